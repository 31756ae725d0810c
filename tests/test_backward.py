"""Backward passes: gradients equal the dense float64 oracle and finite differences of
the forward; traffic == count_backward == theory.traffic_backward."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import flashsim as fs
from flashsim import theory
from flashsim.problem import itemsize_of
from flashsim.strategies import attention_problems

BWD = ("standard", "flash1", "flash2")
RTOL = 1e-9


def blocks_for(algorithm, p):
    """p's tiles; standard attention runs whole matrices (the paper's count) for even
    Nq and tiled products (as the GPU runs them) for odd, so both are drawn."""
    return None if algorithm == "standard" and p.Nq % 2 == 0 else p.block_sizes


def _forward_and_dout(p, rng_seed=0, **variants):
    f = fs.simulate(p.q, p.k, p.v, "flash2", block_sizes=p.block_sizes, causal=p.causal,
                    **variants)
    dout = np.random.default_rng(rng_seed).standard_normal(f.out.shape)
    return f, dout


def _assert_grads(g, ref):
    for name, a, b in zip(("dq", "dk", "dv"), (g.dq, g.dk, g.dv), ref):
        assert a.shape == b.shape, name
        assert np.isfinite(a).all(), name
        tol = RTOL * max(1.0, float(np.abs(b).max(initial=0.0)))
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=tol, err_msg=name)


@given(attention_problems(max_seq=80, max_dim=24, allow_empty=True), st.sampled_from(BWD))
def test_gradients_equal_dense_float64(p, algorithm):
    f, dout = _forward_and_dout(p)
    ref = fs.attention_backward_reference(p.q, p.k, p.v, dout, causal=p.causal)
    blocks = blocks_for(algorithm, p)
    g = fs.simulate_backward(p.q, p.k, p.v, f.out, f.lse, dout, algorithm,
                             block_sizes=blocks, causal=p.causal)
    _assert_grads(g, ref)


WINDOWS = st.sampled_from([None, (-1, -1), (0, 0), (3, 2), (7, -1), (-1, 5)])


@settings(max_examples=60)
@given(attention_problems(max_seq=60, max_dim=16), st.sampled_from(BWD), WINDOWS,
       st.sampled_from([None, 0.5, 5.0]), st.booleans())
def test_variant_gradients_equal_dense_float64(p, algorithm, window, softcap, alibi):
    heads = p.q.shape[-3] if p.q.ndim >= 3 else 1
    slopes = np.linspace(0.05, 1.0, heads) if alibi and p.q.ndim >= 3 else None
    kw = dict(causal=p.causal, window=window, softcap=softcap, alibi_slopes=slopes)
    f = fs.simulate(p.q, p.k, p.v, "flash2", block_sizes=p.block_sizes, **kw)
    dout = np.random.default_rng(1).standard_normal(f.out.shape)
    ref = fs.attention_backward_reference(p.q, p.k, p.v, dout, **kw)
    g = fs.simulate_backward(p.q, p.k, p.v, f.out, f.lse, dout, algorithm,
                             block_sizes=blocks_for(algorithm, p),
                             **kw)
    _assert_grads(g, ref)
    c = fs.count_backward(algorithm, Nq=p.Nq, Nk=p.Nk, d=p.d, dv=p.dv,
                          batch_shape=p.q.shape[:-2], kv_batch_shape=p.k.shape[:-2],
                          block_sizes=blocks_for(algorithm, p),
                          causal=p.causal, window=window, softcap=softcap,
                          io_dtype=p.q.dtype)
    assert g.traffic == c, g.traffic.diff(c)


@pytest.mark.parametrize("algorithm", BWD)
@pytest.mark.parametrize("variant", [{}, {"causal": True}, {"window": (2, 1)},
                                     {"softcap": 1.5}, {"alibi_slopes": [0.3, 0.9]}])
def test_gradients_match_finite_differences(algorithm, variant):
    """Central differences of loss = Σ out ∘ dO through the tiled forward itself."""
    rng = np.random.default_rng(5)
    q = rng.standard_normal((2, 5, 3)) * 1.5
    k = rng.standard_normal((2, 7, 3)) * 1.5
    v = rng.standard_normal((2, 7, 2))
    dout = rng.standard_normal((2, 5, 2))

    def loss(q, k, v):
        return float((fs.simulate(q, k, v, "flash1", block_sizes=(2, 3), **variant).out
                      * dout).sum())

    f = fs.simulate(q, k, v, "flash2", block_sizes=(2, 3), **variant)
    g = fs.simulate_backward(q, k, v, f.out, f.lse, dout, algorithm,
                             block_sizes=None if algorithm == "standard" else (3, 2), **variant)
    h = 1e-6
    for name, x, grad in (("q", q, g.dq), ("k", k, g.dk), ("v", v, g.dv)):
        fd = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            xp, xm = x.copy(), x.copy()
            xp[idx] += h
            xm[idx] -= h
            args_p = {"q": q, "k": k, "v": v, name: xp}
            args_m = {"q": q, "k": k, "v": v, name: xm}
            fd[idx] = (loss(**args_p) - loss(**args_m)) / (2 * h)
        np.testing.assert_allclose(grad, fd, rtol=1e-6, atol=1e-7, err_msg=name)


@given(attention_problems(max_seq=80, max_dim=24, allow_empty=True), st.sampled_from(BWD),
       st.sampled_from(["float16", "bfloat16", "float32"]))
def test_backward_traffic_equals_count_and_theory(p, algorithm, io):
    f, dout = _forward_and_dout(p)
    blocks = blocks_for(algorithm, p)
    g = fs.simulate_backward(p.q, p.k, p.v, f.out, f.lse, dout, algorithm,
                             block_sizes=blocks, causal=p.causal, io_dtype=io)
    c = fs.count_backward(algorithm, Nq=p.Nq, Nk=p.Nk, d=p.d, dv=p.dv,
                          batch_shape=p.q.shape[:-2], kv_batch_shape=p.k.shape[:-2],
                          block_sizes=blocks, causal=p.causal, io_dtype=io)
    assert g.traffic == c, g.traffic.diff(c)
    Br, Bc = blocks or (None, None)
    t = theory.traffic_backward(algorithm, Nq=p.Nq, Nk=p.Nk, d=p.d, dv=p.dv, Br=Br, Bc=Bc,
                                causal=p.causal, itemsize=itemsize_of(io),
                                problems=int(np.prod(f.out.shape[:-2])))
    assert c == t, c.diff(t)


@settings(max_examples=40)
@given(attention_problems(max_seq=100, max_dim=32), st.sampled_from(["flash1", "flash2"]),
       st.integers(2**11, 2**16))
def test_backward_sram_budget(p, algorithm, sram):
    f, dout = _forward_and_dout(p)
    try:
        g = fs.simulate_backward(p.q, p.k, p.v, f.out, f.lse, dout, algorithm,
                                 sram_bytes=sram, causal=p.causal, io_dtype="float16")
    except fs.SRAMOverflowError as e:
        assert e.minimum_bytes > sram
        return
    assert g.sram_peak_bytes <= sram
    Br, Bc = g.block_sizes
    assert Br == min(Bc, p.d) or Br < p.d      # K/V-outer rule: Br = min(Bc, d)


@pytest.mark.parametrize("algorithm", BWD)
def test_fully_masked_rows_give_zero_gradients(algorithm):
    # Nq > Nk causal: the first Nq − Nk rows see nothing; their dq is 0, nothing is NaN
    rng = np.random.default_rng(6)
    q, k, v = rng.standard_normal((12, 4)), rng.standard_normal((5, 4)), rng.standard_normal((5, 3))
    f = fs.simulate(q, k, v, "flash2", block_sizes=(4, 2), causal=True)
    dout = rng.standard_normal(f.out.shape)
    g = fs.simulate_backward(q, k, v, f.out, f.lse, dout, algorithm, causal=True,
                             block_sizes=None if algorithm == "standard" else (4, 2))
    assert all(np.isfinite(x).all() for x in (g.dq, g.dk, g.dv))
    assert (g.dq[:7] == 0).all()


def test_window_covering_everything_is_unmasked():
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((2, 19, 8)) for _ in range(3))
    dout = rng.standard_normal((2, 19, 8))
    f = fs.simulate(q, k, v, "flash2", block_sizes=(4, 4))
    for window in [(-1, -1), (100, 100), (18, 18)]:
        fw = fs.simulate(q, k, v, "flash2", block_sizes=(4, 4), window=window)
        np.testing.assert_array_equal(fw.out, f.out)
        assert fw.traffic == f.traffic
        a = fs.simulate_backward(q, k, v, f.out, f.lse, dout, "flash2", block_sizes=(4, 4))
        b = fs.simulate_backward(q, k, v, f.out, f.lse, dout, "flash2", block_sizes=(4, 4),
                                 window=window)
        np.testing.assert_array_equal(a.dq, b.dq)
        assert a.traffic == b.traffic


def test_gqa_gradients_sum_over_the_group():
    rng = np.random.default_rng(8)
    q = rng.standard_normal((6, 10, 4))
    k, v = rng.standard_normal((2, 13, 4)), rng.standard_normal((2, 13, 4))
    f = fs.simulate(q, k, v, "flash2", block_sizes=(4, 4))
    dout = rng.standard_normal(f.out.shape)
    g = fs.simulate_backward(q, k, v, f.out, f.lse, dout, "flash2", block_sizes=(4, 4))
    k3, v3 = np.repeat(k, 3, axis=0), np.repeat(v, 3, axis=0)
    g3 = fs.simulate_backward(q, k3, v3, f.out, f.lse, dout, "flash2", block_sizes=(4, 4))
    np.testing.assert_allclose(g.dk, g3.dk.reshape(2, 3, 13, 4).sum(axis=1), rtol=1e-12)
    np.testing.assert_allclose(g.dq, g3.dq, rtol=1e-12)
    assert g.traffic == g3.traffic   # each query head writes its own dK_j, dV_j


def test_flash2_backward_counts_by_hand():
    """Nq = Nk = 8, d = dv = 2, Br = Bc = 4, fp16, no mask: Tc = 2 K/V tiles each meet
    all 8 rows, so R = 16 rows streamed."""
    t = fs.count_backward("flash2", Nq=8, Nk=8, d=2, block_sizes=(4, 4))
    R, N, d = 16, 8, 2
    assert t.reads == {"Q": R * d * 2, "K": N * d * 2, "V": N * d * 2, "O": N * d * 2,
                       "L": R * 4, "dO": (N + R) * d * 2, "D": R * 4,
                       "dQacc": (N + R) * d * 4}
    assert t.writes == {"D": N * 4, "dQacc": (N + R) * d * 4, "dQ": N * d * 2,
                        "dK": N * d * 2, "dV": N * d * 2}


def test_compulsory_is_a_lower_bound():
    for alg in ("flash1", "flash2"):
        for N in (128, 1000, 4096):
            kw = dict(Nq=N, Nk=N, d=64)
            low_f = theory.compulsory(**kw)
            low_b = theory.compulsory(**kw, backward=True)
            for sram in ("16KiB", "96KiB", "1MiB"):
                fwd = fs.count(alg, **kw, sram_bytes=sram)
                bwd = fs.count_backward(alg, **kw, sram_bytes=sram)
                # flash1 keeps no L, so compare without it
                floor_f = low_f.total_bytes - (N * 4 if alg == "flash1" else 0)
                assert fwd.total_bytes >= floor_f
                assert bwd.total_bytes >= low_b.total_bytes - N * 4  # flash1 reads ℓ, m not L


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"algorithm": "splitkv"}, ValueError, "flash2"),
    ({"algorithm": "square"}, ValueError, "no backward"),
    ({"out_shape": (2, 10, 7)}, ValueError, "out has shape"),
    ({"lse_shape": (2, 9)}, ValueError, "lse has shape"),
    ({"dout_nan": True}, ValueError, "dout contains"),
    ({"lse_nan": True}, ValueError, "lse contains"),
    ({"window": (-2, 0)}, ValueError, ">= -1"),
    ({"softcap": 0.0}, ValueError, "softcap"),
    ({"softcap": -1.0}, ValueError, "softcap"),
    ({"alibi_slopes": [1.0, 2.0, 3.0]}, ValueError, "alibi_slopes must have shape"),
])
def test_bad_backward_input(kwargs, exc, match):
    rng = np.random.default_rng(9)
    q, k, v = (rng.standard_normal((2, 10, 4)) for _ in range(3))
    f = fs.simulate(q, k, v, "flash2", block_sizes=(4, 4))
    out, lse, dout = f.out, f.lse, rng.standard_normal(f.out.shape)
    if "out_shape" in kwargs:
        out = np.zeros(kwargs.pop("out_shape"))
    if "lse_shape" in kwargs:
        lse = np.zeros(kwargs.pop("lse_shape"))
    if kwargs.pop("dout_nan", False):
        dout = dout.copy()
        dout[0, 0, 0] = np.nan
    if kwargs.pop("lse_nan", False):
        lse = lse.copy()
        lse[0, 0] = np.nan
    algorithm = kwargs.pop("algorithm", "flash2")
    with pytest.raises(exc, match=match):
        fs.simulate_backward(q, k, v, out, lse, dout, algorithm, block_sizes=(4, 4), **kwargs)
