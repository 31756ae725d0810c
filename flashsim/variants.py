"""The attention variants real models use, as one description of how a tile of scores
is formed:

    S = softcap(scale · Q Kᵀ) − slope · |r + Nk − Nq − c|,   masked to the band

- ``window=(left, right)``: row r sees keys r + off − left ≤ c ≤ r + off + right
  (off = Nk − Nq, −1 = unbounded); ``causal=True`` is window (−1, 0) and, as in
  FlashAttention, forces right = 0 when combined with a window.
- ``softcap=c``: scores become c·tanh(S/c) before the softmax (Gemma-2, Grok).
- ``alibi_slopes``: shape (heads,) or (batch, heads) over the query heads; adds
  −slope·|r + off − c| after the softcap, as FlashAttention does.

None of these changes the bytes a tile costs; only the band changes which tiles are
visited. The slopes are kernel arguments (one fp32 per head), not counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .problem import Shape, canon_batch
from .tiling import Band, Tiles

NEG_INF = -np.inf


def make_band(causal: bool, window) -> Band:
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    left = right = None
    if window is not None:
        try:
            wl, wr = window
        except (TypeError, ValueError):
            raise TypeError(f"window must be a pair (left, right), got {window!r}") from None
        for name, w in (("left", wl), ("right", wr)):
            if isinstance(w, bool) or not isinstance(w, (int, np.integer)):
                raise TypeError(f"window {name} must be an integer (-1 = unbounded), got {w!r}")
            if w < -1:
                raise ValueError(f"window {name} must be >= -1 (-1 means unbounded), got {w}")
        left = None if wl == -1 else int(wl)
        right = None if wr == -1 else int(wr)
    if causal:
        right = 0 if right is None else min(right, 0)
    return Band(left, right)


def check_softcap(softcap) -> float | None:
    if softcap is None:
        return None
    try:
        c = float(softcap)
    except (TypeError, ValueError):
        raise TypeError(f"softcap must be a positive number or None, got {softcap!r}") from None
    if not (c > 0 and math.isfinite(c)):
        raise ValueError(f"softcap must be > 0 and finite (None turns it off), got {softcap!r}")
    return c


def canonical_slopes(alibi_slopes, shape: Shape) -> np.ndarray | None:
    """Slopes of shape (heads,) or (batch, heads) → canonical (…, hk, g) for broadcasting
    against score tiles of shape (…, hk, g, rows, cols)."""
    if alibi_slopes is None:
        return None
    s = np.asarray(alibi_slopes)
    if s.dtype.kind not in "fiu" or s.dtype.kind == "b":
        raise TypeError(f"alibi_slopes must be real numbers, got dtype {s.dtype}")
    s = s.astype(np.float64)
    if not np.isfinite(s).all():
        raise ValueError("alibi_slopes must be finite")
    heads = shape.batch_shape[-1] if shape.batch_shape else 1
    batch = shape.batch_shape[-2] if len(shape.batch_shape) >= 2 else None
    hint = (f"alibi_slopes must have shape ({heads},) (one per query head)"
            + (f" or ({batch}, {heads}) (per batch entry and head)" if batch else "")
            + f"; got {s.shape}")
    if s.ndim == 1 and s.shape[0] == heads:
        lead = ()
    elif s.ndim == 2 and batch is not None and s.shape == (batch, heads):
        lead = (batch,)
    else:
        raise ValueError(hint)
    *_, hk, g = canon_batch(shape)
    return s.reshape(lead + (hk, g))


@dataclass(frozen=True)
class Scores:
    """How each (Q tile i, K/V tile j) block of S is formed; see the module docstring."""
    scale: float
    band: Band
    softcap: float | None = None
    slopes: np.ndarray | None = None

    def bias(self, rows: np.ndarray, cols: np.ndarray, off: int):
        """The ALiBi term −slope·|r + off − c| (0 without slopes)."""
        if self.slopes is None:
            return 0.0
        dist = np.abs(rows[:, None] + off - cols[None, :]).astype(np.float64)
        return -self.slopes[..., None, None] * dist

    def raw(self, Qi, Kj) -> np.ndarray:
        return self.scale * (Qi @ np.swapaxes(Kj, -1, -2))

    def finish(self, S_raw, rows: np.ndarray, cols: np.ndarray, off: int,
               mask: np.ndarray | None):
        """(S, T): final masked scores and, with a softcap, T = tanh(S_raw / c), whose
        1 − T² the backward pass needs."""
        T = None
        S = S_raw
        if self.softcap is not None:
            T = np.tanh(S_raw / self.softcap)
            S = self.softcap * T
        if self.slopes is not None:
            S = S + self.bias(rows, cols, off)
        if mask is not None:
            S = np.where(mask, S, NEG_INF)
        return S, T

    def tile(self, Qi, Kj, tiles: Tiles, i: int, j: int):
        i0, i1 = i * tiles.Br, min((i + 1) * tiles.Br, tiles.Nq)
        j0, j1 = j * tiles.Bc, min((j + 1) * tiles.Bc, tiles.Nk)
        mask = tiles.mask(i, j) if tiles.partial(i, j) else None
        return self.finish(self.raw(Qi, Kj), np.arange(i0, i1), np.arange(j0, j1),
                           tiles.off, mask)

    def full(self, Q, K, Nq: int, Nk: int):
        """All of S at once (standard attention and the dense oracle)."""
        rows, cols = np.arange(Nq), np.arange(Nk)
        mask = None if self.band.unbounded else self.band.allowed(rows, cols, Nk - Nq)
        return self.finish(self.raw(Q, K), rows, cols, Nk - Nq, mask)


def make_scores(shape: Shape, scale: float, causal, window, softcap, alibi_slopes) -> Scores:
    return Scores(scale, make_band(causal, window), check_softcap(softcap),
                  canonical_slopes(alibi_slopes, shape))
