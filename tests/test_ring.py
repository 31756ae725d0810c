"""Ring attention over simulated ranks (flashsim.ring): any world size and slice
assignment gives flash2's outputs and gradients, the interconnect moves the closed form's
bytes, and zig-zag slices balance a causal mask."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import flashsim as fs
from flashsim.ring import chunks, ring_interconnect

rings = st.fixed_dictionaries({
    "seed": st.integers(0, 2**16), "W": st.integers(1, 5),
    "assignment": st.sampled_from(["contiguous", "zigzag"]), "per": st.integers(1, 9),
    "heads": st.sampled_from([(1, 1), (2, 1), (4, 2)]), "d": st.sampled_from([4, 16]),
    "dv": st.sampled_from([None, 8]), "causal": st.booleans(),
    "blocks": st.sampled_from([(4, 4), (3, 5), (16, 8)]),
})


def arrays(c):
    rng = np.random.default_rng(c["seed"])
    parts = c["W"] * (2 if c["assignment"] == "zigzag" else 1)
    N = parts * c["per"]
    H, Hk = c["heads"]
    dv = c["dv"] or c["d"]
    q = rng.standard_normal((2, H, N, c["d"]))
    k = rng.standard_normal((2, Hk, N, c["d"]))
    v = rng.standard_normal((2, Hk, N, dv))
    return q, k, v, rng.standard_normal((2, H, N, dv))


@settings(max_examples=60, deadline=None)
@given(rings)
def test_ring_equals_flash2_forward_and_backward(c):
    q, k, v, do = arrays(c)
    kw = dict(causal=c["causal"], block_sizes=c["blocks"])
    f = fs.simulate(q, k, v, "flash2", **kw)
    r = fs.simulate(q, k, v, "ring", world_size=c["W"], assignment=c["assignment"], **kw)
    np.testing.assert_allclose(r.out, f.out, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(r.lse, f.lse, rtol=1e-12, atol=1e-13)
    g0 = fs.simulate_backward(q, k, v, f.out, f.lse, do, "flash2", **kw)
    g = fs.simulate_backward(q, k, v, f.out, f.lse, do, "ring", world_size=c["W"],
                             assignment=c["assignment"], **kw)
    for a, b in ((g.dq, g0.dq), (g.dk, g0.dk), (g.dv, g0.dv)):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
    # the ranks' HBM traffic adds up; every rank sends what it receives
    assert r.traffic == sum(r.ring.ranks, fs.Traffic())
    for links in (r.ring.links, g.ring.links):
        assert all(t.reads == t.writes for t in links)


@settings(max_examples=60, deadline=None)
@given(rings)
def test_interconnect_bytes_are_the_closed_form(c):
    q, k, v, do = arrays(c)
    W, N = c["W"], q.shape[-2]
    d, dv = q.shape[-1], v.shape[-1]
    Hk = c["heads"][1]
    r = fs.simulate(q, k, v, "ring", world_size=W, assignment=c["assignment"],
                    causal=c["causal"], block_sizes=c["blocks"], io_dtype="float16")
    rows = N // W
    # W − 1 sends of a slice's K and V (2 batches × Hk heads), fp16
    want = (W - 1) * rows * (d + dv) * 2 * (2 * Hk)
    assert all(t.write_bytes == want for t in r.ring.links) or W == 1
    assert r.ring.links == ring_interconnect(N, W, d, dv, 2, 2 * Hk, c["assignment"])
    link_s = sum(s["link_s"] for s in r.ring.steps)
    assert link_s == pytest.approx(want / fs.hardware.H100.link_bytes_per_s)
    g = fs.simulate_backward(q, k, v, np.zeros(q.shape[:-1] + (dv,)), np.zeros(q.shape[:-1]),
                             do, "ring", world_size=W, assignment=c["assignment"],
                             causal=c["causal"], block_sizes=c["blocks"], io_dtype="float16")
    grads = W * rows * (d + dv) * 4 * (2 * Hk) if W > 1 else 0
    assert all(t.write_bytes == want + grads for t in g.ring.links)


@pytest.mark.parametrize("W", [2, 4, 8])
def test_zigzag_balances_the_causal_mask(W):
    """Per step, zig-zag ranks do the same work (within one tile pair); contiguous ones
    range from a whole slice's work to none."""
    rng = np.random.default_rng(0)
    N, d, B = 16 * W, 8, 4
    q, k, v = (rng.standard_normal((1, N, d)) for _ in range(3))
    tile_flops = 2 * B * B * (d + d)
    hw = fs.hardware.H100
    from flashsim.hierarchy import efficiency
    per_s = efficiency("flash2_fwd_wg", 128) * hw.peak_flops
    for assignment, balanced in (("zigzag", True), ("contiguous", False)):
        r = fs.simulate(q, k, v, "ring", world_size=W, assignment=assignment, causal=True,
                        block_sizes=(B, B))
        spread = [(max(s["compute_per_rank_s"]) - min(s["compute_per_rank_s"])) * per_s
                  for s in r.ring.steps]
        if balanced:
            assert max(spread) <= tile_flops
        else:
            assert max(spread) > tile_flops


def test_chunks_and_errors():
    assert chunks(8, 2, "zigzag") == [[(0, 2), (6, 8)], [(2, 4), (4, 6)]]
    assert chunks(8, 4, "contiguous") == [[(0, 2)], [(2, 4)], [(4, 6)], [(6, 8)]]
    q = np.ones((1, 10, 4))
    with pytest.raises(ValueError, match="pad the sequence"):
        fs.simulate(q, q, q, "ring", world_size=4, block_sizes=(2, 2))
    with pytest.raises(ValueError, match="Nq must equal Nk"):
        fs.simulate(q, np.ones((1, 12, 4)), np.ones((1, 12, 4)), "ring", world_size=2,
                    block_sizes=(2, 2))
    with pytest.raises(ValueError, match="world_size goes with"):
        fs.simulate(q, q, q, "flash2", world_size=2, block_sizes=(2, 2))
    with pytest.raises(ValueError, match="assignment must be"):
        fs.simulate(q, q, q, "ring", world_size=2, assignment="striped", block_sizes=(2, 2))
    with pytest.raises(ValueError, match="running its ranks"):
        fs.count("ring", Nq=8, Nk=8, d=4, block_sizes=(2, 2))
    with pytest.raises(ValueError, match="running its ranks"):
        fs.count_backward("ring", Nq=8, Nk=8, d=4, block_sizes=(2, 2))
    for closed_form in (fs.theory.traffic, fs.theory.traffic_backward):
        with pytest.raises(ValueError, match="depend on its ranks"):
            closed_form("ring", Nq=8, Nk=8, d=4, Br=2, Bc=2)
    with pytest.raises(ValueError, match="one sequence per problem"):
        fs.count_varlen("ring", cu_seqlens_q=[0, 4], cu_seqlens_k=[0, 4], heads=1, d=4,
                        block_sizes=(2, 2))
