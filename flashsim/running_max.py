"""Which m a FlashAttention-2 forward subtracts before its exponentials: three rules.

For any m, P = exp(S − m), ℓ = Σ P and O = P V / ℓ give the same softmax, and
L = m + log ℓ the same log-sum-exp; the rules differ in what a step costs and in how P
rounds once it is fed to the second product in the I/O type.

- ``"online"`` (the papers'): m is the running row max, so every P ≤ 1, the largest is
  exactly 1, and each step reduces its rows' max, rescales ℓ and O by α = exp(m_old − m).
- ``"fixed"``: with a softcap c every logit lies in (−c, c), so one m for the whole
  row keeps P in a known interval: m = min(c, 125·ln 2 − c), the kernels'
  ``cap_fixed_m`` (log2 units there), gives P ∈ [2^−125, 2^max(0, 2C − 125)],
  C = c·log2 e, normal in float32 and bfloat16. No row max, no α, no rescale. With
  ALiBi a row's logits are shifted by its bias −slope·|dist|, whose largest value B
  over the row's visible keys moves both ends of the interval: m + B per row keeps it
  (`fixed_max_rows`, the kernels' ``fixed_m_alibi``). The Hopper forward's softcap
  instance runs it in bfloat16 (`flashsim.kernels.cap_only`); as there, 2C − 125 may
  be at most `flashsim.kernels.CAP_HEADROOM`.
- ``"lazy"``: a step takes P = exp(S − m) with the m of the steps before, and moves m
  only where P might leave the I/O type's range. The rule is the Hopper forward's
  float16 softcap instances' (tensor_core.cuh's ``softmax_lazy``), modelled at its
  granularity: a tile's first step is an online one; after it, the 4 threads of a row
  each sum P over their share of the tile's keys (key c to thread (c mod 8) // 2), and a
  warp (16 rows from the tile's first) takes the online step only where a share of one
  of its rows passed 2^12, or one of its rows has seen no key yet. Rows of the last tile
  past Nq count as the kernel's do: zero scores, masked by the band. With ALiBi a tile
  visits its key tiles as the kernel does (`key_order`): first the one holding the
  diagonal key of its middle row, where its rows' biases are largest, then the others
  in order; in key order the rising bias would move m at most steps.

The rule changes no byte of traffic: m and ℓ live in SRAM either way.
"""

from __future__ import annotations

import math

import numpy as np

from .kernels import CAP_HEADROOM, cap_only   # P ≤ 2^CAP_HEADROOM under the fixed max

RULES = ("online", "fixed", "lazy")
AUTO = "auto"            # simulate's: the rule of the kernel it models on ``hardware``
LAZY_BOUND = 2.0**12     # a quiet step's P stays ≤ this (float16's range ends at 2^16)
WARP_ROWS = 16           # rows of S a warp of a 64-row warpgroup holds (m64nNk16)
QUAD = 4                 # threads that share a row, each holding keys 2t, 2t + 1 of 8


def check_rule(rule, algorithm: str) -> str:
    """``rule`` validated for ``algorithm``, with a message that says how to fix it."""
    if rule not in RULES + (AUTO,):
        raise ValueError(f"softmax_max must be one of {RULES + (AUTO,)}, got {rule!r}")
    if rule != "online" and algorithm != "flash2":
        raise ValueError(f"softmax_max={rule!r} is a rule of the flash2 forward; "
                         f"algorithm={algorithm!r} runs the online one (softmax_max='online')")
    return rule


def check_scores(rule: str, softcap, slopes) -> None:
    """The fixed rule's needs, on checked variants (`flashsim.variants.Scores`)."""
    if rule != "fixed":
        return
    if softcap is None:
        raise ValueError("softmax_max='fixed' needs every logit bounded by a softcap; "
                         "use 'online' or 'lazy'")
    if not cap_only("bfloat16", softcap, slopes):           # the kernels' own bound
        limit = (125 + CAP_HEADROOM) / (2 * math.log2(math.e))
        raise ValueError(f"softmax_max='fixed' keeps P ≤ 2^{CAP_HEADROOM} only for "
                         f"softcap ≤ {limit:.1f}, got {softcap}; use 'online' or 'lazy'")


def fixed_max(softcap: float) -> float:
    """The fixed rule's m, natural-log units: min(c, 125·ln 2 − c)."""
    return min(float(softcap), 125 * math.log(2) - float(softcap))


def fixed_max_rows(softcap: float, slopes, band, rows: np.ndarray, off: int, Nk: int):
    """The fixed rule's m of query rows ``rows`` (natural-log units): `fixed_max` plus,
    with ALiBi (``slopes`` (…, hk, g)), the largest bias −slope·|r + off − c| over the
    row's visible keys c (``band``, 0 ≤ c < Nk): at the key nearest the row's diagonal
    r + off for slope ≥ 0, the farthest for slope < 0; a row that sees no key keeps
    `fixed_max`. Shape (…, hk, g, len(rows)), or a scalar without slopes."""
    m = fixed_max(softcap)
    if slopes is None:
        return np.float64(m)
    dq = np.asarray(rows) + off                                # each row's diagonal key
    klo = np.zeros_like(dq) if band.left is None else np.maximum(0, dq - band.left)
    khi = np.full_like(dq, Nk - 1) if band.right is None else np.minimum(Nk - 1, dq + band.right)
    near = np.where(dq < klo, klo - dq, np.where(dq > khi, dq - khi, 0))
    far = np.maximum(np.abs(dq - klo), np.abs(dq - khi))
    s = np.asarray(slopes, dtype=np.float64)[..., None]
    B = -s * np.where(s >= 0, near, far)
    return np.where(klo <= khi, m + B, m)


def _safe(m):
    return np.where(np.isneginf(m), 0.0, m)


def key_order(j_first: int, j_last: int, i0: int, rows: int, off: int, Bc: int,
              diagonal: bool) -> list[int]:
    """The K/V tiles j_first … j_last of the Q tile of ``rows`` rows from query i0 in the
    order the lazy rule's kernel visits them (flash2_ws.cu's key_tile): in key order, or
    (``diagonal``: with ALiBi) the tile of the diagonal key of the middle row first
    (``off`` = Nk − Nq: row r's diagonal key is r + off), then the others in order."""
    order = list(range(j_first, j_last + 1))
    if not diagonal or not order:
        return order
    # C's division truncates towards 0, Python's floors: they differ only below 0, where
    # both clamp to j_first ≥ 0
    jd = min(max((i0 + rows // 2 + off) // Bc, j_first), j_last)
    return [jd] + [j for j in order if j != jd]


def lazy_step(S, m, unseen_past=None):
    """One step of the lazy rule on a tile's scores S (..., rows, keys) and the row max
    m (..., rows) of the steps before: (P, α, m_new). ``unseen_past`` (rows past Nq in
    the kernel's tile: (pad,) bool, True where such a row has seen no key yet) joins the
    last warp's vote."""
    rows, w = S.shape[-2:]
    P = np.exp(S - _safe(m)[..., None])
    Pk = np.concatenate([P, np.zeros(P.shape[:-1] + ((-w) % 8,), P.dtype)], axis=-1)
    shares = Pk.reshape(P.shape[:-1] + (-1, QUAD, 2)).sum(axis=(-3, -1))
    with np.errstate(invalid="ignore"):
        quiet = np.all(shares <= LAZY_BOUND, axis=-1) & ~np.isneginf(m)
    pad = (-rows) % WARP_ROWS
    past = np.ones(pad, dtype=bool) if unseen_past is None else ~np.asarray(unseen_past)[:pad]
    quiet = np.concatenate([quiet, np.broadcast_to(past, quiet.shape[:-1] + (pad,))], axis=-1)
    warp = quiet.reshape(quiet.shape[:-1] + (-1, WARP_ROWS)).all(axis=-1)
    fire = ~np.repeat(warp, WARP_ROWS, axis=-1)[..., :rows]
    mx = S.max(axis=-1, initial=-np.inf)
    move = fire & (mx > m)
    m_new = np.where(move, mx, m)
    alpha = np.where(move, np.exp(m - _safe(m_new)), 1.0).astype(P.dtype)
    P = np.where(move[..., None], np.exp(S - _safe(m_new)[..., None]), P)
    return P, alpha, m_new


__all__ = ["RULES", "check_rule", "check_scores", "fixed_max", "fixed_max_rows", "key_order",
           "lazy_step"]
