"""The simulator computes real attention: every algorithm equals the dense float64
oracle, on awkward shapes, with masks, GQA and large logits."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import flashsim as fs
from flashsim.strategies import attention_problems

# the three schedules of the FlashAttention papers; splitkv and square have their own tests
CORE = ("standard", "flash1", "flash2")

RTOL = 1e-10


def blocks_for(algorithm, p):
    """p's tiles; standard attention runs whole matrices (the paper's count) for even
    Nq and tiled products (as the GPU runs them) for odd, so both are drawn."""
    return None if algorithm == "standard" and p.Nq % 2 == 0 else p.block_sizes


def assert_matches_reference(r, ref_out, ref_lse, v):
    # Outputs are convex combinations of V's rows, so their error scales with |V|;
    # a relative bound alone would be meaningless for an output element near 0.
    vmax = max(1.0, float(np.abs(v).max(initial=0.0)))
    np.testing.assert_allclose(r.out, ref_out, rtol=RTOL, atol=RTOL * vmax)
    assert np.array_equal(np.isneginf(r.lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(r.lse[fin], ref_lse[fin], rtol=RTOL,
                               atol=RTOL * max(1.0, float(np.abs(ref_lse[fin]).max(initial=0))))


@given(attention_problems(allow_empty=True), st.sampled_from(CORE))
def test_every_algorithm_equals_dense_float64(p, algorithm):
    ref_out, ref_lse = fs.attention_reference(p.q, p.k, p.v, causal=p.causal)
    blocks = blocks_for(algorithm, p)
    r = fs.simulate(p.q, p.k, p.v, algorithm, block_sizes=blocks, causal=p.causal)
    assert r.out.shape == ref_out.shape and r.lse.shape == ref_lse.shape
    assert r.out.dtype == np.float64 and r.lse.dtype == np.float64
    assert np.isfinite(r.out).all(), "no NaN/Inf even for rows that see no key"
    assert_matches_reference(r, ref_out, ref_lse, p.v)


def _scipy_reference(q, k, v, causal):
    """An independent oracle: scipy's softmax, one problem at a time, no shared code."""
    from scipy.special import logsumexp, softmax
    S = (q @ k.T) / np.sqrt(q.shape[-1])
    if causal:
        Nq, Nk = S.shape
        S = np.where(np.arange(Nk)[None, :] <= np.arange(Nq)[:, None] + Nk - Nq, S, -np.inf)
    return softmax(S, axis=-1) @ v, logsumexp(S, axis=-1)


@settings(max_examples=40)
@given(attention_problems(max_seq=90, max_dim=24), st.sampled_from(CORE))
def test_reference_agrees_with_scipy(p, algorithm):
    # Rows that see no key are excluded here: scipy returns NaN for them by design.
    q, k, v = (x.reshape((-1,) + x.shape[-2:]) for x in (p.q, p.k, p.v))
    if q.shape[0] != k.shape[0]:
        return  # GQA/broadcast layouts are covered against the package's own oracle
    blocks = blocks_for(algorithm, p)
    r = fs.simulate(p.q, p.k, p.v, algorithm, block_sizes=blocks, causal=p.causal)
    out = r.out.reshape((-1,) + r.out.shape[-2:])
    lse = r.lse.reshape((-1, r.lse.shape[-1]))
    for b in range(q.shape[0]):
        with np.errstate(invalid="ignore"):
            o_ref, l_ref = _scipy_reference(q[b], k[b], v[b], p.causal)
        seen = np.isfinite(l_ref)
        np.testing.assert_allclose(out[b][seen], o_ref[seen], rtol=RTOL,
                                   atol=RTOL * max(1.0, np.abs(v).max()))
        np.testing.assert_allclose(lse[b][seen], l_ref[seen], rtol=RTOL)


def test_seed_worked_example():
    """One query, four keys: S row [0.1, 0.3, 0.5, 0.7] and V = [7, 8, 9, 10] give
    softmax(S)·V = 8.7472 (to 4 places), whichever way the keys are tiled."""
    s = np.array([0.1, 0.3, 0.5, 0.7])
    q = np.array([[1.0]])
    k = s[:, None]
    v = np.array([[7.0], [8.0], [9.0], [10.0]])
    expected = (np.exp(s) @ v[:, 0]) / np.exp(s).sum()
    assert round(expected, 4) == 8.7472
    for algorithm, blocks in [("standard", None), ("flash1", (1, 1)), ("flash1", (1, 3)),
                              ("flash2", (1, 2)), ("flash2", (1, 3)), ("flash2", (1, 4))]:
        r = fs.simulate(q, k, v, algorithm, block_sizes=blocks, scale=1.0)
        assert r.out[0, 0] == pytest.approx(expected, rel=1e-14)
        assert r.lse[0] == pytest.approx(np.log(np.exp(s).sum()), rel=1e-14)


@pytest.mark.parametrize("algorithm", CORE)
def test_huge_logits_stay_finite(algorithm):
    rng = np.random.default_rng(1)
    q = rng.standard_normal((37, 16)) * 300   # logits of order 1e4-1e5
    k = rng.standard_normal((53, 16)) * 300
    v = rng.standard_normal((53, 8))
    r = fs.simulate(q, k, v, algorithm, block_sizes=None if algorithm == "standard" else (5, 7))
    ref_out, ref_lse = fs.attention_reference(q, k, v)
    assert np.isfinite(r.out).all() and np.isfinite(r.lse).all()
    np.testing.assert_allclose(r.out, ref_out, rtol=1e-10, atol=1e-10 * np.abs(v).max())
    np.testing.assert_allclose(r.lse, ref_lse, rtol=1e-12)


@pytest.mark.parametrize("algorithm", ["flash1", "flash2"])
def test_rows_seeing_no_key_output_zero(algorithm):
    # Nq > Nk with a bottom-right causal mask: the first Nq - Nk rows see nothing.
    rng = np.random.default_rng(2)
    q, k, v = rng.standard_normal((20, 4)), rng.standard_normal((6, 4)), rng.standard_normal((6, 3))
    r = fs.simulate(q, k, v, algorithm, block_sizes=(4, 4), causal=True)
    assert (r.out[:14] == 0).all() and np.isneginf(r.lse[:14]).all()
    assert np.isfinite(r.lse[14:]).all()
    ref_out, _ = fs.attention_reference(q, k, v, causal=True)
    np.testing.assert_allclose(r.out, ref_out, rtol=1e-12, atol=1e-12)


def test_gqa_matches_repeated_kv_heads():
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 6, 33, 8))
    k = rng.standard_normal((2, 2, 41, 8))
    v = rng.standard_normal((2, 2, 41, 5))
    r = fs.simulate(q, k, v, "flash2", block_sizes=(8, 16), causal=True)
    # query heads 0-2 use K/V head 0 and 3-5 use head 1: contiguous groups
    k_rep, v_rep = np.repeat(k, 3, axis=1), np.repeat(v, 3, axis=1)
    r_rep = fs.simulate(q, k_rep, v_rep, "flash2", block_sizes=(8, 16), causal=True)
    np.testing.assert_array_equal(r.out, r_rep.out)
    assert r.traffic == r_rep.traffic  # no sharing of K/V tiles between heads is assumed


def test_low_precision_inputs_are_computed_in_float64():
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((50, 16)).astype(np.float16) for _ in range(3))
    r = fs.simulate(q, k, v, "flash2", block_sizes=(16, 16))
    ref_out, _ = fs.attention_reference(q.astype(np.float64), k.astype(np.float64),
                                        v.astype(np.float64))
    np.testing.assert_allclose(r.out, ref_out, rtol=1e-10, atol=1e-12)
    assert r.traffic.reads["Q"] == 50 * 16 * 2   # bytes counted at fp16 by default
    r32 = fs.simulate(q, k, v, "flash2", block_sizes=(16, 16), io_dtype="float32")
    assert r32.traffic.reads["Q"] == 50 * 16 * 4


@settings(max_examples=40)
@given(attention_problems(max_seq=70, max_dim=24), st.sampled_from(CORE),
       st.sampled_from(["float16", "bfloat16", "float64"]))
def test_kernel_precision_of_each_gpu_algorithm(p, algorithm, io):
    """precision="kernel" (the GPU kernels' roundings) stays within what those roundings
    allow of the float64 result: FlashAttention's 2× the same-dtype error, one rounding
    of the output, and for flash1 one rounding of O (ℓ: fp32) per K/V tile it visits."""
    from flashsim.precision import make_precision
    from flashsim.testing import EPS, same_dtype_errors
    rnd = make_precision("kernel", io).io_round
    q, k, v = (np.asarray(rnd(x), np.float64) for x in (p.q, p.k, p.v))
    blocks = blocks_for(algorithm, p)
    exact = fs.simulate(q, k, v, algorithm, block_sizes=blocks, causal=p.causal)
    kern = fs.simulate(q, k, v, algorithm, block_sizes=blocks, causal=p.causal, io_dtype=io,
                       precision="kernel")
    assert kern.traffic == fs.simulate(q, k, v, algorithm, block_sizes=blocks, causal=p.causal,
                                       io_dtype=io).traffic
    base_io = "float32" if io == "float64" else io     # m, ℓ, L are fp32 in every kernel
    base = same_dtype_errors(q, k, v, exact.out, io_dtype=base_io, causal=p.causal)[0]
    vmax = np.abs(v).max(initial=0)
    tol = 2 * base + EPS[base_io] * vmax
    if algorithm == "flash1":
        Tc = -(-p.Nk // blocks[1])
        tol += Tc * (EPS[io] / 2 + 2 * EPS["float32"]) * vmax
    assert np.abs(kern.out - exact.out).max(initial=0) <= tol
