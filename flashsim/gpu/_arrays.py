"""Inputs and outputs of flashsim.gpu: device arrays from NumPy, CuPy or PyTorch, the
per-problem layout the kernels read, PyTorch's stream, and the GQA/broadcast sums of
the gradients."""

from __future__ import annotations

import contextlib
import functools
import math
import weakref

import numpy as np

from .. import kernels as K
from ..problem import canon_batch, resolve_batch, Shape
from . import _device as dev

# -- inputs and outputs -----------------------------------------------------------------

class In:
    """A device array plus how to hand results back (CuPy, or PyTorch)."""

    def __init__(self, x, name: str):
        cp = dev.cupy()
        self.torch = type(x).__module__.split(".")[0] == "torch"
        if self.torch:
            if dev.is_emulated():
                x = x.detach().cpu()
            elif x.device.type != "cuda":
                x = x.cuda()
            x = x.contiguous()
            self.dtype = str(x.dtype).replace("torch.", "")
            if self.dtype in K.CUDA_TYPES:
                # a CuPy view of the tensor's memory, no copy: DLPack's exchange costs
                # tens of microseconds of Python per tensor, a pointer costs none. The
                # launches run on torch's current stream (stream), so no sync is needed.
                self.arr = view(cp, x, np.int16 if self.dtype == "bfloat16"
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
        if dev.pointer(self.arr) % 16:
            # a view starting mid-row: the kernels read 16 bytes at a time, so give them
            # a fresh (256-byte aligned) copy rather than a misaligned address
            self.arr = self.arr.copy()
        if self.arr.ndim < 2:
            raise ValueError(f"{name} must have at least 2 dimensions (..., N, d), got shape "
                             f"{tuple(self.arr.shape)}")

    @property
    def shape(self):
        return tuple(self.arr.shape)


def view(cp, t, dtype):
    """A CuPy array over a contiguous CUDA tensor's memory (the tensor stays alive as its
    owner)."""
    if t.numel() == 0:
        return cp.empty(tuple(t.shape), dtype=dtype)
    if dev.is_emulated():                  # a NumPy view of the CPU tensor
        import torch
        return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()
    mem = cp.cuda.UnownedMemory(t.data_ptr(), t.numel() * t.element_size(), t,
                                t.device.index)
    return cp.ndarray(tuple(t.shape), dtype=dtype, memptr=cp.cuda.MemoryPointer(mem, 0))


def stream(x):
    """Run on PyTorch's current stream when the inputs are tensors, so our kernels are
    ordered with the user's PyTorch work; otherwise on CuPy's current stream."""
    if type(x).__module__.split(".")[0] != "torch" or dev.is_emulated():
        return contextlib.nullcontext()
    import torch
    index = x.device.index if x.device.type == "cuda" else torch.cuda.current_device()
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)   # the fast path, ~1 µs
    ptr = raw(index) if raw is not None else torch.cuda.current_stream(index).cuda_stream
    cp = dev.cupy()
    if hasattr(cp.cuda.Stream, "from_external"):                 # CuPy ≥ 14
        return cp.cuda.Stream.from_external(StreamHandle(ptr))
    return cp.cuda.ExternalStream(ptr, index)


class StreamHandle:
    """A raw CUDA stream in the CUDA stream protocol (what Stream.from_external reads)."""

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


def storage(cp, dtype: str):
    # bfloat16 travels as its 16 bits in an int16 array
    return cp.int16 if dtype == "bfloat16" else getattr(cp, dtype)


# PyTorch tensors behind CuPy views made by empty(torch_dtype=...), by data pointer, so
# out hands the tensor itself back (DLPack costs ~20 µs of Python per output)
TORCH_OUTPUTS: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()


def empty(cp, shape, dtype, torch_dtype: str | None = None):
    """Output allocation: a CuPy array, or with ``torch_dtype`` a CuPy view of a new
    PyTorch tensor (the caller passed tensors). The GPU tests wrap it with a poisoning
    one to prove that every element is written."""
    if torch_dtype is None or math.prod(shape) == 0:
        return cp.empty(shape, dtype=dtype)
    import torch
    t = torch.empty(shape, dtype=getattr(torch, torch_dtype),
                    device="cpu" if dev.is_emulated() else f"cuda:{cp.cuda.Device().id}")
    arr = view(cp, t, np.dtype(dtype))
    TORCH_OUTPUTS[dev.pointer(arr)] = t
    return arr


def out(cp, arr, dtype: str, as_torch: bool):
    if not as_torch:
        return arr
    t = TORCH_OUTPUTS.get(dev.pointer(arr)) if arr.size else None
    if t is not None and t.numel() == arr.size:
        return t.view(tuple(arr.shape))
    import torch
    t = torch.from_dlpack(arr)
    return t.view(torch.bfloat16) if dtype == "bfloat16" else t


def to_f32(cp, arr, dtype: str):
    if dtype == "bfloat16":
        return (arr.view(cp.uint16).astype(cp.uint32) << 16).view(cp.float32)
    return arr.astype(cp.float64 if dtype == "float64" else cp.float32)


def from_f32(cp, x, dtype: str):
    if dtype == "bfloat16":  # round to nearest even on the top 16 bits
        u = x.astype(cp.float32).view(cp.uint32)
        u = (u + cp.uint32(0x7FFF) + ((u >> 16) & cp.uint32(1))) >> 16
        return u.astype(cp.uint16).view(cp.int16)
    return x.astype(storage(cp, dtype))


def layout(q: In, k: In, v: In):
    """Shape, per-problem Q (P, Nq, d), K/V (Pk, Nk, ·) and kv_index (P,) int32."""
    cp = dev.cupy()
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
            kv_index(kb_pad, canon_batch(shape), cp.cuda.Device().id))


@functools.lru_cache(maxsize=256)
def kv_index(kb_pad: tuple, canon: tuple, device: int):
    """kv_index[p]: the K/V problem of query problem p (GQA groups, broadcast batch axes);
    cached on the device so repeated calls copy nothing."""
    cp = dev.cupy()
    Pk = math.prod(kb_pad)
    idx = np.broadcast_to(np.arange(Pk, dtype=np.int32).reshape(kb_pad)[..., None], canon)
    return cp.asarray(np.ascontiguousarray(idx).reshape(-1))


def band(causal: bool) -> tuple[int, int]:
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    return (-1, 0) if causal else (-1, -1)


def reduce(cp, g, shape: Shape, target: tuple, N: int, w: int, dtype: str):
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
    summed = to_f32(cp, full, dtype).sum(axis=axes, keepdims=True)
    return from_f32(cp, summed, dtype).reshape(target)
