"""Backward passes, tile by tile on the same two-level memory as the forward.

Given the forward's out O and log-sum-exp L, the gradients follow from recomputing
P = exp(S − L) tile by tile (no N × N array is stored):

    dV = Pᵀ dO,   dP = dO Vᵀ,   D = rowsum(dO ∘ O) = rowsum(P ∘ dP),
    dS = P ∘ (dP − D),   dQ = scale · dS K,   dK = scale · dSᵀ Q,

and with a softcap c (S = c·tanh(S_raw/c) + bias) dS_raw = dS ∘ (1 − tanh²) is used
in place of dS. Schedules (each move tagged in the code):

- standard (FlashAttention paper, Algorithm 3): read P, dO, write dV; read dO, V, write
  dP; read P, dP, write dS; read dS, K, write dQ; read dS, Q, write dK. With a softcap
  the dS pass also reads the saved scores S (it needs tanh). With ``block_sizes`` the
  matrix products are tiled as the GPU runs them: a tile of dV or dK (Bc rows) streams
  the Q tiles (so dO, Q are read ⌈Nk/Bc⌉ times), a tile of dP or dQ (Br rows) the K/V
  tiles (V, K read ⌈Nq/Br⌉ times).
- flash1 (Algorithm 4): dQ = 0 written whole. Outer loop over K/V tiles j: read K_j,
  V_j; inner loop over visited Q tiles i: read Q_i, O_i, dO_i, dQ_i, ℓ_i, m_i, write
  dQ_i; then write dK_j, dV_j.
- flash2 (as FlashAttention-2 kernels run it): a pre-pass reads O, dO once and writes
  D (fp32); the fp32 accumulator dQacc = 0 is written whole; outer loop over K/V tiles
  j: read K_j, V_j; inner loop over visited i: read Q_i, dO_i, L_i, D_i, dQacc_i (4 bytes
  per element), write dQacc_i; then write dK_j, dV_j; a post-pass reads dQacc once and
  writes dQ in the I/O type.

A K/V tile that no query row sees reads nothing and writes dK_j = dV_j = 0. Under GQA
each query head is its own problem and writes its own dK_j, dV_j (as FlashAttention-2
does before summing the group), so counts are per (batch, query-head) problem like the
forward's; the returned dk, dv are summed over each group.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .memory import Machine
from .problem import (STAT_BYTES, Shape, canon_batch, canonical, check_algorithm, check_arrays,
                      check_scale, itemsize_of, make_shape)
from .tiling import Tiles, cdiv, parse_size, resolve_block_sizes
from .traffic import Traffic
from .precision import EXACT, Precision, make_precision
from .variants import Scores, make_band, make_scores

NEG_INF = -np.inf
KERNEL_PRECISION = ("standard", "flash1", "flash2")
BACKWARD_ALGORITHMS = ("standard", "flash1", "flash2", "ring")


@dataclass(frozen=True)
class Gradients:
    """What `simulate_backward` returns: dq, dk, dv (float64, shaped like q, k, v), the
    HBM traffic, the (Br, Bc) used (None for standard) and the SRAM high-water mark."""
    dq: np.ndarray
    dk: np.ndarray
    dv: np.ndarray
    traffic: Traffic
    block_sizes: tuple[int, int] | None
    sram_peak_bytes: int | None
    algorithm: str
    prediction: object = None    # flashsim.hierarchy.Prediction, with hardware=
    ring: object = None          # flashsim.ring.RingGradients, for algorithm="ring"


def _check_backward_algorithm(algorithm: str) -> str:
    check_algorithm(algorithm)
    if algorithm not in BACKWARD_ALGORITHMS:
        hint = " (split-KV only changes the forward; use 'flash2')" if algorithm == "splitkv" else ""
        raise ValueError(f"no backward pass for algorithm {algorithm!r}{hint}; choose one of "
                         f"{', '.join(BACKWARD_ALGORITHMS)}")
    return algorithm


def _check_saved(name: str, x, want: tuple, *, allow_neg_inf: bool = False) -> np.ndarray:
    if not isinstance(x, np.ndarray):
        x = np.asarray(x)
    if x.dtype.kind != "f":
        raise TypeError(f"{name} must be a floating-point array, got dtype {x.dtype}")
    if x.shape != want:
        raise ValueError(f"{name} has shape {x.shape}, but q, k, v call for {want}")
    bad = np.isnan(x) | np.isposinf(x) if allow_neg_inf else ~np.isfinite(x)
    if bad.any():
        what = "NaN or +Inf" if allow_neg_inf else "NaN or Inf"
        raise ValueError(f"{name} contains {what}")
    return x


def simulate_backward(q, k, v, out, lse, dout, algorithm: str = "flash2", *, sram_bytes=None,
                      block_sizes=None, causal: bool = False, scale=None, io_dtype=None,
                      window=None, softcap=None, alibi_slopes=None,
                      precision: str = "float64", hardware=None, launch: str = "auto",
                      deterministic: bool = False, world_size=None,
                      assignment: str = "contiguous") -> Gradients:
    """Gradients of attention with respect to q, k, v for upstream gradient ``dout``,
    run tile by tile with ``algorithm`` ∈ {"standard", "flash1", "flash2"}.

    ``out`` (..., Nq, dv) and ``lse`` (..., Nq) are the forward's results (for example
    from `simulate`); block sizes come from ``sram_bytes`` by the paper's rule for a
    K/V-outer loop (Bc = ⌈M/4d⌉, Br = min(Bc, d), shrunk to fit), or ``block_sizes``.
    ``precision="kernel"`` (standard, flash1, flash2) reproduces the GPU kernels'
    rounding. Standard attention takes ``block_sizes`` for its tiled matrix products
    (see `flashsim.simulate`), or none for the paper's whole-matrix count.
    ``hardware`` (flash2 only) runs the backward kernels' tiles and adds
    ``gradients.prediction``, as `flashsim.simulate` does for the forward.
    """
    algorithm = _check_backward_algorithm(algorithm)
    q, k, v, shape = check_arrays(q, k, v)
    if algorithm == "ring" or world_size is not None:
        if algorithm != "ring" or world_size is None:
            raise ValueError("world_size goes with algorithm='ring', which needs it")
        if (window, softcap, alibi_slopes) != (None, None, None) or precision != "float64":
            raise ValueError("algorithm='ring' takes causal or not and block sizes; window, "
                             "softcap, alibi_slopes and precision are not supported there")
        from .ring import simulate_ring_backward
        out_shape = shape.batch_shape + (shape.Nq, shape.dv)
        r = simulate_ring_backward(
            q, k, v, _check_saved("out", out, out_shape),
            _check_saved("lse", lse, shape.batch_shape + (shape.Nq,), allow_neg_inf=True),
            _check_saved("dout", dout, out_shape), world_size=world_size,
            assignment=assignment, causal=causal, block_sizes=block_sizes,
            sram_bytes=sram_bytes, scale=scale, io_dtype=io_dtype, hardware=hardware or "H100")
        blocks = resolve_block_sizes("flash2-backward", sram_bytes=sram_bytes,
                                     block_sizes=block_sizes, d=shape.d, dv=shape.dv,
                                     itemsize=itemsize_of(q.dtype if io_dtype is None else io_dtype))
        return Gradients(dq=r.dq, dk=r.dk, dv=r.dv, traffic=r.traffic, block_sizes=blocks,
                         sram_peak_bytes=None, algorithm="ring", ring=r)
    if hardware is not None:
        from . import hierarchy
        hw_blocks = block_sizes
        block_sizes = hierarchy.hardware_tiles(
            algorithm, shape, q.dtype if io_dtype is None else io_dtype, hardware,
            sram_bytes=sram_bytes, block_sizes=block_sizes, launch=launch, backward=True)
    out_shape = shape.batch_shape + (shape.Nq, shape.dv)
    out = _check_saved("out", out, out_shape)
    dout = _check_saved("dout", dout, out_shape)
    lse = _check_saved("lse", lse, shape.batch_shape + (shape.Nq,), allow_neg_inf=True)
    itemsize = itemsize_of(q.dtype if io_dtype is None else io_dtype)
    scores = make_scores(shape, check_scale(scale, shape.d), causal, window, softcap,
                         alibi_slopes)
    rule = None if algorithm == "standard" else f"{algorithm}-backward"
    blocks = resolve_block_sizes(rule or "standard", sram_bytes=sram_bytes,
                                 block_sizes=block_sizes, d=shape.d, dv=shape.dv,
                                 itemsize=itemsize)
    prec = make_precision(precision, q.dtype if io_dtype is None else io_dtype)
    if not prec.exact and algorithm not in KERNEL_PRECISION:
        raise ValueError(f"precision='kernel' models the GPU kernels, which run "
                         f"{', '.join(KERNEL_PRECISION)}; got algorithm={algorithm!r}")
    cb = canon_batch(shape)

    def load(x, trailing, stat=False):
        x = np.asarray(x, np.float64).reshape(cb + trailing) if trailing else x
        return prec.cast(prec.stat_round(x) if stat else prec.io_round(x))

    Q, K, V = (load(x, None) for x in canonical(q, k, v, shape))
    O = load(out, (shape.Nq, shape.dv))
    dO = load(dout, (shape.Nq, shape.dv))
    L = load(lse, (shape.Nq,), stat=True)
    if algorithm == "standard":
        mc = Machine(shape.problems, itemsize)
        dQ, dK, dV = _standard_bwd(mc, Q, K, V, dO, L, shape, scores, blocks, prec)
        peak = None
    else:
        budget = parse_size(sram_bytes) if sram_bytes is not None else None
        mc = Machine(shape.problems, itemsize, budget)
        tiles = Tiles(shape.Nq, shape.Nk, *blocks, scores.band)
        if algorithm == "flash1":
            dQ, dK, dV = _flash1_bwd(mc, Q, K, V, O, dO, L, shape, tiles, scores, prec)
        else:
            dQ, dK, dV = _flash2_bwd(mc, Q, K, V, O, dO, L, shape, tiles, scores, prec)
        peak = mc.sram.peak

    def grad(g, like, x):
        # GQA groups and broadcast axes are summed in the accumulation type, then rounded
        return np.asarray(prec.io_round(sum_to(g, like.shape)), np.float64).reshape(x.shape)

    prediction = None
    if hardware is not None:
        prediction = hierarchy.predict(shape, q.dtype if io_dtype is None else io_dtype,
                                       scores.band, hardware, backward=True, launch=launch,
                                       block_sizes=hw_blocks, deterministic=deterministic,
                                       traffic=mc.traffic)
    return Gradients(dq=grad(dQ, Q, q), dk=grad(dK, K, k), dv=grad(dV, V, v),
                     traffic=mc.traffic, block_sizes=blocks, sram_peak_bytes=peak,
                     algorithm=algorithm, prediction=prediction)


def sum_to(x: np.ndarray, shape: tuple) -> np.ndarray:
    """Sum a gradient over the axes its input was broadcast along (GQA groups, size-1
    batch axes), so it has the input's (canonical) shape."""
    lead = x.ndim - len(shape)
    if lead:
        x = x.sum(axis=tuple(range(lead)))
    axes = tuple(a for a, n in enumerate(shape) if n == 1 and x.shape[a] != 1)
    return x.sum(axis=axes, keepdims=True) if axes else x


def _hbm(shape: Shape, rows: int, cols: int | None) -> np.ndarray:
    trailing = (rows,) if cols is None else (rows, cols)
    return np.full(canon_batch(shape) + trailing, np.nan)   # poisoned until written


def _probs(S, L):
    """P = exp(S − L); a row that sees no key (L = −∞) has P = 0."""
    return np.exp(S - np.where(np.isneginf(L), 0.0, L)[..., None])


def _ds(P, dP, D, T):
    dS = P * (dP - D[..., None])
    return dS if T is None else dS * (1.0 - T * T)      # through c·tanh(S_raw/c)


# -- standard (Algorithm 3) ------------------------------------------------------------

def _standard_bwd(mc: Machine, Q, K, V, dO, L, shape: Shape, scores: Scores, blocks=None,
                  prec: Precision = EXACT):
    """Algorithm 3, five passes through HBM. The matrix products run as tiled kernels
    (`flashsim.simulate`'s standard): Q-tile outputs (dP, dQ) hold a Q tile of Br rows
    and stream K/V tiles of Bc rows, K/V-tile outputs (dV, dK) the other way round;
    ``blocks`` None is one tile of the whole matrix (the paper's count)."""
    Nq, Nk = shape.Nq, shape.Nk
    Br, Bc = blocks if blocks is not None else (max(Nq, 1), max(Nk, 1))
    # The forward left P (and S) in HBM; rebuilding them here is not part of this pass.
    S, T = scores.full(Q, K, Nq, Nk)
    if prec.exact:
        P_saved = _probs(S, L)
    else:   # as the GPU's forward left them: S in the I/O type, P its rounded softmax
        S = prec.io_round(S)
        if T is not None:   # the backward's tanh comes from the stored S, less the bias
            bias = scores.bias(np.arange(Nq), np.arange(Nk), Nk - Nq)
            T = np.where(np.isneginf(S), 0.0, (S - bias) / scores.softcap).astype(prec.acc)
        m = S.max(axis=-1, initial=NEG_INF)
        P_saved = np.exp(S - np.where(np.isneginf(m), 0.0, m)[..., None])
        l = P_saved.sum(axis=-1)
        P_saved = prec.io_round(P_saved / np.where(l > 0, l, 1.0)[..., None])
    P_saved = prec.cast(P_saved)
    # dV_j = Σ_i P_ijᵀ dO_i, a CTA per K/V tile j
    dV = mc.write_whole("dV", prec.io_round(                     # SRAM→HBM: dV (Nk·dv)
        _tiles_t(mc, "P", P_saved, "dO", dO, Bc, Br, Nk, Nq, prec)))

    dP = np.full(P_saved.shape, np.nan, dtype=prec.acc)          # dP_i = dO_i Vᵀ, by Q tile
    for i in range(cdiv(Nq, Br)):
        i0, i1 = i * Br, min((i + 1) * Br, Nq)
        dOi = mc.load("dO", dO, i0, i1)                          # HBM→SRAM: dO_i (Br·dv)
        for j in range(cdiv(Nk, Bc)):
            j0, j1 = j * Bc, min((j + 1) * Bc, Nk)
            Vj = mc.load("V", V, j0, j1)                         # HBM→SRAM: V_j (Bc·dv)
            mc.store_block("dP", dP, i0, i1, j0, j1,             # SRAM→HBM: dP_ij (Br·Bc)
                           prec.io_round(dOi @ np.swapaxes(Vj, -1, -2)))
            mc.free("V")
        mc.free("dO")

    P = mc.read_whole("P", P_saved)                              # HBM→SRAM: P (Nq·Nk)
    dP = mc.read_whole("dP", dP)                                 # HBM→SRAM: dP (Nq·Nk)
    if T is not None:
        mc.read_whole("S", S)                                    # HBM→SRAM: S (Nq·Nk), for tanh
    D = (P * dP).sum(axis=-1)
    dS = mc.write_whole("dS", prec.io_round(_ds(P, dP, D, T)))   # SRAM→HBM: dS (Nq·Nk)
    dS = prec.cast(dS)

    # dQ_i = scale · Σ_j dS_ij K_j, a CTA per Q tile; dK_j = scale · Σ_i dS_ijᵀ Q_i
    dQ = mc.write_whole("dQ", prec.io_round(                     # SRAM→HBM: dQ (Nq·d)
        scores.scale * _tiles(mc, "dS", dS, "K", K, Br, Bc, Nq, Nk, prec)))
    dK = mc.write_whole("dK", prec.io_round(                     # SRAM→HBM: dK (Nk·d)
        scores.scale * _tiles_t(mc, "dS", dS, "Q", Q, Bc, Br, Nk, Nq, prec)))
    return dQ, dK, dV


def _tiles(mc: Machine, nx: str, X, ny: str, Y, B_out: int, B_in: int, n_out: int,
           n_in: int, prec: Precision):
    """Σ_j X_ij Y_j per output tile i of B_out rows (X: n_out × n_in, Y: n_in rows): a
    CTA per tile i holds its accumulator and streams X_ij and Y_j (tiles of B_in)."""
    out = np.zeros(np.broadcast_shapes(X.shape[:-2], Y.shape[:-2]) + (n_out, Y.shape[-1]),
                   dtype=prec.acc)
    for i in range(cdiv(n_out, B_out)):
        i0, i1 = i * B_out, min((i + 1) * B_out, n_out)
        XiT = np.swapaxes(X[..., i0:i1, :], -1, -2)               # columns of X_i as rows
        for j in range(cdiv(n_in, B_in)):
            j0, j1 = j * B_in, min((j + 1) * B_in, n_in)
            Xij = np.swapaxes(mc.load(nx, XiT, j0, j1), -1, -2)  # HBM→SRAM: X_ij (B_out·B_in)
            Yj = mc.load(ny, Y, j0, j1)                          # HBM→SRAM: Y_j (B_in·n)
            out[..., i0:i1, :] += Xij @ Yj
            mc.free(nx, ny)
    return out


def _tiles_t(mc: Machine, nx: str, X, ny: str, Y, B_out: int, B_in: int, n_out: int,
             n_in: int, prec: Precision):
    """Σ_i X_ijᵀ Y_i per output tile j of B_out rows (X: n_in × n_out, Y: n_in rows)."""
    return _tiles(mc, nx, np.swapaxes(X, -1, -2), ny, Y, B_out, B_in, n_out, n_in, prec)


# -- flash1 (Algorithm 4) --------------------------------------------------------------

def _flash1_bwd(mc: Machine, Q, K, V, O, dO, L, shape: Shape, tiles: Tiles, scores: Scores,
                prec: Precision = EXACT):
    Br, Bc, d, dv = tiles.Br, tiles.Bc, shape.d, shape.dv
    # Algorithm 4 reads the forward's ℓ and m; m = L, ℓ = 1 describe the same softmax.
    m = np.where(np.isneginf(L), NEG_INF, L).astype(prec.acc)
    l = np.where(np.isneginf(L), 0.0, 1.0).astype(prec.acc)
    dQ = np.zeros(canon_batch(shape) + (shape.Nq, d), prec.acc)
    mc.store("dQ", dQ, 0, shape.Nq, dQ)                          # SRAM→HBM: dQ = 0 (Nq·d)
    dK, dV = _hbm(shape, shape.Nk, d), _hbm(shape, shape.Nk, dv)
    ilo, ihi = tiles.q_ranges()
    for j in range(tiles.Tc):
        j0, j1 = j * Bc, min((j + 1) * Bc, shape.Nk)
        mc.scratch("dK", j1 - j0, d)
        mc.scratch("dV", j1 - j0, dv)
        dKj = np.zeros(dK.shape[:-2] + (j1 - j0, d), prec.acc)
        dVj = np.zeros(dV.shape[:-2] + (j1 - j0, dv), prec.acc)
        if ihi[j] >= ilo[j]:
            Kj = mc.load("K", K, j0, j1)                         # HBM→SRAM: K_j (Bc·d)
            Vj = mc.load("V", V, j0, j1)                         # HBM→SRAM: V_j (Bc·dv)
            for i in range(ilo[j], ihi[j] + 1):
                i0, i1 = i * Br, min((i + 1) * Br, shape.Nq)
                Qi = mc.load("Q", Q, i0, i1)                     # HBM→SRAM: Q_i (Br·d)
                Oi = mc.load("O", O, i0, i1)                     # HBM→SRAM: O_i (Br·dv)
                dOi = mc.load("dO", dO, i0, i1)                  # HBM→SRAM: dO_i (Br·dv)
                dQi = mc.load("dQ", dQ, i0, i1)                  # HBM→SRAM: dQ_i (Br·d)
                li = mc.load("l", l, i0, i1, stat=True)          # HBM→SRAM: ℓ_i (Br)
                mi = mc.load("m", m, i0, i1, stat=True)          # HBM→SRAM: m_i (Br)
                mc.scratch("S", i1 - i0, j1 - j0)
                mc.scratch("dP", i1 - i0, j1 - j0)
                mc.scratch("D", i1 - i0, stat=True)
                S, T = scores.tile(Qi, Kj, tiles, i, j)
                inv = np.where(li > 0, 1 / np.where(li > 0, li, 1), 0).astype(prec.acc)
                P = _probs(S, mi) * inv[..., None]
                dVj = dVj + np.swapaxes(prec.io_round(P), -1, -2) @ dOi
                dP = dOi @ np.swapaxes(Vj, -1, -2)
                Di = (dOi * Oi).sum(axis=-1)                     # D_i = rowsum(dO_i ∘ O_i)
                dS = prec.io_round(_ds(P, dP, Di, T))
                dQi = dQi + scores.scale * (dS @ Kj)
                dKj = dKj + scores.scale * (np.swapaxes(dS, -1, -2) @ Qi)
                mc.store("dQ", dQ, i0, i1, prec.io_round(dQi))   # SRAM→HBM: dQ_i (Br·d)
                mc.free("Q", "O", "dO", "dQ", "l", "m", "S", "dP", "D")
            mc.free("K", "V")
        mc.store("dK", dK, j0, j1, prec.io_round(dKj))           # SRAM→HBM: dK_j (Bc·d)
        mc.store("dV", dV, j0, j1, prec.io_round(dVj))           # SRAM→HBM: dV_j (Bc·dv)
        mc.free("dK", "dV")
    return dQ, dK, dV


# -- flash2 (FlashAttention-2 backward: pre-pass, KV-outer main loop, post-pass) --------

def _flash2_bwd(mc: Machine, Q, K, V, O, dO, L, shape: Shape, tiles: Tiles, scores: Scores,
                prec: Precision = EXACT):
    Br, Bc, d, dv = tiles.Br, tiles.Bc, shape.d, shape.dv
    D = _hbm(shape, shape.Nq, None)
    for i in range(tiles.Tr):                                    # pre-pass
        i0, i1 = i * Br, min((i + 1) * Br, shape.Nq)
        Oi = mc.load("O", O, i0, i1)                             # HBM→SRAM: O_i (Br·dv)
        dOi = mc.load("dO", dO, i0, i1)                          # HBM→SRAM: dO_i (Br·dv)
        mc.scratch("D", i1 - i0, stat=True)
        Di = prec.stat_round((dOi * Oi).sum(axis=-1))
        mc.store("D", D, i0, i1, Di, stat=True)                  # SRAM→HBM: D_i (Br)
        mc.free("O", "dO", "D")

    # the accumulator is fp32 in the kernels (float64 in exact mode)
    dQacc = np.zeros(canon_batch(shape) + (shape.Nq, d), np.float64 if prec.exact else np.float32)
    mc.store("dQacc", dQacc, 0, shape.Nq, dQacc, elem=STAT_BYTES)  # SRAM→HBM: dQacc = 0 (Nq·d fp32)
    dK, dV = _hbm(shape, shape.Nk, d), _hbm(shape, shape.Nk, dv)
    ilo, ihi = tiles.q_ranges()
    for j in range(tiles.Tc):
        j0, j1 = j * Bc, min((j + 1) * Bc, shape.Nk)
        mc.scratch("dK", j1 - j0, d)
        mc.scratch("dV", j1 - j0, dv)
        dKj = np.zeros(dK.shape[:-2] + (j1 - j0, d), prec.acc)
        dVj = np.zeros(dV.shape[:-2] + (j1 - j0, dv), prec.acc)
        if ihi[j] >= ilo[j]:
            Kj = mc.load("K", K, j0, j1)                         # HBM→SRAM: K_j (Bc·d)
            Vj = mc.load("V", V, j0, j1)                         # HBM→SRAM: V_j (Bc·dv)
            for i in range(ilo[j], ihi[j] + 1):
                i0, i1 = i * Br, min((i + 1) * Br, shape.Nq)
                Qi = mc.load("Q", Q, i0, i1)                     # HBM→SRAM: Q_i (Br·d)
                dOi = mc.load("dO", dO, i0, i1)                  # HBM→SRAM: dO_i (Br·dv)
                Li = mc.load("L", L, i0, i1, stat=True)          # HBM→SRAM: L_i (Br)
                Di = mc.load("D", D, i0, i1, stat=True)          # HBM→SRAM: D_i (Br)
                dQi = mc.load("dQacc", dQacc, i0, i1, elem=STAT_BYTES)  # HBM→SRAM: dQacc_i (Br·d fp32)
                mc.scratch("S", i1 - i0, j1 - j0)
                mc.scratch("dP", i1 - i0, j1 - j0)
                S, T = scores.tile(Qi, Kj, tiles, i, j)
                P = _probs(S, Li)                                # recomputed, never stored
                dVj = dVj + np.swapaxes(prec.io_round(P), -1, -2) @ dOi
                dP = dOi @ np.swapaxes(Vj, -1, -2)
                dS = prec.io_round(_ds(P, dP, Di, T))
                dQi = dQi + (scores.scale * (dS @ Kj)).astype(dQacc.dtype)
                dKj = dKj + scores.scale * (np.swapaxes(dS, -1, -2) @ Qi)
                mc.store("dQacc", dQacc, i0, i1, dQi, elem=STAT_BYTES)  # SRAM→HBM: dQacc_i (Br·d fp32)
                mc.free("Q", "dO", "L", "D", "dQacc", "S", "dP")
            mc.free("K", "V")
        mc.store("dK", dK, j0, j1, prec.io_round(dKj))           # SRAM→HBM: dK_j (Bc·d)
        mc.store("dV", dV, j0, j1, prec.io_round(dVj))           # SRAM→HBM: dV_j (Bc·dv)
        mc.free("dK", "dV")

    dQ = _hbm(shape, shape.Nq, d)
    for i in range(tiles.Tr):                                    # post-pass
        i0, i1 = i * Br, min((i + 1) * Br, shape.Nq)
        dQi = mc.load("dQacc", dQacc, i0, i1, elem=STAT_BYTES)   # HBM→SRAM: dQacc_i (Br·d fp32)
        mc.store("dQ", dQ, i0, i1, prec.io_round(prec.cast(dQi)))  # SRAM→HBM: dQ_i (Br·d)
        mc.free("dQacc")
    return dQ, dK, dV


# -- counting without arrays -------------------------------------------------------------

def count_backward(algorithm: str, *, Nq: int, Nk: int, d: int, dv: int | None = None,
                   batch_shape=(), kv_batch_shape=None, sram_bytes=None, block_sizes=None,
                   causal: bool = False, io_dtype="float16", window=None,
                   softcap=None, hardware=None, launch: str = "auto",
                   deterministic: bool = False):
    """`simulate_backward(...).traffic` with no arrays. ``softcap`` matters only to
    standard attention, whose dS pass then also reads S.

    With ``hardware``, returns a `flashsim.hierarchy.Prediction` of the project's backward
    kernels (pre-pass, main kernel, ``deterministic`` or not, post-pass) on that GPU, as
    `count` does for the forward."""
    from .variants import check_softcap
    algorithm = _check_backward_algorithm(algorithm)
    if algorithm == "ring":
        raise ValueError("ring attention's traffic comes from running its ranks: use "
                         "fs.simulate_backward(..., 'ring', world_size=...)")
    shape = make_shape(Nq=Nq, Nk=Nk, d=d, dv=dv, batch_shape=batch_shape,
                       kv_batch_shape=kv_batch_shape)
    b = itemsize_of(io_dtype)
    band = make_band(causal, window)
    capped = check_softcap(softcap) is not None
    if hardware is not None:
        from . import hierarchy
        blocks = hierarchy.hardware_tiles(algorithm, shape, io_dtype, hardware,
                                          sram_bytes=sram_bytes, block_sizes=block_sizes,
                                          launch=launch, backward=True)
        traffic = count_backward(algorithm, Nq=Nq, Nk=Nk, d=d, dv=dv, batch_shape=batch_shape,
                                 kv_batch_shape=kv_batch_shape, block_sizes=blocks,
                                 causal=causal, io_dtype=io_dtype, window=window)
        return hierarchy.predict(shape, io_dtype, band, hardware, backward=True, launch=launch,
                                 block_sizes=block_sizes, deterministic=deterministic,
                                 traffic=traffic)
    rule = "standard" if algorithm == "standard" else f"{algorithm}-backward"
    blocks = resolve_block_sizes(rule, sram_bytes=sram_bytes, block_sizes=block_sizes,
                                 d=shape.d, dv=shape.dv, itemsize=b)
    Nq, Nk, d, dv, n, s = shape.Nq, shape.Nk, shape.d, shape.dv, shape.problems, STAT_BYTES
    if algorithm == "standard":
        nn = Nq * Nk * b
        # tiled products: K, V read once per Q tile; Q, dO once per K/V tile (dK, dV)
        Br, Bc = blocks if blocks is not None else (max(Nq, 1), max(Nk, 1))
        Tr, Tc = cdiv(Nq, Br), cdiv(Nk, Bc)
        return n * Traffic(
            reads={"P": 2 * nn, "dO": (Tc + 1) * Nq * dv * b, "V": Tr * Nk * dv * b,
                   "dP": nn, "dS": 2 * nn, "K": Tr * Nk * d * b, "Q": Tc * Nq * d * b,
                   "S": nn if capped else 0},
            writes={"dV": Nk * dv * b, "dP": nn, "dS": nn, "dQ": Nq * d * b,
                    "dK": Nk * d * b})
    tiles = Tiles(Nq, Nk, *blocks, band)
    ilo, ihi = tiles.q_ranges()
    j0, j1 = tiles.k_bounds()
    keys = int(np.where(ihi >= ilo, j1 - j0, 0).sum())
    rows = int(np.where(ihi >= ilo,
                        np.minimum((ihi + 1) * tiles.Br, Nq) - ilo * tiles.Br, 0).sum())
    common_reads = {"K": keys * d * b, "V": keys * dv * b, "Q": rows * d * b}
    out_writes = {"dK": Nk * d * b, "dV": Nk * dv * b}
    if algorithm == "flash1":
        return n * Traffic(
            reads={**common_reads, "O": rows * dv * b, "dO": rows * dv * b,
                   "dQ": rows * d * b, "l": rows * s, "m": rows * s},
            writes={**out_writes, "dQ": (Nq + rows) * d * b})
    return n * Traffic(
        reads={**common_reads, "O": Nq * dv * b, "dO": (Nq + rows) * dv * b,
               "L": rows * s, "D": rows * s, "dQacc": (rows + Nq) * d * s},
        writes={**out_writes, "D": Nq * s, "dQacc": (Nq + rows) * d * s, "dQ": Nq * d * b})
