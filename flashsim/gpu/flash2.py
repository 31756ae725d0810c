"""FlashAttention-2 on the GPU: the forward and backward launchers of the three rungs
(flash2_ref.cu, flash2_tc.cu, flash2_wg.cu), the choice between them, and a fast path
for PyTorch tensors."""

from __future__ import annotations

import ctypes
import math
import os
import struct
import warnings

import numpy as np

from .. import kernels as K
from ..problem import canon_batch, check_scale, Shape
from ..variants import canonical_slopes, check_softcap, make_band
from . import _arrays as arrays, _device as dev, _tma, algorithms
from .algorithms import check_algorithm

KERNELS = ("auto", "ref", "tc", "wg")
LOG2E = math.log2(math.e)


def _wg_supports(shape: Shape, dtype: str, block_sizes, backward: bool = False,
                 var: bool = False) -> bool:
    """The Hopper forward (or backward) runs these inputs on the current device (compute
    capability 9.0: its sm_90a code runs on no other; ``var``: softcap or ALiBi)."""
    if not (dtype in K.TC_DTYPES and K.head_dim_instance(shape.d, shape.dv, K.WG_HEAD_DIMS)):
        return False
    device = dev.cupy().cuda.Device().id
    return K.wg_supports(shape.d, shape.dv, dtype, dev.cc(device), dev.smem_limit_on(device),
                         block_sizes, backward, var)


def _tc_tiles(D: int, backward: bool, var: bool = False) -> tuple[int, int]:
    """The tensor-core kernel's (Br, Bc) for its instance of head dim D on the current
    device (``var``: its softcap/ALiBi instance)."""
    if backward:
        return K.tc_bwd_blocks(D, dev.cc_major(dev.cupy().cuda.Device().id))
    return K.tc_blocks(D, dev.cc_major(dev.cupy().cuda.Device().id), var)


def _instance(shape: Shape, rung: str = "tc", backward: bool = False) -> int | None:
    """D of the instance the fast rung ``rung`` runs these head dims on, in the forward or
    the backward, on the current device (kernels.instance_dim)."""
    cc = dev.cc_major(dev.cupy().cuda.Device().id)
    return K.instance_dim(rung, shape.d, shape.dv, backward, cc)


def _ws_tiles(shape: Shape, D: int | None, block_sizes=None,
              var: bool = False) -> tuple[int, int] | None:
    """The tiles of flash2_fwd_ws where the Hopper forward runs these inputs on it
    (kernels.ws_runs, ``var``: softcap or ALiBi; FLASHSIM_TMA not 0; ``block_sizes`` None
    or those tiles), else None.
    Layouts a tensor map cannot address are copied first where its tiles or its softmax's
    max are not flash2_fwd_wg's (_attention), so that they hold whatever the strides."""
    if (K.ws_runs(shape.d, shape.dv, D, variant=var) and os.environ.get("FLASHSIM_TMA", "1") != "0"
            and (block_sizes is None or tuple(block_sizes) == K.ws_blocks(D, var))):
        return K.ws_blocks(D, var)
    return None


def _tc_supports(shape: Shape, dtype: str, block_sizes, backward: bool = False,
                 var: bool = False) -> bool:
    if not (dtype in K.TC_DTYPES and K.head_dim_instance(shape.d, shape.dv)):
        return False
    # the tiles must fit the device's shared memory (not so on GPUs with 99 KB per block)
    device = dev.cupy().cuda.Device().id
    return K.tc_supports(shape.d, shape.dv, dtype, dev.cc(device), dev.smem_limit_on(device),
                         block_sizes, backward, var)


def _choose(kernel: str, shape: Shape, dtype: str, block_sizes, backward: bool = False,
            variant: str | None = None, var: bool = False) -> str:
    """The fastest rung that supports the inputs: "wg" (Hopper), "tc" (tensor
    cores), else "ref"; or the one asked for, with an error where it cannot run them.
    Every rung runs the variants (window, softcap, ALiBi; ``variant`` names those asked
    for, kept for the messages; ``var``: softcap or ALiBi, whose instance may have its
    own tiles). "auto" warns (once per reason) when float16/bfloat16
    inputs fall to the reference rung, which is two orders of magnitude slower."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if kernel == "ref":
        return "ref"
    if dev.is_emulated():
        # the CPU emulation runs the mma.sync rung only when asked for: on a CPU the
        # reference rung is the faster, and the Hopper rung is not emulated
        if kernel == "wg":
            raise ValueError("the Hopper kernel ('wg') is not emulated on the CPU; use "
                             "kernel='tc', 'ref' or 'auto'")
        if kernel == "auto":
            return "ref"
    if kernel in ("auto", "wg") and _wg_supports(shape, dtype, block_sizes, backward, var):
        return "wg"
    if kernel == "wg":
        raise ValueError(
            f"the Hopper kernel runs float16/bfloat16 with d and dv multiples of 8 up to "
            f"{max(K.WG_BWD_HEAD_DIMS if backward else K.WG_HEAD_DIMS)} and its own tiles {K.WG_BWD_BLOCKS if backward else K.WG_BLOCKS}, on a device of "
            f"compute capability 9.0 (this one: "
            f"{dev.cc(dev.cupy().cuda.Device().id) / 10:.1f}); got {dtype}, d={shape.d}, "
            f"dv={shape.dv}, block_sizes={block_sizes}. Use kernel='tc', 'ref' or 'auto'.")
    if _tc_supports(shape, dtype, block_sizes, backward, var):
        return "tc"
    if kernel == "tc":
        raise ValueError(
            f"the tensor-core kernel runs float16/bfloat16 with d and dv multiples of 8 up "
            f"to {max(K.TC_HEAD_DIMS)} and its own tiles (fs.gpu.block_sizes(q, v, kernel='tc')), which must fit "
            f"the device's shared memory ({dev.smem_limit()} bytes here); got {dtype}, "
            f"d={shape.d}, dv={shape.dv}, "
            f"block_sizes={block_sizes}. Use kernel='ref' or 'auto'.")
    if block_sizes is None:
        _warn_reference(dtype, f"d={shape.d}, dv={shape.dv} (the fast rungs take d and dv "
                               f"multiples of 8 up to {max(K.TC_HEAD_DIMS)}, with tiles "
                               f"that fit the device)")
    return "ref"


_WARNED: set = set()


def _warn_reference(dtype: str, reason: str):
    if dtype not in K.TC_DTYPES or dev.is_emulated() or reason in _WARNED:
        return
    _WARNED.add(reason)
    warnings.warn(f"flashsim.gpu runs {dtype} attention on the reference kernel, ~100× "
                  f"slower than the tensor-core ones, because of {reason}", UserWarning,
                  stacklevel=5)   # the caller of attention or attention_backward


def _variant_args(cp, shape: Shape, dtype: str, causal, window, softcap, alibi_slopes):
    """(left, right, softcap, slopes, what) for the kernels: the band, softcap (0: none),
    the slopes per query problem as a float32 device array (a null pointer: none), and
    the name of the variant asked for (None for plain attention)."""
    band = make_band(causal, window)
    c = check_softcap(softcap)
    # slopes may be on the GPU (a model's buffer): their values are read here, once
    slopes = canonical_slopes(None if alibi_slopes is None else arrays.host_values(alibi_slopes),
                              shape)
    left = -1 if band.left is None else band.left
    right = -1 if band.right is None else band.right
    ptr = np.uint64(0)
    if slopes is not None:
        # (…, hk, g) → one slope per query problem, in the order of Q's problems
        full = np.broadcast_to(slopes, canon_batch(shape))
        ptr = cp.asarray(np.ascontiguousarray(full, np.float32).reshape(-1))
    return left, right, dev.scalar(dtype, c or 0.0), ptr, _asked(window, softcap, alibi_slopes)


def _fast_variants(cp, scale: float, softcap, slopes):
    """(k_in, k_out, slopes) for the fast rungs' softcap/ALiBi instance (tensor_core.cuh's
    VarScores): the scores' constants, computed here so that the kernels read them from
    their parameters, and the slopes (a device array, or a null pointer) in the units of
    the scores the kernels form: log2 units over VarScores::scale() (softcap·log2(e) with
    a softcap, else 1)."""
    c = check_softcap(softcap)
    if c is None:
        k_in, k_out, per_slope = scale * LOG2E, 0.0, LOG2E
    else:
        k_in, k_out, per_slope = scale / c, c * LOG2E, 1.0 / c
    if not isinstance(slopes, np.uint64):
        slopes = (slopes * np.float32(per_slope)).astype(np.float32)
    return np.float32(k_in), np.float32(k_out), slopes


def _asked(window, softcap, alibi_slopes) -> str | None:
    """The variants given, by name ("window, softcap"), or None for plain attention."""
    names = [n for n, x in (("window", window), ("softcap", softcap),
                            ("alibi_slopes", alibi_slopes)) if x is not None]
    return ", ".join(names) or None


def negated(q, scale):
    """(q, scale, False), or (−q, −scale, True) where ``scale`` is negative. The fast
    kernels set a masked score to −∞ before they scale it, which a negative scale would
    turn into +∞ (NaN out); S·scale = ((−Q)Kᵀ)·(−scale) exactly (a sign is exact), so
    such a launch runs on −q, the same bits, and a backward negates dq back (`flip_sign`)."""
    s = None if scale is None else check_scale(scale, 1)
    nq = flip_sign(q) if s is not None and s < 0 else None
    # (scale ≥ 0, or q not an array: the checks that follow say what q must be)
    return (q, scale, False) if nq is None else (nq, -s, True)


def flip_sign(x):
    """−x for a PyTorch tensor or a NumPy or CuPy array (where its dtype has no
    arithmetic, its sign bit flipped through an unsigned view); None for anything else."""
    dt = getattr(x, "dtype", None)
    if dt is None:
        return None
    try:
        return -x
    except Exception:
        if not hasattr(x, "view") or getattr(dt, "itemsize", 0) not in (2, 4, 8):
            return None
        bits = np.dtype(f"uint{8 * dt.itemsize}")
        return (x.view(bits) ^ bits.type(1 << (8 * dt.itemsize - 1))).view(dt)


def _blocks(block_sizes, shape: Shape, dtype: str, backward: bool) -> tuple[int, int]:
    """The reference flash2 kernels' (Br, Bc): ``block_sizes`` checked against the
    device's shared memory, or the largest square tile that fits."""
    return algorithms.tiles(block_sizes, shape, dtype, "flash2", backward)


def block_sizes(q, v, *, backward: bool = False, kernel: str = "auto", window=None,
                softcap=None, alibi_slopes=None, algorithm: str = "flash2",
                varlen: bool = False) -> tuple[int, int]:
    """The (Br, Bc) the kernels use by default for these inputs (pass them to
    `flashsim.simulate` to predict the kernels' traffic); with a window, softcap or
    ALiBi slopes, those of the rung that runs them; for ``algorithm`` "flash1" or
    "standard", those of its reference kernels; ``varlen=True``: those of
    `attention_varlen` (q, v packed, (total, heads, d); `flashsim.simulate_varlen`)."""
    qi, vi = arrays.In(q, "q"), arrays.In(v, "v")
    shape = Shape(qi.shape[-2], vi.shape[-2], qi.shape[-1], vi.shape[-1], (), (), (), 1)
    if check_algorithm(algorithm, kernel, backward) != "flash2":
        if varlen:
            raise ValueError("packed varlen batches run algorithm='flash2' only")
        return algorithms.tiles(None, shape, qi.dtype, algorithm, backward)
    # the fast rungs run a varlen batch in their softcap/ALiBi instance (VL with VAR)
    var = varlen or softcap is not None or alibi_slopes is not None
    which = _choose(kernel, shape, qi.dtype, None, backward,
                    variant=_asked(window, softcap, alibi_slopes), var=var)
    D = _instance(shape, which, backward) if which in ("tc", "wg") else None
    if which == "wg":
        ws = None if backward or varlen else _ws_tiles(shape, D, var=var)
        return ws or K.wg_blocks(D, backward)
    if which == "tc":
        return _tc_tiles(D, backward, var or (not backward and K.padded(shape.d, shape.dv, D)))
    return _blocks(None, shape, qi.dtype, backward)


def softmax_max(q, v, *, kernel: str = "auto", window=None, softcap=None,
                alibi_slopes=None, block_sizes=None) -> str:
    """The rule for the softmax's m (`flashsim.running_max`) that `attention` runs these
    inputs under (pass it to `flashsim.simulate` as ``softmax_max``): "fixed" in bfloat16
    (a softcap, with ALiBi or without) and "lazy" in float16 (a softcap, or ALiBi at
    head dims up to 128 but above 64) where the Hopper forward fed by the copy engine runs
    its softcap instance (flashsim.kernels.cap_only), "lazy" in bfloat16 where it runs its
    lazy one (kernels.ws_lazy: ALiBi, or a softcap past the fixed max's bound, at head
    dims up to 128 but above 64), as where the cp.async one runs its
    own (kernels.wg_cap: in bfloat16 not at head dims 33–64; in float16 without ALiBi)
    and the mma.sync one its own (kernels.tc_cap: in float16 without ALiBi), else
    "online". ``block_sizes``: the tiles `attention` is given (they pick the rung, and on
    Hopper whether the copy engine's forward runs). It holds for any layout of the
    inputs: where the copy engine cannot address them and its instance's max is not the
    cp.async forward's, `attention` copies them dense first."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    qi, vi = arrays.In(q, "q"), arrays.In(v, "v")
    shape = Shape(qi.shape[-2], vi.shape[-2], qi.shape[-1], vi.shape[-1], (), (), (), 1)
    var = softcap is not None or alibi_slopes is not None
    if not var:
        return "online"
    which = _choose(kernel, shape, qi.dtype, block_sizes,
                    variant=_asked(window, softcap, alibi_slopes), var=var)
    D = _instance(shape, which, False) if which in ("wg", "tc") else None
    if (which == "wg" and K.ws_lazy(qi.dtype, softcap, alibi_slopes, D)
            and _ws_tiles(shape, D, block_sizes, var) is not None):
        return "lazy"            # flash2_fwd_ws's lazy instance in bfloat16
    if which not in ("wg", "tc") or not K.cap_only(qi.dtype, softcap, alibi_slopes, D):
        return "online"
    if which == "tc" and not K.tc_cap(qi.dtype, D, alibi_slopes):
        return "online"
    if (which == "wg" and _ws_tiles(shape, D, block_sizes, var) is None
            and not K.wg_cap(qi.dtype, D, alibi_slopes)):
        return "online"          # flash2_fwd_wg, without a softcap instance here
    return "fixed" if qi.dtype == "bfloat16" else "lazy"


# -- forward ------------------------------------------------------------------------------

def attention(q, k, v, *, causal: bool = False, scale=None, window=None, softcap=None,
              alibi_slopes=None, block_sizes=None, count_io: bool = False,
              kernel: str = "auto", algorithm: str = "flash2"):
    """FlashAttention-2 forward on the GPU: (out, lse), or (out, lse, traffic) with
    ``count_io=True``. out has q's dtype and shape (..., Nq, dv); lse is fp32 (..., Nq).

    ``kernel``: "wg" the Hopper kernel (warpgroup MMAs; compute capability 9.0,
    float16/bfloat16, d and dv multiples of 8 up to 256, run by the smallest instance
    D ∈ fs.kernels.WG_HEAD_DIMS above them; at D ∈ fs.kernels.WS_HEAD_DIMS fed by the
    copy engine, with its own tiles, fs.kernels.WS_BLOCKS, WS_BLOCKS_VAR with softcap or
    ALiBi), "tc" the tensor-core
    kernel (mma.sync, Ampere and later; float16/bfloat16, d and dv as for "wg",
    instances fs.kernels.TC_HEAD_DIMS), "ref" the reference kernel (any dtype, d,
    dv ≤ 256, any tiles), or "auto" (default): the first of "wg", "tc", "ref" that
    supports the inputs on this device, with tiles that fit its shared memory.
    fs.gpu.block_sizes gives the tiles each runs.

    Variants, with `flashsim.simulate`'s semantics (flashsim.variants): ``window=(left,
    right)`` (−1 unbounded; tiles outside the band are skipped), ``softcap=c`` and
    ``alibi_slopes`` ((heads,) or (batch, heads), fp32), on every rung (the fast rungs
    run softcap and ALiBi in their own template instances, so plain attention pays
    nothing for them; a softcap runs the Hopper forward under a fixed softmax max in
    bfloat16, with ALiBi or without (on the cp.async forward too, but at 32 < d ≤ 64:
    flashsim.kernels.wg_cap; and the mma.sync one: kernels.tc_cap), and a lazy one in
    float16 (without ALiBi on those two), as does ALiBi in float16 at
    64 < d ≤ 128 on the copy engine's forward, each Q tile's diagonal key tile first:
    flashsim.kernels.cap_only).

    ``algorithm``: "flash2" (default), or the paper's other two schedules on the
    reference rung, "flash1" (FlashAttention-1: K/V outer, O, ℓ, m through HBM at every
    step) and "standard" (S, P and O each through HBM), or Saha & Ye's "square" (B × B
    tiles, block_sizes=(B, B); forward only), with their variants, tiles and
    instrumented counts (flashsim.gpu.algorithms).
    """
    if check_algorithm(algorithm, kernel) != "flash2":
        with arrays.stream(q):
            return algorithms.forward(q, k, v, algorithm=algorithm, causal=causal,
                                      scale=scale, window=window, softcap=softcap,
                                      alibi_slopes=alibi_slopes, block_sizes=block_sizes,
                                      count_io=count_io)
    q, scale, _ = negated(q, scale)
    plain = _asked(window, softcap, alibi_slopes) is None
    if plain and not count_io and block_sizes is None and kernel in ("auto", "tc", "wg"):
        fast = _torch_forward(q, k, v, causal, scale, kernel)
        if fast is not None:
            return fast
    with arrays.stream(q):
        return _attention(q, k, v, causal=causal, scale=scale, window=window,
                          softcap=softcap, alibi_slopes=alibi_slopes,
                          block_sizes=block_sizes, count_io=count_io, kernel=kernel)



def _attention(q, k, v, *, causal, scale, window, softcap, alibi_slopes, block_sizes,
               count_io, kernel):
    cp = dev.cupy()
    qi, ki, vi = arrays.In(q, "q"), arrays.In(k, "k"), arrays.In(v, "v")
    shape = arrays.shape_of(qi, ki, vi)
    dtype = qi.dtype
    scale = check_scale(scale, shape.d)
    left, right, cap, slopes, variant = _variant_args(cp, shape, dtype, causal, window,
                                                      softcap, alibi_slopes)
    var = softcap is not None or alibi_slopes is not None   # the fast rungs' VAR instance
    which = _choose(kernel, shape, dtype, block_sizes, variant=variant, var=var)
    D = _instance(shape, which) if which in ("tc", "wg") else None
    # flash2_fwd_ws's instance: the VAR one, the softcap's (kernels.cap_only) or
    # bfloat16's lazy one (kernels.ws_lazy)
    ws_var = var
    if var and which == "wg" and K.cap_only(dtype, softcap, alibi_slopes, D):
        ws_var = K.CAP_ONLY
    elif var and which == "wg" and K.ws_lazy(dtype, softcap, alibi_slopes, D):
        ws_var = K.LAZY_BF16
    P, Nq = shape.problems, shape.Nq
    # O laid out as q is (q read through its strides: no copies of (B, N, H, d) inputs)
    O = arrays.empty(cp, shape.batch_shape + (Nq, shape.dv), arrays.storage(cp, dtype),
                     dtype if qi.torch else None, like=qi)
    L = arrays.empty(cp, (P, Nq), cp.float32, "float32" if qi.torch else None)
    cols = {arrays.AT_Q: (qi.arr, "q"), arrays.AT_K: (ki.arr, "k"),
            arrays.AT_V: (vi.arr, "k"), arrays.AT_O: (O, "q")}
    at, ld = arrays.rows(cp, shape, cols)
    rows = (qi.arr, ki.arr, vi.arr, at, O, L, np.int32(Nq), np.int32(shape.Nk))
    lds = tuple(ld[t] for t in (arrays.AT_Q, arrays.AT_K, arrays.AT_V, arrays.AT_O))
    io = dev.counters(cp, count_io)
    i32 = np.int32
    ws_tiles = _ws_tiles(shape, D, block_sizes, var) if which == "wg" else None
    ws = _ws_forward(cp, shape, dtype, count_io, ws_var, cols, ld) if ws_tiles else None
    if ws is None and ws_tiles and (ws_tiles != K.WG_BLOCKS[D]
                                    or _ws_max_apart(dtype, D, softcap, alibi_slopes, ws_var)):
        # a layout no tensor map addresses, where the cp.async kernel's tiles differ from
        # the ones block_sizes reports, or its softmax's max from the one softmax_max
        # reports: copied into a dense one, which TMA reads
        dense = [cp.ascontiguousarray(cols[t][0]) for t in (arrays.AT_Q, arrays.AT_K, arrays.AT_V)]
        cols.update({t: (x, cols[t][1]) for t, x in zip((arrays.AT_Q, arrays.AT_K, arrays.AT_V), dense)})
        at, ld = arrays.rows(cp, shape, cols)
        qi.arr, ki.arr, vi.arr = dense
        ws = _ws_forward(cp, shape, dtype, count_io, ws_var, cols, ld)
        if ws is None:
            raise RuntimeError("the driver refused the tensor maps of flash2_fwd_ws for "
                               "dense inputs; set FLASHSIM_TMA=0 to run flash2_fwd_wg")
    if ws is not None:           # the Hopper forward fed by the copy engine
        k_in, k_out, sl = _fast_variants(cp, scale, softcap, slopes)
        ws(cp.cuda.get_current_stream().ptr, dev.pointer(qi.arr), dev.pointer(ki.arr),
           dev.pointer(vi.arr), at.data.ptr, dev.pointer(O), dev.pointer(L),
           tail=(Nq, shape.Nk, int(ld[arrays.AT_O]), shape.d, shape.dv, left, right,
                 scale * LOG2E, float(k_in),
                 float(k_out), 0 if isinstance(sl, np.uint64) else sl.data.ptr, io.data.ptr))
    elif which in ("tc", "wg"):  # one signature: (Q, K, V, at, O, L, Nq, Nk, d, dv, ld…,
        # band, scale); head dims below D in the VAR instance
        user_var, var = var, var or K.padded(shape.d, shape.dv, D)
        if which == "wg":
            name, (Br, Bc) = "flash2_fwd_wg", K.WG_BLOCKS[D]
            if user_var and K.wg_cap(dtype, D, alibi_slopes) and K.cap_only(dtype, softcap, alibi_slopes, D):
                var = K.CAP_ONLY         # its softcap instance: the fixed or lazy max
        else:
            name, (Br, Bc) = "flash2_fwd_tc", _tc_tiles(D, False, var)
            if user_var and K.tc_cap(dtype, D, alibi_slopes) and K.cap_only(dtype, softcap, alibi_slopes, D):
                var = K.CAP_ONLY         # its softcap instance: the fixed or lazy max
        if block_sizes is not None and tuple(block_sizes) != (Br, Bc):
            raise ValueError(f"{name} runs tiles {(Br, Bc)} here, not block_sizes="
                             f"{tuple(block_sizes)} (FLASHSIM_TMA=0 turns off the copy "
                             "engine's forward, whose tiles those are); pass "
                             "block_sizes=None")
        threads = K.threads(name, D, dev.cc(cp.cuda.Device().id))
        smem = K.smem_bytes(name, Br, Bc, D, D, dtype)
        dev.launch(cp, dev.kernel(name, dtype, count_io, D, var),
                   K.grid(name, Nq, shape.Nk, Br, Bc, P), smem,
                   (*rows, *lds, i32(shape.d), i32(shape.dv), i32(left), i32(right),
                    np.float32(scale * LOG2E),
                    *_fast_variants(cp, scale, softcap, slopes), np.uint64(0), io),
                   threads=threads)
    else:
        Br, Bc = _blocks(block_sizes, shape, dtype, backward=False)
        smem = K.smem_bytes("flash2_fwd", Br, Bc, shape.d, shape.dv, dtype)
        dev.launch(cp, dev.kernel("flash2_fwd", dtype, count_io),
                K.grid("flash2_fwd", Nq, shape.Nk, Br, Bc, P), smem,
                (*rows, *lds, i32(shape.d), i32(shape.dv), i32(Br), i32(Bc), i32(left), i32(right),
                 dev.scalar(dtype, scale), cap, slopes, np.uint64(0), io))
    out = arrays.out(cp, O, dtype, qi.torch)
    lse = arrays.out(cp, L.reshape(shape.batch_shape + (Nq,)), "float32", qi.torch)
    return (out, lse, dev.traffic(cp, io)) if count_io else (out, lse)


# -- backward -----------------------------------------------------------------------------

def attention_backward(q, k, v, out, lse, dout, *, causal: bool = False, scale=None,
                       window=None, softcap=None, alibi_slopes=None, block_sizes=None,
                       count_io: bool = False, kernel: str = "auto",
                       deterministic: bool = False, algorithm: str = "flash2"):
    """FlashAttention-2 backward on the GPU: (dq, dk, dv) shaped like q, k, v, or
    (dq, dk, dv, traffic) with ``count_io=True``. lse is read as fp32. ``kernel`` as in
    `attention`: the Hopper main loop ("wg": warpgroup MMAs, compute capability 9.0), the
    tensor-core one ("tc"; both float16/bfloat16, d and dv multiples of 8 up to 256, tiles
    `block_sizes(q, v, backward=True)`) or the reference ("ref").

    dQ is summed over the K/V tiles with fp32 atomics, whose order varies from run to
    run, and so do the last bits of dq. ``deterministic=True`` makes the tiles add in a
    fixed order (each waits for the one before it), so dq is the same bits on every run,
    at some cost in speed; the bytes moved are the same. ``window``, ``softcap`` and
    ``alibi_slopes`` must be those of the forward (the softcap's tanh is recomputed).

    ``algorithm`` "flash1" and "standard" run those schedules' backward passes on the
    reference rung (`attention`); both are deterministic (no atomics)."""
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"deterministic must be True or False, got {deterministic!r}")
    if check_algorithm(algorithm, kernel, backward=True) != "flash2":
        with arrays.stream(q):
            return algorithms.backward(q, k, v, out, lse, dout, algorithm=algorithm,
                                       causal=causal, scale=scale, window=window,
                                       softcap=softcap, alibi_slopes=alibi_slopes,
                                       block_sizes=block_sizes, count_io=count_io)
    q, scale, flip = negated(q, scale)
    plain = _asked(window, softcap, alibi_slopes) is None
    grads = None
    if (plain and not count_io and block_sizes is None and kernel in ("auto", "tc", "wg")
            and not deterministic):
        grads = _torch_backward(q, k, v, out, lse, dout, causal, scale, kernel)
    if grads is None:
        with arrays.stream(q):
            grads = _attention_backward(q, k, v, out, lse, dout, causal=causal, scale=scale,
                                        window=window, softcap=softcap,
                                        alibi_slopes=alibi_slopes, block_sizes=block_sizes,
                                        count_io=count_io, kernel=kernel,
                                        deterministic=deterministic)
    return (flip_sign(grads[0]), *grads[1:]) if flip else grads


def saved(cp, shape: Shape, dtype: str, out, lse, dout):
    """The forward's out and the upstream dout (as `arrays.In`, checked against q, k, v)
    and lse as fp32 (problems, Nq)."""
    oi, doi = arrays.In(out, "out"), arrays.In(dout, "dout")
    want = shape.batch_shape + (shape.Nq, shape.dv)
    for name, x in (("out", oi), ("dout", doi)):
        if x.shape != want:
            raise ValueError(f"{name} has shape {x.shape}, but q, k, v call for {want}")
        if x.dtype != dtype:
            raise TypeError(f"{name} must have q's dtype {dtype}, got {x.dtype}")
    li = arrays.In(lse, "lse") if not isinstance(lse, np.ndarray) else None
    L = cp.asarray(np.asarray(lse, np.float32)) if li is None else li.arr
    if li is not None and li.dtype == "bfloat16":
        raise TypeError("lse must be float32 (or float16/float64), not bfloat16")
    if tuple(L.shape) != shape.batch_shape + (shape.Nq,):
        raise ValueError(f"lse has shape {tuple(L.shape)}, but q, k, v call for "
                         f"{shape.batch_shape + (shape.Nq,)}")
    return oi, doi, cp.ascontiguousarray(L.astype(cp.float32, copy=False)).reshape(-1, shape.Nq)


def _attention_backward(q, k, v, out, lse, dout, *, causal, scale, window, softcap,
                        alibi_slopes, block_sizes, count_io, kernel, deterministic):
    cp = dev.cupy()
    A = arrays
    qi, ki, vi = A.In(q, "q"), A.In(k, "k"), A.In(v, "v")
    shape = A.shape_of(qi, ki, vi)
    dtype = qi.dtype
    oi, doi, L = saved(cp, shape, dtype, out, lse, dout)
    scale = check_scale(scale, shape.d)
    left, right, cap, slopes, variant = _variant_args(cp, shape, dtype, causal, window,
                                                      softcap, alibi_slopes)
    which = _choose(kernel, shape, dtype, block_sizes, backward=True, variant=variant)
    # the fast rungs' instance (head dims below it: predicated), and its VAR instance:
    # softcap, ALiBi, and head dims below the instance's D
    D = _instance(shape, which, backward=True) if which in ("tc", "wg") else None
    var = softcap is not None or alibi_slopes is not None or K.padded(shape.d, shape.dv, D)
    if which == "wg":
        Br, Bc = K.wg_blocks(D, True)
    elif which == "tc":
        Br, Bc = _tc_tiles(D, True)
    else:
        Br, Bc = _blocks(block_sizes, shape, dtype, backward=True)
    P, Nq, Nk, d, dv = shape.problems, shape.Nq, shape.Nk, shape.d, shape.dv
    st = A.storage(cp, dtype)
    Dr = A.empty(cp, (P, Nq), cp.float32)   # D_i = rowsum(dO_i ∘ O_i)
    # the gradients go straight into outputs laid out like q, k, v, unless a GQA group or
    # a broadcast axis must be summed first: then into per-problem scratch (reduce)
    tq = dtype if qi.torch else None
    q_direct = qi.shape[:-2] == shape.batch_shape
    k_direct = ki.shape[:-2] == shape.batch_shape
    dQ = A.empty(cp, qi.shape, st, tq, like=qi) if q_direct else A.empty(cp, (P, Nq, d), st)
    dK = A.empty(cp, ki.shape, st, tq, like=ki) if k_direct else A.empty(cp, (P, Nk, d), st)
    dV = A.empty(cp, vi.shape, st, tq, like=vi) if k_direct else A.empty(cp, (P, Nk, dv), st)
    at, ld = A.rows(cp, shape, {
        A.AT_Q: (qi.arr, "q"), A.AT_K: (ki.arr, "k"), A.AT_V: (vi.arr, "k"),
        A.AT_O: (oi.arr, "q"), A.AT_dO: (doi.arr, "q"), A.AT_dQ: (dQ, "q" if q_direct else "p"),
        A.AT_dK: (dK, "k" if k_direct else "p"), A.AT_dV: (dV, "k" if k_direct else "p")})
    io = dev.counters(cp, count_io)
    Tr = -(-Nq // Br)
    i32 = np.int32
    # one turn counter per (problem, Q tile of Br rows); a null pointer: unordered atomics
    sem = cp.zeros(P * Tr, dtype=cp.int32) if deterministic else np.uint64(0)
    cc = dev.cc(cp.cuda.Device().id)
    ws = None if which != "wg" else _ws_backward(
        cp, shape, dtype, count_io, softcap is not None or alibi_slopes is not None,
        deterministic,
        {A.AT_Q: (qi.arr, "q"), A.AT_K: (ki.arr, "k"), A.AT_V: (vi.arr, "k"),
         A.AT_dO: (doi.arr, "q")}, ld)
    # the fp32 dQ accumulator: in rows, or in the copy-engine backward's blocks (tiled: its
    # instance D, which the pre- and post-pass take; 0: in rows)
    tiled = D if ws is not None and not deterministic else 0
    dQacc = A.empty(cp, _dq_tiled_shape(P, Nq, D) if tiled else (P, Nq, d), cp.float32)
    lds = tuple(ld[t] for t in (A.AT_Q, A.AT_K, A.AT_V, A.AT_dO, A.AT_dK, A.AT_dV))
    main = (qi.arr, ki.arr, vi.arr, at, doi.arr, L, Dr, dQacc, dK, dV, i32(Nq), i32(Nk))

    def grid(name):
        return K.grid(name, Nq, Nk, Br, Bc, P)

    if which in ("tc", "wg"):      # the same pre-pass; main loops of one signature
        name = "flash2_bwd_preprocess_tc"
        Dp = K.pre_instance(d, dv)
        dev.launch(cp, dev.kernel(name, dtype, count_io, Dp), grid(name), 0,
                   (oi.arr, doi.arr, at, Dr, dQacc, i32(Nq), ld[A.AT_O], ld[A.AT_dO], i32(d),
                    i32(dv), i32(tiled), io), threads=K.threads(name, Dp, cc))
        name = f"flash2_bwd_{which}" + ("_det" if deterministic else "")
        k_in, k_out, sl = _fast_variants(cp, scale, softcap, slopes)
        if ws is not None:       # the Hopper backward fed by the copy engine
            ws(cp.cuda.get_current_stream().ptr,
               tuple(dev.pointer(x) for x in (qi.arr, ki.arr, vi.arr, doi.arr)),
               ws.crd.data.ptr, at.data.ptr, L.data.ptr, Dr.data.ptr, dQacc.data.ptr,
               dev.pointer(dK), dev.pointer(dV), Nq, Nk, int(ld[A.AT_dK]), int(ld[A.AT_dV]),
               d, dv, left, right, scale, float(k_in), float(k_out),
               0 if isinstance(sl, np.uint64) else sl.data.ptr,
               0 if isinstance(sem, np.uint64) else sem.data.ptr, io.data.ptr,
               1 if deterministic else K.ws_chunk(P, Nq, d, dv, left >= 0 or right >= 0))
        else:
            smem = K.smem_bytes(name, Br, Bc, D, D, dtype)
            dev.launch(cp, dev.kernel(name, dtype, count_io, D, var), grid(name), smem,
                       (*main, *lds, i32(d), i32(dv), i32(left), i32(right), np.float32(scale),
                        k_in, k_out, sl, sem, np.uint64(0), io),
                       threads=K.threads(name, D, cc))
    else:
        dev.launch(cp, dev.kernel("flash2_bwd_preprocess", dtype, count_io),
                   grid("flash2_bwd_preprocess"), 0,
                   (oi.arr, doi.arr, at, Dr, dQacc, i32(Nq), ld[A.AT_O], ld[A.AT_dO], i32(d),
                    i32(dv), i32(Br), io))
        smem = K.smem_bytes("flash2_bwd_main", Br, Bc, d, dv, dtype)
        dev.launch(cp, dev.kernel("flash2_bwd_main", dtype, count_io), grid("flash2_bwd_main"),
                   smem, (*main, *lds, i32(d), i32(dv), i32(Br), i32(Bc), i32(left), i32(right),
                          dev.scalar(dtype, scale), cap, slopes, sem, np.uint64(0), io))
    dev.launch(cp, dev.kernel("flash2_bwd_postprocess", dtype, count_io),
               grid("flash2_bwd_postprocess"), 0,
               (dQacc, dQ, at, i32(Nq), ld[A.AT_dQ], i32(d), i32(Br), i32(tiled), io))
    dq = dQ if q_direct else A.laid_out(cp, A.reduce(cp, dQ, shape, qi.shape, Nq, d, dtype), qi)
    dk = dK if k_direct else A.laid_out(cp, A.reduce(cp, dK, shape, ki.shape, Nk, d, dtype), ki)
    dv_ = dV if k_direct else A.laid_out(cp, A.reduce(cp, dV, shape, vi.shape, Nk, dv, dtype), vi)
    res = tuple(A.out(cp, x, dtype, qi.torch) for x in (dq, dk, dv_))
    return res + (dev.traffic(cp, io),) if count_io else res


# -- the common case without the general path's Python: PyTorch (B, H, N, d) tensors ----

_PLANS: dict = {}        # (shapes, strides, dtypes, devices, causal, scale, kernel) -> plan
_BWD_PLANS: dict = {}    # (_PLANS' key, kernel, out/lse/dout shapes, strides, …) -> (plan,
                         # its backward's launchers), or False


def _torch_forward(q, k, v, causal, scale, kernel="auto"):
    """The wg or tc forward (as ``kernel`` and the device allow) for 4-D CUDA tensors
    (B, H, Nq, d) and (B, Hk, Nk, d) with Hk dividing H, float16/bfloat16, d ∈
    TC_HEAD_DIMS, in any layout the kernels read through its strides ((B, N, H, d)
    transposed, say): outputs allocated by PyTorch (out as `torch.empty_like(q)`),
    pointers passed straight to cuLaunchKernel, the launch plan cached per shapes and
    strides. The general path costs ~0.1 ms of Python per call, a third of the kernel's
    time at N = 1k. Returns None for anything else (the general path then checks and
    runs it)."""
    plan = _torch_forward_plan(q, k, v, causal, scale, kernel)
    if plan is None:
        return None
    import torch
    O = torch.empty_like(q)
    L = torch.empty(plan.lse_shape, dtype=torch.float32, device=q.device)
    index = q.device.index
    # the copy-engine forward's tile counter under a band (_WsForward), from PyTorch's
    # allocator on the current stream
    kw = ({"counter": torch.empty(1, dtype=torch.int32, device=q.device)}
          if getattr(plan.fwd, "banded", False) else {})
    with plan.cp.cuda.Device(index):
        plan.fwd(torch._C._cuda_getCurrentRawStream(index), q.data_ptr(), k.data_ptr(),
                 v.data_ptr(), plan.at.data.ptr, O.data_ptr(), L.data_ptr(), **kw)
    return O, L


class _Launcher:
    """cuLaunchKernel with the arguments packed into one buffer (CU_LAUNCH_PARAM_BUFFER_*):
    ~3 µs of Python per launch where a CuPy kernel call takes ~10, which is 1–2% of the
    kernel's time at N = 2k. ``fmt`` is the kernel's parameter list as a struct format,
    with the padding the C ABI puts between parameters spelled out; a call passes the
    stream and the leading pointers, ``tail`` the parameters fixed for the plan."""

    def __init__(self, kernel, fmt: str, grid, threads: int, smem: int, tail=()):
        self.fptr = kernel.kernel.ptr
        self.fmt = struct.Struct("=" + fmt)
        self.size = ctypes.c_size_t(self.fmt.size)
        self.grid, self.threads, self.smem, self.tail = grid, threads, smem, tuple(tail)
        self.launch = dev.cupy().cuda.driver.launchKernel
        # past 48 KB of shared memory (dynamic and the kernel's static) a CTA opts in
        if smem + getattr(kernel, "shared_size_bytes", 0) > 48 * 1024:
            kernel.max_dynamic_shared_size_bytes = smem
        # one parameter buffer, packed in place per call (the driver copies it at the
        # launch), and the launch's `extra` array pointing at it, made once
        self.buf = ctypes.create_string_buffer(self.fmt.size)
        self.extra = (ctypes.c_void_p * 5)(1, ctypes.addressof(self.buf), 2,
                                           ctypes.addressof(self.size), 0)
        self.extra_ptr = ctypes.addressof(self.extra)

    def __call__(self, stream: int, *pointers):
        self.fmt.pack_into(self.buf, 0, *pointers, *self.tail)
        self.launch(self.fptr, self.grid[0], self.grid[1], 1, self.threads, 1, 1, self.smem,
                    stream, 0, self.extra_ptr)


def _dq_tiled_shape(P: int, Nq: int, D: int) -> tuple[int, int, int]:
    """The shape of flash2_bwd_ws's fp32 dQ accumulator at instance D: per problem, a
    block of DQ_BLOCK floats per step of dq_rows(D) query rows, in the order the kernel's
    threads hold dQ_i (kernels_cu/common.cuh's dq_tiled_at), which the post-pass reads
    back in rows."""
    return (P, -(-Nq // K.dq_rows(D)), K.DQ_BLOCK)


class _TmaLaunch:
    """A kernel whose leading parameters are tensor maps (flash2_ws.cu's
    __grid_constant__ CUtensorMap), for one set of shapes and strides: the maps are
    encoded per call from the tensors' addresses (cached per address) and passed by
    value, the other parameters (``types``: "Q" 64-bit pointers, "i" int32, "f" float32)
    follow. It launches with cuLaunchKernel's array of parameter pointers: from one
    packed buffer (_Launcher's CU_LAUNCH_PARAM_BUFFER_POINTER) the driver does not hand a
    __grid_constant__ tensor map to the copy engine intact (an illegal instruction at the
    first TMA load on an H100)."""

    _CTYPES = {"Q": ctypes.c_uint64, "i": ctypes.c_int32, "f": ctypes.c_float}

    def __init__(self, kernel, name: str, grid, threads: int, smem: int, geoms, rows, D: int,
                 types: str, crd=None):
        self.fptr = kernel.kernel.ptr
        self.crd = crd           # the maps' coordinates per problem (_tma.plan), on the device
        if smem > 48 * 1024:
            kernel.max_dynamic_shared_size_bytes = smem
        self.name, self.grid, self.threads, self.smem = name, grid, threads, smem
        self.geoms, self.rows, self.D = geoms, tuple(rows), D
        self.ptrs = None         # the addresses the maps in self.maps were encoded for
        self.launch = dev.cupy().cuda.driver.launchKernel
        # one C object per parameter, rewritten in place per call
        self.maps = [ctypes.create_string_buffer(128) for _ in range(len(geoms))]
        self.args = [self._CTYPES[t]() for t in types]
        objs = self.maps + self.args
        self.params = (ctypes.c_void_p * len(objs))(*[ctypes.addressof(x) for x in objs])

    def set(self, values, start: int = 0):
        """Parameters start, start + 1, … (after the maps) take ``values``."""
        for obj, x in zip(self.args[start:], values):
            obj.value = x

    def __call__(self, stream: int, tensors, *values):
        """Launch on ``stream`` with maps of the tensors at addresses ``tensors`` and the
        leading other parameters set to ``values`` (the rest as last set)."""
        if 0 in self.grid:
            return
        if tensors != self.ptrs:    # the same addresses (a training loop's): the same maps
            if self.ptrs is None:
                dev.check_grid(self.grid)
            # only the maps whose tensor moved (the forward's O is a new allocation per
            # call where q, k, v stay)
            for n, (x, g, r) in enumerate(zip(tensors, self.geoms, self.rows)):
                if self.ptrs is not None and self.ptrs[n] == x:
                    continue
                m = _tma.tensor_map(int(x), g, r, _tma.box_cols(self.D))
                if m is None:
                    self.ptrs = None
                    raise RuntimeError(f"the driver refused the tensor maps of {self.name} "
                                       f"(geometry {self.geoms}); set FLASHSIM_TMA=0 to run "
                                       "flash2_wg.cu's kernel instead")
                ctypes.memmove(self.maps[n], m, 128)
            self.ptrs = tuple(tensors)
        self.set(values)
        self.launch(self.fptr, self.grid[0], self.grid[1], 1, self.threads, 1, 1, self.smem,
                    stream, ctypes.addressof(self.params), 0)


class _WsForward(_TmaLaunch):
    """flash2_fwd_ws (flash2_ws.cu) for one set of shapes and strides: one CTA per SM
    walking the Q tiles (kernels.ws_forward_ctas) and their shared memory
    (kernels.ws_forward_smem), set with the band. Under a band (``banded``) the CTAs draw
    their tiles from a counter, 4 bytes of device memory zeroed on the call's stream
    before the launch: ``counter`` (a torch tensor or CuPy array allocated for that
    stream), or, where none is passed, taken from CuPy's pool, whose current stream must
    then be the call's. Each launch has its own, so that launches on different streams
    never share one."""

    # tmQ, tmK, tmV, tmO | crd, at, O, L | Nq, Nk, ldo, d, dv, left, right | scale·log2e, k_in,
    # k_out | slopes, io | problems, chunk | tile_counter
    def __init__(self, kernel, tiles, smem: int, crd, geoms, Br: int, Bc: int, D: int,
                 problems: int, sms: int):
        super().__init__(kernel, "flash2_fwd_ws", (tiles, 1), K.ws_threads(D), smem, geoms,
                         (Br, Bc, Bc, 64), D, "QQQQiiiiiiifffQQiiQ", crd)
        self.args[0].value = crd.data.ptr
        self.args[-3].value = problems
        self.tiles, self.sms, self.Br, self.Bc, self.D = tiles, sms, Br, Bc, D
        self.problems = problems
        self.banded = False

    def set_tail(self, Nq, Nk, ldo, d, dv, left, right, scale_log2, k_in, k_out, slopes, io):
        self.set((Nq, Nk, ldo, d, dv, left, right, scale_log2, k_in, k_out, slopes, io), 4)
        self.banded = left >= 0 or right >= 0
        self.args[-2].value = K.ws_chunk(self.problems, Nk, d, dv, self.banded)
        ctas = K.ws_forward_ctas(self.tiles, self.sms)
        self.grid = (ctas, 1)
        self.smem = K.ws_forward_smem(self.Br, self.Bc, self.D, walking=ctas < self.tiles)

    def __call__(self, stream: int, q: int, k: int, v: int, at: int, O: int, L: int,
                 tail=None, counter=None):
        if tail is not None:
            self.set_tail(*tail)
        ptr = 0
        if self.banded and 0 not in self.grid:
            cp = dev.cupy()
            if counter is None:
                counter = cp.empty(1, cp.int32)
            ptr = counter.data_ptr() if hasattr(counter, "data_ptr") else counter.data.ptr
            cp.cuda.runtime.memsetAsync(ptr, 0, 4, stream)
        self.args[-1].value = ptr
        _TmaLaunch.__call__(self, stream, (q, k, v, O), self.crd.data.ptr, at, O, L)


class _WsBackwardMain:
    """flash2_bwd_ws called as the torch backward plan calls its main loop (the pointers
    of Q, K, V, at, dO, L, D, dQacc, dK, dV; the rest set once per plan)."""

    def __init__(self, ws: _TmaLaunch):
        self.ws = ws

    def __call__(self, stream: int, q, k, v, at, dout, lse, D, dQacc, dk, dv):
        self.ws(stream, (q, k, v, dout), self.ws.crd.data.ptr, at, lse, D, dQacc, dk, dv)


def _ws_backward(cp, shape: Shape, dtype: str, count_io: bool, var: bool, det: bool,
                 cols: dict, ld):
    """The launcher of flash2_bwd_ws (the wg backward's main loop fed by TMA) for these
    arrays (``cols``: Q, K, V, dO), or None where it does not apply (kernels.ws_runs;
    layouts TMA cannot address; FLASHSIM_TMA=0): flash2_bwd_wg then runs, with the same
    tiles, steps and bits. Its parameters: tmQ, tmK, tmV, tmdO | crd, at, L, D, dQacc, dK,
    dV | Nq, Nk, lddk, lddv, d, dv, left, right | scale, k_in, k_out | slopes, sem, io |
    chunk (kernels.ws_chunk).
    dQacc is tiled (_dq_tiled_shape) for flash2_bwd_ws, in rows for _det. Head dims below
    D run its plain instance (``var``: softcap or ALiBi only): the copy engine zero-fills
    the columns past d and dv."""
    d, dv = shape.d, shape.dv
    D = _instance(shape, "wg", backward=True)
    if not (K.ws_runs(d, dv, D, backward=True, variant=var)
            and os.environ.get("FLASHSIM_TMA", "1") != "0"):
        return None
    four = {t: cols[t] for t in _tma.BACKWARD}
    rows = {arrays.AT_Q: shape.Nq, arrays.AT_K: shape.Nk, arrays.AT_V: shape.Nk,
            arrays.AT_dO: shape.Nq}
    # head dims below D: maps d (V, dO: dv) columns wide, whose boxes' last columns are zeros
    got = _tma.plan(arrays.table_key(shape, four), tuple(int(x) for x in ld),
                    tuple((t, rows[t]) for t in _tma.BACKWARD), d, cp.cuda.Device().id, D,
                    ((arrays.AT_V, dv), (arrays.AT_dO, dv)) if dv != d else ())
    if got is None:
        return None
    crd, geoms = got
    Br, Bc = K.wg_blocks(D, True)
    box = (Br, Bc, Bc, Br)
    if _tma.maps(tuple(dev.pointer(four[t][0]) for t in _tma.BACKWARD), geoms, box, D) is None:
        return None
    name = "flash2_bwd_ws" + ("_det" if det else "")
    return _TmaLaunch(dev.kernel(name, dtype, count_io, D, var), name,
                      K.grid(name, shape.Nq, shape.Nk, Br, Bc, shape.problems),
                      K.threads(name, D, dev.cc(cp.cuda.Device().id)),
                      K.smem_bytes(name, Br, Bc, D, D, dtype), geoms, box, D,
                      "QQQQQQQiiiiiiiifffQQQi", crd)


def _ws_max_apart(dtype: str, D: int, softcap, alibi_slopes, ws_var: bool | int) -> bool:
    """flash2_fwd_ws's instance ``ws_var`` takes another softmax max (kernels.ws_max) than
    flash2_fwd_wg runs these variants under (its softcap instance where kernels.wg_cap
    and cap_only hold, else the online max), so that the cp.async kernel may not stand in
    for it where TMA cannot address a layout: softmax_max and the simulator's
    hierarchy.softmax_rule, which see no layouts, report flash2_fwd_ws's."""
    wg_var = (K.CAP_ONLY if K.wg_cap(dtype, D, alibi_slopes)
              and K.cap_only(dtype, softcap, alibi_slopes, D) else True)
    return K.ws_max(dtype, ws_var) != K.ws_max(dtype, wg_var)


def _ws_forward(cp, shape: Shape, dtype: str, count_io: bool, var: bool | int, cols: dict,
                ld):
    """The launcher of flash2_fwd_ws (the wg forward fed by TMA) for these arrays, or None
    where it does not apply: a packed varlen batch (not here), layouts TMA cannot address
    (_tma.layout), or FLASHSIM_TMA=0 in the environment (flash2_fwd_wg then runs).
    ``var``: its instance, plain (False), softcap/ALiBi (True), kernels.CAP_ONLY or
    kernels.LAZY_BF16."""
    d, dv = shape.d, shape.dv
    D = _instance(shape, "wg")
    tiles = _ws_tiles(shape, D, var=var)
    if tiles is None:
        return None
    Br, Bc = tiles
    four = {t: cols[t] for t in _tma.FORWARD}
    # head dims below D: maps d (dv) columns wide, whose boxes' last columns are zeros (and,
    # O's, are not written); O leaves through its own map, a box of 64 rows per consumer
    # warpgroup (flash2_ws.cu's wg_store_o_tma)
    got = _tma.plan(arrays.table_key(shape, four), tuple(int(x) for x in ld),
                    ((arrays.AT_Q, shape.Nq), (arrays.AT_K, shape.Nk), (arrays.AT_V, shape.Nk),
                     (arrays.AT_O, shape.Nq)),
                    d, cp.cuda.Device().id, D,
                    ((arrays.AT_V, dv), (arrays.AT_O, dv)) if dv != d else ())
    if got is None:
        return None
    crd, geoms = got
    if _tma.maps(tuple(dev.pointer(cols[t][0]) for t in four), geoms, (Br, Bc, Bc, 64), D) is None:
        return None
    name = "flash2_fwd_ws"
    smem = K.smem_bytes(name, Br, Bc, D, D, dtype)
    nx, P = K.grid(name, shape.Nq, shape.Nk, Br, Bc, shape.problems)
    return _WsForward(dev.kernel(name, dtype, count_io, D, var), nx * P, smem, crd, geoms,
                      Br, Bc, D, P, dev.num_sms(cp.cuda.Device().id))


class _Plan:
    """What the fast paths launch for one set of shapes and strides (_plan_torch_forward)."""
    __slots__ = ("cp", "fwd", "at", "shape", "lse_shape", "scale", "left", "right", "io",
                 "bwd")


def _fast_inputs(q, k, v, causal, scale) -> bool:
    """q, k, v are 4-D CUDA tensors of one dtype on one device with their last axis
    contiguous (the shapes, strides and dtype are checked when the plan is made)."""
    if type(q).__module__ != "torch" or type(k) is not type(q) or type(v) is not type(q):
        return False
    return (q.is_cuda and k.is_cuda and v.is_cuda and q.dim() == k.dim() == v.dim() == 4
            and q.dtype == k.dtype == v.dtype and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
            and q.device == k.device == v.device
            and isinstance(causal, bool) and (scale is None or type(scale) in (float, int)))


def _plan_key(q, k, v, causal, scale, kernel):
    """The fast paths' cache key: all that their checks (_fast_inputs) and plans read of
    the inputs, so that a key seen before needs no check again; None where q, k, v are
    not PyTorch tensors of one type, or causal is not a bool, or scale neither None nor
    a Python number (the general path takes those)."""
    tq = type(q)
    if (tq.__module__ != "torch" or type(k) is not tq or type(v) is not tq
            or type(causal) is not bool or not (scale is None or type(scale) in (float, int))):
        return None
    return (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype,
            v.dtype, q.device, k.device, v.device, causal, scale, kernel,
            os.environ.get("FLASHSIM_TMA"))


def _cached_forward_plan(key, q, k, v, causal, scale, kernel):
    """The plan cached under ``key``, made (or False: the fast path declines these
    inputs) on first sight."""
    plan = _PLANS.get(key)
    if plan is None:
        plan = (_fast_inputs(q, k, v, causal, scale)
                and _plan_torch_forward(q, k, v, causal, scale, kernel))
        if len(_PLANS) > 1024:
            _PLANS.clear()
        _PLANS[key] = plan
    return plan


def _torch_forward_plan(q, k, v, causal, scale, kernel="auto"):
    """The cached launch plan for these tensors and forward ``kernel`` ("auto", "tc" or
    "wg"), or None where the fast path does not apply: the inputs' shapes, strides,
    dtypes, devices checked once per key, the addresses' 16-byte alignment per call."""
    key = _plan_key(q, k, v, causal, scale, kernel)
    if key is None:
        return None
    plan = _cached_forward_plan(key, q, k, v, causal, scale, kernel)
    if plan is False or (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16:
        return None
    return plan


def _views(cp, dtype: str, *tensors):
    """CuPy views of tensors (their shapes and strides, for the row table), or None when
    the kernels cannot read one through its strides."""
    views = [arrays.view(cp, t, np.int16 if dtype == "bfloat16" else np.dtype(dtype))
             for t in tensors]
    return views if all(arrays.readable(x) for x in views) else None


def _plan_torch_forward(q, k, v, causal, scale, kernel):
    """What the fast path launches for these shapes and strides, or False where it does
    not apply."""
    import torch
    dtypes = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
    if q.dtype not in dtypes or not hasattr(torch._C, "_cuda_getCurrentRawStream"):
        return False
    B, H, Nq, d = q.shape
    Bk, Hk, Nk, dk = k.shape
    if (Bk != B or dk != d or tuple(v.shape) != (B, Hk, Nk, d)
            or K.head_dim_instance(d, d) is None or Hk == 0 or H % Hk or min(B, H, Nq, Nk) == 0 or B * H > dev.GRID_Y_MAX):
        return False
    cp = dev.cupy()
    dtype = dtypes[q.dtype]
    plan = _Plan()
    with cp.cuda.Device(q.device.index):
        views = _views(cp, dtype, q, k, v, torch.empty_like(q))
        if views is None:
            return False                                # the general path copies
        shape = Shape(Nq, Nk, d, d, (B, H), (B, H), (B, Hk), H // Hk)
        # the rung's instance of head dim D ≥ d (each rung has its own: kernels.
        # instance_dim); below it, its VAR instance (kernels.padded)
        if kernel != "tc" and _wg_supports(shape, dtype, None):   # Hopper: warpgroup MMAs
            D = K.instance_dim("wg", d, d)
            name, (Br, Bc) = "flash2_fwd_wg", K.WG_BLOCKS[D]
        elif kernel == "wg":
            return False                                # the general path says why not
        else:
            D = K.instance_dim("tc", d, d, cc_major=dev.cc_major(q.device.index))
            name, (Br, Bc) = "flash2_fwd_tc", _tc_tiles(D, False, K.padded(d, d, D))
        pad = K.padded(d, d, D)
        threads = K.threads(name, D, dev.cc(q.device.index))
        smem = K.smem_bytes(name, Br, Bc, D, D, dtype)
        if smem > dev.smem_limit():
            return False                                # the general path picks "ref"
        # the row table: query problem (b, h) reads K/V problem (b, h // (H / Hk)), each
        # tensor through its strides; O as torch.empty_like(q) lays it out
        A = arrays
        plan.at, ld = A.rows(cp, shape, {A.AT_Q: (views[0], "q"), A.AT_K: (views[1], "k"),
                                         A.AT_V: (views[2], "k"), A.AT_O: (views[3], "q")})
        plan.shape = shape
        plan.left, plan.right = arrays.band(causal)
        plan.scale = check_scale(scale, d)
        plan.io = dev.unused_counters(q.device.index).data.ptr
        # (Q, K, V, at, O, L | Nq, Nk, ldq, ldk, ldv, ldo, d, dv, left, right, scale·log2e,
        #  k_in, k_out, slopes, vl, io): the plain instance (d = dv = its D), which reads
        #  none of the variants' three nor vl; below D the VAR one, whose k_in is then
        #  scale·log2e (no softcap, no slopes)
        ws = None
        if name == "flash2_fwd_wg":      # fed by the copy engine where TMA addresses them
            ws = _ws_forward(cp, shape, dtype, False, False,
                             {A.AT_Q: (views[0], "q"), A.AT_K: (views[1], "k"),
                              A.AT_V: (views[2], "k"), A.AT_O: (views[3], "q")}, ld)
        if ws is not None:
            ws.set_tail(Nq, Nk, int(ld[A.AT_O]), d, d, plan.left, plan.right,
                        plan.scale * LOG2E, 0.0, 0.0, 0, plan.io)
            plan.fwd = ws
        elif name == "flash2_fwd_wg" and _ws_tiles(shape, D) not in (None, (Br, Bc)):
            return False     # the general path copies what TMA cannot read (_attention)
        else:
            k_in = plan.scale * LOG2E if pad else 0.0
            plan.fwd = _Launcher(dev.kernel(name, dtype, False, D, pad), "6Q10ifff4xQQQ",
                                 K.grid(name, Nq, Nk, Br, Bc, B * H), threads, smem,
                                 (Nq, Nk, *(int(ld[t]) for t in (A.AT_Q, A.AT_K, A.AT_V, A.AT_O)),
                                  d, d, plan.left, plan.right, plan.scale * LOG2E, k_in, 0.0, 0,
                                  0, plan.io))
        plan.lse_shape = (B, H, Nq)
        plan.cp = cp
        plan.bwd = {}                                   # per (out, dout) strides: made by
    return plan                                         # the first backward call


def _torch_backward(q, k, v, out, lse, dout, causal, scale, kernel="auto"):
    """The Hopper or tensor-core backward (as ``kernel`` and the device allow) on the
    fast path's terms (see _torch_forward), without
    GQA (whose dK, dV group sums the general path does), unordered dQ atomics; out and
    dout in any layout the kernels read, dq, dk, dv as `torch.empty_like` of q, k, v.
    Returns None for anything else."""
    key = _plan_key(q, k, v, causal, scale, "tc")
    tq = type(q)
    if key is None or type(out) is not tq or type(lse) is not tq or type(dout) is not tq:
        return None
    import torch                                     # q is a PyTorch tensor: torch is there
    # the checks below, once per shapes, strides, dtypes and devices (as the forward's)
    bkey = (key, kernel, out.shape, out.stride(), out.dtype, out.device, lse.shape,
            lse.stride(), lse.dtype, lse.device, dout.shape, dout.stride(), dout.dtype,
            dout.device)
    got = _BWD_PLANS.get(bkey)
    if got is None:
        got = False
        if not (k.shape[:2] != q.shape[:2] or out.shape != q.shape
                or dout.shape != q.shape or out.dtype != q.dtype or dout.dtype != q.dtype
                or lse.dtype != torch.float32 or tuple(lse.shape) != tuple(q.shape[:-1])
                or not lse.is_contiguous() or out.stride(-1) != 1 or dout.stride(-1) != 1
                or not all(x.is_cuda and x.device == q.device for x in (out, lse, dout))):
            # the forward plan's shapes, dtype and row table; its tc forward lives in the
            # module the backward loads anyway (an "auto" plan would build the Hopper
            # forward for nothing)
            plan = _cached_forward_plan(key, q, k, v, causal, scale, "tc")
            if plan is not False:
                pkey = (kernel, out.stride(), dout.stride())
                bwd = plan.bwd.get(pkey)
                if bwd is None:
                    bwd = plan.bwd[pkey] = _plan_torch_backward(plan, q, k, v, out, dout,
                                                                kernel)
                # False: tiles too large here, or strides it cannot read
                got = bwd and (plan, bwd)
        if len(_BWD_PLANS) > 1024:
            _BWD_PLANS.clear()
        _BWD_PLANS[bkey] = got
    if got is False or (q.data_ptr() | k.data_ptr() | v.data_ptr() | out.data_ptr()
                        | dout.data_ptr()) % 16:
        return None                                  # the general path
    plan, bwd = got
    B, H, Nq, d = q.shape
    f32 = dict(dtype=torch.float32, device=q.device)
    at, pre, main, post, tiled = bwd
    D = torch.empty((B * H, Nq), **f32)
    dQacc = torch.empty(_dq_tiled_shape(B * H, Nq, tiled) if tiled else (B * H, Nq, d), **f32)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    index = q.device.index
    with plan.cp.cuda.Device(index):
        stream = torch._C._cuda_getCurrentRawStream(index)
        pre(stream, out.data_ptr(), dout.data_ptr(), at.data.ptr, D.data_ptr(), dQacc.data_ptr())
        main(stream, q.data_ptr(), k.data_ptr(), v.data_ptr(), at.data.ptr, dout.data_ptr(),
             lse.data_ptr(), D.data_ptr(), dQacc.data_ptr(), dk.data_ptr(), dv.data_ptr())
        post(stream, dQacc.data_ptr(), dq.data_ptr(), at.data.ptr)
    return dq, dk, dv


def _plan_torch_backward(plan, q, k, v, out, dout, kernel="auto"):
    """The backward's row table, three launchers (pre-pass, main loop, post-pass) and
    how its dQ accumulator lies (flash2_bwd_ws's blocks: their instance D; 0: in rows) for
    a forward plan's shapes and these out, dout strides, or False where its tiles do not
    fit the device's shared memory or the kernels cannot read a layout. The main loop is
    the Hopper one where the device runs it (unless ``kernel`` is "tc")."""
    import torch
    B, H, Nq, d = q.shape
    Nk = k.shape[2]
    P, dtype = B * H, ("float16" if q.dtype == torch.float16 else "bfloat16")
    cp = plan.cp
    A = arrays
    with cp.cuda.Device(q.device.index):
        if kernel != "tc" and _wg_supports(plan.shape, dtype, None, backward=True):
            D = _instance(plan.shape, "wg", backward=True)
            name, (Br, Bc) = "flash2_bwd_wg", K.wg_blocks(D, True)
        elif kernel == "wg":
            return False         # the general path says why
        else:
            D = _instance(plan.shape, "tc", backward=True)
            name, (Br, Bc) = "flash2_bwd_tc", _tc_tiles(D, True)
        pad, Dp = K.padded(d, d, D), K.pre_instance(d, d)   # the VAR instance below D
        smem = K.smem_bytes(name, Br, Bc, D, D, dtype)
        views = _views(cp, dtype, q, k, v, out, dout, torch.empty_like(q), torch.empty_like(k),
                       torch.empty_like(v))
        if smem > dev.smem_limit() or views is None:
            return False
        at, ld = A.rows(cp, plan.shape, {
            A.AT_Q: (views[0], "q"), A.AT_K: (views[1], "k"), A.AT_V: (views[2], "k"),
            A.AT_O: (views[3], "q"), A.AT_dO: (views[4], "q"), A.AT_dQ: (views[5], "q"),
            A.AT_dK: (views[6], "k"), A.AT_dV: (views[7], "k")})
        ld = [int(x) for x in ld]
        cc = dev.cc(q.device.index)
        # (Q, K, V, at, dO, L, D, dQacc, dK, dV | Nq, Nk, ldq, ldk, ldv, lddo, lddk, lddv,
        #  d, dv, left, right, scale, k_in, k_out, slopes, sem, vl, io)
        # (below D the VAR instance: k_in = scale·log2e, no softcap, no slopes)
        main = _Launcher(dev.kernel(name, dtype, False, D, pad), "10Q12ifff4xQQQQ",
                         K.grid(name, Nq, Nk, Br, Bc, P), K.threads(name, D, cc), smem,
                         (Nq, Nk, *(ld[t] for t in (A.AT_Q, A.AT_K, A.AT_V, A.AT_dO, A.AT_dK,
                                                    A.AT_dV)),
                          d, d, plan.left, plan.right, plan.scale,
                          plan.scale * LOG2E if pad else 0.0, 0.0, 0, 0, 0, plan.io))
        if name == "flash2_bwd_wg":   # fed by the copy engine where TMA addresses them
            ws = _ws_backward(cp, plan.shape, dtype, False, False, False,
                              {A.AT_Q: (views[0], "q"), A.AT_K: (views[1], "k"),
                               A.AT_V: (views[2], "k"), A.AT_dO: (views[4], "q")}, ld)
            if ws is not None:
                ws.set((Nq, Nk, ld[A.AT_dK], ld[A.AT_dV], d, d, plan.left, plan.right,
                        plan.scale, 0.0, 0.0, 0, 0, plan.io,
                        K.ws_chunk(P, Nq, d, d, plan.left >= 0 or plan.right >= 0)), 7)
                main = _WsBackwardMain(ws)
        # (O, dO, at, D, dQacc | Nq, ldo, lddo, d, dv, tiled, io)
        tiled = D if isinstance(main, _WsBackwardMain) else 0
        pre = _Launcher(dev.kernel("flash2_bwd_preprocess_tc", dtype, False, Dp), "5Q6iQ",
                        K.grid("flash2_bwd_preprocess_tc", Nq, Nk, Br, Bc, P),
                        K.threads("flash2_bwd_preprocess_tc", Dp, cc), 0,
                        (Nq, ld[A.AT_O], ld[A.AT_dO], d, d, tiled, plan.io))
        # (dQacc, dQ, at | Nq, lddq, d, Br, tiled, io)
        post = _Launcher(dev.kernel("flash2_bwd_postprocess", dtype, False), "3Q5i4xQ",
                         K.grid("flash2_bwd_postprocess", Nq, Nk, Br, Bc, P),
                         K.threads("flash2_bwd_postprocess", d, cc), 0,
                         (Nq, ld[A.AT_dQ], d, Br, tiled, plan.io))
    return at, pre, main, post, tiled
