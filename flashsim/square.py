"""Square tiles for SRAM smaller than d² (Saha & Ye 2024, "The I/O complexity of
attention, or how optimal is FlashAttention?"), made numerically safe.

When M < d² (M = SRAM size in elements) not even one row block of Q of useful height
fits next to its K/V partner: FlashAttention's rule Br ≈ M/4d shrinks to a handful of
rows and its traffic grows like N²d²/M. Saha & Ye show the lower bound is
Θ(N²d/√M) there, reached by treating the two products of attention as blocked
matrix multiplications with square B × B tiles, B ≈ √(M/4), and writing the
exponentiated score blocks to HBM between them. Their listing computes exp(S) with no
max subtraction, which overflows for logits beyond ~709 (float64) or ~88 (fp32).
This schedule subtracts a per-block row max and rescales online in the second phase,
like FlashAttention, at the cost of one fp32 statistic per row per block (lower order).

Notation: Br = Bc = B; Q tile i = rows [iB, min((i+1)B, Nq)), K/V tile j = keys
[jB, min((j+1)B, Nk)); a chunk of the head dim d (or dv) is a column range of width B,
the last one narrower; Cd = ⌈d/B⌉, Cv = ⌈dv/B⌉; b = bytes per I/O element, s = 4.

Phase 1 (scores), for each Q tile i and each visited K tile j (a band mask leaves the
interval jlo[i]..jhi[i], fully masked pairs are skipped as in flash2):
    S_ij = 0 (B×B in SRAM)
    for each d-chunk c:  load Q_i[:, c] (B×|c|), K_j[:, c] (B×|c|);  S_ij += scale·Q Kᵀ
    S_ij ← finish(S_ij)                    (softcap, ALiBi, mask: on the complete block)
    m̃_ij = rowmax(S_ij);  E_ij = exp(S_ij − m̃_ij)     (E overwrites S; rows with no
                                                         visible key: m̃ = −∞, E = 0)
    write E_ij (B×B, tensor "P") and m̃_ij (B fp32, tensor "m")
Phase 2 (softmax · V), for each Q tile i and each dv-chunk c:
    O = 0 (B×|c|), m = −∞, ℓ = 0 (B fp32 each, in SRAM)
    for each visited j:  load E_ij, m̃_ij, V_j[:, c] (B×|c|)
        m_new = max(m, m̃_ij);  α = e^{m − m_new};  β = e^{m̃_ij − m_new}
        O ← α·O + β·E_ij V_j[:, c];   ℓ ← α·ℓ + β·rowsum(E_ij);   m ← m_new
    write O_i[:, c] = O / ℓ (0 where ℓ = 0); after the last chunk write L_i = m + log ℓ
    (−∞ where ℓ = 0). ℓ is recomputed on every chunk from the E_ij already loaded for
    that chunk, so it costs no extra reads. A Q tile that sees no key reads nothing and
    writes O_i = 0, L_i = −∞.
Every exponent is ≤ 0 (E ≤ 1, α, β ≤ 1), so logits of any finite size give finite
results; m̃ = −∞ is replaced by 0 before subtracting, so no −∞ − (−∞) NaN arises.

SRAM footprint (bytes live at the busiest moment; matrix tiles b per element with E
overwriting S in place, statistics 4 bytes), w = min(B, d), wv = min(B, dv):
    phase 1:  S_ij, Q_i[:, c], K_j[:, c]                 = (B² + 2·B·w)·b
              (after the chunks: S/E_ij and m̃_ij         = B²·b + B·4, never more
               than the line above unless w·b = 1, hence the max below)
    phase 2:  O_i[:, c], E_ij, V_j[:, c], and m, ℓ, m_new, m̃_ij
                                                          = (B² + 2·B·wv)·b + 4·B·4
    footprint = max((B² + 2·B·w)·b, B²·b + 4·B, (B² + 2·B·wv)·b + 16·B)
The block rule starts at B = ⌊√(M/4)⌋ (M = sram_bytes // b) and shrinks B until the
footprint fits; tiles are square, so block_sizes=(Br, Bc) needs Br == Bc.

Exact HBM traffic, per problem (then × the number of problems). For Q tile i let
r_i = its rows, n_i = jhi[i] − jlo[i] + 1 its visited K tiles (0 if none) and
k_i = the keys they cover. Then
    reads   Q: Σ r_i·n_i·d·b      K: Σ k_i·d·b      V: Σ k_i·dv·b
            P: Cv·Σ r_i·k_i·b     m: Cv·Σ r_i·n_i·s
    writes  P: Σ r_i·k_i·b        m: Σ r_i·n_i·s    O: Nq·dv·b    L: Nq·s
Non-causal (every pair visited), with Tr = ⌈Nq/B⌉, Tc = ⌈Nk/B⌉:
    reads   Q: Tc·Nq·d·b   K: Tr·Nk·d·b   V: Tr·Nk·dv·b   P: Cv·Nq·Nk·b   m: Cv·Tc·Nq·s
    writes  P: Nq·Nk·b     m: Tc·Nq·s     O: Nq·dv·b      L: Nq·s
With Nq = Nk = N, d = dv and B | N, d: N²·b·(4d/B + 1) + N·(Tc·(d/B + 1) + 1)·s
+ N·d·b, i.e. ≈ 8·N²·d/√M elements for B = √(M/4): Θ(N²d/√M) (the N² term from
writing E once is at most N²d/√M when M ≤ d²). Causal: Q tile i, whose last row is
ρ_i = min((i+1)B, Nq) − 1, visits K tiles 0 … min(Tc − 1, ⌊(ρ_i + Nk − Nq)/B⌋)
and none when ρ_i + Nk − Nq < 0; `theory_square` also takes a sliding window.
"""

from __future__ import annotations

from math import isqrt, sqrt

import numpy as np

from .memory import Machine
from .precision import EXACT, Precision
from .problem import STAT_BYTES, Shape, canon_batch
from .tiling import BLOCK_RULES, BlockRule, Tiles, cdiv
from .traffic import Traffic
from .variants import Scores

NEG_INF = -np.inf


def _check_square(Br: int, Bc: int) -> int:
    if Br != Bc:
        raise ValueError(f"square needs Br == Bc (square B×B tiles), got block_sizes="
                         f"({Br}, {Bc}); pass block_sizes=(B, B) or sram_bytes=")
    return Br


def _footprint(Br, Bc, d, dv, b):
    """See the module docstring: max over the two phases' busiest moments."""
    B = _check_square(Br, Bc)
    w, wv = min(B, d), min(B, dv)
    return max((B * B + 2 * B * w) * b,
               B * B * b + B * STAT_BYTES,
               (B * B + 2 * B * wv) * b + 4 * B * STAT_BYTES)


BLOCK_RULES["square"] = BlockRule(tiles=lambda B, d: (B, B), footprint=_footprint,
                                  start=lambda M, d: max(1, isqrt(M // 4)))


def _safe(m: np.ndarray) -> np.ndarray:
    # −∞ (no visible key so far) → 0, so that exp(−∞ − 0) = 0 rather than NaN
    return np.where(np.isneginf(m), 0.0, m)


def _chunks(width: int, B: int):
    return [(c0, min(c0 + B, width)) for c0 in range(0, width, B)]


def run_square(mc: Machine, Q, K, V, shape: Shape, tiles: Tiles, scores: Scores,
               prec: Precision = EXACT):
    """Saha & Ye's square-tile schedule with per-block row maxima; returns (O, L) in
    the canonical layout, like `simulate._flash2`. ``prec`` (precision="kernel"): what
    kernels_cu/square_ref.cu does, E_ij and O stored in the I/O type, m̃_ij and L in fp32,
    the arithmetic in fp32 (float64 for float64 inputs)."""
    B = _check_square(tiles.Br, tiles.Bc)
    Nq, Nk, d, dv = shape.Nq, shape.Nk, shape.d, shape.dv
    lead = canon_batch(shape)
    O = np.full(lead + (Nq, dv), np.nan, dtype=prec.acc)   # poisoned: every row is written
    L = np.full(lead + (Nq,), np.nan, dtype=prec.acc)
    E = np.full(lead + (Nq, Nk), np.nan, dtype=prec.acc)   # exp(S − m̃) blocks in HBM
    Mt = np.full(lead + (tiles.Tc, Nq), np.nan, dtype=prec.acc)  # m̃_ij: row j, block column j
    jlo, jhi = tiles.kv_ranges()
    d_chunks, dv_chunks = _chunks(d, B), _chunks(dv, B)

    # -- phase 1: E_ij = exp(S_ij − m̃_ij), S_ij accumulated over chunks of d --------
    for i in range(tiles.Tr):
        i0, i1 = i * B, min((i + 1) * B, Nq)
        rows = np.arange(i0, i1)
        for j in range(jlo[i], jhi[i] + 1):
            j0, j1 = j * B, min((j + 1) * B, Nk)
            mc.scratch("S", i1 - i0, j1 - j0)
            S = 0.0
            for c0, c1 in d_chunks:
                Qc = mc.load("Q", Q[..., c0:c1], i0, i1)          # HBM→SRAM: Q_i[:, c] (B·|c|)
                Kc = mc.load("K", K[..., c0:c1], j0, j1)          # HBM→SRAM: K_j[:, c] (B·|c|)
                S = S + scores.raw(Qc, Kc)
                mc.free("Q", "K")
            mask = tiles.mask(i, j) if tiles.partial(i, j) else None
            S, _ = scores.finish(S, rows, np.arange(j0, j1), tiles.off, mask)
            mc.scratch("m~", i1 - i0, stat=True)
            m_t = S.max(axis=-1)                                  # m̃_ij = rowmax(S_ij)
            P = np.exp(S - _safe(m_t)[..., None])                 # E_ij overwrites S_ij
            mc.store("P", E[..., j0:j1], i0, i1, prec.io_round(P))  # SRAM→HBM: E_ij (B·B)
            mc.store("m", Mt[..., j, :], i0, i1, prec.stat_round(m_t),
                     stat=True)                                   # SRAM→HBM: m̃_ij (B)
            mc.free("S", "m~")

    # -- phase 2: O_i[:, c] = softmax(S_i) V[:, c], rescaled online over j -----------
    for i in range(tiles.Tr):
        i0, i1 = i * B, min((i + 1) * B, Nq)
        n = i1 - i0
        for c0, c1 in dv_chunks:
            mc.scratch("O", n, c1 - c0)
            mc.scratch("m", n, stat=True)
            mc.scratch("l", n, stat=True)
            mc.scratch("m_new", n, stat=True)
            Oc = prec.acc(0.0)
            mi = np.full(lead + (n,), NEG_INF, dtype=prec.acc)
            li = np.zeros(lead + (n,), dtype=prec.acc)
            for j in range(jlo[i], jhi[i] + 1):
                j0, j1 = j * B, min((j + 1) * B, Nk)
                Pj = mc.load("P", E[..., j0:j1], i0, i1)          # HBM→SRAM: E_ij (B·B)
                m_t = mc.load("m", Mt[..., j, :], i0, i1, slot="m~",
                              stat=True)                          # HBM→SRAM: m̃_ij (B)
                Vc = mc.load("V", V[..., c0:c1], j0, j1)          # HBM→SRAM: V_j[:, c] (B·|c|)
                m_new = np.maximum(mi, m_t)
                alpha = np.exp(mi - _safe(m_new))                 # e^{m − m_new}
                beta = np.exp(m_t - _safe(m_new))                 # e^{m̃_ij − m_new}
                Oc = alpha[..., None] * Oc + beta[..., None] * (Pj @ Vc)
                li = alpha * li + beta * Pj.sum(axis=-1)
                mi = m_new
                mc.free("P", "m~", "V")
            seen = li > 0
            Oc = np.broadcast_to(Oc / np.where(seen, li, 1.0)[..., None], lead + (n, c1 - c0))
            mc.store("O", O[..., c0:c1], i0, i1, prec.io_round(Oc))  # SRAM→HBM: O_i[:, c] (B·|c|)
            if c1 == dv:
                with np.errstate(divide="ignore"):
                    Li = np.where(seen, mi + np.log(np.where(seen, li, 1.0)), NEG_INF)
                mc.store("L", L, i0, i1, prec.stat_round(Li),
                         stat=True)                               # SRAM→HBM: L_i = m + log ℓ (B)
            mc.free("O", "m", "l", "m_new")
    return O, L


def _row_block_sums(tiles: Tiles):
    """Per Q tile: rows r_i, visited K tiles n_i, keys covered k_i (int64 arrays)."""
    jlo, jhi = tiles.kv_ranges()
    i0, i1 = tiles.q_bounds()
    visited = jhi >= jlo
    rows = i1 - i0
    pairs = np.where(visited, jhi - jlo + 1, 0)
    keys = np.where(visited, np.minimum((jhi + 1) * tiles.Bc, tiles.Nk) - jlo * tiles.Bc, 0)
    return rows, pairs, keys


def _traffic(Nq, dv, d, B, rn, k, rk, b) -> Traffic:
    """Traffic from Σ r_i·n_i (rn), Σ k_i (k), Σ r_i·k_i (rk); see the docstring."""
    s, Cv = STAT_BYTES, cdiv(dv, B)
    return Traffic(
        reads={"Q": rn * d * b, "K": k * d * b, "V": k * dv * b,
               "P": Cv * rk * b, "m": Cv * rn * s},
        writes={"P": rk * b, "m": rn * s, "O": Nq * dv * b, "L": Nq * s})


def count_square(shape: Shape, tiles: Tiles, b: int) -> Traffic:
    """Exact traffic of `run_square`, in O(Tr) vectorised work."""
    B = _check_square(tiles.Br, tiles.Bc)
    rows, pairs, keys = _row_block_sums(tiles)
    t = _traffic(shape.Nq, shape.dv, shape.d, B, int((rows * pairs).sum()), int(keys.sum()),
                 int((rows * keys).sum()), b)
    return shape.problems * t


def theory_square(*, Nq: int, Nk: int, d: int, dv: int | None = None, B: int,
                  causal: bool = False, left: int | None = None, right: int | None = None,
                  itemsize: int = 2, problems: int = 1) -> Traffic:
    """The closed form of the module docstring, written from the loop structure.

    Unmasked: Σ r_i·n_i = Tc·Nq, Σ k_i = Tr·Nk, Σ r_i·k_i = Nq·Nk. With a band (row r
    sees keys r + off − left … r + off + right, off = Nk − Nq, None = unbounded;
    ``causal`` caps right at 0), Q tile i with rows f_i … ρ_i sees keys
    c_lo = max(0, f_i + off − left) … c_hi = min(Nk − 1, ρ_i + off + right) and visits
    the K tiles ⌊c_lo/B⌋ … ⌊c_hi/B⌋ (none if c_lo > c_hi): n_i = ⌊c_hi/B⌋ − ⌊c_lo/B⌋ + 1
    tiles covering k_i = min(Nk, B·(⌊c_hi/B⌋ + 1)) − B·⌊c_lo/B⌋ keys. Causal alone:
    n_i = min(Tc, ⌊(ρ_i + off)/B⌋ + 1), k_i = min(Nk, B·n_i), none when ρ_i + off < 0.
    """
    dv = d if dv is None else dv
    if causal:
        right = 0 if right is None else min(right, 0)
    Tr, Tc = cdiv(Nq, B), cdiv(Nk, B)
    if left is None and right is None:
        rn, k, rk = Tc * Nq, Tr * Nk, Nq * Nk
    else:
        off = Nk - Nq
        first = np.arange(Tr, dtype=np.int64) * B
        rows = np.minimum(first + B, Nq) - first
        last = first + rows - 1
        c_lo = np.maximum(0, first + off - left) if left is not None else np.zeros_like(first)
        c_hi = (np.minimum(Nk - 1, last + off + right) if right is not None
                else np.full_like(first, Nk - 1))
        seen = c_lo <= c_hi
        n = np.where(seen, c_hi // B - c_lo // B + 1, 0)
        keys = np.where(seen, np.minimum(Nk, B * (c_hi // B + 1)) - B * (c_lo // B), 0)
        rn, k, rk = int((rows * n).sum()), int(keys.sum()), int((rows * keys).sum())
    return problems * _traffic(Nq, dv, d, B, rn, k, rk, itemsize)


def theta_square(N: int, d: int, M: int) -> float:
    """Saha & Ye's Θ(N²·d/√M) HBM accesses for M < d² (M in elements)."""
    if M <= 0:
        raise ValueError("M (SRAM size in elements) must be positive")
    return N * N * d / sqrt(M)


__all__ = ["run_square", "count_square", "theory_square", "theta_square"]
