"""Decoding over a KV cache on the GPU: flashsim.kvcache's schedule (append, split-KV
attention with the query heads of a K/V head packed into one tile's rows, combine) run by
splitkv_tc.cu, counted byte for byte as the simulator counts it.

    out, lse = fs.gpu.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens,
                                             block_table=table, k=k_new, v=v_new)
    plan = fs.gpu.kvcache_plan(q, k_cache, cache_seqlens=lens, block_table=table)
    fs.simulate_kvcache(..., block_sizes=plan.block_sizes, num_splits=plan.num_splits)
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from .. import kernels as K
from ..kvcache import make_layout, num_splits_heuristic
from ..problem import check_scale, check_size
from ..tiling import cdiv
from . import _arrays as arrays, _device as dev
from .flash2 import negated


@dataclass(frozen=True)
class KVCachePlan:
    """How `attention_with_kvcache` runs these inputs: the kernel, its tile (Br packed
    query rows, Bc keys), the K/V splits per Q tile, and the thread blocks of the split
    kernel's grid (splits × Q tiles × batch · kv_heads). Pass ``block_sizes``,
    ``num_splits`` and ``cluster`` to `flashsim.simulate_kvcache` to predict the kernels'
    traffic."""
    kernel: str
    block_sizes: tuple[int, int]
    num_splits: int
    grid: tuple[int, int, int]

    @property
    def cluster(self) -> bool:
        """Whether a Q tile's parts run as one thread block cluster and merge their
        partials through distributed shared memory (none reaches memory)."""
        return "_cl" in self.kernel


def _host_ints(x, name: str) -> np.ndarray:
    """An integer array's values on the host (checked before any launch)."""
    a = np.asarray(arrays.host_values(x))
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name} must be integers (int32), got dtype {a.dtype}")
    return a


def _cache(x, name: str) -> arrays.In:
    """A cache array, used in place: it must be contiguous, as the append writes into it."""
    if type(x).__module__.split(".")[0] == "torch":
        if not x.is_contiguous():
            raise ValueError(f"{name} must be contiguous: the append writes into it in place")
    elif hasattr(x, "flags") and not x.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous: the append writes into it in place")
    return arrays.In(x, name)


@dataclass
class _Problem:
    q: arrays.In
    kc: arrays.In
    vc: arrays.In
    kn: arrays.In | None
    vn: arrays.In | None
    batch: int
    Nq: int
    heads: int
    kv_heads: int
    d: int
    Nnew: int
    seqlens: np.ndarray          # rows before the append (host)
    table: np.ndarray | None     # the block table (host), or None for a contiguous cache
    page_rows: int


def _problem(q, k_cache, v_cache, cache_seqlens, block_table, k, v) -> _Problem:
    qi = arrays.In(q, "q").dense()            # the decoding kernels read dense q, k, v
    kc, vc = _cache(k_cache, "k_cache"), _cache(v_cache, "v_cache")
    for name, x in (("q", qi), ("k_cache", kc), ("v_cache", vc)):
        if len(x.shape) != 4:
            raise ValueError(f"{name} must have 4 axes, got shape {x.shape}: q is (batch, Nq, "
                             "heads, d); the caches (batch, capacity, kv_heads, d), or "
                             "(num_pages, page_size, kv_heads, d) with block_table")
    batch, Nq, heads, d = qi.shape
    if not (qi.dtype == kc.dtype == vc.dtype):
        raise TypeError(f"q, k_cache, v_cache must share one dtype, got {qi.dtype}, "
                        f"{kc.dtype}, {vc.dtype}")
    if kc.shape != vc.shape:
        raise ValueError(f"k_cache {kc.shape} and v_cache {vc.shape} must have one shape "
                         "(the kernels take dv = d)")
    if kc.shape[3] != d:
        raise ValueError(f"k_cache's last axis is {kc.shape[3]}; q's d is {d}")
    if qi.dtype not in K.TC_DTYPES or d not in K.SPLITKV_HEAD_DIMS:
        raise ValueError(f"the decoding kernels take float16 or bfloat16 with d in "
                         f"{K.SPLITKV_HEAD_DIMS}; got {qi.dtype}, d={d} (fs.simulate_kvcache "
                         "runs any)")
    kv_heads = kc.shape[2]
    if (k is None) != (v is None):
        raise ValueError("give both k and v to append, or neither")
    kn = vn = None
    Nnew = 0
    if k is not None:
        kn, vn = arrays.In(k, "k").dense(), arrays.In(v, "v").dense()
        want = (batch, kn.shape[1] if len(kn.shape) == 4 else -1, kv_heads, d)
        if kn.shape != want or vn.shape != want:
            raise ValueError(f"k, v must be (batch={batch}, Nnew, kv_heads={kv_heads}, d={d}); "
                             f"got {kn.shape} and {vn.shape}")
        if kn.dtype != qi.dtype or vn.dtype != qi.dtype:
            raise TypeError(f"k, v must have q's dtype {qi.dtype}, got {kn.dtype}, {vn.dtype}")
        Nnew = kn.shape[1]
    seqlens = _host_ints(cache_seqlens, "cache_seqlens")
    paged = block_table is not None
    table = _host_ints(block_table, "block_table") if paged else None
    if paged:
        page_rows = kc.shape[1]
        if page_rows % K.SPLITKV_PAGE_MULTIPLE:
            raise ValueError(f"page size {page_rows} (k_cache.shape[1]) must be a multiple of "
                             f"{K.SPLITKV_PAGE_MULTIPLE} rows")
    else:
        page_rows = kc.shape[1]
        if kc.shape[0] != batch:
            raise ValueError(f"a contiguous cache has one row of pages per sequence: k_cache's "
                             f"first axis is {kc.shape[0]}, q's batch is {batch} (give "
                             "block_table for a paged cache)")
    # the simulator's checks and messages: sizes, GQA, lengths, capacity, table range
    make_layout(batch=batch, Nq=Nq, heads=heads, kv_heads=kv_heads, d=d,
                cache_seqlens=seqlens, Nnew=Nnew,
                capacity=None if paged else kc.shape[1],
                page_size=page_rows if paged else None,
                num_pages=kc.shape[0], block_table=table)
    if int(seqlens.max()) + Nnew >= 2**31:
        raise ValueError(f"cache lengths must fit in int32, got up to {int(seqlens.max()) + Nnew}")
    return _Problem(qi, kc, vc, kn, vn, batch, Nq, heads, kv_heads, d, Nnew,
                    seqlens.astype(np.int64), table, page_rows)


def _write_back(cp, user, arr):
    """Where the kernels appended into a device copy of the user's cache (a NumPy array,
    or a CPU tensor on a GPU), copy the result back so the append lands in place."""
    if dev.pointer(arr) == _address(user):
        return
    host = cp.asnumpy(arr)
    if type(user).__module__.split(".")[0] == "torch":
        import torch
        t = torch.from_numpy(host)
        user.copy_(t.view(torch.bfloat16) if user.dtype == torch.bfloat16 else t)
    else:
        user[...] = host.view(user.dtype).reshape(user.shape)


def _address(x) -> int | None:
    if type(x).__module__.split(".")[0] == "torch":
        return x.data_ptr()
    if isinstance(x, np.ndarray):
        return x.ctypes.data
    if hasattr(x, "__cuda_array_interface__"):
        return x.__cuda_array_interface__["data"][0]
    return None


_SEMAPHORES: dict = {}


def _semaphores(cp, n: int):
    """n zeroed int32 counters for the split kernel's merge, kept per device and stream:
    each launch leaves them zero again, so no memset runs per call, and launches on two
    streams never share them."""
    stream = cp.cuda.get_current_stream()
    key = (cp.cuda.Device().id, getattr(stream, "ptr", 0))
    buf = _SEMAPHORES.get(key)
    if buf is None or buf.size < n:
        buf = cp.zeros(max(n, 1024), dtype=cp.int32)
        _SEMAPHORES[key] = buf
    return buf


def _device_sms() -> tuple[int, int, int]:
    """(SMs, compute capability, shared memory per SM) of the current device; inside
    the emulation an H100's, so that the tests see the splits an H100 would run."""
    if dev.is_emulated():
        from ..hardware import H100
        return H100.num_sms, 90, H100.smem_per_sm
    return _sm_props(dev.cupy().cuda.Device().id)


@functools.lru_cache(maxsize=None)
def _sm_props(device: int) -> tuple[int, int, int]:
    # CuPy's getDeviceProperties reads every property (milliseconds): once per device
    props = dev.cupy().cuda.runtime.getDeviceProperties(device)
    return (int(props["multiProcessorCount"]), dev.cc(device),
            int(props["sharedMemPerMultiprocessor"]))


# The merge in a cluster (splitkv_fwd_tc_m<Br>_cl<CL>, compute capability 9.0) saves the
# merge through memory's partials, fence, counter and L2 round trips: about 1 µs of a
# decoding step on an H100 for a tile of up to 16 packed rows, 10 µs and more for 64
# (the partials grow with the rows); it pays where the parts are short beside that: at
# most CLUSTER_PART_TILES K/V tiles per 16 packed rows (kernels_cu/NOTES.md v35, v36).
# Clusters of 4 and 8 CTAs find at most 7/8 of an H100's SMs (a GPC whose SMs are not a
# multiple of the cluster keeps the rest idle: 128 CTAs in clusters of 4 or 8 ran on 120
# SMs, 8 of them holding two).
CLUSTER_PART_TILES = 8


def cluster_splits(work: int, num_sms: int, kv_tiles: int, num_splits: int,
                   rows: int = 16, ctas_per_sm: int = 1) -> int | None:
    """The parts per cluster for ``work`` Q tiles of ``rows`` packed rows whose caches
    span ``kv_tiles`` K/V tiles, where the merge through memory would take
    ``num_splits`` parts: the largest of `kernels.SPLITKV_CLUSTERS` no larger than that
    whose CTAs all run at once (``ctas_per_sm`` on each SM a cluster of that size can
    use), if its parts are short (at most CLUSTER_PART_TILES tiles per 16 rows); None:
    merge through memory."""
    longest = CLUSTER_PART_TILES * max(1, cdiv(rows, 16))
    for CL in sorted(K.SPLITKV_CLUSTERS, reverse=True):
        sms = num_sms if CL <= 2 else num_sms * 7 // 8
        if CL > num_splits or work * CL > sms * ctas_per_sm:
            continue
        return CL if cdiv(kv_tiles, CL) <= longest else None
    return None


def _plan(pr: _Problem, num_splits, cluster=None) -> KVCachePlan:
    if cluster is not None and not isinstance(cluster, (bool, np.bool_)):
        raise TypeError(f"cluster must be True, False or None, got {cluster!r}")
    G = pr.heads // pr.kv_heads
    M = pr.Nq * G
    Br, Bc = K.splitkv_rows(M), K.SPLITKV_BC
    name = f"splitkv_fwd_tc_m{Br}"
    Tr = cdiv(M, Br)
    work = pr.batch * pr.kv_heads * Tr
    kv_tiles = cdiv(int((pr.seqlens + pr.Nnew).max()), Bc)
    sms, cc, smem_per_sm = _device_sms()
    if Br == 16:
        # the 16-row kernel (3 K/V tiles in flight per CTA) fills the SMs one CTA each, and
        # its split rule counts every part's fixed costs (its Q tile, its first K/V tile's
        # latency, its partial and counter) as a 64-row combine: fewer, longer parts; with
        # the 3 stages, 0.77–1.04× (mean 0.93×) the time of 2 stages and the occupancy
        # rule over 48 decoding steps on an H100 (kernels_cu/NOTES.md v33). Its clusters
        # count one CTA per SM too (two per SM in clusters of 4 ran up to 5% slower, v35)
        per_sm, rows = 1, 64
    else:
        smem = K.smem_bytes(name, Br, Bc, pr.d, pr.d, pr.q.dtype)
        per_sm = max(1, K.ctas_per_sm(threads=K.SPLITKV_THREADS,
                                      registers=K.registers(name, pr.d, cc), smem=smem,
                                      smem_per_sm=smem_per_sm))
        rows = min(Br, M)
    if num_splits is None:
        s = num_splits_heuristic(work, sms, kv_tiles, ctas_per_sm=per_sm, balance_waves=True,
                                 combine_rows=rows, Bc=Bc)
    else:
        s = check_size("num_splits", num_splits, 1)
        if s > 65535:
            raise ValueError(f"num_splits must be at most 65535, got {s}")
    # the merge in a cluster: compute capability 9.0 (not emulated)
    can = cc >= 90 and not dev.is_emulated()
    if cluster:
        if not can:
            raise ValueError(
                "cluster=True needs a GPU of compute capability 9.0 or later (the CPU "
                f"emulation has no clusters); got compute capability {cc / 10:.1f}"
                f"{' (emulated)' if dev.is_emulated() else ''}")
        if num_splits is None:
            s = (cluster_splits(work, sms, kv_tiles, s, min(Br, M), per_sm)
                 or max(c for c in K.SPLITKV_CLUSTERS if c <= max(s, K.SPLITKV_CLUSTERS[0])))
        elif s not in K.SPLITKV_CLUSTERS:
            raise ValueError(f"a cluster merges {K.SPLITKV_CLUSTERS} parts; got num_splits={s} "
                             "(give one of those, or cluster=False)")
    elif cluster is None and can and s > 1:
        CL = cluster_splits(work, sms, kv_tiles, s, min(Br, M), per_sm)
        cluster = CL is not None and (num_splits is None or CL == s)
        s = CL if cluster else s
    if cluster:
        name = f"splitkv_fwd_tc_m{Br}_cl{s}"
    return KVCachePlan(name, (Br, Bc), s, (s, Tr, pr.batch * pr.kv_heads))


def kvcache_plan(q, k_cache, v_cache=None, *, cache_seqlens, block_table=None, k=None,
                 v=None, num_splits=None, cluster=None) -> KVCachePlan:
    """The `KVCachePlan` that `attention_with_kvcache` follows for these inputs."""
    pr = _problem(q, k_cache, k_cache if v_cache is None else v_cache, cache_seqlens,
                  block_table, k, k if v is None else v)
    return _plan(pr, num_splits, cluster)


def attention_with_kvcache(q, k_cache, v_cache, *, cache_seqlens, block_table=None, k=None,
                           v=None, causal: bool = False, scale=None, num_splits=None,
                           cluster=None, count_io: bool = False):
    """One decoding step on the GPU, FlashAttention's ``flash_attn_with_kvcache``: append
    k, v (if given) into the cache in place at rows cache_seqlens[b] …, then attend q over
    each sequence's cache_seqlens[b] + Nnew rows. Returns (out, lse), or (out, lse,
    traffic) with ``count_io=True``; out is (batch, Nq, heads, d) in q's dtype, lse
    (batch, heads, Nq) fp32.

    Layouts and semantics are `flashsim.simulate_kvcache`'s: q (batch, Nq, heads, d); the
    caches (batch, capacity, kv_heads, d), or paged (num_pages, page_size, kv_heads, d)
    with ``block_table`` (batch, max_pages) int32; ``causal`` aligned to the bottom right.
    float16 or bfloat16, d ∈ {64, 128}, page sizes a multiple of 16. ``num_splits``: K/V
    splits per Q tile (None: the occupancy heuristic for this GPU, `kvcache_plan`).
    ``cluster``: whether a Q tile's parts run as one thread block cluster and merge
    their partials through distributed shared memory rather than memory (compute
    capability 9.0; 2, 4 or 8 parts); None: where that is faster
    (short parts, `cluster_splits`). Pass the plan's ``cluster`` to
    `flashsim.simulate_kvcache` to predict the traffic.
    The caches must be contiguous device arrays (or PyTorch CUDA tensors) for the append
    to land in them; NumPy caches are copied to the device, appended there, and the
    rows copied back."""
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    q, scale, _ = negated(q, scale)
    with arrays.stream(q):
        pr = _problem(q, k_cache, v_cache, cache_seqlens, block_table, k, v)
        plan = _plan(pr, num_splits, cluster)
        return _run(pr, plan, bool(causal), check_scale(scale, pr.d), count_io,
                    (k_cache, v_cache))


def _run(pr: _Problem, plan: KVCachePlan, causal: bool, scale: float, count_io: bool,
         caches):
    cp = dev.cupy()
    launch, O, L, io = _prepare(pr, plan, causal, scale, count_io)
    launch()
    if pr.Nnew:
        for user, arr in zip(caches, (pr.kc.arr, pr.vc.arr)):
            _write_back(cp, user, arr)
    out = arrays.out(cp, O, pr.q.dtype, pr.q.torch)
    lse = arrays.out(cp, L, "float32", pr.q.torch)
    return (out, lse, dev.traffic(cp, io)) if count_io else (out, lse)


def _prepare(pr: _Problem, plan: KVCachePlan, causal: bool, scale: float, count_io: bool):
    """The launches of one decoding step with every argument ready: (launch, O, L, io).
    ``launch()`` runs the append (if any) and the split kernel (which merges its parts)
    on the current stream;
    analysis/bench_decode.py times it apart from the Python checks of a call."""
    cp = dev.cupy()
    dtype, D = pr.q.dtype, pr.d
    i32 = np.int32
    io = dev.counters(cp, count_io)
    table = (cp.asarray(np.ascontiguousarray(pr.table, np.int32)) if pr.table is not None
             else np.uint64(0))
    max_pages = pr.table.shape[1] if pr.table is not None else 1
    num_pages = pr.kc.shape[0]
    before = cp.asarray(pr.seqlens.astype(np.int32))
    total = cp.asarray((pr.seqlens + pr.Nnew).astype(np.int32))
    s, Tr, Z = plan.grid
    Br, Bc = plan.block_sizes
    M = pr.Nq * (pr.heads // pr.kv_heads)
    st = arrays.storage(cp, dtype)
    as_torch = pr.q.torch
    O = arrays.empty(cp, (pr.batch, pr.Nq, pr.heads, D), st, dtype if as_torch else None)
    L = arrays.empty(cp, (pr.batch, pr.heads, pr.Nq), cp.float32, "float32" if as_torch else None)
    # the parts' partials, through memory (a cluster's stay in its shared memory)
    through_memory = s > 1 and not plan.cluster
    if through_memory:
        Osplit = arrays.empty(cp, (s, Z, M, D), cp.float32)
        Lsplit = arrays.empty(cp, (s, Z, M), cp.float32)
    else:
        Osplit = Lsplit = np.uint64(0)
    smem = K.smem_bytes(plan.kernel, Br, Bc, D, D, dtype)
    steps = []
    if pr.Nnew:
        steps.append((dev.kernel("kvcache_append", dtype, count_io, D), (pr.batch, 1), 0,
                      (pr.kn.arr, pr.vn.arr, pr.kc.arr, pr.vc.arr, table, before, i32(pr.Nnew),
                       i32(pr.kv_heads), i32(pr.page_rows), i32(max_pages), i32(num_pages),
                       io)))
    # the parts' counters for the merge through memory: zero, and left zero by each launch
    sem = _semaphores(cp, Tr * Z) if through_memory else np.uint64(0)
    steps.append((dev.kernel(plan.kernel, dtype, count_io, D), plan.grid, smem,
                  (pr.q.arr, pr.kc.arr, pr.vc.arr, table, total, O, L, Osplit, Lsplit, sem,
                   i32(pr.Nq), i32(pr.heads), i32(pr.kv_heads), i32(pr.page_rows),
                   i32(max_pages), i32(num_pages), i32(causal), np.float32(scale),
                   np.float32(scale * math.log2(math.e)), io)))

    def launch():
        for kernel, grid, shared, args in steps:
            dev.launch(cp, kernel, grid, shared, args, threads=K.SPLITKV_THREADS)
    return launch, O, L, io


__all__ = ["KVCachePlan", "attention_with_kvcache", "cluster_splits", "kvcache_plan"]
