"""FlashAttention-1, standard attention and Saha & Ye's square tiles on the GPU: the
launchers of flash1_ref.cu, standard_ref.cu and square_ref.cu, reached through
``fs.gpu.attention(..., algorithm="flash1" | "standard" | "square")`` and
`attention_backward`'s same argument (not "square": a forward schedule).

Both run on the reference rung (SIMT, any dtype, d, dv ≤ 256, any tiles) with the
simulator's schedules, so that the paper's comparison, standard against FlashAttention-1
and -2, is timed on hardware with each one's counted bytes beside it:

- flash1: `flashsim.simulate(..., "flash1")`'s loop. One CTA per (batch, head) problem,
  as FlashAttention-1 parallelised, since every K/V step updates the O_i, ℓ_i, m_i of
  the Q tiles it visits in HBM. The forward's lse is m + log ℓ, computed after the
  kernel from the ℓ, m it leaves in HBM (the simulator derives it the same way, outside
  its count). The backward reads m = lse and ℓ = 1 (0 for a row that sees no key).
- standard: three passes through HBM (S, P with L, O), the matrix products tiled as
  `flashsim.simulate(..., "standard", block_sizes=(Br, Bc))` counts them; the row
  passes hold a row of each N × N matrix they read in shared memory, which bounds Nk
  (about 100k keys in float16 on an H100). Its backward rebuilds S and P with the
  forward's first two passes, uncounted: they stand for the matrices a standard forward
  leaves in HBM, which Algorithm 3 starts from.
- square: `flashsim.simulate(..., "square")`'s two phases (flashsim/square.py), B × B
  tiles (block_sizes=(B, B)): a CTA per Q tile writes E_ij = exp(S_ij − m̃_ij) and m̃_ij
  to HBM, then a CTA per Q tile streams them with V in chunks of B columns of dv.
"""

from __future__ import annotations

import numpy as np

from .. import kernels as K
from ..problem import Shape, check_scale
from . import _arrays as arrays, _device as dev

ALGORITHMS = ("flash2", "flash1", "standard", "square")


def check_algorithm(algorithm, kernel: str, backward: bool = False) -> str:
    """``algorithm`` for `attention`/`attention_backward`: flash2 on any rung, flash1,
    standard and (forward only) square on the reference rung."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    if algorithm != "flash2" and kernel not in ("auto", "ref"):
        raise ValueError(f"algorithm={algorithm!r} runs on the reference kernels only; use "
                         f"kernel='ref' or 'auto' (got kernel={kernel!r})")
    if algorithm == "square" and backward:
        raise ValueError("algorithm='square' is a forward schedule (Saha & Ye's square "
                         "tiles, forward only, as flashsim.simulate runs it); take the "
                         "gradients with algorithm='flash2'")
    return algorithm


def tiles(block_sizes, shape: Shape, dtype: str, algorithm: str, backward: bool):
    """(Br, Bc) for ``algorithm``'s tiled kernels: ``block_sizes``, checked against the
    device's shared memory, or the largest square tile they all fit."""
    limit = dev.smem_limit()
    if block_sizes is None:
        return K.default_block_sizes(shape.d, shape.dv, dtype, limit, backward, algorithm)
    try:
        Br, Bc = (int(x) for x in block_sizes)
    except (TypeError, ValueError):
        raise TypeError(f"block_sizes must be a pair (Br, Bc), got {block_sizes!r}") from None
    if Br < 1 or Bc < 1:
        raise ValueError(f"block sizes must be >= 1, got {(Br, Bc)}")
    if algorithm == "square" and Br != Bc:
        raise ValueError(f"square needs Br == Bc (square B×B tiles), got block_sizes="
                         f"{(Br, Bc)}; pass block_sizes=(B, B)")
    for name in K.ALGORITHM_KERNELS[(algorithm, backward)]:
        need = K.smem_bytes(name, Br, Bc, shape.d, shape.dv, dtype)
        if need > limit:
            raise ValueError(f"{name} with Br={Br}, Bc={Bc}, d={shape.d}, dv={shape.dv} "
                             f"({dtype}) needs {need} bytes of shared memory; this device "
                             f"allows {limit}. Use smaller block_sizes.")
    return Br, Bc


def _row_smem(kernel: str, shape: Shape, dtype: str, softcap: bool = True) -> int:
    need = K.row_smem_bytes(kernel, shape.Nk, dtype, softcap)
    limit = dev.smem_limit()
    if need > limit:
        most = (limit - K.REF_THREADS * K.ACC_BYTES[dtype]) // (
            K.ROW_KERNELS[kernel] * K.ITEM_BYTES[dtype])
        raise ValueError(f"standard attention's {kernel} holds a row of {shape.Nk} keys in "
                         f"shared memory ({need} bytes; this device allows {limit}): Nk up to "
                         f"about {most} in {dtype} here. Use algorithm='flash2', which has no "
                         "such limit.")
    return need


def _launch(cp, name, dtype, count_io, grid, smem, args):
    dev.launch(cp, dev.kernel(name, dtype, count_io), grid, smem, args)


# -- forward ------------------------------------------------------------------------------

def forward(q, k, v, *, algorithm, causal, scale, window, softcap, alibi_slopes, block_sizes,
            count_io):
    from .flash2 import _variant_args
    cp = dev.cupy()
    qi, ki, vi = arrays.In(q, "q"), arrays.In(k, "k"), arrays.In(v, "v")
    shape, Q, Kd, Vd, kv_index = arrays.layout(qi, ki, vi)
    dtype = qi.dtype
    scale = check_scale(scale, shape.d)
    left, right, cap, slopes, _ = _variant_args(cp, shape, dtype, causal, window, softcap,
                                                alibi_slopes)
    Br, Bc = tiles(block_sizes, shape, dtype, algorithm, backward=False)
    P, Nq, Nk, d, dv = shape.problems, shape.Nq, shape.Nk, shape.d, shape.dv
    st = arrays.storage(cp, dtype)
    io = dev.counters(cp, count_io)
    i32 = np.int32
    O = arrays.empty(cp, (P, Nq, dv), st, dtype if qi.torch else None)
    sc = dev.scalar(dtype, scale)
    if algorithm == "flash1":
        l = arrays.empty(cp, (P, Nq), cp.float32)
        m = arrays.empty(cp, (P, Nq), cp.float32)
        name = "flash1_fwd"
        _launch(cp, name, dtype, count_io, K.grid(name, Nq, Nk, Br, Bc, P),
                K.smem_bytes(name, Br, Bc, d, dv, dtype),
                (Q, Kd, Vd, kv_index, O, l, m, i32(Nq), i32(Nk), i32(d), i32(dv), i32(Br),
                 i32(Bc), i32(left), i32(right), sc, cap, slopes, io))
        # L = m + log ℓ from the statistics Algorithm 1 leaves in HBM (not in the count)
        seen = l > 0
        L = cp.where(seen, m + cp.log(cp.where(seen, l, cp.float32(1))),
                     cp.float32(-np.inf)).astype(cp.float32)
    elif algorithm == "square":
        B = Br
        L = arrays.empty(cp, (P, Nq), cp.float32, "float32" if qi.torch else None)
        E = arrays.empty(cp, (P, Nq, Nk), st)                     # exp(S_ij − m̃_ij) blocks
        Mt = arrays.empty(cp, (P, -(-Nk // B), Nq), cp.float32)  # m̃_ij, block column j in row j
        name = "square_fwd_scores"
        _launch(cp, name, dtype, count_io, K.grid(name, Nq, Nk, B, B, P),
                K.smem_bytes(name, B, B, d, dv, dtype),
                (Q, Kd, kv_index, E, Mt, i32(Nq), i32(Nk), i32(d), i32(B), i32(left),
                 i32(right), sc, cap, slopes, io))
        name = "square_fwd_out"
        _launch(cp, name, dtype, count_io, K.grid(name, Nq, Nk, B, B, P),
                K.smem_bytes(name, B, B, d, dv, dtype),
                (Vd, kv_index, E, Mt, O, L, i32(Nq), i32(Nk), i32(dv), i32(B), i32(left),
                 i32(right), io))
    else:
        L = arrays.empty(cp, (P, Nq), cp.float32, "float32" if qi.torch else None)
        _, Pm = _scores_and_probs(cp, shape, dtype, Q, Kd, kv_index, Br, Bc, left, right, sc,
                                  cap, slopes, io, count_io, L)
        name = "standard_fwd_out"
        _launch(cp, name, dtype, count_io, K.grid(name, Nq, Nk, Br, Bc, P),
                K.smem_bytes(name, Br, Bc, d, dv, dtype),
                (Pm, Vd, kv_index, O, i32(Nq), i32(Nk), i32(dv), i32(Br), i32(Bc), io))
    out = arrays.out(cp, O.reshape(shape.batch_shape + (Nq, dv)), dtype, qi.torch)
    lse = arrays.out(cp, L.reshape(shape.batch_shape + (Nq,)), "float32", qi.torch)
    return (out, lse, dev.traffic(cp, io)) if count_io else (out, lse)


def _scores_and_probs(cp, shape, dtype, Q, Kd, kv_index, Br, Bc, left, right, sc, cap, slopes,
                      io, count_io, L):
    """Standard attention's first two passes: S (masked, variants) and P = softmax(S),
    with L written to ``L``. Returns the (problems, Nq, Nk) matrices S and P."""
    P, Nq, Nk, d = shape.problems, shape.Nq, shape.Nk, shape.d
    i32 = np.int32
    smem_row = _row_smem("standard_fwd_softmax", shape, dtype)
    st = arrays.storage(cp, dtype)
    S = arrays.empty(cp, (P, Nq, Nk), st)
    Pm = arrays.empty(cp, (P, Nq, Nk), st)
    name = "standard_fwd_scores"
    _launch(cp, name, dtype, count_io, K.grid(name, Nq, Nk, Br, Bc, P),
            K.smem_bytes(name, Br, Bc, d, shape.dv, dtype),
            (Q, Kd, kv_index, S, i32(Nq), i32(Nk), i32(d), i32(Br), i32(Bc), i32(left),
             i32(right), sc, cap, slopes, io))
    name = "standard_fwd_softmax"
    _launch(cp, name, dtype, count_io, K.grid(name, Nq, Nk, Br, Bc, P), smem_row,
            (S, Pm, L, i32(Nq), i32(Nk), io))
    return S, Pm


# -- backward -----------------------------------------------------------------------------

def backward(q, k, v, out, lse, dout, *, algorithm, causal, scale, window, softcap,
             alibi_slopes, block_sizes, count_io):
    from .flash2 import _variant_args, saved
    cp = dev.cupy()
    qi, ki, vi = arrays.In(q, "q"), arrays.In(k, "k"), arrays.In(v, "v")
    shape, Q, Kd, Vd, kv_index = arrays.layout(qi, ki, vi)
    dtype = qi.dtype
    oi, doi, L = saved(cp, shape, dtype, out, lse, dout)
    scale = check_scale(scale, shape.d)
    left, right, cap, slopes, _ = _variant_args(cp, shape, dtype, causal, window, softcap,
                                                alibi_slopes)
    Br, Bc = tiles(block_sizes, shape, dtype, algorithm, backward=True)
    P, Nq, Nk, d, dv = shape.problems, shape.Nq, shape.Nk, shape.d, shape.dv
    # these kernels read dense rows (no row table): a strided out or dout is copied
    O = oi.dense().arr.reshape(P, Nq, dv)
    dO = doi.dense().arr.reshape(P, Nq, dv)
    st = arrays.storage(cp, dtype)
    dQ = arrays.empty(cp, (P, Nq, d), st)
    dK = arrays.empty(cp, (P, Nk, d), st)
    dV = arrays.empty(cp, (P, Nk, dv), st)
    io = dev.counters(cp, count_io)
    i32 = np.int32
    sc = dev.scalar(dtype, scale)

    def launch(name, smem, args):
        _launch(cp, name, dtype, count_io, K.grid(name, Nq, Nk, Br, Bc, P), smem, args)

    if algorithm == "flash1":
        # Algorithm 4 reads the forward's m and ℓ; m = L, ℓ = 1 describe the same softmax
        seen = ~cp.isneginf(L)
        m = cp.ascontiguousarray(L)
        l = seen.astype(cp.float32)
        launch("flash1_bwd", K.smem_bytes("flash1_bwd", Br, Bc, d, dv, dtype),
               (Q, Kd, Vd, kv_index, O, dO, l, m, dQ, dK, dV, i32(Nq), i32(Nk), i32(d),
                i32(dv), i32(Br), i32(Bc), i32(left), i32(right), sc, cap, slopes, io))
    else:
        smem_ds = _row_smem("standard_bwd_ds", shape, dtype, softcap is not None)
        # S and P as the forward left them (its first two passes, fast build: uncounted)
        S, Pm = _scores_and_probs(cp, shape, dtype, Q, Kd, kv_index, Br, Bc, left, right, sc,
                                  cap, slopes, dev.counters(cp, False), False,
                                  cp.empty((P, Nq), cp.float32))
        dP = arrays.empty(cp, (P, Nq, Nk), st)
        dS = arrays.empty(cp, (P, Nq, Nk), st)
        launch("standard_bwd_dv", K.smem_bytes("standard_bwd_dv", Br, Bc, d, dv, dtype),
               (Pm, dO, dV, i32(Nq), i32(Nk), i32(dv), i32(Br), i32(Bc), io))
        launch("standard_bwd_dp", K.smem_bytes("standard_bwd_dp", Br, Bc, d, dv, dtype),
               (dO, Vd, kv_index, dP, i32(Nq), i32(Nk), i32(dv), i32(Br), i32(Bc), io))
        launch("standard_bwd_ds", smem_ds,
               (Pm, dP, S, dS, i32(Nq), i32(Nk), cap, slopes, io))
        launch("standard_bwd_dq", K.smem_bytes("standard_bwd_dq", Br, Bc, d, dv, dtype),
               (dS, Kd, kv_index, dQ, i32(Nq), i32(Nk), i32(d), i32(Br), i32(Bc), sc, io))
        launch("standard_bwd_dk", K.smem_bytes("standard_bwd_dk", Br, Bc, d, dv, dtype),
               (dS, Q, dK, i32(Nq), i32(Nk), i32(d), i32(Br), i32(Bc), sc, io))
    dq = arrays.reduce(cp, dQ, shape, qi.shape, Nq, d, dtype)
    dk = arrays.reduce(cp, dK, shape, ki.shape, Nk, d, dtype)
    dv_ = arrays.reduce(cp, dV, shape, vi.shape, Nk, dv, dtype)
    res = tuple(arrays.out(cp, x, dtype, qi.torch) for x in (dq, dk, dv_))
    return res + (dev.traffic(cp, io),) if count_io else res
