"""The simulator's FlashAttention-2 schedule on a real GPU, launched through CuPy.

The only module of flashsim that imports CuPy, and only when a function here is called:
`import flashsim` works with no CuPy and no GPU.

    out, lse = fs.gpu.attention(q, k, v, causal=True)
    dq, dk, dv = fs.gpu.attention_backward(q, k, v, out, lse, dout, causal=True)
    out, lse, traffic = fs.gpu.attention(q, k, v, count_io=True)
    traffic == fs.simulate(q, k, v, "flash2", block_sizes=fs.gpu.block_sizes(q, v)).traffic

Inputs: CuPy arrays, NumPy arrays (copied to the device), or any tensor exposing
``__cuda_array_interface__`` or ``__dlpack__`` (PyTorch: no copy). Results are CuPy
arrays, or PyTorch tensors when the inputs were PyTorch tensors. float16, float32 and
float64 come in any of these; bfloat16 comes as PyTorch tensors (CuPy has no bfloat16).
Non-contiguous inputs are copied to contiguous ones first. The layout and semantics are
`flashsim.simulate`'s; L is fp32, as FlashAttention stores it.

Kernels (kernels_cu/*.cu) are compiled once per (source, instrumented or not, device)
with NVRTC and cached; ``count_io=True`` runs the instrumented build, whose thread blocks
add the bytes of every tile they move to per-tensor counters, and returns that as a
`flashsim.Traffic`. Three rungs: "ref" (flash2_ref.cu, any dtype and tile), "tc"
(flash2_tc.cu, mma.sync tensor cores, Ampere and later) and "wg" (flash2_wg.cu, the
forward on Hopper's warpgroup MMAs, compute capability 9.0 only).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import json
import math
import os
import struct
import tempfile
import weakref
from pathlib import Path

import numpy as np

from . import kernels as K
from .problem import canon_batch, check_scale, resolve_batch, Shape
from .traffic import Traffic

THREADS = K.REF_THREADS
_GRID_Y_MAX = 65535

INSTALL_HINT = ('pip install "flashsim[cuda12]" (CUDA 12) or "flashsim[cuda13]" (CUDA 13)')


class GPUUnavailableError(RuntimeError):
    """CuPy is not installed, or no CUDA device is visible."""


def _cupy():
    try:
        import cupy as cp
    except ImportError as e:
        raise GPUUnavailableError(f"flashsim.gpu needs CuPy: {INSTALL_HINT} ({e})") from None
    try:
        n = cp.cuda.runtime.getDeviceCount()
    except Exception as e:  # the driver or runtime is missing
        raise GPUUnavailableError(f"no CUDA device is visible ({e})") from None
    if n == 0:
        raise GPUUnavailableError("no CUDA device is visible (CUDA_VISIBLE_DEVICES?)")
    return cp


def available() -> bool:
    """True if CuPy imports and a CUDA device is visible."""
    try:
        _cupy()
        return True
    except GPUUnavailableError:
        return False


def compile_options(count_io: bool) -> tuple[str, ...]:
    """NVRTC options (CuPy adds the current device's architecture, -arch=sm_XY)."""
    opts = ("--std=c++17", f"-I{K.kernel_dir()}")
    cp = _cupy()
    cuda_path = cp.cuda.get_cuda_path()
    if cuda_path:
        opts += (f"-I{cuda_path}/include",)
    return opts + (("-DFLASHSIM_COUNT_IO",) if count_io else ())


def _headers_digest() -> str:
    """A digest of kernels_cu/*.cuh. CuPy keys its on-disk kernel cache by the source text
    it is given, not by the headers that text includes, so the source carries this."""
    text = "".join(p.read_text() for p in sorted(K.kernel_dir().glob("*.cuh")))
    return hashlib.sha256(text.encode()).hexdigest()[:40]


@functools.lru_cache(maxsize=None)
def _module(source: str, count_io: bool, device: int):
    cp = _cupy()
    code = (K.kernel_dir() / source).read_text() + f"\n// headers: {_headers_digest()}\n"
    if source in K.ARCH_SPECIFIC:
        return _ArchModule(source, code, count_io)
    return cp.RawModule(code=code, options=compile_options(count_io),
                        name_expressions=K.name_expressions(source))


class _ArchModule:
    """A source built by NVRTC for its arch-specific target (K.ARCH_SPECIFIC: sm_90a for
    wgmma), which CuPy's RawModule, naming the plain target itself, cannot ask for. The
    cubin and the kernels' mangled names are cached on disk beside CuPy's own kernels,
    keyed by everything the build depends on."""

    def __init__(self, source: str, code: str, count_io: bool):
        cp = _cupy()
        from cupy_backends.cuda.libs import nvrtc
        exprs = K.name_expressions(source)
        opts = compile_options(count_io) + (f"-arch={K.ARCH_SPECIFIC[source]}",)
        # code ends with the headers' digest (_module)
        key = hashlib.sha256("\0".join((code, *opts, *exprs, str(nvrtc.getVersion())))
                             .encode()).hexdigest()[:40]
        cache = Path(os.environ.get("CUPY_CACHE_DIR") or Path.home() / ".cupy" / "kernel_cache")
        path = cache / f"flashsim_{Path(source).stem}_{key}"
        try:
            cubin = path.with_suffix(".cubin").read_bytes()
            names = json.loads(path.with_suffix(".json").read_text())
        except (OSError, ValueError):
            cubin, names = self._compile(nvrtc, source, code, opts, exprs)
            try:   # written whole, then renamed: a concurrent reader sees all or nothing
                cache.mkdir(parents=True, exist_ok=True)
                for suffix, data in ((".cubin", cubin), (".json", json.dumps(names).encode())):
                    fd, tmp = tempfile.mkstemp(dir=cache)
                    with os.fdopen(fd, "wb") as f:
                        f.write(data)
                    os.replace(tmp, path.with_suffix(suffix))
            except OSError:
                pass                                    # no cache: compile again next time
        self.names = names
        self.module = cp.cuda.function.Module()
        self.module.load(cubin)

    @staticmethod
    def _compile(nvrtc, source, code, opts, exprs):
        prog = nvrtc.createProgram(code, source, [], [])
        try:
            for e in exprs:
                nvrtc.addNameExpression(prog, e)
            try:
                nvrtc.compileProgram(prog, list(opts))
            except nvrtc.NVRTCError as e:
                raise RuntimeError(f"NVRTC failed on {source} ({' '.join(opts)}):\n"
                                   f"{nvrtc.getProgramLog(prog)}") from e
            return bytes(nvrtc.getCUBIN(prog)), {e: nvrtc.getLoweredName(prog, e) for e in exprs}
        finally:
            nvrtc.destroyProgram(prog)

    def get_function(self, expr: str) -> "_ArchKernel":
        return _ArchKernel(self.module.get_function(self.names[expr]))


class _ArchKernel:
    """A driver function with what the launchers use of a CuPy RawKernel: ``.kernel``,
    ``max_dynamic_shared_size_bytes`` and a call on the current stream."""

    def __init__(self, fn):
        self.kernel = fn

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        drv = _cupy().cuda.driver
        return drv.funcGetAttribute(drv.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                    self.kernel.ptr)

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, n: int):
        drv = _cupy().cuda.driver
        drv.funcSetAttribute(self.kernel.ptr, drv.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                             n)

    def __call__(self, grid, block, args, shared_mem: int = 0):
        pad = lambda t: tuple(t) + (1,) * (3 - len(t))
        self.kernel(pad(grid), pad(block), args, shared_mem=shared_mem,
                    stream=_cupy().cuda.get_current_stream())


def _kernel(name: str, dtype: str, count_io: bool, D: int | None = None):
    return _kernel_on(name, dtype, count_io, D, _cupy().cuda.Device().id)


@functools.lru_cache(maxsize=None)
def _kernel_on(name: str, dtype: str, count_io: bool, D: int | None, device: int):
    cp = _cupy()
    if name in K.SOURCES["flash2_tc.cu"]:
        source, expr = "flash2_tc.cu", f"{name}<{K.CUDA_TYPES[dtype]}, {D}>"
    elif name in K.SOURCES["flash2_wg.cu"]:
        source, expr = "flash2_wg.cu", f"{name}<{K.CUDA_TYPES[dtype]}, {D}>"
    else:
        source, expr = "flash2_ref.cu", f"{name}<{K.CUDA_TYPES[dtype]}>"
    return _module(source, count_io, device).get_function(expr)


KERNELS = ("auto", "ref", "tc", "wg")


@functools.lru_cache(maxsize=None)
def _cc(device: int) -> int:
    # CuPy spells the compute capability as a string, "90" for 9.0
    return int(_cupy().cuda.Device(device).compute_capability)


def _cc_major(device: int) -> int:
    return _cc(device) // 10


def _wg_supports(shape: Shape, dtype: str, block_sizes) -> bool:
    """The Hopper forward runs these inputs on the current device (compute capability
    9.0: its sm_90a code runs on no other)."""
    if not (dtype in K.TC_DTYPES and shape.d == shape.dv and shape.d in K.WG_HEAD_DIMS):
        return False
    device = _cupy().cuda.Device().id
    return K.wg_supports(shape.d, shape.dv, dtype, _cc(device), _smem_limit_on(device),
                         block_sizes)


def _tc_tiles(d: int, backward: bool) -> tuple[int, int]:
    """The tensor-core kernel's (Br, Bc) for head dim d on the current device."""
    if backward:
        return K.tc_bwd_blocks(d, _cc_major(_cupy().cuda.Device().id))
    return K.tc_blocks(d, _cc_major(_cupy().cuda.Device().id))


def _tc_supports(shape: Shape, dtype: str, block_sizes, backward: bool = False) -> bool:
    if not (dtype in K.TC_DTYPES and shape.d == shape.dv and shape.d in K.TC_HEAD_DIMS):
        return False
    # the tiles must fit the device's shared memory (not so on GPUs with 99 KB per block)
    device = _cupy().cuda.Device().id
    return K.tc_supports(shape.d, shape.dv, dtype, _cc(device), _smem_limit_on(device),
                         block_sizes, backward)


def _choose(kernel: str, shape: Shape, dtype: str, block_sizes, backward: bool = False) -> str:
    """The fastest rung that supports the inputs: "wg" (Hopper, forward), "tc" (tensor
    cores), else "ref"; or the one asked for, with an error where it cannot run them."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if kernel == "ref":
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
            f"{_cc(_cupy().cuda.Device().id) / 10:.1f}); got {dtype}, d={shape.d}, "
            f"dv={shape.dv}, block_sizes={block_sizes}. Use kernel='tc', 'ref' or 'auto'.")
    if _tc_supports(shape, dtype, block_sizes, backward):
        return "tc"
    if kernel == "tc":
        raise ValueError(
            f"the tensor-core kernel runs float16/bfloat16 with d = dv in {K.TC_HEAD_DIMS} "
            f"and its own tiles (fs.gpu.block_sizes(q, v, kernel='tc')), which must fit "
            f"the device's shared memory ({smem_limit()} bytes here); got {dtype}, "
            f"d={shape.d}, dv={shape.dv}, "
            f"block_sizes={block_sizes}. Use kernel='ref' or 'auto'.")
    return "ref"


def smem_limit() -> int:
    """Largest dynamic shared memory one CTA may opt in to on the current device."""
    return _smem_limit_on(_cupy().cuda.Device().id)


@functools.lru_cache(maxsize=None)
def _smem_limit_on(device: int) -> int:
    props = _cupy().cuda.runtime.getDeviceProperties(device)
    return int(props.get("sharedMemPerBlockOptin", props["sharedMemPerBlock"]))


# -- inputs and outputs -----------------------------------------------------------------

class _In:
    """A device array plus how to hand results back (CuPy, or PyTorch)."""

    def __init__(self, x, name: str):
        cp = _cupy()
        self.torch = type(x).__module__.split(".")[0] == "torch"
        if self.torch:
            import torch
            if x.device.type != "cuda":
                x = x.cuda()
            x = x.contiguous()
            self.dtype = str(x.dtype).replace("torch.", "")
            if self.dtype in K.CUDA_TYPES:
                # a CuPy view of the tensor's memory, no copy: DLPack's exchange costs
                # tens of microseconds of Python per tensor, a pointer costs none. The
                # launches run on torch's current stream (_stream), so no sync is needed.
                self.arr = _view(cp, x, np.int16 if self.dtype == "bfloat16"
                                 else np.dtype(self.dtype))
        else:
            if isinstance(x, np.ndarray) or not (hasattr(x, "__cuda_array_interface__")
                                                 or hasattr(x, "__dlpack__")):
                arr = cp.asarray(np.asarray(x))
            elif hasattr(x, "__cuda_array_interface__"):
                arr = cp.asarray(x)
            else:
                arr = cp.from_dlpack(x)
            self.dtype = str(arr.dtype)
            self.arr = cp.ascontiguousarray(arr)
        if self.dtype not in K.CUDA_TYPES:
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got "
                            f"{self.dtype}")
        if self.arr.data.ptr % 16:
            # a view starting mid-row: the kernels read 16 bytes at a time, so give them
            # a fresh (256-byte aligned) copy rather than a misaligned address
            self.arr = self.arr.copy()
        if self.arr.ndim < 2:
            raise ValueError(f"{name} must have at least 2 dimensions (..., N, d), got shape "
                             f"{tuple(self.arr.shape)}")

    @property
    def shape(self):
        return tuple(self.arr.shape)


def _view(cp, t, dtype):
    """A CuPy array over a contiguous CUDA tensor's memory (the tensor stays alive as its
    owner)."""
    if t.numel() == 0:
        return cp.empty(tuple(t.shape), dtype=dtype)
    mem = cp.cuda.UnownedMemory(t.data_ptr(), t.numel() * t.element_size(), t,
                                t.device.index)
    return cp.ndarray(tuple(t.shape), dtype=dtype, memptr=cp.cuda.MemoryPointer(mem, 0))


def _stream(x):
    """Run on PyTorch's current stream when the inputs are tensors, so our kernels are
    ordered with the user's PyTorch work; otherwise on CuPy's current stream."""
    if type(x).__module__.split(".")[0] != "torch":
        return contextlib.nullcontext()
    import torch
    dev = x.device.index if x.device.type == "cuda" else torch.cuda.current_device()
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)   # the fast path, ~1 µs
    ptr = raw(dev) if raw is not None else torch.cuda.current_stream(dev).cuda_stream
    cp = _cupy()
    if hasattr(cp.cuda.Stream, "from_external"):                 # CuPy ≥ 14
        return cp.cuda.Stream.from_external(_StreamHandle(ptr))
    return cp.cuda.ExternalStream(ptr, dev)


class _StreamHandle:
    """A raw CUDA stream in the CUDA stream protocol (what Stream.from_external reads)."""

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


def _storage(cp, dtype: str):
    # bfloat16 travels as its 16 bits in an int16 array
    return cp.int16 if dtype == "bfloat16" else getattr(cp, dtype)


# PyTorch tensors behind CuPy views made by _empty(torch_dtype=...), by data pointer, so
# _out hands the tensor itself back (DLPack costs ~20 µs of Python per output)
_TORCH_OUTPUTS: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()


def _empty(cp, shape, dtype, torch_dtype: str | None = None):
    """Output allocation: a CuPy array, or with ``torch_dtype`` a CuPy view of a new
    PyTorch tensor (the caller passed tensors). The GPU tests wrap it with a poisoning
    one to prove that every element is written."""
    if torch_dtype is None or math.prod(shape) == 0:
        return cp.empty(shape, dtype=dtype)
    import torch
    t = torch.empty(shape, dtype=getattr(torch, torch_dtype),
                    device=f"cuda:{cp.cuda.Device().id}")
    arr = _view(cp, t, np.dtype(dtype))
    _TORCH_OUTPUTS[arr.data.ptr] = t
    return arr


def _out(cp, arr, dtype: str, as_torch: bool):
    if not as_torch:
        return arr
    t = _TORCH_OUTPUTS.get(arr.data.ptr) if arr.size else None
    if t is not None and t.numel() == arr.size:
        return t.view(tuple(arr.shape))
    import torch
    t = torch.from_dlpack(arr)
    return t.view(torch.bfloat16) if dtype == "bfloat16" else t


def _to_f32(cp, arr, dtype: str):
    if dtype == "bfloat16":
        return (arr.view(cp.uint16).astype(cp.uint32) << 16).view(cp.float32)
    return arr.astype(cp.float64 if dtype == "float64" else cp.float32)


def _from_f32(cp, x, dtype: str):
    if dtype == "bfloat16":  # round to nearest even on the top 16 bits
        u = x.astype(cp.float32).view(cp.uint32)
        u = (u + cp.uint32(0x7FFF) + ((u >> 16) & cp.uint32(1))) >> 16
        return u.astype(cp.uint16).view(cp.int16)
    return x.astype(_storage(cp, dtype))


def _layout(q: _In, k: _In, v: _In):
    """Shape, per-problem Q (P, Nq, d), K/V (Pk, Nk, ·) and kv_index (P,) int32."""
    cp = _cupy()
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must share the head dim d: q has d={q.shape[-1]}, "
                         f"k has d={k.shape[-1]}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k {k.shape} and v {v.shape} must agree on every axis but the "
                         "last (..., Nk, ·)")
    batch, g = resolve_batch(q.shape[:-2], k.shape[:-2])
    shape = Shape(q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1], batch,
                  q.shape[:-2], k.shape[:-2], g)
    if max(shape.d, shape.dv) > 256:
        raise ValueError(f"head dims up to 256 are supported, got d={shape.d}, dv={shape.dv}")
    P = shape.problems
    Q = q.arr
    if q.shape[:-2] != batch:   # q broadcast over a batch or head axis: materialise it
        Q = cp.ascontiguousarray(cp.broadcast_to(Q, batch + q.shape[-2:]))
    Q = Q.reshape(P, shape.Nq, shape.d)
    kb = k.shape[:-2]
    Pk = math.prod(kb)
    n = max(len(batch), 1)
    kb_pad = (1,) * (n - len(kb)) + kb
    return (shape, Q, k.arr.reshape(Pk, shape.Nk, shape.d),
            v.arr.reshape(Pk, shape.Nk, shape.dv),
            _kv_index(kb_pad, canon_batch(shape), cp.cuda.Device().id))


@functools.lru_cache(maxsize=256)
def _kv_index(kb_pad: tuple, canon: tuple, device: int):
    """kv_index[p]: the K/V problem of query problem p (GQA groups, broadcast batch axes);
    cached on the device so repeated calls copy nothing."""
    cp = _cupy()
    Pk = math.prod(kb_pad)
    idx = np.broadcast_to(np.arange(Pk, dtype=np.int32).reshape(kb_pad)[..., None], canon)
    return cp.asarray(np.ascontiguousarray(idx).reshape(-1))


def _band(causal: bool) -> tuple[int, int]:
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    return (-1, 0) if causal else (-1, -1)


def _blocks(block_sizes, shape: Shape, dtype: str, backward: bool) -> tuple[int, int]:
    limit = smem_limit()
    if block_sizes is None:
        return K.default_block_sizes(shape.d, shape.dv, dtype, limit, backward)
    try:
        Br, Bc = (int(x) for x in block_sizes)
    except (TypeError, ValueError):
        raise TypeError(f"block_sizes must be a pair (Br, Bc), got {block_sizes!r}") from None
    if Br < 1 or Bc < 1:
        raise ValueError(f"block sizes must be >= 1, got {(Br, Bc)}")
    kernel = "flash2_bwd_main" if backward else "flash2_fwd"
    need = K.smem_bytes(kernel, Br, Bc, shape.d, shape.dv, dtype)
    if need > limit:
        raise ValueError(f"{kernel} with Br={Br}, Bc={Bc}, d={shape.d}, dv={shape.dv} "
                         f"({dtype}) needs {need} bytes of shared memory; this device allows "
                         f"{limit}. Use smaller block_sizes.")
    return Br, Bc


def block_sizes(q, v, *, backward: bool = False, kernel: str = "auto") -> tuple[int, int]:
    """The (Br, Bc) the kernels use by default for these inputs (pass them to
    `flashsim.simulate` to predict the kernels' traffic)."""
    qi, vi = _In(q, "q"), _In(v, "v")
    shape = Shape(qi.shape[-2], vi.shape[-2], qi.shape[-1], vi.shape[-1], (), (), (), 1)
    which = _choose(kernel, shape, qi.dtype, None, backward)
    if which == "wg":
        return K.WG_BLOCKS[shape.d]
    if which == "tc":
        return _tc_tiles(shape.d, backward)
    return _blocks(None, shape, qi.dtype, backward)


def _launch(cp, kernel, grid, smem: int, args, threads: int = THREADS):
    if 0 in grid:
        return
    if grid[1] > _GRID_Y_MAX:
        raise ValueError(f"{grid[1]} (batch × heads) problems exceed the grid's y limit "
                         f"{_GRID_Y_MAX}; split the batch")
    if smem > 48 * 1024:
        kernel.max_dynamic_shared_size_bytes = smem
    kernel(grid, (threads,), args, shared_mem=smem)


def _counters(cp, count_io: bool):
    """Fresh zeroed counters for an instrumented run; the fast build never touches them,
    so it gets one shared buffer per device instead of an allocation per call."""
    if count_io:
        return cp.zeros(len(K.io_counters()), dtype=cp.uint64)
    return _unused_counters(cp.cuda.Device().id)


@functools.lru_cache(maxsize=None)
def _unused_counters(device: int):
    cp = _cupy()
    return cp.zeros(len(K.io_counters()), dtype=cp.uint64)


def _scalar(dtype: str, x: float):
    return np.float64(x) if dtype == "float64" else np.float32(x)


def _traffic(cp, counters) -> Traffic:
    values = cp.asnumpy(counters).tolist()
    reads, writes = {}, {}
    for (tensor, direction), n in zip(K.io_counters(), values):
        (reads if direction == "read" else writes)[tensor] = int(n)
    return Traffic(reads, writes)


# -- forward ------------------------------------------------------------------------------

def attention(q, k, v, *, causal: bool = False, scale=None, block_sizes=None,
              count_io: bool = False, kernel: str = "auto"):
    """FlashAttention-2 forward on the GPU: (out, lse), or (out, lse, traffic) with
    ``count_io=True``. out has q's dtype and shape (..., Nq, dv); lse is fp32 (..., Nq).

    ``kernel``: "wg" the Hopper kernel (warpgroup MMAs; compute capability 9.0,
    float16/bfloat16, d = dv ∈ {64, 128}, tiles 128×128, 128×64 at d = 64), "tc" the
    tensor-core kernel (mma.sync, Ampere and later; float16/bfloat16, d = dv ∈ {64, 128},
    tiles 128×128 at d = 64 on sm_90, else 128×64), "ref" the reference kernel (any
    dtype, d, dv ≤ 256, any tiles), or "auto" (default): the first of "wg", "tc", "ref"
    that supports the inputs on this device, with tiles that fit its shared memory.
    """
    if not count_io and block_sizes is None and kernel in ("auto", "tc", "wg"):
        fast = _torch_forward(q, k, v, causal, scale, kernel)
        if fast is not None:
            return fast
    with _stream(q):
        return _attention(q, k, v, causal=causal, scale=scale, block_sizes=block_sizes,
                          count_io=count_io, kernel=kernel)


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
    dev = q.device.index
    with plan.cp.cuda.Device(dev):
        plan.fwd(torch._C._cuda_getCurrentRawStream(dev), q.data_ptr(), k.data_ptr(),
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
        self.launch = _cupy().cuda.driver.launchKernel

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
            or Hk == 0 or H % Hk or min(B, H, Nq, Nk) == 0 or B * H > _GRID_Y_MAX):
        return False
    cp = _cupy()
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
        threads = K.threads(name, d, _cc(q.device.index))
        smem = K.smem_bytes(name, Br, Bc, d, d, dtype)
        if smem > smem_limit():
            return False                                # the general path picks "ref"
        kern = _kernel(name, dtype, False, d)
        if smem > 48 * 1024:
            kern.max_dynamic_shared_size_bytes = smem
        # query problem (b, h) reads K/V problem (b, h // (H / Hk)): GQA groups
        kv = cp.asarray((np.arange(B)[:, None] * Hk
                         + np.arange(H)[None, :] // (H // Hk)).astype(np.int32).ravel())
        plan.kv, plan.kv_index = kv, kv.data.ptr       # the array, kept alive, and its address
        plan.left, plan.right = _band(causal)
        plan.scale = check_scale(scale, d)
        plan.io = _unused_counters(q.device.index).data.ptr
        # (Q, K, V, kv_index, O, L | Nq, Nk, left, right, scale·log2e, io)
        plan.fwd = _Launcher(kern, "6Q4if4xQ", K.grid(name, Nq, Nk, Br, Bc, B * H), threads, smem,
                             (Nq, Nk, plan.left, plan.right, plan.scale * math.log2(math.e),
                              plan.io))
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
    dev = q.device.index
    pre, main, post = bwd
    with plan.cp.cuda.Device(dev):
        stream = torch._C._cuda_getCurrentRawStream(dev)
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
        if smem > smem_limit():
            plan.bwd = False
            return False
        main = _kernel("flash2_bwd_tc", dtype, False, d)
        if smem > 48 * 1024:
            main.max_dynamic_shared_size_bytes = smem
        # (O, dO, D, dQacc | Nq, io)
        cc = _cc(q.device.index)
        pre = _Launcher(_kernel("flash2_bwd_preprocess_tc", dtype, False, d), "4Qi4xQ",
                        K.grid("flash2_bwd_preprocess_tc", Nq, Nk, Br, Bc, P),
                        K.threads("flash2_bwd_preprocess_tc", d, cc), 0, (Nq, plan.io))
        # (Q, K, V, kv_index, dO, L, D, dQacc, dK, dV | Nq, Nk, left, right, scale, sem, io)
        main = _Launcher(main, "10Q4if4xQQ", K.grid("flash2_bwd_tc", Nq, Nk, Br, Bc, P),
                         K.threads("flash2_bwd_tc", d, cc), smem,
                         (Nq, Nk, plan.left, plan.right, plan.scale, 0, plan.io))
        # (dQacc, dQ | Nq, d, Br, io)
        post = _Launcher(_kernel("flash2_bwd_postprocess", dtype, False), "2Q3i4xQ",
                         K.grid("flash2_bwd_postprocess", Nq, Nk, Br, Bc, P),
                         K.threads("flash2_bwd_postprocess", d, cc), 0, (Nq, d, Br, plan.io))
    plan.bwd = (pre, main, post)
    return plan.bwd


def _attention(q, k, v, *, causal, scale, block_sizes, count_io, kernel):
    cp = _cupy()
    qi, ki, vi = _In(q, "q"), _In(k, "k"), _In(v, "v")
    shape, Q, Kd, Vd, kv_index = _layout(qi, ki, vi)
    dtype = qi.dtype
    scale = check_scale(scale, shape.d)
    left, right = _band(causal)
    which = _choose(kernel, shape, dtype, block_sizes)
    P, Nq = shape.problems, shape.Nq
    O = _empty(cp, (P, Nq, shape.dv), _storage(cp, dtype), dtype if qi.torch else None)
    L = _empty(cp, (P, Nq), cp.float32, "float32" if qi.torch else None)
    io = _counters(cp, count_io)
    i32 = np.int32
    if which in ("tc", "wg"):    # one signature: (Q, K, V, kv_index, O, L, Nq, Nk, band, scale)
        if which == "wg":
            name, (Br, Bc) = "flash2_fwd_wg", K.WG_BLOCKS[shape.d]
        else:
            name, (Br, Bc) = "flash2_fwd_tc", _tc_tiles(shape.d, False)
        threads = K.threads(name, shape.d, _cc(cp.cuda.Device().id))
        smem = K.smem_bytes(name, Br, Bc, shape.d, shape.dv, dtype)
        _launch(cp, _kernel(name, dtype, count_io, shape.d),
                K.grid(name, Nq, shape.Nk, Br, Bc, P), smem, (Q, Kd, Vd, kv_index, O, L, i32(Nq), i32(shape.Nk), i32(left),
                       i32(right), np.float32(scale * math.log2(math.e)), io),
                threads=threads)
    else:
        Br, Bc = _blocks(block_sizes, shape, dtype, backward=False)
        smem = K.smem_bytes("flash2_fwd", Br, Bc, shape.d, shape.dv, dtype)
        _launch(cp, _kernel("flash2_fwd", dtype, count_io),
                K.grid("flash2_fwd", Nq, shape.Nk, Br, Bc, P), smem,
                (Q, Kd, Vd, kv_index, O, L, i32(Nq), i32(shape.Nk), i32(shape.d),
                 i32(shape.dv), i32(Br), i32(Bc), i32(left), i32(right),
                 _scalar(dtype, scale), io))
    out = _out(cp, O.reshape(shape.batch_shape + (Nq, shape.dv)), dtype, qi.torch)
    lse = _out(cp, L.reshape(shape.batch_shape + (Nq,)), "float32", qi.torch)
    return (out, lse, _traffic(cp, io)) if count_io else (out, lse)


# -- backward -----------------------------------------------------------------------------

def attention_backward(q, k, v, out, lse, dout, *, causal: bool = False, scale=None,
                       block_sizes=None, count_io: bool = False, kernel: str = "auto",
                       deterministic: bool = False):
    """FlashAttention-2 backward on the GPU: (dq, dk, dv) shaped like q, k, v, or
    (dq, dk, dv, traffic) with ``count_io=True``. lse is read as fp32. ``kernel`` as in
    `attention`: the tensor-core main loop ("tc": float16/bfloat16, d = dv ∈ {64, 128},
    tiles `block_sizes(q, v, backward=True)`) or the reference ("ref").

    dQ is summed over the K/V tiles with fp32 atomics, whose order varies from run to
    run, and so do the last bits of dq. ``deterministic=True`` makes the tiles add in a
    fixed order (each waits for the one before it), so dq is the same bits on every run,
    at some cost in speed; the bytes moved are the same."""
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"deterministic must be True or False, got {deterministic!r}")
    if not count_io and block_sizes is None and kernel in ("auto", "tc") and not deterministic:
        fast = _torch_backward(q, k, v, out, lse, dout, causal, scale)
        if fast is not None:
            return fast
    with _stream(q):
        return _attention_backward(q, k, v, out, lse, dout, causal=causal, scale=scale,
                                   block_sizes=block_sizes, count_io=count_io,
                                   kernel=kernel, deterministic=deterministic)


def _attention_backward(q, k, v, out, lse, dout, *, causal, scale, block_sizes, count_io,
                        kernel, deterministic):
    cp = _cupy()
    qi, ki, vi = _In(q, "q"), _In(k, "k"), _In(v, "v")
    shape, Q, Kd, Vd, kv_index = _layout(qi, ki, vi)
    dtype = qi.dtype
    oi, doi = _In(out, "out"), _In(dout, "dout")
    want = shape.batch_shape + (shape.Nq, shape.dv)
    for name, x in (("out", oi), ("dout", doi)):
        if x.shape != want:
            raise ValueError(f"{name} has shape {x.shape}, but q, k, v call for {want}")
        if x.dtype != dtype:
            raise TypeError(f"{name} must have q's dtype {dtype}, got {x.dtype}")
    li = _In(lse, "lse") if not isinstance(lse, np.ndarray) else None
    L = cp.asarray(np.asarray(lse, np.float32)) if li is None else li.arr
    if li is not None and li.dtype == "bfloat16":
        raise TypeError("lse must be float32 (or float16/float64), not bfloat16")
    if tuple(L.shape) != shape.batch_shape + (shape.Nq,):
        raise ValueError(f"lse has shape {tuple(L.shape)}, but q, k, v call for "
                         f"{shape.batch_shape + (shape.Nq,)}")
    L = cp.ascontiguousarray(L.astype(cp.float32, copy=False)).reshape(-1, shape.Nq)
    scale = check_scale(scale, shape.d)
    left, right = _band(causal)
    which = _choose(kernel, shape, dtype, block_sizes, backward=True)
    if which == "tc":
        Br, Bc = _tc_tiles(shape.d, True)
    else:
        Br, Bc = _blocks(block_sizes, shape, dtype, backward=True)
    P, Nq, Nk, d, dv = shape.problems, shape.Nq, shape.Nk, shape.d, shape.dv
    O = oi.arr.reshape(P, Nq, dv)
    dO = doi.arr.reshape(P, Nq, dv)
    st = _storage(cp, dtype)
    D = _empty(cp, (P, Nq), cp.float32)
    dQacc = _empty(cp, (P, Nq, d), cp.float32)
    dQ = _empty(cp, (P, Nq, d), st)
    dK = _empty(cp, (P, Nk, d), st)
    dV = _empty(cp, (P, Nk, dv), st)
    io = _counters(cp, count_io)
    Tr = -(-Nq // Br)
    i32 = np.int32
    # one turn counter per (problem, Q tile of Br rows); a null pointer: unordered atomics
    sem = cp.zeros(P * Tr, dtype=cp.int32) if deterministic else np.uint64(0)
    cc = _cc(cp.cuda.Device().id)

    def grid(name):
        return K.grid(name, Nq, Nk, Br, Bc, P)

    if which == "tc":
        name = "flash2_bwd_preprocess_tc"
        _launch(cp, _kernel(name, dtype, count_io, d), grid(name), 0,
                (O, dO, D, dQacc, i32(Nq), io), threads=K.threads(name, d, cc))
    else:
        _launch(cp, _kernel("flash2_bwd_preprocess", dtype, count_io),
                grid("flash2_bwd_preprocess"), 0,
                (O, dO, D, dQacc, i32(Nq), i32(d), i32(dv), i32(Br), io))
    if which == "tc":
        smem = K.smem_bytes("flash2_bwd_tc", Br, Bc, d, dv, dtype)
        name = "flash2_bwd_tc_det" if deterministic else "flash2_bwd_tc"
        _launch(cp, _kernel(name, dtype, count_io, d), grid(name), smem,
                (Q, Kd, Vd, kv_index, dO, L, D, dQacc, dK, dV, i32(Nq), i32(Nk), i32(left),
                 i32(right), np.float32(scale), sem, io), threads=K.threads(name, d, cc))
    else:
        smem = K.smem_bytes("flash2_bwd_main", Br, Bc, d, dv, dtype)
        _launch(cp, _kernel("flash2_bwd_main", dtype, count_io), grid("flash2_bwd_main"), smem,
                (Q, Kd, Vd, kv_index, dO, L, D, dQacc, dK, dV, i32(Nq), i32(Nk), i32(d),
                 i32(dv), i32(Br), i32(Bc), i32(left), i32(right), _scalar(dtype, scale), sem,
                 io))
    _launch(cp, _kernel("flash2_bwd_postprocess", dtype, count_io),
            grid("flash2_bwd_postprocess"), 0,
            (dQacc, dQ, i32(Nq), i32(d), i32(Br), io))
    dq = _reduce(cp, dQ, shape, qi.shape, Nq, d, dtype)
    dk = _reduce(cp, dK, shape, ki.shape, Nk, d, dtype)
    dv_ = _reduce(cp, dV, shape, vi.shape, Nk, dv, dtype)
    res = tuple(_out(cp, x, dtype, qi.torch) for x in (dq, dk, dv_))
    return res + (_traffic(cp, io),) if count_io else res


def _reduce(cp, g, shape: Shape, target: tuple, N: int, w: int, dtype: str):
    """Per-query-problem gradients → the input's shape: sum over GQA groups and
    broadcast axes in fp32 (fp64 for float64), then round once."""
    full = g.reshape(canon_batch(shape) + (N, w))
    lead = target[:-2]
    n = max(len(shape.batch_shape), 1)
    pad = (1,) * (n - len(lead)) + lead
    # the canonical layout of the target: batch axes, then (heads/g, g) or (hk, 1)
    if len(pad) and pad[-1] == full.shape[-4] * full.shape[-3]:
        tgt = pad[:-1] + (full.shape[-4], full.shape[-3])
    else:
        tgt = pad[:-1] + (pad[-1], 1)
    axes = tuple(a for a, (t, f) in enumerate(zip(tgt, full.shape[:-2])) if t == 1 and f != 1)
    if not axes:
        return g.reshape(target)
    summed = _to_f32(cp, full, dtype).sum(axis=axes, keepdims=True)
    return _from_f32(cp, summed, dtype).reshape(target)
