"""Inputs and outputs of flashsim.gpu: device arrays from NumPy, CuPy or PyTorch, read
through their strides where the kernels can (no copies of (B, N, H, d) or packed
layouts), the per-problem row table the flash2 kernels read, PyTorch's stream, and the
GQA/broadcast sums of the gradients."""

from __future__ import annotations

import contextlib
import functools
import math
import weakref

import numpy as np

from .. import kernels as K
from ..problem import canon_batch, resolve_batch, Shape
from . import _device as dev


def host_values(x):
    """A small array's values on the host, for checks and tables made before any launch
    (cu_seqlens, cache lengths, block tables, ALiBi slopes): NumPy and lists as they are,
    CuPy arrays and PyTorch tensors (on a GPU or not) copied to NumPy."""
    if type(x).__module__.split(".")[0] == "torch":
        x = x.detach().cpu()
        return (x.float() if str(x.dtype) == "torch.bfloat16" else x).numpy()
    if hasattr(x, "__cuda_array_interface__") and not isinstance(x, np.ndarray):
        return dev.cupy().asnumpy(x)
    return x


# -- inputs and outputs -----------------------------------------------------------------

class In:
    """A device array plus how to hand results back (CuPy, or PyTorch). The array keeps
    the caller's strides where the kernels can read them (`readable`); otherwise it is a
    dense copy."""

    def __init__(self, x, name: str):
        cp = dev.cupy()
        self.torch = type(x).__module__.split(".")[0] == "torch"
        self.tensor = None
        if self.torch:
            if dev.is_emulated():
                x = x.detach().cpu()
            elif x.device.type != "cuda":
                x = x.cuda()
            if x.dim() == 0 or (x.shape[-1] > 1 and x.stride(-1) != 1):
                x = x.contiguous()
            self.tensor = x
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
            self.arr = arr
        if self.dtype not in K.CUDA_TYPES:
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got "
                            f"{self.dtype}")
        if not readable(self.arr):
            self.arr = cp.ascontiguousarray(self.arr)
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

    def dense(self) -> "In":
        """For kernels without a row table (decoding, flash1, standard, square): the
        array C-contiguous (one copy where it is not)."""
        self.arr = dev.cupy().ascontiguousarray(self.arr)
        return self


def view(cp, t, dtype):
    """A CuPy array over a CUDA tensor's memory, with its strides (the tensor stays alive
    as its owner)."""
    if t.numel() == 0:
        return cp.empty(tuple(t.shape), dtype=dtype)
    if dev.is_emulated():                  # a NumPy view of the CPU tensor
        import torch
        return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()
    size = t.element_size()
    span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))   # elements reached
    mem = cp.cuda.UnownedMemory(t.data_ptr(), span * size, t, t.device.index)
    return cp.ndarray(tuple(t.shape), dtype=dtype, memptr=cp.cuda.MemoryPointer(mem, 0),
                      strides=tuple(st * size for st in t.stride()))


# the kernels multiply a row index by a row stride in 32 bits inside a tile
_LD_MAX = 1 << 24


def readable(arr) -> bool:
    """The kernels read ``arr`` through its strides: the last axis contiguous, no
    negative strides, rows fewer than 2^24 elements apart, and for 16-bit types every
    stride a multiple of 8 elements (16 bytes: the tensor-core rungs' loads). A dense
    array always is, whatever its head dim (odd head dims run on the reference rung,
    which reads elements)."""
    if arr.ndim < 2 or arr.size == 0 or arr.flags.c_contiguous:
        return True
    item = arr.itemsize
    if arr.shape[-1] > 1 and arr.strides[-1] != item:
        return False
    for n, st in zip(arr.shape[:-1], arr.strides[:-1]):
        if n > 1 and (st < 0 or st % item or (item == 2 and (st // item) % 8)):
            return False
    return arr.shape[-2] <= 1 or arr.strides[-2] // item < _LD_MAX


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


def empty(cp, shape, dtype, torch_dtype: str | None = None, like: "In | None" = None):
    """Output allocation: a CuPy array, or with ``torch_dtype`` a CuPy view of a new
    PyTorch tensor (the caller passed tensors). With ``like`` (an input of the same
    leading shape), laid out as it is: its axes in the order of its strides, dense, so
    an output of (B, N, H, d) inputs read as (B, H, N, d) is (B, N, H, d) in memory, as
    `torch.empty_like` makes it. The GPU tests wrap it with a poisoning one to prove that
    every element is written."""
    shape = tuple(shape)
    if like is not None and like.tensor is not None and torch_dtype is not None \
            and tuple(like.tensor.shape) == shape and math.prod(shape):
        import torch
        t = torch.empty_like(like.tensor)          # PyTorch's own rule (and its fakes')
        arr = view(cp, t, np.dtype(dtype))
        TORCH_OUTPUTS[dev.pointer(arr)] = t
        return arr
    order = None
    if like is not None and like.shape[:-1] == shape[:-1]:
        order = _order(like.tensor.stride() if like.tensor is not None else
                       tuple(st // like.arr.itemsize for st in like.arr.strides))
    dense = shape if order is None else tuple(shape[a] for a in order) + shape[-1:]
    if torch_dtype is None or math.prod(shape) == 0:
        arr = cp.empty(dense, dtype=dtype)
    else:
        import torch
        t = torch.empty(dense, dtype=getattr(torch, torch_dtype),
                        device="cpu" if dev.is_emulated() else f"cuda:{cp.cuda.Device().id}")
        arr = view(cp, t, np.dtype(dtype))
        TORCH_OUTPUTS[dev.pointer(arr)] = t
    if order is None:
        return arr
    return arr.transpose(tuple(np.argsort(order)) + (len(shape) - 1,))


def laid_out(cp, x, like: "In"):
    """``x`` (a gradient summed over groups or broadcast axes) in an output laid out as
    ``like`` is, as `empty` lays outputs out: one copy, so that every gradient has its
    input's layout (PyTorch's fakes promise `torch.empty_like`)."""
    y = empty(cp, x.shape, x.dtype, like.dtype if like.torch else None, like=like)
    y[...] = x
    return y


def _order(strides) -> tuple | None:
    """The leading axes from the largest stride to the smallest (the first among equals
    first), or None when that is their order already (flashsim.torch's fakes make
    their outputs by the same rule)."""
    lead = len(strides) - 1
    order = tuple(sorted(range(lead), key=lambda a: -strides[a]))
    return None if order == tuple(range(lead)) else order


def out(cp, arr, dtype: str, as_torch: bool):
    if not as_torch:
        # bfloat16 arrays came in as CuPy's own bfloat16 (CuPy 14 on, through ml_dtypes):
        # the result goes back in that dtype, not as the int16 bits the kernels wrote
        return arr.view(np.dtype("bfloat16")) if dtype == "bfloat16" and arr.dtype == np.int16 else arr
    t = TORCH_OUTPUTS.get(dev.pointer(arr)) if arr.size else None
    if t is not None and t.numel() == arr.size:
        item = arr.itemsize
        strides = tuple(st // item for st in arr.strides)
        if tuple(t.shape) == tuple(arr.shape) and tuple(t.stride()) == strides:
            return t
        return t.as_strided(tuple(arr.shape), strides)
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


def shape_of(q: In, k: In, v: In) -> Shape:
    """The problem's Shape, with the checks every kernel needs."""
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
    return shape


def layout(q: In, k: In, v: In):
    """Shape, dense per-problem Q (P, Nq, d), K/V (Pk, Nk, ·) and kv_index (P,) int32:
    what the kernels without a row table read (flash1, standard, square)."""
    cp = dev.cupy()
    shape = shape_of(q, k, v)
    batch = shape.batch_shape
    P = shape.problems
    Q = cp.ascontiguousarray(q.arr)
    if q.shape[:-2] != batch:   # q broadcast over a batch or head axis: materialise it
        Q = cp.ascontiguousarray(cp.broadcast_to(Q, batch + q.shape[-2:]))
    Q = Q.reshape(P, shape.Nq, shape.d)
    kb = k.shape[:-2]
    Pk = math.prod(kb)
    return (shape, Q, cp.ascontiguousarray(k.arr).reshape(Pk, shape.Nk, shape.d),
            cp.ascontiguousarray(v.arr).reshape(Pk, shape.Nk, shape.dv),
            kv_index(_kb_pad(shape), canon_batch(shape), cp.cuda.Device().id))


def _kb_pad(shape: Shape) -> tuple:
    kb = shape.kv_batch_shape
    n = max(len(shape.batch_shape), 1)
    return (1,) * (n - len(kb)) + tuple(kb)


# -- the flash2 kernels' row table (kernels_cu/common.cuh: at, ld) -----------------------
AT_Q, AT_K, AT_V, AT_O, AT_dO, AT_dQ, AT_dK, AT_dV, AT_NUM = range(9)


def rows(cp, shape: Shape, cols: dict, host: bool = False) -> tuple:
    """(at, ld) for the flash2 kernels: ``cols`` maps a column (AT_Q …) to (array, side),
    side "q" for arrays over the query problems (batch_shape, or broadcast to it), "k"
    for K/V arrays (read by each query problem of their group), "p" for (problems, N, ·)
    scratch. at is the device table (problems × AT_NUM int64 element offsets of row 0;
    cached per shapes and strides; ``host``: the NumPy table instead), ld the row strides
    in elements (np.int32 per column, 0 for columns not given)."""
    args = table_key(shape, cols)
    at = host_table(*args) if host else _table(*args, cp.cuda.Device().id)
    ld = [np.int32(0)] * AT_NUM
    for t, (a, _) in cols.items():
        ld[t] = np.int32(a.strides[-2] // a.itemsize if a.shape[-2] > 1 else a.shape[-1])
    return at, ld


def table_key(shape: Shape, cols: dict) -> tuple:
    """What the row table of these arrays depends on (host_table's arguments)."""
    key = tuple(sorted((t, tuple(a.shape), tuple(a.strides), a.itemsize, side)
                       for t, (a, side) in cols.items()))
    return shape.batch_shape, _kb_pad(shape), canon_batch(shape), key


@functools.lru_cache(maxsize=256)
def _table(batch: tuple, kb_pad: tuple, canon: tuple, cols: tuple, device: int):
    return dev.cupy().asarray(host_table(batch, kb_pad, canon, cols).reshape(-1))


@functools.lru_cache(maxsize=256)
def host_table(batch: tuple, kb_pad: tuple, canon: tuple, cols: tuple) -> np.ndarray:
    """The row table (problems × AT_NUM) on the host (read-only)."""
    P = math.prod(batch)
    tab = np.zeros((P, AT_NUM), np.int64)
    kvi = None
    for t, shp, strides, item, side in cols:
        lead, st = shp[:-2], [x // item for x in strides[:-2]]
        off = np.zeros(lead, np.int64)
        for a, (n, x) in enumerate(zip(lead, st)):
            off = off + (np.arange(n, dtype=np.int64) * x).reshape((n,) + (1,) * (len(lead) - a - 1))
        if side == "q":
            pad = (1,) * (len(batch) - len(lead)) + tuple(lead)
            tab[:, t] = np.broadcast_to(off.reshape(pad), batch).reshape(-1)
        elif side == "k":
            if kvi is None:
                kvi = np.broadcast_to(np.arange(math.prod(kb_pad)).reshape(kb_pad)[..., None],
                                      canon).reshape(-1)
            tab[:, t] = off.reshape(-1)[kvi]
        else:
            tab[:, t] = off.reshape(-1)
    tab.setflags(write=False)
    return tab


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
