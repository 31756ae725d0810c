"""Peak numbers of a few data-centre GPUs, for roofline arithmetic.

    >>> from flashsim.hardware import A100, H100, PRESETS
    >>> round(H100.ridge)            # FLOP per HBM byte where compute and memory balance
    295

Each preset holds vendor datasheet peaks (dense fp16/bf16 tensor-core FLOP/s, HBM
bandwidth) and the on-chip sizes from NVIDIA's architecture whitepapers and the CUDA
C++ Programming Guide (shared memory per SM, SMs, L2), with a ``source`` string saying
where each number comes from. Peaks are marketing peaks: sustained matmul throughput is
typically 70–90 % of them and sustained bandwidth 80–90 %.

Units: FLOP/s and bytes/s are decimal (TB/s = 10¹² B/s, as datasheets write them);
on-chip sizes are binary (NVIDIA's "164 KB" of shared memory is 164 KiB = 167,936 B).
"""

from __future__ import annotations

from dataclasses import dataclass

KiB = 2**10
MiB = 2**20


@dataclass(frozen=True)
class GPU:
    """Peak numbers of one GPU.

    ``peak_flops``: dense fp16/bf16 tensor-core FLOP/s (fp32 accumulate, no sparsity).
    ``hbm_bytes_per_s``: peak HBM bandwidth. ``smem_per_sm``: the largest shared memory
    (the SRAM of the FlashAttention papers) one SM can be configured with, carved out of
    ``l1_smem_per_sm`` (combined L1 data cache and shared memory). ``smem_per_block``:
    the most one thread block may opt in to. ``l2_bytes``: L2 cache size.
    """
    name: str
    peak_flops: float
    hbm_bytes_per_s: float
    smem_per_sm: int
    l1_smem_per_sm: int
    smem_per_block: int
    num_sms: int
    l2_bytes: int
    source: str

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
    peak_flops=312e12,
    hbm_bytes_per_s=2.039e12,
    smem_per_sm=164 * KiB,
    l1_smem_per_sm=192 * KiB,
    smem_per_block=163 * KiB,
    num_sms=108,
    l2_bytes=40 * MiB,
    source=("NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM: 312 TFLOPS FP16/BF16 "
            "tensor core dense (624 with sparsity), 2,039 GB/s HBM2e (the 40GB part has "
            "1,555 GB/s, ridge 200.6 FLOP/B); NVIDIA A100 Tensor Core GPU Architecture "
            "whitepaper and CUDA C++ Programming Guide (compute capability 8.0): 108 SMs, "
            "192 KB combined L1/shared memory per SM of which up to 164 KB shared, 163 KB "
            "per thread block, 40 MB L2"),
)

H100 = GPU(
    name="H100 SXM5 80GB",
    peak_flops=989.4e12,
    hbm_bytes_per_s=3.35e12,
    smem_per_sm=228 * KiB,
    l1_smem_per_sm=256 * KiB,
    smem_per_block=227 * KiB,
    num_sms=132,
    l2_bytes=50 * MiB,
    source=("NVIDIA H100 Tensor Core GPU datasheet, H100 SXM: 1,979 TFLOPS FP16/BF16 tensor "
            "core with sparsity = 989.4 dense, 3.35 TB/s HBM3; NVIDIA H100 Tensor Core GPU "
            "Architecture whitepaper and CUDA C++ Programming Guide (compute capability "
            "9.0): 132 SMs, 256 KB combined L1/shared memory per SM of which up to 228 KB "
            "shared, 227 KB per thread block, 50 MB L2"),
)

H200 = GPU(
    name="H200 SXM 141GB",
    peak_flops=989.4e12,
    hbm_bytes_per_s=4.8e12,
    smem_per_sm=228 * KiB,
    l1_smem_per_sm=256 * KiB,
    smem_per_block=227 * KiB,
    num_sms=132,
    l2_bytes=50 * MiB,
    source=("NVIDIA H200 Tensor Core GPU datasheet, H200 SXM: 1,979 TFLOPS FP16/BF16 tensor "
            "core with sparsity = 989.4 dense, 4.8 TB/s HBM3e, 141 GB; the same GH100 "
            "configuration as H100 SXM (compute capability 9.0): 132 SMs, 256 KB combined "
            "L1/shared memory per SM of which up to 228 KB shared, 227 KB per thread "
            "block, 50 MB L2"),
)

PRESETS: dict[str, GPU] = {"A100": A100, "H100": H100, "H200": H200}

__all__ = ["GPU", "A100", "H100", "H200", "PRESETS"]
