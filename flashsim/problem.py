"""Shapes, dtypes and option checks shared by `simulate` and `count`.

Layout: q (..., Nq, d), k (..., Nk, d), v (..., Nk, dv). Leading axes broadcast like
NumPy's, except the last one (heads): the K/V head count hk may divide the query
head count hq (GQA/MQA), query heads mapping to K/V heads in contiguous groups of
g = hq / hk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

ALGORITHMS = ("standard", "flash1", "flash2", "splitkv", "square", "ring")
FLASH_ALGORITHMS = ("flash1", "flash2")

# Row statistics m, ℓ, L are fp32 in every real kernel, whatever the I/O type.
STAT_BYTES = 4

_DTYPE_ALIASES = {
    "fp16": 2, "half": 2, "float16": 2, "f2": 2,
    "bf16": 2, "bfloat16": 2,
    "fp32": 4, "float": 4, "float32": 4, "f4": 4, "single": 4,
    "fp64": 8, "double": 8, "float64": 8, "f8": 8,
    "fp8": 1, "float8": 1, "float8_e4m3": 1, "float8_e5m2": 1, "e4m3": 1, "e5m2": 1,
}


def itemsize_of(io_dtype) -> int:
    """Bytes per element of an I/O type: a NumPy dtype, a name such as "bfloat16", or
    any object with an integer ``itemsize`` (e.g. a torch dtype)."""
    if isinstance(io_dtype, str):
        key = io_dtype.strip().lower().replace("torch.", "").replace("numpy.", "")
        if key in _DTYPE_ALIASES:
            return _DTYPE_ALIASES[key]
    size = getattr(io_dtype, "itemsize", None)
    if isinstance(size, (int, np.integer)) and not isinstance(size, bool) and size > 0:
        if isinstance(io_dtype, np.dtype) and io_dtype.kind != "f":
            raise TypeError(f"io_dtype must be a floating type, got {io_dtype}")
        return int(size)
    try:
        dt = np.dtype(io_dtype)
    except TypeError:
        dt = None
    if dt is not None and dt.kind == "f":
        return dt.itemsize
    raise TypeError(
        f"io_dtype {io_dtype!r} is not a floating type; use one of "
        "'float16', 'bfloat16', 'float32', 'float64', 'float8' or a NumPy float dtype")


def check_algorithm(algorithm, allowed=ALGORITHMS) -> str:
    if algorithm not in allowed:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {', '.join(allowed)}")
    return algorithm


def check_size(name: str, value, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def check_scale(scale, d: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(d)
    try:
        s = float(scale)
    except (TypeError, ValueError):
        raise TypeError(f"scale must be a real number, got {scale!r}") from None
    if not math.isfinite(s):
        raise ValueError(f"scale must be finite, got {scale!r}")
    return s


def check_options(algorithm: str, *, num_splits=None, cluster=False) -> dict:
    """Algorithm-specific options: only splitkv takes ``num_splits`` and ``cluster`` (its
    parts merging in a thread block cluster, `flashsim.splitkv`)."""
    if not isinstance(cluster, (bool, np.bool_)):
        raise TypeError(f"cluster must be True or False, got {cluster!r}")
    if algorithm == "splitkv":
        if num_splits is None:
            raise ValueError("splitkv needs num_splits (the number of K/V splits per Q tile)")
        return {"num_splits": check_size("num_splits", num_splits, 1), "cluster": bool(cluster)}
    if num_splits is not None:
        raise ValueError(f"num_splits applies to algorithm='splitkv', not {algorithm!r}")
    if cluster:
        raise ValueError(f"cluster applies to algorithm='splitkv', not {algorithm!r}")
    return {}


@dataclass(frozen=True)
class Shape:
    """One attention problem's sizes, without arrays.

    ``batch_shape`` is the output's leading shape; ``problems`` = prod(batch_shape) is
    the number of independent (batch, query-head) attention problems that traffic is
    summed over.
    """
    Nq: int
    Nk: int
    d: int
    dv: int
    batch_shape: tuple
    q_batch_shape: tuple
    kv_batch_shape: tuple
    groups: int  # g: query heads per K/V head (1 unless GQA/MQA)

    @property
    def problems(self) -> int:
        return math.prod(self.batch_shape)


def resolve_batch(q_batch: tuple, kv_batch: tuple) -> tuple[tuple, int]:
    """Output leading shape and GQA group size g for leading shapes of q and k/v."""
    if len(q_batch) == 0 and len(kv_batch) == 0:
        return (), 1
    n = max(len(q_batch), len(kv_batch), 1)
    qb = (1,) * (n - len(q_batch)) + tuple(q_batch)
    kb = (1,) * (n - len(kv_batch)) + tuple(kv_batch)
    hq, hk = qb[-1], kb[-1]
    if hq == hk:
        heads, g = hq, 1
    elif hk >= 1 and hq % hk == 0:
        heads, g = hq, hq // hk
    elif hq == 1:
        heads, g = hk, 1
    else:
        raise ValueError(
            f"the K/V head axis has {hk} heads, which does not divide the {hq} query heads; "
            "for GQA/MQA the number of K/V heads must divide the number of query heads "
            "(the head axis is the last leading axis, just before N)")
    try:
        rest = np.broadcast_shapes(qb[:-1], kb[:-1])
    except ValueError:
        raise ValueError(
            f"leading (batch) axes of q {tuple(q_batch)} and k/v {tuple(kv_batch)} do not "
            "broadcast; make them equal or 1") from None
    return tuple(int(x) for x in rest) + (int(heads),), g


def make_shape(*, Nq, Nk, d, dv=None, batch_shape=(), kv_batch_shape=None) -> Shape:
    Nq = check_size("Nq", Nq)
    Nk = check_size("Nk", Nk)
    d = check_size("d", d, 1)
    dv = d if dv is None else check_size("dv", dv, 1)
    qb = tuple(check_size("batch_shape entry", x, 1) for x in batch_shape)
    kb = qb if kv_batch_shape is None else tuple(
        check_size("kv_batch_shape entry", x, 1) for x in kv_batch_shape)
    out, g = resolve_batch(qb, kb)
    return Shape(Nq, Nk, d, dv, out, qb, kb, g)


def _check_array(name: str, x) -> np.ndarray:
    if not isinstance(x, np.ndarray):
        if hasattr(x, "__cuda_array_interface__") or type(x).__module__.startswith("cupy"):
            raise TypeError(f"{name} is a GPU array; the simulator runs on NumPy arrays "
                            f"(use {name}.get() or cupy.asnumpy({name}))")
        x = np.asarray(x)
    if x.dtype.kind != "f":
        raise TypeError(f"{name} must be a floating-point array (float16, float32 or float64), "
                        f"got dtype {x.dtype}; convert it with {name}.astype(np.float32)")
    if x.ndim < 2:
        raise ValueError(f"{name} must have at least 2 dimensions (..., N, d), got shape {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError(f"{name} contains NaN or Inf; attention inputs must be finite")
    return x


def check_arrays(q, k, v) -> tuple[np.ndarray, np.ndarray, np.ndarray, Shape]:
    q, k, v = _check_array("q", q), _check_array("k", k), _check_array("v", v)
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must share the head dim d: q has d={q.shape[-1]}, "
                         f"k has d={k.shape[-1]}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"k and v must have the same number of keys Nk: k has "
                         f"{k.shape[-2]}, v has {v.shape[-2]}")
    if q.shape[-1] < 1 or v.shape[-1] < 1:
        raise ValueError(f"head dims must be >= 1, got d={q.shape[-1]}, dv={v.shape[-1]}")
    try:
        kv_batch = np.broadcast_shapes(k.shape[:-2], v.shape[:-2])
    except ValueError:
        raise ValueError(f"leading axes of k {k.shape[:-2]} and v {v.shape[:-2]} do not "
                         "broadcast; make them equal") from None
    out, g = resolve_batch(q.shape[:-2], tuple(kv_batch))
    shape = Shape(q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1], out,
                  tuple(q.shape[:-2]), tuple(kv_batch), g)
    return q, k, v, shape


def canonical(q, k, v, shape: Shape):
    """float64 views shaped (..., hk, g, N, ·) so that one matmul covers every head.

    K/V get a singleton group axis and broadcast over the g query heads that share them;
    nothing of size Nq × Nk is ever formed here.
    """
    n = max(len(shape.batch_shape), 1)

    def pad(x):
        lead = x.shape[:-2]
        return x.reshape((1,) * (n - len(lead)) + lead + x.shape[-2:])

    q64 = pad(np.asarray(q, dtype=np.float64))
    k64 = pad(np.asarray(k, dtype=np.float64))
    v64 = pad(np.asarray(v, dtype=np.float64))
    g = shape.groups
    hq = q64.shape[-3]
    Q = q64.reshape(q64.shape[:-3] + (hq // g, g) + q64.shape[-2:])
    K = k64[..., None, :, :]
    V = v64[..., None, :, :]
    return Q, K, V


def canon_batch(shape: Shape) -> tuple:
    """Leading shape of the canonical arrays: batch axes, then (hk, g)."""
    if not shape.batch_shape:
        return (1, 1)
    *rest, h = shape.batch_shape
    g = shape.groups
    return tuple(rest) + (h // g, g)


def restore(x: np.ndarray, shape: Shape, trailing: tuple) -> np.ndarray:
    """Undo `canonical`'s (hk, g) split: back to batch_shape + trailing."""
    return x.reshape(shape.batch_shape + trailing)
