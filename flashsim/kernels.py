"""The CUDA kernels as data: where their sources are, which template instances exist,
their shared-memory needs, and an ahead-of-time build with nvcc that needs no GPU.

Pure Python (no CuPy): `flashsim kernels build --arch sm_90` uses it on CPU machines so
a kernel that does not compile never lands; `flashsim.gpu` uses the same lists to load
the kernels through CuPy.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import re
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

# T of each kernel template: the I/O element type, by its NumPy/PyTorch name.
CUDA_TYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float",
              "float64": "double"}
ACC_BYTES = {"float16": 4, "bfloat16": 4, "float32": 4, "float64": 8}

# kernel source file -> kernel templates it defines
SOURCES = {
    "flash2_ref.cu": ("flash2_fwd", "flash2_bwd_preprocess", "flash2_bwd_main",
                      "flash2_bwd_postprocess"),
    "flash2_tc.cu": ("flash2_fwd_tc", "flash2_bwd_preprocess_tc", "flash2_bwd_tc",
                     "flash2_bwd_tc_det"),
    "flash2_wg.cu": ("flash2_fwd_wg", "flash2_bwd_wg", "flash2_bwd_wg_det"),
    "flash2_ws.cu": ("flash2_fwd_ws", "flash2_bwd_ws", "flash2_bwd_ws_det"),
    "flash1_ref.cu": ("flash1_fwd", "flash1_bwd"),
    "standard_ref.cu": ("standard_fwd_scores", "standard_fwd_softmax", "standard_fwd_out",
                        "standard_bwd_dv", "standard_bwd_dp", "standard_bwd_ds",
                        "standard_bwd_dq", "standard_bwd_dk"),
    "square_ref.cu": ("square_fwd_scores", "square_fwd_out"),
    "splitkv_tc.cu": ("kvcache_append", "splitkv_fwd_tc_m16", "splitkv_fwd_tc_m32",
                      "splitkv_fwd_tc_m64",
                      *(f"splitkv_fwd_tc_m{Br}_cl{CL}" for Br in (16, 32, 64) for CL in (2, 4, 8))),
}
# Sources built for one architecture only, by its arch-specific target: the Hopper rung
# uses wgmma, which exists on compute capability 9.0 alone (sm_90a code runs nowhere else).
ARCH_SPECIFIC = {"flash2_wg.cu": "sm_90a", "flash2_ws.cu": "sm_90a"}

# The tensor-core rung: fp16/bf16, template instances of head dim D ∈ TC_HEAD_DIMS, fixed
# tiles TC_BLOCKS; head dims d, dv ≤ D (multiples of 8) run on the instance above them
# (head_dim_instance).
TC_DTYPES = ("float16", "bfloat16")
TC_HEAD_DIMS = (32, 64, 96, 128, 160, 192, 224, 256)
# forward (Br, Bc) per head dim: 4 warps of two 16-row m-tiles (kernels_cu/NOTES.md); on
# Ampere (sm_8x) d = 96 and 128 run the same tile as 8 warps of one m-tile (fewer
# registers); above 128: 4 warps of one m-tile (O alone takes D/2 registers per thread).
# Shared memory holds rows of D rounded up to 64 halves (tc_row: the swizzle's 8 chunks)
TC_BLOCKS = {32: (128, 128), 64: (128, 128), 96: (128, 64), 128: (128, 64), 160: (64, 64),
             192: (64, 64), 224: (64, 64), 256: (64, 64)}
TC_BLOCKS_AMPERE = {32: (128, 64), 64: (128, 64), 96: (128, 64), 128: (128, 64), 160: (64, 64),
                    192: (64, 64), 224: (64, 64), 256: (64, 64)}   # 128 keys at d = 64 spill on sm_80
# the softcap/ALiBi instance (VAR) on sm_90: 64 keys at d = 64 (128 spill there)
TC_BLOCKS_VAR = {**TC_BLOCKS, 64: (128, 64)}
TC_THREADS = {D: 128 for D in TC_HEAD_DIMS}
TC_THREADS_AMPERE = {**TC_THREADS, 96: 256, 128: 256}
# backward main loop: (Br, Bc) = (queries per step, keys per CTA), 8 warps; on Ampere
# the steps are half as long (d = 128: registers; d = 32, 64: an A100's shared memory),
# and d = 96 takes 64 keys (its 128-key tile with rows of 128 halves does not fit);
# above 128: 64 keys (one 16-key m-tile per warp: dK_j, dV_j take D/2 registers each) in
# steps of 64 queries, 32 at d = 256 (64 spilled in the varlen instances)
TC_BWD_BLOCKS = {32: (128, 128), 64: (128, 128), 96: (64, 128), 128: (64, 128), 160: (64, 64),
                 192: (64, 64), 256: (32, 64)}
TC_BWD_BLOCKS_AMPERE = {32: (64, 128), 64: (64, 128), 96: (64, 64), 128: (32, 128),
                        160: (64, 64), 192: (32, 64), 256: (32, 64)}
# the backward's instances: d = 160 and 192 have their own on sm_90, 64 keys in steps of
# 64 queries. On Ampere steps of 64 need more shared memory than an A100 gives a CTA at
# both; D = 192 takes steps of 32 there (as 256), and d in (128, 192] runs on it (d = 160
# too: its rows are padded to 192 halves either way); the D = 160 instance is built for
# every target (TC_BWD_BLOCKS_AMPERE naming its tiles), not launched on Ampere, since
# steps of 32 would split its dQ columns into odd n-tile counts. d = 224 runs D = 256
# everywhere: its varlen instance in steps of 64 spills 20 bytes on sm_90, and steps of 32
# split dQ's columns into odd counts
TC_BWD_HEAD_DIMS = (32, 64, 96, 128, 160, 192, 256)
TC_BWD_HEAD_DIMS_AMPERE = (32, 64, 96, 128, 192, 256)
# the backward pre-pass's instances (D/8 lanes of a row reduce by shuffles: powers of two)
PRE_HEAD_DIMS = (64, 128, 256)


def tc_row(d: int) -> int:
    """Halves per row of the tensor-core rung's shared tiles at instance d: d rounded up
    to a multiple of 64 (flash2_tc.cu's ds<D>)."""
    return -(-d // 64) * 64


def head_dim_instance(d: int, dv: int, dims=TC_HEAD_DIMS) -> int | None:
    """D of the fast rungs' instance that runs head dims d (of Q, K) and dv (of V, O): the
    smallest of ``dims`` that holds both, for d and dv multiples of 8 (rows are read 16
    bytes at a time); None where none does. Below D the kernels zero the columns past d
    and dv on chip and store none of them, so the bytes moved are those of d and dv. The
    forward runs such inputs in its softcap/ALiBi instance (`padded`)."""
    if d % 8 or dv % 8 or min(d, dv) < 8:
        return None
    return next((D for D in sorted(dims) if max(d, dv) <= D), None)


def instance_dim(rung: str, d: int, dv: int, backward: bool = False,
                 cc_major: int = 9) -> int | None:
    """D of the instance the fast rung ``rung`` ("tc" or "wg") runs head dims d, dv on, in
    the forward or the backward, on a device of this compute capability (the instances
    differ: TC_HEAD_DIMS, TC_BWD_HEAD_DIMS(_AMPERE), WG_HEAD_DIMS, WG_BWD_HEAD_DIMS)."""
    if rung == "wg":
        dims = WG_BWD_HEAD_DIMS if backward else WG_HEAD_DIMS
    elif backward:
        dims = TC_BWD_HEAD_DIMS if cc_major >= 9 else TC_BWD_HEAD_DIMS_AMPERE
    else:
        dims = TC_HEAD_DIMS
    return head_dim_instance(d, dv, dims)


def pre_instance(d: int, dv: int) -> int | None:
    """D of the fast backwards' pre-pass (flash2_bwd_preprocess_tc) for head dims d, dv:
    the smallest of PRE_HEAD_DIMS that holds them (a power of two: D/8 lanes of a row
    reduce by shuffles)."""
    return head_dim_instance(d, dv, PRE_HEAD_DIMS)


def padded(d: int, dv: int, D: int | None = None) -> bool:
    """Head dims below their instance's D (default: the forward's, head_dim_instance):
    the fast rungs run them in their VAR instances (flash2_tc.cu's plain ones, at 255
    registers, spilled with the column tests); its constants make softcap and ALiBi
    no-ops there."""
    D = head_dim_instance(d, dv) if D is None else D
    return D is not None and (d < D or dv < D)


def tc_blocks(d: int, cc_major: int, variant: bool = False) -> tuple[int, int]:
    """(Br, Bc) of the tensor-core forward on a device of this compute capability
    (``variant``: its softcap/ALiBi instance), for the instance of head dim d."""
    if cc_major < 9:
        return TC_BLOCKS_AMPERE[d]
    return (TC_BLOCKS_VAR if variant else TC_BLOCKS)[d]


def tc_threads(d: int, cc_major: int) -> int:
    """Threads per CTA of the tensor-core forward on a device of this compute capability."""
    return (TC_THREADS_AMPERE if cc_major < 9 else TC_THREADS)[d]


def tc_bwd_blocks(d: int, cc_major: int) -> tuple[int, int]:
    """(Br, Bc) of the tensor-core backward on a device of this compute capability."""
    return (TC_BWD_BLOCKS_AMPERE if cc_major < 9 else TC_BWD_BLOCKS)[d]


# The Hopper rung (flash2_wg.cu): warpgroup MMAs, 2 warpgroups. Forward: 64 query rows
# each; at d = 64 two CTAs of 64-key tiles share an SM (kernels_cu/NOTES.md, v7).
# Backward: 64 keys each (Bc = 128), steps of Br queries, the tiles of the tc backward;
# above D = 128 (every d, dv in (128, 256]) a warpgroup's dK_j, dV_j of 64 keys would
# take D registers, so the CTA takes 64 keys and its warpgroups split their columns
# (wg_bwd.cuh's step_wide: one of Sᵀ, dPᵀ each, then a part of dV_j, dK_j, dQ_i each,
# wgmma.cuh's Parts: 96 + 64 at 160, 128 + 96 at 224). D = 32, 96, 160, 192 and 224
# lay their tiles in 32-column blocks (the 64-byte swizzle; wgmma.cuh's Cols: each part
# of a product must be whole blocks); the backward's D = 32 takes steps of 128 queries,
# as 64 (its warpgroups split dQ's queries). No backward instance at 96: one (its
# warpgroups taking 64 and 32 of dQ's columns, wg_bwd.cuh) ran d = 96 in 1.1–1.2× the
# time of the copy-engine backward's D = 128 (flash2_bwd_ws, NOTES v31), which d, dv in
# (64, 128] keep
WG_HEAD_DIMS = (32, 64, 96, 128, 160, 192, 224, 256)
WG_BWD_HEAD_DIMS = (32, 64, 128, 160, 192, 224, 256)
# (above 128: 64 keys, S beside O's 80 … 128 registers; D = 32 and 64: two CTAs of
# 64-key tiles per SM; D = 96 as 128: at two CTAs per SM its 128 registers spill)
WG_BLOCKS = {32: (128, 64), 64: (128, 64), 96: (128, 128), 128: (128, 128), 160: (128, 64),
             192: (128, 64), 224: (128, 64), 256: (128, 64)}
WG_BWD_BLOCKS = {32: (128, 128), 64: (128, 128), 128: (64, 128), 160: (64, 64), 192: (64, 64),
                 224: (64, 64), 256: (64, 64)}
WG_THREADS = 256
WG_COMPUTE_CAPABILITY = 90
# flash2_fwd_wg's softcap instance (``variant`` = CAP_ONLY, not varlen; cap_only and wg_cap
# say which launches): flash2_fwd_ws's rules for m. In bfloat16 (a softcap ≤ 54.4, with
# ALiBi or without) the fixed max (NOTES v68), at every D but 64, whose 128 registers (two
# CTAs per SM) spill with it; in float16 (a softcap without ALiBi) the lazy max (v70), at
# every D. With ALiBi float16 keeps the online VAR instance here: the lazy max with the
# diagonal key tile first, which pays on flash2_fwd_ws, measured slower on this kernel,
# whose exponentials then wait for P V (no second warpgroup's turn to hide them). The
# varlen instances keep the online max (D = 128's spills 8 bytes with the fixed one), so
# that a varlen batch and its sequences' dense calls share one rule.
WG_FIXED_HEAD_DIMS = (32, 96, 128, 160, 192, 224, 256)
WG_LAZY_HEAD_DIMS = WG_HEAD_DIMS
# Its forward fed by the copy engine (flash2_ws.cu), for inputs whose rows TMA can
# address (flashsim/gpu/_tma.py) at D ∈ WS_HEAD_DIMS (head dims below D too: the copy
# engine zero-fills the columns past them, NOTES v30): a producer warpgroup
# beside one consumer warpgroup per 64 query rows of the tile (Br / 64: flash2_ws.cu's
# consumers<D>), K/V in a ring of WS_STAGES slots, one CTA per SM, tiles WS_BLOCKS
# (WG_BLOCKS' at 96 and 128; at 64 one CTA of 128 × 64 measured 0.86–0.93× the cp.async
# kernel's two, 128 × 128 faster, 192 × 128 (three consumers) faster still: NOTES v16,
# v21, v22). Elsewhere (packed varlen batches, FLASHSIM_TMA=0)
# flash2_fwd_wg runs, with WG_BLOCKS.
WS_STAGES = 2
WS_HEAD_DIMS = (64, 96, 128)
WS_BLOCKS = {64: (192, 128), 96: (128, 128), 128: (128, 128)}
# its softcap/ALiBi instance (VAR): flash2_fwd_wg's keys a tile (64 at D = 64), so that a
# packed varlen batch, which runs on flash2_fwd_wg, and each of its sequences agree bit for
# bit (a row's arithmetic depends on the key tiles alone); flash2_ws.cu's bc<D, VAR>
WS_BLOCKS_VAR = {**WS_BLOCKS, 64: (192, 64)}
# Its backward fed by the copy engine (flash2_bwd_ws, _det): flash2_bwd_wg's tiles
# (WG_BWD_BLOCKS), steps and bits, a producer warpgroup beside the two consumer ones, Q_i
# and dO_i in a ring of WS_STAGES slots, dQ added by the copy engine's bulk reduce-adds
# from WS_BWD_DQ_BUFFERS[D] shared buffers (one at 64, whose 128-row steps leave no room
# for two), at D ∈ WS_BWD_HEAD_DIMS, d, dv ≤ D. Its dQ accumulator (not _det's) lies in
# blocks of DQ_BLOCK fp32 per problem and step of dq_rows(D) rows (the instance's Br: 64 ×
# 128 at D = 128, 128 × 64 at D = 64), in the order its threads hold dQ_i (common.cuh's
# DQ_BLOCK, dq_rows, dq_tiled_at; tests/test_tma.py holds the two equal). The build, the
# launchers, the launch model and the tests read WS_BWD_HEAD_DIMS.
WS_BWD_HEAD_DIMS = (64, 128)
WS_BWD_THREADS = 384
WS_BWD_DQ_BUFFERS = {64: 1, 128: 2}
DQ_BLOCK = 64 * 128


def dq_rows(D: int) -> int:
    """Query rows per block of flash2_bwd_ws's tiled dQ accumulator at instance D."""
    return DQ_BLOCK // D


def ws_blocks(D: int, variant: bool = False) -> tuple[int, int]:
    """(Br, Bc) of flash2_fwd_ws at instance D (``variant``: its softcap/ALiBi instance)."""
    return (WS_BLOCKS_VAR if variant else WS_BLOCKS)[D]


def ws_threads(D: int) -> int:
    """Threads per CTA of flash2_fwd_ws at instance D: the producer warpgroup and one
    consumer warpgroup per 64 rows of the Q tile."""
    return 128 * (1 + WS_BLOCKS[D][0] // 64)


def source_arch(source: str, arch: str) -> str | None:
    """The target to build ``source`` for when building for ``arch``: ``arch`` itself,
    the arch-specific target (sm_90a) for a source that needs one on that chip, or None
    where the source has no code for that chip."""
    special = ARCH_SPECIFIC.get(source)
    if special is None:
        return arch
    return special if arch.rstrip("a") == special.rstrip("a") else None


# Decoding over a KV cache (splitkv_tc.cu): fp16/bf16, d = dv ∈ SPLITKV_HEAD_DIMS; K/V
# tiles of SPLITKV_BC keys, SPLITKV_STAGES in flight; 4 warps in WM = Br / 16 groups of
# 16 packed query rows, each taking a 1/(4/WM) share of every tile's keys. The launcher
# picks the smallest Br in SPLITKV_ROWS that holds the packed rows (Nq · heads/kv_heads),
# 64 beyond. splitkv_fwd_tc_m<Br> is the instance for Br.
SPLITKV_HEAD_DIMS = (64, 128)
SPLITKV_ROWS = (16, 32, 64)
SPLITKV_BC = 64
# K/V tiles in flight per CTA, per Br (splitkv_tc.cu: stages<WM>)
SPLITKV_STAGES = {16: 3, 32: 2, 64: 2}
SPLITKV_THREADS = 128
SPLITKV_PAGE_CHUNK = 128     # page ids staged in shared memory at a time
SPLITKV_PAGE_MULTIPLE = 16   # page sizes the kernels take: multiples of this many rows


# A Q tile's parts as one thread block cluster (compute capability 9.0): s = CL parts
# merge through distributed shared memory, no partial in memory; splitkv_fwd_tc_m<Br>_cl<CL>
# is the instance for tiles of Br rows and CL parts (a cluster of up to 8 CTAs is portable)
SPLITKV_CLUSTERS = (2, 4, 8)


def splitkv_rows(packed_rows: int) -> int:
    """Br of the decoding kernel for this many packed query rows per K/V head."""
    return next((r for r in SPLITKV_ROWS if packed_rows <= r), SPLITKV_ROWS[-1])


TC_BWD_THREADS = 256
# its pre-pass (D = rowsum(dO ∘ O), dQacc = 0): rows per CTA and threads
TC_PRE_BR, TC_PRE_THREADS = 64, 128
# the reference rung's CTAs, all four kernels
REF_THREADS = 128


def wg_blocks(d: int, backward: bool = False) -> tuple[int, int]:
    """(Br, Bc) of the Hopper forward, or of its backward (``backward``)."""
    return (WG_BWD_BLOCKS if backward else WG_BLOCKS)[d]


def wg_supports(d: int, dv: int, dtype: str, cc: int, smem_limit: int,
                block_sizes=None, backward: bool = False, variant: bool = False) -> bool:
    """The Hopper forward (or backward) runs these inputs on a device of compute
    capability ``cc`` (its sm_90a code runs on 9.0 alone) whose CTAs may opt in to
    ``smem_limit`` bytes (``variant``: softcap or ALiBi)."""
    D = head_dim_instance(d, dv, WG_BWD_HEAD_DIMS if backward else WG_HEAD_DIMS)
    if not (dtype in TC_DTYPES and D is not None and cc == WG_COMPUTE_CAPABILITY):
        return False
    runs = [("flash2_bwd_wg" if backward else "flash2_fwd_wg", wg_blocks(D, backward))]
    if ws_runs(d, dv, D, backward, variant):   # the kernels fed by the copy engine
        runs.append(("flash2_bwd_ws", wg_blocks(D, True)) if backward
                    else ("flash2_fwd_ws", ws_blocks(D, variant)))
    return any((block_sizes is None or tuple(block_sizes) == tiles)
               and smem_bytes(kernel, *tiles, D, D, dtype) <= smem_limit
               for kernel, tiles in runs)


def ws_runs(d: int, dv: int, D: int | None, backward: bool = False,
            variant: bool = False) -> bool:
    """The Hopper forward (or ``backward``) of head dims d, dv (instance D) is the one fed
    by the copy engine (flash2_ws.cu) on inputs whose rows a tensor map addresses: the
    forward at D ∈ WS_HEAD_DIMS, the backward at D ∈ WS_BWD_HEAD_DIMS (d, dv ≤ D); the
    forward with softcap or ALiBi
    (``variant``) only where its keys a tile are flash2_fwd_wg's, whose softcap/ALiBi
    instance a packed varlen batch's shares, so that a batch and each of its sequences run
    the same arithmetic (bit for bit: a row's depends on the key tiles, not on how many
    rows a tile holds; except the softcaps that flash2_fwd_ws runs under a fixed or lazy
    softmax max, cap_only). The backward's tiles and steps are
    flash2_bwd_wg's."""
    # below D the tensor maps are d (dv) columns wide, and the copy engine zero-fills the
    # boxes' columns past them (flashsim/gpu/_tma.py)
    if backward:
        return D in WS_BWD_HEAD_DIMS and max(d, dv) <= D
    return (D in WS_HEAD_DIMS and max(d, dv) <= D
            and (not variant or ws_blocks(D, True)[1] == WG_BLOCKS[D][1]))


# flash2_fwd_ws's third instance (``variant`` = CAP_ONLY): a softcap, whose logits all lie
# in [−C, C] in log2 units, C = softcap·log2(e) (NOTES v56, v57, v66).
# - bfloat16, with ALiBi or without: a fixed softmax max, m = min(C, 125 − C) (wgmma.cuh's
#   cap_fixed_m). Each P = 2^(x − m) lies in [2^−125, 2^max(0, 2C − 125)], normal in float
#   and bfloat16, and no step needs a row max, α or a rescale of O. CAP_HEADROOM bounds P
#   at 2^32: ℓ and O stay finite unless |V| ≥ 2^(96 − log2 Nk). ALiBi shifts a row's
#   logits by its bias, at most B over the row's visible keys: m + B per row keeps the same
#   bounds (fixed_m_alibi; running_max.fixed_max_rows).
# - float16, whose 2^−24 … 2^16 holds no such interval: a lazy running max (wgmma.cuh's
#   softmax_lazy). A step's exponentials take the m of the steps before; only a warp
#   where some P may pass 2^12 reduces its rows' max and takes the online step again.
#   ALiBi's bias rises along a row towards its diagonal key: in key order it moved that
#   max at most steps (NOTES v65), so with ALiBi (a softcap or none) each Q tile visits
#   the key tile of its middle row's diagonal key first, where its rows' biases are
#   largest (v69; running_max.key_order). That holds for every row only where the tiles
#   are square (diagonal_first: D = 96, 128); at D = 64 (192 × 64 tiles) float16 with
#   slopes keeps the online VAR instance.
# Its fourth (``variant`` = LAZY_BF16, ws_lazy): bfloat16 under the lazy max, where the
# fixed one does not hold (ALiBi alone, or a softcap past CAP_HEADROOM's), at square tiles
# (NOTES v90). The template's MAX argument is the rule: 0 online, 1 fixed, 2 lazy.
CAP_ONLY = 2
LAZY_BF16 = 3
CAP_HEADROOM = 32


def cap_only(dtype: str, softcap, alibi_slopes, D: int | None = None) -> bool:
    """flash2_fwd_ws runs this forward at instance D in its softcap instance (CAP_ONLY):
    a softcap in bfloat16 with 2·softcap·log2(e) − 125 ≤ CAP_HEADROOM (softcap ≤ 54.4),
    with ALiBi or without (the fixed max); in float16 a softcap without ALiBi, or ALiBi,
    with a softcap or without, where diagonal_first(D) (the lazy max)."""
    if dtype == "bfloat16":
        return softcap is not None and 2 * float(softcap) * math.log2(math.e) - 125 <= CAP_HEADROOM
    if dtype != "float16":
        return False
    if alibi_slopes is None:
        return softcap is not None
    return D is not None and diagonal_first(D)


def ws_lazy(dtype: str, softcap, alibi_slopes, D: int | None = None) -> bool:
    """flash2_fwd_ws runs this forward at instance D in bfloat16's lazy instance
    (LAZY_BF16): bfloat16 with a softcap or ALiBi that its softcap instance does not take
    (cap_only: ALiBi alone, or a softcap past CAP_HEADROOM's bound), where
    diagonal_first(D)."""
    return (dtype == "bfloat16" and (softcap is not None or alibi_slopes is not None)
            and not cap_only(dtype, softcap, alibi_slopes, D)
            and D is not None and diagonal_first(D))


def ws_max(dtype: str, variant: bool | int) -> int:
    """flash2_fwd_ws's MAX template argument for instance ``variant``: 0 the online
    max (plain or VAR), 1 fixed (bfloat16's CAP_ONLY), 2 lazy (float16's CAP_ONLY,
    LAZY_BF16)."""
    if variant == CAP_ONLY:
        return 1 if dtype == "bfloat16" else 2
    return 2 if variant == LAZY_BF16 else 0


def wg_cap(dtype: str, D: int, alibi_slopes=None) -> bool:
    """flash2_fwd_wg has a softcap instance (CAP_ONLY) for this dtype and D, which runs
    these slopes: bfloat16 (the fixed max, ALiBi or none) at D ∈ WG_FIXED_HEAD_DIMS,
    float16 (the lazy max) without ALiBi at D ∈ WG_LAZY_HEAD_DIMS; where cap_only holds
    too, its dense launches run it."""
    if dtype == "bfloat16":
        return D in WG_FIXED_HEAD_DIMS
    return dtype == "float16" and D in WG_LAZY_HEAD_DIMS and alibi_slopes is None


# flash2_fwd_tc's softcap instance (``variant`` = CAP_ONLY, dense): bfloat16's fixed max
# at every D (NOTES v71), float16's lazy one (v73) at every D but 32, where on Ampere it
# takes 220 registers, two CTAs per SM where the others run three
TC_LAZY_HEAD_DIMS = tuple(D for D in TC_HEAD_DIMS if D != 32)


def tc_cap(dtype: str, D: int, alibi_slopes=None) -> bool:
    """flash2_fwd_tc has a softcap instance (CAP_ONLY) for this dtype and D, which runs
    these slopes: bfloat16 (the fixed max, ALiBi or none) at every D, float16 (the lazy
    max) without ALiBi at D ∈ TC_LAZY_HEAD_DIMS; where cap_only holds too, its dense
    launches run it."""
    if dtype == "bfloat16":
        return D in TC_HEAD_DIMS
    return dtype == "float16" and D in TC_LAZY_HEAD_DIMS and alibi_slopes is None


def diagonal_first(D: int) -> bool:
    """flash2_fwd_ws's float16 softcap instance at D runs ALiBi, visiting each Q tile's
    diagonal key tile first: its softcap/ALiBi tiles are square, so that tile holds the
    diagonal key of every row of an aligned Q tile."""
    return D in WS_HEAD_DIMS and ws_blocks(D, True)[0] == ws_blocks(D, True)[1]


def tc_supports(d: int, dv: int, dtype: str, cc: int, smem_limit: int, block_sizes=None,
                backward: bool = False, variant: bool = False) -> bool:
    """The mma.sync rung (compute capability 8.0 on) runs these inputs with its tiles
    (``variant``: the softcap/ALiBi instance's, which a forward below its D runs too)."""
    D = instance_dim("tc", d, dv, backward, cc // 10)
    if not (dtype in TC_DTYPES and D is not None and cc >= 80):
        return False
    variant = variant or padded(d, dv, D)
    tiles = tc_bwd_blocks(D, cc // 10) if backward else tc_blocks(D, cc // 10, variant)
    need = smem_bytes("flash2_bwd_tc" if backward else "flash2_fwd_tc", *tiles, D, D, dtype)
    return (block_sizes is None or tuple(block_sizes) == tiles) and need <= smem_limit


# -- launches: how each kernel covers its grid ---------------------------------------------
# flashsim.gpu launches with these grids and threads, and flashsim.hierarchy models the
# same launches (which CTA runs which tile, in which order, how many share an SM), so the
# model and the kernels read one table. tests/test_hierarchy.py holds ``order`` against the
# blockIdx arithmetic in each kernel's source.

@dataclass(frozen=True)
class LaunchSpec:
    """How one kernel maps its grid: blockIdx.y is the (batch, query-head) problem and
    blockIdx.x a tile along ``over`` ("q": Q tiles, "kv": K/V tiles), taken in
    ``order`` ("natural": tile = blockIdx.x; "reversed": tile = gridDim.x − 1 − blockIdx.x,
    so the Q tiles that see the most keys under a causal mask start first). ``phase``
    names the part of the schedule it runs; ``reduces`` the tensors it adds into with
    atomics, which the L2 performs (reductions, not SM reads and writes)."""
    kernel: str
    phase: str
    over: str
    order: str
    reduces: tuple = ()


LAUNCH_SPECS = {s.kernel: s for s in (
    LaunchSpec("flash2_fwd", "forward", "q", "natural"),
    LaunchSpec("flash2_fwd_tc", "forward", "q", "reversed"),
    LaunchSpec("flash2_fwd_wg", "forward", "q", "reversed"),
    LaunchSpec("flash2_fwd_ws", "forward", "q", "reversed"),
    LaunchSpec("flash2_bwd_preprocess", "backward-pre", "q", "natural"),
    LaunchSpec("flash2_bwd_preprocess_tc", "backward-pre", "q", "natural"),
    LaunchSpec("flash2_bwd_main", "backward-main", "kv", "natural", ("dQacc",)),
    LaunchSpec("flash2_bwd_tc", "backward-main", "kv", "natural", ("dQacc",)),
    LaunchSpec("flash2_bwd_tc_det", "backward-main", "kv", "reversed", ("dQacc",)),
    LaunchSpec("flash2_bwd_wg", "backward-main", "kv", "natural", ("dQacc",)),
    LaunchSpec("flash2_bwd_wg_det", "backward-main", "kv", "reversed", ("dQacc",)),
    LaunchSpec("flash2_bwd_ws", "backward-main", "kv", "natural", ("dQacc",)),
    LaunchSpec("flash2_bwd_ws_det", "backward-main", "kv", "reversed", ("dQacc",)),
    LaunchSpec("flash2_bwd_postprocess", "backward-post", "q", "natural"),
)}


def grid_rows(kernel: str, Br: int, Bc: int) -> int:
    """Rows of the tile one CTA of ``kernel`` covers along its grid's x axis."""
    if kernel == "flash2_bwd_preprocess_tc":
        return TC_PRE_BR
    return Bc if LAUNCH_SPECS[kernel].over == "kv" else Br


# The reference rung's other algorithms (flash1_ref.cu, standard_ref.cu), outside the
# three-level launch model: what blockIdx.x of each runs over. "problem": one CTA walks a
# whole (batch, head) problem (FlashAttention-1's K/V-outer loop updates every O_i in
# turn); "q"/"kv": a Q tile of Br rows / a K/V tile of Bc rows; "row": one query row.
ALGORITHM_GRIDS = {
    "flash1_fwd": "problem", "flash1_bwd": "problem",
    "standard_fwd_scores": "q", "standard_fwd_softmax": "row", "standard_fwd_out": "q",
    "standard_bwd_dv": "kv", "standard_bwd_dp": "q", "standard_bwd_ds": "row",
    "standard_bwd_dq": "q", "standard_bwd_dk": "kv",
    "square_fwd_scores": "q", "square_fwd_out": "q",
}


def grid(kernel: str, Nq: int, Nk: int, Br: int, Bc: int, problems: int) -> tuple[int, int]:
    """(gridDim.x, gridDim.y) of ``kernel`` for these sizes and tiles."""
    over = ALGORITHM_GRIDS.get(kernel)
    if over is not None:
        n = {"problem": 1, "row": Nq, "q": -(-Nq // Br), "kv": -(-Nk // Bc)}[over]
        return n, problems
    N = Nk if LAUNCH_SPECS[kernel].over == "kv" else Nq
    B = grid_rows(kernel, Br, Bc)
    return -(-N // B), problems


def ws_forward_smem(Br: int, Bc: int, d: int, walking: bool) -> int:
    """Dynamic shared memory of flash2_fwd_ws (16-bit tiles of d columns): Q_i in two
    slots where its CTAs walk several tiles (``walking``), else one; WS_STAGES slots of
    K_j and of V_j; room to start the tiles on 1024 bytes."""
    return ((2 if walking else 1) * Br * d + 2 * WS_STAGES * Bc * d) * 2 + 1024


def ws_forward_ctas(tiles: int, sms: int) -> int:
    """CTAs of a flash2_fwd_ws launch over ``tiles`` Q tiles (grid(…)'s x·y, in its
    order): one per SM (the kernel takes one CTA an SM), each walking tiles, so that its
    producer loads the next tile's Q_i and first K_j, V_j while the consumers finish the
    last: b, b + CTAs, … without a band (tiles of equal cost; NOTES v44), else whichever
    tile a counter hands out next as a CTA frees, heaviest first (NOTES v45)."""
    return min(tiles, sms)


# A banded flash2_fwd_ws or flash2_bwd_ws launch visits its problems in chunks whose
# operands re-read by every tile (the forward's K and V, the backward's Q and dO) take
# about this much of L2 (H100: 50 MB): enough problems a chunk that the launch ends on
# light tiles, few enough that the tiles in flight re-read them from L2 (NOTES v46: the
# forward at d = 128, N = 16k in chunks of 2 problems, 16 MB, measured 0–2% slower than 1)
WS_CHUNK_BYTES = 8 * 2**20


def ws_chunk(problems: int, N: int, d: int, dv: int, banded: bool, itemsize: int = 2) -> int:
    """Problems per chunk of the tile order of a flash2_fwd_ws launch (its `chunk`
    parameter; N = Nk) or a flash2_bwd_ws one (N = Nq). 1 without a band: the order of the
    grid of tiles × problems, whose tiles cost the same (the forward: Q tile nx − 1 − x of
    problem p at t = x + nx·p; the backward: K/V tile blockIdx.x of problem blockIdx.y).
    Under a band as many problems as keep N·(d + dv) elements each within WS_CHUNK_BYTES,
    at least 1: the tiles then go heaviest first across a chunk's problems (the forward's
    last Q tiles, the backward's first K/V tiles), so a launch ends on its lightest tiles
    rather than on a last problem's heavy ones (the forward at N = 2k–4k under a causal
    mask 2–6% faster, NOTES v46)."""
    if not banded:
        return 1
    return max(1, min(problems, WS_CHUNK_BYTES // max(1, N * (d + dv) * itemsize)))


def ws_order(nx: int, problems: int, chunk: int):
    """(x, p) of each tile in the order flash2_fwd_ws hands its tiles out and
    flash2_bwd_ws's CTAs take theirs (flash2_ws.cu, the same arithmetic): problems in
    chunks of ``chunk`` (the first one shorter where they do not divide, so that the
    order ends on a whole chunk), a chunk's tiles x = 0 of each of its problems, then
    x = 1 of each, …; with chunk = 1, tile x of problem p at x + nx·p (the order of a grid
    of nx × problems). x is the forward's Q tile nx − 1 − x, the backward's K/V tile x."""
    import numpy as np
    t = np.arange(nx * problems, dtype=np.int64)
    first = problems - (problems - 1) // chunk * chunk
    late = t >= first * nx
    c = np.where(late, (t - first * nx) // (chunk * nx), 0)
    r = np.where(late, t - first * nx - c * chunk * nx, t)
    gc = np.where(late, chunk, first)
    pb = np.where(late, first + c * chunk, 0)
    x = r // gc
    return x, pb + r - x * gc


def threads(kernel: str, d: int, cc: int) -> int:
    """Threads per CTA of ``kernel`` at head dim d on a device of compute capability cc."""
    if kernel == "flash2_fwd_tc":
        return tc_threads(d, cc // 10)
    if kernel in ("flash2_fwd_wg", "flash2_bwd_wg", "flash2_bwd_wg_det"):
        return WG_THREADS
    if kernel == "flash2_fwd_ws":
        return ws_threads(d)
    if kernel in ("flash2_bwd_ws", "flash2_bwd_ws_det"):
        return WS_BWD_THREADS
    if kernel in ("flash2_bwd_tc", "flash2_bwd_tc_det"):
        return TC_BWD_THREADS
    if kernel == "flash2_bwd_preprocess_tc":
        return TC_PRE_THREADS
    if kernel in SOURCES["splitkv_tc.cu"]:
        return SPLITKV_THREADS
    return REF_THREADS


# Registers per thread of the fast (not instrumented) builds, the most over the dtypes
# (and the plain, softcap/ALiBi and varlen instances) each kernel is built for, as ptxas reports them (`flashsim kernels build`); they set
# how many CTAs an SM holds. tests/test_kernels.py rebuilds and checks the occupancy
# they give against every instance's own count.
REGISTERS = {
    "sm_90": {"flash2_fwd": 77, "flash2_bwd_preprocess": 29, "flash2_bwd_main": 103,
              "flash2_bwd_postprocess": 30,
              "flash2_fwd_tc": {32: 255, 64: 255, 96: 251, 128: 255, 160: 196, 192: 226, 224: 255,
                                256: 255},
              "flash2_bwd_preprocess_tc": 32,
              "flash2_bwd_tc": {32: 234, 64: 255, 96: 255, 128: 255, 160: 222, 192: 248, 256: 251},
              "flash2_bwd_tc_det": {32: 234, 64: 255, 96: 255, 128: 255, 160: 231, 192: 246,
                                    256: 243},
              "flash2_fwd_wg": {32: 128, 64: 128, 96: 255, 128: 255, 160: 205, 192: 225, 224: 255,
                                256: 255},
              "flash2_bwd_wg": {32: 228, 64: 253, 128: 254, 160: 194, 192: 180, 224: 227, 256: 232},
              "flash2_bwd_wg_det": {32: 227, 64: 252, 128: 253, 160: 190, 192: 176, 224: 223,
                                    256: 234}, "flash2_fwd_ws": {64: 128, 96: 168, 128: 168},
              "flash2_bwd_ws": {64: 168, 128: 168}, "flash2_bwd_ws_det": {64: 168, 128: 168},
              "kvcache_append": 32,
              "splitkv_fwd_tc_m16": {64: 152, 128: 173}, "splitkv_fwd_tc_m32": {64: 146, 128: 198},
              "splitkv_fwd_tc_m64": {64: 161, 128: 219},
              **{f"splitkv_fwd_tc_m{Br}_cl{c}": r for Br, r in (
                  (16, {64: 110, 128: 160}), (32, {64: 124, 128: 190}),
                  (64, {64: 150, 128: 210})) for c in (2, 4, 8)}},
    "sm_80": {"flash2_fwd": 72, "flash2_bwd_preprocess": 28, "flash2_bwd_main": 80,
              "flash2_bwd_postprocess": 32,
              "flash2_fwd_tc": {32: 168, 64: 254, 96: 167, 128: 195, 160: 192, 192: 215, 224: 249,
                                256: 254},
              "flash2_bwd_preprocess_tc": 30,
              "flash2_bwd_tc": {32: 170, 64: 228, 96: 179, 128: 250, 160: 229, 192: 228, 256: 250},
              "flash2_bwd_tc_det": {32: 172, 64: 227, 96: 178, 128: 241, 160: 220, 192: 224,
                                    256: 245}, "kvcache_append": 34,
              "splitkv_fwd_tc_m16": {64: 144, 128: 166}, "splitkv_fwd_tc_m32": {64: 139, 128: 189},
              "splitkv_fwd_tc_m64": {64: 153, 128: 213}},
}


def registers(kernel: str, d: int, cc: int) -> int:
    """Registers per thread of ``kernel`` (fast build) at head dim d; sm_80's figures
    stand for every compute capability below 9.0."""
    table = REGISTERS["sm_90" if cc >= 90 else "sm_80"]
    r = table[kernel]
    return r[d] if isinstance(r, dict) else r


def ctas_per_sm(*, threads: int, registers: int, smem: int, regs_per_sm: int = 65536,
                max_threads_per_sm: int = 2048, max_blocks_per_sm: int = 32,
                smem_per_sm: int = 228 * 1024, smem_reserved_per_block: int = 1024) -> int:
    """CTAs one SM holds at once (the CUDA occupancy rules): the fewest allowed by
    threads, registers (allocated per warp in units of 256), shared memory (plus what
    the runtime reserves per CTA) and the block limit."""
    warps = -(-threads // 32)
    by_threads = max_threads_per_sm // (warps * 32)
    regs_per_warp = -(-registers * 32 // 256) * 256
    by_regs = (regs_per_sm // regs_per_warp) // warps
    by_smem = smem_per_sm // (smem + smem_reserved_per_block)
    return max(0, min(max_blocks_per_sm, by_threads, by_regs, by_smem))


@dataclass(frozen=True)
class Instance:
    """One template instance: its source, kernel, dtype, head dim (tensor-core rung
    only), the NVRTC name expression and the start of its mangled name. ``variant``:
    the instance that also runs softcap and ALiBi (the fast rungs' VAR = true; the
    plain one keeps the registers it has without them). ``varlen``: the instance that
    walks a packed varlen batch's table of tiles (VL = true; always with VAR, whose
    constants make softcap and ALiBi no-ops when absent). flash2_fwd_ws has a third,
    ``variant`` = CAP_ONLY (cap_only), and in bfloat16 a fourth, LAZY_BF16 (ws_lazy)."""
    source: str
    kernel: str
    dtype: str
    D: int | None
    expr: str
    mangled: str
    variant: bool | int = False    # (or CAP_ONLY: the softcap instance; LAZY_BF16)
    varlen: bool = False


# kernels with VAR (softcap and ALiBi) and VL (packed varlen batches) template arguments:
# a plain instance, a variant one, and a varlen one that runs the variants too
VARIANT_KERNELS = ("flash2_fwd_tc", "flash2_bwd_tc", "flash2_bwd_tc_det", "flash2_fwd_wg",
                   "flash2_bwd_wg", "flash2_bwd_wg_det", "flash2_fwd_ws", "flash2_bwd_ws",
                   "flash2_bwd_ws_det")
# kernels fed by the copy engine (TMA), whose tensor maps bound each problem's rows: a
# plain and a softcap/ALiBi instance, no packed varlen one
WS_KERNELS = ("flash2_fwd_ws", "flash2_bwd_ws", "flash2_bwd_ws_det")
VARIANT_FLAGS = ((False, False), (True, False), (True, True))   # (VAR, VL)


_MANGLED_T = {"float16": "6__half", "bfloat16": "13__nv_bfloat16", "float32": "f",
              "float64": "d"}


def instances(source: str | None = None) -> list[Instance]:
    out = []
    for src, names in SOURCES.items():
        if source is not None and src != source:
            continue
        for k in names:
            if src == "splitkv_tc.cu":
                for dt in TC_DTYPES:
                    for D in SPLITKV_HEAD_DIMS:
                        out.append(_splitkv_instance(k, dt, D))
            elif src in ("flash2_tc.cu", "flash2_wg.cu", "flash2_ws.cu"):
                dims = {"flash2_tc.cu": TC_HEAD_DIMS, "flash2_wg.cu": WG_HEAD_DIMS,
                        "flash2_ws.cu": WS_HEAD_DIMS}[src]
                if k.startswith("flash2_bwd_wg"):
                    dims = WG_BWD_HEAD_DIMS
                elif k.startswith("flash2_bwd_ws"):
                    dims = WS_BWD_HEAD_DIMS
                elif k == "flash2_bwd_preprocess_tc":
                    dims = PRE_HEAD_DIMS
                elif k.startswith("flash2_bwd_tc"):
                    # every target builds them (one NVRTC module per source); Ampere
                    # launches no D = 192 (instance_dim)
                    dims = TC_BWD_HEAD_DIMS
                for dt in TC_DTYPES:
                    for D in dims:
                        T, mT = CUDA_TYPES[dt], _MANGLED_T[dt]
                        if k not in VARIANT_KERNELS:
                            out.append(Instance(src, k, dt, D, f"{k}<{T}, {D}>",
                                                f"_Z{len(k)}{k}I{mT}Li{D}EE"))
                            continue
                        for var, vl in VARIANT_FLAGS:
                            if k in ("flash2_fwd_wg", "flash2_fwd_tc"):   # <T, D, VAR, VL, CAP_ONLY>
                                cap = wg_cap(dt, D) if k == "flash2_fwd_wg" else tc_cap(dt, D)
                                kinds = [(var, False)] + ([(CAP_ONLY, True)] if var and not vl
                                                          and cap else [])
                                out.extend(Instance(
                                    src, k, dt, D,
                                    f"{k}<{T}, {D}, {str(bool(v)).lower()}, {str(vl).lower()}, "
                                    f"{str(f).lower()}>",
                                    f"_Z{len(k)}{k}I{mT}Li{D}ELb{int(bool(v))}ELb{int(vl)}ELb{int(f)}EE",
                                    v, vl)
                                    for v, f in kinds)
                                continue
                            if k == "flash2_fwd_ws" and not vl:   # <T, D, VAR, MAX>
                                kinds = [var] + ([CAP_ONLY] if var else []) + (
                                    [LAZY_BF16] if var and dt == "bfloat16" and diagonal_first(D) else [])
                                out.extend(Instance(
                                    src, k, dt, D,
                                    f"{k}<{T}, {D}, {str(bool(v)).lower()}, {ws_max(dt, v)}>",
                                    f"_Z{len(k)}{k}I{mT}Li{D}ELb{int(bool(v))}ELi{ws_max(dt, v)}EE", v)
                                    for v in kinds)
                            if k in WS_KERNELS:    # no varlen instance, and no VL argument
                                if not vl and k != "flash2_fwd_ws":
                                    out.append(Instance(
                                        src, k, dt, D, f"{k}<{T}, {D}, {str(var).lower()}>",
                                        f"_Z{len(k)}{k}I{mT}Li{D}ELb{int(var)}EE", var))
                                continue
                            out.append(Instance(
                                src, k, dt, D,
                                f"{k}<{T}, {D}, {str(var).lower()}, {str(vl).lower()}>",
                                f"_Z{len(k)}{k}I{mT}Li{D}ELb{int(var)}ELb{int(vl)}EE", var, vl))
            else:
                for dt in CUDA_TYPES:
                    out.append(Instance(src, k, dt, None, f"{k}<{CUDA_TYPES[dt]}>",
                                        f"_Z{len(k)}{k}I{_MANGLED_T[dt]}E"))
    return out


def _splitkv_instance(k: str, dt: str, D: int) -> Instance:
    src, T, mT = "splitkv_tc.cu", CUDA_TYPES[dt], _MANGLED_T[dt]
    if k.startswith("splitkv_fwd_tc_m") and "_cl" in k:
        Br, CL = (int(x) for x in re.fullmatch(r"splitkv_fwd_tc_m(\d+)_cl(\d+)", k).groups())
        return Instance(src, k, dt, D, f"splitkv_fwd_tc_cl<{T}, {D}, {Br // 16}, {CL}>",
                        f"_Z17splitkv_fwd_tc_clI{mT}Li{D}ELi{Br // 16}ELi{CL}EE")
    if k.startswith("splitkv_fwd_tc_m"):
        WM = int(k.rsplit("_m", 1)[1]) // 16
        return Instance(src, k, dt, D, f"splitkv_fwd_tc<{T}, {D}, {WM}>",
                        f"_Z14splitkv_fwd_tcI{mT}Li{D}ELi{WM}EE")
    return Instance(src, k, dt, D, f"{k}<{T}, {D}>", f"_Z{len(k)}{k}I{mT}Li{D}EE")


@functools.lru_cache(maxsize=None)
def instance(kernel: str, dtype: str, D: int | None, variant: bool = False,
             varlen: bool = False) -> Instance:
    """The instance of ``kernel`` for this dtype (and head dim, where it is a template
    argument; softcap/ALiBi, ``variant``; packed varlen batches, ``varlen``), with its
    source and NVRTC name expression."""
    for i in instances():
        if (i.kernel == kernel and i.dtype == dtype and i.D == D and i.variant == variant
                and i.varlen == varlen):
            return i
    raise KeyError(f"no instance of {kernel} for dtype={dtype}, D={D}, variant={variant}, "
                   f"varlen={varlen}")


def kernel_dir() -> Path:
    """kernels_cu/: installed beside the package as flashsim/kernels_cu, or the
    repository's top-level folder when running from a checkout."""
    installed = Path(__file__).resolve().parent / "kernels_cu"
    if (installed / "common.cuh").is_file():
        return installed
    repo = Path(__file__).resolve().parent.parent / "kernels_cu"
    if (repo / "common.cuh").is_file():
        return repo
    raise FileNotFoundError("the CUDA sources (kernels_cu/common.cuh) are missing from "
                            "this installation; reinstall flashsim")


@functools.lru_cache(maxsize=None)
def io_counters() -> tuple[tuple[str, str], ...]:
    """(tensor, "read"|"write") per counter of the instrumented build, in the order of
    the IoCounter enum in kernels_cu/common.cuh (read from the header itself, so the two
    cannot drift apart)."""
    text = (kernel_dir() / "common.cuh").read_text()
    body = re.search(r"enum\s+IoCounter\s*\{(.*?)\}", text, re.S).group(1)
    body = re.sub(r"//[^\n]*", "", body)
    names = [n.strip() for n in body.replace("\n", " ").split(",") if n.strip()]
    out = []
    for n in names:
        if n == "IO_NUM_COUNTERS":
            break
        m = re.fullmatch(r"IO_(\w+)_([RW])", n)
        if not m:
            raise ValueError(f"unexpected I/O counter name {n!r} in common.cuh")
        out.append((m.group(1), "read" if m.group(2) == "R" else "write"))
    return tuple(out)


def name_expressions(source: str = "flash2_ref.cu", cc: int | None = None) -> list[str]:
    """NVRTC name expressions of ``source``'s instances; with ``cc`` (the target's compute
    capability, 0 for the CPU emulation) only those that run there (`runs_on`)."""
    return [i.expr for i in instances(source) if cc is None or runs_on(i.kernel, cc)]


# kernels that need thread block clusters (compute capability 9.0): built and launched
# there alone
CLUSTER_MIN_CC = 90


def runs_on(kernel: str, cc: int) -> bool:
    """Whether ``kernel`` is built for, and launched on, compute capability ``cc`` (0:
    the CPU emulation): the decoding kernels whose parts merge in a cluster need 9.0."""
    return not ("_cl" in kernel and kernel.startswith("splitkv")) or cc >= CLUSTER_MIN_CC


# -- tile shapes --------------------------------------------------------------------------

def smem_bytes(kernel: str, Br: int, Bc: int, d: int, dv: int, dtype: str) -> int:
    """Dynamic shared memory of one CTA (arrays of the accumulation type, see the
    kernel's smem layout)."""
    a = ACC_BYTES[dtype]
    if kernel == "flash2_fwd":
        return (Br * d + Bc * d + Bc * dv + Br * Bc + Br * dv + 3 * Br) * a
    if kernel == "flash2_bwd_main":
        return (2 * Bc * d + 2 * Bc * dv + Br * d + Br * dv + 2 * Br * Bc + 2 * Br) * a
    if kernel == "flash2_fwd_tc":   # Q_i, and K_j, V_j double-buffered, in the I/O type
        return (Br + 4 * Bc) * tc_row(d) * 2
    if kernel == "flash2_fwd_wg":   # the same, plus room to start the tiles on 1024 bytes
        return (Br * d + 4 * Bc * d) * 2 + 1024
    if kernel == "flash2_fwd_ws":   # as its CTAs walking several tiles take it
        return ws_forward_smem(Br, Bc, d, walking=True)
    if kernel in ("flash2_bwd_tc", "flash2_bwd_tc_det"):
        # K_j, V_j; Q_i, dO_i double-buffered (rows of tc_row(d)); Pᵀ, dSᵀ (padded); L, D
        return ((2 * Bc + 4 * Br) * tc_row(d) + 2 * Bc * (Br + 8)) * 2 + 4 * Br * 4
    if kernel in ("flash2_bwd_wg", "flash2_bwd_wg_det"):
        # K_j, V_j; Q_i, dO_i double-buffered; dSᵀ (swizzled, unpadded); L, D; and room
        # to start the tiles on 1024 bytes; above 128 (step_wide) also Pᵀ (laid out as dSᵀ)
        wide = Bc * Br * 2 if d > 128 else 0
        return (2 * Bc * d + 4 * Br * d + Bc * Br) * 2 + 4 * Br * 4 + 1024 + wide
    if kernel in ("flash2_bwd_ws", "flash2_bwd_ws_det"):
        # the same with WS_STAGES slots of Q_i, dO_i, L_i, D_i and dSᵀ double-buffered; and
        # (not deterministic) dQ_i in fp32, in WS_BWD_DQ_BUFFERS[d] buffers (d: the instance)
        sdq = WS_BWD_DQ_BUFFERS[d] * Br * d * 4 if kernel == "flash2_bwd_ws" else 0
        return ((2 * Bc * d + 2 * WS_STAGES * Br * d + 2 * Bc * Br) * 2 + sdq
                + 2 * WS_STAGES * Br * 4 + 1024)
    if kernel == "flash1_fwd":      # K_j, V_j; Q_i, O_i; S; m, ℓ and O's two weights
        return (Bc * d + Bc * dv + Br * d + Br * dv + Br * Bc + 4 * Br) * a
    if kernel == "flash1_bwd":      # K_j, V_j, dK_j, dV_j; Q_i, dO_i, dQ_i; P, dS; m, ℓ, D
        return (2 * Bc * d + 2 * Bc * dv + 2 * Br * d + Br * dv + 2 * Br * Bc + 3 * Br) * a
    if kernel in ("standard_fwd_scores", "standard_bwd_dp"):   # the held rows, a streamed tile
        n = d if kernel == "standard_fwd_scores" else dv
        return (Br + Bc) * n * a
    if kernel in ("standard_fwd_out", "standard_bwd_dq", "standard_bwd_dv", "standard_bwd_dk"):
        n = d if kernel in ("standard_bwd_dq", "standard_bwd_dk") else dv
        held, streamed = (Br, Bc) if kernel in ("standard_fwd_out", "standard_bwd_dq") else (Bc, Br)
        return (held * n + Br * Bc + streamed * n) * a   # the output tile, X_ij, the other operand
    if kernel == "square_fwd_scores":   # S_ij (B×B, Br = Bc = B), Q_i[:, c], K_j[:, c]; m̃
        return (Br * Br + 2 * Br * min(Br, d) + Br) * a
    if kernel == "square_fwd_out":      # E_ij, V_j[:, c], O_i[:, c]; m, ℓ, m̃ and two weights
        return (Br * Br + 2 * Br * min(Br, dv) + 5 * Br) * a
    if kernel.startswith("splitkv_fwd_tc_"):
        # Q_i; K_j, V_j in STAGES; staged page ids; each key group's m, ℓ and weight
        # per row (the merge's O, and a cluster's partial, reuse the K/V stages)
        WN = SPLITKV_THREADS // 32 // (Br // 16)
        return ((Br * d + 2 * SPLITKV_STAGES[Br] * Bc * d) * 2 + SPLITKV_PAGE_CHUNK * 4
                + 3 * WN * Br * 4)
    return 0


BLOCK_CHOICES = (64, 32, 16, 8, 4, 2, 1)

# the kernels each reference-rung algorithm launches with tiles, forward and backward
ALGORITHM_KERNELS = {
    ("flash2", False): ("flash2_fwd",), ("flash2", True): ("flash2_bwd_main",),
    ("flash1", False): ("flash1_fwd",), ("flash1", True): ("flash1_bwd",),
    ("standard", False): ("standard_fwd_scores", "standard_fwd_out"),
    ("standard", True): ("standard_fwd_scores", "standard_bwd_dv", "standard_bwd_dp",
                         "standard_bwd_dq", "standard_bwd_dk"),
    ("square", False): ("square_fwd_scores", "square_fwd_out"),   # forward only
}
# standard attention's row passes hold a row of S, P, dP (a whole row each) in shared
# memory, in the I/O type, beside one accumulator per thread for their reductions
ROW_KERNELS = {"standard_fwd_softmax": 1, "standard_bwd_ds": 3}


def row_smem_bytes(kernel: str, Nk: int, dtype: str, softcap: bool = True) -> int:
    """Dynamic shared memory of a row pass of standard attention for rows of Nk keys (the
    dS pass holds S too only with a softcap)."""
    rows = ROW_KERNELS[kernel] - (kernel == "standard_bwd_ds" and not softcap)
    item = ITEM_BYTES[dtype]
    return REF_THREADS * ACC_BYTES[dtype] + rows * Nk * item


ITEM_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


def default_block_sizes(d: int, dv: int, dtype: str, smem_limit: int,
                        backward: bool = False, algorithm: str = "flash2") -> tuple[int, int]:
    """The largest square tile B×B (B in 64, 32, 16, …) whose CTAs (every tiled kernel of
    the reference rung's ``algorithm``) fit ``smem_limit`` bytes; pass these to
    `flashsim.simulate` to predict the kernels' traffic."""
    names = ALGORITHM_KERNELS[(algorithm, bool(backward))]
    for B in BLOCK_CHOICES:
        if all(smem_bytes(k, B, B, d, dv, dtype) <= smem_limit for k in names):
            return B, B
    raise ValueError(f"no tile fits {smem_limit} bytes of shared memory at d={d}, dv={dv}")


# -- ahead-of-time build --------------------------------------------------------------

@dataclass(frozen=True)
class BuildRow:
    kernel: str
    dtype: str
    D: int | None
    instrumented: bool
    registers: int
    smem_static: int
    stack: int
    spill_stores: int
    spill_loads: int
    variant: bool | int = False
    varlen: bool = False
    # ptxas serialised the warpgroup MMAs (C7510, C7511, …: "wgmma.mma_async instructions
    # are serialized"): each waits for the one before it, which costs far more than a spill
    wgmma_serialized: bool = False


_PTXAS_SERIAL = re.compile(r"wgmma\.mma_async instructions are serialized.*?function '(\w+)'")
_PTXAS_FUNC = re.compile(r"Compiling entry function '(\w+)' for '(\w+)'")
_PTXAS_USED = re.compile(r"Used (\d+) registers")
_PTXAS_SMEM = re.compile(r"(\d+) bytes smem")
_PTXAS_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def _build_cache_dir() -> Path:
    return (Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flashsim"
            / "build")


@functools.lru_cache(maxsize=None)
def _nvcc_version(nvcc: str) -> str:
    return subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout


_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)


def includes(src: str, kdir: Path | None = None) -> list[str]:
    """``src`` and the project headers it includes, directly or through another header
    (its `#include "…"` lines, in kernels_cu; the CUDA headers are the toolkit's version,
    which the cache key holds apart), sorted."""
    kdir = kdir or kernel_dir()
    seen, todo = set(), [src]
    while todo:
        name = todo.pop()
        if name in seen or not (kdir / name).is_file():
            continue
        seen.add(name)
        todo += _INCLUDE.findall((kdir / name).read_text())
    return sorted(seen)


def _source_digest(kdir: Path, src: str) -> str:
    """A source and the headers it includes: what its builds depend on, so that editing
    one kernel file rebuilds its own instances alone."""
    h = hashlib.sha256()
    for name in includes(src, kdir):
        h.update(name.encode() + b"\0" + (kdir / name).read_bytes() + b"\0")
    return h.hexdigest()


def find_nvrtc(lib: str | None = None) -> Path:
    """The NVRTC library to build with: ``lib``, else $FLASHSIM_NVRTC, else one from the
    NVIDIA wheels CuPy depends on (nvidia-cuda-nvrtc: nvidia/cu13/lib, nvidia/cuda_nvrtc/
    lib), else the CUDA toolkit's beside nvcc. FileNotFoundError if none is found."""
    lib = lib or os.environ.get("FLASHSIM_NVRTC")
    if lib:
        if not Path(lib).is_file():
            raise FileNotFoundError(f"no NVRTC library at {lib}")
        return Path(lib)
    import importlib.util
    dirs = []
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        dirs += [Path(root) / "cu13" / "lib", Path(root) / "cuda_nvrtc" / "lib"]
    if (nvcc := shutil.which("nvcc")):
        dirs += [Path(nvcc).resolve().parent.parent / d for d in ("lib64", "lib")]
    for d in dirs:
        hits = sorted(d.glob("libnvrtc.so*")) if d.is_dir() else []
        if hits:
            return hits[-1]
    raise FileNotFoundError("no NVRTC library found: pip install nvidia-cuda-nvrtc (the one "
                            "CuPy loads), or name one with --nvrtc PATH or FLASHSIM_NVRTC")


@functools.lru_cache(maxsize=None)
def _nvrtc(lib: str):
    """NVRTC loaded by ctypes, its builtins library first (libnvrtc opens it by name, and
    a library of that name already loaded is the one it gets), and its version."""
    import ctypes
    for b in sorted(Path(lib).parent.glob("libnvrtc-builtins.so*")):
        if ".alt." not in b.name:
            ctypes.CDLL(str(b), mode=ctypes.RTLD_GLOBAL)
            break
    n = ctypes.CDLL(lib)
    major, minor = ctypes.c_int(), ctypes.c_int()
    n.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return n, f"NVRTC {major.value}.{minor.value}"


def _nvrtc_compile(lib: str, src: str, code: str, exprs: list[str], opts: list[str]) -> str:
    """ptxas's report (--ptxas-options=-v) of one program of ``exprs`` built by NVRTC as
    flashsim.gpu builds it; RuntimeError with NVRTC's log if it fails."""
    import ctypes
    n, _ = _nvrtc(lib)
    prog = ctypes.c_void_p()
    n.nvrtcCreateProgram(ctypes.byref(prog), code.encode(), src.encode(), 0, None, None)
    try:
        for e in exprs:
            n.nvrtcAddNameExpression(prog, e.encode())
        args = (ctypes.c_char_p * len(opts))(*(o.encode() for o in opts))
        rc = n.nvrtcCompileProgram(prog, len(opts), args)
        size = ctypes.c_size_t()
        n.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        n.nvrtcGetProgramLog(prog, log)
        log = log.value.decode(errors="replace")
    finally:
        n.nvrtcDestroyProgram(ctypes.byref(prog))
    if rc != 0:
        raise RuntimeError(f"NVRTC failed on {src} ({' '.join(opts)}):\n{log}")
    return log


def build(arch: str = "sm_90", *, nvcc: str | None = None, source: str | None = None,
          instrumented: bool | None = None, cache: bool = True,
          nvrtc: str | bool | None = None) -> list[BuildRow]:
    """Compile every kernel instance with nvcc (no GPU needed) and return ptxas's
    registers, static shared memory, stack and spill bytes per instance. Raises
    RuntimeError with the compiler's output if anything fails to compile. ``cache``:
    ptxas's report of each compilation is kept under ~/.cache/flashsim/build, keyed by the
    nvcc version, the command, the instances, and the kernel's source with the headers it
    includes (`includes`), so an unchanged build (the test suite's, then `flashsim kernels
    build`'s) compiles once, and an edit to one source rebuilds that source's instances.

    ``nvrtc``: build with NVRTC instead, the compiler that flashsim.gpu builds the kernels
    with on the GPU's machine, one instance per program with the same options as there
    (True: the library `find_nvrtc` finds; a string: its path). Its builds can differ
    from nvcc's of the same version (NVRTC 13.0 spilled where nvcc 13.0 did not, NOTES
    v80); the CUDA headers come from $CUDA_PATH, $CUDA_HOME, the toolkit above nvcc or
    /usr/local/cuda."""
    if not re.fullmatch(r"sm_\d{2,3}a?", arch):
        raise ValueError(f"arch must look like sm_80 or sm_90, got {arch!r}")
    nvcc = nvcc or shutil.which("nvcc")
    lib = None
    if nvrtc:
        lib = str(find_nvrtc(nvrtc if isinstance(nvrtc, str) else None))
        homes = [os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"),
                 nvcc and str(Path(nvcc).resolve().parent.parent), "/usr/local/cuda"]
        cuda = next((h for h in homes if h and (Path(h) / "include" / "cuda_fp16.h").is_file()),
                    None)
        if cuda is None:
            raise FileNotFoundError("NVRTC needs the CUDA headers (cuda_fp16.h): set "
                                    "CUDA_PATH to the toolkit")
    elif nvcc is None:
        raise FileNotFoundError("nvcc is not on PATH; install the CUDA toolkit to build")
    modes = (False, True) if instrumented is None else (instrumented,)
    kdir = kernel_dir()
    sources = [source] if source is not None else list(SOURCES)
    # one nvcc per (source, build, kernel): the jobs run in parallel, one per core (ptxas
    # on the tensor-core kernels' 255-register instances is most of the time); NVRTC, as
    # flashsim.gpu, one program per instance
    jobs = [(src, count_io, k, target, e) for src in sources for count_io in modes
            for k in SOURCES[src] if (target := source_arch(src, arch)) is not None
            and runs_on(k, int(re.sub(r"\D", "", target)))
            for e in ([i.expr for i in instances(src) if i.kernel == k] if lib else [None])]

    version = _nvrtc(lib)[1] if lib else _nvcc_version(nvcc)
    digests = {src: _source_digest(kdir, src) + version for src in sources} if cache else {}

    def compile_one(job, tmp):
        src, count_io, k, target, expr = job
        digest = digests.get(src)
        if lib:
            key = None
            if digest is not None:
                key = hashlib.sha256(repr((digest, job, cuda)).encode()).hexdigest()
                hit = _build_cache_dir() / f"{key}.ptxas"
                if hit.is_file():
                    return _parse_ptxas(hit.read_text(), src, count_io)
            opts = ["--std=c++17", f"-I{kdir}", f"-I{cuda}/include", f"-arch={target}",
                    "--ptxas-options=-v"] + (["-DFLASHSIM_COUNT_IO"] if count_io else [])
            log = _nvrtc_compile(lib, src, (kdir / src).read_text(), [expr], opts)
            if key is not None:
                _cache_put(key, log)
            return _parse_ptxas(log, src, count_io)
        key = None
        exprs = [i.expr for i in instances(src) if i.kernel == k]
        if digest is not None:
            # the instance list is Python's (e.g. WS_BWD_HEAD_DIMS): part of the key too
            key = hashlib.sha256(repr((digest, job, exprs)).encode()).hexdigest()
            hit = _build_cache_dir() / f"{key}.ptxas"
            if hit.is_file():
                return [r for r in _parse_ptxas(hit.read_text(), src, count_io) if r.kernel == k]
        inst = Path(tmp) / "instances.cu"
        refs = ",\n    ".join(f"(void*)&{e}" for e in exprs)
        inst.write_text(f'#include "{src}"\n'
                        f"void* flashsim_instances[] = {{\n    {refs}\n}};\n")
        # -gencode, not -arch, for sm_90a: -arch=sm_90a would add a plain sm_90 pass,
        # which rejects wgmma
        gen = (f"-gencode=arch=compute_{target[3:]},code={target}" if target.endswith("a")
               else f"-arch={target}")
        cmd = [nvcc, gen, "-std=c++17", "-cubin", "-Xptxas", "-v",
               f"-I{kdir}", "-o", str(Path(tmp) / "out.cubin"), str(inst)]
        if count_io:
            cmd.insert(1, "-DFLASHSIM_COUNT_IO")
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc failed ({' '.join(cmd)}):\n{proc.stderr}")
        if key is not None:
            _cache_put(key, proc.stderr)
        return [r for r in _parse_ptxas(proc.stderr, src, count_io) if r.kernel == k]

    with tempfile.TemporaryDirectory() as tmp:
        dirs = [Path(tmp) / str(n) for n in range(len(jobs))]
        for d in dirs:
            d.mkdir()
        with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
            done = list(pool.map(compile_one, jobs, dirs))
    return [r for rows in done for r in rows]


def _cache_put(key: str, log: str):
    try:
        _build_cache_dir().mkdir(parents=True, exist_ok=True)
        part = _build_cache_dir() / f"{key}.{os.getpid()}.{threading.get_ident()}.tmp"
        part.write_text(log)
        part.replace(_build_cache_dir() / f"{key}.ptxas")
    except OSError:
        pass                             # a read-only home: no cache, the same result


def _parse_ptxas(log: str, source: str, count_io: bool) -> list[BuildRow]:
    names = {i.mangled: (i.kernel, i.dtype, i.D, i.variant, i.varlen)
             for i in instances(source)}
    rows, current, info = [], None, {}
    serial = {m.group(1) for m in _PTXAS_SERIAL.finditer(log)}

    def flush():
        if current is not None:
            (k, dt, D, var, vl), func = current
            rows.append(BuildRow(k, dt, D, count_io, info.get("regs", 0), info.get("smem", 0),
                                 info.get("stack", 0), info.get("st", 0), info.get("ld", 0),
                                 var, vl, func in serial))

    for line in log.splitlines():
        m = _PTXAS_FUNC.search(line)
        if m:
            flush()
            current = next(((v, m.group(1)) for p, v in names.items()
                            if m.group(1).startswith(p)), None)
            info = {}
            continue
        if (m := _PTXAS_USED.search(line)):
            info["regs"] = int(m.group(1))
            if (s := _PTXAS_SMEM.search(line)):
                info["smem"] = int(s.group(1))
        if (m := _PTXAS_STACK.search(line)):
            info["stack"], info["st"], info["ld"] = map(int, m.groups())
    flush()
    return rows


def format_build(rows: list[BuildRow], arch: str) -> str:
    head = (f"{'kernel':<26}{'dtype':<10}{'D':>4} {'build':<14}{'regs':>5}{'smem':>7}"
            f"{'stack':>7}{'spill st/ld':>13}")
    lines = [f"kernels built for {arch} (dynamic shared memory is sized per launch)", head,
             "-" * len(head)]
    for r in sorted(rows, key=lambda r: (r.instrumented, r.kernel, r.variant, r.varlen,
                                         r.dtype, r.D or 0)):
        build_kind = "instrumented" if r.instrumented else "fast path"
        name = r.kernel + (" +varlen" if r.varlen else " +cap" if r.variant == CAP_ONLY
                           else " +lazy" if r.variant == LAZY_BF16 else " +var" if r.variant else "")
        lines.append(f"{name:<26}{r.dtype:<10}{r.D or '-':>4} {build_kind:<14}{r.registers:>5}"
                     f"{r.smem_static:>7}{r.stack:>7}{f'{r.spill_stores}/{r.spill_loads}':>13}"
                     + ("  wgmma serialized" if r.wgmma_serialized else ""))
    built = {r.kernel for r in rows}
    for src, target in ARCH_SPECIFIC.items():
        if built & set(SOURCES[src]):
            lines.append(f"({', '.join(SOURCES[src])}: built for {target})")
    return "\n".join(lines)
