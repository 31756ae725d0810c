"""The accounting: simulate == count == theory byte for byte, and the traffic
properties the FlashAttention papers argue from."""

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import flashsim as fs
from flashsim import theory
from flashsim.strategies import attention_problems, problem_sizes
from flashsim.tiling import derive_block_sizes, sram_footprint

# the three schedules of the FlashAttention papers; splitkv and square have their own tests
CORE = ("standard", "flash1", "flash2")

IO = st.sampled_from(["float16", "bfloat16", "float32", "float64"])
SRAM = st.integers(2**9, 2**22)


def blocks_for(algorithm, p):
    """p's tiles; standard attention runs whole matrices (the paper's count) for even
    Nq and tiled products (as the GPU runs them) for odd, so both are drawn."""
    return None if algorithm == "standard" and p.Nq % 2 == 0 else p.block_sizes


@given(attention_problems(allow_empty=True), st.sampled_from(CORE), IO)
def test_simulated_equals_count_equals_theory(p, algorithm, io):
    blocks = blocks_for(algorithm, p)
    r = fs.simulate(p.q, p.k, p.v, algorithm, block_sizes=blocks, causal=p.causal, io_dtype=io)
    c = fs.count(algorithm, Nq=p.Nq, Nk=p.Nk, d=p.d, dv=p.dv, batch_shape=p.q.shape[:-2],
                 kv_batch_shape=p.k.shape[:-2], block_sizes=blocks, causal=p.causal,
                 io_dtype=io)
    assert r.traffic == c, r.traffic.diff(c)
    Br, Bc = blocks or (None, None)
    t = theory.traffic(algorithm, Nq=p.Nq, Nk=p.Nk, d=p.d, dv=p.dv, Br=Br, Bc=Bc,
                       causal=p.causal, itemsize=fs.problem.itemsize_of(io),
                       problems=int(np.prod(r.out.shape[:-2])))
    assert c == t, c.diff(t)


@settings(max_examples=60)
@given(attention_problems(max_seq=120), st.sampled_from(["flash1", "flash2"]),
       st.integers(2**10, 2**17))
def test_sram_budget_is_respected(p, algorithm, sram):
    try:
        r = fs.simulate(p.q, p.k, p.v, algorithm, sram_bytes=sram, causal=p.causal,
                        io_dtype="float16")
    except fs.SRAMOverflowError as e:
        assert e.minimum_bytes > sram
        return
    assert r.sram_peak_bytes <= sram
    Br, Bc = r.block_sizes
    if p.Nq >= Br and p.Nk >= Bc and not p.causal:
        # full tiles occur, so the peak is exactly the footprint the sizes were fitted to
        assert r.sram_peak_bytes == sram_footprint(algorithm, Br, Bc, p.d, p.dv, 2)
    assert r.traffic == fs.count(algorithm, Nq=p.Nq, Nk=p.Nk, d=p.d, dv=p.dv,
                                 batch_shape=p.q.shape[:-2], kv_batch_shape=p.k.shape[:-2],
                                 sram_bytes=sram, causal=p.causal, io_dtype="float16")


@given(problem_sizes(), st.sampled_from(["flash1", "flash2"]), SRAM, SRAM, IO)
def test_flash_traffic_never_rises_with_sram_noncausal(sizes, algorithm, m1, m2, io):
    small, large = sorted((m1, m2))
    try:
        t_small = fs.count(algorithm, **sizes, sram_bytes=small, io_dtype=io)
    except fs.SRAMOverflowError:
        return
    t_large = fs.count(algorithm, **sizes, sram_bytes=large, io_dtype=io)
    assert t_large.total_bytes <= t_small.total_bytes


def test_causal_flash2_traffic_can_rise_with_sram():
    """Not every property survives the causal mask. With d = 64, growing SRAM grows the
    streamed tile Bc of flash1 beyond Br... and for flash2 given block sizes, a wider K
    tile over-fetches past the diagonal: Q tile i reads whole K tiles up to the one
    holding its last visible key. N = 256, Br = 64: Bc = 64 reads 64+128+192+256 = 640
    K rows, Bc = 128 reads 128+128+256+256 = 768."""
    kw = dict(Nq=256, Nk=256, d=64, causal=True)
    narrow = fs.count("flash2", **kw, block_sizes=(64, 64))
    wide = fs.count("flash2", **kw, block_sizes=(64, 128))
    assert narrow.reads["K"] == 640 * 64 * 2 and wide.reads["K"] == 768 * 64 * 2
    assert wide.total_bytes > narrow.total_bytes


@given(problem_sizes(), SRAM, IO, st.booleans())
def test_flash2_never_moves_more_than_flash1(sizes, sram, io, causal):
    """With block sizes derived from the same SRAM, d = dv, and every query row seeing a
    key. The two exceptions are pinned down by the tests below."""
    sizes["dv"] = sizes["d"]
    assume(not causal or sizes["Nq"] <= sizes["Nk"])
    try:
        f1 = fs.count("flash1", **sizes, sram_bytes=sram, io_dtype=io, causal=causal)
        f2 = fs.count("flash2", **sizes, sram_bytes=sram, io_dtype=io, causal=causal)
    except fs.SRAMOverflowError:
        return
    assert f2.total_bytes <= f1.total_bytes


def test_flash2_can_move_more_when_dv_is_much_smaller_than_d():
    # flash2 re-reads K (d wide) per extra Q tile where flash1 re-reads O (dv wide):
    # Nq = 2, Nk = 1, d = 16, dv = 1, 512 B of fp64 SRAM leaves Br = 1, so flash2
    # reads K twice (256 B) while flash1 reads Q once and O (1 wide) twice.
    kw = dict(Nq=2, Nk=1, d=16, dv=1, sram_bytes=512, io_dtype="float64")
    assert fs.count("flash2", **kw).total_bytes > fs.count("flash1", **kw).total_bytes


def test_flash2_can_move_more_when_causal_rows_see_nothing():
    # Nq = 31 > Nk = 1 with a causal mask: only the last row sees a key. flash1's Q tiles
    # are at most d = 3 rows, so it reads one row of Q; flash2's one resident Q tile
    # covers all 31 rows and must be read whole.
    kw = dict(Nq=31, Nk=1, d=3, sram_bytes=966, causal=True)
    f1, f2 = fs.count("flash1", **kw), fs.count("flash2", **kw)
    assert f2.reads["Q"] == 31 * 3 * 2 and f1.reads["Q"] == 1 * 3 * 2
    assert f2.total_bytes > f1.total_bytes


@given(problem_sizes(), st.sampled_from(["flash1", "flash2"]), SRAM, IO, st.booleans())
def test_flash_reads_each_input_once_and_writes_output(sizes, algorithm, sram, io, causal):
    try:
        t = fs.count(algorithm, **sizes, sram_bytes=sram, io_dtype=io, causal=causal)
    except fs.SRAMOverflowError:
        return
    b = fs.problem.itemsize_of(io)
    n = int(np.prod(fs.problem.make_shape(**sizes).batch_shape))
    Nq, Nk, d, dv = sizes["Nq"], sizes["Nk"], sizes["d"], sizes["dv"]
    assume(Nq > 0 and Nk > 0)
    # rows that see at least one key under the bottom-right causal mask
    live = min(Nq, Nk) if causal else Nq
    assert t.reads["Q"] >= n * live * d * b
    assert t.reads["K"] >= n * Nk * d * b and t.reads["V"] >= n * Nk * dv * b
    if algorithm == "flash2":
        assert t.writes["O"] == n * Nq * dv * b     # O written exactly once
        assert t.writes["L"] == n * Nq * 4
    else:
        assert t.writes["O"] >= n * Nq * dv * b


def test_causal_square_closed_form():
    for N, B in [(1024, 64), (4096, 128), (96, 32)]:
        rows = theory.causal_square_rows(N, B)
        t2 = fs.count("flash2", Nq=N, Nk=N, d=64, block_sizes=(B, B), causal=True)
        t1 = fs.count("flash1", Nq=N, Nk=N, d=64, block_sizes=(B, B), causal=True)
        assert t2.reads["K"] == rows * 64 * 2
        assert t1.reads["Q"] == rows * 64 * 2


def test_standard_traffic_matches_algorithm_0():
    N, d = 1024, 64
    t = fs.count("standard", Nq=N, Nk=N, d=d, io_dtype="float16")
    # Θ(Nd + N²): 4 N·d element moves (Q, K, V, O) and 4 N² (S, P each written and read),
    # and the softmax pass's log-sum-exp L (fp32)
    assert t.total_bytes == 2 * (4 * N * d + 4 * N * N) + 4 * N
    assert t.reads["S"] == t.writes["S"] == t.reads["P"] == t.writes["P"] == 2 * N * N
    assert t.writes["L"] == 4 * N


def test_tiled_standard_reads_k_and_v_once_per_q_tile():
    N, d, B = 1000, 64, 128
    whole = fs.count("standard", Nq=N, Nk=N, d=d)
    tiled = fs.count("standard", Nq=N, Nk=N, d=d, block_sizes=(B, 64))
    Tr = -(-N // B)
    assert tiled.reads["K"] == Tr * whole.reads["K"] and tiled.reads["V"] == Tr * whole.reads["V"]
    assert tiled.reads["Q"] == whole.reads["Q"] and tiled.writes == whole.writes
    bw = fs.count_backward("standard", Nq=N, Nk=N, d=d, block_sizes=(B, 64))
    bw_whole = fs.count_backward("standard", Nq=N, Nk=N, d=d)
    Tc = -(-N // 64)
    assert bw.reads["Q"] == Tc * bw_whole.reads["Q"]
    assert bw.reads["dO"] == (Tc + 1) * bw_whole.reads["dO"] // 2
    assert bw.reads["K"] == Tr * bw_whole.reads["K"] and bw.writes == bw_whole.writes


def test_flash_traffic_follows_theorem2_shape():
    """Under the paper's block rule, flash1 traffic scales like N²d²/M: quadrupling M
    (in its valid range d ≤ M ≤ Nd) cuts the quadratic part about four-fold."""
    N, d = 16384, 64
    totals = [fs.count("flash1", Nq=N, Nk=N, d=d, sram_bytes=2 * M, io_dtype="float16")
              for M in (2**16, 2**18)]
    compulsory = 2 * 4 * N * d
    ratio = (totals[0].total_bytes - compulsory) / (totals[1].total_bytes - compulsory)
    assert 3.5 < ratio < 4.5
    assert theory.theorem2_flash(N, d, 2**16) / theory.theorem2_flash(N, d, 2**18) == 4


def test_count_is_fast_at_a_million_tokens():
    import time
    t0 = time.perf_counter()
    for alg in ("flash1", "flash2"):
        for causal in (False, True):
            fs.count(alg, Nq=2**20, Nk=2**20, d=128, sram_bytes="192KiB", causal=causal)
    # generous bound: the point is O(Tr + Tc) work, not O(Tr·Tc) = 10^8 pairs
    assert time.perf_counter() - t0 < 4.0


def test_derived_block_sizes_follow_the_paper():
    # M = 96 KiB of fp16 = 49152 elements, d = 64: ⌈M/4d⌉ = 192
    assert theory.paper_block_sizes(49152, 64) == (64, 192)
    assert derive_block_sizes("flash1", 96 * 1024, 64, 64, 2) == (64, 192)  # fits as is
    # d = 256 at 192 KiB: ⌈M/4d⌉ = 96 does not fit (K, V, Q, O alone are 4·96·256·2
    # bytes), so the tiles shrink to the largest that does
    Br, Bc = derive_block_sizes("flash1", 192 * 1024, 256, 256, 2)
    assert Br == Bc < 96
    assert sram_footprint("flash1", Br, Bc, 256, 256, 2) <= 192 * 1024
    assert sram_footprint("flash1", Br + 1, Bc + 1, 256, 256, 2) > 192 * 1024
    # flash2 keeps Q resident, so its resident tile is Br
    Br2, Bc2 = derive_block_sizes("flash2", 96 * 1024, 64, 64, 2)
    assert Bc2 == 64 and Br2 >= Bc


def test_traffic_value_type():
    a = fs.Traffic(reads={"Q": 10, "K": 0}, writes={"O": 5})
    b = fs.Traffic(reads={"Q": 1}, writes={"L": 4})
    assert (a + b).reads == {"Q": 11} and (a + b).writes == {"O": 5, "L": 4}
    assert a.read_bytes == 10 and a.write_bytes == 5 and a.total_bytes == 15
    assert sum([a, b]) == a + b and 2 * a == a + a
    assert a != b and "K" not in a.reads
    assert "total" in a.table() and "Q" in str(a)
    with pytest.raises(ValueError, match="non-negative"):
        fs.Traffic(reads={"Q": -1})
