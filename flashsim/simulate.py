"""Attention executed tile by tile on the two-level memory of `memory.Machine`.

Every HBM↔SRAM move goes through ``Machine.load``/``store`` and is tagged in a comment
with what it moves, so the schedule reads beside the paper's listings and the CUDA
kernels. The math is float64 throughout; ``io_dtype`` only sets the bytes counted.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .memory import Machine
from .problem import (ALGORITHMS, Shape, canon_batch, canonical, check_algorithm, check_arrays,
                      check_options, check_scale, itemsize_of, restore)
from .tiling import Tiles, parse_size, resolve_block_sizes
from . import running_max
from .precision import EXACT, Precision, make_precision
from .variants import Scores, make_scores
from .traffic import Traffic

NEG_INF = -np.inf
# the algorithms the GPU runs, whose kernels precision="kernel" reproduces
KERNEL_PRECISION = ("standard", "flash1", "flash2", "square")


@dataclass(frozen=True)
class Result:
    """What `simulate` returns.

    out: (..., Nq, dv) float64; lse: (..., Nq) float64, natural log (−inf for a row
    that sees no key); traffic: HBM bytes per tensor; block_sizes: (Br, Bc) used, or
    None for standard attention on whole matrices; sram_peak_bytes: most bytes live in
    SRAM at once (None for standard attention, whose passes are library-call sized).
    """
    out: np.ndarray
    lse: np.ndarray
    traffic: Traffic
    block_sizes: tuple[int, int] | None
    sram_peak_bytes: int | None
    algorithm: str
    shape: Shape
    prediction: object = None    # flashsim.hierarchy.Prediction, with hardware=
    ring: object = None          # flashsim.ring.RingResult, for algorithm="ring"


def simulate(q, k, v, algorithm: str = "flash2", *, sram_bytes=None, block_sizes=None,
             causal: bool = False, scale=None, io_dtype=None, window=None, softcap=None,
             alibi_slopes=None, num_splits=None, cluster: bool = False,
             precision: str = "float64", hardware=None, launch: str = "auto",
             world_size=None, assignment: str = "contiguous",
             softmax_max: str = "online") -> Result:
    """Run ``algorithm`` on q (..., Nq, d), k (..., Nk, d), v (..., Nk, dv) and count its
    HBM traffic.

    Algorithms: "standard", "flash1", "flash2", "splitkv" (flash-decoding, with
    ``num_splits``; ``cluster=True``: a Q tile's parts merge in a thread block cluster,
    no partial in HBM) and "square" (square tiles for SRAM smaller than d²). The tiled
    ones need exactly one of ``sram_bytes`` (block sizes by the paper's rule, shrunk to
    fit) or ``block_sizes=(Br, Bc)``. ``io_dtype`` (default q.dtype) sets the bytes per
    element of Q, K, V, O, S, P; m, ℓ, L are 4 bytes. Variants: ``window=(left, right)``,
    ``softcap``, ``alibi_slopes`` (see `flashsim.variants`). ``precision="kernel"``
    (standard, flash1, flash2) reproduces the GPU kernels' rounding (see
    `flashsim.precision`; flash1 rounds O to the I/O type each time it goes back to HBM).
    ``softmax_max`` (flash2): the m its exponentials take, "online" (the running max,
    default), "fixed" or "lazy", the rules of the Hopper forward's softcap instance in
    bfloat16 and float16 (`flashsim.running_max`; `flashsim.gpu.softmax_max` says which
    a launch runs), or "auto" with ``hardware``: the rule of the kernel it models there.
    Traffic is the same under each; O and L differ by roundings.

    Standard attention takes no SRAM size: its three passes (S, P, O through HBM) are
    counted as whole-matrix operations, each operand read once, as the paper counts them;
    with ``block_sizes=(Br, Bc)`` its two matrix products run as the GPU's kernels run
    them, a Q tile of Br rows against K (V) tiles of Bc rows, so K and V are read
    ⌈Nq/Br⌉ times.

    ``hardware`` (a `flashsim.hardware` preset name or `GPU`; flash2 only) runs the
    schedule with the tiles of the project's kernel for these inputs on that GPU
    (``launch``: "auto", "wg", "tc" or "ref"; ``block_sizes`` picks the reference
    kernel's) and adds ``result.prediction``, a `flashsim.hierarchy.Prediction` of its
    traffic at each level (SM↔L2, L2↔DRAM, compulsory) and its time.
    """
    algorithm = check_algorithm(algorithm)
    q, k, v, shape = check_arrays(q, k, v)
    softmax_max = running_max.check_rule(softmax_max, "ring" if world_size is not None
                                         else algorithm)
    itemsize = itemsize_of(q.dtype if io_dtype is None else io_dtype)
    if algorithm == "ring" or world_size is not None:
        return _ring_result(q, k, v, shape, algorithm, world_size, assignment, causal,
                            block_sizes, sram_bytes, scale, io_dtype, hardware,
                            (window, softcap, alibi_slopes, num_splits, cluster, precision,
                             launch))
    if hardware is not None:
        from . import hierarchy
        hw_blocks = block_sizes
        block_sizes = hierarchy.hardware_tiles(
            algorithm, shape, q.dtype if io_dtype is None else io_dtype, hardware,
            sram_bytes=sram_bytes, block_sizes=block_sizes, launch=launch, backward=False,
            variant=softcap is not None or alibi_slopes is not None)
    scores = make_scores(shape, check_scale(scale, shape.d), causal, window, softcap,
                         alibi_slopes)
    if softmax_max == running_max.AUTO:
        if hardware is None:
            raise ValueError("softmax_max='auto' takes the rule of the kernel launched on "
                             "hardware=; give hardware (e.g. 'H100'), or name the rule: "
                             f"one of {running_max.RULES}")
        from . import hierarchy
        softmax_max = hierarchy.softmax_rule(
            shape, q.dtype if io_dtype is None else io_dtype, hardware, launch=launch,
            block_sizes=hw_blocks, softcap=scores.softcap, alibi_slopes=scores.slopes)
    opts = check_options(algorithm, num_splits=num_splits, cluster=cluster)
    running_max.check_scores(softmax_max, scores.softcap, scores.slopes)
    if softmax_max != "online":
        opts = {**opts, "softmax_max": softmax_max}
    blocks = resolve_block_sizes(algorithm, sram_bytes=sram_bytes, block_sizes=block_sizes,
                                 d=shape.d, dv=shape.dv, itemsize=itemsize)
    budget = parse_size(sram_bytes) if sram_bytes is not None else None
    prec = make_precision(precision, q.dtype if io_dtype is None else io_dtype)
    if not prec.exact:
        if algorithm not in KERNEL_PRECISION:
            raise ValueError(f"precision='kernel' models the GPU kernels, which run "
                             f"{', '.join(KERNEL_PRECISION)}; got algorithm={algorithm!r}")
        opts = {**opts, "prec": prec}
    Q, K, V = (prec.cast(prec.io_round(x)) for x in canonical(q, k, v, shape))
    if algorithm == "standard":
        machine = Machine(shape.problems, itemsize)
        O, L = _standard(machine, Q, K, V, shape, scores, blocks, prec)
        peak = None
    else:
        machine = Machine(shape.problems, itemsize, budget)
        tiles = Tiles(shape.Nq, shape.Nk, *blocks, scores.band)
        O, L = FORWARD[algorithm](machine, Q, K, V, shape, tiles, scores, **opts)
        peak = machine.sram.peak
    prediction = None
    if hardware is not None:
        prediction = hierarchy.predict(shape, q.dtype if io_dtype is None else io_dtype,
                                       scores.band, hardware, launch=launch,
                                       block_sizes=hw_blocks, traffic=machine.traffic,
                                       variant=softcap is not None or alibi_slopes is not None)
    return Result(out=restore(O, shape, (shape.Nq, shape.dv)),
                  lse=restore(L, shape, (shape.Nq,)),
                  traffic=machine.traffic, block_sizes=blocks,
                  sram_peak_bytes=peak, algorithm=algorithm, shape=shape,
                  prediction=prediction)


def _ring_result(q, k, v, shape, algorithm, world_size, assignment, causal, block_sizes,
                 sram_bytes, scale, io_dtype, hardware, unsupported) -> Result:
    """algorithm="ring": `flashsim.ring.simulate_ring` over ``world_size`` ranks."""
    from .ring import simulate_ring
    if algorithm != "ring" or world_size is None:
        raise ValueError("world_size goes with algorithm='ring', which needs it (the number "
                         "of ranks the sequence is split over)")
    window, softcap, alibi, splits, cluster, precision, launch = unsupported
    if (window, softcap, alibi, splits) != (None, None, None, None) or cluster \
            or precision != "float64" or launch != "auto":
        raise ValueError("algorithm='ring' takes causal or not, block sizes and the hardware "
                         "(for its link and compute rates); window, softcap, alibi_slopes, "
                         "num_splits, cluster, precision and launch are not supported there")
    r = simulate_ring(q, k, v, world_size=world_size, assignment=assignment, causal=causal,
                      block_sizes=block_sizes, sram_bytes=sram_bytes, scale=scale,
                      io_dtype=io_dtype, hardware=hardware or "H100")
    blocks = resolve_block_sizes("flash2", sram_bytes=sram_bytes, block_sizes=block_sizes,
                                 d=shape.d, dv=shape.dv,
                                 itemsize=itemsize_of(q.dtype if io_dtype is None else io_dtype))
    return Result(out=r.out, lse=r.lse, traffic=r.traffic, block_sizes=blocks,
                  sram_peak_bytes=None, algorithm="ring", shape=shape, ring=r)


def _hbm(shape: Shape, cols: int | None, fill: float, dtype=np.float64) -> np.ndarray:
    """A tensor in HBM with the canonical leading shape (…, hk, g)."""
    rows = (shape.Nq,) if cols is None else (shape.Nq, cols)
    return np.full(canon_batch(shape) + rows, fill, dtype=dtype)


def _safe(m: np.ndarray) -> np.ndarray:
    # A row with no visible key so far has m = −∞; subtracting 0 instead keeps
    # exp(−∞ − 0) = 0 where exp(−∞ − (−∞)) would be NaN.
    return np.where(np.isneginf(m), 0.0, m)


# -- Algorithm 0: standard attention ----------------------------------------------------

def _standard(mc: Machine, Q, K, V, shape: Shape, scores: Scores, blocks=None,
              prec: Precision = EXACT):
    """Three passes, each through HBM: S = scale·QKᵀ (masked, variants), P = softmax(S)
    (with L = m + log ℓ, the log-sum-exp every forward returns), O = P V. The two matrix
    products run as tiled kernels: a CTA per Q tile of Br rows holds it and streams the
    K (or V) tiles of Bc rows, so K and V are read once per Q tile. ``blocks`` None
    is one tile of the whole matrix (the paper's count: every operand read once, as by
    a matmul with unbounded on-chip memory). The softmax pass holds whole rows."""
    Nq, Nk = shape.Nq, shape.Nk
    Br, Bc = blocks if blocks is not None else (max(Nq, 1), max(Nk, 1))
    tiles = Tiles(Nq, Nk, Br, Bc, scores.band)
    S = np.full(canon_batch(shape) + (Nq, Nk), np.nan, dtype=prec.acc)
    for i in range(tiles.Tr):                                    # pass 1: S = scale·QKᵀ
        i0, i1 = i * Br, min((i + 1) * Br, Nq)
        Qi = mc.load("Q", Q, i0, i1)                             # HBM→SRAM: Q_i (Br·d)
        for j in range(tiles.Tc):
            j0, j1 = j * Bc, min((j + 1) * Bc, Nk)
            Kj = mc.load("K", K, j0, j1)                         # HBM→SRAM: K_j (Bc·d)
            Sij, _ = scores.tile(Qi, Kj, tiles, i, j)
            mc.scratch("S", i1 - i0, j1 - j0)
            mc.store_block("S", S, i0, i1, j0, j1, prec.io_round(Sij))  # SRAM→HBM: S_ij (Br·Bc)
            mc.free("K", "S")
        mc.free("Q")

    S = mc.load("S", S, 0, Nq)                                   # HBM→SRAM: S (Nq·Nk), by rows
    m = S.max(axis=-1, initial=NEG_INF)
    P = np.exp(S - _safe(m)[..., None])
    l = P.sum(axis=-1)
    P = P / np.where(l > 0, l, 1.0)[..., None]
    with np.errstate(divide="ignore"):
        L = np.where(l > 0, m + np.log(np.where(l > 0, l, 1.0)), NEG_INF)
    Ph = np.empty(P.shape, dtype=prec.acc)
    mc.store("P", Ph, 0, Nq, prec.io_round(P))                   # SRAM→HBM: P (Nq·Nk)
    Lh = _hbm(shape, None, np.nan, prec.acc)
    mc.store("L", Lh, 0, Nq, prec.stat_round(L), stat=True)      # SRAM→HBM: L (Nq)
    mc.free("S")

    O = _hbm(shape, shape.dv, np.nan, prec.acc)
    for i in range(tiles.Tr):                                    # pass 3: O = P V
        i0, i1 = i * Br, min((i + 1) * Br, Nq)
        mc.scratch("O", i1 - i0, shape.dv)
        Oi = np.zeros(np.broadcast_shapes(Ph.shape[:-2], V.shape[:-2]) + (i1 - i0, shape.dv),
                      dtype=prec.acc)
        for j in range(tiles.Tc):
            j0, j1 = j * Bc, min((j + 1) * Bc, Nk)
            Pij = mc.load("P", np.swapaxes(Ph[..., i0:i1, :], -1, -2), j0, j1)  # HBM→SRAM: P_ij (Br·Bc)
            Vj = mc.load("V", V, j0, j1)                         # HBM→SRAM: V_j (Bc·dv)
            Oi = Oi + np.swapaxes(Pij, -1, -2) @ Vj
            mc.free("P", "V")
        mc.store("O", O, i0, i1, prec.io_round(Oi))              # SRAM→HBM: O_i (Br·dv)
        mc.free("O")
    return O, Lh

# -- Algorithm 1: FlashAttention (K/V outer, Q inner) ------------------------------------

def _flash1(mc: Machine, Q, K, V, shape: Shape, tiles: Tiles, scores: Scores,
            prec: Precision = EXACT):
    Br, Bc = tiles.Br, tiles.Bc
    O = _hbm(shape, shape.dv, 0.0, prec.acc)
    l = _hbm(shape, None, 0.0, prec.acc)
    m = _hbm(shape, None, NEG_INF, prec.acc)
    mc.store("O", O, 0, shape.Nq, O)                             # SRAM→HBM: O = 0 (Nq·dv)
    mc.store("l", l, 0, shape.Nq, l, stat=True)                  # SRAM→HBM: ℓ = 0 (Nq)
    mc.store("m", m, 0, shape.Nq, m, stat=True)                  # SRAM→HBM: m = −∞ (Nq)
    ilo, ihi = tiles.q_ranges()
    for j in range(tiles.Tc):
        if ihi[j] < ilo[j]:
            continue                                             # no visible entry: skip K_j
        j0, j1 = j * Bc, min((j + 1) * Bc, shape.Nk)
        Kj = mc.load("K", K, j0, j1)                             # HBM→SRAM: K_j (Bc·d)
        Vj = mc.load("V", V, j0, j1)                             # HBM→SRAM: V_j (Bc·dv)
        for i in range(ilo[j], ihi[j] + 1):
            i0, i1 = i * Br, min((i + 1) * Br, shape.Nq)
            Qi = mc.load("Q", Q, i0, i1)                         # HBM→SRAM: Q_i (Br·d)
            Oi = mc.load("O", O, i0, i1)                         # HBM→SRAM: O_i (Br·dv)
            li = mc.load("l", l, i0, i1, stat=True)              # HBM→SRAM: ℓ_i (Br)
            mi = mc.load("m", m, i0, i1, stat=True)              # HBM→SRAM: m_i (Br)
            mc.scratch("S", i1 - i0, j1 - j0)
            S, _ = scores.tile(Qi, Kj, tiles, i, j)
            mc.scratch("m~", i1 - i0, stat=True)
            mc.scratch("l~", i1 - i0, stat=True)
            m_t = S.max(axis=-1)                                 # m̃_ij = rowmax(S_ij)
            P = np.exp(S - _safe(m_t)[..., None])                # P̃_ij overwrites S_ij
            l_t = P.sum(axis=-1)                                 # ℓ̃_ij = rowsum(P̃_ij)
            mc.scratch("m_new", i1 - i0, stat=True)
            mc.scratch("l_new", i1 - i0, stat=True)
            m_new = np.maximum(mi, m_t)
            a = np.exp(mi - _safe(m_new))                        # e^{m_i − m_new}
            b = np.exp(m_t - _safe(m_new))                       # e^{m̃_ij − m_new}
            l_new = a * li + b * l_t
            inv = np.where(l_new > 0, 1 / np.where(l_new > 0, l_new, 1), 0).astype(prec.acc)
            Oi = inv[..., None] * ((li * a)[..., None] * Oi
                                   + b[..., None] * (prec.io_round(P) @ Vj))
            mc.store("O", O, i0, i1, prec.io_round(Oi))          # SRAM→HBM: O_i (Br·dv)
            mc.store("l", l, i0, i1, prec.stat_round(l_new), stat=True)  # SRAM→HBM: ℓ_i (Br)
            mc.store("m", m, i0, i1, prec.stat_round(m_new), stat=True)  # SRAM→HBM: m_i (Br)
            mc.free("Q", "O", "l", "m", "S", "m~", "l~", "m_new", "l_new")
        mc.free("K", "V")
    # The paper's Algorithm 1 returns O and keeps ℓ, m in HBM for the backward pass;
    # the log-sum-exp reported here is derived from them after the run (not counted).
    with np.errstate(divide="ignore"):
        L = np.where(l > 0, m + np.log(np.where(l > 0, l, 1.0)), NEG_INF)
    return O, prec.stat_round(L)


# -- FlashAttention-2 forward (Q outer, K/V inner, deferred normalisation) ---------------

def kv_sweep(mc: Machine, Qi, K, V, shape: Shape, tiles: Tiles, scores: Scores, i: int,
             j_first: int, j_last: int, prec: Precision = EXACT, softmax_max: str = "online"):
    """FlashAttention-2's inner loop for Q tile i over K/V tiles j_first..j_last: the
    online softmax with deferred normalisation (``softmax_max``: the m its exponentials
    take, `flashsim.running_max`). Returns the unnormalised O_i and the row statistics
    m_i, ℓ_i (still in SRAM; the caller owns their slots)."""
    rows = Qi.shape[-2]
    Oi = np.zeros(np.broadcast_shapes(Qi.shape[:-2], V.shape[:-2]) + (rows, shape.dv),
                  dtype=prec.acc)
    mi = np.full(Oi.shape[:-1], NEG_INF, dtype=prec.acc)
    if softmax_max == "fixed":                  # per row with ALiBi (fixed_max_rows)
        mi[...] = running_max.fixed_max_rows(scores.softcap, scores.slopes, tiles.band,
                                             np.arange(i * tiles.Br, i * tiles.Br + rows),
                                             tiles.off, shape.Nk)
    li = np.zeros(Oi.shape[:-1], dtype=prec.acc)
    lazy = softmax_max == "lazy"
    if lazy:      # its vote counts the kernel's rows past Nq in the last tile's last warp
        past = np.arange(i * tiles.Br + rows, i * tiles.Br + rows + (-rows) % running_max.WARP_ROWS)
        unseen_past = np.ones(past.shape, dtype=bool)
    # (lazy with ALiBi: the kernel's order, the diagonal key tile first; the same traffic)
    order = running_max.key_order(j_first, j_last, i * tiles.Br, rows, tiles.off, tiles.Bc,
                                  lazy and scores.slopes is not None)
    for n, j in enumerate(order):
        j0, j1 = j * tiles.Bc, min((j + 1) * tiles.Bc, shape.Nk)
        Kj = mc.load("K", K, j0, j1)                             # HBM→SRAM: K_j (Bc·d)
        Vj = mc.load("V", V, j0, j1)                             # HBM→SRAM: V_j (Bc·dv)
        mc.scratch("S", rows, j1 - j0)
        S, _ = scores.tile(Qi, Kj, tiles, i, j)
        if softmax_max == "fixed":                               # m fixed: no α
            m_new = mi
            P = np.exp(S - mi[..., None])
            alpha = np.ones_like(mi)
        elif lazy and n > 0:
            P, alpha, m_new = running_max.lazy_step(S, mi, unseen_past)
        else:
            m_new = np.maximum(mi, S.max(axis=-1))
            P = np.exp(S - _safe(m_new)[..., None])              # P̃_ij overwrites S_ij
            alpha = np.exp(mi - _safe(m_new))                    # e^{m_old − m_new}
        if lazy:
            unseen_past &= ~tiles.band.allowed(past, np.arange(j0, j1), tiles.off).any(axis=-1)
        li = alpha * li + P.sum(axis=-1)
        Oi = alpha[..., None] * Oi + prec.io_round(P) @ Vj       # unnormalised until the end
        mi = m_new
        mc.free("K", "V", "S")
    return Oi, mi, li


def _flash2(mc: Machine, Q, K, V, shape: Shape, tiles: Tiles, scores: Scores,
            prec: Precision = EXACT, softmax_max: str = "online"):
    Br, Bc = tiles.Br, tiles.Bc
    O = _hbm(shape, shape.dv, np.nan)     # poisoned: every row must be written
    L = _hbm(shape, None, np.nan)
    jlo, jhi = tiles.kv_ranges()
    for i in range(tiles.Tr):
        i0, i1 = i * Br, min((i + 1) * Br, shape.Nq)
        rows = i1 - i0
        mc.scratch("O", rows, shape.dv)
        mc.scratch("m", rows, stat=True)
        if jhi[i] < jlo[i]:
            # Every row of this tile sees no key: output 0 and L = −∞ without reading.
            mc.store("O", O, i0, i1, 0.0)                        # SRAM→HBM: O_i (Br·dv)
            mc.store("L", L, i0, i1, NEG_INF, stat=True)         # SRAM→HBM: L_i (Br)
            mc.free("O", "m")
            continue
        Qi = mc.load("Q", Q, i0, i1)                             # HBM→SRAM: Q_i (Br·d)
        mc.scratch("l", rows, stat=True)
        mc.scratch("m_new", rows, stat=True)
        Oi, mi, li = kv_sweep(mc, Qi, K, V, shape, tiles, scores, i, jlo[i], jhi[i], prec,
                              softmax_max)
        seen = li > 0
        Oi = Oi / np.where(seen, li, 1.0)[..., None]             # diag(ℓ_i)^−1 O_i, once
        with np.errstate(divide="ignore"):
            Li = np.where(seen, mi + np.log(np.where(seen, li, 1.0)), NEG_INF)
        mc.store("O", O, i0, i1, prec.io_round(Oi))              # SRAM→HBM: O_i (Br·dv)
        mc.store("L", L, i0, i1, prec.stat_round(Li), stat=True)  # SRAM→HBM: L_i = m_i + log ℓ_i (Br)
        mc.free("Q", "O", "m", "l", "m_new")
    return O, L


from .splitkv import run_splitkv  # noqa: E402  (they build on the helpers above)
from .square import run_square  # noqa: E402

FORWARD = {"flash1": _flash1, "flash2": _flash2, "splitkv": run_splitkv, "square": run_square}

__all__ = ["simulate", "Result", "ALGORITHMS"]
