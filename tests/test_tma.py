"""The Hopper kernels' tensor maps (flashsim/gpu/_tma.py): every layout the row table
describes is either decomposed exactly (at[p] = z_p·zs + c_p, the columns inside a row)
or refused, so flash2_fwd_ws and flash2_bwd_ws never read (nor, O, write) a row the
table does not name."""

import numpy as np
import pytest

import flashsim as fs
from flashsim.gpu import _arrays as A, _tma
from flashsim.problem import Shape


class Strided:
    """What the row table reads of an array: shape, strides (bytes), itemsize."""

    def __init__(self, shape, strides, item=2):
        self.shape, self.strides, self.itemsize = shape, tuple(x * item for x in strides), item


def table(q, k, shape):
    # O laid out as q is (flashsim allocates it so: _arrays.empty(like=q))
    cols = {A.AT_Q: (q, "q"), A.AT_K: (k, "k"), A.AT_V: (k, "k"), A.AT_O: (q, "q")}
    tab = A.host_table(*A.table_key(shape, cols))
    ld = [0] * A.AT_NUM
    for t, (a, _) in cols.items():
        ld[t] = a.strides[-2] // a.itemsize
    return tab, ld


def check_exact(tab, ld, got, d, cols=_tma.FORWARD, widths=None):
    """crd and geoms address each problem's rows exactly: element (row, col) of problem
    p at z_p·zs + c_p + row·ld + col, its columns inside the map (w: ld, or the width
    ``widths[t]`` of a tensor below the instance, whose maps hold only those columns)."""
    crd, geoms = got
    assert crd.shape == (tab.shape[0], 2 * len(cols)) and len(geoms) == len(cols)
    for n, t in enumerate(cols):
        w, l, N, Z, zs = geoms[n]
        c, z = crd[:, 2 * n].astype(np.int64), crd[:, 2 * n + 1].astype(np.int64)
        assert l == ld[t] and (z * zs + c == tab[:, t]).all()
        assert (c >= 0).all() and (c + d <= w).all() and (z < Z).all()
        if widths is not None:                     # a map exactly the tensor's columns wide
            assert w == widths[t] and (c == 0).all()
        else:
            assert w == l
        assert l % 8 == 0 and zs % 8 == 0          # TMA strides: multiples of 16 bytes


@pytest.mark.parametrize("layout", ["bhnd", "bnhd", "fused", "sliced"])
@pytest.mark.parametrize("B,H,Hk", [(1, 1, 1), (2, 4, 2), (3, 6, 1)])
def test_row_tables_decompose_into_tensor_map_coordinates(layout, B, H, Hk):
    N, d = 100, 128
    if layout == "bhnd":
        q = Strided((B, H, N, d), (H * N * d, N * d, d, 1))
        k = Strided((B, Hk, N, d), (Hk * N * d, N * d, d, 1))
    elif layout == "bnhd":                         # (B, N, H, d) seen as (B, H, N, d)
        q = Strided((B, H, N, d), (N * H * d, d, H * d, 1))
        k = Strided((B, Hk, N, d), (N * Hk * d, d, Hk * d, 1))
    elif layout == "fused":                        # slices of one (B, N, 3, H, d) tensor
        q = Strided((B, H, N, d), (N * 3 * H * d, d, 3 * H * d, 1))
        k = Strided((B, H, N, d), (N * 3 * H * d, d, 3 * H * d, 1))
        Hk = H
    else:                                          # the first N rows of longer sequences
        q = Strided((B, H, N, d), (H * 4 * N * d, 4 * N * d, d, 1))
        k = Strided((B, Hk, N, d), (Hk * 3 * N * d, 3 * N * d, d, 1))
    shape = Shape(N, N, d, d, (B, H), (B, H), (B, Hk), H // Hk)
    tab, ld = table(q, k, shape)
    got = _tma.layout(tab, ld, {A.AT_Q: N, A.AT_K: N, A.AT_V: N, A.AT_O: N}, d)
    assert got is not None
    check_exact(tab, ld, got, d)
    assert [g[2] for g in got[1]] == [N, N, N, N]  # rows past N: outside the map


@pytest.mark.parametrize("layout", ["bhnd", "bnhd", "fused", "sliced"])
@pytest.mark.parametrize("d,dv,D", [(80, 80, 96), (48, 48, 64), (112, 64, 128)])
def test_head_dims_below_the_instance_get_maps_as_wide_as_the_tensor(layout, d, dv, D):
    """Below the instance's D the maps are d (dv) columns wide, so that the copy engine
    zero-fills the boxes' columns past them (the kernels' instance needs zeros there,
    never the next head's or the next tensor's columns): every problem's offset a
    multiple of zs, the column coordinate 0."""
    B, H, Hk, N = 2, 4, 2, 100

    def arr(h, w):
        if layout == "bhnd":
            return Strided((B, h, N, w), (h * N * w, N * w, w, 1))
        if layout == "bnhd":
            return Strided((B, h, N, w), (N * h * w, w, h * w, 1))
        if layout == "fused":                      # one of 3 slices of a (B, N, 3, h, w) tensor
            return Strided((B, h, N, w), (N * 3 * h * w, w, 3 * h * w, 1))
        return Strided((B, h, N, w), (h * 4 * N * w, 4 * N * w, w, 1))

    q, k, v, o = arr(H, d), arr(Hk, d), arr(Hk, dv), arr(H, dv)
    shape = Shape(N, N, d, dv, (B, H), (B, H), (B, Hk), H // Hk)
    cols = {A.AT_Q: (q, "q"), A.AT_K: (k, "k"), A.AT_V: (v, "k"), A.AT_O: (o, "q")}
    tab = A.host_table(*A.table_key(shape, cols))
    ld = [0] * A.AT_NUM
    for t, (a, _) in cols.items():
        ld[t] = a.strides[-2] // a.itemsize
    widths = {A.AT_Q: d, A.AT_K: d, A.AT_V: dv, A.AT_O: dv}
    got = _tma.layout(tab, ld, {A.AT_Q: N, A.AT_K: N, A.AT_V: N, A.AT_O: N}, d, _tma.FORWARD, D,
                      {A.AT_V: dv, A.AT_O: dv})
    assert got is not None
    check_exact(tab, ld, got, 0, widths=widths)
    # at d = D the maps stay ld columns wide (heads side by side in a row: c_p ≠ 0)
    full = _tma.layout(tab, ld, {A.AT_Q: N, A.AT_K: N, A.AT_V: N, A.AT_O: N}, d)
    if dv == d:
        check_exact(tab, ld, full, d)


def test_layouts_tma_cannot_address_are_refused():
    N, d = 64, 128
    shape = Shape(N, N, d, d, (1, 2), (1, 2), (1, 2), 1)
    # rows 1028 elements apart: not a multiple of 16 bytes
    q = Strided((1, 2, N, d), (2 * N * 1028, N * 1028, 1028, 1))
    k = Strided((1, 2, N, d), (2 * N * d, N * d, d, 1))
    tab, ld = table(q, k, shape)
    assert _tma.layout(tab, ld, {A.AT_Q: N, A.AT_K: N, A.AT_V: N, A.AT_O: N}, d) is None
    # heads 72 elements apart inside rows of 144: a head's d columns cross the row's end
    q = Strided((1, 2, N, d), (N * 144, 72, 144, 1))
    tab, ld = table(q, k, shape)
    assert _tma.layout(tab, ld, {A.AT_Q: N, A.AT_K: N, A.AT_V: N, A.AT_O: N}, d) is None


def test_the_backward_maps_dO_beside_Q_K_V():
    """flash2_bwd_ws reads dO through a fourth map: its own strides (a (B, N, H, d)
    gradient beside (B, H, N, d) inputs), rows past Nq outside it, and its coordinates
    after Q's, K's and V's in each problem's row of crd."""
    B, H, Hk, Nq, Nk, d = 2, 4, 2, 100, 70, 128
    q = Strided((B, H, Nq, d), (H * Nq * d, Nq * d, d, 1))
    k = Strided((B, Hk, Nk, d), (Hk * Nk * d, Nk * d, d, 1))
    do = Strided((B, H, Nq, d), (Nq * H * d, d, H * d, 1))
    shape = Shape(Nq, Nk, d, d, (B, H), (B, H), (B, Hk), H // Hk)
    cols = {A.AT_Q: (q, "q"), A.AT_K: (k, "k"), A.AT_V: (k, "k"), A.AT_dO: (do, "q")}
    tab = A.host_table(*A.table_key(shape, cols))
    ld = [0] * A.AT_NUM
    for t, (a, _) in cols.items():
        ld[t] = a.strides[-2] // a.itemsize
    N = {A.AT_Q: Nq, A.AT_K: Nk, A.AT_V: Nk, A.AT_dO: Nq}
    got = _tma.layout(tab, ld, N, d, _tma.BACKWARD)
    assert got is not None
    check_exact(tab, ld, got, d, _tma.BACKWARD)
    assert [g[2] for g in got[1]] == [Nq, Nk, Nk, Nq]
    assert ld[A.AT_dO] == H * d != ld[A.AT_Q]


def test_the_backward_adds_dQ_in_blocks_the_header_and_python_agree_on():
    """flash2_bwd_ws adds dQ into dQacc as whole blocks of DQ_BLOCK fp32 per problem and
    step (one bulk reduce-add each, no tensor map, any d): the launcher sizes dQacc and
    the post-pass reads it with the header's constants, a block is one step of the
    backward's tiles at its instance (64 × 128 at D = 128, 128 × 64 at D = 64), and the
    shared memory the launcher gives holds the kernel's dQ buffers."""
    import re
    from flashsim.gpu.flash2 import _dq_tiled_shape
    K = fs.kernels
    text = (K.kernel_dir() / "common.cuh").read_text()
    assert re.search(r"constexpr int DQ_BLOCK = 64 \* 128;", text) and K.DQ_BLOCK == 64 * 128
    assert "inline int dq_rows(int D) { return DQ_BLOCK / D; }" in text
    assert set(K.WS_BWD_HEAD_DIMS) <= set(K.WS_BWD_DQ_BUFFERS) == {64, 128}
    for D in K.WS_BWD_DQ_BUFFERS:
        assert K.wg_blocks(D, True)[0] == K.dq_rows(D) and K.dq_rows(D) * D == K.DQ_BLOCK
    ws = (K.kernel_dir() / "flash2_ws.cu").read_text()
    assert "dq_buffers() { return D == 64 ? 1 : 2; }" in ws
    assert K.WS_BWD_DQ_BUFFERS == {64: 1, 128: 2}
    assert _dq_tiled_shape(3, 129, 128) == (3, 3, 64 * 128)
    assert _dq_tiled_shape(3, 129, 64) == (3, 2, 64 * 128)
    assert _dq_tiled_shape(3, 128, 64) == (3, 1, 64 * 128)
