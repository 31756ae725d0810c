"""The three rules for the softmax's m (flashsim.running_max): the same attention in
exact arithmetic, the same traffic, and in the kernels' precision the roundings each one
causes; the lazy rule's bound and its warp-wide vote; bad requests refused."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

import flashsim as fs
from flashsim import running_max
from flashsim.precision import make_precision


def _inputs(seed, Nq=333, Nk=200, d=32, scale=3.0, dtype="float16"):
    rng = np.random.default_rng(seed)
    rnd = make_precision("kernel", dtype).io_round
    q, k = (rnd(rng.standard_normal((2, 2, n, d)) * scale).astype(np.float64) for n in (Nq, Nk))
    v = rnd(rng.standard_normal((2, 2, Nk, d))).astype(np.float64)
    return q, k, v


VARIANTS = [dict(), dict(causal=True), dict(window=(70, 3)), dict(window=(0, 0))]


@pytest.mark.parametrize("kw", VARIANTS)
@pytest.mark.parametrize("rule", ["fixed", "lazy"])
def test_every_rule_is_the_same_attention_and_traffic(rule, kw):
    """exp(S − m)/Σ exp(S − m) is the softmax for any m: in float64 each rule gives the
    online rule's O and L to float64 roundings, with the same bytes moved, rows that
    see no key included (O = 0, L = −∞)."""
    q, k, v = _inputs(0)
    common = dict(block_sizes=(64, 32), softcap=30.0, io_dtype="float16", **kw)
    online = fs.simulate(q, k, v, **common)
    ruled = fs.simulate(q, k, v, softmax_max=rule, **common)
    assert ruled.traffic == online.traffic
    fin = np.isfinite(online.lse)
    assert np.array_equal(np.isfinite(ruled.lse), fin)
    assert (ruled.out[~fin] == 0).all()
    np.testing.assert_allclose(ruled.out, online.out, rtol=0, atol=1e-12)
    np.testing.assert_allclose(ruled.lse[fin], online.lse[fin], rtol=0, atol=1e-12)


@pytest.mark.parametrize("kw", VARIANTS[:3])
def test_the_kernel_precision_shows_each_rules_roundings(kw):
    """In the kernels' precision the fixed (bfloat16) and lazy (float16) rules round the
    dominant key's weight P ≠ 1 to the I/O type, which the online rule's P = 1 never is:
    on peaked rows (q, k × 3) their O is further from the exact one than the online
    rule's, within a few roundings of P; L, which takes ℓ in fp32, is not."""
    for dtype, rule, eps in (("bfloat16", "fixed", 2.0**-8), ("float16", "lazy", 2.0**-11)):
        q, k, v = _inputs(1, dtype=dtype)
        common = dict(block_sizes=(64, 64), softcap=30.0, io_dtype=dtype, **kw)
        exact = fs.simulate(q, k, v, **common)
        online, ruled = (fs.simulate(q, k, v, precision="kernel", softmax_max=r, **common)
                         for r in ("online", rule))
        e_online, e_ruled = (np.abs(x.out - exact.out).max() for x in (online, ruled))
        assert e_online < e_ruled <= 4 * eps * np.abs(v).max(), (dtype, e_online, e_ruled)
        fin = np.isfinite(exact.lse)
        for x in (online, ruled):
            np.testing.assert_allclose(x.lse[fin], exact.lse[fin], rtol=0, atol=1e-5)


SLOPES = [np.array([0.5, 0.02]), np.array([1e-4, 0.0]), np.array([-0.05, 0.3]),
          np.array([[0.1, 0.7], [-0.2, 0.01]])]       # steep, flat, negative, per batch entry


@pytest.mark.parametrize("kw", VARIANTS + [dict(window=(-1, 5)), dict(window=(400, 400))])
@pytest.mark.parametrize("slopes", SLOPES, ids=["steep", "flat", "negative", "per-batch"])
@pytest.mark.parametrize("Nq, Nk", [(333, 200), (200, 333)])
def test_the_fixed_rule_with_alibi_is_the_same_attention_and_traffic(kw, slopes, Nq, Nk):
    """With ALiBi the fixed rule takes m per row (fixed_max_rows): in float64 the online
    rule's O and L and the same bytes, for steep, flat, negative and per-batch slopes,
    Nq ≠ Nk both ways (rows without their diagonal key), causal, windows, rows that see
    no key."""
    q, k, v = _inputs(5, Nq=Nq, Nk=Nk)
    common = dict(block_sizes=(64, 32), softcap=30.0, alibi_slopes=slopes,
                  io_dtype="bfloat16", **kw)
    _assert_same_attention(fs.simulate(q, k, v, softmax_max="fixed", **common),
                           fs.simulate(q, k, v, **common))


def _assert_same_attention(ruled, online):
    """A rule's float64 run against the online one's: the same bytes, the same rows
    without a key (O = 0, L = −∞), O and L to float64 roundings."""
    assert ruled.traffic == online.traffic
    fin = np.isfinite(online.lse)
    assert np.array_equal(np.isfinite(ruled.lse), fin)
    assert (ruled.out[~fin] == 0).all()
    np.testing.assert_allclose(ruled.out, online.out, rtol=0, atol=1e-12)
    np.testing.assert_allclose(ruled.lse[fin], online.lse[fin], rtol=1e-14, atol=1e-12)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 40), st.integers(1, 40), st.integers(-1, 12), st.integers(-1, 12),
       st.booleans(), st.floats(-2, 2, allow_subnormal=False), st.floats(0.5, 54))
def test_the_fixed_max_of_a_row_is_the_softcaps_plus_its_largest_visible_bias(
        Nq, Nk, left, right, causal, slope, c):
    """fixed_max_rows against every key: m(r) − fixed_max(c) is the largest ALiBi bias
    −slope·|r + off − key| over the keys row r sees (fixed_max(c) where it sees none), so
    every logit c·tanh(·) + bias lies in [m(r) − 2c, m(r)] shifted as the softcap alone's
    [−c, c] is by fixed_max: P = exp(S − m) keeps the unshifted rule's bounds."""
    from flashsim.variants import make_band
    band = make_band(causal, (left, right))
    rows, keys, off = np.arange(Nq), np.arange(Nk), Nk - Nq
    m = running_max.fixed_max_rows(c, np.array([slope]), band, rows, off, Nk)[0]
    seen = band.allowed(rows, keys, off)
    bias = -slope * np.abs(rows[:, None] + off - keys[None, :]).astype(np.float64)
    want = np.where(seen.any(axis=1), np.where(seen, bias, -np.inf).max(axis=1), 0.0)
    np.testing.assert_allclose(m - running_max.fixed_max(c), want, rtol=1e-15, atol=1e-12)
    assert running_max.fixed_max_rows(c, None, band, rows, off, Nk) == running_max.fixed_max(c)


@pytest.mark.parametrize("kw", VARIANTS[:3])
def test_the_fixed_rule_with_alibi_rounds_within_a_few_of_p(kw):
    """In bfloat16 kernel precision the fixed rule with ALiBi keeps O within a few
    roundings of P of the exact one (as the softcap alone does), and L within fp32's."""
    q, k, v = _inputs(6, dtype="bfloat16")
    for slopes in SLOPES[:3]:
        common = dict(block_sizes=(64, 64), softcap=30.0, alibi_slopes=slopes,
                      io_dtype="bfloat16", **kw)
        exact = fs.simulate(q, k, v, **common)
        ruled = fs.simulate(q, k, v, precision="kernel", softmax_max="fixed", **common)
        assert np.abs(ruled.out - exact.out).max() <= 4 * 2.0**-8 * np.abs(v).max()
        fin = np.isfinite(exact.lse)
        np.testing.assert_allclose(ruled.lse[fin], exact.lse[fin], rtol=0, atol=1e-5)


@pytest.mark.parametrize("kw", VARIANTS + [dict(window=(-1, 5))])
@pytest.mark.parametrize("slopes", SLOPES, ids=["steep", "flat", "negative", "per-batch"])
@pytest.mark.parametrize("Nq, Nk", [(333, 200), (200, 333)])
@pytest.mark.parametrize("softcap", [30.0, None])
def test_the_lazy_rule_with_alibi_is_the_same_attention_and_traffic(kw, slopes, Nq, Nk, softcap):
    """With ALiBi the lazy rule visits each Q tile's diagonal key tile first
    (key_order): in float64 the online rule's O and L and the same bytes, with a softcap
    or without, for steep, flat, negative and per-batch slopes, Nq ≠ Nk both ways,
    causal, windows, rows that see no key."""
    q, k, v = _inputs(7, Nq=Nq, Nk=Nk)
    common = dict(block_sizes=(64, 64), softcap=softcap, alibi_slopes=slopes,
                  io_dtype="float16", **kw)
    _assert_same_attention(fs.simulate(q, k, v, softmax_max="lazy", **common),
                           fs.simulate(q, k, v, **common))


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 6), st.integers(0, 6), st.integers(0, 2000), st.integers(1, 256),
       st.integers(-600, 600), st.sampled_from([16, 64, 128]))
def test_the_lazy_rules_order_takes_the_diagonal_key_tile_first(jf, n, i0, rows, off, Bc):
    """key_order: every tile j_first … j_last once; without ALiBi in key order; with it,
    first the tile of the middle row's diagonal key (r + off), clamped to the tiles the
    Q tile visits, then the others in key order."""
    jl = jf + n
    assert running_max.key_order(jf, jl, i0, rows, off, Bc, False) == list(range(jf, jl + 1))
    order = running_max.key_order(jf, jl, i0, rows, off, Bc, True)
    assert sorted(order) == list(range(jf, jl + 1))
    assert order[1:] == sorted(order[1:])
    key = i0 + rows // 2 + off
    if key < jf * Bc:
        assert order[0] == jf
    elif key >= (jl + 1) * Bc:
        assert order[0] == jl
    else:
        assert order[0] * Bc <= key < (order[0] + 1) * Bc
    assert running_max.key_order(3, 2, i0, rows, off, Bc, True) == []


@pytest.mark.parametrize("causal", [False, True])
def test_with_alibi_the_diagonal_tile_first_keeps_the_lazy_max_still(causal):
    """Why the order (NOTES v69): ALiBi's logits rise along a row towards its diagonal
    key, so in key order the lazy rule moves m at many steps (at ~24% of warp-steps here,
    ~47% causal: each such step runs its exponentials twice); from the diagonal tile,
    which holds each row's largest biases, at none. 16 heads with the standard slopes
    2^(−8h/16), softcap 30, N = 512, 128 × 128 tiles."""
    rng = np.random.default_rng(0)
    H, N, d, B = 16, 512, 64, 128
    slopes = 2.0 ** (-8.0 * np.arange(1, H + 1) / H)
    q, k = rng.standard_normal((2, H, N, d))
    S_all = 30 * np.tanh((q @ k.transpose(0, 2, 1)) / np.sqrt(d) / 30)
    S_all = S_all - slopes[:, None, None] * np.abs(np.arange(N)[:, None] - np.arange(N)[None])
    if causal:
        S_all = np.where(np.arange(N)[None, :] <= np.arange(N)[:, None], S_all, -np.inf)
    moved = {}
    for diagonal in (False, True):
        moved[diagonal] = steps = 0
        for i in range(N // B):
            order = running_max.key_order(0, i if causal else N // B - 1, i * B, B, 0, B, diagonal)
            m = S_all[:, i * B:(i + 1) * B, order[0] * B:(order[0] + 1) * B].max(-1)
            for j in order[1:]:
                _, _, m_new = running_max.lazy_step(S_all[:, i * B:(i + 1) * B, j * B:(j + 1) * B], m)
                moved[diagonal] += (m_new != m).reshape(H, -1, running_max.WARP_ROWS).any(-1).sum()
                steps += H * B // running_max.WARP_ROWS
                m = m_new
        moved[diagonal] /= steps
    assert moved[True] == 0 and moved[False] > 0.2, moved


@pytest.mark.parametrize("kw", VARIANTS[:3])
def test_the_lazy_rule_with_alibi_rounds_within_a_few_of_p(kw):
    """In float16 kernel precision the lazy rule with ALiBi (the diagonal key tile
    first) keeps O within a few roundings of P of the exact one, and L within a few of
    fp32's."""
    q, k, v = _inputs(8, dtype="float16")
    for slopes in SLOPES[:3]:
        for softcap in (30.0, None):
            common = dict(block_sizes=(64, 64), softcap=softcap, alibi_slopes=slopes,
                          io_dtype="float16", **kw)
            exact = fs.simulate(q, k, v, **common)
            ruled = fs.simulate(q, k, v, precision="kernel", softmax_max="lazy", **common)
            assert np.abs(ruled.out - exact.out).max() <= 4 * 2.0**-11 * np.abs(v).max()
            fin = np.isfinite(exact.lse)   # (|L| up to ~60 with the biases: fp32's ulps)
            np.testing.assert_allclose(ruled.lse[fin], exact.lse[fin], rtol=1e-6, atol=1e-5)


def test_a_row_of_one_key_gives_v_under_the_online_max_alone():
    """One key: the online rule's P = 1 gives O = V exactly; the fixed one's P is
    2^(x − m) rounded to bfloat16, over ℓ in fp32, a rounding away (as measured on the
    GPU, NOTES v60)."""
    q, k, v = _inputs(2, Nq=64, Nk=1, dtype="bfloat16")
    common = dict(block_sizes=(64, 64), softcap=30.0, io_dtype="bfloat16", precision="kernel")
    online = fs.simulate(q, k, v, **common)
    fixed = fs.simulate(q, k, v, softmax_max="fixed", **common)
    target = np.broadcast_to(v, online.out.shape)
    assert np.array_equal(online.out, target)
    assert not np.array_equal(fixed.out, target)
    np.testing.assert_allclose(fixed.out, target, rtol=2.0**-7)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.integers(1, 40), st.data())
def test_a_lazy_step_keeps_every_p_within_its_bound(rows, keys, data):
    """Whatever the scores (masked entries included) and the m before (−∞ included), a
    lazy step leaves every P in [0, 2^12], m only up and never past the row's max, α in
    [0, 1] and 1 wherever m stays, and ℓ·α + Σ P, O·α + P V equal to the online step's
    in exact arithmetic."""
    finite = st.floats(-60, 60)
    S = data.draw(arrays(np.float64, (rows, keys), elements=st.one_of(finite, st.just(-np.inf))))
    m = data.draw(arrays(np.float64, (rows,), elements=st.one_of(finite, st.just(-np.inf))))
    P, alpha, m_new = running_max.lazy_step(S, m)
    assert np.isfinite(P).all() and (P >= 0).all() and (P <= running_max.LAZY_BOUND).all()
    assert (m_new >= m).all()
    mx = S.max(axis=-1)
    assert ((m_new == m) | (m_new == mx)).all()
    assert ((alpha >= 0) & (alpha <= 1)).all() and (alpha[m_new == m] == 1).all()
    # the step against the online one: both give Σ exp(S − ref) for their own ref
    ref = np.where(np.isneginf(m_new), 0.0, m_new)
    np.testing.assert_allclose(P, np.exp(S - ref[:, None]), rtol=1e-12, atol=0)


def test_the_lazy_vote_is_a_warps():
    """A share of one row past 2^12 moves every row of its warp (16 rows) whose max
    passed m, and no row of another warp; a row that has seen no key moves its warp too."""
    rows, keys = 48, 64
    S = np.zeros((rows, keys))
    m = np.full(rows, -1.0)                    # every row's max (0) passed m by 1
    P, alpha, m_new = running_max.lazy_step(S, m)
    assert (m_new == m).all() and (alpha == 1).all()          # shares e·16 ≪ 2^12: quiet
    S[20, 0:2] = 12.0                          # row 20 (warp 1): one thread's share > 2^12
    P, alpha, m_new = running_max.lazy_step(S, m)
    moved = m_new != m
    assert moved[16:32].all() and not moved[:16].any() and not moved[32:].any()
    assert m_new[20] == 12.0 and (m_new[16:32][np.arange(16) != 4] == 0.0).all()
    S[20, 0:2] = 0.0
    m[40] = -np.inf                            # row 40 (warp 2) has seen no key
    P, alpha, m_new = running_max.lazy_step(S, m)
    moved = m_new != m
    assert moved[32:].all() and not moved[:32].any()
    # keys spread over the 4 threads of the quad: 2^12 in all, under 2^12 each: quiet
    S2 = np.full((16, 8), np.log(2.0**12 / 8))
    assert (running_max.lazy_step(S2, np.zeros(16))[2] == 0).all()
    S2[0, :2] = np.log(2.0**12 / 2) + 0.01       # one thread's two keys: fires
    assert running_max.lazy_step(S2, np.zeros(16))[2][0] > 0


def test_rows_past_nq_vote_as_the_kernels_do():
    """In the last Q tile the kernel's rows past Nq hold zero scores under the band: one
    that has seen no key yet (m = −∞) makes its warp take the online step."""
    S = np.zeros((10, 8))                      # 10 real rows; 6 past Nq fill the warp
    m = np.full(10, -1.0)
    assert (running_max.lazy_step(S, m)[2] == m).all()
    unseen = np.zeros(6, dtype=bool)
    unseen[3] = True
    assert (running_max.lazy_step(S, m, unseen)[2] == 0).all()


@pytest.mark.parametrize("kwargs, says", [
    (dict(softmax_max="running"), "softmax_max must be one of"),
    (dict(softmax_max="lazy", algorithm="flash1"), "rule of the flash2 forward"),
    (dict(softmax_max="fixed", algorithm="splitkv", num_splits=2), "rule of the flash2"),
    (dict(softmax_max="fixed"), "needs every logit bounded"),
    (dict(softmax_max="fixed", alibi_slopes=np.full(2, 0.1)), "bounded by a softcap"),
    (dict(softmax_max="fixed", softcap=60.0), "softcap ≤ 54.4"),
    (dict(softmax_max="fixed", softcap=60.0, alibi_slopes=np.full(2, 0.1)), "softcap ≤ 54.4"),
    (dict(softmax_max="lazy", algorithm="ring", world_size=2), "rule of the flash2"),
])
def test_a_rule_that_cannot_run_is_refused(kwargs, says):
    q, k, v = _inputs(3, Nq=32, Nk=32, d=8)
    kwargs = {"block_sizes": (16, 16), "algorithm": "flash2", **kwargs}
    if kwargs["algorithm"] == "ring":
        kwargs.pop("block_sizes")
    with pytest.raises(ValueError, match=says):
        fs.simulate(q, k, v, **kwargs)


def test_the_gpu_says_which_rule_its_forward_runs(monkeypatch):
    """fs.gpu.softmax_max: "lazy" (float16: a softcap, or ALiBi at d = 128) and "fixed"
    (bfloat16, a softcap with ALiBi or without) where the Hopper forward fed by the copy
    engine runs, and where the cp.async one does (FLASHSIM_TMA=0, d = 256; in bfloat16
    not at d = 64) and the mma.sync one (float16 without ALiBi); "lazy" in bfloat16 where
    the copy-engine forward runs its lazy instance (kernels.ws_lazy: ALiBi alone, or past
    softcap 54.4, at d = 128); "online" elsewhere: no variant, ALiBi at d = 64 or 256 and
    on the mma.sync rung, bfloat16 past softcap 54.4 or without one off the copy-engine
    forward's d = 96, 128."""
    from flashsim.gpu import flash2
    rung = ["wg"]
    monkeypatch.setattr(flash2, "_choose", lambda *a, **kw: rung[0])
    monkeypatch.setattr(flash2, "_instance", lambda shape, r="tc", backward=False: shape.d)
    with fs.gpu.emulated():                  # arrays read without a GPU
        q = np.zeros((1, 2, 256, 128), np.float16)
        rule = fs.gpu.softmax_max
        assert rule(q, q, softcap=30.0) == "lazy"
        assert rule(q, q, softcap=30.0, window=(70, 3)) == "lazy"
        assert rule(q, q) == "online" and rule(q, q, window=(8, 0)) == "online"
        sl = np.full(2, 0.1, np.float32)
        assert rule(q, q, softcap=30.0, alibi_slopes=sl) == "lazy"
        assert rule(q, q, alibi_slopes=sl, window=(70, 0)) == "lazy"
        q64 = np.zeros((1, 2, 256, 64), np.float16)
        assert rule(q64, q64, softcap=30.0) == "lazy"
        assert rule(q64, q64, softcap=30.0, alibi_slopes=sl) == "online"
        assert rule(q64, q64, alibi_slopes=sl) == "online"
        h = np.zeros((1, 2, 256, 256), np.float16)
        assert rule(h, h, softcap=30.0) == "lazy"            # D = 256: flash2_fwd_wg's
        assert rule(h, h, softcap=30.0, alibi_slopes=sl) == "online"   # (128 × 64 tiles)
        monkeypatch.setenv("FLASHSIM_TMA", "0")              # flash2_fwd_wg's, as the copy
        assert rule(q, q, softcap=30.0) == "lazy"            # engine's
        assert rule(q, q, alibi_slopes=sl) == "online"      # (float16's ALiBi: online
        assert rule(q, q, softcap=30.0, alibi_slopes=sl) == "online"   # on flash2_fwd_wg)
        assert rule(q64, q64, softcap=30.0) == "lazy"
        assert rule(q64, q64, softcap=30.0, alibi_slopes=sl) == "online"
        monkeypatch.delenv("FLASHSIM_TMA")
        rung[0] = "tc"                                       # the mma.sync forward's
        assert rule(q, q, softcap=30.0) == "lazy"
        assert rule(q, q, softcap=30.0, alibi_slopes=sl) == "online"
        assert rule(q, q, alibi_slopes=sl) == "online"
        rung[0] = "wg"
        with pytest.raises(ValueError, match="kernel must be one of"):
            rule(q, q, kernel="fast")
        torch = pytest.importorskip("torch")
        b = torch.zeros((1, 2, 256, 128), dtype=torch.bfloat16)
        assert rule(b, b, softcap=50.0) == "fixed" and rule(b, b, softcap=60.0) == "lazy"
        slopes = np.full(2, 0.1, np.float32)
        assert rule(b, b, softcap=50.0, alibi_slopes=slopes) == "fixed"
        assert rule(b, b, softcap=60.0, alibi_slopes=slopes) == "lazy"   # (ws_lazy)
        assert rule(b, b, alibi_slopes=slopes) == "lazy"
        # the cp.async forward's softcap instance (kernels.wg_cap): bfloat16 but at D = 64
        b256 = torch.zeros((1, 2, 256, 256), dtype=torch.bfloat16)
        assert rule(b256, b256, softcap=50.0, alibi_slopes=slopes) == "fixed"
        assert rule(b256, b256, softcap=60.0) == "online"
        monkeypatch.setenv("FLASHSIM_TMA", "0")
        assert rule(b, b, softcap=50.0) == "fixed"
        assert rule(b, b, alibi_slopes=slopes) == "online"   # (no lazy bfloat16 instance
        assert rule(b, b, softcap=60.0) == "online"          # on flash2_fwd_wg)
        b64 = torch.zeros((1, 2, 256, 64), dtype=torch.bfloat16)
        assert rule(b64, b64, softcap=50.0) == "online"
        monkeypatch.delenv("FLASHSIM_TMA")
        assert rule(b64, b64, softcap=50.0) == "fixed"       # the copy engine's instance
        assert rule(b64, b64, alibi_slopes=slopes) == "online"   # (its 192 × 64 tiles: no
        assert rule(b64, b64, softcap=60.0) == "online"          # lazy instance at 64)
        # tiles that send the launch to flash2_fwd_wg, without a bfloat16 instance at 64
        assert rule(b64, b64, softcap=50.0, block_sizes=fs.kernels.WG_BLOCKS[64]) == "online"
        assert rule(b64, b64, softcap=50.0, block_sizes=fs.kernels.ws_blocks(64, True)) == "fixed"
        rung[0] = "tc"                                       # the mma.sync forward's
        assert rule(b64, b64, softcap=50.0, alibi_slopes=slopes) == "fixed"
        assert rule(b64, b64, softcap=60.0) == "online"
        assert rule(b64, b64, alibi_slopes=slopes) == "online"
        rung[0] = "wg"


def test_auto_takes_the_rule_of_the_kernel_on_the_hardware():
    """softmax_max="auto" with hardware=: the copy-engine forward's softcap instance on a
    Hopper GPU runs "fixed" in bfloat16 (with ALiBi or without) and "lazy" in float16
    (with ALiBi at d = 128 only), and so does the mma.sync forward's (an Ampere GPU's
    too; in float16 without ALiBi); its lazy instance in bfloat16 (ALiBi alone, or a
    softcap past 54.4, at d = 128) runs "lazy"; ALiBi at d = 64 or on the mma.sync rung,
    and no variant, run "online". Without hardware, "auto" is refused."""
    from flashsim import hierarchy
    from flashsim.problem import Shape
    shape = Shape(200, 200, 64, 64, (1,), (2,), (2,), 2)
    rule = hierarchy.softmax_rule
    assert rule(shape, "bfloat16", "H100", softcap=30.0) == "fixed"
    assert rule(shape, "float16", "H100", softcap=30.0) == "lazy"
    assert rule(shape, "bfloat16", "H100", softcap=60.0) == "online"
    assert rule(shape, "float16", "H100", softcap=30.0, alibi_slopes=np.ones(2)) == "online"
    big = Shape(200, 200, 256, 256, (1,), (2,), (2,), 2)      # flash2_fwd_wg's instance
    assert rule(big, "bfloat16", "H100", softcap=30.0, alibi_slopes=np.ones(2)) == "fixed"
    assert rule(big, "float16", "H100", softcap=30.0) == "lazy"
    assert rule(big, "float16", "H100", softcap=30.0, alibi_slopes=np.ones(2)) == "online"
    wide = Shape(200, 200, 128, 128, (1,), (2,), (2,), 2)
    assert rule(wide, "float16", "H100", softcap=30.0, alibi_slopes=np.ones(2)) == "lazy"
    assert rule(wide, "float16", "H100", alibi_slopes=np.ones(2)) == "lazy"
    assert rule(wide, "float16", "H100", alibi_slopes=np.ones(2), launch="tc") == "online"
    assert rule(wide, "bfloat16", "H100", alibi_slopes=np.ones(2)) == "lazy"
    assert rule(wide, "bfloat16", "H100", softcap=60.0) == "lazy"
    assert rule(wide, "bfloat16", "H100", softcap=60.0, alibi_slopes=np.ones(2)) == "lazy"
    assert rule(wide, "bfloat16", "H100", alibi_slopes=np.ones(2), launch="tc") == "online"
    assert rule(wide, "bfloat16", "H100", alibi_slopes=np.ones(2), block_sizes=(64, 64)) == "online"
    assert rule(shape, "bfloat16", "H100", softcap=30.0, alibi_slopes=np.ones(2)) == "fixed"
    assert rule(shape, "bfloat16", "H100", alibi_slopes=np.ones(2)) == "online"
    assert rule(shape, "float16", "H100") == "online"
    # the mma.sync forward's softcap instance (kernels.tc_cap): float16's lazy max
    # without ALiBi, bfloat16's fixed one
    assert rule(shape, "float16", "A100", softcap=30.0) == "lazy"
    assert rule(shape, "float16", "H100", softcap=30.0, launch="tc") == "lazy"
    assert rule(shape, "float16", "A100", softcap=30.0, alibi_slopes=np.ones(2)) == "online"
    assert rule(shape, "bfloat16", "A100", softcap=30.0, alibi_slopes=np.ones(2)) == "fixed"
    assert rule(wide, "bfloat16", "H100", softcap=50.0, launch="tc") == "fixed"
    assert rule(wide, "bfloat16", "A100", softcap=60.0) == "online"
    assert rule(wide, "bfloat16", "A100", alibi_slopes=np.ones(2)) == "online"
    q, k, v = _inputs(4, Nq=200, Nk=200, d=64)
    for dtype, named in (("bfloat16", "fixed"), ("float16", "lazy")):
        common = dict(softcap=30.0, io_dtype=dtype, precision="kernel", hardware="H100")
        auto = fs.simulate(q, k, v, softmax_max="auto", **common)
        ruled = fs.simulate(q, k, v, softmax_max=named, **common)
        online = fs.simulate(q, k, v, **common)
        assert np.array_equal(auto.out, ruled.out) and np.array_equal(auto.lse, ruled.lse)
        assert not np.array_equal(auto.out, online.out)
    with pytest.raises(ValueError, match="give hardware"):
        fs.simulate(q, k, v, block_sizes=(64, 64), softcap=30.0, softmax_max="auto")
