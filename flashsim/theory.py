"""Closed forms of each schedule's exact HBM traffic, and the Θ bounds of the
FlashAttention paper's Theorem 2.

Written from the loop structure on paper, not from the simulator's code, so that
``simulate(...).traffic == count(...) == theory.traffic(...)`` is a real check.

Notation: b = bytes per I/O element, s = 4 bytes per statistic, Tr = ⌈Nq/Br⌉,
Tc = ⌈Nk/Bc⌉, off = Nk − Nq; everything is per problem and then multiplied by the
number of (batch, query-head) problems.

Non-causal (every pair visited; Nq, Nk > 0):
  standard  reads  Q: Nq·d·b, K: Nk·d·b, S: Nq·Nk·b, P: Nq·Nk·b, V: Nk·dv·b
            writes S: Nq·Nk·b, P: Nq·Nk·b, O: Nq·dv·b
  flash1    reads  K: Nk·d·b, V: Nk·dv·b, Q: Tc·Nq·d·b, O: Tc·Nq·dv·b, ℓ, m: Tc·Nq·s
            writes O: (1 + Tc)·Nq·dv·b, ℓ, m: (1 + Tc)·Nq·s
  flash2    reads  Q: Nq·d·b, K: Tr·Nk·d·b, V: Tr·Nk·dv·b
            writes O: Nq·dv·b, L: Nq·s

Causal (row r sees keys c ≤ r + off): Q tile i, whose last row is
r_i = min((i+1)·Br, Nq) − 1, reads keys 0 … min(Nk, Bc·(⌊(r_i + off)/Bc⌋ + 1)) − 1,
and is skipped when r_i + off < 0. K/V tile j, whose first key is j·Bc, is first seen
by row max(0, j·Bc − off), so it meets Nq − Br·⌊max(0, j·Bc − off)/Br⌋ query rows.
With Nq = Nk = N and Br = Bc = B dividing N (T = N/B) both sums are N·(T + 1)/2.
"""

from __future__ import annotations

import math

import numpy as np

from .problem import STAT_BYTES, check_algorithm
from .tiling import cdiv
from .traffic import Traffic


def traffic(algorithm: str, *, Nq: int, Nk: int, d: int, dv: int | None = None,
            Br: int | None = None, Bc: int | None = None, causal: bool = False,
            itemsize: int = 2, problems: int = 1) -> Traffic:
    """Exact HBM bytes of ``algorithm`` from the closed forms in this module's docstring."""
    check_algorithm(algorithm)
    dv = d if dv is None else dv
    b, s = itemsize, STAT_BYTES
    if algorithm == "standard":
        t = Traffic(reads={"Q": Nq * d * b, "K": Nk * d * b, "S": Nq * Nk * b,
                           "P": Nq * Nk * b, "V": Nk * dv * b},
                    writes={"S": Nq * Nk * b, "P": Nq * Nk * b, "O": Nq * dv * b})
        return problems * t
    if Br is None or Bc is None:
        raise ValueError(f"theory.traffic({algorithm!r}) needs Br and Bc")
    if algorithm == "flash2":
        q_rows, keys = _flash2_rows_keys(Nq, Nk, Br, Bc, causal)
        t = Traffic(reads={"Q": q_rows * d * b, "K": keys * d * b, "V": keys * dv * b},
                    writes={"O": Nq * dv * b, "L": Nq * s})
        return problems * t
    keys, rows = _flash1_keys_rows(Nq, Nk, Br, Bc, causal)
    t = Traffic(reads={"K": keys * d * b, "V": keys * dv * b, "Q": rows * d * b,
                       "O": rows * dv * b, "l": rows * s, "m": rows * s},
                writes={"O": (Nq + rows) * dv * b, "l": (Nq + rows) * s,
                        "m": (Nq + rows) * s})
    return problems * t


def _flash2_rows_keys(Nq, Nk, Br, Bc, causal) -> tuple[int, int]:
    """(Q rows read, K/V rows read) summed over Q tiles."""
    if Nq == 0 or Nk == 0:
        return 0, 0
    Tr = cdiv(Nq, Br)
    if not causal:
        return Nq, Tr * Nk
    off = Nk - Nq
    last = np.minimum((np.arange(Tr, dtype=np.int64) + 1) * Br, Nq) - 1 + off
    first = np.arange(Tr, dtype=np.int64) * Br
    seen = last >= 0
    rows = np.minimum(first + Br, Nq) - first
    keys = np.minimum(Nk, Bc * (np.where(seen, last, 0) // Bc + 1))
    return int(rows[seen].sum()), int(keys[seen].sum())


def _flash1_keys_rows(Nq, Nk, Br, Bc, causal) -> tuple[int, int]:
    """(K/V rows read, Q rows met) summed over K/V tiles."""
    if Nq == 0 or Nk == 0:
        return 0, 0
    Tc = cdiv(Nk, Bc)
    if not causal:
        return Nk, Tc * Nq
    off = Nk - Nq
    first_row = np.maximum(0, np.arange(Tc, dtype=np.int64) * Bc - off)
    # causal: the last query row sees every key, so every K/V tile is visited
    return Nk, int((Nq - Br * (first_row // Br)).sum())


def causal_square_rows(N: int, B: int) -> int:
    """Rows (flash1: Q rows; flash2: K rows) a causal square problem moves when
    Br = Bc = B divides N: Σ_{t=1..T} t·B = N·(T + 1)/2 with T = N/B."""
    if N % B:
        raise ValueError(f"B={B} must divide N={N}")
    T = N // B
    return N * (T + 1) // 2


# -- Θ shapes (FlashAttention, Theorem 2; in elements) ----------------------------------

def theorem2_standard(N: int, d: int) -> float:
    """Standard attention: Θ(N·d + N²) HBM accesses."""
    return float(N * d + N * N)


def theorem2_flash(N: int, d: int, M: int) -> float:
    """FlashAttention: Θ(N²·d²/M) HBM accesses for d ≤ M ≤ N·d (M in elements)."""
    if M <= 0:
        raise ValueError("M (SRAM size in elements) must be positive")
    return N * N * d * d / M


def paper_block_sizes(M: int, d: int) -> tuple[int, int]:
    """Algorithm 1's (Br, Bc) = (min(⌈M/4d⌉, d), ⌈M/4d⌉) before any fitting."""
    Bc = math.ceil(M / (4 * d))
    return min(Bc, d), Bc
