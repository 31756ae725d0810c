"""Decoding over a KV cache (flashsim.kvcache): the dense oracle, paged = contiguous,
any split count = one, append-then-attend = attend over the concatenation, count =
simulate, the GQA packing rule, the split heuristic and bad input."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import flashsim as fs
from flashsim.kvcache import num_splits_heuristic


def case(draw_seed, batch, Nq, kv_heads, g, d, page, lens, Nnew, spare=2):
    """Random q, a paged cache holding ``lens`` rows per sequence (room for Nnew more),
    the same rows as a contiguous cache, and the rows to append."""
    rng = np.random.default_rng(draw_seed)
    heads = kv_heads * g
    need = [-(-(L + Nnew) // page) for L in lens]
    max_pages = max(max(need), 1) + spare
    num_pages = batch * max_pages + 3
    kc = rng.standard_normal((num_pages, page, kv_heads, d))
    vc = rng.standard_normal((num_pages, page, kv_heads, d))
    table = rng.permutation(num_pages)[:batch * max_pages].reshape(batch, max_pages)
    table = table.astype(np.int32)
    cap = max_pages * page
    kcont = np.zeros((batch, cap, kv_heads, d))
    vcont = np.zeros((batch, cap, kv_heads, d))
    for b in range(batch):
        r = np.arange(cap)
        kcont[b], vcont[b] = kc[table[b, r // page], r % page], vc[table[b, r // page], r % page]
    q = rng.standard_normal((batch, Nq, heads, d))
    kn = rng.standard_normal((batch, Nnew, kv_heads, d)) if Nnew else None
    vn = rng.standard_normal((batch, Nnew, kv_heads, d)) if Nnew else None
    return q, kc, vc, table, kcont, vcont, kn, vn


cases = st.fixed_dictionaries({
    "seed": st.integers(0, 2**16), "batch": st.integers(1, 3), "Nq": st.integers(1, 5),
    "kv_heads": st.integers(1, 2), "g": st.sampled_from([1, 2, 4]), "d": st.sampled_from([8, 16]),
    "page": st.sampled_from([1, 4, 16]), "Nnew": st.integers(0, 3), "causal": st.booleans(),
    "splits": st.sampled_from([1, 2, 3, 7, None]),
    "blocks": st.sampled_from([(4, 8), (8, 4), (64, 128), (3, 5)]),
}).flatmap(lambda c: st.lists(st.integers(0, 70), min_size=c["batch"], max_size=c["batch"])
           .map(lambda lens: {**c, "lens": lens}))


def run(c, paged=True, **kw):
    q, kc, vc, table, kcont, vcont, kn, vn = case(c["seed"], c["batch"], c["Nq"], c["kv_heads"],
                                                  c["g"], c["d"], c["page"], c["lens"], c["Nnew"])
    args = dict(cache_seqlens=np.array(c["lens"], np.int32), k=kn, v=vn, causal=c["causal"],
                num_splits=c["splits"], block_sizes=c["blocks"])
    args.update(kw)
    if paged:
        return fs.simulate_kvcache(q, kc, vc, block_table=table, **args), (q, kc, vc, table, kn, vn)
    return fs.simulate_kvcache(q, kcont, vcont, **args), (q, kcont, vcont, None, kn, vn)


def dense(c, r, parts):
    """The float64 oracle over each sequence's cache rows after the append."""
    q, kc, vc, table, kn, vn = parts
    g = c["g"]
    out = np.zeros_like(r.out)
    lse = np.zeros_like(r.lse)
    for b, L0 in enumerate(c["lens"]):
        L = L0 + c["Nnew"]
        rows = np.arange(L)
        if table is None:
            Kb, Vb = r.k_cache[b, :L], r.v_cache[b, :L]
        else:
            pg = table[b, rows // c["page"]]
            Kb, Vb = r.k_cache[pg, rows % c["page"]], r.v_cache[pg, rows % c["page"]]
        Kh = np.repeat(np.moveaxis(Kb, 1, 0), g, axis=0)
        Vh = np.repeat(np.moveaxis(Vb, 1, 0), g, axis=0)
        o, l = fs.attention_reference(np.moveaxis(q[b], 1, 0), Kh, Vh, causal=c["causal"])
        out[b], lse[b] = np.moveaxis(o, 0, 1), l
    return out, lse


@settings(max_examples=80, deadline=None)
@given(cases)
def test_decoding_equals_the_dense_oracle_and_its_count(c):
    r, parts = run(c)
    out, lse = dense(c, r, parts)
    np.testing.assert_allclose(r.out, out, rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(r.lse), np.isneginf(lse))
    fin = np.isfinite(lse)
    np.testing.assert_allclose(r.lse[fin], lse[fin], rtol=1e-10, atol=1e-12)
    # rows that see no key: 0 and −∞
    assert (r.out[np.isneginf(r.lse).transpose(0, 2, 1)] == 0).all()
    count = fs.count_kvcache(Nq=c["Nq"], heads=c["kv_heads"] * c["g"], kv_heads=c["kv_heads"],
                             d=c["d"], cache_seqlens=c["lens"], Nnew=c["Nnew"],
                             page_size=c["page"], causal=c["causal"], num_splits=c["splits"],
                             block_sizes=c["blocks"], io_dtype="float64")
    assert count == r.traffic


@settings(max_examples=60, deadline=None)
@given(cases)
def test_paged_equals_contiguous(c):
    rp, _ = run(c, paged=True)
    rc, _ = run(c, paged=False)
    np.testing.assert_array_equal(rp.out, rc.out)
    np.testing.assert_array_equal(rp.lse, rc.lse)
    # the same rows are read; the paged cache also reads its block table
    assert rp.traffic == rc.traffic + fs.Traffic(reads={"block_table": rp.traffic.reads.get("block_table", 0)})


@settings(max_examples=60, deadline=None)
@given(cases)
def test_any_split_count_gives_the_unsplit_result(c):
    r, _ = run(c)
    one, _ = run(c, num_splits=1)
    np.testing.assert_allclose(r.out, one.out, rtol=1e-12, atol=1e-13)
    # the parts partition each tile's K/V range: the same K and V bytes for any count
    for t in ("K", "V"):
        assert r.traffic.reads.get(t, 0) == one.traffic.reads.get(t, 0)


@settings(max_examples=60, deadline=None)
@given(cases)
def test_the_merge_in_a_cluster_moves_no_partial(c):
    """cluster=True: the same parts and merge, so the same outputs bit for bit; the
    traffic is the memory merge's without the partials, and count agrees."""
    mem, _ = run(c)
    cl, _ = run(c, cluster=True)
    np.testing.assert_array_equal(cl.out, mem.out)
    np.testing.assert_array_equal(cl.lse, mem.lse)
    assert cl.num_splits == mem.num_splits or c["splits"] is None
    if cl.num_splits == mem.num_splits:
        partials = fs.Traffic(reads={t: mem.traffic.reads.get(t, 0) for t in ("Osplit", "Lsplit")},
                              writes={t: mem.traffic.writes.get(t, 0) for t in ("Osplit", "Lsplit")})
        assert cl.traffic + partials == mem.traffic
    assert not {"Osplit", "Lsplit"} & (set(cl.traffic.reads) | set(cl.traffic.writes))
    count = fs.count_kvcache(Nq=c["Nq"], heads=c["kv_heads"] * c["g"], kv_heads=c["kv_heads"],
                             d=c["d"], cache_seqlens=c["lens"], Nnew=c["Nnew"],
                             page_size=c["page"], causal=c["causal"], num_splits=c["splits"],
                             cluster=True, block_sizes=c["blocks"], io_dtype="float64")
    assert count == cl.traffic


def test_a_cluster_holds_at_most_16_parts():
    q, kc, vc, table, *_ = case(0, 1, 1, 1, 1, 8, 4, [70], 0)
    args = dict(cache_seqlens=np.array([70], np.int32), block_table=table, block_sizes=(4, 4))
    with pytest.raises(ValueError, match="at most 16"):
        fs.simulate_kvcache(q, kc, vc, num_splits=17, cluster=True, **args)
    with pytest.raises(TypeError, match="cluster must be True or False"):
        fs.simulate_kvcache(q, kc, vc, num_splits=2, cluster="yes", **args)
    # the default split count stays within a cluster
    assert fs.simulate_kvcache(q, kc, vc, cluster=True, **args).num_splits <= 16


def test_the_gpu_launcher_merges_short_parts_in_a_cluster():
    """flashsim.gpu.decode's rule (no GPU needed): the largest cluster no larger than the
    memory merge's split count whose CTAs find an SM each (clusters of 4 and 8: 7/8 of
    them), if its parts hold at most CLUSTER_PART_TILES tiles per 16 packed rows."""
    from flashsim.gpu.decode import cluster_splits
    assert cluster_splits(8, 132, 16, 8) == 8           # GQA 32/8, batch 1, 1k keys
    assert cluster_splits(8, 132, 64, 16) == 8          # … 4k keys: 8 tiles per part
    assert cluster_splits(8, 132, 256, 16) is None      # … 16k keys: through memory
    assert cluster_splits(32, 132, 16, 4) == 2          # MHA: 128 CTAs in 4s find 120 SMs
    assert cluster_splits(64, 132, 16, 2) == 2          # batch 8: 128 CTAs in pairs
    assert cluster_splits(64, 132, 64, 2) is None       # … 4k keys: 32 tiles per part
    assert cluster_splits(256, 132, 16, 1) is None      # no split, no merge
    # 64 packed rows (GQA 32/8, Nq = 16): the memory merge costs more, longer parts pay
    assert cluster_splits(8, 132, 256, 32, rows=64) == 8          # 16k keys: 32 tiles a part
    assert cluster_splits(8, 132, 1024, 32, rows=64) is None      # 64k keys
    assert cluster_splits(64, 132, 64, 4, rows=64) == 2           # batch 8, 4k keys
    # … as many CTAs per SM as fit: 256 in clusters of 4 where three fit (d = 64), not two
    assert cluster_splits(64, 132, 16, 6, rows=64, ctas_per_sm=3) == 4
    assert cluster_splits(64, 132, 16, 6, rows=64, ctas_per_sm=2) == 2


@settings(max_examples=40, deadline=None)
@given(cases.filter(lambda c: c["Nnew"] > 0))
def test_appending_then_attending_is_attending_over_the_concatenation(c):
    r, parts = run(c)
    # the same cache with the new rows already in it, nothing appended
    q, kc, vc, table, kn, vn = parts
    longer = [L + c["Nnew"] for L in c["lens"]]
    pre = fs.simulate_kvcache(q, r.k_cache, r.v_cache, block_table=table,
                              cache_seqlens=np.array(longer, np.int32), causal=c["causal"],
                              num_splits=r.num_splits, block_sizes=c["blocks"])
    np.testing.assert_array_equal(r.out, pre.out)
    n = c["batch"] * c["Nnew"] * c["kv_heads"] * c["d"] * 8
    # the append looks up each page its rows land in once per sequence
    pages = sum((L + c["Nnew"] - 1) // c["page"] - L // c["page"] + 1 for L in c["lens"])
    assert r.traffic == pre.traffic + fs.Traffic(reads={"Knew": n, "Vnew": n,
                                                        "block_table": 4 * pages},
                                                 writes={"K": n, "V": n})
    # the rows landed where the block table says, and nothing else moved
    for b, L in enumerate(c["lens"]):
        for i in range(c["Nnew"]):
            row = L + i
            page = table[b, row // c["page"]]
            np.testing.assert_array_equal(r.k_cache[page, row % c["page"]], kn[b, i])
    untouched = np.ones(kc.shape[:2], bool)
    for b, L in enumerate(c["lens"]):
        rows = np.arange(L, L + c["Nnew"])
        untouched[table[b, rows // c["page"]], rows % c["page"]] = False
    np.testing.assert_array_equal(r.k_cache[untouched], kc[untouched])


def test_gqa_heads_share_each_kv_tile():
    """Packed: with every query head of a K/V head in one tile, K and V are read once
    per K/V head; 32 query heads over 8 K/V heads read a quarter of what 32 separate
    heads would."""
    lens = [1000, 517]
    packed = fs.count_kvcache(Nq=1, heads=32, kv_heads=8, d=128, cache_seqlens=lens,
                              num_splits=1)
    mha = fs.count_kvcache(Nq=1, heads=32, kv_heads=32, d=128, cache_seqlens=lens,
                           num_splits=1)
    assert packed.reads["K"] == sum(lens) * 8 * 128 * 2
    assert mha.reads["K"] == 4 * packed.reads["K"]
    assert packed.reads["Q"] == mha.reads["Q"] == 2 * 32 * 128 * 2


def test_an_empty_cache_gives_zeros():
    q = np.ones((1, 1, 2, 8))
    kc = np.ones((1, 4, 1, 8))
    r = fs.simulate_kvcache(q, kc, kc, cache_seqlens=np.zeros(1, np.int32))
    assert (r.out == 0).all() and np.isneginf(r.lse).all()
    assert set(r.traffic.reads) == set() and set(r.traffic.writes) == {"O", "L"}


def test_split_heuristic():
    # 48 blocks of work on 108 SMs: 2 splits fill 89% of the last wave, 3 only 67%, and 9
    # make exactly 4 full waves, the smallest count within 95% of the best
    assert num_splits_heuristic(48, 108, kv_tiles=100) == 9
    assert num_splits_heuristic(48, 108, kv_tiles=100, max_splits=8) == 2
    # a full GPU is not split
    assert num_splits_heuristic(132, 132, kv_tiles=1000) == 1
    # one sequence, one head: as many splits as fill the SMs, no more than there are tiles
    # (at most 128 splits; 125 is the smallest count whose longest part is 8 tiles)
    assert num_splits_heuristic(1, 132, kv_tiles=1000) == 125
    assert num_splits_heuristic(1, 132, kv_tiles=5) == 5
    assert num_splits_heuristic(1, 132, kv_tiles=1) == 1
    # the combine weighed: 64 packed rows of a 16-tile (1024-key) cache take √(4·16·64/64)
    # = 8 splits, where filling the SMs alone takes 16; 4 rows keep 16; one row changes
    # nothing (its √ is above the tiles)
    eight = dict(ctas_per_sm=2, balance_waves=True)
    assert num_splits_heuristic(8, 132, kv_tiles=16, **eight) == 16
    assert num_splits_heuristic(8, 132, kv_tiles=16, combine_rows=64, **eight) == 8
    assert num_splits_heuristic(8, 132, kv_tiles=4, combine_rows=64, Bc=16, **eight) == 2
    assert num_splits_heuristic(8, 132, kv_tiles=16, combine_rows=4, **eight) == 16
    assert num_splits_heuristic(1, 132, kv_tiles=1000, combine_rows=1) == 125
    assert num_splits_heuristic(8, 132, kv_tiles=4096, combine_rows=64, **eight) == 32
    with pytest.raises(ValueError, match="combine_rows"):
        num_splits_heuristic(8, 132, kv_tiles=16, combine_rows=-1)
    # the choice fills at least 95% of what the best count fills, among the counts that
    # shorten the longest part (the others cost partials and save no time)
    def eligible(t, n):
        return t == 1 or -(-n // t) < -(-n // (t - 1))

    def fill(work, t):
        w = work * t / 132
        return w / np.ceil(w)

    for work in range(106, 140):       # 80% of the slots busy already: no split
        assert num_splits_heuristic(work, 132, kv_tiles=64) == 1
    # balancing waves: a full GPU is still not split, one whose waves would be less than
    # 80% full on average is (512 blocks on 396 slots: 3 splits make 3.9 waves)
    assert num_splits_heuristic(396, 132, kv_tiles=256, ctas_per_sm=3, balance_waves=True) == 1
    assert num_splits_heuristic(512, 132, kv_tiles=256, ctas_per_sm=3, balance_waves=True) == 3
    assert num_splits_heuristic(512, 132, kv_tiles=256, ctas_per_sm=3) == 1
    for work in range(1, 106):
        s = num_splits_heuristic(work, 132, kv_tiles=64)
        assert eligible(s, 64)
        assert fill(work, s) >= 0.95 * max(fill(work, t) for t in range(1, 65) if eligible(t, 64))
        assert not any(fill(work, t) >= 0.95 * max(fill(work, u) for u in range(1, 65)
                                                   if eligible(u, 64))
                       for t in range(1, s) if eligible(t, 64))
    r = fs.count_kvcache(Nq=1, heads=8, kv_heads=8, d=64, cache_seqlens=[4096],
                         hardware="H100")
    assert r.reads["Osplit"] > 0


@pytest.mark.parametrize("change, error, message", [
    (dict(block_table=np.array([[0, 99]], np.int32), cache_seqlens=np.array([20], np.int32)),
     ValueError, "pages are 0"),
    (dict(cache_seqlens=np.array([40], np.int32)), ValueError, "needs 3 pages"),
    (dict(cache_seqlens=np.array([-1], np.int32)), ValueError, ">= 0"),
    (dict(cache_seqlens=np.array([1.5])), TypeError, "integers"),
    (dict(block_table=np.array([[0.0, 1.0]])), TypeError, "integers"),
    (dict(k=np.ones((1, 2, 1, 8))), ValueError, "both k and v"),
])
def test_bad_input(change, error, message):
    """Each a typed error before any work; table entries past a sequence's pages are not
    read (padding such as −1 is fine there)."""
    args = dict(cache_seqlens=np.array([3], np.int32), block_table=np.array([[0, 1]], np.int32))
    args.update(change)
    with pytest.raises(error, match=message):
        fs.simulate_kvcache(np.ones((1, 1, 2, 8)), np.ones((3, 16, 1, 8)),
                            np.ones((3, 16, 1, 8)), **args)
    with pytest.raises(ValueError, match="cache holds 4"):
        fs.simulate_kvcache(np.ones((1, 1, 2, 8)), np.ones((1, 4, 1, 8)), np.ones((1, 4, 1, 8)),
                            cache_seqlens=np.array([3], np.int32), k=np.ones((1, 2, 1, 8)),
                            v=np.ones((1, 2, 1, 8)))
