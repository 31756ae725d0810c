"""Varlen (packed) batches: each sequence attends only within itself, exactly as if run
alone, and the traffic is the sum over the real sequences."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import flashsim as fs
from flashsim.varlen import (count_varlen, count_varlen_backward, simulate_varlen,
                             simulate_varlen_backward)

LENGTHS = st.lists(st.one_of(st.sampled_from([0, 1]), st.integers(0, 40)), min_size=1,
                   max_size=5)
# (algorithm, tiling options)
SETUPS = [("standard", {}), ("flash1", {"block_sizes": (3, 5)}),
          ("flash2", {"block_sizes": (4, 7)}), ("flash2", {"sram_bytes": 2048}),
          ("splitkv", {"block_sizes": (4, 3), "num_splits": 3}),
          ("splitkv", {"block_sizes": (2, 2), "num_splits": 1})]


def cu(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def packed(rng, lq, lk, Hq, Hk, d, dv):
    q = rng.standard_normal((sum(lq), Hq, d))
    k = rng.standard_normal((sum(lk), Hk, d))
    v = rng.standard_normal((sum(lk), Hk, dv))
    return q, k, v


@settings(max_examples=200)
@given(st.data(), LENGTHS, st.sampled_from(range(len(SETUPS))), st.booleans(),
       st.sampled_from([(1, 1), (2, 2), (4, 2), (3, 1)]), st.integers(1, 9),
       st.integers(1, 9), st.integers(0, 2**32 - 1))
def test_equals_each_sequence_alone(data, lq, setup, causal, heads, d, dv, seed):
    lk = data.draw(st.lists(st.one_of(st.sampled_from([0, 1]), st.integers(0, 40)),
                            min_size=len(lq), max_size=len(lq)))
    algorithm, tiling = SETUPS[setup]
    Hq, Hk = heads
    rng = np.random.default_rng(seed)
    q, k, v = packed(rng, lq, lk, Hq, Hk, d, dv)
    cq, ck = cu(lq), cu(lk)
    r = simulate_varlen(q, k, v, cq, ck, algorithm, causal=causal, **tiling)
    assert r.out.shape == (sum(lq), Hq, dv) and r.lse.shape == (Hq, sum(lq))
    assert np.isfinite(r.out).all()
    total = fs.Traffic()
    peaks = []
    for b in range(len(lq)):
        qb = np.moveaxis(q[cq[b]:cq[b + 1]], 0, 1)
        kb = np.moveaxis(k[ck[b]:ck[b + 1]], 0, 1)
        vb = np.moveaxis(v[ck[b]:ck[b + 1]], 0, 1)
        alone = fs.simulate(qb, kb, vb, algorithm, causal=causal, **tiling)
        assert np.array_equal(r.out[cq[b]:cq[b + 1]], np.moveaxis(alone.out, 0, 1))
        assert np.array_equal(r.lse[:, cq[b]:cq[b + 1]], alone.lse)
        assert r.per_sequence[b] == alone.traffic
        ref_out, _ = fs.attention_reference(qb, kb, vb, causal=causal)
        np.testing.assert_allclose(alone.out, ref_out, rtol=1e-10, atol=1e-10 * 5)
        total = total + alone.traffic
        peaks.append(alone.sram_peak_bytes)
    assert r.traffic == total
    if algorithm == "standard":
        assert r.sram_peak_bytes is None and r.block_sizes is None
    else:
        assert r.sram_peak_bytes == max(peaks)
        assert r.block_sizes == fs.simulate(q[:0].transpose(1, 0, 2), k[:0].transpose(1, 0, 2),
                                            v[:0].transpose(1, 0, 2), algorithm,
                                            **tiling).block_sizes
    c = count_varlen(algorithm, cu_seqlens_q=cq, cu_seqlens_k=ck, heads=Hq, kv_heads=Hk,
                     d=d, dv=dv, causal=causal, io_dtype="float64", **tiling)
    assert c == r.traffic, c.diff(r.traffic)


def test_lengths_zero_and_one():
    rng = np.random.default_rng(0)
    lq, lk = [0, 1, 1, 3, 0], [2, 0, 1, 5, 0]
    q, k, v = packed(rng, lq, lk, 2, 2, 4, 3)
    r = simulate_varlen(q, k, v, cu(lq), cu(lk), "flash2", block_sizes=(2, 2), causal=True)
    # sequence 1: one query, no key → out 0, lse −inf; sequence 2: one key → out = v
    assert (r.out[0] == 0).all() and np.isneginf(r.lse[:, 0]).all()
    np.testing.assert_allclose(r.out[1], v[2], rtol=1e-14)
    # the packed-out rows never see another sequence's keys
    ref, _ = fs.attention_reference(np.moveaxis(q[2:5], 0, 1), np.moveaxis(k[3:8], 0, 1),
                                    np.moveaxis(v[3:8], 0, 1), causal=True)
    np.testing.assert_allclose(r.out[2:5], np.moveaxis(ref, 0, 1), rtol=1e-12, atol=1e-12)
    # an empty batch
    e = simulate_varlen(q[:0], k[:0], v[:0], [0], [0], "flash2", block_sizes=(2, 2))
    assert e.out.shape == (0, 2, 3) and e.lse.shape == (2, 0) and e.traffic.total_bytes == 0


def test_traffic_counts_only_real_rows():
    """Packing [100, 1, 1, 1] tokens: the traffic is the sum of the four problems; a
    padded batch of 4 × 100 would move far more."""
    lens = [100, 1, 1, 1]
    kw = dict(heads=8, kv_heads=2, d=64, sram_bytes="64KiB", causal=True)
    t = count_varlen("flash2", cu_seqlens_q=cu(lens), cu_seqlens_k=cu(lens), **kw)
    parts = [fs.count("flash2", Nq=n, Nk=n, d=64, batch_shape=(8,), kv_batch_shape=(2,),
                      sram_bytes="64KiB", causal=True) for n in lens]
    assert t == sum(parts, fs.Traffic())
    padded = fs.count("flash2", Nq=100, Nk=100, d=64, batch_shape=(4, 8),
                      kv_batch_shape=(4, 2), sram_bytes="64KiB", causal=True)
    assert t.total_bytes < padded.total_bytes / 3
    assert t.writes["O"] == 103 * 8 * 64 * 2


def test_variants_per_sequence():
    rng = np.random.default_rng(1)
    lq, lk = [5, 9, 2], [7, 9, 11]
    q, k, v = packed(rng, lq, lk, 4, 2, 8, 8)
    slopes = rng.uniform(0.05, 0.5, (3, 4))
    for alibi in (slopes, slopes[0]):
        r = simulate_varlen(q, k, v, cu(lq), cu(lk), "splitkv", block_sizes=(2, 3),
                            num_splits=2, window=(3, 1), softcap=5.0, alibi_slopes=alibi,
                            causal=True)
        cq, ck = cu(lq), cu(lk)
        for b in range(3):
            s = alibi[b] if alibi.ndim == 2 else alibi
            ref_out, ref_lse = fs.attention_reference(
                np.moveaxis(q[cq[b]:cq[b + 1]], 0, 1), np.moveaxis(k[ck[b]:ck[b + 1]], 0, 1),
                np.moveaxis(v[ck[b]:ck[b + 1]], 0, 1), window=(3, 1), softcap=5.0,
                alibi_slopes=s, causal=True)
            np.testing.assert_allclose(r.out[cq[b]:cq[b + 1]], np.moveaxis(ref_out, 0, 1),
                                       rtol=1e-12, atol=1e-12)
            fin = np.isfinite(ref_lse)
            assert np.array_equal(fin, np.isfinite(r.lse[:, cq[b]:cq[b + 1]]))
            np.testing.assert_allclose(r.lse[:, cq[b]:cq[b + 1]][fin], ref_lse[fin], rtol=1e-12)
        c = count_varlen("splitkv", cu_seqlens_q=cq, cu_seqlens_k=ck, heads=4, kv_heads=2,
                         d=8, block_sizes=(2, 3), num_splits=2, window=(3, 1), causal=True,
                         io_dtype="float64")
        assert c == r.traffic


# -- errors --------------------------------------------------------------------------------

rng = np.random.default_rng(0)
Q = rng.standard_normal((6, 2, 4))
K = rng.standard_normal((8, 2, 4))
V = rng.standard_normal((8, 2, 3))
CQ, CK = np.array([0, 2, 6], np.int32), np.array([0, 5, 8], np.int32)


@pytest.mark.parametrize("args, kwargs, exc, match", [
    ((Q, K, V, CQ.astype(float), CK), {}, TypeError, "cu_seqlens_q must be an integer array"),
    ((Q, K, V, CQ, [[0, 5, 8]]), {}, ValueError, "cu_seqlens_k must be 1-D"),
    ((Q, K, V, np.array([], np.int32), CK), {}, ValueError, "cu_seqlens_q must be 1-D"),
    ((Q, K, V, np.array([1, 2, 6]), CK), {}, ValueError, "must start at 0"),
    ((Q, K, V, np.array([0, 4, 2, 6]), np.array([0, 1, 2, 8])), {}, ValueError,
     "non-decreasing"),
    ((Q, K, V, np.array([0, 2, 5]), CK), {}, ValueError, r"cu_seqlens_q\[-1\] = 5 must equal "
                                                         "the packed length 6"),
    ((Q, K, V, CQ, np.array([0, 5, 7])), {}, ValueError, "packed length 8"),
    ((Q, K, V, CQ, np.array([0, 8])), {}, ValueError, "describes 2 sequences but "
                                                      "cu_seqlens_k 1"),
    ((Q[0], K, V, CQ, CK), {}, ValueError, "q must be 3-D packed"),
    ((Q, K[None], V, CQ, CK), {}, ValueError, "k must be 3-D packed"),
    ((Q, K, V[:7], CQ, CK), {}, ValueError, "same tokens and heads"),
    ((Q, K, V, CQ, CK), {"alibi_slopes": np.ones(3)}, ValueError, r"alibi_slopes must have "
                                                                  r"shape \(2,\) or \(2, 2\)"),
    ((Q, K, V, CQ, CK, "flash2"), {}, ValueError, "neither"),
    ((Q, K, V, CQ, CK, "splitkv"), {"block_sizes": (2, 2)}, ValueError,
     "splitkv needs num_splits"),
    ((Q, K, V, CQ, CK, "flash3"), {}, ValueError, "unknown algorithm"),
])
def test_bad_input(args, kwargs, exc, match):
    if len(args) == 5 and "block_sizes" not in kwargs:
        kwargs = {**kwargs, "block_sizes": (2, 2)}
    with pytest.raises(exc, match=match):
        simulate_varlen(*args, **kwargs)


def test_count_varlen_bad_input():
    kw = dict(heads=2, d=4, block_sizes=(2, 2))
    with pytest.raises(TypeError, match="integer array"):
        count_varlen("flash2", cu_seqlens_q=[0.0, 2.0], cu_seqlens_k=[0, 2], **kw)
    with pytest.raises(ValueError, match="must start at 0"):
        count_varlen("flash2", cu_seqlens_q=[2, 4], cu_seqlens_k=[0, 2], **kw)
    with pytest.raises(ValueError, match="non-decreasing"):
        count_varlen("flash2", cu_seqlens_q=[0, 4, 3], cu_seqlens_k=[0, 2, 3], **kw)
    with pytest.raises(ValueError, match="describes 1 sequences but cu_seqlens_k 2"):
        count_varlen("flash2", cu_seqlens_q=[0, 4], cu_seqlens_k=[0, 2, 3], **kw)
    with pytest.raises(ValueError, match="does not divide"):
        count_varlen("flash2", cu_seqlens_q=[0, 4], cu_seqlens_k=[0, 2], heads=3, kv_heads=2,
                     d=4, block_sizes=(2, 2))
    with pytest.raises(ValueError, match="heads must be >= 1"):
        count_varlen("flash2", cu_seqlens_q=[0, 4], cu_seqlens_k=[0, 2], heads=0, d=4,
                     block_sizes=(2, 2))
    with pytest.raises(ValueError, match="splitkv needs num_splits"):
        count_varlen("splitkv", cu_seqlens_q=[0], cu_seqlens_k=[0], **kw)


# -- backward ------------------------------------------------------------------------------

BWD_SETUPS = [("standard", {}), ("flash1", {"block_sizes": (3, 5)}),
              ("flash2", {"block_sizes": (4, 7)}), ("flash2", {"sram_bytes": 2048}),
              ("flash1", {"block_sizes": (1, 2)})]
WINDOWS = [None, (3, 1), (0, 0), (-1, 2), (5, -1)]


def _forward_backward(rng, lq, lk, Hq, Hk, d, dv, **kw):
    q, k, v = packed(rng, lq, lk, Hq, Hk, d, dv)
    f = simulate_varlen(q, k, v, cu(lq), cu(lk), "flash2", block_sizes=(3, 4), **kw)
    dout = rng.standard_normal(f.out.shape)
    return q, k, v, f, dout


def _assert_close(a, b, name):
    tol = 1e-9 * max(1.0, float(np.abs(b).max(initial=0.0)))
    np.testing.assert_allclose(a, b, rtol=1e-9, atol=tol, err_msg=name)


@given(st.data(), LENGTHS, st.sampled_from(range(len(BWD_SETUPS))), st.booleans(),
       st.sampled_from([(1, 1), (2, 2), (4, 2), (3, 1)]), st.integers(1, 6),
       st.integers(1, 6), st.sampled_from(WINDOWS), st.sampled_from([None, 0.7, 5.0]),
       st.integers(0, 2**32 - 1))
def test_backward_equals_each_sequence_alone(data, lq, setup, causal, heads, d, dv, window,
                                             softcap, seed):
    lk = data.draw(st.lists(st.one_of(st.sampled_from([0, 1]), st.integers(0, 30)),
                            min_size=len(lq), max_size=len(lq)))
    algorithm, tiling = BWD_SETUPS[setup]
    Hq, Hk = heads
    var = dict(causal=causal, window=window, softcap=softcap)
    rng = np.random.default_rng(seed)
    q, k, v, f, dout = _forward_backward(rng, lq, lk, Hq, Hk, d, dv, **var)
    cq, ck = cu(lq), cu(lk)
    g = simulate_varlen_backward(q, k, v, f.out, f.lse, dout, cq, ck, algorithm, **tiling,
                                 **var)
    assert g.dq.shape == q.shape and g.dk.shape == k.shape and g.dv.shape == v.shape
    assert np.isfinite(g.dq).all() and np.isfinite(g.dk).all() and np.isfinite(g.dv).all()
    total, peaks = fs.Traffic(), []
    for b in range(len(lq)):
        sq, sk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        qb, kb, vb = (np.moveaxis(x, 0, 1) for x in (q[sq], k[sk], v[sk]))
        dob = np.moveaxis(dout[sq], 0, 1)
        alone = fs.simulate_backward(qb, kb, vb, np.moveaxis(f.out[sq], 0, 1), f.lse[:, sq],
                                     dob, algorithm, **tiling, **var)
        for name, packed_g, own in (("dq", g.dq[sq], alone.dq), ("dk", g.dk[sk], alone.dk),
                                    ("dv", g.dv[sk], alone.dv)):
            assert np.array_equal(packed_g, np.moveaxis(own, 0, 1)), name
        assert g.per_sequence[b] == alone.traffic
        assert alone.traffic == fs.count_backward(
            algorithm, Nq=lq[b], Nk=lk[b], d=d, dv=dv, batch_shape=(Hq,),
            kv_batch_shape=(Hk,), io_dtype="float64", **tiling, **var)
        if lq[b] == 0 or lk[b] == 0:
            assert not g.dq[sq].any() and not g.dk[sk].any() and not g.dv[sk].any()
        ref = fs.attention_backward_reference(qb, kb, vb, dob, **var)
        for name, packed_g, r in zip(("dq", "dk", "dv"), (g.dq[sq], g.dk[sk], g.dv[sk]), ref):
            _assert_close(packed_g, np.moveaxis(r, 0, 1), name)
        total = total + alone.traffic
        peaks.append(alone.sram_peak_bytes)
    assert g.traffic == total
    if algorithm == "standard":
        assert g.sram_peak_bytes is None and g.block_sizes is None
    else:
        assert g.sram_peak_bytes == max(peaks)
        assert g.block_sizes == alone.block_sizes
    c = count_varlen_backward(algorithm, cu_seqlens_q=cq, cu_seqlens_k=ck, heads=Hq,
                              kv_heads=Hk, d=d, dv=dv, io_dtype="float64", **tiling, **var)
    assert c == g.traffic, c.diff(g.traffic)


@pytest.mark.parametrize("algorithm", ["standard", "flash1", "flash2"])
def test_backward_lengths_zero_and_one(algorithm):
    rng = np.random.default_rng(2)
    lq, lk = [0, 1, 1, 3, 0, 2], [2, 0, 1, 5, 0, 1]
    q, k, v, f, dout = _forward_backward(rng, lq, lk, 4, 2, 4, 3, causal=True)
    tiling = {} if algorithm == "standard" else {"block_sizes": (2, 2)}
    g = simulate_varlen_backward(q, k, v, f.out, f.lse, dout, cu(lq), cu(lk), algorithm,
                                 causal=True, **tiling)
    # sequence 0 (no query) and 1 (no key): zero gradients, count_backward's traffic
    assert not g.dk[0:2].any() and not g.dv[0:2].any() and not g.dq[0].any()
    for b in (0, 1, 4):
        assert g.per_sequence[b] == fs.count_backward(
            algorithm, Nq=lq[b], Nk=lk[b], d=4, dv=3, batch_shape=(4,), kv_batch_shape=(2,),
            causal=True, io_dtype="float64", **tiling)
    assert g.per_sequence[4].total_bytes == 0
    # sequence 2: one query, one key → P = 1, so dq = dk = 0 and dv sums dout over the group
    _assert_close(g.dq[1], np.zeros((4, 4)), "dq")
    _assert_close(g.dk[2], np.zeros((2, 4)), "dk")
    _assert_close(g.dv[2], dout[1].reshape(2, 2, 3).sum(axis=1), "dv")
    # an empty batch
    e = simulate_varlen_backward(q[:0], k[:0], v[:0], f.out[:0], f.lse[:, :0], dout[:0], [0],
                                 [0], algorithm, **tiling)
    assert e.dq.shape == (0, 4, 4) and e.dv.shape == (0, 2, 3) and e.traffic.total_bytes == 0
    assert e.sram_peak_bytes == (None if algorithm == "standard" else 0)
    assert count_varlen_backward(algorithm, cu_seqlens_q=[0], cu_seqlens_k=[0], heads=4,
                                 d=4, **tiling).total_bytes == 0


def test_backward_alibi_and_scale_per_sequence():
    rng = np.random.default_rng(3)
    lq, lk = [5, 9, 2], [7, 9, 11]
    slopes = rng.uniform(0.05, 0.5, (3, 4))
    var = dict(window=(3, 1), softcap=5.0, causal=True, scale=0.3)
    for alibi in (slopes, slopes[0]):
        q, k, v, f, dout = _forward_backward(rng, lq, lk, 4, 2, 8, 6, alibi_slopes=alibi,
                                             **var)
        g = simulate_varlen_backward(q, k, v, f.out, f.lse, dout, cu(lq), cu(lk), "flash2",
                                     sram_bytes="4KiB", alibi_slopes=alibi, **var)
        cq, ck = cu(lq), cu(lk)
        for b in range(3):
            sq, sk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
            ref = fs.attention_backward_reference(
                *(np.moveaxis(x, 0, 1) for x in (q[sq], k[sk], v[sk], dout[sq])),
                alibi_slopes=alibi[b] if alibi.ndim == 2 else alibi, **var)
            for name, a, r in zip(("dq", "dk", "dv"), (g.dq[sq], g.dk[sk], g.dv[sk]), ref):
                _assert_close(a, np.moveaxis(r, 0, 1), name)
        c = count_varlen_backward("flash2", cu_seqlens_q=cq, cu_seqlens_k=ck, heads=4,
                                  kv_heads=2, d=8, dv=6, sram_bytes="4KiB", window=(3, 1),
                                  causal=True, io_dtype="float64")
        assert c == g.traffic


def test_backward_io_dtype_and_float16():
    """float16 inputs count 2-byte I/O as in simulate_backward; the counts agree."""
    rng = np.random.default_rng(4)
    lq = lk = [6, 0, 3]
    q, k, v = (x.astype(np.float16) for x in packed(rng, lq, lk, 2, 1, 8, 8))
    f = simulate_varlen(q, k, v, cu(lq), cu(lk), "flash2", block_sizes=(4, 4))
    dout = rng.standard_normal(f.out.shape)
    g = simulate_varlen_backward(q, k, v, f.out, f.lse, dout, cu(lq), cu(lk), "flash2",
                                 sram_bytes="8KiB")
    assert g.traffic == count_varlen_backward("flash2", cu_seqlens_q=cu(lq),
                                              cu_seqlens_k=cu(lk), heads=2, kv_heads=1, d=8,
                                              sram_bytes="8KiB")


OUT = rng.standard_normal((6, 2, 3))
LSE = rng.standard_normal((2, 6))


@pytest.mark.parametrize("args, kwargs, exc, match", [
    ((Q, K, V, OUT[:5], LSE, OUT, CQ, CK), {}, ValueError,
     r"out must have the packed shape \(total_q, heads, dv\) = \(6, 2, 3\), got \(5, 2, 3\)"),
    ((Q, K, V, OUT, LSE.T, OUT, CQ, CK), {}, ValueError,
     r"lse must have the packed shape \(heads, total_q.*\) = \(2, 6\), got \(6, 2\)"),
    ((Q, K, V, OUT, LSE, OUT[:, :, :2], CQ, CK), {}, ValueError,
     r"dout must have the packed shape .* = \(6, 2, 3\), got \(6, 2, 2\)"),
    ((Q, K, V, OUT, LSE[None], OUT, CQ, CK), {}, ValueError, r"lse must .* got \(1, 2, 6\)"),
    ((Q, K, V, OUT.astype(int), LSE, OUT, CQ, CK), {}, TypeError,
     "out must be a floating-point array"),
    ((Q, K, V, OUT, LSE, np.where(OUT > 0, np.nan, OUT), CQ, CK), {}, ValueError,
     "dout contains NaN"),
    ((Q, K, V, OUT, np.full((2, 6), np.inf), OUT, CQ, CK), {}, ValueError,
     r"lse contains NaN or \+Inf"),
    ((Q, K, V, OUT, LSE, OUT, CQ, np.array([0, 5, 7])), {}, ValueError, "packed length 8"),
    ((Q, K, V, OUT, LSE, OUT, CQ.astype(float), CK), {}, TypeError, "integer array"),
    ((Q, K, V, OUT, LSE, OUT, CQ, np.array([0, 8])), {}, ValueError,
     "describes 2 sequences"),
    ((Q[0], K, V, OUT, LSE, OUT, CQ, CK), {}, ValueError, "q must be 3-D packed"),
    ((Q, K, V[:7], OUT, LSE, OUT, CQ, CK), {}, ValueError, "same tokens and heads"),
    ((Q, K, V, OUT, LSE, OUT, CQ, CK), {"alibi_slopes": np.ones(3)}, ValueError,
     r"alibi_slopes must have shape \(2,\) or \(2, 2\)"),
    ((Q, K, V, OUT, LSE, OUT, CQ, CK, "flash2"), {}, ValueError, "neither"),
    ((Q, K, V, OUT, LSE, OUT, CQ, CK, "splitkv"), {}, ValueError,
     "no backward pass for algorithm 'splitkv'"),
    ((Q, K, V, OUT, LSE, OUT, CQ, CK, "flash3"), {}, ValueError, "unknown algorithm"),
])
def test_backward_bad_input(args, kwargs, exc, match):
    if len(args) == 8 and "block_sizes" not in kwargs:
        kwargs = {**kwargs, "block_sizes": (2, 2)}
    with pytest.raises(exc, match=match):
        simulate_varlen_backward(*args, **kwargs)


def test_count_varlen_backward_bad_input():
    kw = dict(heads=2, d=4, block_sizes=(2, 2))
    with pytest.raises(TypeError, match="integer array"):
        count_varlen_backward("flash2", cu_seqlens_q=[0.0, 2.0], cu_seqlens_k=[0, 2], **kw)
    with pytest.raises(ValueError, match="describes 1 sequences but cu_seqlens_k 2"):
        count_varlen_backward("flash2", cu_seqlens_q=[0, 4], cu_seqlens_k=[0, 2, 3], **kw)
    with pytest.raises(ValueError, match="does not divide"):
        count_varlen_backward("flash1", cu_seqlens_q=[0, 4], cu_seqlens_k=[0, 2], heads=3,
                              kv_heads=2, d=4, block_sizes=(2, 2))
    with pytest.raises(ValueError, match="no backward pass"):
        count_varlen_backward("splitkv", cu_seqlens_q=[0], cu_seqlens_k=[0], **kw)
    with pytest.raises(ValueError, match="neither"):     # checked for an empty batch too
        count_varlen_backward("flash2", cu_seqlens_q=[0], cu_seqlens_k=[0], heads=2, d=4)
