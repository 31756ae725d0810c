"""Dense float64 attention: the oracle every algorithm and kernel is checked against.

Materialises S = scale·QKᵀ (Nq × Nk) per problem, so keep it to test sizes.
"""

from __future__ import annotations

import numpy as np

from .problem import canonical, check_arrays, check_scale, restore
from .variants import make_scores


def attention_reference(q, k, v, *, causal: bool = False, scale=None, window=None,
                        softcap=None, alibi_slopes=None):
    """(out, lse) in float64 with FlashAttention's semantics: bottom-right causal mask,
    GQA head groups, out = 0 and lse = −inf for a row that sees no key; variants as in
    `flashsim.variants`."""
    q, k, v, shape = check_arrays(q, k, v)
    scores = make_scores(shape, check_scale(scale, shape.d), causal, window, softcap,
                         alibi_slopes)
    Q, K, V = canonical(q, k, v, shape)
    S, _ = scores.full(Q, K, shape.Nq, shape.Nk)
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


def attention_backward_reference(q, k, v, dout, *, causal: bool = False, scale=None,
                                 window=None, softcap=None, alibi_slopes=None):
    """(dq, dk, dv) in float64 by dense autodiff-by-hand of `attention_reference`:
    dV = Pᵀ dO, dP = dO Vᵀ, dS = P ∘ (dP − rowsum(P ∘ dP)) (∘ (1 − tanh²) under a
    softcap), dQ = scale·dS K, dK = scale·dSᵀ Q; GQA groups and broadcast axes summed."""
    from .backward import sum_to
    q, k, v, shape = check_arrays(q, k, v)
    scores = make_scores(shape, check_scale(scale, shape.d), causal, window, softcap,
                         alibi_slopes)
    Q, K, V = canonical(q, k, v, shape)
    dO = np.asarray(dout, dtype=np.float64)
    if dO.shape != shape.batch_shape + (shape.Nq, shape.dv):
        raise ValueError(f"dout has shape {dO.shape}, expected "
                         f"{shape.batch_shape + (shape.Nq, shape.dv)}")
    from .problem import canon_batch
    dO = dO.reshape(canon_batch(shape) + (shape.Nq, shape.dv))
    S, T = scores.full(Q, K, shape.Nq, shape.Nk)
    m = S.max(axis=-1, initial=-np.inf)
    seen = np.isfinite(m)
    E = np.exp(S - np.where(seen, m, 0.0)[..., None])
    P = E / np.where(seen, E.sum(axis=-1), 1.0)[..., None]
    dV = np.swapaxes(P, -1, -2) @ dO
    dP = dO @ np.swapaxes(V, -1, -2)
    dS = P * (dP - (P * dP).sum(axis=-1, keepdims=True))
    if T is not None:
        dS = dS * (1.0 - T * T)
    dQ = scores.scale * (dS @ K)
    dK = scores.scale * (np.swapaxes(dS, -1, -2) @ Q)
    return (sum_to(dQ, Q.shape).reshape(q.shape), sum_to(dK, K.shape).reshape(k.shape),
            sum_to(dV, V.shape).reshape(v.shape))


def attention_same_dtype(q, k, v, dout=None, *, io_dtype: str, causal: bool = False,
                         scale=None):
    """Dense attention as a framework computes it in the I/O type itself (FlashAttention's
    'naive same-dtype' baseline): every matrix product accumulates in fp32 and rounds
    its result to ``io_dtype``; the softmax runs in fp32 on the rounded S and rounds P.

    Returns out, or (out, dq, dk, dv) with ``dout``, all float64 arrays of rounded values.
    FlashAttention's correctness rule compares a kernel's error against this one's:
    max|out − ref| ≤ 2·max|out_same_dtype − ref| (3× for gradients). One problem at a
    time: q (Nq, d), k (Nk, d), v (Nk, dv).
    """
    from .precision import make_precision
    r = make_precision("kernel", io_dtype).io_round
    f32 = np.float32
    q, k, v = (r(np.asarray(x, f32)).astype(f32) for x in (q, k, v))
    s = check_scale(scale, q.shape[-1])
    S = r(f32(s) * (q @ k.T))
    if causal:
        Nq, Nk = S.shape
        S = np.where(np.arange(Nk)[None, :] <= np.arange(Nq)[:, None] + Nk - Nq, S, -np.inf)
    m = S.max(axis=-1, keepdims=True, initial=-np.inf)
    E = np.exp(S - np.where(np.isfinite(m), m, 0))
    P = r(E / np.maximum(E.sum(axis=-1, keepdims=True), np.finfo(f32).tiny))
    out = r(P @ v)
    if dout is None:
        return out.astype(np.float64)
    dO = r(np.asarray(dout, f32))
    dV = r(P.T @ dO)
    dP = r(dO @ v.T)
    dS = r(P * (dP - (P * dP).sum(axis=-1, keepdims=True)))
    dQ = r(f32(s) * (dS @ k))
    dK = r(f32(s) * (dS.T @ q))
    return tuple(x.astype(np.float64) for x in (out, dQ, dK, dV))
