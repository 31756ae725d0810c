"""Closed forms of each schedule's exact HBM traffic, and the Θ bounds of the
FlashAttention paper's Theorem 2.

Written from the loop structure on paper, not from the simulator's code, so that
``simulate(...).traffic == count(...) == theory.traffic(...)`` is a real check.

Notation: b = bytes per I/O element, s = 4 bytes per statistic, Tr = ⌈Nq/Br⌉,
Tc = ⌈Nk/Bc⌉, off = Nk − Nq; everything is per problem and then multiplied by the
number of (batch, query-head) problems.

Non-causal (every pair visited; Nq, Nk > 0):
  standard  reads  Q: Nq·d·b, K: Nk·d·b, S: Nq·Nk·b, P: Nq·Nk·b, V: Nk·dv·b
            writes S: Nq·Nk·b, P: Nq·Nk·b, O: Nq·dv·b, L: Nq·s
            (tiled, Br and Bc given: K and V read Tr times)
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

from .problem import STAT_BYTES, check_algorithm, check_options
from .tiling import cdiv
from .traffic import Traffic


def traffic(algorithm: str, *, Nq: int, Nk: int, d: int, dv: int | None = None,
            Br: int | None = None, Bc: int | None = None, causal: bool = False,
            window=None, itemsize: int = 2, problems: int = 1,
            num_splits: int | None = None, cluster: bool = False) -> Traffic:
    """Exact HBM bytes of ``algorithm`` from the closed forms in this module's docstring."""
    check_algorithm(algorithm)
    _no_ring(algorithm)
    if algorithm != "splitkv":      # num_splits and cluster are splitkv's alone
        check_options(algorithm, num_splits=num_splits, cluster=cluster)
    dv = d if dv is None else dv
    b, s = itemsize, STAT_BYTES
    if algorithm == "standard":
        # whole matrices (Br, Bc None): each operand once; tiled: K, V once per Q tile
        Tr = cdiv(Nq, Br or max(Nq, 1))
        t = Traffic(reads={"Q": Nq * d * b, "K": Tr * Nk * d * b, "S": Nq * Nk * b,
                           "P": Nq * Nk * b, "V": Tr * Nk * dv * b},
                    writes={"S": Nq * Nk * b, "P": Nq * Nk * b, "O": Nq * dv * b,
                            "L": Nq * s})
        return problems * t
    if Br is None or Bc is None:
        raise ValueError(f"theory.traffic({algorithm!r}) needs Br and Bc")
    left, right = _band(causal, window)
    if algorithm == "splitkv":
        from .splitkv import theory_splitkv
        return theory_splitkv(Nq=Nq, Nk=Nk, d=d, dv=dv, Br=Br, Bc=Bc, left=left, right=right,
                              itemsize=itemsize, problems=problems, num_splits=num_splits,
                              cluster=cluster)
    if algorithm == "square":
        from .square import theory_square
        return theory_square(Nq=Nq, Nk=Nk, d=d, dv=dv, B=Br, left=left, right=right,
                             itemsize=itemsize, problems=problems)
    if algorithm == "flash2":
        q_rows, keys = _q_outer(Nq, Nk, Br, Bc, left, right)
        t = Traffic(reads={"Q": q_rows * d * b, "K": keys * d * b, "V": keys * dv * b},
                    writes={"O": Nq * dv * b, "L": Nq * s})
        return problems * t
    keys, rows = _kv_outer(Nq, Nk, Br, Bc, left, right)
    t = Traffic(reads={"K": keys * d * b, "V": keys * dv * b, "Q": rows * d * b,
                       "O": rows * dv * b, "l": rows * s, "m": rows * s},
                writes={"O": (Nq + rows) * dv * b, "l": (Nq + rows) * s,
                        "m": (Nq + rows) * s})
    return problems * t


def _no_ring(algorithm: str) -> None:
    if algorithm == "ring":
        raise ValueError("ring attention's bytes depend on its ranks: fs.simulate(..., 'ring', "
                         "world_size=...) counts them, flashsim.ring.ring_interconnect gives "
                         "the links' closed form")


def traffic_backward(algorithm: str, *, Nq: int, Nk: int, d: int, dv: int | None = None,
                     Br: int | None = None, Bc: int | None = None, causal: bool = False,
                     window=None, softcap: bool = False, itemsize: int = 2,
                     problems: int = 1) -> Traffic:
    """Exact HBM bytes of each backward schedule (see `flashsim.backward`).

    With K' = K/V rows read and R = Σ_j (Q rows met by K/V tile j), both from the
    K/V-outer sums of this module's docstring:
      standard  reads P: 2·Nq·Nk, dO: 2·Nq·dv, V: Nk·dv, dP: Nq·Nk, dS: 2·Nq·Nk, K: Nk·d,
                Q: Nq·d (+ S: Nq·Nk with a softcap); writes dV, dP, dS, dQ, dK once each;
                tiled (Br, Bc given): dO (Tc + 1)·Nq·dv, V and K Tr times, Q Tc times
      flash1    reads K, V: K'; Q, dQ: R·d; O, dO: R·dv; ℓ, m: R·s
                writes dQ: (Nq + R)·d, dK: Nk·d, dV: Nk·dv
      flash2    reads K, V: K'; Q: R·d; dO: (Nq + R)·dv; O: Nq·dv; L, D: R·s;
                dQacc: (Nq + R)·d·s; writes D: Nq·s, dQacc: (Nq + R)·d·s,
                dQ: Nq·d, dK: Nk·d, dV: Nk·dv
    (element sizes b unless marked s = 4 bytes).
    """
    _no_ring(algorithm)
    dv = d if dv is None else dv
    b, s = itemsize, STAT_BYTES
    if algorithm == "standard":
        nn = Nq * Nk * b
        Tr, Tc = cdiv(Nq, Br or max(Nq, 1)), cdiv(Nk, Bc or max(Nk, 1))
        t = Traffic(reads={"P": 2 * nn, "dO": (Tc + 1) * Nq * dv * b, "V": Tr * Nk * dv * b,
                           "dP": nn, "dS": 2 * nn, "K": Tr * Nk * d * b, "Q": Tc * Nq * d * b,
                           "S": nn if softcap else 0},
                    writes={"dV": Nk * dv * b, "dP": nn, "dS": nn, "dQ": Nq * d * b,
                            "dK": Nk * d * b})
        return problems * t
    if algorithm not in ("flash1", "flash2"):
        raise ValueError(f"no backward closed form for {algorithm!r}")
    if Br is None or Bc is None:
        raise ValueError(f"theory.traffic_backward({algorithm!r}) needs Br and Bc")
    keys, R = _kv_outer(Nq, Nk, Br, Bc, *_band(causal, window))
    out = {"dK": Nk * d * b, "dV": Nk * dv * b}
    kv = {"K": keys * d * b, "V": keys * dv * b, "Q": R * d * b}
    if algorithm == "flash1":
        t = Traffic(reads={**kv, "dQ": R * d * b, "O": R * dv * b, "dO": R * dv * b,
                           "l": R * s, "m": R * s},
                    writes={**out, "dQ": (Nq + R) * d * b})
    else:
        t = Traffic(reads={**kv, "dO": (Nq + R) * dv * b, "O": Nq * dv * b, "L": R * s,
                           "D": R * s, "dQacc": (Nq + R) * d * s},
                    writes={**out, "D": Nq * s, "dQacc": (Nq + R) * d * s,
                            "dQ": Nq * d * b})
    return problems * t


def compulsory(*, Nq: int, Nk: int, d: int, dv: int | None = None, itemsize: int = 2,
               problems: int = 1, backward: bool = False) -> Traffic:
    """Each input read once and each output written once: a true lower bound on any
    schedule's traffic (no algorithm can produce its outputs without touching them).
    Forward: read Q, K, V, write O and L. Backward: read Q, K, V, O, dO, L, write dQ,
    dK, dV."""
    dv = d if dv is None else dv
    b, s = itemsize, STAT_BYTES
    if not backward:
        t = Traffic(reads={"Q": Nq * d * b, "K": Nk * d * b, "V": Nk * dv * b},
                    writes={"O": Nq * dv * b, "L": Nq * s})
    else:
        t = Traffic(reads={"Q": Nq * d * b, "K": Nk * d * b, "V": Nk * dv * b,
                           "O": Nq * dv * b, "dO": Nq * dv * b, "L": Nq * s},
                    writes={"dQ": Nq * d * b, "dK": Nk * d * b, "dV": Nk * dv * b})
    return problems * t


def _band(causal: bool, window) -> tuple[int | None, int | None]:
    """(left, right) reach of a row, None = unbounded; causal forces right = 0."""
    left = right = None
    if window is not None:
        left = None if window[0] == -1 else window[0]
        right = None if window[1] == -1 else window[1]
    if causal:
        right = 0 if right is None else min(right, 0)
    return left, right


def _q_outer(Nq, Nk, Br, Bc, left, right) -> tuple[int, int]:
    """(Q rows read, K/V rows read) of a Q-outer schedule: Q tile i (rows i0..i1−1) sees
    keys max(0, i0 + off − left) … min(Nk − 1, i1 − 1 + off + right) and reads the K/V
    tiles that hold them whole."""
    if Nq == 0 or Nk == 0:
        return 0, 0
    Tr, off = cdiv(Nq, Br), Nk - Nq
    i0 = np.arange(Tr, dtype=np.int64) * Br
    i1 = np.minimum(i0 + Br, Nq)
    if left is None and right is None:
        return Nq, Tr * Nk
    c_lo = np.maximum(0, i0 + off - left) if left is not None else np.zeros_like(i0)
    c_hi = np.minimum(Nk - 1, i1 - 1 + off + right) if right is not None else np.full_like(i0, Nk - 1)
    seen = c_lo <= c_hi
    keys = np.minimum(Nk, Bc * (c_hi // Bc + 1)) - Bc * (c_lo // Bc)
    return int((i1 - i0)[seen].sum()), int(keys[seen].sum())


def _kv_outer(Nq, Nk, Br, Bc, left, right) -> tuple[int, int]:
    """(K/V rows read, Σ Q rows met) of a K/V-outer schedule: key c is seen by rows
    c − off − right … c − off + left, so K/V tile j (keys j0..j1−1) meets the Q tiles
    holding rows max(0, j0 − off − right) … min(Nq − 1, j1 − 1 − off + left)."""
    if Nq == 0 or Nk == 0:
        return 0, 0
    Tc, off = cdiv(Nk, Bc), Nk - Nq
    j0 = np.arange(Tc, dtype=np.int64) * Bc
    j1 = np.minimum(j0 + Bc, Nk)
    if left is None and right is None:
        return Nk, Tc * Nq
    r_lo = np.maximum(0, j0 - off - right) if right is not None else np.zeros_like(j0)
    r_hi = np.minimum(Nq - 1, j1 - 1 - off + left) if left is not None else np.full_like(j0, Nq - 1)
    seen = r_lo <= r_hi
    rows = np.minimum(Nq, Br * (r_hi // Br + 1)) - Br * (r_lo // Br)
    return int((j1 - j0)[seen].sum()), int(rows[seen].sum())


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


def theorem5_backward(N: int, d: int, M: int) -> float:
    """Theorem 5: the backward pass has the same Θ(N²·d²/M) as the forward."""
    return theorem2_flash(N, d, M)


def theta_small_sram(N: int, d: int, M: int) -> float:
    """Saha & Ye: for M < d², attention needs Θ(N²·d/√M) HBM accesses (M in elements);
    for M ≥ d², Θ(N²·d²/M) and FlashAttention is optimal."""
    if M <= 0:
        raise ValueError("M (SRAM size in elements) must be positive")
    return N * N * d / math.sqrt(M) if M < d * d else N * N * d * d / M


def paper_block_sizes(M: int, d: int) -> tuple[int, int]:
    """Algorithm 1's (Br, Bc) = (min(⌈M/4d⌉, d), ⌈M/4d⌉) before any fitting."""
    Bc = math.ceil(M / (4 * d))
    return min(Bc, d), Bc
