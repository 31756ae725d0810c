"""Decoding over a KV cache: split-KV attention (flash-decoding) on a paged or contiguous
cache, with new keys appended in place, as serving systems store it.

    r = fs.simulate_kvcache(q, k_cache, v_cache, cache_seqlens=lens, block_table=table,
                            k=k_new, v=v_new, causal=True)
    r.out, r.lse, r.traffic, r.num_splits, r.k_cache, r.v_cache
    fs.count_kvcache(Nq=1, heads=32, kv_heads=8, d=128, cache_seqlens=lens, ...)

Layouts are FlashAttention's ``flash_attn_with_kvcache``: q (batch, Nq, heads, d);
k_cache, v_cache (batch, capacity, kv_heads, d) contiguous, or (num_pages, page_size,
kv_heads, d) paged with ``block_table`` (batch, max_pages) int32 giving each sequence's
pages in order; ``cache_seqlens`` (batch,) the rows already in each sequence's cache;
optional k, v (batch, Nnew, kv_heads, d) appended at rows cache_seqlens[b] … + Nnew − 1
before attending. Out is (batch, Nq, heads, dv), lse (batch, heads, Nq). Sequence b
attends over its L_b = cache_seqlens[b] + Nnew keys; a causal mask is aligned to the
bottom right of that (query position s sees key c iff c ≤ s + L_b − Nq).

The schedule and its counts (per sequence b and K/V head; summed over both):

- **Append**: each new row is read once from k, v ("Knew", "Vnew") and written once into
  the cache (K, V writes), before the attention reads the cache. In a paged cache the
  append reads the table entry of each page its rows land in once per sequence (one
  thread block per sequence covers all K/V heads).
- **GQA packing**: the g = heads / kv_heads query heads of one K/V head are packed into
  the rows of one Q tile (row r of the packed tile is query position r // g, head r mod
  g, FlashAttention's decoding layout), so each K/V tile is read once per K/V head, not
  once per query head. A packed tile of rows [i0, i1) sees the keys of positions
  i0 // g … (i1 − 1) // g.
- **Split-KV** (`flashsim.splitkv`): each packed Q tile's K/V range is cut into
  ``num_splits`` parts, each a thread block writing fp32 partials, then combined. With
  ``num_splits=None`` it is chosen by `num_splits_heuristic` for the hardware's SMs.
  ``cluster=True``: a Q tile's parts run as one thread block cluster and merge their
  partials through distributed shared memory, so no partial reaches HBM (at most 16
  parts; `flashsim.splitkv`).
- **Pages**: a K/V tile reads only the real rows of the sequence, wherever its pages lie:
  the traffic of a paged cache is that of a contiguous one holding the same rows (a
  partly filled last page costs its real rows). The block table itself is read once
  per thread block (4 bytes per page a block visits, tensor "block_table").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .memory import Machine
from .problem import Shape, check_scale, check_size, itemsize_of
from .splitkv import CLUSTER_MAX, count_splitkv, run_splitkv, split_bounds
from .tiling import Tiles, cdiv
from .traffic import Traffic
from .variants import make_band, make_scores

DEFAULT_BLOCKS = (64, 128)     # (Br, Bc): packed query rows per tile, keys per tile


# -- tiles with query heads packed into the rows --------------------------------------

@dataclass(frozen=True)
class PackedTiles(Tiles):
    """`Tiles` whose rows are g query heads packed per query position: row r is position
    r // g (Nq counts packed rows, Nq / g positions)."""
    g: int = 1

    @property
    def off(self) -> int:
        return self.Nk - self.Nq // self.g

    def positions(self, i0, i1):
        return i0 // self.g, (i1 - 1) // self.g + 1

    def q_ranges(self):
        raise NotImplementedError("packed tiles are for the forward (decoding) only")

    def partial(self, i: int, j: int) -> bool:
        return not self.band.unbounded

    def mask(self, i: int, j: int) -> np.ndarray:
        rows = np.arange(i * self.Br, min((i + 1) * self.Br, self.Nq)) // self.g
        cols = np.arange(j * self.Bc, min((j + 1) * self.Bc, self.Nk))
        return self.band.allowed(rows, cols, self.off)


# -- the number of splits ---------------------------------------------------------------

def num_splits_heuristic(work: int, num_sms: int, kv_tiles: int, *, ctas_per_sm: int = 1,
                         max_splits: int = 128, balance_waves: bool = False,
                         combine_rows: int = 0, Bc: int = 64) -> int:
    """Splits per Q tile that fill the GPU without paying for partials it does not need.

    ``work`` thread blocks (batch × K/V heads × packed Q tiles) run on ``num_sms`` ×
    ``ctas_per_sm`` slots. With at least 80% of the slots already busy, 1 (splitting only
    adds partials to write, read and combine). Otherwise, for s = 1 … min(max_splits,
    kv_tiles, slots), the waves w = work·s / slots fill their last wave to e(s) = w / ⌈w⌉;
    a split count is worth considering only if it shortens the longest part (⌈kv_tiles/s⌉
    < ⌈kv_tiles/(s − 1)⌉); take the smallest s whose e(s) reaches 95% of the best. (The
    FlashAttention-1 launcher's rule, with the eligibility test of FlashAttention-2's
    decoding path.)

    ``balance_waves=True`` (what `flashsim.gpu.attention_with_kvcache` uses) also splits
    a busy GPU whose waves would run less than 80% full on average (work just past the
    slots: 512 blocks on 396 slots leave the second wave 29% full, and a memory-bound
    kernel with a third of its SMs busy runs at a fraction of the bandwidth).

    ``combine_rows`` > 0 (the packed query rows of a Q tile) weighs the combine: one CTA
    per Q tile reads every part's fp32 partial of those rows (s · rows · 4·d bytes) where
    each part's CTA reads its share of the K/V tiles of ``Bc`` keys (kv_tiles · Bc · 4·d / s
    bytes in 16 bits) through its products and softmax, about four times slower per byte
    than the combine's plain loads; the sum of the two is least at s = √(4 · kv_tiles · Bc
    / rows), and no more splits than that are considered. (On an H100, 64 packed rows of a
    1024-key cache ran fastest at 8 splits, 27.6 µs, where filling the SMs alone took 16,
    33.6 µs: kernels_cu/NOTES.md v27.)"""
    work, num_sms = check_size("work", work, 1), check_size("num_sms", num_sms, 1)
    kv_tiles = check_size("kv_tiles", kv_tiles, 0)
    slots = num_sms * check_size("ctas_per_sm", ctas_per_sm, 1)
    if kv_tiles <= 1:
        return 1
    if work >= 0.8 * slots:
        waves = work / slots
        if not balance_waves or waves / math.ceil(waves) >= 0.8:
            return 1
    top = min(check_size("max_splits", max_splits, 1), kv_tiles, slots)
    if check_size("combine_rows", combine_rows, 0) > 0:
        top = max(1, min(top, math.isqrt(4 * kv_tiles * check_size("Bc", Bc, 1) // combine_rows)))
    eff = {}
    for s in range(1, top + 1):
        if s > 1 and cdiv(kv_tiles, s) == cdiv(kv_tiles, s - 1):
            continue
        w = work * s / slots
        eff[s] = w / math.ceil(w)
    best = max(eff.values())
    return min(s for s, e in eff.items() if e >= 0.95 * best)


# -- inputs -----------------------------------------------------------------------------

@dataclass(frozen=True)
class CacheLayout:
    """Sizes of one decoding call, checked: batch, Nq, heads, kv_heads, d, dv, Nnew, the
    cache rows per sequence before and after the append, and the page size (None for a
    contiguous cache)."""
    batch: int
    Nq: int
    heads: int
    kv_heads: int
    d: int
    dv: int
    Nnew: int
    seqlens: np.ndarray
    page_size: int | None

    @property
    def g(self) -> int:
        return self.heads // self.kv_heads

    @property
    def total(self) -> np.ndarray:
        return self.seqlens + self.Nnew


def _check_seqlens(cache_seqlens, batch: int) -> np.ndarray:
    s = np.asarray(cache_seqlens)
    if s.dtype.kind not in "iu":
        raise TypeError(f"cache_seqlens must be integers (int32), got dtype {s.dtype}")
    if s.shape != (batch,):
        raise ValueError(f"cache_seqlens has shape {s.shape}; q calls for ({batch},)")
    if (s < 0).any():
        raise ValueError(f"cache_seqlens must be >= 0, got {s.tolist()}")
    return s.astype(np.int64)


def make_layout(*, batch, Nq, heads, kv_heads, d, dv=None, cache_seqlens, Nnew=0,
                capacity=None, page_size=None, max_pages=None, num_pages=None,
                block_table=None) -> CacheLayout:
    batch, Nq = check_size("batch", batch, 1), check_size("Nq", Nq, 1)
    heads, kv_heads = check_size("heads", heads, 1), check_size("kv_heads", kv_heads, 1)
    d = check_size("d", d, 1)
    dv = d if dv is None else check_size("dv", dv, 1)
    Nnew = check_size("Nnew (rows of k, v to append)", Nnew, 0)
    if heads % kv_heads:
        raise ValueError(f"kv_heads ({kv_heads}) must divide heads ({heads}) for GQA/MQA")
    seqlens = _check_seqlens(cache_seqlens, batch)
    total = seqlens + Nnew
    if page_size is None:
        if capacity is not None and (total > capacity).any():
            b = int(np.argmax(total > capacity))
            raise ValueError(f"sequence {b} needs {total[b]} cache rows (cache_seqlens "
                             f"{seqlens[b]} + {Nnew} appended) but the cache holds {capacity}; "
                             "give a longer cache or append fewer rows")
    else:
        page_size = check_size("page_size", page_size, 1)
        if block_table is not None:
            table = np.asarray(block_table)
            if table.dtype.kind not in "iu":
                raise TypeError(f"block_table must be integers (int32), got {table.dtype}")
            if table.ndim != 2 or table.shape[0] != batch:
                raise ValueError(f"block_table has shape {table.shape}; it must be "
                                 f"(batch={batch}, max_pages)")
            max_pages = table.shape[1]
            need = -(-total // page_size)
            if (need > max_pages).any():
                b = int(np.argmax(need > max_pages))
                raise ValueError(f"sequence {b} needs {need[b]} pages of {page_size} rows "
                                 f"({total[b]} rows after the append) but block_table has "
                                 f"{max_pages} per sequence")
            for b in range(batch):
                used = table[b, :need[b]]
                if ((used < 0) | (used >= num_pages)).any():
                    raise ValueError(f"block_table[{b}] names pages {used.tolist()}; pages "
                                     f"are 0 … {num_pages - 1}")
        elif max_pages is not None:
            need = -(-total // page_size)
            if (need > max_pages).any():
                b = int(np.argmax(need > max_pages))
                raise ValueError(f"sequence {b} needs {need[b]} pages of {page_size} rows; "
                                 f"max_pages is {max_pages}")
    return CacheLayout(batch, Nq, heads, kv_heads, d, dv, Nnew, seqlens, page_size)


def _split_count(lay: CacheLayout, blocks, num_splits, hardware, cluster=False) -> int:
    if num_splits is not None:
        return check_size("num_splits", num_splits, 1)
    from .hardware import get as get_hardware
    hw = get_hardware(hardware)
    Br, Bc = blocks
    work = lay.batch * lay.kv_heads * cdiv(lay.Nq * lay.g, Br)
    return num_splits_heuristic(work, hw.num_sms, cdiv(int(lay.total.max()), Bc),
                                combine_rows=min(Br, lay.Nq * lay.g), Bc=Bc,
                                max_splits=CLUSTER_MAX if cluster else 128)


def _blocks(block_sizes) -> tuple[int, int]:
    try:
        Br, Bc = block_sizes
    except (TypeError, ValueError):
        raise TypeError(f"block_sizes must be a pair (Br, Bc), got {block_sizes!r}") from None
    return check_size("Br (block_sizes[0])", Br, 1), check_size("Bc (block_sizes[1])", Bc, 1)


# -- counting ---------------------------------------------------------------------------

def _sequence_traffic(lay: CacheLayout, L: int, blocks, band, b: int, s: int,
                      cluster: bool) -> Traffic:
    """One sequence's traffic: append, split-KV attention over L keys, block table."""
    Br, Bc = blocks
    rows = lay.Nq * lay.g
    shape = Shape(rows, L, lay.d, lay.dv, (lay.kv_heads,), (lay.kv_heads,), (lay.kv_heads,), 1)
    tiles = PackedTiles(rows, L, Br, Bc, band, lay.g)
    t = count_splitkv(shape, tiles, b, num_splits=s, cluster=cluster) + _append_traffic(lay, L, b)
    if lay.page_size is not None:
        t = t + Traffic(reads={"block_table": _table_bytes(tiles, s, lay)})
    return t


def _append_traffic(lay: CacheLayout, L: int, b: int) -> Traffic:
    """The append of one sequence that ends with L rows: its Nnew rows read from k, v and
    written into the cache, and in a paged cache each page they land in looked up once."""
    if not lay.Nnew:
        return Traffic()
    n = lay.Nnew * lay.kv_heads
    table = 0
    if lay.page_size is not None:
        table = 4 * ((L - 1) // lay.page_size - (L - lay.Nnew) // lay.page_size + 1)
    return Traffic(reads={"Knew": n * lay.d * b, "Vnew": n * lay.dv * b, "block_table": table},
                   writes={"K": n * lay.d * b, "V": n * lay.dv * b})


def _table_bytes(tiles: PackedTiles, s: int, lay: CacheLayout) -> int:
    """4 bytes per page each thread block's K/V range touches, per K/V head."""
    jlo, jhi = tiles.kv_ranges()
    start, stop = split_bounds(jlo, jhi, s)
    total = 0
    for a, z in zip(start.ravel().tolist(), stop.ravel().tolist()):
        if z > a:
            first = a * tiles.Bc // lay.page_size
            last = (min(z * tiles.Bc, tiles.Nk) - 1) // lay.page_size
            total += last - first + 1
    return total * 4 * lay.kv_heads


def count_kvcache(*, Nq: int, heads: int, kv_heads: int | None = None, d: int,
                  dv: int | None = None, cache_seqlens, Nnew: int = 0, page_size=None,
                  causal: bool = False, num_splits=None, cluster: bool = False,
                  block_sizes=DEFAULT_BLOCKS, io_dtype="float16", hardware="H100") -> Traffic:
    """`simulate_kvcache(...).traffic` with no arrays: ``cache_seqlens`` per sequence
    (its length is the batch), ``Nnew`` rows appended to each, ``page_size`` for a paged
    cache (None: contiguous)."""
    seqlens = np.asarray(cache_seqlens)
    if seqlens.ndim != 1 or len(seqlens) == 0:
        raise ValueError(f"cache_seqlens must be one length per sequence, (batch,); got shape "
                         f"{seqlens.shape}")
    lay = make_layout(batch=len(seqlens), Nq=Nq,
                      heads=heads, kv_heads=kv_heads or heads, d=d, dv=dv,
                      cache_seqlens=seqlens, Nnew=Nnew, page_size=page_size)
    blocks = _blocks(block_sizes)
    s = _split_count(lay, blocks, num_splits, hardware, cluster)
    band = make_band(causal, None)
    b = itemsize_of(io_dtype)
    return sum((_sequence_traffic(lay, int(L), blocks, band, b, s, cluster)
                for L in lay.total), Traffic())


# -- simulation -------------------------------------------------------------------------

@dataclass(frozen=True)
class KVCacheResult:
    """What `simulate_kvcache` returns: out (batch, Nq, heads, dv) and lse (batch, heads,
    Nq), float64; the traffic; the splits and tiles used; the caches after the append
    (copies: the inputs are not changed)."""
    out: np.ndarray
    lse: np.ndarray
    traffic: Traffic
    num_splits: int
    block_sizes: tuple[int, int]
    k_cache: np.ndarray
    v_cache: np.ndarray


def _array(name, x, ndim):
    if not isinstance(x, np.ndarray):
        x = np.asarray(x)
    if x.dtype.kind != "f":
        raise TypeError(f"{name} must be a floating-point array, got dtype {x.dtype}")
    if x.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} axes, got shape {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError(f"{name} contains NaN or Inf")
    return x


def simulate_kvcache(q, k_cache, v_cache, *, cache_seqlens, block_table=None, k=None,
                     v=None, causal: bool = False, num_splits=None, cluster: bool = False,
                     block_sizes=DEFAULT_BLOCKS, scale=None, io_dtype=None,
                     hardware="H100") -> KVCacheResult:
    """One decoding step: append k, v (if given) to each sequence's cache, then split-KV
    attention of q over the cache, counted tile by tile (see the module docstring)."""
    q = _array("q", q, 4)
    k_cache, v_cache = _array("k_cache", k_cache, 4), _array("v_cache", v_cache, 4)
    batch, Nq, heads, d = q.shape
    paged = block_table is not None
    if k_cache.shape[:3] != v_cache.shape[:3] or k_cache.shape[3] != d:
        raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} must agree on "
                         f"their first three axes, and k_cache's last must be q's d = {d}")
    kv_heads, dv = k_cache.shape[2], v_cache.shape[3]
    if not paged and k_cache.shape[0] != batch:
        raise ValueError(f"a contiguous cache has one row of pages per sequence: k_cache's "
                         f"first axis is {k_cache.shape[0]}, q's batch is {batch} (give "
                         "block_table for a paged cache)")
    if (k is None) != (v is None):
        raise ValueError("give both k and v to append, or neither")
    Nnew = 0
    if k is not None:
        k, v = _array("k", k, 4), _array("v", v, 4)
        if k.shape != (batch, k.shape[1], kv_heads, d) or v.shape != k.shape[:3] + (dv,):
            raise ValueError(f"k, v must be (batch={batch}, Nnew, kv_heads={kv_heads}, d) "
                             f"and (…, dv={dv}); got {k.shape} and {v.shape}")
        Nnew = k.shape[1]
    lay = make_layout(batch=batch, Nq=Nq, heads=heads, kv_heads=kv_heads, d=d, dv=dv,
                      cache_seqlens=cache_seqlens, Nnew=Nnew,
                      capacity=None if paged else k_cache.shape[1],
                      page_size=k_cache.shape[1] if paged else None,
                      num_pages=k_cache.shape[0], block_table=block_table)
    blocks = _blocks(block_sizes)
    s = _split_count(lay, blocks, num_splits, hardware, cluster)
    itemsize = itemsize_of(q.dtype if io_dtype is None else io_dtype)
    scale = check_scale(scale, d)
    table = np.asarray(block_table) if paged else None
    K_all, V_all = k_cache.astype(np.float64), v_cache.astype(np.float64)

    def rows_of(b, L):
        """Cache positions 0 … L − 1 of sequence b: (page or sequence, row) pairs."""
        r = np.arange(L)
        if paged:
            return table[b, r // lay.page_size].astype(np.int64), r % lay.page_size
        return np.full(L, b), r

    out = np.zeros((batch, Nq, heads, dv))
    lse = np.zeros((batch, heads, Nq))
    traffic = Traffic()
    g, Br, Bc = lay.g, *blocks
    for b in range(batch):
        L = int(lay.total[b])
        if Nnew:                                               # append in place
            pg, rw = rows_of(b, L)
            pg, rw = pg[L - Nnew:], rw[L - Nnew:]
            K_all[pg, rw] = k[b]
            V_all[pg, rw] = v[b]
        pg, rw = rows_of(b, L)
        Kb = np.moveaxis(K_all[pg, rw], 1, 0)[:, None]         # (kv_heads, 1, L, d)
        Vb = np.moveaxis(V_all[pg, rw], 1, 0)[:, None]
        # pack: row s·g + h' of K/V head h is query position s of head h·g + h'
        Qb = q[b].astype(np.float64).reshape(Nq, kv_heads, g, d)
        Qb = np.moveaxis(Qb, 0, 1).reshape(kv_heads, 1, Nq * g, d)
        shape = Shape(Nq * g, L, d, dv, (kv_heads,), (kv_heads,), (kv_heads,), 1)
        scores = make_scores(shape, scale, causal, None, None, None)
        tiles = PackedTiles(Nq * g, L, Br, Bc, scores.band, g)
        mc = Machine(kv_heads, itemsize, None)
        O, Lb = run_splitkv(mc, Qb, Kb, Vb, shape, tiles, scores, num_splits=s,
                            cluster=cluster)
        out[b] = np.moveaxis(O[:, 0].reshape(kv_heads, Nq, g, dv), 1, 0).reshape(Nq, heads, dv)
        lse[b] = Lb[:, 0].reshape(kv_heads, Nq, g).transpose(0, 2, 1).reshape(heads, Nq)
        t = mc.traffic + _append_traffic(lay, L, itemsize)
        if paged:
            t = t + Traffic(reads={"block_table": _table_bytes(tiles, s, lay)})
        traffic = traffic + t
    return KVCacheResult(out=out, lse=lse, traffic=traffic, num_splits=s, block_sizes=blocks,
                         k_cache=K_all.astype(k_cache.dtype), v_cache=V_all.astype(v_cache.dtype))


__all__ = ["simulate_kvcache", "count_kvcache", "KVCacheResult", "num_splits_heuristic",
           "PackedTiles", "DEFAULT_BLOCKS"]
