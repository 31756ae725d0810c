"""Dense float64 attention: the oracle every algorithm and kernel is checked against.

Materialises S = scale·QKᵀ (Nq × Nk) per problem, so keep it to test sizes.
"""

from __future__ import annotations

import numpy as np

from .problem import canonical, check_arrays, check_scale, restore
from .tiling import band_for


def attention_reference(q, k, v, *, causal: bool = False, scale=None):
    """(out, lse) in float64 with FlashAttention's semantics: bottom-right causal mask,
    GQA head groups, out = 0 and lse = −inf for a row that sees no key."""
    q, k, v, shape = check_arrays(q, k, v)
    scale = check_scale(scale, shape.d)
    Q, K, V = canonical(q, k, v, shape)
    S = scale * (Q @ np.swapaxes(K, -1, -2))
    band = band_for(bool(causal))
    if not band.unbounded:
        S = np.where(band.allowed(np.arange(shape.Nq), np.arange(shape.Nk),
                                  shape.Nk - shape.Nq), S, -np.inf)
    m = S.max(axis=-1, initial=-np.inf)
    seen = np.isfinite(m)
    P = np.exp(S - np.where(seen, m, 0.0)[..., None])
    l = P.sum(axis=-1)
    out = (P @ V) / np.where(seen, l, 1.0)[..., None]
    with np.errstate(divide="ignore"):
        lse = np.where(seen, m + np.log(np.where(seen, l, 1.0)), -np.inf)
    full = out.shape[:-2]
    return (restore(np.ascontiguousarray(np.broadcast_to(out, full + out.shape[-2:])), shape,
                    (shape.Nq, shape.dv)),
            restore(np.ascontiguousarray(np.broadcast_to(lse, full + lse.shape[-1:])), shape,
                    (shape.Nq,)))
