"""Packed variable-length batches on the GPU: `flashsim.simulate_varlen`'s call,
``flash_attn_varlen_func``'s layout.

    out, lse = fs.gpu.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=True)
    dq, dk, dv = fs.gpu.attention_varlen_backward(q, k, v, out, lse, dout,
                                                  cu_seqlens_q, cu_seqlens_k, causal=True)

q (total_q, Hq, d), k (total_k, Hk, d), v (total_k, Hk, dv) packed; out like q with dv,
lse (Hq, total_q) fp32, heads first, as FlashAttention's varlen forward returns it.
Sequence b is q[cu_q[b]:cu_q[b+1]] against k, v[cu_k[b]:cu_k[b+1]], a causal mask or
window aligned to the bottom-right corner of its own Nq_b × Nk_b scores; lengths of 0
are allowed (an empty key sequence gives out = 0, lse = −∞).

Every rung runs them, chosen as for dense inputs ("auto": the Hopper forward, else the
tensor-core kernels, else the reference; float16/bfloat16 warn once where they fall to the
reference). The forward and backward main loops walk a table of the real tiles
(kernels_cu/common.cuh's seq_of; the fast rungs in their varlen instance, VL, which also
runs softcap and ALiBi), so the grid covers no padding and ``count_io=True`` counts
exactly `fs.simulate_varlen`'s bytes for the same block sizes
(``fs.gpu.block_sizes(q, v, varlen=True)``, the same for every sequence). The kernels
read the packed arrays through their strides (each head a problem whose rows are the
tokens; kernels_cu/common.cuh's row table) and write out, dq (and dk, dv without GQA)
packed in place: no transposing copies.
"""

from __future__ import annotations

import numpy as np

from .. import kernels as K
from ..problem import Shape, check_scale
from ..varlen import _check_batches, _slopes_per_sequence, check_cu_seqlens
from ..variants import check_softcap, make_band
from . import _arrays as arrays, _device as dev
from .flash2 import (LOG2E, _asked, _blocks, _choose, _fast_variants, _instance, _tc_tiles,
                     flip_sign, negated)


def _host_ints(name: str, x) -> np.ndarray:
    """cu_seqlens as host integers, from NumPy, a list, CuPy or PyTorch (one small copy:
    the grid is sized from them before any launch, as flash_attn's is from max_seqlen)."""
    return check_cu_seqlens(name, np.asarray(arrays.host_values(x)))


def _check_max(name: str, given, lengths: np.ndarray) -> None:
    if given is None:
        return
    if isinstance(given, bool) or not isinstance(given, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {given!r}")
    longest = int(lengths.max(initial=0))
    if given < longest:
        raise ValueError(f"{name}={given} is shorter than the longest sequence ({longest}); "
                         f"pass at least {longest}, or None to take it from the cu_seqlens")


class _Batch:
    """A validated packed batch on the device, viewed heads first (no copy): Q (Hq,
    total_q, d), K (Hk, total_k, d), V (Hk, total_k, dv), the cumulative lengths on the
    host, the band, softcap and slopes (B, Hq) for the kernels."""

    def __init__(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                 causal, scale, window, softcap, alibi_slopes, kernel):
        cp = dev.cupy()
        qi, ki, vi = arrays.In(q, "q"), arrays.In(k, "k"), arrays.In(v, "v")
        for name, x, what in (("q", qi, "total_q, heads, d"), ("k", ki, "total_k, kv_heads, d"),
                              ("v", vi, "total_k, kv_heads, dv")):
            if len(x.shape) != 3:
                raise ValueError(f"{name} must be 3-D packed ({what}), got shape {x.shape}")
        if not qi.dtype == ki.dtype == vi.dtype:
            raise TypeError(f"q, k, v must share one dtype, got {qi.dtype}, {ki.dtype}, "
                            f"{vi.dtype}")
        if ki.shape[:2] != vi.shape[:2]:
            raise ValueError(f"k {ki.shape} and v {vi.shape} must have the same tokens and "
                             "heads (axes 0 and 1)")
        (Tq, Hq, d), (Tk, Hk, _), dv = qi.shape, ki.shape, vi.shape[2]
        if qi.shape[2] != d or ki.shape[2] != d:
            raise ValueError(f"q and k must share the head dim d: q has {d}, k {ki.shape[2]}")
        if Hk == 0 or Hq % Hk:
            raise ValueError(f"the query heads ({Hq}) must be a multiple of the K/V heads "
                             f"({Hk}) (GQA groups)")
        if max(d, dv) > 256:
            raise ValueError(f"head dims up to 256 are supported, got d={d}, dv={dv}")
        self.cu_q = _host_ints("cu_seqlens_q", cu_seqlens_q)
        self.cu_k = _host_ints("cu_seqlens_k", cu_seqlens_k)
        check_cu_seqlens("cu_seqlens_q", self.cu_q, Tq)
        check_cu_seqlens("cu_seqlens_k", self.cu_k, Tk)
        self.B = _check_batches(self.cu_q, self.cu_k)
        _check_max("max_seqlen_q", max_seqlen_q, np.diff(self.cu_q))
        _check_max("max_seqlen_k", max_seqlen_k, np.diff(self.cu_k))
        band = make_band(causal, window)
        cap = check_softcap(softcap)
        host = None if alibi_slopes is None else arrays.host_values(alibi_slopes)
        slopes = _slopes_per_sequence(host, self.B, Hq)
        self.kernel, self.softcap = kernel, cap
        self.variant = _asked(window, softcap, alibi_slopes)
        self.dtype, self.torch = qi.dtype, qi.torch
        self.Tq, self.Tk, self.Hq, self.Hk, self.d, self.dv = Tq, Tk, Hq, Hk, d, dv
        # what the block sizes depend on (d, dv); N is the longest sequence's
        self.shape = Shape(int(np.diff(self.cu_q).max(initial=0)),
                           int(np.diff(self.cu_k).max(initial=0)), d, dv, (Hq,), (Hq,),
                           (Hk,), Hq // Hk)
        self.scale = check_scale(scale, d)
        self.left = -1 if band.left is None else band.left
        self.right = -1 if band.right is None else band.right
        self.cap = dev.scalar(self.dtype, cap or 0.0)
        self.slopes = (np.uint64(0) if alibi_slopes is None or self.B == 0 else
                       cp.asarray(np.ascontiguousarray(np.stack(slopes), np.float32)))
        self.qi, self.ki, self.vi = qi, ki, vi
        self.Q, self.K, self.V = (heads_first(x.arr) for x in (qi, ki, vi))

    def rung(self, block_sizes, backward: bool) -> str:
        """"wg", "tc" or "ref", as `flash2._choose` picks for dense inputs of these head
        dims (the fast rungs' varlen instance is their softcap/ALiBi one, VAR)."""
        return _choose(self.kernel, self.shape, self.dtype, block_sizes, backward,
                       variant=self.variant, var=True)

    def rows(self, cp, cols: dict):
        """The kernels' row table and strides (`arrays.rows`) for heads-first views:
        query head h reads K/V head h // (Hq / Hk)."""
        return arrays.rows(cp, self.shape, cols)

    def fast(self, cp):
        """(k_in, k_out, slopes) of the fast rungs' varlen instance (VarScores)."""
        return _fast_variants(cp, self.scale, self.softcap, self.slopes)

    def table(self, Br: int, Bc: int, over: str):
        """The kernels' vl array: B, cu_q, cu_k, cumulative Q tiles of Br, and (b, tile)
        for each CTA along x: the Q tiles of Br (over="q") or K/V tiles of Bc ("kv") of
        every sequence, none for an empty one. Returns (vl on the device, CTAs)."""
        nq, nk = np.diff(self.cu_q), np.diff(self.cu_k)
        tq = -(-nq // Br)
        tiles = tq if over == "q" else -(-nk // Bc)
        b = np.repeat(np.arange(self.B), tiles)
        start = np.repeat(np.cumsum(tiles) - tiles, tiles)
        tile = np.arange(int(tiles.sum())) - start
        cu_t = np.concatenate([[0], np.cumsum(tq)])
        vl = np.concatenate([[self.B], self.cu_q, self.cu_k, cu_t,
                             np.stack([b, tile], axis=1).reshape(-1)]).astype(np.int32)
        return dev.cupy().asarray(vl), int(tiles.sum()), int(cu_t[-1])


def heads_first(x):
    """(tokens, heads, ·) → a (heads, tokens, ·) view (or back)."""
    return x.transpose(1, 0, 2)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None,
                     max_seqlen_k=None, causal: bool = False, scale=None, window=None,
                     softcap=None, alibi_slopes=None, block_sizes=None,
                     count_io: bool = False, kernel: str = "auto"):
    """FlashAttention-2 forward over a packed batch: (out, lse), or (out, lse, traffic)
    with ``count_io=True``. out (total_q, Hq, dv) in q's dtype, lse (Hq, total_q) fp32.
    ``max_seqlen_q``/``max_seqlen_k``, when given (flash_attn's arguments), must be at
    least the longest sequence. ``alibi_slopes``: (Hq,) or (batch, Hq). ``kernel``: as
    in `flashsim.gpu.attention` ("auto", "wg", "tc" or "ref"); the fast rungs' tiles are
    ``fs.gpu.block_sizes(q, v, varlen=True)``."""
    q, scale, _ = negated(q, scale)
    with arrays.stream(q):
        return _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                        causal, scale, window, softcap, alibi_slopes, block_sizes,
                        count_io, kernel)


def _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
             scale, window, softcap, alibi_slopes, block_sizes, count_io, kernel):
    cp = dev.cupy()
    bt = _Batch(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                scale, window, softcap, alibi_slopes, kernel)
    which = bt.rung(block_sizes, backward=False)
    A = arrays
    # out packed like q, written in place through its heads-first view
    out = A.empty(cp, (bt.Tq, bt.Hq, bt.dv), A.storage(cp, bt.dtype),
                  bt.dtype if bt.torch else None, like=bt.qi)
    O = heads_first(out)
    L = A.empty(cp, (bt.Hq, bt.Tq), cp.float32)
    at, ld = bt.rows(cp, {A.AT_Q: (bt.Q, "q"), A.AT_K: (bt.K, "k"), A.AT_V: (bt.V, "k"),
                          A.AT_O: (O, "q")})
    rows = (bt.Q, bt.K, bt.V, at, O, L, np.int32(bt.Tq), np.int32(bt.Tk),
            *(ld[t] for t in (A.AT_Q, A.AT_K, A.AT_V, A.AT_O)))
    io = dev.counters(cp, count_io)
    i32 = np.int32
    if which in ("tc", "wg"):
        D = _instance(bt.shape, which)   # (its varlen instance takes any d, dv ≤ D)
        if which == "wg":
            name, (Br, Bc) = "flash2_fwd_wg", K.WG_BLOCKS[D]
        else:
            name, (Br, Bc) = "flash2_fwd_tc", _tc_tiles(D, False, True)
        vl, ctas, _ = bt.table(Br, Bc, "q")
        smem = K.smem_bytes(name, Br, Bc, D, D, bt.dtype)
        dev.launch(cp, dev.kernel(name, bt.dtype, count_io, D, True, True), (ctas, bt.Hq),
                   smem, (*rows, i32(bt.d), i32(bt.dv), i32(bt.left), i32(bt.right),
                          np.float32(bt.scale * LOG2E), *bt.fast(cp), vl, io),
                   threads=K.threads(name, D, dev.cc(cp.cuda.Device().id)))
    else:
        Br, Bc = _blocks(block_sizes, bt.shape, bt.dtype, backward=False)
        vl, ctas, _ = bt.table(Br, Bc, "q")
        smem = K.smem_bytes("flash2_fwd", Br, Bc, bt.d, bt.dv, bt.dtype)
        dev.launch(cp, dev.kernel("flash2_fwd", bt.dtype, count_io), (ctas, bt.Hq), smem,
                   (*rows, i32(bt.d), i32(bt.dv), i32(Br), i32(Bc), i32(bt.left), i32(bt.right),
                    dev.scalar(bt.dtype, bt.scale), bt.cap, bt.slopes, vl, io))
    out = arrays.out(cp, out, bt.dtype, bt.torch)
    lse = arrays.out(cp, L, "float32", bt.torch)
    return (out, lse, dev.traffic(cp, io)) if count_io else (out, lse)


def attention_varlen_backward(q, k, v, out, lse, dout, cu_seqlens_q, cu_seqlens_k, *,
                              max_seqlen_q=None, max_seqlen_k=None, causal: bool = False,
                              scale=None, window=None, softcap=None, alibi_slopes=None,
                              block_sizes=None, count_io: bool = False, kernel: str = "auto",
                              deterministic: bool = False):
    """FlashAttention-2 backward over a packed batch: (dq, dk, dv) packed like q, k, v,
    or with the traffic (``count_io=True``). out and dout (total_q, Hq, dv) in q's dtype,
    lse (Hq, total_q) as `attention_varlen` returns them; the variants as given to the
    forward. ``deterministic=True``: dQ's K/V tiles add in a fixed order (same bits every
    run)."""
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"deterministic must be True or False, got {deterministic!r}")
    q, scale, flip = negated(q, scale)
    with arrays.stream(q):
        grads = _backward(q, k, v, out, lse, dout, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                          max_seqlen_k, causal, scale, window, softcap, alibi_slopes,
                          block_sizes, count_io, kernel, deterministic)
    return (flip_sign(grads[0]), *grads[1:]) if flip else grads


def _backward(q, k, v, out, lse, dout, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
              max_seqlen_k, causal, scale, window, softcap, alibi_slopes, block_sizes,
              count_io, kernel, deterministic):
    cp = dev.cupy()
    bt = _Batch(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                scale, window, softcap, alibi_slopes, kernel)
    want = (bt.Tq, bt.Hq, bt.dv)
    saved = []
    for name, x in (("out", out), ("dout", dout)):
        xi = arrays.In(x, name)
        if xi.shape != want:
            raise ValueError(f"{name} must have the packed shape (total_q, heads, dv) = "
                             f"{want}, got {xi.shape}")
        if xi.dtype != bt.dtype:
            raise TypeError(f"{name} must have q's dtype {bt.dtype}, got {xi.dtype}")
        saved.append(heads_first(xi.arr))
    O, dO = saved
    li = arrays.In(lse, "lse") if not isinstance(lse, np.ndarray) else None
    L = cp.asarray(np.asarray(lse, np.float32)) if li is None else li.arr
    if li is not None and li.dtype == "bfloat16":
        raise TypeError("lse must be float32, not bfloat16")
    if tuple(L.shape) != (bt.Hq, bt.Tq):
        raise ValueError(f"lse must have shape (heads, total_q) = {(bt.Hq, bt.Tq)}, got "
                         f"{tuple(L.shape)}")
    L = cp.ascontiguousarray(L.astype(cp.float32, copy=False))
    which = bt.rung(block_sizes, backward=True)
    # the fast rung's instance (its varlen instance takes any d, dv ≤ D), and the pre-pass's
    Dh = _instance(bt.shape, which, backward=True) if which in ("tc", "wg") else None
    Dp = K.pre_instance(bt.d, bt.dv)
    if which == "wg":
        Br, Bc = K.wg_blocks(Dh, True)
    elif which == "tc":
        Br, Bc = _tc_tiles(Dh, True)
    else:
        Br, Bc = _blocks(block_sizes, bt.shape, bt.dtype, backward=True)
    vl, ctas, q_tiles = bt.table(Br, Bc, "kv")
    A = arrays
    i32 = np.int32
    st = A.storage(cp, bt.dtype)
    tq = bt.dtype if bt.torch else None
    g = bt.Hq // bt.Hk
    D = A.empty(cp, (bt.Hq, bt.Tq), cp.float32)
    dQacc = A.empty(cp, (bt.Hq, bt.Tq, bt.d), cp.float32)
    # dq packed like q, and dk, dv like k, v without GQA, written in place; with GQA dK and
    # dV go per query head into scratch, and each group is summed after
    dq = A.empty(cp, (bt.Tq, bt.Hq, bt.d), st, tq, like=bt.qi)
    dQ = heads_first(dq)
    if g == 1:
        dk = A.empty(cp, (bt.Tk, bt.Hk, bt.d), st, tq, like=bt.ki)
        dv = A.empty(cp, (bt.Tk, bt.Hk, bt.dv), st, tq, like=bt.vi)
        dK, dV = heads_first(dk), heads_first(dv)
    else:
        dK = A.empty(cp, (bt.Hq, bt.Tk, bt.d), st)
        dV = A.empty(cp, (bt.Hq, bt.Tk, bt.dv), st)
    side = "k" if g == 1 else "p"
    at, ld = bt.rows(cp, {A.AT_Q: (bt.Q, "q"), A.AT_K: (bt.K, "k"), A.AT_V: (bt.V, "k"),
                          A.AT_O: (O, "q"), A.AT_dO: (dO, "q"), A.AT_dQ: (dQ, "q"),
                          A.AT_dK: (dK, side), A.AT_dV: (dV, side)})
    pre = (O, dO, at, D, dQacc, i32(bt.Tq), ld[A.AT_O], ld[A.AT_dO])
    main = (bt.Q, bt.K, bt.V, at, dO, L, D, dQacc, dK, dV, i32(bt.Tq), i32(bt.Tk),
            *(ld[t] for t in (A.AT_Q, A.AT_K, A.AT_V, A.AT_dO, A.AT_dK, A.AT_dV)))
    io = dev.counters(cp, count_io)
    cc = dev.cc(cp.cuda.Device().id)
    # one turn counter per (head, Q tile of a sequence); a null pointer: unordered atomics
    sem = cp.zeros(bt.Hq * q_tiles, dtype=cp.int32) if deterministic else np.uint64(0)
    # the pre- and post-pass are per row: all of a head's rows are one problem for them
    rows = (-(-bt.Tq // Br), bt.Hq)
    if which in ("tc", "wg"):
        name = "flash2_bwd_preprocess_tc"
        dev.launch(cp, dev.kernel(name, bt.dtype, count_io, Dp),
                   K.grid(name, bt.Tq, bt.Tk, Br, Bc, bt.Hq), 0,
                   (*pre, i32(bt.d), i32(bt.dv), i32(0), io), threads=K.threads(name, Dp, cc))
        name = f"flash2_bwd_{which}" + ("_det" if deterministic else "")
        smem = K.smem_bytes(name, Br, Bc, Dh, Dh, bt.dtype)
        dev.launch(cp, dev.kernel(name, bt.dtype, count_io, Dh, True, True), (ctas, bt.Hq),
                   smem, (*main, i32(bt.d), i32(bt.dv), i32(bt.left), i32(bt.right),
                          np.float32(bt.scale), *bt.fast(cp), sem, vl, io),
                   threads=K.threads(name, Dh, cc))
    else:
        dev.launch(cp, dev.kernel("flash2_bwd_preprocess", bt.dtype, count_io), rows, 0,
                   (*pre, i32(bt.d), i32(bt.dv), i32(Br), io))
        smem = K.smem_bytes("flash2_bwd_main", Br, Bc, bt.d, bt.dv, bt.dtype)
        dev.launch(cp, dev.kernel("flash2_bwd_main", bt.dtype, count_io), (ctas, bt.Hq), smem,
                   (*main, i32(bt.d), i32(bt.dv), i32(Br), i32(Bc), i32(bt.left),
                    i32(bt.right), dev.scalar(bt.dtype, bt.scale), bt.cap, bt.slopes, sem,
                    vl, io))
    dev.launch(cp, dev.kernel("flash2_bwd_postprocess", bt.dtype, count_io), rows, 0,
               (dQacc, dQ, at, i32(bt.Tq), ld[A.AT_dQ], i32(bt.d), i32(Br), i32(0), io))
    if g > 1:     # GQA: each K/V head's gradient sums its group's, in fp32, rounded once
        dk, dv = (A.laid_out(cp, heads_first(
                      A.from_f32(cp, A.to_f32(cp, x.reshape(bt.Hk, g, bt.Tk, w), bt.dtype)
                                 .sum(axis=1), bt.dtype)), like)
                  for x, w, like in ((dK, bt.d, bt.ki), (dV, bt.dv, bt.vi)))
    res = tuple(A.out(cp, x, bt.dtype, bt.torch) for x in (dq, dk, dv))
    return res + (dev.traffic(cp, io),) if count_io else res
