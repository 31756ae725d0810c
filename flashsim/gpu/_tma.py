"""Tensor maps for the Hopper kernels fed by the copy engine (kernels_cu/flash2_ws.cu).

A TMA load copies a box of a tensor that a tensor map (CUtensorMap, 128 bytes) describes:
its address, up to five dimensions with their byte strides, the box and the swizzle the
copy writes into shared memory. The kernels read each of Q, K, V (and the backward dO) through a row
table (element offset of row 0 per problem, rows ``ld`` elements apart); here that table
becomes a 3-D map per tensor, (columns, rows, problems) = (ld, N, Z), and per problem a
column and a problem coordinate of its row 0:

    at[p] = z_p · zs + c_p,   0 ≤ c_p ≤ ld − d,

with zs the greatest common divisor of the offsets' row parts. Rows past N of a problem
lie outside the map, so the copy engine zero-fills a ragged last tile as the accounting
rules assume. A head dim w below the instance's D (d of Q and K, dv of V) makes the map
(w, N, Z) instead, every problem's offset a multiple z_p of zs = gcd(at) (c_p = 0): the
boxes' columns past w lie outside it too, and arrive as zeros, which is what the kernels'
instance of D needs of them (the cp.async kernels zero them on chip). Layouts that do
not decompose so (or whose strides TMA cannot take: a multiple of 16 bytes) return None,
and the launcher runs flash2_wg.cu's kernels, which copy with cp.async. The maps are
encoded on the host by the driver's cuTensorMapEncodeTiled, through ctypes (CuPy does
not wrap it)."""

from __future__ import annotations

import ctypes
import functools

import numpy as np

from . import _arrays as arrays, _device as dev

# CUtensorMapDataType: 16-bit elements copied as bits (float16 and bfloat16 alike; the
# zero fill is +0.0 in both); CU_TENSOR_MAP_SWIZZLE_64B and _128B;
# CU_TENSOR_MAP_L2_PROMOTION_L2_128B
_UINT16, _SWIZZLE_64B, _SWIZZLE_128B, _L2_128B = 1, 2, 3, 2


def box_cols(D: int) -> int:
    """Columns per box for an instance of head dim D: one column block of the kernels'
    shared layout (wgmma.cuh's Cols<D>), 64 (128 bytes, the 128-byte swizzle) where 64
    divides D (but 192), else 32 (64 bytes, the 64-byte swizzle)."""
    return 64 if D % 64 == 0 and D != 192 else 32


@functools.lru_cache(maxsize=None)
def _encode():
    lib = ctypes.CDLL("libcuda.so.1")
    f = lib.cuTensorMapEncodeTiled
    u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
    f.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p,
                  u32p, u32p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    f.restype = ctypes.c_int
    return f


FORWARD = (arrays.AT_Q, arrays.AT_K, arrays.AT_V, arrays.AT_O)   # flash2_fwd_ws's maps
BACKWARD = (arrays.AT_Q, arrays.AT_K, arrays.AT_V, arrays.AT_dO)  # flash2_bwd_ws's


def layout(tab: np.ndarray, ld, N: dict, d: int, cols=FORWARD, D: int | None = None,
           widths: dict | None = None):
    """(crd, geoms) for the columns ``cols`` (Q, K, V by default) of the host row table
    ``tab`` (problems × AT_NUM) with row strides ``ld`` and row counts ``N`` (per column),
    read by an instance of head dim ``D`` (default d) whose tensors hold ``widths[t]``
    columns (default d): crd the int32 (problems, 2·len(cols)) table (c, z of each
    column), geoms per column (w, ld, N, Z, zs) in elements, w the map's columns (ld, or
    the tensor's width where that is below D); or None where a tensor does not decompose
    as above."""
    D = d if D is None else D
    crd = np.zeros((tab.shape[0], 2 * len(cols)), np.int32)
    geoms = []
    for n, t in enumerate(cols):
        off, l = tab[:, t], int(ld[t])
        w = d if widths is None else widths.get(t, d)
        if l % 8:                               # row stride: a multiple of 16 bytes
            return None
        c = off % l if w == D else np.zeros_like(off)
        if (c > l - w).any():
            return None
        row = off - c
        zs = int(np.gcd.reduce(row)) or N[t] * l
        if zs % 8 or zs * 2 >= 1 << 40:
            return None
        z = row // zs
        if z.max() >= 1 << 31:
            return None
        crd[:, 2 * n], crd[:, 2 * n + 1] = c, z
        geoms.append((l if w == D else w, l, N[t], int(z.max()) + 1, zs))
    return crd, tuple(geoms)


@functools.lru_cache(maxsize=256)
def plan(table_key: tuple, ld: tuple, N: tuple, d: int, device: int, D: int | None = None,
         widths: tuple = ()):
    """(crd on the device, geoms) for the row table of ``table_key`` (_arrays.table_key),
    cached, with ``N`` the (column, rows) of each map in order, an instance of head dim
    ``D`` (default d) and ``widths`` the (column, width) pairs that differ from d; None
    where `layout` finds no tensor maps for it."""
    got = layout(arrays.host_table(*table_key), ld, dict(N), d, tuple(t for t, _ in N), D,
                 dict(widths))
    if got is None:
        return None
    crd, geoms = got
    return dev.cupy().asarray(crd.reshape(-1)), geoms


@functools.lru_cache(maxsize=1024)
def tensor_map(ptr: int, geom: tuple, box_rows: int, cols: int = 64) -> bytes | None:
    """The 128-byte CUtensorMap of a tensor at ``ptr`` (16-byte aligned) with this
    geometry (w, ld, N, Z, zs), boxes of ``cols`` columns × box_rows rows, in the swizzle
    of that width (64: 128 bytes, 32: 64 bytes); None where the driver refuses it."""
    w, ld, N, Z, zs = geom
    return _encode_3d(ptr, _UINT16, (w, N, Z), (ld * 2, zs * 2), (cols, box_rows),
                      _SWIZZLE_128B if cols == 64 else _SWIZZLE_64B)


def _encode_3d(ptr: int, dtype: int, dims, strides, box, swizzle: int) -> bytes | None:
    """A 3-D CUtensorMap (128 bytes) of elements ``dtype`` at ``ptr``: ``dims`` in
    elements, ``strides`` of dims 1 and 2 in bytes, boxes of box[0] × box[1] × 1; None
    where the address is not 16-byte aligned or the driver refuses it."""
    if ptr % 16:
        return None
    raw = ctypes.create_string_buffer(128 + 64)          # CUtensorMap is 64-byte aligned
    addr = (ctypes.addressof(raw) + 63) & ~63
    rc = _encode()(addr, dtype, 3, ptr, (ctypes.c_uint64 * 3)(*dims),
                   (ctypes.c_uint64 * 2)(*strides), (ctypes.c_uint32 * 3)(*box, 1),
                   (ctypes.c_uint32 * 3)(1, 1, 1), 0, swizzle, _L2_128B, 0)
    if rc != 0:
        return None
    return ctypes.string_at(addr, 128)


def maps(ptrs, geoms, rows: tuple, D: int):
    """The tensor maps of the tensors at ``ptrs`` (boxes of ``rows`` rows each: Br for Q,
    Bc for K and V in the forward) for the instance of head dim D, or None."""
    out = tuple(tensor_map(int(x), g, r, box_cols(D))
                for x, g, r in zip(ptrs, geoms, rows))
    return None if None in out else out

