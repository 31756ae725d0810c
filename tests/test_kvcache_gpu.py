"""Decoding on the GPU (fs.gpu.attention_with_kvcache, kernels_cu/splitkv_tc.cu) against
the simulator (fs.simulate_kvcache): the instrumented build's bytes equal the simulator's
exactly, the appended cache equals the simulator's bit for bit, outputs follow
FlashAttention's 2× rule per sequence, and bad input is refused before any launch.

Marked `gpu`: skipped where CuPy or a CUDA device is missing; tests/test_emulate.py runs
the same checks on the CPU emulation. On a GPU machine, from the repository root:
python3 -m pytest -m gpu --hypothesis-profile=gpu tests/test_kvcache_gpu.py
"""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import flashsim as fs
from flashsim.precision import make_precision
from flashsim.testing import assert_attention_close

import test_gpu as G

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not fs.gpu.available(), reason="no CuPy or no CUDA device")]

DTYPES = ["float16"] + (["bfloat16"] if G.HAVE_TORCH else [])


def clusters() -> bool:
    """The device merges a Q tile's parts in a thread block cluster (compute capability
    9.0 or later; not the CPU emulation)."""
    dev = fs.gpu._device
    return not dev.is_emulated() and dev.cc(dev.cupy().cuda.Device().id) >= 90


@st.composite
def kvcache_problems(draw, dtypes=None, max_len=300):
    """A decoding step: q, a paged or contiguous cache (lengths at and around page and
    tile edges, 0 included), rows to append, causal or not, a split count or None, and
    where the device has them the merge in a cluster asked for, refused or left to the
    launcher (None)."""
    dtype = draw(st.sampled_from(dtypes or DTYPES))
    d = draw(st.sampled_from([64, 128]))
    batch = draw(st.integers(1, 3))
    Nq = draw(st.sampled_from([1, 1, 2, 4, 7, 16]))
    kv_heads = draw(st.integers(1, 2))
    g = draw(st.sampled_from([1, 2, 4, 8]))
    paged = draw(st.booleans())
    page = draw(st.sampled_from([16, 32, 48, 64, 256])) if paged else None
    edges = [0, 1, 15, 16, 17, 63, 64, 65, 128, 255, 256]
    lens = draw(st.lists(st.one_of(st.sampled_from([e for e in edges if e <= max_len]),
                                   st.integers(0, max_len)), min_size=batch, max_size=batch))
    Nnew = draw(st.sampled_from([0, 0, 1, 3, 16]))
    causal = draw(st.booleans())
    splits = draw(st.sampled_from([None, None, 1, 2, 3, 5, 16]))
    cluster = None
    if clusters():
        cluster = draw(st.sampled_from([None, True, False]))
        if cluster:
            splits = draw(st.sampled_from([None, *fs.kernels.SPLITKV_CLUSTERS]))
    seed = draw(st.integers(0, 2**32 - 1))
    return dict(dtype=dtype, d=d, batch=batch, Nq=Nq, kv_heads=kv_heads, g=g, page=page,
                lens=lens, Nnew=Nnew, causal=causal, splits=splits, cluster=cluster,
                seed=seed)


def make_inputs(c):
    """Host float64 arrays holding values exact in the dtype: q, the caches (paged with a
    shuffled block table, or contiguous with spare rows), the rows to append."""
    rng = np.random.default_rng(c["seed"])
    rnd = make_precision("kernel", c["dtype"]).io_round
    heads, kvh, d = c["kv_heads"] * c["g"], c["kv_heads"], c["d"]
    total = [L + c["Nnew"] for L in c["lens"]]
    if c["page"] is not None:
        need = [-(-t // c["page"]) for t in total]
        max_pages = max(max(need), 1) + 1
        num_pages = c["batch"] * max_pages + 2
        table = rng.permutation(num_pages)[:c["batch"] * max_pages]
        table = table.reshape(c["batch"], max_pages).astype(np.int32)
        rows = (num_pages, c["page"])
    else:
        table, rows = None, (c["batch"], max(total) + 5)
    kc = rnd(rng.standard_normal(rows + (kvh, d)))
    vc = rnd(rng.standard_normal(rows + (kvh, d)))
    q = rnd(rng.standard_normal((c["batch"], c["Nq"], heads, d)))
    kn = vn = None
    if c["Nnew"]:
        kn = rnd(rng.standard_normal((c["batch"], c["Nnew"], kvh, d)))
        vn = rnd(rng.standard_normal((c["batch"], c["Nnew"], kvh, d)))
    return q, kc, vc, table, kn, vn


def check_kvcache(c):
    dtype = c["dtype"]
    q, kc, vc, table, kn, vn = make_inputs(c)
    lens = np.array(c["lens"], np.int32)
    on = lambda x: None if x is None else G.dev(x, dtype)
    args = dict(cache_seqlens=lens, block_table=table, causal=c["causal"],
                num_splits=c["splits"], cluster=c.get("cluster"))
    plan = fs.gpu.kvcache_plan(on(q), on(kc), on(vc), cache_seqlens=lens, block_table=table,
                               k=on(kn), v=on(vn), num_splits=c["splits"],
                               cluster=c.get("cluster"))
    if c.get("cluster") is not None:
        assert plan.cluster == c["cluster"]
    kd, vd = on(kc), on(vc)
    out, lse, traffic = fs.gpu.attention_with_kvcache(on(q), kd, vd, k=on(kn), v=on(vn),
                                                      count_io=True, **args)
    kd2, vd2 = on(kc), on(vc)
    out2, lse2 = fs.gpu.attention_with_kvcache(on(q), kd2, vd2, k=on(kn), v=on(vn), **args)
    out, lse, out2, lse2 = map(G.host, (out, lse, out2, lse2))
    assert not np.isnan(out).any() and not np.isnan(lse).any(), "an output was not written"
    np.testing.assert_array_equal(out, out2)        # instrumenting changes no result
    np.testing.assert_array_equal(lse, lse2)

    sim = fs.simulate_kvcache(q, kc, vc, k=kn, v=vn, io_dtype=dtype,
                              block_sizes=plan.block_sizes, num_splits=plan.num_splits,
                              cluster=plan.cluster,
                              **{a: args[a] for a in ("cache_seqlens", "block_table", "causal")})
    fs.testing.assert_traffic_equal(traffic, sim.traffic)
    # the append landed where the simulator put it, and nothing else changed
    for got in (kd, kd2):
        np.testing.assert_array_equal(G.host(got), sim.k_cache)
    for got in (vd, vd2):
        np.testing.assert_array_equal(G.host(got), sim.v_cache)

    g = c["g"]
    for b, L in enumerate(lens + c["Nnew"]):
        o_b = out[b].transpose(1, 0, 2)                    # (heads, Nq, d)
        l_b = lse[b]                                       # (heads, Nq)
        if L == 0:                                         # no key: O = 0, L = −∞
            assert (o_b == 0).all() and np.isneginf(l_b).all()
            continue
        if table is None:
            K_b, V_b = sim.k_cache[b, :L], sim.v_cache[b, :L]
        else:
            r = np.arange(L)
            pg = table[b, r // c["page"]]
            K_b, V_b = sim.k_cache[pg, r % c["page"]], sim.v_cache[pg, r % c["page"]]
        q_b = q[b].transpose(1, 0, 2)
        K_b = np.repeat(K_b.transpose(1, 0, 2), g, axis=0)
        V_b = np.repeat(V_b.transpose(1, 0, 2), g, axis=0)
        if c["causal"] and c["Nq"] > L:                # rows that see no key: 0 and −∞
            blind = c["Nq"] - L
            assert (o_b[:, :blind] == 0).all() and np.isneginf(l_b[:, :blind]).all()
            o_b, l_b, q_b = o_b[:, blind:], l_b[:, blind:], q_b[:, blind:]
        assert_attention_close(o_b, q_b, K_b, V_b, causal=c["causal"], io_dtype=dtype, lse=l_b)
    return plan


@pytest.fixture
def poisoned(monkeypatch):
    G.poison_outputs(monkeypatch)


@given(kvcache_problems())
def test_kvcache_matches_simulator(poisoned, problem):
    check_kvcache(problem)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("Nq,g", [(1, 1), (1, 8), (4, 4), (16, 4), (3, 8)])
def test_every_tile_shape(poisoned, dtype, d, Nq, g):
    """Each instance (Br = 16, 32, 64, and more packed rows than one tile holds), long
    enough for many tiles per split and a page table that needs restaging."""
    plan = check_kvcache(dict(dtype=dtype, d=d, batch=2, Nq=Nq, kv_heads=2, g=g, page=16,
                              lens=[2500, 1031], Nnew=2, causal=True, splits=3, seed=Nq * g))
    assert plan.block_sizes[0] == fs.kernels.splitkv_rows(Nq * g)


@pytest.mark.skipif(not fs.gpu.available() or not clusters(),
                    reason="clusters need compute capability 9.0")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("CL", fs.kernels.SPLITKV_CLUSTERS)
@pytest.mark.parametrize("Nq,g", [(1, 4), (2, 8), (4, 8), (16, 4), (16, 8)])
def test_every_cluster_instance(poisoned, dtype, d, CL, Nq, g):
    """Each cluster instance (tiles of 16, 32 and 64 packed rows, and more rows than a
    tile holds): a paged cache restaged within a part, causal, a short sequence with
    empty parts beside a long one whose parts all run."""
    plan = check_kvcache(dict(dtype=dtype, d=d, batch=2, Nq=Nq, kv_heads=2, g=g, page=16,
                              lens=[1500, 3 + Nq], Nnew=1, causal=True, splits=CL,
                              cluster=True, seed=CL * g))
    Br = fs.kernels.splitkv_rows(Nq * g)
    assert plan.cluster and plan.num_splits == CL
    assert plan.kernel == f"splitkv_fwd_tc_m{Br}_cl{CL}"


@pytest.mark.skipif(not fs.gpu.available() or not clusters(),
                    reason="clusters need compute capability 9.0")
def test_the_launcher_merges_short_parts_in_a_cluster():
    """On 9.0 a short cache's parts merge in a cluster, a long one's through memory; a
    cluster that cannot be is refused before any launch."""
    xp = fs.gpu._device.cupy()
    q = xp.zeros((1, 1, 32, 128), xp.float16)
    for L, want in ((1024, True), (16384, False)):
        kc = xp.zeros((1, L, 8, 128), xp.float16)
        plan = fs.gpu.kvcache_plan(q, kc, cache_seqlens=np.array([L], np.int32))
        assert plan.cluster == want, (L, plan)
    lens = np.array([L], np.int32)
    with pytest.raises(ValueError, match="a cluster merges"):
        fs.gpu.kvcache_plan(q, kc, cache_seqlens=lens, num_splits=3, cluster=True)
    with pytest.raises(TypeError, match="cluster must be"):
        fs.gpu.kvcache_plan(q, kc, cache_seqlens=lens, cluster="yes")


def bad_inputs():
    """(arguments, error type, message) for input the launcher must refuse."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 1, 2, 64)).astype(np.float16)
    kc = rng.standard_normal((4, 16, 2, 64)).astype(np.float16)
    lens = np.array([20], np.int32)
    table = np.array([[0, 1]], np.int32)
    return [
        (dict(block_table=np.array([[0, 7]], np.int32)), ValueError, "pages are 0"),
        (dict(cache_seqlens=np.array([40], np.int32)), ValueError, "needs 3 pages"),
        (dict(cache_seqlens=np.array([-1], np.int32)), ValueError, ">= 0"),
        (dict(cache_seqlens=np.array([1.0])), TypeError, "integers"),
        (dict(block_table=table.astype(np.float32)), TypeError, "integers"),
        (dict(k_cache=np.ascontiguousarray(kc[:, :8]), v_cache=np.ascontiguousarray(kc[:, :8])),
         ValueError, "multiple of 16"),
        (dict(k=q[:, :1, :2].repeat(13, 1), v=q[:, :1, :2].repeat(13, 1)), ValueError,
         "needs 3 pages"),
        (dict(k=q[:, :, :2]), ValueError, "both k and v"),
        (dict(q=q.astype(np.float32)), TypeError, "one dtype"),
        (dict(q=q[..., :32], k_cache=np.ascontiguousarray(kc[..., :32]),
              v_cache=np.ascontiguousarray(kc[..., :32])), ValueError, "d in"),
        (dict(block_table=None), ValueError, "one row of pages per sequence"),
        (dict(num_splits=0), ValueError, "num_splits"),
        (dict(k_cache=kc[:, :, :, ::2].repeat(2, -1)[:, :, ::-1]), ValueError, "contiguous"),
    ], dict(q=q, k_cache=kc, v_cache=kc.copy(), cache_seqlens=lens, block_table=table)


def check_bad_input(monkeypatch):
    def no_launch(*a, **kw):
        raise AssertionError("launched on bad input")
    monkeypatch.setattr(fs.gpu._device, "launch", no_launch)
    cases, base = bad_inputs()
    for change, error, message in cases:
        args = {**base, **change}
        with pytest.raises(error, match=message):
            fs.gpu.attention_with_kvcache(args.pop("q"), args.pop("k_cache"),
                                          args.pop("v_cache"), **args)


def test_bad_input_is_refused_before_any_launch(monkeypatch):
    check_bad_input(monkeypatch)


def check_strided_inputs():
    """q and the appended k, v as slices of one fused (batch, Nq, H + 2·Hk, d) projection
    (strided views): the same out, lse and appended caches, bit for bit, as dense copies
    (the decoding kernels read dense q, k, v: flashsim.gpu copies such views once)."""
    xp = fs.gpu._device.cupy()
    rng = np.random.default_rng(4)
    B, Nq, H, Hk, d, cap = 2, 3, 8, 2, 64, 96
    fused = xp.asarray(rng.standard_normal((B, Nq, H + 2 * Hk, d)).astype(np.float16))
    q, kn, vn = fused[:, :, :H], fused[:, :, H:H + Hk], fused[:, :, H + Hk:]
    caches = [xp.asarray(rng.standard_normal((B, cap, Hk, d)).astype(np.float16))
              for _ in range(2)]
    lens = np.array([5, 40], np.int32)
    runs = []
    for inputs in ((q, kn, vn), tuple(xp.ascontiguousarray(x) for x in (q, kn, vn))):
        kc, vc = (c.copy() for c in caches)
        out, lse = fs.gpu.attention_with_kvcache(inputs[0], kc, vc, cache_seqlens=lens,
                                                 k=inputs[1], v=inputs[2], causal=True)
        runs.append([G.host(x) for x in (out, lse, kc, vc)])
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)


def test_strided_inputs():
    check_strided_inputs()
