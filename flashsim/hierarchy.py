"""Three levels: each SM's SRAM, one L2 shared by all SMs, and DRAM (HBM), driven by a
kernel's real launch.

`fs.count` counts what moves between one SM's SRAM and the memory behind it. On a GPU
that traffic goes to L2, and only L2 misses reach DRAM. This module predicts the DRAM
bytes from the launch:

1. **The launch** (`Launch`, from the table in `flashsim.kernels`): the kernel, its grid,
   which tile each blockIdx takes (natural or reversed order; under a band the copy-engine
   kernels' tiles go out in chunks of problems, `kernels.ws_order`), and how many CTAs an SM
   holds (the CUDA occupancy rules over threads, registers and shared memory), so
   ``slots = SMs × CTAs per SM`` run at once.
2. **The CTAs' programs**: the tile moves of the simulator's schedule, CTA by CTA — for
   the forward, Q tile i reads Q_i, then K_j, V_j for each visited j (the same
   `Tiles.kv_ranges` the simulator's loops walk), then writes O_i, L_i; for the backward's
   main kernel, K/V tile j reads K_j, V_j, then Q_i, dO_i, L_i, D_i and adds into dQacc_i
   for each visited i (`Tiles.q_ranges`), then writes dK_j, dV_j; the pre- and post-pass
   one tile each. A kernel's atomics (the backward's dQacc) are *reductions*, performed in
   L2: one SM→L2 transfer, where the two-level count has a read and a write.
3. **Dispatch**: CTAs start in blockIdx order (x fastest) on the first free slot; every
   running CTA advances one inner step (one visited tile pair) per time unit, so a CTA of
   n steps started at t runs over [t, t + n). This is the lockstep a GPU shows when its
   CTAs do equal work per step.
4. **The L2**: ``hardware.l2_partitions`` partitions, each least recently used,
   write-back and write-allocate (a write fills its bytes without reading DRAM; a
   reduction that misses first reads them from DRAM), fed by the accesses of the CTAs
   running at each time unit, in time order (CTAs in launch order within a time unit,
   each CTA's moves in program order: prologue reads, inner step, epilogue writes). Each
   entry has a home partition, which reads it from DRAM, performs its reductions and
   writes it back; an SM wired to another partition that reads it also keeps a copy
   there, so data that every SM reads (K and V of a head) takes room in every partition,
   as NVIDIA describes the A100's and H100's L2 ("each partition localizes and caches
   data for memory accesses from SMs in the GPCs directly connected to the partition").
   Slot k of the dispatch is on SM k mod SMs, and SM s is wired to partition s mod
   partitions. Entries are whole tiles: the tile of one problem's rows that a CTA moves at
   once (Q_i; K_j with V_j; Q_i, dO_i, L_i, D_i; dQacc_i), always accessed together. A
   read misses to DRAM when its home partition lacks the bytes; an evicted entry that was
   written is written back to DRAM. Writes still in L2 when the kernel ends reach DRAM
   after it (``writeback``): Nsight Compute counts only what moves during the launch,
   which is ``levels["L2-DRAM"]``. L2 starts empty, as after Nsight Compute's
   ``--cache-control all``. Where the preset gives ``l2_retention`` (what the L2 keeps of
   a buffer that every SM reads twice, measured), the counts are the average over LRUs
   whose partition sizes are spread evenly over that range; else the partitions share
   ``l2_bytes``.

Identical accesses by CTAs that start together (same problem, same first tile) arrive in
the same time unit and are folded into one access with a multiplicity: the repeats hit,
exactly as the serialised LRU would have them. Where a launch would still need more than
``max_events`` accesses (one head at N = 2¹⁸ under a causal mask has ~2·10⁶), G
consecutive tiles of the streamed tensor (K/V in the forward, the Q-side tiles in the
backward) form one L2 entry, which tracks which of its tiles are loaded: a CTA's access to
the entry happens when it enters it, and misses only on the tiles not yet loaded. G is
the smallest power of two that fits and is reported (``superblock``); G = 1 is the exact
tile-by-tile LRU, and the error of G > 1 is at most G steps of reuse distance.

Each partition sees a fixed sequence of accesses (every read of what it owns, its own
SMs' reads of the rest, the writes and reductions it owns), so DRAM traffic never rises
as the L2 grows, never falls below the compulsory bytes, equals them when the L2 holds
everything, and equals the two-level count when it holds nothing (`tests/
test_hierarchy.py`). `analysis/model_vs_hardware.py` holds the model against Nsight
Compute on an H100 and an H200.

Time (`LaunchPrediction.time_s`), stated as a formula:

    t = max(t_compute, t_DRAM, t_L2)
    t_compute = makespan · F_step / (η · peak_flops / (SMs · CTAs per SM))
    t_DRAM    = (DRAM bytes read + written during the launch) / dram_sustained_bytes_per_s
    t_L2      = (SM↔L2 bytes) / l2_bytes_per_s

where makespan is the dispatch's length in inner steps, F_step the FLOPs of one full
inner step (forward 2·Br·Bc·(d + dv), backward 2·Br·Bc·(3d + 2dv)), and η the fraction
of the tensor cores' peak the kernel's inner loop sustains (`EFFICIENCY`, measured once
per kernel and head dim on an H100 at one size and held fixed). The pre- and post-pass do
no matrix products: their time is the larger of the two memory terms.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from . import kernels as K
from .hardware import GPU, get as get_hardware
from .problem import STAT_BYTES, Shape, canon_batch, itemsize_of
from .tiling import Tiles
from .traffic import Traffic, format_table

LEVELS = ("SM-L2", "L2-DRAM", "compulsory")
READ, WRITE, REDUCE = "read", "write", "reduce"
MAX_EVENTS = 300_000

# η: the fraction of peak_flops one SM sustains in the kernel's inner loop, measured on an
# NVIDIA H100 80GB HBM3 on 2026-11-23 (ncu's gpu__time_duration, L2 flushed, float16; the
# rows marked calib in analysis/out/model_vs_hardware.md: N = 16384, 8 heads, no mask, and
# the reference rung at N = 4096, 4 heads, d = 64), keyed by (kernel, d); the reference
# kernels' η is the same for every d.
EFFICIENCY = {
    ("flash2_fwd_wg", 64): 0.410, ("flash2_fwd_wg", 128): 0.485,
    ("flash2_fwd_tc", 64): 0.334, ("flash2_fwd_tc", 128): 0.394,
    ("flash2_bwd_tc", 64): 0.251, ("flash2_bwd_tc", 128): 0.288,
    ("flash2_bwd_tc_det", 64): 0.206, ("flash2_bwd_tc_det", 128): 0.240,
    # the Hopper backward: not yet measured with ncu; the tc rows scaled by the two
    # kernels' TFLOP/s in one benchmark run (H100, float16, N = 16384, no mask:
    # analysis/bench_attention.py, wg / tc = 316 / 233 at d = 64, 337 / 268 at d = 128);
    # its deterministic mode 0.82 of that (do_bench there: 0.85 at d = 64, 0.82 at 128)
    ("flash2_bwd_wg", 64): 0.341, ("flash2_bwd_wg", 128): 0.363,
    ("flash2_bwd_wg_det", 64): 0.280, ("flash2_bwd_wg_det", 128): 0.302,
    # its D = 256 instance (wg_bwd.cuh's step_wide), the same way: 219.7 TF/s at d = 256,
    # N = 4096 (analysis/out/bench/wg_bwd256.json) over the wg backward's 297 at d = 128
    # (head_dims.json: another process on the same device), 0.269, then by 227.6 / 219.7
    # once L_i, D_i were read a step ahead (wg_bwd_wide.json); det by wg's det / plain at 128
    ("flash2_bwd_wg", 256): 0.279, ("flash2_bwd_wg_det", 256): 0.232,
    # its D = 192 instance (step_wide on 32-column blocks), the same way: 208.8 TF/s at
    # d = 192, N = 4096 against D = 256's 227.6 in one run (wg_bwd_wide.json)
    ("flash2_bwd_wg", 192): 0.256, ("flash2_bwd_wg_det", 192): 0.213,
    # its D = 32 instance, the same way: at d = 32, N = 16384, float16, 183.4 TF/s against
    # the D = 64 instance's 185.2 in one run (kernels_cu/NOTES.md v26), whose η at d = 32
    # is 0.341 · 64/128; det by wg's det / plain at 64
    ("flash2_bwd_wg", 32): 0.169, ("flash2_bwd_wg_det", 32): 0.139,
    # the same scaling by measured TFLOP/s (H100, float16, no mask): the ws forward from
    # wg's 0.485 by ws / wg = 569 / 399 at N = 16384 (analysis/out/bench/ws_fwd.md); the
    # D = 256 instances from ws at d = 128 and the wg backward at d = 128 in one run at
    # N = 4096 (analysis/out/bench/head_dims.json: forward wg(256) / ws(128) = 395 / 459,
    # backward tc(256) / wg(128) = 156 / 297), the deterministic one by tc's det / plain
    # at 128. The tc forward at 256 (which `auto` does not run on 9.0) is not measured.
    ("flash2_fwd_ws", 128): 0.693, ("flash2_fwd_wg", 256): 0.596,
    ("flash2_bwd_tc", 256): 0.191, ("flash2_bwd_tc_det", 256): 0.159,
    # the tc backward's D = 192 instance, the same way: 167 TF/s at d = 192, N = 4096
    # (analysis/out/bench/head_dims_bwd192.json) over the wg backward's 297 at d = 128
    # above (head_dims.json: another process on the same device)
    ("flash2_bwd_tc", 192): 0.204, ("flash2_bwd_tc_det", 192): 0.170,
    # the wg forward's D = 32 and D = 96 instances, the same way, from ws at d = 128 in
    # one run at N = 4096 (analysis/out/bench/head_dims_wg32_96.json: 234 and 305 TF/s
    # against 435)
    ("flash2_fwd_wg", 32): 0.374, ("flash2_fwd_wg", 96): 0.486,
    # its D = 192 instance: 256's 0.596 at d = 192 (0.447 of the instance's peak) by the
    # two instances' TF/s at d = 192, N = 4096, float16, no mask: 344 (analysis/out/bench/
    # wg_fwd192.json) over 326 (head_dims.json; another process on the same device)
    ("flash2_fwd_wg", 192): 0.472,
    # the copy-engine forward at D = 64 and 96 (their own runs at N = 4096: at 64 with three
    # consumers, analysis/out/bench/ws64_c3.json, 380 TF/s; at 96 ws_64_96.json, 408)
    # against that ws at 128
    ("flash2_fwd_ws", 64): 0.605, ("flash2_fwd_ws", 96): 0.650,
    # the backward fed by the copy engine at d = 128 from wg's 0.363 by ws / wg = 379 / 333
    # (one process, H100, float16, N = 16384, no mask: kernels_cu/NOTES.md v23); its
    # deterministic mode keeps wg_det's atomics in turns and is taken at wg_det's η (not
    # measured apart)
    # its D = 64 instance from wg's 0.341 at 64 by wg / ws time = 17.31 / 16.69 ms (one
    # process, H100, float16, N = 16384, no mask, the mean of two interleaved replays each:
    # kernels_cu/NOTES.md v41); det at wg_det's η, as at 128. Then both plain instances by
    # v41 / v42 time (the mask behind one branch; one process, H100, float16, N = 16384,
    # no mask, the mean of two replays: 17.03 / 11.62 ms at 64, 12.20 / 10.76 at 128,
    # NOTES v42). v42 runs in flash2_bwd_wg and the det kernels too, whose η are v41's
    # (not re-measured).
    ("flash2_bwd_ws", 128): 0.469, ("flash2_bwd_ws_det", 128): 0.302,
    ("flash2_bwd_ws", 64): 0.519, ("flash2_bwd_ws_det", 64): 0.280,
    # the wg D = 160 and 224 instances (wgmma.cuh's Parts) from D = 192 and 256 by their
    # TF/s at d = D, N = 4096, float16, no mask (analysis/out/bench/hopper_v31.json against
    # head_dims.json: another process on the same device): forward 351 / 367 and 370 / 440,
    # backward 200 / 204 and 211 / 226; det by 192's and 256's det / plain
    ("flash2_fwd_wg", 160): 0.452, ("flash2_fwd_wg", 224): 0.501,
    ("flash2_bwd_wg", 160): 0.251, ("flash2_bwd_wg_det", 160): 0.209,
    ("flash2_bwd_wg", 224): 0.261, ("flash2_bwd_wg_det", 224): 0.217,
    ("flash2_fwd", None): 0.00090, ("flash2_bwd_main", None): 0.00090,
}


# -- traffic by level ---------------------------------------------------------------------

class Levels:
    """Traffic at each level of the memory, by tensor and kind (read, write, reduce):

    - ``"SM-L2"``: what the SMs move to and from L2 (the two-level model's traffic, with a
      kernel's atomics as reductions);
    - ``"L2-DRAM"``: what L2 reads from and writes to DRAM during the launch (what Nsight
      Compute's dram__bytes counters show);
    - ``"compulsory"``: each distinct byte the launch touches, read (or written) once.

    ``==`` compares every level, ``+`` adds level by level, ``table()`` prints them side
    by side.
    """

    __slots__ = ("_levels",)

    def __init__(self, levels: dict[str, Traffic]):
        for name, t in levels.items():
            if not isinstance(t, Traffic):
                raise TypeError(f"level {name!r} must be a Traffic, got {t!r}")
        self._levels = dict(levels)

    def __getitem__(self, level: str) -> Traffic:
        try:
            return self._levels[level]
        except KeyError:
            raise KeyError(f"no level {level!r}; levels are {', '.join(self._levels)}") from None

    def __iter__(self):
        return iter(self._levels)

    def __len__(self):
        return len(self._levels)

    def items(self):
        return self._levels.items()

    @property
    def sm_l2(self) -> Traffic:
        return self._levels["SM-L2"]

    @property
    def dram(self) -> Traffic:
        return self._levels["L2-DRAM"]

    @property
    def compulsory(self) -> Traffic:
        return self._levels["compulsory"]

    def __eq__(self, other):
        if not isinstance(other, Levels):
            return NotImplemented
        return self._levels == other._levels

    def __hash__(self):
        return hash(tuple(sorted(self._levels.items())))

    def __add__(self, other: "Levels") -> "Levels":
        if not isinstance(other, Levels):
            return NotImplemented
        names = list(dict.fromkeys([*self._levels, *other._levels]))
        return Levels({n: self._levels.get(n, Traffic()) + other._levels.get(n, Traffic())
                       for n in names})

    def table(self, unit: str = "auto") -> str:
        return format_table({_LABELS.get(n, n): t for n, t in self._levels.items()}, unit=unit)

    def __str__(self):
        return self.table()

    def __repr__(self):
        return f"Levels({self._levels!r})"

    def to_dict(self) -> dict:
        return {n: t.to_dict() for n, t in self._levels.items()}


_LABELS = {"SM-L2": "SM↔L2", "L2-DRAM": "L2↔DRAM"}


# -- the launch -------------------------------------------------------------------------

@dataclass(frozen=True)
class Launch:
    """One kernel launch on one GPU: its grid, which tile each CTA takes and how many CTAs
    run at once. Built from the kernel table (`flashsim.kernels.LAUNCH_SPECS`) by
    `launches`; ``Br``, ``Bc`` are the schedule's tiles, ``rows`` those of the tile a CTA
    covers along the grid's x axis."""
    kernel: str
    phase: str
    over: str
    order: str
    grid: tuple[int, int]
    threads: int
    registers: int
    smem_bytes: int
    ctas_per_sm: int
    Br: int
    Bc: int
    rows: int
    reduces: tuple
    hardware: GPU = field(repr=False)

    @property
    def ctas(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def slots(self) -> int:
        """CTAs running at once over the whole GPU."""
        return self.hardware.num_sms * self.ctas_per_sm

    @property
    def waves(self) -> float:
        return self.ctas / self.slots

    def tile_of(self, bx):
        """The tile index blockIdx.x = ``bx`` works on (NumPy arrays welcome)."""
        return self.grid[0] - 1 - bx if self.order == "reversed" else bx


def dtype_name(io_dtype) -> str:
    """'float16', 'bfloat16', 'float32' or 'float64' for an I/O type (names, aliases and
    NumPy dtypes), as the kernels are built for."""
    if isinstance(io_dtype, str):
        key = io_dtype.strip().lower().replace("torch.", "")
        key = {"fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp32": "float32",
               "float": "float32", "single": "float32", "fp64": "float64",
               "double": "float64"}.get(key, key)
        if key in K.CUDA_TYPES:
            return key
    else:
        name = str(getattr(io_dtype, "name", io_dtype)).replace("torch.", "")
        if name in K.CUDA_TYPES:
            return name
    raise ValueError(f"the kernels run float16, bfloat16, float32 and float64; io_dtype "
                     f"{io_dtype!r} has no kernel (itemsize {itemsize_of(io_dtype)})")


RUNGS = ("auto", "wg", "tc", "ref")


def choose_kernel(launch: str, shape: Shape, dtype: str, hw: GPU, block_sizes=None,
                  backward: bool = False, variant: bool = False) -> str:
    """The rung the project's kernels would take on ``hw``: "wg", "tc" or "ref" (the same
    rules as `flashsim.gpu`'s kernel="auto", from `flashsim.kernels`; ``variant``: softcap
    or ALiBi, whose instances may have their own tiles)."""
    if launch not in RUNGS:
        raise ValueError(f"launch must be one of {RUNGS}, got {launch!r}")
    cc, limit, d, dv = hw.compute_capability, hw.smem_per_block, shape.d, shape.dv
    if launch in ("auto", "wg") and K.wg_supports(d, dv, dtype, cc, limit, block_sizes,
                                                  backward, variant):
        return "wg"
    if launch == "wg":
        raise ValueError(f"the Hopper kernel runs float16/bfloat16, d and dv multiples of "
                         f"8 up to {max(K.WG_BWD_HEAD_DIMS if backward else K.WG_HEAD_DIMS)}, tiles {K.WG_BWD_BLOCKS if backward else K.WG_BLOCKS}, on compute capability 9.0 "
                         f"({hw.name} is {cc / 10:.1f}); got {dtype}, d={d}, dv={dv}, "
                         f"block_sizes={block_sizes}")
    if launch in ("auto", "tc") and K.tc_supports(d, dv, dtype, cc, limit, block_sizes, backward,
                                                  variant):
        return "tc"
    if launch == "tc":
        raise ValueError(f"the tensor-core kernel runs float16/bfloat16, d and dv "
                         f"multiples of 8 up to {max(K.TC_HEAD_DIMS)}, its own tiles, on compute capability 8.0 or "
                         f"later; got {dtype}, d={d}, dv={dv}, block_sizes={block_sizes} "
                         f"on {hw.name}")
    return "ref"


def kernel_tiles(rung: str, shape: Shape, dtype: str, hw: GPU, block_sizes=None,
                 backward: bool = False, variant: bool = False) -> tuple[int, int]:
    """(Br, Bc) the rung runs with: its fixed tiles (``variant``: those of its softcap/ALiBi
    instance), or for "ref" ``block_sizes`` (default: the largest square tile whose CTA
    fits the device's shared memory)."""
    cc = hw.compute_capability
    if rung in ("tc", "wg"):                       # the fast rungs' instance
        D = K.instance_dim(rung, shape.d, shape.dv, backward, cc // 10)
        if rung == "wg":
            if _copy_engine_forward(shape, block_sizes, backward, variant):
                return K.ws_blocks(D, variant)
            return K.wg_blocks(D, backward)
        if backward:
            return K.tc_bwd_blocks(D, cc // 10)
        return K.tc_blocks(D, cc // 10, variant or K.padded(shape.d, shape.dv, D))
    if block_sizes is not None:
        Br, Bc = (int(x) for x in block_sizes)
        kernel = "flash2_bwd_main" if backward else "flash2_fwd"
        need = K.smem_bytes(kernel, Br, Bc, shape.d, shape.dv, dtype)
        if need > hw.smem_per_block:
            raise ValueError(f"{kernel} with Br={Br}, Bc={Bc}, d={shape.d} ({dtype}) needs "
                             f"{need} bytes of shared memory; {hw.name} allows "
                             f"{hw.smem_per_block}. Use smaller block_sizes.")
        return Br, Bc
    return K.default_block_sizes(shape.d, shape.dv, dtype, hw.smem_per_block, backward)


def _copy_engine_forward(shape: Shape, block_sizes, backward: bool,
                         variant: bool = False) -> bool:
    """The Hopper rung's forward of these head dims (``variant``: with softcap or ALiBi)
    is flash2_fwd_ws (fed by the copy engine, kernels.ws_runs) with ``block_sizes`` (None:
    its own tiles)."""
    D = K.instance_dim("wg", shape.d, shape.dv, backward)
    return (not backward and K.ws_runs(shape.d, shape.dv, D, backward, variant)
            and (block_sizes is None or tuple(block_sizes) == K.ws_blocks(D, variant)))


def softmax_rule(shape: Shape, io_dtype, hardware, *, launch: str = "auto", block_sizes=None,
                 softcap=None, alibi_slopes=None) -> str:
    """The rule for the softmax's m (`flashsim.running_max`) of the forward the project's
    kernel ``launch`` runs on ``hardware``: the copy-engine forward's softcap instance
    (kernels.cap_only: a softcap, with ALiBi or without, in bfloat16; a softcap or ALiBi
    in float16, ALiBi at kernels.diagonal_first's D) runs "fixed" in bfloat16 and "lazy"
    in float16, as do the cp.async forward's (kernels.wg_cap) and the mma.sync
    forward's (kernels.tc_cap; in float16 without ALiBi); the copy-engine forward's lazy
    instance in bfloat16 (kernels.ws_lazy) "lazy"; every other launch "online"
    (`flashsim.gpu.softmax_max` on a real device)."""
    hw = get_hardware(hardware)
    dtype = dtype_name(io_dtype)
    variant = softcap is not None or alibi_slopes is not None
    D = K.instance_dim("wg", shape.d, shape.dv, False)
    if (variant and K.ws_lazy(dtype, softcap, alibi_slopes, D)
            and choose_kernel(launch, shape, dtype, hw, block_sizes, False, variant) == "wg"
            and _copy_engine_forward(shape, block_sizes, False, variant)):
        return "lazy"
    if not (variant and K.cap_only(dtype, softcap, alibi_slopes, D)):
        return "online"
    rung = choose_kernel(launch, shape, dtype, hw, block_sizes, False, variant)
    if rung == "tc":             # (cap_only's D matters for float16's ALiBi alone,
        # which this rung runs online)
        D = K.instance_dim("tc", shape.d, shape.dv, False, hw.compute_capability // 10)
        if not K.tc_cap(dtype, D, alibi_slopes):
            return "online"
    elif rung != "wg":
        return "online"
    elif not (_copy_engine_forward(shape, block_sizes, False, variant)
              or K.wg_cap(dtype, D, alibi_slopes)):
        return "online"          # flash2_fwd_wg, without a softcap instance here
    return "fixed" if dtype == "bfloat16" else "lazy"


def _copy_engine_backward(shape: Shape) -> bool:
    """The Hopper rung's backward main loop of these head dims is flash2_bwd_ws (fed by
    the copy engine, kernels.ws_runs), with flash2_bwd_wg's tiles."""
    D = K.instance_dim("wg", shape.d, shape.dv, True)
    return K.ws_runs(shape.d, shape.dv, D, backward=True)


def _instance_of(kernel: str, d: int, dv: int, cc: int = 90) -> int | None:
    """D of the template instance ``kernel`` runs head dims d, dv on (None: a reference
    kernel, which takes any d): the pre-pass's, the backward's or the forward's."""
    if kernel == "flash2_bwd_preprocess_tc":
        return K.pre_instance(d, dv)
    if not kernel.endswith(("_tc", "_wg", "_ws", "_tc_det", "_wg_det", "_ws_det")):
        return None
    rung = "wg" if "_wg" in kernel or "_ws" in kernel else "tc"
    return K.instance_dim(rung, d, dv, kernel.startswith("flash2_bwd"), cc // 10)


def _make_launch(kernel: str, shape: Shape, dtype: str, hw: GPU, Br: int, Bc: int) -> Launch:
    spec = K.LAUNCH_SPECS[kernel]
    cc = hw.compute_capability
    D = _instance_of(kernel, shape.d, shape.dv, cc)   # the instance's head dim (or None)
    smem = K.smem_bytes(kernel, Br, Bc, D or shape.d, D or shape.dv, dtype)
    threads = K.threads(kernel, D or shape.d, cc)
    regs = K.registers(kernel, D, cc)
    occ = K.ctas_per_sm(threads=threads, registers=regs, smem=smem,
                        regs_per_sm=hw.regs_per_sm, max_threads_per_sm=hw.max_threads_per_sm,
                        max_blocks_per_sm=hw.max_blocks_per_sm, smem_per_sm=hw.smem_per_sm,
                        smem_reserved_per_block=hw.smem_reserved_per_block)
    if occ < 1:
        raise ValueError(f"{kernel} (Br={Br}, Bc={Bc}, d={shape.d}, {dtype}) does not fit one "
                         f"SM of {hw.name}: {smem} bytes of shared memory, {threads} threads "
                         f"of {regs} registers")
    return Launch(kernel=kernel, phase=spec.phase, over=spec.over, order=spec.order,
                  grid=K.grid(kernel, shape.Nq, shape.Nk, Br, Bc, shape.problems),
                  threads=threads, registers=regs, smem_bytes=smem, ctas_per_sm=occ, Br=Br,
                  Bc=Bc, rows=K.grid_rows(kernel, Br, Bc), reduces=spec.reduces, hardware=hw)


def launches(shape: Shape, io_dtype, hardware, *, backward: bool = False,
             launch: str = "auto", block_sizes=None, deterministic: bool = False,
             variant: bool = False) -> tuple[Launch, ...]:
    """The launches the project's kernels make for this problem on ``hardware``: the
    forward (one kernel) or the backward (pre-pass, main kernel, post-pass); ``variant``:
    with softcap or ALiBi (the instances that run them may have their own tiles)."""
    hw = get_hardware(hardware)
    dtype = dtype_name(io_dtype)
    rung = choose_kernel(launch, shape, dtype, hw, block_sizes, backward, variant)
    Br, Bc = kernel_tiles(rung, shape, dtype, hw, block_sizes, backward, variant)
    if not backward:
        name = {"wg": "flash2_fwd_wg", "tc": "flash2_fwd_tc", "ref": "flash2_fwd"}[rung]
        if rung == "wg" and _copy_engine_forward(shape, block_sizes, backward, variant):
            # the forward fed by the copy engine, as flashsim.gpu launches it for rows TMA
            # can address (a dense layout: the model's), with its own tiles
            name = "flash2_fwd_ws"
        return (_make_launch(name, shape, dtype, hw, Br, Bc),)
    if rung in ("tc", "wg"):
        # the backward fed by the copy engine, as flashsim.gpu launches it for rows TMA
        # can address, with the same tiles
        main = "ws" if rung == "wg" and _copy_engine_backward(shape) else rung
        names = ("flash2_bwd_preprocess_tc",
                 f"flash2_bwd_{main}_det" if deterministic else f"flash2_bwd_{main}")
    else:
        names = ("flash2_bwd_preprocess", "flash2_bwd_main")
    names += ("flash2_bwd_postprocess",)
    return tuple(_make_launch(n, shape, dtype, hw, Br, Bc) for n in names)


# -- the CTAs' programs ---------------------------------------------------------------------

@dataclass(frozen=True)
class Stream:
    """Tensors a CTA always moves together, tile by tile: one L2 entry per (problem,
    tile). ``parts`` are (tensor, kind, bytes per row); a tile has B rows, the last of a
    tensor of N rows N − t·B."""
    name: str
    parts: tuple
    B: int
    N: int

    def rows(self, t):
        return np.minimum(self.B, self.N - np.asarray(t, np.int64) * self.B)

    @property
    def row_bytes(self) -> int:
        return sum(b for _, _, b in self.parts)

    def bytes_of(self, kinds) -> int:
        """Bytes per row of the parts of these kinds."""
        return sum(b for _, k, b in self.parts if k in kinds)


@dataclass
class Access:
    """A stream's tile accessed once by each CTA (``active`` ones), in its prologue or
    epilogue; ``problem`` is the address-space problem (K/V's under GQA)."""
    stream: Stream
    problem: np.ndarray
    tile: np.ndarray
    active: np.ndarray


@dataclass
class Program:
    """Every CTA's tile moves, CTAs in launch order: ``prologue`` accesses at its first
    step, ``n`` inner steps over tiles lo, lo + 1, …, lo + n − 1 of each stream in
    ``inner`` (problem ``inner_problem``), ``epilogue`` accesses at its last step. A CTA
    with no inner step takes one time unit."""
    prologue: list
    inner: tuple          # the streams every inner step moves (same tile index)
    inner_problem: np.ndarray
    lo: np.ndarray
    n: np.ndarray
    epilogue: list

    @property
    def length(self) -> np.ndarray:
        return np.maximum(self.n, 1)


def _kv_of(shape: Shape) -> np.ndarray:
    """K/V problem of each query problem p (GQA groups and broadcast batch axes), as the
    kernels' kv_index."""
    if not shape.batch_shape:
        return np.zeros(1, np.int64)
    kb = (1,) * (len(shape.batch_shape) - len(shape.kv_batch_shape)) + tuple(shape.kv_batch_shape)
    idx = np.arange(math.prod(kb), dtype=np.int64).reshape(kb)[..., None]
    return np.broadcast_to(idx, canon_batch(shape)).reshape(-1).copy()


def program(launch: Launch, shape: Shape, io_dtype, band) -> Program:
    """The tile moves of every CTA of ``launch``, as the simulator's schedule makes them
    (`Tiles.kv_ranges` / `Tiles.q_ranges` give each outer tile its visited range)."""
    b, s = itemsize_of(io_dtype), STAT_BYTES
    Nq, Nk, d, dv = shape.Nq, shape.Nk, shape.d, shape.dv
    gx, P = launch.grid
    # the copy-engine kernels take a banded launch's problems in chunks (kernels.ws_chunk)
    N = {"flash2_fwd_ws": Nk, "flash2_bwd_ws": Nq}.get(launch.kernel)
    chunk = 1 if N is None else K.ws_chunk(P, N, d, dv, not band.unbounded)
    bx, p = K.ws_order(gx, P, chunk)
    t = launch.tile_of(bx)
    kv = _kv_of(shape)[p]
    zero = np.zeros(len(p), np.int64)
    on = np.ones(len(p), bool)
    tiles = Tiles(Nq, Nk, launch.Br, launch.Bc, band)
    R = launch.rows
    if launch.phase == "forward":
        jlo, jhi = tiles.kv_ranges()
        lo, n = jlo[t], np.maximum(jhi[t] - jlo[t] + 1, 0)
        Q = Stream("Q", (("Q", READ, d * b),), R, Nq)
        KV = Stream("KV", (("K", READ, d * b), ("V", READ, dv * b)), launch.Bc, Nk)
        OL = Stream("OL", (("O", WRITE, dv * b), ("L", WRITE, s)), R, Nq)
        return Program([Access(Q, p, t, n > 0)], (KV,), kv, lo, n, [Access(OL, p, t, on)])
    if launch.phase == "backward-main":
        ilo, ihi = tiles.q_ranges()
        lo, n = ilo[t], np.maximum(ihi[t] - ilo[t] + 1, 0)
        KV = Stream("KV", (("K", READ, d * b), ("V", READ, dv * b)), R, Nk)
        step = Stream("QdOLD", (("Q", READ, d * b), ("dO", READ, dv * b), ("L", READ, s),
                                ("D", READ, s)), launch.Br, Nq)
        acc = Stream("dQacc", (("dQacc", REDUCE, d * s),), launch.Br, Nq)
        dKV = Stream("dKdV", (("dK", WRITE, d * b), ("dV", WRITE, dv * b)), R, Nk)
        return Program([Access(KV, kv, t, n > 0)], (step, acc), p, lo, n,
                       [Access(dKV, p, t, on)])
    if launch.phase == "backward-pre":
        OdO = Stream("OdO", (("O", READ, dv * b), ("dO", READ, dv * b)), R, Nq)
        DQ = Stream("DdQacc", (("D", WRITE, s), ("dQacc", WRITE, d * s)), R, Nq)
        return Program([Access(OdO, p, t, on)], (), p, zero, zero, [Access(DQ, p, t, on)])
    if launch.phase == "backward-post":
        acc = Stream("dQacc", (("dQacc", READ, d * s),), R, Nq)
        dQ = Stream("dQ", (("dQ", WRITE, d * b),), R, Nq)
        return Program([Access(acc, p, t, on)], (), p, zero, zero, [Access(dQ, p, t, on)])
    raise ValueError(f"no program for phase {launch.phase!r}")


def _span(stream: Stream, lo, n) -> np.ndarray:
    """Rows of tiles lo..lo+n−1 of ``stream`` (0 where n = 0)."""
    hi = lo + n - 1
    return np.where(n > 0, np.minimum((hi + 1) * stream.B, stream.N) - lo * stream.B, 0)


def sm_l2_traffic(prog: Program) -> Traffic:
    """What the SMs move to and from L2: every access of every CTA, reductions as such."""
    rows: dict[Stream, int] = {}
    for a in prog.prologue + prog.epilogue:
        rows[a.stream] = rows.get(a.stream, 0) + int(np.where(a.active, a.stream.rows(a.tile), 0).sum())
    for stream in prog.inner:
        rows[stream] = rows.get(stream, 0) + int(_span(stream, prog.lo, prog.n).sum())
    return _to_traffic(rows, (READ,), (WRITE,), (REDUCE,))


def _to_traffic(rows: dict, read_kinds, write_kinds, reduce_kinds=(), streams=None) -> Traffic:
    """Traffic of ``rows`` moved per stream (keys: streams, or indices into ``streams``)."""
    reads, writes, reduces = {}, {}, {}
    for stream, r in rows.items():
        if streams is not None:
            stream = streams[stream]
        for tensor, kind, b in stream.parts:
            for kinds, out in ((read_kinds, reads), (write_kinds, writes),
                               (reduce_kinds, reduces)):
                if kind in kinds:
                    out[tensor] = out.get(tensor, 0) + r * b
    return Traffic(reads, writes, reduces)


# -- dispatch ---------------------------------------------------------------------------

def dispatch(lengths: np.ndarray, slots: int) -> tuple[np.ndarray, np.ndarray]:
    """Start time and slot of each CTA (launch order) when each takes the first free slot
    (the lowest-numbered among those free at once) and runs for ``lengths`` time units.
    Slot k is on SM k mod (number of SMs): the first wave puts one CTA on every SM before
    a second on any."""
    lengths = np.asarray(lengths, np.int64)
    n = len(lengths)
    idx = np.arange(n, dtype=np.int64)
    if n <= slots:
        return np.zeros(n, np.int64), idx
    if (lengths == lengths[0]).all():
        return (idx // slots) * lengths[0], idx % slots
    start, slot = np.zeros(n, np.int64), np.zeros(n, np.int64)
    free = [(0, k) for k in range(slots)]
    heapq.heapify(free)
    push, pop = heapq.heappush, heapq.heappop
    for c, L in enumerate(lengths.tolist()):
        t, k = pop(free)
        start[c], slot[c] = t, k
        push(free, (t + L, k))
    return start, slot


# -- the L2 -------------------------------------------------------------------------------

@dataclass(frozen=True)
class L2Result:
    dram: Traffic
    writeback: Traffic
    compulsory: Traffic
    makespan: int
    superblock: int
    events: int


def _cohorts(prog: Program, start: np.ndarray):
    """CTAs that start at the same time on the same problem and first tile: their inner
    accesses coincide step for step. Returns the CTAs with inner steps (sorted by
    cohort), each one's cohort, and where each cohort begins."""
    idx = np.nonzero(prog.n > 0)[0]
    key = np.stack([start[idx], prog.inner_problem[idx], prog.lo[idx]])
    order = np.lexsort(key[::-1])
    idx, key = idx[order], key[:, order]
    new = np.ones(len(idx), bool)
    new[1:] = (key[:, 1:] != key[:, :-1]).any(axis=0)
    return idx, np.cumsum(new) - 1, new


def _inner_count(lo: np.ndarray, longest: np.ndarray, G: int) -> int:
    """Folded inner accesses when G consecutive tiles form one entry."""
    return int(((lo + longest - 1) // G - lo // G + 1).sum())


def _inner_events(prog: Program, start, max_events):
    """Folded inner accesses: (time, seq, problem, superblock, first, last tile offset in
    it, mult) and the superblock size G."""
    idx, cohort, new = _cohorts(prog, start)
    C = cohort[-1] + 1
    n = prog.n[idx]
    longest = np.zeros(C, np.int64)
    np.maximum.at(longest, cohort, n)
    first = idx[new]                             # the cohort's first CTA in launch order
    t0, lo = start[first], prog.lo[first]
    G = 1
    while _inner_count(lo, longest, G) > max_events and G < int(longest.max()):
        G *= 2
    J0, J1 = lo // G, (lo + longest - 1) // G
    per = J1 - J0 + 1
    E = int(per.sum())
    ev_c = np.repeat(np.arange(C), per)
    offs = np.concatenate([[0], np.cumsum(per)[:-1]])
    J = J0[ev_c] + np.arange(E, dtype=np.int64) - offs[ev_c]
    a = np.maximum(J * G, lo[ev_c])                          # first tile touched in J
    e = np.minimum((J + 1) * G, lo[ev_c] + longest[ev_c]) - 1  # last
    s = a - lo[ev_c]                                         # the step that enters J
    # multiplicity: members of the cohort still running at step s
    big = int(n.max()) + 1
    keys = np.sort(cohort * big + n)
    size = np.bincount(cohort, minlength=C)
    first_pos = np.concatenate([[0], np.cumsum(size)[:-1]])
    done = np.searchsorted(keys, ev_c * big + s, side="right") - first_pos[ev_c]
    mult = size[ev_c] - done
    return (t0[ev_c] + s, first[ev_c], prog.inner_problem[first][ev_c], J, a - J * G,
            e - J * G, mult), G


def simulate_l2(prog: Program, slots: int, capacity, *, sms: int | None = None,
                partitions: int = 1, max_events: int = MAX_EVENTS) -> L2Result:
    """Run the CTAs' accesses through an LRU, write-back L2 of ``capacity`` bytes (or the
    average over a sequence of capacities) split into ``partitions`` (see the module's
    docstring); ``sms``: SMs the slots are spread over (default: one slot per SM)."""
    start, slot = dispatch(prog.length, slots)
    sm = slot % (sms or slots)
    part = sm % partitions                      # the partition each CTA's SM is wired to
    L = prog.length
    makespan = int((start + L).max()) if len(start) else 0
    streams: list[Stream] = []
    cols = []     # time, order, seq, stream, problem, entry, first, last offset, mult, part
    for order, accesses, when in ((0, prog.prologue, start), (2, prog.epilogue, start + L - 1)):
        for acc in accesses:
            m = acc.active
            k = int(m.sum())
            streams.append(acc.stream)
            z = np.zeros(k, np.int64)
            cols.append((when[m], np.full(k, order), np.nonzero(m)[0],
                         np.full(k, len(streams) - 1), acc.problem[m], acc.tile[m], z, z,
                         np.ones(k, np.int64), part[m]))
    G = 1
    inner_ids = []
    if prog.inner and (prog.n > 0).any():
        (t, seq, pr, J, a, e, mult), G = _inner_events(prog, start, max_events)
        for stream in prog.inner:
            streams.append(stream)
            inner_ids.append(len(streams) - 1)
            cols.append((t, np.ones(len(t), np.int64), seq, np.full(len(t), len(streams) - 1),
                         pr, J, a, e, mult, part[seq]))
    time, order, seq, st, prob, ent, a, e, mult, part = (
        np.concatenate([c[i] for c in cols]).astype(np.int64) for i in range(10))
    srt = np.lexsort((st, order, seq, time))
    st, prob, ent, a, e, mult, part = (x[srt] for x in (st, prob, ent, a, e, mult, part))
    # G tiles per entry of the streamed tensors, 1 for the others
    g = np.array([G if k in inner_ids else 1 for k in range(len(streams))])
    B = np.array([x.B for x in streams])
    last = np.array([-(-x.N // x.B) - 1 for x in streams])      # each tensor's last tile
    deficit = np.array([x.B * (lt + 1) - x.N for x, lt in zip(streams, last)])
    tile_a, tile_e = ent * g[st] + a, ent * g[st] + e
    rows = (tile_e - tile_a + 1) * B[st] - np.where(tile_e == last[st], deficit[st], 0)
    # the last tile's bit, where this entry holds it (its rows are fewer than B)
    edge = np.where(last[st] // g[st] == ent, last[st] % g[st], -1)
    span = int(ent.max()) + 1 if len(ent) else 1
    nprob = int(prob.max()) + 1 if len(prob) else 1
    keys = (st * nprob + prob) * span + ent
    row_bytes = [x.row_bytes for x in streams]
    dirty = [x.bytes_of((WRITE, REDUCE)) > 0 for x in streams]
    caps = (capacity,) if isinstance(capacity, (int, np.integer)) else tuple(capacity)
    runs = [_lru(keys, st, a, e, rows, edge, mult, part, len(streams), B.tolist(),
                 deficit.tolist(), row_bytes, dirty, int(c), partitions) for c in caps]
    # the average over the capacities (one LRU: its counts as they are)
    fetched, written, left = ([round(sum(r[i][k] for r in runs) / len(runs))
                               for k in range(len(streams))] for i in range(3))
    # compulsory: each distinct tile once
    tiles_key = (st * nprob + prob) * (int(tile_e.max()) + 1 if len(tile_e) else 1)
    distinct = [0] * len(streams)
    for k in range(len(streams)):
        sel = st == k
        if g[k] == 1:
            u, i = np.unique(tiles_key[sel] + tile_a[sel], return_index=True)
            distinct[k] = int(rows[sel][i].sum())
        else:     # union of tile ranges per problem
            distinct[k] = _union_rows(prob[sel], tile_a[sel], tile_e[sel], streams[k])
    fetch_kinds, write_kinds = (READ, REDUCE), (WRITE, REDUCE)
    return L2Result(
        dram=_to_traffic(dict(enumerate(fetched)), fetch_kinds, (), streams=streams)
        + _to_traffic(dict(enumerate(written)), (), write_kinds, streams=streams),
        writeback=_to_traffic(dict(enumerate(left)), (), write_kinds, streams=streams),
        compulsory=_to_traffic(dict(enumerate(distinct)), fetch_kinds, write_kinds,
                               streams=streams),
        makespan=makespan, superblock=G, events=len(keys))


def _lru(keys, st, a, e, rows, edge, mult, part, nstreams, Bs, defs, row_bytes, dirty,
         capacity, partitions=1):
    """One pass of the accesses through ``partitions`` LRUs of ``capacity / partitions``
    bytes each: rows fetched from DRAM, rows written back during the launch and rows left
    dirty, per stream.

    Every entry has a home partition (its key modulo ``partitions``), the one that reads
    it from DRAM, performs its reductions and writes it back. A read by an SM wired to
    another partition also leaves a copy there (and refreshes it), so data that SMs on
    every side read takes room in every partition. A read misses to DRAM when the home
    partition lacks the bytes. ``mult`` CTAs reading at once sit on up to ``partitions``
    sides. Each partition sees a fixed sequence of accesses (all reads of what it owns,
    plus its own SMs' reads of the rest), so each is an LRU whatever the others hold."""
    P = partitions
    share = capacity // P
    fetched = [0] * nstreams      # rows read from DRAM, per stream
    written = [0] * nstreams      # rows written back during the launch
    caches = [OrderedDict() for _ in range(P)]     # key -> [stream, loaded-tile mask, rows]
    used = [0] * P

    def tile_rows(k, mask, eb):
        return mask.bit_count() * Bs[k] - (defs[k] if eb >= 0 and mask >> eb & 1 else 0)

    def touch(q, key, k, mask, eb):
        """Access ``mask`` of ``key`` in partition q; returns the rows it lacked."""
        cache = caches[q]
        entry = cache.get(key)
        if entry is None:
            miss = mask
            got = tile_rows(k, miss, eb)
            cache[key] = [k, mask, got]
        else:
            cache.move_to_end(key)
            miss = mask & ~entry[1]
            if not miss:
                return 0
            got = tile_rows(k, miss, eb)
            entry[1] |= mask
            entry[2] += got
        used[q] += got * row_bytes[k]
        while used[q] > share:
            _, (k2, _, r2) = cache.popitem(last=False)
            used[q] -= r2 * row_bytes[k2]
            if dirty[k2] and q == _home(q, k2):
                written[k2] += r2
        return got

    def _home(q, k2):
        return q          # a dirty entry lives only in its home partition

    for key, k, lo_, hi_, r, eb, m, q0 in zip(keys.tolist(), st.tolist(), a.tolist(),
                                               e.tolist(), rows.tolist(), edge.tolist(),
                                               mult.tolist(), part.tolist()):
        mask = ((1 << (hi_ + 1)) - 1) ^ ((1 << lo_) - 1)
        home = key % P
        fetched[k] += touch(home, key, k, mask, eb)
        if not dirty[k]:
            for i in range(min(m, P)):                 # copies near the readers
                q = (q0 + i) % P
                if q != home:
                    touch(q, key, k, mask, eb)
        if m > 1 and key not in caches[home]:
            # too large to stay: every further access misses too
            fetched[k] += r * (m - 1)
            if dirty[k]:
                written[k] += r * (m - 1)
    left = [0] * nstreams
    for cache in caches:
        for k, _, r in cache.values():
            if dirty[k]:
                left[k] += r
    return fetched, written, left


def _union_rows(prob, a, e, stream: Stream) -> int:
    """Rows in the union of tile ranges [a, e] per problem."""
    order = np.lexsort((a, prob))
    prob, a, e = prob[order], a[order], e[order]
    total = 0
    for p in np.unique(prob):
        sel = prob == p
        aa, ee = a[sel], e[sel]
        reach = np.maximum.accumulate(ee)
        starts = np.concatenate([[True], aa[1:] > reach[:-1]])
        seg_a = aa[starts]
        seg_e = np.append(reach[np.nonzero(starts)[0][1:] - 1], reach[-1])
        total += int(_span(stream, seg_a, seg_e - seg_a + 1).sum())
    return total


# -- predictions --------------------------------------------------------------------------

def step_flops(launch: Launch, shape: Shape) -> int:
    """FLOPs of one full inner step (one tile pair) of ``launch``'s CTAs."""
    d, dv = shape.d, shape.dv
    if launch.phase == "forward":
        return 2 * launch.Br * launch.Bc * (d + dv)
    if launch.phase == "backward-main":
        return 2 * launch.Br * launch.Bc * (3 * d + 2 * dv)
    return 0


def efficiency(kernel: str, d: int, dv: int | None = None, cc: int = 90) -> float:
    """η of a kernel (see `EFFICIENCY`) on a device of compute capability ``cc``; the
    reference kernels' does not depend on d. A fast kernel's instance wider than d, dv
    multiplies the columns past them too (zeros): its η counts the useful share,
    (d + dv) / 2D, of the instance's."""
    dv = d if dv is None else dv
    D = _instance_of(kernel, d, dv, cc)
    if D is not None and (kernel, D) in EFFICIENCY:
        return EFFICIENCY[(kernel, D)] * (d + dv) / (2 * D)
    return EFFICIENCY.get((kernel, d), EFFICIENCY.get((kernel, None), 0.0))


@dataclass(frozen=True)
class LaunchPrediction:
    """One launch's traffic at each level, write-back left in L2, and predicted time."""
    launch: Launch
    levels: Levels
    writeback: Traffic
    flops: int
    makespan: int
    superblock: int
    time_s: float
    time_parts: dict

    def summary(self) -> str:
        L = self.launch
        tiles = (f"tiles {L.Br}×{L.Bc}" if L.phase in ("forward", "backward-main")
                 else f"{L.rows} rows per CTA")
        return (f"{L.kernel}: grid {L.grid[0]}×{L.grid[1]} of {L.threads} threads, {tiles}, "
                f"{L.ctas_per_sm} CTA/SM, {L.waves:.2f} waves; predicted "
                f"{self.time_s * 1e3:.3f} ms (compute {self.time_parts['compute'] * 1e3:.3f}, "
                f"DRAM {self.time_parts['dram'] * 1e3:.3f}, L2 {self.time_parts['l2'] * 1e3:.3f})")


@dataclass(frozen=True)
class Prediction:
    """The three-level prediction of a forward (one launch) or backward (pre-pass, main
    kernel, post-pass): ``levels`` and ``time_s`` summed over the launches."""
    launches: tuple
    traffic: Traffic          # the two-level count (SRAM↔memory) for the same tiles

    @property
    def levels(self) -> Levels:
        out = self.launches[0].levels
        for lp in self.launches[1:]:
            out = out + lp.levels
        return out

    @property
    def writeback(self) -> Traffic:
        return sum((lp.writeback for lp in self.launches), Traffic())

    @property
    def time_s(self) -> float:
        return sum(lp.time_s for lp in self.launches)

    @property
    def flops(self) -> int:
        return sum(lp.flops for lp in self.launches)

    def table(self, unit: str = "auto") -> str:
        lines = [lp.summary() for lp in self.launches]
        lines.append(self.levels.table(unit))
        if self.writeback.total_bytes:
            lines.append(f"(plus {self.writeback.write_bytes:,} bytes written in L2 that reach "
                         "DRAM after the launch)")
        return "\n".join(lines)

    def __str__(self):
        return self.table()


def predict(shape: Shape, io_dtype, band, hardware, *, backward: bool = False,
            launch: str = "auto", block_sizes=None, deterministic: bool = False,
            traffic: Traffic | None = None, max_events: int = MAX_EVENTS,
            variant: bool = False) -> Prediction:
    """Three-level prediction for the project's kernels on ``hardware`` (see the module;
    ``variant``: softcap or ALiBi)."""
    hw = get_hardware(hardware)
    out = []
    for L in launches(shape, io_dtype, hw, backward=backward, launch=launch,
                      block_sizes=block_sizes, deterministic=deterministic, variant=variant):
        prog = program(L, shape, io_dtype, band)
        sm = sm_l2_traffic(prog)
        l2 = simulate_l2(prog, L.slots, hw.l2_capacities, sms=hw.num_sms,
                         partitions=hw.l2_partitions, max_events=max_events)
        F = step_flops(L, shape)
        flops = F * int(prog.n.sum())
        eta = efficiency(L.kernel, shape.d, shape.dv, hw.compute_capability)
        per_slot = eta * hw.peak_flops / L.slots if eta > 0 else math.inf
        parts = {"compute": l2.makespan * F / per_slot if F else 0.0,
                 "dram": l2.dram.total_bytes / hw.dram_sustained_bytes_per_s,
                 "l2": sm.total_bytes / hw.l2_bytes_per_s}
        out.append(LaunchPrediction(
            launch=L, levels=Levels({"SM-L2": sm, "L2-DRAM": l2.dram, "compulsory": l2.compulsory}),
            writeback=l2.writeback, flops=flops, makespan=l2.makespan,
            superblock=l2.superblock, time_s=max(parts.values()), time_parts=parts))
    return Prediction(tuple(out), traffic if traffic is not None else Traffic())


def check_hardware_args(algorithm: str, sram_bytes, block_sizes, launch) -> None:
    """The three-level model runs the kernels' schedule (flash2) with the kernels' tiles."""
    if algorithm != "flash2":
        raise ValueError(f"hardware= models the project's GPU kernels, which run flash2; "
                         f"algorithm {algorithm!r} has no kernel (use algorithm='flash2', or "
                         "drop hardware= for the two-level count)")
    if sram_bytes is not None:
        raise ValueError("with hardware= the tiles are the kernel's: drop sram_bytes (pass "
                         "block_sizes=(Br, Bc) to model the reference kernel with other tiles)")
    if launch not in RUNGS:
        raise ValueError(f"launch must be one of {RUNGS}, got {launch!r}")


def hardware_tiles(algorithm: str, shape: Shape, io_dtype, hardware, *, sram_bytes,
                   block_sizes, launch: str, backward: bool,
                   variant: bool = False) -> tuple[int, int]:
    """What `count`, `simulate` and their backwards run with ``hardware=``: the arguments
    checked, then (Br, Bc) of the schedule the kernel ``launch`` runs on ``hardware``
    (``variant``: with softcap or ALiBi)."""
    check_hardware_args(algorithm, sram_bytes, block_sizes, launch)
    return tiles_for(shape, io_dtype, hardware, backward=backward, launch=launch,
                     block_sizes=block_sizes, variant=variant)


def tiles_for(shape: Shape, io_dtype, hardware, *, backward: bool, launch: str,
              block_sizes, variant: bool = False) -> tuple[int, int]:
    """(Br, Bc) of the schedule the kernel ``launch`` runs on ``hardware``."""
    hw = get_hardware(hardware)
    dtype = dtype_name(io_dtype)
    rung = choose_kernel(launch, shape, dtype, hw, block_sizes, backward, variant)
    return kernel_tiles(rung, shape, dtype, hw, block_sizes, backward, variant)


__all__ = ["Levels", "Launch", "Prediction", "LaunchPrediction", "launches", "predict",
           "program", "simulate_l2", "sm_l2_traffic", "dispatch", "softmax_rule", "EFFICIENCY",
           "LEVELS"]
