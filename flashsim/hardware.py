"""GPUs as data: the numbers a roofline and a launch model need.

    >>> from flashsim.hardware import A100, H100, PRESETS
    >>> round(H100.ridge)            # FLOP per HBM byte where compute and memory balance
    295
    >>> H100.l2_bytes // 2**20, H100.num_sms, H100.compute_capability
    (50, 132, 90)

Each preset holds vendor datasheet peaks (dense fp16/bf16 tensor-core FLOP/s, HBM
bandwidth), the on-chip sizes from NVIDIA's architecture whitepapers and the CUDA C++
Programming Guide (SMs, shared memory and registers per SM, L2 size and line), and the
sustained rates a time model needs (DRAM and L2 bandwidth as measured on the device, where
one was measured), with a ``source`` string saying where each number comes from.
Peaks are marketing peaks: sustained matmul throughput is typically 70–90 % of them
and sustained bandwidth 80–90 %.

A preset is frozen and checked when built; make your own with `GPU(...)` or
`dataclasses.replace(H100, l2_bytes=...)` (the same checks run).

Units: FLOP/s and bytes/s are decimal (TB/s = 10¹² B/s, as datasheets write them);
on-chip sizes are binary (NVIDIA's "164 KB" of shared memory is 164 KiB = 167,936 B).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

KiB = 2**10
MiB = 2**20


@dataclass(frozen=True, kw_only=True)
class GPU:
    """One GPU, as a launch model and a roofline see it.

    ``peak_flops``: dense fp16/bf16 tensor-core FLOP/s (fp32 accumulate, no sparsity).
    ``hbm_bytes_per_s``: peak HBM (DRAM) bandwidth; ``dram_sustained_bytes_per_s``: what a
    large device-to-device copy reaches (bytes read plus written), the time model's DRAM
    rate. ``l2_bytes_per_s``: sustained L2 bandwidth for reads that hit. ``smem_per_sm``:
    the largest shared memory (the SRAM of the FlashAttention papers) one SM can be
    configured with, carved out of ``l1_smem_per_sm`` (combined L1 data cache and shared
    memory); ``smem_per_block``: the most one thread block may opt in to;
    ``smem_reserved_per_block``: what the runtime keeps per resident block (1 KiB from
    compute capability 8.0 on). ``l2_bytes``: L2 cache size, ``l2_line_bytes`` and
    ``l2_sector_bytes`` its line and sector (the unit DRAM traffic is counted in).
    ``regs_per_sm``, ``max_threads_per_sm``, ``max_blocks_per_sm``: the other limits on
    how many thread blocks an SM holds at once (occupancy). ``l2_partitions``: the L2
    is split into this many partitions; a line lives in its home partition, and an SM
    wired to another one that reads it gets a copy in its own (so data that every SM
    reads is held once per partition). ``link_bytes_per_s``: NVLink bandwidth to a peer,
    one direction (what a ring step's send gets). ``l2_retention`` = (lo, hi) bytes: what the L2
    keeps of a buffer that every SM reads twice in a row — all of it up to lo, none from
    hi, the re-read fraction rising linearly between (fitted to the broadcast probe of
    `analysis/model_vs_hardware.py --probe`); None where unmeasured (the model then takes
    LRUs of ``l2_bytes`` in all).
    """
    name: str
    compute_capability: int
    peak_flops: float
    hbm_bytes_per_s: float
    dram_sustained_bytes_per_s: float
    l2_bytes_per_s: float
    smem_per_sm: int
    l1_smem_per_sm: int
    smem_per_block: int
    num_sms: int
    l2_bytes: int
    source: str
    l2_line_bytes: int = 128
    l2_sector_bytes: int = 32
    regs_per_sm: int = 65536
    max_threads_per_sm: int = 2048
    max_blocks_per_sm: int = 32
    smem_reserved_per_block: int = 1024
    l2_retention: tuple | None = None
    l2_partitions: int = 1
    link_bytes_per_s: float = 450e9

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "l2_retention":
                self._check_retention(value)
                continue
            if f.name in ("name", "source"):
                if not isinstance(value, str) or not value:
                    raise TypeError(f"GPU.{f.name} must be a non-empty string, got {value!r}")
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"GPU.{f.name} must be a number, got {value!r}")
            if f.type == "int" and value != int(value):
                raise TypeError(f"GPU.{f.name} must be a whole number, got {value!r}")
            # an L2 of 0 bytes is a legitimate what-if (every access goes to DRAM)
            if not (value > 0 or (f.name == "l2_bytes" and value == 0)):
                raise ValueError(f"GPU.{f.name} must be positive, got {value!r}")
        if not self.smem_per_block <= self.smem_per_sm <= self.l1_smem_per_sm:
            raise ValueError(
                f"GPU {self.name!r}: need smem_per_block <= smem_per_sm <= l1_smem_per_sm, got "
                f"{self.smem_per_block}, {self.smem_per_sm}, {self.l1_smem_per_sm}")
        if self.l2_retention is not None and self.l2_retention[1] > self.l2_bytes:
            raise ValueError(f"GPU {self.name!r}: l2_retention {self.l2_retention} reaches past "
                             f"l2_bytes ({self.l2_bytes})")
        if self.l2_line_bytes % self.l2_sector_bytes:
            raise ValueError(f"GPU {self.name!r}: l2_line_bytes ({self.l2_line_bytes}) must be a "
                             f"multiple of l2_sector_bytes ({self.l2_sector_bytes})")

    @staticmethod
    def _check_retention(value):
        if value is None:
            return
        if (not isinstance(value, tuple) or len(value) != 2
                or any(isinstance(x, bool) or not isinstance(x, int) for x in value)
                or not 0 <= value[0] <= value[1]):
            raise ValueError(f"GPU.l2_retention must be None or a pair of byte counts "
                             f"(lo, hi) with 0 <= lo <= hi, got {value!r}")

    @property
    def l2_capacities(self) -> tuple[int, ...]:
        """The L2 capacities (all partitions together) `flashsim.hierarchy` averages its
        LRUs over: ``l2_bytes`` alone, or, with ``l2_retention = (lo, hi)``, four with
        partitions of (lo, hi) spread evenly (the midpoints of its quarters). A buffer
        that every SM reads takes room in every partition, so the average re-reads such
        a buffer read twice in the fraction that rises linearly from 0 at lo to 1 at hi,
        as the broadcast probe measures. (The H100's fitted range puts up to 31.25 MB in
        each of its two partitions, more than half its nominal 50 MiB: a broadcast buffer
        is kept a little better than strict halves would allow.)"""
        if self.l2_retention is None:
            return (self.l2_bytes,)
        lo, hi = self.l2_retention
        return tuple(self.l2_partitions * int(lo + (hi - lo) * (k + 0.5) / 4)
                     for k in range(4))

    @property
    def ridge(self) -> float:
        """The roofline's ridge point, peak FLOP/s ÷ peak bytes/s (FLOP per HBM byte):
        a kernel of lower arithmetic intensity is memory-bound, of higher compute-bound."""
        return self.peak_flops / self.hbm_bytes_per_s

    def bound(self, intensity: float) -> str:
        """'memory' or 'compute': which roof limits a kernel of this intensity."""
        return "compute" if intensity >= self.ridge else "memory"

    @property
    def smem_total(self) -> int:
        """Shared memory over all SMs, bytes."""
        return self.smem_per_sm * self.num_sms


A100 = GPU(
    name="A100 SXM4 80GB",
    compute_capability=80,
    peak_flops=312e12,
    hbm_bytes_per_s=2.039e12,
    dram_sustained_bytes_per_s=0.9 * 2.039e12,
    l2_bytes_per_s=5120 * 1.41e9,
    smem_per_sm=164 * KiB,
    l1_smem_per_sm=192 * KiB,
    smem_per_block=163 * KiB,
    num_sms=108,
    l2_bytes=40 * MiB,
    l2_partitions=2,
    link_bytes_per_s=300e9,
    source=("NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM: 312 TFLOPS FP16/BF16 "
            "tensor core dense (624 with sparsity), 2,039 GB/s HBM2e (the 40GB part has "
            "1,555 GB/s, ridge 200.6 FLOP/B); NVIDIA A100 Tensor Core GPU Architecture "
            "whitepaper and CUDA C++ Programming Guide (compute capability 8.0): 108 SMs, "
            "192 KB combined L1/shared memory per SM of which up to 164 KB shared, 163 KB "
            "per thread block, 64K registers and 2048 threads per SM, 40 MB L2 of 128-byte "
            "lines in 32-byte sectors in two partitions, each caching data for the SMs of "
            "the GPCs wired to it, NVLink 600 GB/s (300 each way), L2 reads 5120 bytes/clock at the 1410 MHz boost "
            "clock; sustained DRAM taken as 90% of peak (not measured here)"),
)

H100 = GPU(
    name="H100 SXM5 80GB",
    compute_capability=90,
    peak_flops=989.4e12,
    hbm_bytes_per_s=3.35e12,
    dram_sustained_bytes_per_s=3.0e12,
    l2_bytes_per_s=6.65e12,
    smem_per_sm=228 * KiB,
    l1_smem_per_sm=256 * KiB,
    smem_per_block=227 * KiB,
    num_sms=132,
    l2_bytes=50 * MiB,
    l2_retention=(25_250_000, 31_250_000),
    l2_partitions=2,
    source=("NVIDIA H100 Tensor Core GPU datasheet, H100 SXM: 1,979 TFLOPS FP16/BF16 tensor "
            "core with sparsity = 989.4 dense, 3.35 TB/s HBM3; NVIDIA H100 Tensor Core GPU "
            "Architecture whitepaper and CUDA C++ Programming Guide (compute capability "
            "9.0): 132 SMs, 256 KB combined L1/shared memory per SM of which up to 228 KB "
            "shared, 227 KB per thread block, 64K registers and 2048 threads per SM, 50 MB "
            "L2 of 128-byte lines in 32-byte sectors in two partitions (as the A100's); NVLink "
            "900 GB/s (450 each way); measured on an H100 80GB HBM3 here: "
            "a device-to-device copy moves 3.0 TB/s (read plus written), L2 read hits "
            "at 7.0 TB/s"),
)

H200 = GPU(
    name="H200 SXM 141GB",
    compute_capability=90,
    peak_flops=989.4e12,
    hbm_bytes_per_s=4.8e12,
    dram_sustained_bytes_per_s=4.3e12,
    l2_bytes_per_s=7.06e12,
    smem_per_sm=228 * KiB,
    l1_smem_per_sm=256 * KiB,
    smem_per_block=227 * KiB,
    num_sms=132,
    l2_bytes=60 * MiB,
    l2_partitions=2,
    source=("NVIDIA H200 Tensor Core GPU datasheet, H200 SXM: 1,979 TFLOPS FP16/BF16 tensor "
            "core with sparsity = 989.4 dense, 4.8 TB/s HBM3e, 141 GB; the GH100 SM "
            "configuration of H100 SXM (compute capability 9.0): 132 SMs, 256 KB combined "
            "L1/shared memory per SM of which up to 228 KB shared, 227 KB per thread "
            "block, NVLink 900 GB/s (450 each way); L2 60 MB as the device reports it (cudaDevAttrL2CacheSize, read on an "
            "H200 here), in two partitions as the H100's; measured on an H200 here "
            "(analysis/model_vs_hardware.py --probe, 2026-11-23): a device-to-device copy "
            "moves 4.3 TB/s, reads that hit L2 7.06 TB/s, a buffer that each SM reads alone "
            "is kept whole up to 38.5 MB and not at all from 52.75 MB; what it keeps of a "
            "buffer every SM reads was not measured, so l2_retention is left unset (the "
            "model takes the nominal 60 MiB)"),
)

PRESETS: dict[str, GPU] = {"A100": A100, "H100": H100, "H200": H200}


def get(hardware) -> GPU:
    """A `GPU` from a preset name ("H100", case-insensitive) or a `GPU` itself."""
    if isinstance(hardware, GPU):
        return hardware
    if isinstance(hardware, str):
        for name, gpu in PRESETS.items():
            if hardware.strip().upper() == name:
                return gpu
        raise ValueError(f"unknown hardware {hardware!r}; use one of {', '.join(PRESETS)} "
                         "or a flashsim.hardware.GPU")
    raise TypeError(f"hardware must be a preset name ({', '.join(PRESETS)}) or a "
                    f"flashsim.hardware.GPU, got {hardware!r}")

__all__ = ["GPU", "A100", "H100", "H200", "PRESETS", "get"]
