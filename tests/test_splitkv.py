"""Split-KV forward (flash-decoding): the math equals flash2 and the dense oracle for any
number of splits, and simulate == count == theory byte for byte."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import flashsim as fs
from flashsim.problem import check_arrays
from flashsim.splitkv import combine_chunks, split_bounds, theory_splitkv
from flashsim.strategies import attention_problems, problem_sizes
from flashsim.tiling import sram_footprint

RTOL = 1e-10
SPLITS = st.integers(1, 10)
WINDOWS = st.one_of(st.none(), st.tuples(st.integers(-1, 40), st.integers(-1, 40)))
IO = st.sampled_from(["float16", "bfloat16", "float32", "float64"])


def _close(r, ref_out, ref_lse, v):
    vmax = max(1.0, float(np.abs(v).max(initial=0.0)))
    np.testing.assert_allclose(r.out, ref_out, rtol=RTOL, atol=RTOL * vmax)
    assert np.array_equal(np.isneginf(r.lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(r.lse[fin], ref_lse[fin], rtol=RTOL,
                               atol=RTOL * max(1.0, float(np.abs(ref_lse[fin]).max(initial=0))))


def _count(p, s, io="float64", **kw):
    return fs.count("splitkv", Nq=p.Nq, Nk=p.Nk, d=p.d, dv=p.dv, batch_shape=p.q.shape[:-2],
                    kv_batch_shape=p.k.shape[:-2], block_sizes=p.block_sizes,
                    causal=p.causal, io_dtype=io, num_splits=s, **kw)


# -- the math ---------------------------------------------------------------------------

@settings(max_examples=200)
@given(attention_problems(max_seq=70, max_dim=16, max_block=16, allow_empty=True), SPLITS,
       WINDOWS, st.one_of(st.none(), st.floats(1.0, 30.0)), st.booleans())
def test_equals_flash2_and_dense_reference(p, s, window, softcap, alibi):
    heads = check_arrays(p.q, p.k, p.v)[3].batch_shape[-1:] or (1,)
    slopes = (np.random.default_rng(s).uniform(0.01, 0.5, heads)
              if alibi and p.q.ndim > 2 else None)
    kw = dict(causal=p.causal, window=window, softcap=softcap, alibi_slopes=slopes)
    r = fs.simulate(p.q, p.k, p.v, "splitkv", block_sizes=p.block_sizes, num_splits=s, **kw)
    f2 = fs.simulate(p.q, p.k, p.v, "flash2", block_sizes=p.block_sizes, **kw)
    ref_out, ref_lse = fs.attention_reference(p.q, p.k, p.v, **kw)
    assert r.out.shape == ref_out.shape and r.lse.shape == ref_lse.shape
    assert np.isfinite(r.out).all(), "no NaN/Inf, even for rows a part leaves without a key"
    _close(r, ref_out, ref_lse, p.v)
    _close(r, f2.out, f2.lse, p.v)
    if s == 1:   # the unsplit kernel: identical, not just close
        assert np.array_equal(r.out, f2.out) and r.traffic == f2.traffic
    assert r.traffic == _count(p, s, window=window)
    assert r.sram_peak_bytes <= sram_footprint("splitkv", *p.block_sizes, p.d, p.dv, 8)


def test_rows_without_a_key_inside_a_part_stay_finite():
    # A local window: each row of a Q tile sees 3 keys, so in every part most rows
    # see nothing (m = −∞, ℓ = 0) and must come out as Osplit = 0, Lsplit = −∞.
    rng = np.random.default_rng(5)
    q, k, v = rng.standard_normal((2, 40, 8)), rng.standard_normal((2, 40, 8)), \
        rng.standard_normal((2, 40, 4))
    for causal in (False, True):
        r = fs.simulate(q, k, v, "splitkv", block_sizes=(16, 2), window=(2, 0),
                        causal=causal, num_splits=4)
        ref_out, ref_lse = fs.attention_reference(q, k, v, window=(2, 0), causal=causal)
        assert np.isfinite(r.out).all() and np.isfinite(r.lse).all()
        np.testing.assert_allclose(r.out, ref_out, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(r.lse, ref_lse, rtol=1e-12)


def test_tiles_seeing_no_key_output_zero_without_reading():
    # Nq > Nk causal: the first Nq − Nk rows see nothing; their tiles read nothing.
    rng = np.random.default_rng(2)
    q, k, v = rng.standard_normal((20, 4)), rng.standard_normal((6, 4)), rng.standard_normal((6, 3))
    r = fs.simulate(q, k, v, "splitkv", block_sizes=(4, 2), causal=True, num_splits=3)
    assert (r.out[:14] == 0).all() and np.isneginf(r.lse[:14]).all()
    ref_out, _ = fs.attention_reference(q, k, v, causal=True)
    np.testing.assert_allclose(r.out, ref_out, rtol=1e-12, atol=1e-12)
    # tiles 0-2 (rows 0-11) see no key; tile 3 (rows 12-15) sees keys 0-1 (1 K tile),
    # tile 4 (rows 16-19) keys 0-5 (3 K tiles): parts 1 and 3, Q rows read 4·1 + 4·3
    assert r.traffic.reads["Q"] == (4 * 1 + 4 * 3) * 4 * 8
    assert r.traffic.writes["O"] == 20 * 3 * 8 and r.traffic.writes["L"] == 20 * 4


def test_huge_logits_stay_finite():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((37, 16)) * 300
    k = rng.standard_normal((53, 16)) * 300
    v = rng.standard_normal((53, 8))
    ref_out, ref_lse = fs.attention_reference(q, k, v)
    for s in (2, 5, 11):
        r = fs.simulate(q, k, v, "splitkv", block_sizes=(5, 7), num_splits=s)
        assert np.isfinite(r.out).all() and np.isfinite(r.lse).all()
        np.testing.assert_allclose(r.out, ref_out, rtol=1e-10, atol=1e-10 * np.abs(v).max())
        np.testing.assert_allclose(r.lse, ref_lse, rtol=1e-12)


def test_split_bounds_partition_the_range():
    # n = 10 tiles in 3 parts: 3, 3, 4; n = 2 in 5 parts: two non-empty parts of 1
    start, stop = split_bounds(np.array([4, 0, 3]), np.array([13, 1, 2]), 3)
    assert (stop - start).tolist() == [[3, 3, 4], [0, 1, 1], [0, 0, 0]]
    assert start[0].tolist() == [4, 7, 10] and stop[0, -1] == 14
    start, stop = split_bounds(np.array([0]), np.array([1]), 5)
    assert (stop - start).tolist() == [[0, 0, 1, 0, 1]]   # cuts ⌊p·2/5⌋ = 0 0 0 1 1 2


# -- SRAM ------------------------------------------------------------------------------------

@settings(max_examples=120)
@given(attention_problems(max_seq=60, max_dim=40, max_block=8), st.integers(2, 6), IO)
def test_peak_stays_within_flash2_footprint(p, s, io):
    """Tiny tiles and dv ≫ d force the combine into row and column chunks; the peak
    never passes flash2's footprint and the traffic does not depend on the chunking."""
    r = fs.simulate(p.q, p.k, p.v, "splitkv", block_sizes=p.block_sizes, num_splits=s,
                    causal=p.causal, io_dtype=io)
    b = fs.problem.itemsize_of(io)
    assert r.sram_peak_bytes <= sram_footprint("splitkv", *p.block_sizes, p.d, p.dv, b)
    assert r.traffic == _count(p, s, io)
    ref_out, ref_lse = fs.attention_reference(p.q, p.k, p.v, causal=p.causal)
    _close(r, ref_out, ref_lse, p.v)


def test_combine_chunking_modes():
    d, dv, b = 1, 64, 2
    F = sram_footprint("splitkv", 1, 1, d, dv, b)          # 1×1 tiles: one row does not fit
    assert F < 8 * dv + 12
    R, nc = combine_chunks(F, 1, dv)
    assert R == 1 and 1 <= nc < dv and 4 * dv + 4 * nc + 12 <= F
    F = sram_footprint("splitkv", 8, 8, 16, 16, 2)
    assert combine_chunks(F, 8, 16) == (8, 16)             # the whole tile at once
    assert combine_chunks(600, 8, 16) == (600 // (8 * 16 + 12), 16)   # row chunks
    rng = np.random.default_rng(7)
    q, k, v = rng.standard_normal((5, d)), rng.standard_normal((9, d)), rng.standard_normal((9, dv))
    r = fs.simulate(q, k, v, "splitkv", block_sizes=(1, 1), num_splits=4, io_dtype="float16")
    assert r.sram_peak_bytes <= sram_footprint("splitkv", 1, 1, d, dv, 2)
    np.testing.assert_allclose(r.out, fs.attention_reference(q, k, v)[0], rtol=1e-12, atol=1e-12)


@settings(max_examples=60)
@given(attention_problems(max_seq=120, max_dim=32), st.integers(2**11, 2**16), SPLITS)
def test_sram_budget_is_respected(p, sram, s):
    try:
        r = fs.simulate(p.q, p.k, p.v, "splitkv", sram_bytes=sram, causal=p.causal,
                        io_dtype="float16", num_splits=s)
    except fs.SRAMOverflowError as e:
        assert e.minimum_bytes > sram
        return
    assert r.sram_peak_bytes <= sram
    f2 = fs.simulate(p.q, p.k, p.v, "flash2", sram_bytes=sram, causal=p.causal,
                     io_dtype="float16")
    assert r.block_sizes == f2.block_sizes                 # flash2's block rule
    assert r.traffic == fs.count("splitkv", Nq=p.Nq, Nk=p.Nk, d=p.d, dv=p.dv,
                                 batch_shape=p.q.shape[:-2], kv_batch_shape=p.k.shape[:-2],
                                 sram_bytes=sram, causal=p.causal, num_splits=s)


def test_footprint_leaves_room_for_the_combine():
    """With 1-byte I/O and 1×1 tiles flash2's own footprint (4·64 + 1 + 12 = 269 B at
    d = dv = 64) is smaller than the combine's fp32 row (4·dv + 16 = 272 B); splitkv's
    footprint is the larger, so derived block sizes always leave room for the combine."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((3, 64)) for _ in range(3))
    assert sram_footprint("flash2", 1, 1, 64, 64, 1) == 269
    assert sram_footprint("splitkv", 1, 1, 64, 64, 1) == 272
    r = fs.simulate(q, k, v, "splitkv", block_sizes=(1, 1), num_splits=2, io_dtype="float8")
    assert r.sram_peak_bytes == 272
    with pytest.raises(fs.SRAMOverflowError, match="at least 272") as e:
        fs.simulate(q, k, v, "splitkv", sram_bytes=271, num_splits=2, io_dtype="float8")
    assert e.value.minimum_bytes == 272
    r = fs.simulate(q, k, v, "splitkv", sram_bytes=272, num_splits=2, io_dtype="float8")
    assert r.sram_peak_bytes <= 272


# -- the accounting ----------------------------------------------------------------------

@given(problem_sizes(), st.integers(1, 64), st.integers(1, 256), st.integers(1, 12),
       st.booleans(), WINDOWS, IO)
def test_count_equals_theory(sizes, Br, Bc, s, causal, window, io):
    c = fs.count("splitkv", **sizes, block_sizes=(Br, Bc), causal=causal, window=window,
                 io_dtype=io, num_splits=s)
    shape = fs.problem.make_shape(**sizes)
    t = theory_splitkv(Nq=sizes["Nq"], Nk=sizes["Nk"], d=sizes["d"], dv=sizes["dv"], Br=Br,
                       Bc=Bc, causal=causal, window=window, itemsize=fs.problem.itemsize_of(io),
                       problems=shape.problems, num_splits=s)
    assert c == t, c.diff(t)
    f2 = fs.count("flash2", **sizes, block_sizes=(Br, Bc), causal=causal, window=window,
                  io_dtype=io)
    if s == 1:
        assert c == f2
    else:
        # K/V and the final O, L are flash2's; the rest is Q re-reads and the partials
        for direction, name in [("read", "K"), ("read", "V"), ("write", "O"), ("write", "L")]:
            get = (lambda t: t.reads) if direction == "read" else (lambda t: t.writes)
            assert get(c).get(name, 0) == get(f2).get(name, 0)
        assert c.reads.get("Q", 0) >= f2.reads.get("Q", 0)
        assert c.reads.get("Osplit", 0) == c.writes.get("Osplit", 0)
        assert c.reads.get("Lsplit", 0) == c.writes.get("Lsplit", 0)


def test_theory_traffic_dispatches_to_splitkv():
    kw = dict(Nq=100, Nk=300, d=8, dv=5, causal=True, window=(20, -1))
    want = fs.count("splitkv", **kw, block_sizes=(7, 9), num_splits=3)
    assert fs.theory.traffic("splitkv", **kw, Br=7, Bc=9, num_splits=3) == want
    assert theory_splitkv(**kw, Br=7, Bc=9, num_splits=3) == want


def test_noncausal_closed_form():
    # Tr = 3, Tc = 4: every Q tile has 4 K/V tiles, so min(s, 4) parts each
    Nq, Nk, d, dv, B = 24, 32, 16, 8, 8
    for s, k in [(2, 2), (4, 4), (7, 4)]:
        t = fs.count("splitkv", Nq=Nq, Nk=Nk, d=d, dv=dv, block_sizes=(B, B), num_splits=s)
        assert t.reads == {"Q": k * Nq * d * 2, "K": 3 * Nk * d * 2, "V": 3 * Nk * dv * 2,
                           "Osplit": k * Nq * dv * 4, "Lsplit": k * Nq * 4}
        assert t.writes == {"Osplit": k * Nq * dv * 4, "O": Nq * dv * 2,
                            "Lsplit": k * Nq * 4, "L": Nq * 4}


@settings(max_examples=60)
@given(st.integers(1, 64), st.integers(1, 10**6), st.sampled_from([64, 128, 256]),
       st.integers(1, 32), st.booleans())
def test_decoding_kv_bytes_equal_flash2(Nq, Nk, d, s, causal):
    kw = dict(Nq=Nq, Nk=Nk, d=d, batch_shape=(2, 8), kv_batch_shape=(2, 2),
              sram_bytes="192KiB", causal=causal)
    sk = fs.count("splitkv", **kw, num_splits=s)
    f2 = fs.count("flash2", **kw)
    assert sk.reads["K"] == f2.reads["K"] and sk.reads["V"] == f2.reads["V"]
    assert sk.writes["O"] == f2.writes["O"] and sk.writes["L"] == f2.writes["L"]


def test_decoding_one_query_million_keys():
    """Nq = 1, Nk = 10⁶, d = dv = 128, fp16, SRAM 192 KiB (Br = 168, Bc = 128, so
    Tc = 7813 K/V tiles), one head, 8 splits. K and V are read once, 256,000,000 B
    each, exactly as flash2. The split costs 10,048 B more: q read by 8 blocks instead
    of 1 (+7·256 B), Osplit written and read (2·8·128·4 = 8,192 B) and Lsplit written
    and read (2·8·4 = 64 B), 0.002% of the K/V bytes."""
    kw = dict(Nq=1, Nk=10**6, d=128, sram_bytes="192KiB")
    f2 = fs.count("flash2", **kw)
    sk = fs.count("splitkv", **kw, num_splits=8)
    assert sk.reads["K"] == f2.reads["K"] == 10**6 * 128 * 2 == 256_000_000
    assert sk.reads["V"] == f2.reads["V"] == 256_000_000
    assert sk.reads["Q"] == 8 * 128 * 2 and f2.reads["Q"] == 128 * 2
    assert sk.reads["Osplit"] == sk.writes["Osplit"] == 8 * 128 * 4
    assert sk.reads["Lsplit"] == sk.writes["Lsplit"] == 8 * 4
    assert sk.writes["O"] == f2.writes["O"] == 256 and sk.writes["L"] == f2.writes["L"] == 4
    extra = sk.total_bytes - f2.total_bytes
    assert extra == 7 * 256 + 2 * 8 * 128 * 4 + 2 * 8 * 4 == 10_048
    assert extra / (2 * 256_000_000) < 2e-5
    assert fs.count("splitkv", **kw, num_splits=1) == f2


def test_more_splits_than_kv_tiles_cost_nothing_extra():
    # Nk = 40, Bc = 16: 3 K/V tiles, so splits beyond 3 are empty and free
    kw = dict(Nq=1, Nk=40, d=16, block_sizes=(1, 16))
    t3 = fs.count("splitkv", **kw, num_splits=3)
    for s in (4, 10, 1000):
        assert fs.count("splitkv", **kw, num_splits=s) == t3
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((1, 16)), rng.standard_normal((40, 16)), rng.standard_normal((40, 16))
    r = fs.simulate(q, k, v, "splitkv", block_sizes=(1, 16), num_splits=10, io_dtype="float16")
    assert r.traffic == t3
    np.testing.assert_allclose(r.out, fs.attention_reference(q, k, v)[0], rtol=1e-12)


def test_count_is_fast_at_a_million_tokens():
    import time
    t0 = time.perf_counter()
    for causal in (False, True):
        fs.count("splitkv", Nq=2**20, Nk=2**20, d=128, sram_bytes="192KiB", causal=causal,
                 num_splits=16)
    assert time.perf_counter() - t0 < 2.0


# -- errors --------------------------------------------------------------------------------

@pytest.mark.parametrize("algorithm, num_splits, exc, match", [
    ("splitkv", 0, ValueError, "num_splits must be >= 1"),
    ("splitkv", -1, ValueError, "num_splits must be >= 1"),
    ("splitkv", 1.5, TypeError, "num_splits must be an integer"),
    ("splitkv", True, TypeError, "num_splits must be an integer"),
    ("splitkv", None, ValueError, "splitkv needs num_splits"),
    ("flash2", 2, ValueError, "num_splits applies to algorithm='splitkv'"),
    ("flash1", 1, ValueError, "num_splits applies to algorithm='splitkv'"),
    ("standard", 4, ValueError, "num_splits applies to algorithm='splitkv'"),
])
def test_bad_num_splits(algorithm, num_splits, exc, match):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((4, 8))
    blocks = None if algorithm == "standard" else (2, 2)
    with pytest.raises(exc, match=match):
        fs.simulate(q, q, q, algorithm, block_sizes=blocks, num_splits=num_splits)
    with pytest.raises(exc, match=match):
        fs.count(algorithm, Nq=4, Nk=4, d=8, block_sizes=blocks, num_splits=num_splits)


@settings(max_examples=100)
@given(attention_problems(max_seq=70, max_dim=16, max_block=16, allow_empty=True),
       st.integers(1, 16), WINDOWS)
def test_the_merge_in_a_cluster(p, s, window):
    """cluster=True: the memory merge's outputs bit for bit, its traffic without the
    partials, and simulate == count == theory."""
    kw = dict(block_sizes=p.block_sizes, causal=p.causal, window=window, num_splits=s)
    mem = fs.simulate(p.q, p.k, p.v, "splitkv", **kw)
    cl = fs.simulate(p.q, p.k, p.v, "splitkv", cluster=True, **kw)
    assert np.array_equal(cl.out, mem.out) and np.array_equal(cl.lse, mem.lse)
    partials = fs.Traffic(reads={t: mem.traffic.reads.get(t, 0) for t in ("Osplit", "Lsplit")},
                          writes={t: mem.traffic.writes.get(t, 0) for t in ("Osplit", "Lsplit")})
    assert cl.traffic + partials == mem.traffic
    assert cl.traffic == _count(p, s, window=window, cluster=True)
    shape = check_arrays(p.q, p.k, p.v)[3]
    t = fs.theory.traffic("splitkv", Nq=p.Nq, Nk=p.Nk, d=p.d, dv=p.dv, Br=p.block_sizes[0],
                          Bc=p.block_sizes[1], causal=p.causal, window=window, itemsize=8,
                          problems=shape.problems, num_splits=s, cluster=True)
    assert t == cl.traffic


@pytest.mark.parametrize("algorithm, num_splits, cluster, exc, match", [
    ("splitkv", 17, True, ValueError, "at most 16"),
    ("splitkv", 2, "yes", TypeError, "cluster must be True or False"),
    ("flash2", None, True, ValueError, "cluster applies to algorithm='splitkv'"),
])
def test_bad_cluster(algorithm, num_splits, cluster, exc, match):
    q = np.random.default_rng(0).standard_normal((4, 8))
    with pytest.raises(exc, match=match):
        fs.simulate(q, q, q, algorithm, block_sizes=(2, 2), num_splits=num_splits,
                    cluster=cluster)
    with pytest.raises(exc, match=match):
        fs.count(algorithm, Nq=4, Nk=4, d=8, block_sizes=(2, 2), num_splits=num_splits,
                 cluster=cluster)
    with pytest.raises(ValueError, match="cluster"):
        fs.simulate(q[None], q[None], q[None], "ring", world_size=2, cluster=True)


def test_theory_bad_num_splits():
    with pytest.raises(ValueError, match="splitkv needs num_splits"):
        theory_splitkv(Nq=4, Nk=4, d=8, Br=2, Bc=2, num_splits=None)
    with pytest.raises(ValueError, match="not both"):
        theory_splitkv(Nq=4, Nk=4, d=8, Br=2, Bc=2, causal=True, right=0, num_splits=2)


def test_theory_refuses_splitkv_options_for_other_algorithms():
    """num_splits and cluster belong to splitkv: given for another algorithm they are an
    error (as in simulate and count), not ignored."""
    kw = dict(Nq=4, Nk=4, d=8, Br=2, Bc=2)
    with pytest.raises(ValueError, match="num_splits applies to algorithm='splitkv'"):
        fs.theory.traffic("flash2", **kw, num_splits=2)
    with pytest.raises(ValueError, match="cluster applies to algorithm='splitkv'"):
        fs.theory.traffic("flash1", **kw, cluster=True)
    with pytest.raises(TypeError, match="cluster must be True or False"):
        fs.theory.traffic("square", **kw, cluster="yes")
    assert fs.theory.traffic("flash2", **kw) == fs.count("flash2", Nq=4, Nk=4, d=8,
                                                          block_sizes=(2, 2))


# -- command line ----------------------------------------------------------------------------

def test_cli_simulate_splitkv(capsys):
    import json
    from flashsim.cli import main
    argv = ["simulate", "--algorithm", "splitkv", "--num-splits", "4", "--seq", "2",
            "--seq-k", "3000", "--head-dim", "32", "--heads", "4", "--kv-heads", "2",
            "--sram", "32KiB", "--causal"]
    assert main(argv + ["--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    want = fs.count("splitkv", Nq=2, Nk=3000, d=32, batch_shape=(1, 4), kv_batch_shape=(1, 2),
                    sram_bytes="32KiB", causal=True, num_splits=4)
    assert d["traffic"] == want.to_dict() and d["num_splits"] == 4
    assert d["matches_theory"] is True and d["matches_count"] is True
    assert d["max_abs_error"] < 1e-10 and d["sram_peak_bytes"] <= 32 * 1024
    assert main(argv + ["--no-math"]) == 0
    out = capsys.readouterr().out
    assert "Osplit" in out and "Lsplit" in out and "matches closed form: yes" in out
    assert "4 per Q tile" in out
    # --cluster: the same run without the partials in HBM
    assert main(argv + ["--cluster", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    want = fs.count("splitkv", Nq=2, Nk=3000, d=32, batch_shape=(1, 4), kv_batch_shape=(1, 2),
                    sram_bytes="32KiB", causal=True, num_splits=4, cluster=True)
    assert d["traffic"] == want.to_dict() and d["cluster"] is True
    assert d["matches_theory"] is True and d["matches_count"] is True
    assert "Osplit" not in d["traffic"]["reads"]


@pytest.mark.parametrize("argv, match", [
    (["--algorithm", "splitkv"], "needs --num-splits"),
    (["--algorithm", "splitkv", "--num-splits", "0"], "--num-splits must be >= 1"),
    (["--num-splits", "2"], "applies to --algorithm splitkv"),
    (["--cluster"], "--cluster applies to --algorithm splitkv"),
    (["--algorithm", "splitkv", "--num-splits", "17", "--cluster"], "at most 16"),
])
def test_cli_bad_num_splits(capsys, argv, match):
    from flashsim.cli import main
    assert main(["simulate", "--seq", "64", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flashsim: error: ") and match in err
