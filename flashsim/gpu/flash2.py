"""FlashAttention-2 on the GPU: the forward and backward launchers of the three rungs
(flash2_ref.cu, flash2_tc.cu, flash2_wg.cu), the choice between them, and a fast path
for PyTorch tensors."""

from __future__ import annotations

import ctypes
import math
import struct
import warnings

import numpy as np

from .. import kernels as K
from ..problem import canon_batch, check_scale, Shape
from ..variants import canonical_slopes, check_softcap, make_band
from . import _arrays as arrays, _device as dev, algorithms
from .algorithms import check_algorithm

KERNELS = ("auto", "ref", "tc", "wg")
LOG2E = math.log2(math.e)


def _wg_supports(shape: Shape, dtype: str, block_sizes) -> bool:
    """The Hopper forward runs these inputs on the current device (compute capability
    9.0: its sm_90a code runs on no other)."""
    if not (dtype in K.TC_DTYPES and shape.d == shape.dv and shape.d in K.WG_HEAD_DIMS):
        return False
    device = dev.cupy().cuda.Device().id
    return K.wg_supports(shape.d, shape.dv, dtype, dev.cc(device), dev.smem_limit_on(device),
                         block_sizes)


def _tc_tiles(d: int, backward: bool, var: bool = False) -> tuple[int, int]:
    """The tensor-core kernel's (Br, Bc) for head dim d on the current device (``var``:
    its softcap/ALiBi instance)."""
    if backward:
        return K.tc_bwd_blocks(d, dev.cc_major(dev.cupy().cuda.Device().id))
    return K.tc_blocks(d, dev.cc_major(dev.cupy().cuda.Device().id), var)


def _tc_supports(shape: Shape, dtype: str, block_sizes, backward: bool = False,
                 var: bool = False) -> bool:
    if not (dtype in K.TC_DTYPES and shape.d == shape.dv and shape.d in K.TC_HEAD_DIMS):
        return False
    # the tiles must fit the device's shared memory (not so on GPUs with 99 KB per block)
    device = dev.cupy().cuda.Device().id
    return K.tc_supports(shape.d, shape.dv, dtype, dev.cc(device), dev.smem_limit_on(device),
                         block_sizes, backward, var)


def _choose(kernel: str, shape: Shape, dtype: str, block_sizes, backward: bool = False,
            variant: str | None = None, var: bool = False) -> str:
    """The fastest rung that supports the inputs: "wg" (Hopper, forward), "tc" (tensor
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
    if kernel == "wg" and backward:
        raise ValueError("the Hopper kernel ('wg') is a forward only; the backward runs on "
                         "kernel='tc' (or 'auto', which picks it)")
    if kernel in ("auto", "wg") and not backward and _wg_supports(shape, dtype, block_sizes):
        return "wg"
    if kernel == "wg":
        raise ValueError(
            f"the Hopper kernel runs float16/bfloat16 with d = dv in {K.WG_HEAD_DIMS} and "
            f"its own tiles {K.WG_BLOCKS}, on a device of compute capability 9.0 (this one: "
            f"{dev.cc(dev.cupy().cuda.Device().id) / 10:.1f}); got {dtype}, d={shape.d}, "
            f"dv={shape.dv}, block_sizes={block_sizes}. Use kernel='tc', 'ref' or 'auto'.")
    if _tc_supports(shape, dtype, block_sizes, backward, var):
        return "tc"
    if kernel == "tc":
        raise ValueError(
            f"the tensor-core kernel runs float16/bfloat16 with d = dv in {K.TC_HEAD_DIMS} "
            f"and its own tiles (fs.gpu.block_sizes(q, v, kernel='tc')), which must fit "
            f"the device's shared memory ({dev.smem_limit()} bytes here); got {dtype}, "
            f"d={shape.d}, dv={shape.dv}, "
            f"block_sizes={block_sizes}. Use kernel='ref' or 'auto'.")
    if block_sizes is None:
        _warn_reference(dtype, f"d={shape.d}, dv={shape.dv} (the fast rungs take d = dv in "
                               f"{K.TC_HEAD_DIMS} with tiles that fit the device)")
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
    slopes = canonical_slopes(alibi_slopes, shape)
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
    VarScores): the scores' constants in log2 units, computed here so that the kernels
    read them from their parameters, and the slopes (a device array, or a null pointer)
    times log2(e)."""
    c = check_softcap(softcap)
    if c is None:
        k_in, k_out = scale * LOG2E, 0.0
    else:
        k_in, k_out = 2 * LOG2E * scale / c, c * LOG2E
    if not isinstance(slopes, np.uint64):
        slopes = (slopes * np.float32(LOG2E)).astype(np.float32)
    return np.float32(k_in), np.float32(k_out), slopes


def _asked(window, softcap, alibi_slopes) -> str | None:
    """The variants given, by name ("window, softcap"), or None for plain attention."""
    names = [n for n, x in (("window", window), ("softcap", softcap),
                            ("alibi_slopes", alibi_slopes)) if x is not None]
    return ", ".join(names) or None


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
    if which == "wg":
        return K.WG_BLOCKS[shape.d]
    if which == "tc":
        return _tc_tiles(shape.d, backward, var)
    return _blocks(None, shape, qi.dtype, backward)


# -- forward ------------------------------------------------------------------------------

def attention(q, k, v, *, causal: bool = False, scale=None, window=None, softcap=None,
              alibi_slopes=None, block_sizes=None, count_io: bool = False,
              kernel: str = "auto", algorithm: str = "flash2"):
    """FlashAttention-2 forward on the GPU: (out, lse), or (out, lse, traffic) with
    ``count_io=True``. out has q's dtype and shape (..., Nq, dv); lse is fp32 (..., Nq).

    ``kernel``: "wg" the Hopper kernel (warpgroup MMAs; compute capability 9.0,
    float16/bfloat16, d = dv ∈ {64, 128}, tiles 128×128, 128×64 at d = 64), "tc" the
    tensor-core kernel (mma.sync, Ampere and later; float16/bfloat16, d = dv ∈ {64, 128},
    tiles 128×128 at d = 64 on sm_90, else 128×64), "ref" the reference kernel (any
    dtype, d, dv ≤ 256, any tiles), or "auto" (default): the first of "wg", "tc", "ref"
    that supports the inputs on this device, with tiles that fit its shared memory.

    Variants, with `flashsim.simulate`'s semantics (flashsim.variants): ``window=(left,
    right)`` (−1 unbounded; tiles outside the band are skipped), ``softcap=c`` and
    ``alibi_slopes`` ((heads,) or (batch, heads), fp32), on every rung (the fast rungs
    run softcap and ALiBi in their own template instances, so plain attention pays
    nothing for them).

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
    shape, Q, Kd, Vd, kv_index = arrays.layout(qi, ki, vi)
    dtype = qi.dtype
    scale = check_scale(scale, shape.d)
    left, right, cap, slopes, variant = _variant_args(cp, shape, dtype, causal, window,
                                                      softcap, alibi_slopes)
    var = softcap is not None or alibi_slopes is not None   # the fast rungs' VAR instance
    which = _choose(kernel, shape, dtype, block_sizes, variant=variant, var=var)
    P, Nq = shape.problems, shape.Nq
    O = arrays.empty(cp, (P, Nq, shape.dv), arrays.storage(cp, dtype), dtype if qi.torch else None)
    L = arrays.empty(cp, (P, Nq), cp.float32, "float32" if qi.torch else None)
    io = dev.counters(cp, count_io)
    i32 = np.int32
    if which in ("tc", "wg"):    # one signature: (Q, K, V, kv_index, O, L, Nq, Nk, band, scale)
        if which == "wg":
            name, (Br, Bc) = "flash2_fwd_wg", K.WG_BLOCKS[shape.d]
        else:
            name, (Br, Bc) = "flash2_fwd_tc", _tc_tiles(shape.d, False, var)
        threads = K.threads(name, shape.d, dev.cc(cp.cuda.Device().id))
        smem = K.smem_bytes(name, Br, Bc, shape.d, shape.dv, dtype)
        dev.launch(cp, dev.kernel(name, dtype, count_io, shape.d, var),
                   K.grid(name, Nq, shape.Nk, Br, Bc, P), smem,
                   (Q, Kd, Vd, kv_index, O, L, i32(Nq), i32(shape.Nk), i32(left), i32(right),
                    np.float32(scale * LOG2E), *_fast_variants(cp, scale, softcap, slopes),
                    np.uint64(0), io),
                   threads=threads)
    else:
        Br, Bc = _blocks(block_sizes, shape, dtype, backward=False)
        smem = K.smem_bytes("flash2_fwd", Br, Bc, shape.d, shape.dv, dtype)
        dev.launch(cp, dev.kernel("flash2_fwd", dtype, count_io),
                K.grid("flash2_fwd", Nq, shape.Nk, Br, Bc, P), smem,
                (Q, Kd, Vd, kv_index, O, L, i32(Nq), i32(shape.Nk), i32(shape.d),
                 i32(shape.dv), i32(Br), i32(Bc), i32(left), i32(right),
                 dev.scalar(dtype, scale), cap, slopes, np.uint64(0), io))
    out = arrays.out(cp, O.reshape(shape.batch_shape + (Nq, shape.dv)), dtype, qi.torch)
    lse = arrays.out(cp, L.reshape(shape.batch_shape + (Nq,)), "float32", qi.torch)
    return (out, lse, dev.traffic(cp, io)) if count_io else (out, lse)


# -- backward -----------------------------------------------------------------------------

def attention_backward(q, k, v, out, lse, dout, *, causal: bool = False, scale=None,
                       window=None, softcap=None, alibi_slopes=None, block_sizes=None,
                       count_io: bool = False, kernel: str = "auto",
                       deterministic: bool = False, algorithm: str = "flash2"):
    """FlashAttention-2 backward on the GPU: (dq, dk, dv) shaped like q, k, v, or
    (dq, dk, dv, traffic) with ``count_io=True``. lse is read as fp32. ``kernel`` as in
    `attention`: the tensor-core main loop ("tc": float16/bfloat16, d = dv ∈ {64, 128},
    tiles `block_sizes(q, v, backward=True)`) or the reference ("ref").

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
    plain = _asked(window, softcap, alibi_slopes) is None
    if (plain and not count_io and block_sizes is None and kernel in ("auto", "tc")
            and not deterministic):
        fast = _torch_backward(q, k, v, out, lse, dout, causal, scale)
        if fast is not None:
            return fast
    with arrays.stream(q):
        return _attention_backward(q, k, v, out, lse, dout, causal=causal, scale=scale,
                                   window=window, softcap=softcap,
                                   alibi_slopes=alibi_slopes, block_sizes=block_sizes,
                                   count_io=count_io, kernel=kernel,
                                   deterministic=deterministic)


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
    qi, ki, vi = arrays.In(q, "q"), arrays.In(k, "k"), arrays.In(v, "v")
    shape, Q, Kd, Vd, kv_index = arrays.layout(qi, ki, vi)
    dtype = qi.dtype
    oi, doi, L = saved(cp, shape, dtype, out, lse, dout)
    scale = check_scale(scale, shape.d)
    left, right, cap, slopes, variant = _variant_args(cp, shape, dtype, causal, window,
                                                      softcap, alibi_slopes)
    which = _choose(kernel, shape, dtype, block_sizes, backward=True, variant=variant)
    var = softcap is not None or alibi_slopes is not None   # the fast rungs' VAR instance
    if which == "tc":
        Br, Bc = _tc_tiles(shape.d, True)
    else:
        Br, Bc = _blocks(block_sizes, shape, dtype, backward=True)
    P, Nq, Nk, d, dv = shape.problems, shape.Nq, shape.Nk, shape.d, shape.dv
    O = oi.arr.reshape(P, Nq, dv)
    dO = doi.arr.reshape(P, Nq, dv)
    st = arrays.storage(cp, dtype)
    D = arrays.empty(cp, (P, Nq), cp.float32)
    dQacc = arrays.empty(cp, (P, Nq, d), cp.float32)
    dQ = arrays.empty(cp, (P, Nq, d), st)
    dK = arrays.empty(cp, (P, Nk, d), st)
    dV = arrays.empty(cp, (P, Nk, dv), st)
    io = dev.counters(cp, count_io)
    Tr = -(-Nq // Br)
    i32 = np.int32
    # one turn counter per (problem, Q tile of Br rows); a null pointer: unordered atomics
    sem = cp.zeros(P * Tr, dtype=cp.int32) if deterministic else np.uint64(0)
    cc = dev.cc(cp.cuda.Device().id)

    def grid(name):
        return K.grid(name, Nq, Nk, Br, Bc, P)

    if which == "tc":
        name = "flash2_bwd_preprocess_tc"
        dev.launch(cp, dev.kernel(name, dtype, count_io, d), grid(name), 0,
                (O, dO, D, dQacc, i32(Nq), io), threads=K.threads(name, d, cc))
    else:
        dev.launch(cp, dev.kernel("flash2_bwd_preprocess", dtype, count_io),
                grid("flash2_bwd_preprocess"), 0,
                (O, dO, D, dQacc, i32(Nq), i32(d), i32(dv), i32(Br), io))
    if which == "tc":
        smem = K.smem_bytes("flash2_bwd_tc", Br, Bc, d, dv, dtype)
        name = "flash2_bwd_tc_det" if deterministic else "flash2_bwd_tc"
        dev.launch(cp, dev.kernel(name, dtype, count_io, d, var), grid(name), smem,
                (Q, Kd, Vd, kv_index, dO, L, D, dQacc, dK, dV, i32(Nq), i32(Nk), i32(left),
                 i32(right), np.float32(scale), *_fast_variants(cp, scale, softcap, slopes),
                 sem, np.uint64(0), io),
                threads=K.threads(name, d, cc))
    else:
        smem = K.smem_bytes("flash2_bwd_main", Br, Bc, d, dv, dtype)
        dev.launch(cp, dev.kernel("flash2_bwd_main", dtype, count_io), grid("flash2_bwd_main"), smem,
                (Q, Kd, Vd, kv_index, dO, L, D, dQacc, dK, dV, i32(Nq), i32(Nk), i32(d),
                 i32(dv), i32(Br), i32(Bc), i32(left), i32(right), dev.scalar(dtype, scale),
                 cap, slopes, sem, np.uint64(0), io))
    dev.launch(cp, dev.kernel("flash2_bwd_postprocess", dtype, count_io),
            grid("flash2_bwd_postprocess"), 0,
            (dQacc, dQ, i32(Nq), i32(d), i32(Br), io))
    dq = arrays.reduce(cp, dQ, shape, qi.shape, Nq, d, dtype)
    dk = arrays.reduce(cp, dK, shape, ki.shape, Nk, d, dtype)
    dv_ = arrays.reduce(cp, dV, shape, vi.shape, Nk, dv, dtype)
    res = tuple(arrays.out(cp, x, dtype, qi.torch) for x in (dq, dk, dv_))
    return res + (dev.traffic(cp, io),) if count_io else res


# -- the common case without the general path's Python: PyTorch (B, H, N, d) tensors ----

_PLANS: dict = {}        # (shapes, dtype, causal, scale, device, kernel) -> launch plan


def _torch_forward(q, k, v, causal, scale, kernel="auto"):
    """The wg or tc forward (as ``kernel`` and the device allow) for contiguous CUDA
    tensors (B, H, Nq, d) and (B, Hk, Nk, d) with Hk dividing H, float16/bfloat16,
    d ∈ TC_HEAD_DIMS: outputs allocated by PyTorch,
    pointers passed straight to cuLaunchKernel, the launch plan cached per shape. The
    general path costs ~0.1 ms of Python per call, a third of the kernel's time at
    N = 1k. Returns None for anything else (the general path then checks and runs it)."""
    if not _fast_inputs(q, k, v, causal, scale):
        return None
    plan = _torch_forward_plan(q, k, v, causal, scale, kernel)
    if plan is None:
        return None
    import torch
    O = torch.empty_like(q)
    L = torch.empty(plan.lse_shape, dtype=torch.float32, device=q.device)
    index = q.device.index
    with plan.cp.cuda.Device(index):
        plan.fwd(torch._C._cuda_getCurrentRawStream(index), q.data_ptr(), k.data_ptr(),
                 v.data_ptr(), plan.kv_index, O.data_ptr(), L.data_ptr())
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

    def __call__(self, stream: int, *pointers):
        buf = ctypes.create_string_buffer(self.fmt.pack(*pointers, *self.tail), self.fmt.size)
        extra = (ctypes.c_void_p * 5)(1, ctypes.addressof(buf), 2, ctypes.addressof(self.size), 0)
        self.launch(self.fptr, self.grid[0], self.grid[1], 1, self.threads, 1, 1, self.smem,
                    stream, 0, ctypes.addressof(extra))


class _Plan:
    """What the fast paths launch for one set of shapes (see _plan_torch_forward)."""
    __slots__ = ("cp", "fwd", "kv", "kv_index", "lse_shape", "scale", "left", "right", "io",
                 "bwd")


def _fast_inputs(q, k, v, causal, scale) -> bool:
    """q, k, v are contiguous 4-D CUDA tensors of one dtype on one device (the shapes and
    dtype are checked when the plan is made)."""
    if type(q).__module__ != "torch" or type(k) is not type(q) or type(v) is not type(q):
        return False
    return (q.is_cuda and k.is_cuda and v.is_cuda and q.dim() == k.dim() == v.dim() == 4
            and q.dtype == k.dtype == v.dtype and q.is_contiguous() and k.is_contiguous()
            and v.is_contiguous() and q.device == k.device == v.device
            and isinstance(causal, bool) and (scale is None or type(scale) in (float, int)))


def _plan_key(q, k, v, causal, scale, kernel):
    return (tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype, causal, scale,
            q.device.index, kernel)


def _torch_forward_plan(q, k, v, causal, scale, kernel="auto"):
    """The cached launch plan for these tensors and forward ``kernel`` ("auto", "tc" or
    "wg"), or None where the fast path does not apply (the caller has checked the
    types)."""
    key = _plan_key(q, k, v, causal, scale, kernel)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _plan_torch_forward(q, k, v, causal, scale, kernel)
        if len(_PLANS) > 1024:
            _PLANS.clear()
        _PLANS[key] = plan
    if plan is False or (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16:
        return None
    return plan


def _plan_torch_forward(q, k, v, causal, scale, kernel):
    """What the fast path launches for these shapes, or False where it does not apply."""
    import torch
    dtypes = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
    if q.dtype not in dtypes or not hasattr(torch._C, "_cuda_getCurrentRawStream"):
        return False
    B, H, Nq, d = q.shape
    Bk, Hk, Nk, dk = k.shape
    if (Bk != B or dk != d or tuple(v.shape) != (B, Hk, Nk, d) or d not in K.TC_HEAD_DIMS
            or Hk == 0 or H % Hk or min(B, H, Nq, Nk) == 0 or B * H > dev.GRID_Y_MAX):
        return False
    cp = dev.cupy()
    dtype = dtypes[q.dtype]
    plan = _Plan()
    with cp.cuda.Device(q.device.index):
        shape = Shape(Nq, Nk, d, d, (B, H), (B, H), (B, Hk), H // Hk)
        if kernel != "tc" and _wg_supports(shape, dtype, None):   # Hopper: warpgroup MMAs
            name, (Br, Bc) = "flash2_fwd_wg", K.WG_BLOCKS[d]
        elif kernel == "wg":
            return False                                # the general path says why not
        else:
            name, (Br, Bc) = "flash2_fwd_tc", _tc_tiles(d, False)
        threads = K.threads(name, d, dev.cc(q.device.index))
        smem = K.smem_bytes(name, Br, Bc, d, d, dtype)
        if smem > dev.smem_limit():
            return False                                # the general path picks "ref"
        kern = dev.kernel(name, dtype, False, d)
        if smem > 48 * 1024:
            kern.max_dynamic_shared_size_bytes = smem
        # query problem (b, h) reads K/V problem (b, h // (H / Hk)): GQA groups
        kv = cp.asarray((np.arange(B)[:, None] * Hk
                         + np.arange(H)[None, :] // (H // Hk)).astype(np.int32).ravel())
        plan.kv, plan.kv_index = kv, kv.data.ptr       # the array, kept alive, and its address
        plan.left, plan.right = arrays.band(causal)
        plan.scale = check_scale(scale, d)
        plan.io = dev.unused_counters(q.device.index).data.ptr
        # (Q, K, V, kv_index, O, L | Nq, Nk, left, right, scale·log2e, k_in, k_out, slopes,
        #  vl, io): the plain instance, which reads none of the variants' three nor vl
        plan.fwd = _Launcher(kern, "6Q4ifff4xQQQ", K.grid(name, Nq, Nk, Br, Bc, B * H), threads,
                             smem, (Nq, Nk, plan.left, plan.right, plan.scale * LOG2E, 0.0, 0.0,
                                    0, 0, plan.io))
        plan.lse_shape = (B, H, Nq)
        plan.cp = cp
        plan.bwd = None                                 # made by the first backward call
    return plan


def _torch_backward(q, k, v, out, lse, dout, causal, scale):
    """The tensor-core backward on the fast path's terms (see _torch_forward), without
    GQA (whose dK, dV group sums the general path does), unordered dQ atomics. Returns
    None for anything else."""
    if not _fast_inputs(q, k, v, causal, scale):
        return None
    import torch
    if (any(type(x) is not type(q) for x in (out, lse, dout))
            or k.shape[:2] != q.shape[:2] or out.shape != q.shape
            or dout.shape != q.shape or out.dtype != q.dtype or dout.dtype != q.dtype
            or lse.dtype != torch.float32 or tuple(lse.shape) != tuple(q.shape[:-1])
            or not all(x.is_contiguous() and x.is_cuda and x.device == q.device
                       for x in (out, lse, dout))
            or any(x.data_ptr() % 16 for x in (out, dout))):
        return None
    # the forward plan's shapes, dtype and K/V index; its tc forward lives in the module
    # the backward loads anyway (an "auto" plan would build the Hopper forward for nothing)
    plan = _torch_forward_plan(q, k, v, causal, scale, "tc")
    if plan is None:
        return None
    bwd = plan.bwd if plan.bwd is not None else _plan_torch_backward(plan, q, k)
    if bwd is False:                # its tiles do not fit here: the general path picks "ref"
        return None
    B, H, Nq, d = q.shape
    f32 = dict(dtype=torch.float32, device=q.device)
    D, dQacc = torch.empty((B * H, Nq), **f32), torch.empty((B * H, Nq, d), **f32)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    index = q.device.index
    pre, main, post = bwd
    with plan.cp.cuda.Device(index):
        stream = torch._C._cuda_getCurrentRawStream(index)
        pre(stream, out.data_ptr(), dout.data_ptr(), D.data_ptr(), dQacc.data_ptr())
        main(stream, q.data_ptr(), k.data_ptr(), v.data_ptr(), plan.kv_index, dout.data_ptr(),
             lse.data_ptr(), D.data_ptr(), dQacc.data_ptr(), dk.data_ptr(), dv.data_ptr())
        post(stream, dQacc.data_ptr(), dq.data_ptr())
    return dq, dk, dv


def _plan_torch_backward(plan, q, k):
    """The backward's three launchers (pre-pass, main loop, post-pass) for the shapes of a
    forward plan, or False where its tiles do not fit the device's shared memory."""
    import torch
    B, H, Nq, d = q.shape
    Nk = k.shape[2]
    P, dtype = B * H, ("float16" if q.dtype == torch.float16 else "bfloat16")
    cp = plan.cp
    with cp.cuda.Device(q.device.index):
        Br, Bc = _tc_tiles(d, True)
        smem = K.smem_bytes("flash2_bwd_tc", Br, Bc, d, d, dtype)
        if smem > dev.smem_limit():
            plan.bwd = False
            return False
        main = dev.kernel("flash2_bwd_tc", dtype, False, d)
        if smem > 48 * 1024:
            main.max_dynamic_shared_size_bytes = smem
        # (O, dO, D, dQacc | Nq, io)
        cc = dev.cc(q.device.index)
        pre = _Launcher(dev.kernel("flash2_bwd_preprocess_tc", dtype, False, d), "4Qi4xQ",
                        K.grid("flash2_bwd_preprocess_tc", Nq, Nk, Br, Bc, P),
                        K.threads("flash2_bwd_preprocess_tc", d, cc), 0, (Nq, plan.io))
        # (Q, K, V, kv_index, dO, L, D, dQacc, dK, dV | Nq, Nk, left, right, scale, k_in,
        #  k_out, slopes, sem, vl, io)
        main = _Launcher(main, "10Q4ifff4xQQQQ", K.grid("flash2_bwd_tc", Nq, Nk, Br, Bc, P),
                         K.threads("flash2_bwd_tc", d, cc), smem,
                         (Nq, Nk, plan.left, plan.right, plan.scale, 0.0, 0.0, 0, 0, 0, plan.io))
        # (dQacc, dQ | Nq, d, Br, io)
        post = _Launcher(dev.kernel("flash2_bwd_postprocess", dtype, False), "2Q3i4xQ",
                         K.grid("flash2_bwd_postprocess", Nq, Nk, Br, Bc, P),
                         K.threads("flash2_bwd_postprocess", d, cc), 0, (Nq, d, Br, plan.io))
    plan.bwd = (pre, main, post)
    return plan.bwd
