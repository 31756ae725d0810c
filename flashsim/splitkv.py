"""Split-KV forward ("flash-decoding"): FlashAttention-2 with the K/V range of every Q
tile cut into ``num_splits`` parts that run as separate thread blocks, followed by a
combine step. With few query rows (decoding: Nq = 1 … 64) flash2 has only Tr thread
blocks per head; splitting the keys gives the GPU Tr·s of them, at the price of writing
and re-reading fp32 partial results.

Semantics (``algorithm="splitkv", num_splits=s``):

- s == 1 is exactly flash2: same schedule, output and traffic (FlashAttention runs the
  unsplit kernel then; no partials are written).
- s > 1: Q tile i visits K/V tiles jlo_i … jhi_i (n_i = jhi_i − jlo_i + 1 of them, the
  same range as flash2). They are cut into s contiguous parts; part p covers tiles
      jlo_i + ⌊p·n_i/s⌋  …  jlo_i + ⌊(p+1)·n_i/s⌋ − 1,
  so part sizes differ by at most one, and exactly k_i = min(s, n_i) parts are
  non-empty. Each non-empty part is its own thread block: it reads Q_i, streams its
  K_j, V_j with flash2's online softmax and writes a partial output Osplit (rows × dv,
  fp32, normalised by its own ℓ) and a partial log-sum-exp Lsplit (rows, fp32).
  A row that sees no key inside a part gets Osplit = 0 and Lsplit = −∞ (no NaN).
- Empty parts (only when n_i < s) do nothing and cost nothing. (FlashAttention's
  kernel instead launches them, writes Osplit = 0 and Lsplit = −∞, and its combine reads
  all s partials; here the combine reads only the k_i written ones, so the counts
  measure the data the algorithm needs, not launch padding.)
- Combine, per Q tile (a second kernel, after all parts): reads each non-empty part's
  Osplit and Lsplit once and writes O_i (I/O dtype) and L_i (fp32):
      L = log Σ_p exp(Lsplit_p),   O = Σ_p exp(Lsplit_p − L) · Osplit_p,
  computed online (running max and sum over the parts, one partial at a time). A Q
  tile with no visible key (n_i = 0) writes O_i = 0 and L_i = −∞ without reading, as
  flash2 does.

SRAM: each part runs flash2's inner loop, so its peak is flash2's footprint; the
footprint F = ``tiling.sram_footprint("splitkv", …)`` is the larger of that and the
combine's minimum 4·dv + 16 bytes (which only matters for 1-byte I/O with tiny tiles).
The combine holds an fp32 accumulator, the
running max and sum, and one fp32 partial (Osplit rows + Lsplit): 8·R·dv + 12·R bytes for
a chunk of R rows. It combines the Q tile in chunks of the largest R ≤ rows that fits in
F; if not even one row fits, it streams a row's partial in column chunks of nc values
(4·dv + 4·nc + 12 bytes). The chunking never changes the traffic: every partial value
is read exactly once.

Exact traffic per problem (b = I/O bytes per element; rows_i = rows of Q tile i;
keys_i = keys in K/V tiles jlo_i … jhi_i; sums over Q tiles with n_i ≥ 1 unless noted):

    s == 1:  flash2's traffic.
    s  > 1:  reads   Q:      Σ k_i·rows_i·d·b        (each part reads Q_i)
                     K:      Σ keys_i·d·b            (= flash2: the parts partition the range)
                     V:      Σ keys_i·dv·b
                     Osplit: Σ k_i·rows_i·dv·4
                     Lsplit: Σ k_i·rows_i·4
             writes  Osplit, Lsplit: as read
                     O: Nq·dv·b,  L: Nq·4          (over all Q tiles)
    with k_i = min(s, n_i). Non-causal and Nk > 0: n_i = Tc and k_i = min(s, Tc) for every
    tile, so Q reads min(s, Tc)·Nq·d·b and the partials min(s, Tc)·Nq·(dv + 1)·4 each way.

For one query (Nq = 1) the K/V bytes are flash2's; the extra cost is the partials,
2·k·(dv + 1)·4 bytes, plus (k − 1) more reads of the d·b bytes of q.

**The merge in a cluster** (``cluster=True``, Hopper's thread block clusters): the s
parts of a Q tile run together as one cluster of s thread blocks, each keeping its
partial (Osplit_ip, Lsplit_ip) in its own SRAM; after a cluster-wide barrier the parts'
blocks read one another's partials from their SRAM (distributed shared memory, an
SM-to-SM network, not the memory hierarchy), each merging a share of the tile's rows and
writing that share of O_i, L_i (simulated here as one merge per tile: the same values
and the same HBM writes). No partial reaches HBM:
the traffic is the table above without the Osplit and Lsplit lines. The parts are the
same (an empty part joins the cluster's barriers with an empty partial and moves
nothing), so outputs are the memory merge's. A cluster holds at most 16 thread blocks
(8 portably), so ``num_splits`` ≤ 16.
"""

from __future__ import annotations

import numpy as np

from .problem import STAT_BYTES, canon_batch, check_size
from .tiling import Tiles, cdiv, sram_footprint
from .traffic import Traffic

NEG_INF = -np.inf


CLUSTER_MAX = 16     # thread blocks a cluster may hold (an H100's non-portable limit)


def _check_splits(num_splits, cluster: bool = False) -> int:
    s = check_size("num_splits", num_splits, 1)
    if not isinstance(cluster, (bool, np.bool_)):
        raise TypeError(f"cluster must be True or False, got {cluster!r}")
    if cluster and s > CLUSTER_MAX:
        raise ValueError(f"a cluster holds at most {CLUSTER_MAX} thread blocks: num_splits "
                         f"= {s} parts cannot merge in one (use cluster=False, or fewer "
                         "splits)")
    return s


def split_bounds(jlo, jhi, num_splits: int):
    """(start, stop) arrays of shape (Tr, s): part p of Q tile i covers K/V tiles
    start[i, p] … stop[i, p] − 1 (empty when start == stop)."""
    jlo = np.asarray(jlo, dtype=np.int64)
    n = np.maximum(np.asarray(jhi, dtype=np.int64) - jlo + 1, 0)
    p = np.arange(num_splits + 1, dtype=np.int64)
    cuts = jlo[:, None] + (p[None, :] * n[:, None]) // num_splits
    return cuts[:, :-1], cuts[:, 1:]


def combine_chunks(budget: int, rows: int, dv: int) -> tuple[int, int]:
    """(R, nc): rows per combine chunk and values per streamed piece of a partial row.

    Whole rows (nc = dv) while 8·R·dv + 12·R ≤ budget; else one row with the fp32
    accumulator whole and the partial in pieces of nc values (4·dv + 4·nc + 12 bytes);
    (1, 1) if nothing fits (see the module docstring)."""
    per_row = 2 * dv * STAT_BYTES + 3 * STAT_BYTES
    R = min(rows, budget // per_row)
    if R >= 1:
        return R, dv
    nc = min(dv, (budget - dv * STAT_BYTES - 3 * STAT_BYTES) // STAT_BYTES)
    return 1, max(1, nc)


# -- simulation -------------------------------------------------------------------------

def run_splitkv(mc, Q, K, V, shape, tiles: Tiles, scores, *, num_splits, cluster=False):
    # each part runs flash2's inner loop (simulate imports this module, hence the late import)
    from .simulate import _flash2, _safe, kv_sweep
    s = _check_splits(num_splits, cluster)
    if s == 1:
        return _flash2(mc, Q, K, V, shape, tiles, scores)   # FlashAttention's unsplit kernel

    Br, Bc, dv = tiles.Br, tiles.Bc, shape.dv
    lead = canon_batch(shape)
    O = np.full(lead + (shape.Nq, dv), np.nan)            # poisoned: every row is written
    L = np.full(lead + (shape.Nq,), np.nan)
    # Partials in HBM, fp32: slot p holds part p of every Q tile. Osplit is kept flat
    # (Nq·dv values per slot) so that its moves are counted at 4 bytes per value.
    Osplit = np.full(lead + (s, shape.Nq * dv), np.nan)
    Lsplit = np.full(lead + (s, shape.Nq), np.nan)
    jlo, jhi = tiles.kv_ranges()
    start, stop = split_bounds(jlo, jhi, s)

    # Kernel 1: one thread block per (Q tile i, non-empty part p).
    for i in range(tiles.Tr):
        i0, i1 = i * Br, min((i + 1) * Br, shape.Nq)
        rows = i1 - i0
        for p in range(s):
            if start[i, p] == stop[i, p]:
                continue                                         # empty part: no block
            mc.scratch("O", rows, dv)
            mc.scratch("m", rows, stat=True)
            Qi = mc.load("Q", Q, i0, i1)                         # HBM→SRAM: Q_i (Br·d)
            mc.scratch("l", rows, stat=True)
            mc.scratch("m_new", rows, stat=True)
            Oi, mi, li = kv_sweep(mc, Qi, K, V, shape, tiles, scores, i, start[i, p],
                                  stop[i, p] - 1)
            seen = li > 0                                        # rows with a key in this part
            Oi = Oi / np.where(seen, li, 1.0)[..., None]
            with np.errstate(divide="ignore"):
                Li = np.where(seen, mi + np.log(np.where(seen, li, 1.0)), NEG_INF)
            Oflat = Oi.reshape(Oi.shape[:-2] + (rows * dv,))
            if cluster:          # the partial stays in this block's SRAM for the merge
                Osplit[..., p, i0 * dv:i1 * dv] = Oflat
                Lsplit[..., p, i0:i1] = Li
            else:
                mc.store("Osplit", Osplit[..., p, :], i0 * dv, i1 * dv, Oflat,
                         stat=True)                              # SRAM→HBM: Osplit_ip (Br·dv, fp32)
                mc.store("Lsplit", Lsplit[..., p, :], i0, i1, Li,
                         stat=True)                              # SRAM→HBM: Lsplit_ip (Br, fp32)
            mc.free("Q", "O", "m", "l", "m_new")

    # Kernel 2: combine, one thread block per Q tile, one partial at a time.
    budget = sram_footprint("splitkv", Br, Bc, shape.d, dv, mc.itemsize)
    for i in range(tiles.Tr):
        i0, i1 = i * Br, min((i + 1) * Br, shape.Nq)
        rows = i1 - i0
        parts = [p for p in range(s) if start[i, p] < stop[i, p]]
        if not parts:
            # Every row of this tile sees no key: output 0 and L = −∞ without reading.
            mc.scratch("O", rows, dv)
            mc.scratch("m", rows, stat=True)
            mc.store("O", O, i0, i1, 0.0)                        # SRAM→HBM: O_i (Br·dv)
            mc.store("L", L, i0, i1, NEG_INF, stat=True)         # SRAM→HBM: L_i (Br)
            mc.free("O", "m")
            continue
        R, nc = combine_chunks(budget, rows, dv)
        for r0 in range(i0, i1, R):
            r1 = min(r0 + R, i1)
            n = r1 - r0
            mc.scratch("Oacc", n * dv, stat=True)                # fp32 accumulator
            mc.scratch("m", n, stat=True)                        # running max of Lsplit
            mc.scratch("l", n, stat=True)                        # running Σ exp(Lsplit − m)
            acc = np.zeros(lead + (n, dv))
            m = np.full(lead + (n,), NEG_INF)
            l = np.zeros(lead + (n,))
            for p in parts:
                if cluster:      # from part p's SRAM, over the cluster's network
                    Lp = Lsplit[..., p, r0:r1]
                else:
                    Lp = mc.load("Lsplit", Lsplit[..., p, :], r0, r1,
                                 stat=True)                      # HBM→SRAM: Lsplit_ip (R, fp32)
                m_new = np.maximum(m, Lp)
                alpha = np.exp(m - _safe(m_new))
                w = np.exp(Lp - _safe(m_new))                    # 0 for a part that saw nothing
                l = alpha * l + w
                for c0 in range(0, dv, nc):
                    c1 = min(c0 + nc, dv)
                    if nc == dv:
                        f0, f1 = r0 * dv, r1 * dv
                    else:                                        # R == 1: a piece of one row
                        f0, f1 = r0 * dv + c0, r0 * dv + c1
                    if cluster:
                        Op = Osplit[..., p, f0:f1]
                    else:
                        Op = mc.load("Osplit", Osplit[..., p, :], f0, f1,
                                     stat=True)                  # HBM→SRAM: Osplit_ip piece (fp32)
                        mc.free("Osplit")
                    Op = Op.reshape(lead + (n, c1 - c0))
                    acc[..., c0:c1] = alpha[..., None] * acc[..., c0:c1] + w[..., None] * Op
                m = m_new
                if not cluster:
                    mc.free("Lsplit")
            seen = l > 0
            Oc = acc / np.where(seen, l, 1.0)[..., None]
            with np.errstate(divide="ignore"):
                Lc = np.where(seen, m + np.log(np.where(seen, l, 1.0)), NEG_INF)
            mc.store("O", O, r0, r1, Oc)                         # SRAM→HBM: O rows (R·dv)
            mc.store("L", L, r0, r1, Lc, stat=True)              # SRAM→HBM: L rows (R)
            mc.free("Oacc", "m", "l")
    return O, L


# -- counting ---------------------------------------------------------------------------

def count_splitkv(shape, tiles: Tiles, b: int, *, num_splits, cluster=False) -> Traffic:
    """Exact traffic of `run_splitkv`, vectorised over Q tiles (O(Tr) NumPy)."""
    s = _check_splits(num_splits, cluster)
    Nq, Nk, d, dv, n = shape.Nq, shape.Nk, shape.d, shape.dv, shape.problems
    jlo, jhi = tiles.kv_ranges()
    i0, i1 = tiles.q_bounds()
    rows = i1 - i0
    visited = jhi >= jlo
    tiles_i = np.where(visited, jhi - jlo + 1, 0)
    keys = int(np.where(visited, np.minimum((jhi + 1) * tiles.Bc, Nk) - jlo * tiles.Bc,
                        0).sum())
    parts = np.minimum(s, tiles_i)                               # k_i non-empty parts
    q_rows = int((parts * rows).sum())
    reads = {"Q": q_rows * d * b, "K": keys * d * b, "V": keys * dv * b}
    writes = {"O": Nq * dv * b, "L": Nq * STAT_BYTES}
    if s > 1 and not cluster:
        for direction in (reads, writes):
            direction["Osplit"] = q_rows * dv * STAT_BYTES
            direction["Lsplit"] = q_rows * STAT_BYTES
    return n * Traffic(reads=reads, writes=writes)


# -- closed form ------------------------------------------------------------------------

def theory_splitkv(*, Nq: int, Nk: int, d: int, dv: int | None = None, Br: int, Bc: int,
                   causal: bool = False, window=None, left: int | None = None,
                   right: int | None = None, itemsize: int = 2, problems: int = 1,
                   num_splits: int, cluster: bool = False) -> Traffic:
    """The closed form of the module docstring, written from the loop structure
    independently of `count_splitkv`; ``cluster=True``: the merge in a cluster, no
    partial in HBM.

    The mask is given either as ``causal``/``window`` (as `simulate` takes them) or as
    the band's reach ``left``/``right`` (None = unbounded; `flashsim.theory.traffic`
    passes these), not both. Q tile i (rows i0 … i1 − 1, off = Nk − Nq) sees keys
    c_lo = max(0, i0 + off − left) … c_hi = min(Nk − 1, i1 − 1 + off + right); it is
    skipped when c_lo > c_hi, else it visits n_i = ⌊c_hi/Bc⌋ − ⌊c_lo/Bc⌋ + 1 K/V tiles
    holding min(Nk, Bc·(⌊c_hi/Bc⌋ + 1)) − Bc·⌊c_lo/Bc⌋ keys. Non-causal: n_i = Tc."""
    if num_splits is None:
        raise ValueError("splitkv needs num_splits (the number of K/V splits per Q tile)")
    s = _check_splits(num_splits, cluster)
    if causal or window is not None:
        if left is not None or right is not None:
            raise ValueError("give the mask as causal/window or as left/right, not both")
        if window is not None:
            left = None if window[0] == -1 else window[0]
            right = None if window[1] == -1 else window[1]
        if causal:
            right = 0 if right is None else min(right, 0)
    dv = d if dv is None else dv
    b, st = itemsize, STAT_BYTES
    Tr, Tc = cdiv(Nq, Br), cdiv(Nk, Bc)
    if Nq == 0 or Nk == 0:
        q_rows = keys = 0
    elif left is None and right is None:
        q_rows, keys = min(s, Tc) * Nq, Tr * Nk
    else:
        i0 = np.arange(Tr, dtype=np.int64) * Br
        i1 = np.minimum(i0 + Br, Nq)
        off = Nk - Nq
        c_lo = np.zeros_like(i0) if left is None else np.maximum(0, i0 + off - left)
        c_hi = (np.full_like(i0, Nk - 1) if right is None
                else np.minimum(Nk - 1, i1 - 1 + off + right))
        seen = c_lo <= c_hi
        n_i = np.where(seen, c_hi // Bc - c_lo // Bc + 1, 0)
        q_rows = int((np.minimum(s, n_i) * (i1 - i0)).sum())
        keys = int(np.where(seen, np.minimum(Nk, Bc * (c_hi // Bc + 1)) - Bc * (c_lo // Bc),
                            0).sum())
    reads = {"Q": q_rows * d * b, "K": keys * d * b, "V": keys * dv * b}
    writes = {"O": Nq * dv * b, "L": Nq * st}
    if s > 1 and not cluster:
        reads.update(Osplit=q_rows * dv * st, Lsplit=q_rows * st)
        writes.update(Osplit=q_rows * dv * st, Lsplit=q_rows * st)
    return problems * Traffic(reads=reads, writes=writes)


__all__ = ["run_splitkv", "count_splitkv", "theory_splitkv", "split_bounds",
           "combine_chunks"]
