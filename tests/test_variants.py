"""Forward variants (sliding window, softcap, ALiBi) against an oracle written here from
FlashAttention's definitions, one problem at a time, sharing no code with the package."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import flashsim as fs
from flashsim import theory
from flashsim.problem import itemsize_of
from flashsim.strategies import attention_problems, block_sizes, head_dims, random_tensor, seq_lens

CORE = ("standard", "flash1", "flash2")
WINDOWS = st.sampled_from([None, (-1, -1), (0, 0), (3, 2), (7, -1), (-1, 5), (1, 0)])


def blocks_for(algorithm, p):
    """p's tiles; standard attention runs whole matrices (the paper's count) for even
    Nq and tiled products (as the GPU runs them) for odd, so both are drawn."""
    return None if algorithm == "standard" and p.Nq % 2 == 0 else p.block_sizes


def oracle(q, k, v, *, causal, window, softcap, slope):
    """One 2-D problem: S = softcap(QKᵀ/√d) − slope·|i + Nk − Nq − j|, band-masked."""
    Nq, Nk = q.shape[0], k.shape[0]
    S = (q @ k.T) / np.sqrt(q.shape[1])
    if softcap is not None:
        S = softcap * np.tanh(S / softcap)
    i = np.arange(Nq)[:, None] + Nk - Nq
    j = np.arange(Nk)[None, :]
    S = S - slope * np.abs(i - j)
    left, right = (-1, -1) if window is None else window
    if causal:
        right = 0 if right == -1 else min(right, 0)
    ok = np.ones((Nq, Nk), bool)
    if left != -1:
        ok &= j >= i - left
    if right != -1:
        ok &= j <= i + right
    out = np.zeros((Nq, v.shape[1]))
    lse = np.full(Nq, -np.inf)
    for r in range(Nq):
        if ok[r].any():
            s = S[r, ok[r]]
            m = s.max()
            e = np.exp(s - m)
            out[r] = e @ v[ok[r]] / e.sum()
            lse[r] = m + np.log(e.sum())
    return out, lse


@st.composite
def multihead(draw):
    """(H, N, d) arrays with one K/V head per query head, so the oracle pairs them."""
    H = draw(st.integers(1, 3))
    Nq, Nk = draw(seq_lens(70)), draw(seq_lens(70))
    d, dv = draw(head_dims(16)), draw(head_dims(16))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return (random_tensor(rng, (H, Nq, d)), random_tensor(rng, (H, Nk, d)),
            random_tensor(rng, (H, Nk, dv)), draw(st.booleans()), draw(block_sizes(32)))


@settings(max_examples=80)
@given(multihead(), st.sampled_from(CORE), WINDOWS, st.sampled_from([None, 0.7, 10.0]),
       st.booleans())
def test_variants_equal_oracle(problem, algorithm, window, softcap, alibi):
    q, k, v, causal, blocks = problem
    H = q.shape[0]
    slopes = np.linspace(0.1, 2.0, H) if alibi else None
    r = fs.simulate(q, k, v, algorithm, causal=causal, window=window, softcap=softcap,
                    alibi_slopes=slopes,
                    block_sizes=None if algorithm == "standard" and H % 2 == 0 else blocks)
    for h in range(H):
        o, l = oracle(q[h], k[h], v[h], causal=causal, window=window, softcap=softcap,
                      slope=0.0 if slopes is None else slopes[h])
        np.testing.assert_allclose(r.out[h], o, rtol=1e-10, atol=1e-10 * max(1, np.abs(v).max()))
        assert np.array_equal(np.isneginf(r.lse[h]), np.isneginf(l))
        fin = np.isfinite(l)
        np.testing.assert_allclose(r.lse[h][fin], l[fin], rtol=1e-10, atol=1e-10)


@given(attention_problems(max_seq=90, max_dim=16, allow_empty=True), st.sampled_from(CORE),
       WINDOWS, st.sampled_from(["float16", "float32"]))
def test_window_traffic_equals_count_and_theory(p, algorithm, window, io):
    blocks = blocks_for(algorithm, p)
    r = fs.simulate(p.q, p.k, p.v, algorithm, block_sizes=blocks, causal=p.causal,
                    window=window, io_dtype=io)
    c = fs.count(algorithm, Nq=p.Nq, Nk=p.Nk, d=p.d, dv=p.dv, batch_shape=p.q.shape[:-2],
                 kv_batch_shape=p.k.shape[:-2], block_sizes=blocks, causal=p.causal,
                 window=window, io_dtype=io)
    assert r.traffic == c, r.traffic.diff(c)
    Br, Bc = blocks or (None, None)
    t = theory.traffic(algorithm, Nq=p.Nq, Nk=p.Nk, d=p.d, dv=p.dv, Br=Br, Bc=Bc,
                       causal=p.causal, window=window, itemsize=itemsize_of(io),
                       problems=int(np.prod(r.out.shape[:-2])))
    assert c == t, c.diff(t)


def test_sliding_window_traffic_is_linear_in_n():
    """A window of w keys makes flash2's K/V traffic O(N·w) instead of O(N²/Br·…)."""
    kw = dict(d=64, block_sizes=(128, 64), window=(256, 0))
    t1, t2, t4 = (fs.count("flash2", Nq=n, Nk=n, **kw).reads["K"]
                  for n in (2**14, 2**15, 2**16))
    # linear up to the first tiles, which see fewer than w keys: equal increments
    assert t4 - t2 == 2 * (t2 - t1)
    full = fs.count("flash2", Nq=2**15, Nk=2**15, d=64, block_sizes=(128, 64), causal=True)
    assert t2 * 20 < full.reads["K"]


def test_softcap_and_alibi_change_no_count():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 40, 8)) for _ in range(3))
    base = fs.simulate(q, k, v, "flash2", block_sizes=(8, 8), causal=True)
    var = fs.simulate(q, k, v, "flash2", block_sizes=(8, 8), causal=True, softcap=3.0,
                      alibi_slopes=[0.5, 0.25])
    assert var.traffic == base.traffic
    assert not np.allclose(var.out, base.out)


def test_softcap_bounds_the_scores():
    # with a softcap c every score lies in (−c, c), so a single huge logit cannot take
    # all the weight: exp(2c) bounds the ratio of any two probabilities
    q = np.array([[1000.0, 0.0]])
    k = np.array([[1.0, 0.0], [0.0, 1.0]])
    v = np.array([[1.0], [0.0]])
    r = fs.simulate(q, k, v, "flash2", block_sizes=(1, 1), softcap=1.0, scale=1.0)
    p0 = r.out[0, 0]
    assert p0 / (1 - p0) <= np.exp(1.0) * (1 + 1e-12)


@pytest.mark.parametrize("kw, exc, match", [
    ({"window": (-2, 3)}, ValueError, ">= -1"),
    ({"window": (1.5, 3)}, TypeError, "integer"),
    ({"window": 5}, TypeError, "pair"),
    ({"softcap": 0}, ValueError, "> 0"),
    ({"softcap": -2.0}, ValueError, "> 0"),
    ({"softcap": "big"}, TypeError, "softcap"),
    ({"alibi_slopes": np.ones(3)}, ValueError, r"\(2,\)"),
    ({"alibi_slopes": np.ones((3, 2))}, ValueError, "shape"),
    ({"alibi_slopes": [np.nan, 1.0]}, ValueError, "finite"),
])
def test_bad_variant_options(kw, exc, match):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 10, 4)) for _ in range(3))
    with pytest.raises(exc, match=match):
        fs.simulate(q, k, v, "flash2", block_sizes=(4, 4), **kw)
