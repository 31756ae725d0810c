"""The three-level model (flashsim.hierarchy): its limits (an L2 larger than the problem,
an L2 of zero bytes), monotonicity in the L2's size, a case worked by hand, its programs
against the simulator's own schedule, and the launch table against the kernels' sources."""

import dataclasses
import re

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import flashsim as fs
from flashsim import hierarchy as h
from flashsim import kernels as K
from flashsim.hardware import H100, GPU
from flashsim.memory import Machine
from flashsim.problem import make_shape
from flashsim.variants import make_band


def gpu(l2_bytes, num_sms=4, partitions=1, **kw):
    """A small GPU (few SMs) with an L2 of ``l2_bytes`` in ``partitions`` LRUs."""
    return dataclasses.replace(H100, name="test GPU", num_sms=num_sms, l2_bytes=l2_bytes,
                               l2_retention=None, l2_partitions=partitions, **kw)


problems = st.fixed_dictionaries({
    "N": st.integers(1, 700), "Nk": st.integers(1, 700), "heads": st.sampled_from([1, 2, 4]),
    "groups": st.sampled_from([1, 2]), "d": st.sampled_from([64, 128]),
    "causal": st.booleans(), "backward": st.booleans(), "det": st.booleans(),
    "launch": st.sampled_from(["auto", "tc", "ref"]),
    "dtype": st.sampled_from(["float16", "bfloat16"]), "partitions": st.sampled_from([1, 2])})


def predict(p, hw):
    kw = dict(Nq=p["N"], Nk=p["Nk"], d=p["d"], batch_shape=(2, p["heads"] * p["groups"]),
              kv_batch_shape=(2, p["heads"]), causal=p["causal"], io_dtype=p["dtype"],
              hardware=hw, launch=p["launch"])
    if p["backward"]:
        return fs.count_backward("flash2", deterministic=p["det"], **kw)
    return fs.count("flash2", **kw)


@settings(max_examples=150, deadline=None)
@given(problems)
def test_an_l2_larger_than_the_problem_moves_the_compulsory_bytes(p):
    pred = predict(p, gpu(2**40, partitions=p["partitions"]))
    for lp in pred.launches:
        lv = lp.levels
        # every distinct byte read once; every byte written reaches DRAM once (during the
        # launch or after it)
        assert lv.dram.reads == lv.compulsory.reads
        assert (lv.dram + lp.writeback).writes == lv.compulsory.writes
        assert lv.dram.reduces == {} and lv.compulsory.reduces == {}


@settings(max_examples=150, deadline=None)
@given(problems)
def test_an_l2_of_zero_bytes_moves_the_two_level_count(p):
    pred = predict(p, gpu(0, partitions=p["partitions"]))
    lv = pred.levels
    # the SMs' traffic is the two-level count, with the kernels' atomics as reductions
    assert lv.sm_l2.reductions_as_reads_and_writes() == pred.traffic
    # with no L2, DRAM sees every access: reductions as a read and a write each
    assert lv.dram == pred.traffic
    assert pred.writeback == fs.Traffic()


@settings(max_examples=100, deadline=None)
@given(problems, st.lists(st.integers(0, 3 * 2**20), min_size=2, max_size=4))
def test_dram_traffic_never_rises_as_l2_grows(p, sizes):
    previous = None
    for size in sorted(sizes):
        pred = predict(p, gpu(size, partitions=p["partitions"]))
        lv = pred.levels
        assert lv.dram.read_bytes >= lv.compulsory.read_bytes
        total = [(lp.levels.dram + lp.writeback).total_bytes for lp in pred.launches]
        reads = [lp.levels.dram.read_bytes for lp in pred.launches]
        if previous is not None:
            assert all(r <= q for r, q in zip(reads, previous[0]))
            assert all(t <= q for t, q in zip(total, previous[1]))
        previous = reads, total


def test_one_heads_kv_past_l2_is_read_once_per_wave():
    """Worked by hand. One head, N = 1024, d = 64, float16, the reference kernel with
    64×64 tiles: Tr = 16 CTAs, 2 SMs × 2 CTAs = 4 slots, so W = 4 waves of 4 CTAs that
    sweep K/V in step. K + V = 2 · 1024 · 64 · 2 = 256 KiB. An L2 of 48 KiB holds only
    part of it: each wave reads all of K and V again, and Q once (64 KiB of K and V tiles
    per step never revisited within the reach of a 48 KiB LRU)."""
    hw = gpu(48 * 1024, num_sms=2, max_blocks_per_sm=2)
    pred = fs.count("flash2", Nq=1024, Nk=1024, d=64, io_dtype="float16", hardware=hw,
                    launch="ref", block_sizes=(64, 64))
    (lp,) = pred.launches
    assert lp.launch.slots == 4 and lp.launch.ctas == 16 and lp.launch.waves == 4
    KV = 1024 * 64 * 2
    assert lp.levels.dram.reads == {"Q": KV, "K": 4 * KV, "V": 4 * KV}
    # the SMs read K and V once per CTA: 16 times
    assert lp.levels.sm_l2.reads == {"Q": KV, "K": 16 * KV, "V": 16 * KV}
    # with room for K and V (256 KiB) plus what streams past, one read each
    big = fs.count("flash2", Nq=1024, Nk=1024, d=64, io_dtype="float16",
                   hardware=gpu(400 * 1024, num_sms=2, max_blocks_per_sm=2), launch="ref",
                   block_sizes=(64, 64))
    assert big.levels.dram.reads == {"Q": KV, "K": KV, "V": KV}
    assert lp.makespan == 4 * 16 and big.launches[0].makespan == 64


def test_data_every_sm_reads_takes_room_in_every_partition():
    """The same launch on 2 SMs wired to 2 L2 partitions: each wave's CTAs sit on both
    sides, so each partition keeps a copy of K and V (256 KiB). 400 KiB in two
    partitions of 200 KiB holds no copy whole: K and V are read once per wave, as with
    48 KiB; 600 KiB (300 KiB each) holds them: read once."""
    KV = 1024 * 64 * 2
    for l2, reads in ((400 * 1024, 4 * KV), (600 * 1024, KV)):
        hw = gpu(l2, num_sms=2, partitions=2, max_blocks_per_sm=2)
        pred = fs.count("flash2", Nq=1024, Nk=1024, d=64, io_dtype="float16", hardware=hw,
                        launch="ref", block_sizes=(64, 64))
        assert pred.levels.dram.reads == {"Q": KV, "K": reads, "V": reads}


@pytest.mark.parametrize("backward", [False, True])
def test_superblocks_stay_close_to_the_exact_lru(backward):
    """Folding G tiles of the streamed tensor into one entry (forced here by a small event
    budget) keeps the SM traffic exact, the compulsory bytes exact, and the DRAM bytes
    within 2% of the tile-by-tile LRU."""
    shape = make_shape(Nq=8192, Nk=8192, d=64, batch_shape=(1, 2))
    band = make_band(True, None)
    hw = gpu(3 * 2**20, num_sms=8, partitions=2)
    exact = h.predict(shape, "float16", band, hw, backward=backward, max_events=10**9)
    folded = h.predict(shape, "float16", band, hw, backward=backward, max_events=1000)
    assert max(lp.superblock for lp in folded.launches) > 1
    assert max(lp.superblock for lp in exact.launches) == 1
    assert folded.levels.sm_l2 == exact.levels.sm_l2
    assert folded.levels.compulsory == exact.levels.compulsory
    a, b = folded.levels.dram.total_bytes, exact.levels.dram.total_bytes
    assert abs(a - b) <= 0.02 * b


def test_dispatch_takes_the_first_free_slot():
    start, slot = h.dispatch(np.array([3, 1, 2, 2]), 2)
    assert start.tolist() == [0, 0, 1, 3] and slot.tolist() == [0, 1, 1, 0]   # ties: lowest slot
    start, slot = h.dispatch(np.array([5, 5, 5, 5, 5]), 2)
    assert start.tolist() == [0, 0, 5, 5, 10] and slot.tolist() == [0, 1, 0, 1, 0]
    assert h.dispatch(np.array([4, 1]), 8)[0].tolist() == [0, 0]


def test_causal_heavy_tiles_start_first():
    shape = make_shape(Nq=1024, Nk=1024, d=128, batch_shape=(1, 1))
    (L,) = h.launches(shape, "float16", H100)
    assert L.kernel == "flash2_fwd_ws" and L.order == "reversed"
    prog = h.program(L, shape, "float16", make_band(True, None))
    # blockIdx.x = 0 runs the last Q tile, which sees every key tile
    assert prog.n.tolist() == [8, 7, 6, 5, 4, 3, 2, 1]


def test_banded_copy_engine_launches_take_problems_in_chunks(monkeypatch):
    """Under a causal mask the model runs flash2_fwd_ws's tiles and flash2_bwd_ws's CTAs in
    the kernels' order (kernels.ws_order): a chunk's heaviest tiles across its problems
    first; without a mask the grid's order."""
    monkeypatch.setattr(K, "WS_CHUNK_BYTES", 4 * 1024 * 256 * 2)     # chunks of 4 problems
    shape = make_shape(Nq=1024, Nk=1024, d=128, batch_shape=(2, 3))
    (L,) = h.launches(shape, "float16", H100)
    assert L.kernel == "flash2_fwd_ws" and L.grid == (8, 6)
    prog = h.program(L, shape, "float16", make_band(True, None))
    Q = prog.prologue[0]
    # a first chunk of 2 problems, then one of 4: Q tile 7 (8 key tiles) of each in turn
    assert Q.problem[:4].tolist() == [0, 1, 0, 1] and Q.tile[:4].tolist() == [7, 7, 6, 6]
    assert prog.n[:4].tolist() == [8, 8, 7, 7]
    assert Q.problem[16:22].tolist() == [2, 3, 4, 5, 2, 3] and prog.n[16:22].tolist() == [8] * 4 + [7] * 2
    plain = h.program(L, shape, "float16", make_band(False, None))
    assert plain.prologue[0].problem[:9].tolist() == [0] * 8 + [1]
    main = h.launches(shape, "float16", H100, backward=True)[1]
    assert main.kernel == "flash2_bwd_ws"
    bprog = h.program(main, shape, "float16", make_band(True, None))
    KV = bprog.prologue[0]                       # K/V tile 0 (seen by every query) first
    assert KV.tile[:4].tolist() == [0, 0, 1, 1] and bprog.inner_problem[:4].tolist() == [0, 1, 0, 1]


# -- the model's programs are the simulator's schedule --------------------------------

class TraceMachine(Machine):
    """Records every tile move of the simulator, in order."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.trace = []

    def load(self, tensor, src, r0, r1, **kw):
        self.trace.append(("read", tensor, r0, r1))
        return super().load(tensor, src, r0, r1, **kw)

    def store(self, tensor, dst, r0, r1, tile, **kw):
        self.trace.append(("write", tensor, r0, r1))
        return super().store(tensor, dst, r0, r1, tile, **kw)


def program_trace(prog, launch, stream_rows=None):
    """The moves of problem 0's CTAs, in tile order (the simulator's loop order)."""
    P = launch.grid[1]
    ctas = [c for c in range(len(prog.n)) if c // launch.grid[0] == 0]
    tile_of = {c: int(launch.tile_of(c % launch.grid[0])) for c in ctas}
    out = []

    def moves(stream, t):
        r0 = t * stream.B
        r1 = min(r0 + stream.B, stream.N)
        return [(k, tensor, r0, r1) for tensor, k, _ in stream.parts]

    for c in sorted(ctas, key=lambda c: tile_of[c]):
        for a in prog.prologue:
            if a.active[c]:
                out += moves(a.stream, int(a.tile[c]))
        for s in range(int(prog.n[c])):
            for stream in prog.inner:
                out += moves(stream, int(prog.lo[c]) + s)
        for a in prog.epilogue:
            if a.active[c]:
                out += moves(a.stream, int(a.tile[c]))
    assert P >= 1
    return out


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 300), st.integers(1, 300), st.booleans(), st.sampled_from([64, 128]))
def test_forward_program_is_the_simulators_schedule(Nq, Nk, causal, d):
    import sys
    S = sys.modules["flashsim.simulate"]     # (fs.simulate, the function, shadows it)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((Nq, d))
    k, v = rng.standard_normal((Nk, d)), rng.standard_normal((Nk, d))
    shape = make_shape(Nq=Nq, Nk=Nk, d=d)
    (L,) = h.launches(shape, "float16", H100, launch="ref", block_sizes=(64, 32))
    prog = h.program(L, shape, "float16", make_band(causal, None))
    mc = TraceMachine(1, 2, None)
    from flashsim.problem import canonical
    from flashsim.tiling import Tiles
    from flashsim.variants import make_scores
    scores = make_scores(shape, 1.0, causal, None, None, None)
    Q, K_, V = canonical(q, k, v, shape)
    S._flash2(mc, Q, K_, V, shape, Tiles(Nq, Nk, 64, 32, scores.band), scores)
    want = [(kind, t, r0, r1) for kind, t, r0, r1 in mc.trace]
    assert program_trace(prog, L) == want


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 300), st.integers(1, 300), st.booleans())
def test_backward_main_program_is_the_simulators_main_loop(Nq, Nk, causal):
    import flashsim.backward as Bw
    d = 64
    rng = np.random.default_rng(1)
    q = rng.standard_normal((Nq, d))
    k, v = rng.standard_normal((Nk, d)), rng.standard_normal((Nk, d))
    r = fs.simulate(q, k, v, "flash2", block_sizes=(32, 32), causal=causal)
    shape = make_shape(Nq=Nq, Nk=Nk, d=d)
    launches = h.launches(shape, "float16", H100, backward=True, launch="ref",
                          block_sizes=(32, 64))
    main = launches[1]
    assert main.kernel == "flash2_bwd_main"
    prog = h.program(main, shape, "float16", make_band(causal, None))
    mc = TraceMachine(1, 2, None)
    Machine_ = Bw.Machine
    Bw.Machine = lambda *a, **kw: mc
    try:
        Bw.simulate_backward(q, k, v, r.out, r.lse, rng.standard_normal((Nq, d)), "flash2",
                             block_sizes=(32, 64), causal=causal)
    finally:
        Bw.Machine = Machine_
    # the simulator's main loop: after D and the whole-dQacc zeroing, before the post-pass;
    # its dQacc read + write of a step is the kernel's reduction
    trace = mc.trace
    start = next(i for i, m in enumerate(trace) if m[1] == "dQacc") + 1
    end = max(i for i, m in enumerate(trace) if m[1] in ("dK", "dV")) + 1
    main_trace, merged = trace[start:end], []
    for m in main_trace:
        if m[1] == "dQacc" and m[0] == "write" and merged and merged[-1] == ("read", "dQacc", m[2], m[3]):
            merged[-1] = ("reduce", "dQacc", m[2], m[3])
        else:
            merged.append(m)
    assert program_trace(prog, main) == merged


def test_sm_l2_traffic_is_the_two_level_count_with_reductions():
    for causal in (False, True):
        kw = dict(Nq=1000, Nk=1300, d=128, batch_shape=(2, 8), kv_batch_shape=(2, 2),
                  causal=causal, io_dtype="bfloat16", hardware="H100")
        f = fs.count("flash2", **kw)
        L = f.launches[0].launch
        two_level = {k: v for k, v in kw.items() if k != "hardware"}
        assert f.levels.sm_l2 == f.traffic == fs.count("flash2", block_sizes=(L.Br, L.Bc),
                                                       **two_level)
        b = fs.count_backward("flash2", **kw)
        assert b.levels.sm_l2.reductions_as_reads_and_writes() == b.traffic
        # the two-level count writes dQacc once whole (the pre-pass's zeros) and once per
        # visited tile; the second is the kernel's reduction
        zeros = 1000 * 128 * 4 * 16
        assert b.levels.sm_l2.reduces == {"dQacc": b.traffic.writes["dQacc"] - zeros}


# -- the launch table against the kernels ----------------------------------------------

def test_launch_orders_match_the_kernels_block_index_arithmetic():
    """Each kernel's outer tile comes from blockIdx.x as LAUNCH_SPECS says (the
    deterministic tensor-core backward reverses through its DET template flag)."""
    text = {src: (K.kernel_dir() / src).read_text() for src in K.SOURCES}
    # the decoding kernels' grids (splits × Q tiles × batch·kv_heads) and flash1's and
    # standard attention's (kernels.ALGORITHM_GRIDS) are not in the three-level model yet:
    # they alone are outside the table
    outside = {n for names in K.SOURCES.values() for n in names} - set(K.LAUNCH_SPECS)
    assert outside == set(K.SOURCES["splitkv_tc.cu"]) | set(K.ALGORITHM_GRIDS)
    for src, names in K.SOURCES.items():
        body = text[src]
        for name in names:
            if name in outside:
                continue
            spec = K.LAUNCH_SPECS[name]
            if name in ("flash2_bwd_tc", "flash2_bwd_tc_det", "flash2_bwd_wg",
                        "flash2_bwd_wg_det"):
                line = re.search(r"seq_at<VL>\(vl, DET \? gridDim\.x - 1 - blockIdx\.x : "
                                 r"blockIdx\.x, .*\n\s*const int j = sq\.tile", body)
                assert line, "the fast backwards' j mapping moved"
                assert spec.order == ("reversed" if name.endswith("_det") else "natural")
                continue
            if name in ("flash2_bwd_ws", "flash2_bwd_ws_det"):     # no varlen instance
                # (under a band, not _det, chunks of problems: kernels.ws_chunk, 1 without)
                assert re.search(r"int p = blockIdx\.y, j = DET \? gridDim\.x - 1 - blockIdx\.x : "
                                 r"blockIdx\.x;\s*if \(!DET && chunk > 1\)", body), \
                    "the TMA backward's j mapping moved"
                assert spec.order == ("reversed" if name.endswith("_det") else "natural")
                continue
            if name == "flash2_fwd_ws":   # tiles in chunks of problems, Q tile nx − 1 − xi of
                # each in turn, from blockIdx.x in steps of gridDim.x (under a band, then
                # from a counter): with chunk = 1 (no band: kernels.ws_chunk) the
                # (reversed) order of a grid of nx × problems
                assert re.search(r"const int xi = r / gc;\s*x\.p = pb \+ \(r - xi \* gc\);"
                                 r"\s*x\.i0 = \(nx - 1 - xi\) \* Br", body), "the TMA forward's order moved"
                assert K.ws_chunk(7, 4096, 128, 128, banded=False) == 1
                assert len(re.findall(r"\(int\)blockIdx\.x \+ kq \* \(int\)gridDim\.x",
                                      body)) == 2, "the TMA forward's walk moved"
                assert re.search(r"\(int\)gridDim\.x \+ \(int\)atomicAdd\(tile_counter, 1u\)",
                                 body), "the TMA forward's tile counter moved"
                assert spec.order == "reversed"
                continue
            m = re.search(r"__global__ void[^;{]*?\b" + name + r"\(", body)
            assert m, name
            after = body[m.end():m.end() + 4000]
            var = "j" if spec.over == "kv" else "i"
            # the fast rungs' tile comes through their varlen table's seq_at (dense: x)
            rev = (re.search(rf"const int {var} = gridDim\.x - 1 - blockIdx\.x", after)
                   or re.search(rf"seq_at<VL>\(vl, gridDim\.x - 1 - blockIdx\.x, .*\n\s*"
                                rf"const int {var} = sq\.tile", after))
            nat = (re.search(rf"const int {var}0? = blockIdx\.x", after)
                   or re.search(rf"seq_of\(vl, blockIdx\.x, .*\n\s*const int {var} = sq\.tile", after))
            assert (rev is not None) == (spec.order == "reversed"), name
            assert rev or nat, name


def test_the_other_algorithms_grids_match_their_kernels():
    """kernels.ALGORITHM_GRIDS (what the launcher sizes gridDim.x by) against the blockIdx.x
    arithmetic of flash1_ref.cu, standard_ref.cu and square_ref.cu (whose square tiles
    are B = Br = Bc)."""
    want = {"problem": None, "q": r"i0 = blockIdx\.x \* Br?\b", "kv": r"j0 = blockIdx\.x \* Bc",
            "row": r"(r = blockIdx\.x|\* Nq \+ blockIdx\.x)"}
    for src in ("flash1_ref.cu", "standard_ref.cu", "square_ref.cu"):
        body = (K.kernel_dir() / src).read_text()
        starts = [(m.start(), name) for name in K.SOURCES[src]
                  for m in [re.search(r"__global__ void " + name + r"\(", body)]]
        starts.sort()
        for n, (start, name) in enumerate(starts):
            text = body[start:starts[n + 1][0] if n + 1 < len(starts) else len(body)]
            pattern = want[K.ALGORITHM_GRIDS[name]]
            if pattern is None:
                assert "blockIdx.x" not in text, name
            else:
                assert re.search(pattern, text), name
    assert K.grid("flash1_fwd", 100, 70, 16, 8, 6) == (1, 6)
    assert K.grid("standard_bwd_dk", 100, 70, 16, 8, 6) == (9, 6)
    assert K.grid("standard_fwd_softmax", 100, 70, 16, 8, 6) == (100, 6)


def test_grids_threads_and_occupancy():
    shape = make_shape(Nq=4096, Nk=2048, d=128, batch_shape=(2, 4))
    (f,) = h.launches(shape, "float16", H100)
    # d = dv = 128: the forward fed by the copy engine, as fs.gpu runs dense inputs there
    assert f.kernel == "flash2_fwd_ws" and f.grid == (32, 8) and f.threads == 384
    assert f.ctas_per_sm == 1 and f.slots == 132
    (w,) = h.launches(make_shape(Nq=4096, Nk=2048, d=128, dv=64, batch_shape=(2, 4)),
                      "float16", H100)
    assert w.kernel == "flash2_fwd_ws" and w.threads == 384      # dv < d: its instance, D = 128
    (w,) = h.launches(make_shape(Nq=4096, Nk=2048, d=160, batch_shape=(2, 4)), "float16", H100)
    assert w.kernel == "flash2_fwd_wg" and w.threads == 256      # D = 192: the cp.async kernel
    pre, main, post = h.launches(shape, "float16", H100, backward=True)
    # d = dv = 128: the backward fed by the copy engine, flash2_bwd_wg's tiles
    assert (pre.kernel, main.kernel, post.kernel) == (
        "flash2_bwd_preprocess_tc", "flash2_bwd_ws", "flash2_bwd_postprocess")
    assert (main.Br, main.Bc) == K.WG_BWD_BLOCKS[128] and main.threads == 384
    (_, w64, _) = h.launches(make_shape(Nq=4096, Nk=2048, d=64, batch_shape=(2, 4)), "float16",
                             H100, backward=True)
    assert w64.kernel == "flash2_bwd_ws" and w64.threads == 384      # D = 64 too
    assert (w64.Br, w64.Bc) == K.WG_BWD_BLOCKS[64]
    (_, w160, _) = h.launches(make_shape(Nq=4096, Nk=2048, d=160, batch_shape=(2, 4)), "float16",
                              H100, backward=True)
    assert w160.kernel == "flash2_bwd_wg" and w160.threads == 256    # D = 160: the cp.async one
    _, tc_main, _ = h.launches(shape, "float16", H100, backward=True, launch="tc")
    assert tc_main.kernel == "flash2_bwd_tc"
    assert pre.grid == (4096 // K.TC_PRE_BR, 8) and main.grid == (2048 // 128, 8)
    assert post.grid == (4096 // 64, 8) and main.reduces == ("dQacc",)
    (a,) = h.launches(make_shape(Nq=512, Nk=512, d=64), "bfloat16", "A100")
    assert a.kernel == "flash2_fwd_tc" and (a.Br, a.Bc) == K.TC_BLOCKS_AMPERE[64]
    # d = 80 runs the Hopper instance of D = 96 (fed by the copy engine, which zero-fills
    # the columns past 80), whose η counts the useful share of its products; d = 84 (no
    # 16-byte rows) the reference rung
    (w,) = h.launches(make_shape(Nq=512, Nk=512, d=80), "float16", H100)
    assert w.kernel == "flash2_fwd_ws" and (w.Br, w.Bc) == K.WS_BLOCKS[96]
    assert h.efficiency("flash2_fwd_ws", 80) == pytest.approx(
        h.EFFICIENCY["flash2_fwd_ws", 96] * 80 / 96)
    assert h.efficiency("flash2_fwd_wg", 80) == pytest.approx(
        h.EFFICIENCY["flash2_fwd_wg", 96] * 80 / 96)
    assert h.efficiency("flash2_fwd_wg", 112) == pytest.approx(
        h.EFFICIENCY["flash2_fwd_wg", 128] * 112 / 128)
    (a80,) = h.launches(make_shape(Nq=512, Nk=512, d=80), "float16", "A100")
    assert a80.kernel == "flash2_fwd_tc" and (a80.Br, a80.Bc) == K.tc_blocks(96, 8, True)
    (r,) = h.launches(make_shape(Nq=512, Nk=512, d=84), "float16", H100)
    assert r.kernel == "flash2_fwd" and (r.Br, r.Bc) == K.default_block_sizes(
        84, 84, "float16", H100.smem_per_block)
    with pytest.raises(ValueError, match="compute capability 9.0"):
        h.launches(shape, "float16", "A100", backward=True, launch="wg")
    with pytest.raises(ValueError, match="compute capability 9.0"):
        h.launches(shape, "float16", "A100", launch="wg")


def test_occupancy_rules():
    # 255 registers × 128 threads: 2 CTAs by registers; 80 KiB of shared memory: 2 by smem
    assert K.ctas_per_sm(threads=128, registers=255, smem=80 * 1024) == 2
    assert K.ctas_per_sm(threads=256, registers=189, smem=160 * 1024) == 1
    assert K.ctas_per_sm(threads=128, registers=32, smem=0) == 16
    assert K.ctas_per_sm(threads=128, registers=32, smem=0, max_blocks_per_sm=32) == 16
    assert K.ctas_per_sm(threads=128, registers=255, smem=300 * 1024) == 0


# -- hardware as data -------------------------------------------------------------------

def test_presets_carry_what_a_launch_model_needs():
    for g in fs.hardware.PRESETS.values():
        assert g.num_sms > 0 and g.l2_bytes > 0 and g.l2_bytes_per_s > g.hbm_bytes_per_s
        assert g.dram_sustained_bytes_per_s <= g.hbm_bytes_per_s
        assert g.l2_line_bytes == 128 and g.l2_sector_bytes == 32
        # (the H100's fitted retention puts a little more than half its nominal L2 in
        # each partition: see flashsim/hardware.py)
        assert all(c > 0 for c in g.l2_capacities) and len(g.l2_capacities) in (1, 4)
    assert fs.hardware.H100.l2_partitions == 2 and fs.hardware.H200.l2_retention is None
    assert fs.hardware.H200.l2_bytes == 60 * 2**20 and fs.hardware.H100.l2_bytes == 50 * 2**20
    assert fs.hardware.get("h100") is fs.hardware.H100
    with pytest.raises(ValueError, match="unknown hardware"):
        fs.hardware.get("V100")
    with pytest.raises(TypeError, match="preset name"):
        fs.hardware.get(3)


@pytest.mark.parametrize("change, error", [
    (dict(num_sms=0), ValueError), (dict(l2_bytes=-1), ValueError),
    (dict(num_sms=1.5), TypeError), (dict(peak_flops="fast"), TypeError),
    (dict(smem_per_block=10**9), ValueError), (dict(l2_retention=(5, 1)), ValueError),
    (dict(l2_retention=(1, 2**40)), ValueError), (dict(l2_sector_bytes=48), ValueError),
])
def test_a_gpu_is_checked_when_built(change, error):
    with pytest.raises(error):
        dataclasses.replace(H100, **change)


def test_a_user_gpu():
    mine = GPU(name="mine", compute_capability=90, peak_flops=1e15, hbm_bytes_per_s=3e12,
               dram_sustained_bytes_per_s=2.5e12, l2_bytes_per_s=6e12, smem_per_sm=228 * 1024,
               l1_smem_per_sm=256 * 1024, smem_per_block=227 * 1024, num_sms=100,
               l2_bytes=32 * 2**20, source="made up")
    # d = 32: flash2_fwd_wg, two CTAs per SM; d = 64: flash2_fwd_ws, one
    p = fs.count("flash2", Nq=4096, Nk=4096, d=32, hardware=mine)
    assert p.launches[0].launch.slots == 200 and p.time_s > 0
    p = fs.count("flash2", Nq=4096, Nk=4096, d=64, hardware=mine)
    assert p.launches[0].launch.slots == 100 and p.time_s > 0


# -- the API ------------------------------------------------------------------------------

def test_hardware_in_simulate_and_backward_equals_count():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 4, 200, 64)).astype(np.float16) for _ in range(3))
    r = fs.simulate(q, k, v, "flash2", causal=True, hardware="H100")
    c = fs.count("flash2", Nq=200, Nk=200, d=64, batch_shape=(2, 4), causal=True,
                 hardware="H100")
    assert r.block_sizes == fs.kernels.WS_BLOCKS[64]   # the copy-engine forward's
    assert r.prediction.levels == c.levels and r.traffic == c.traffic
    assert r.prediction.time_s == c.time_s
    do = rng.standard_normal(q.shape).astype(np.float16)
    g = fs.simulate_backward(q, k, v, r.out, r.lse, do, "flash2", causal=True,
                             hardware="H100", deterministic=True)
    cb = fs.count_backward("flash2", Nq=200, Nk=200, d=64, batch_shape=(2, 4), causal=True,
                           hardware="H100", deterministic=True)
    assert g.prediction.levels == cb.levels and g.traffic == cb.traffic
    assert [lp.launch.kernel for lp in cb.launches][1] == "flash2_bwd_ws_det"
    # without hardware, nothing changes
    assert fs.simulate(q, k, v, "flash2", block_sizes=(128, 64), causal=True).prediction is None


def test_hardware_argument_errors():
    with pytest.raises(ValueError, match="run flash2"):
        fs.count("flash1", Nq=64, Nk=64, d=64, hardware="H100")
    with pytest.raises(ValueError, match="drop sram_bytes"):
        fs.count("flash2", Nq=64, Nk=64, d=64, sram_bytes="192KiB", hardware="H100")
    with pytest.raises(ValueError, match="launch must be"):
        fs.count("flash2", Nq=64, Nk=64, d=64, hardware="H100", launch="fast")
    with pytest.raises(ValueError, match="no kernel"):
        fs.count("flash2", Nq=64, Nk=64, d=64, hardware="H100", io_dtype="float8")
    with pytest.raises(ValueError, match="shared memory"):
        fs.count("flash2", Nq=64, Nk=64, d=64, hardware="H100", launch="ref",
                 block_sizes=(512, 512))


def test_levels_compare_add_and_print():
    p = fs.count_backward("flash2", Nq=300, Nk=300, d=64, hardware="H100")
    lv = p.levels
    assert lv == p.levels and set(lv) == {"SM-L2", "L2-DRAM", "compulsory"}
    assert (lv + lv)["SM-L2"] == lv.sm_l2 * 2
    text = p.table()
    assert "SM↔L2 reduce" in text and "L2↔DRAM read" in text and "flash2_bwd_ws" in text
    with pytest.raises(KeyError, match="levels are"):
        lv["HBM"]


def test_the_prediction_is_fast_at_quarter_million_tokens():
    import time
    t0 = time.perf_counter()
    p = fs.count("flash2", Nq=262144, Nk=262144, d=128, causal=True, hardware="H100")
    assert time.perf_counter() - t0 < 10      # under 2 s on a 2-core CI machine; slack for load
    assert p.levels.dram.read_bytes > 5 * p.levels.compulsory.read_bytes


def test_time_is_the_largest_of_its_terms():
    p = fs.count("flash2", Nq=16384, Nk=16384, d=128, batch_shape=(1, 8), hardware="H100")
    (lp,) = p.launches
    assert lp.time_s == max(lp.time_parts.values()) == lp.time_parts["compute"]
    eta = h.EFFICIENCY[("flash2_fwd_ws", 128)]
    F = 2 * 128 * 128 * 256
    assert lp.time_parts["compute"] == pytest.approx(
        lp.makespan * F / (eta * H100.peak_flops / lp.launch.slots))


def test_the_model_takes_the_instance_that_runs_the_variants():
    """With softcap or ALiBi the launch model takes the instance that runs them, as
    fs.gpu.block_sizes(..., softcap=...) does: at d = 64 on a 9.0 device flash2_fwd_ws's
    softcap/ALiBi tiles (the cp.async kernel's 64 keys, its own 192 rows), and the tc
    forward's softcap/ALiBi tiles; at d = 128, where the copy engine's tiles are the
    cp.async kernel's, flash2_fwd_ws with or without them."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 300, 64)).astype(np.float16) for _ in range(3))
    plain = fs.simulate(q, k, v, "flash2", hardware="H100")
    capped = fs.simulate(q, k, v, "flash2", softcap=30.0, hardware="H100")
    assert plain.block_sizes == K.WS_BLOCKS[64] != K.WG_BLOCKS[64]
    assert plain.prediction.launches[0].launch.kernel == "flash2_fwd_ws"
    assert capped.block_sizes == K.WS_BLOCKS_VAR[64] == (192, 64)
    assert capped.prediction.launches[0].launch.kernel == "flash2_fwd_ws"
    tc = fs.simulate(q, k, v, "flash2", alibi_slopes=np.full(2, 0.5), hardware="H100",
                     launch="tc")
    assert tc.block_sizes == K.TC_BLOCKS_VAR[64] != K.TC_BLOCKS[64]
    q, k, v = (rng.standard_normal((1, 2, 300, 128)).astype(np.float16) for _ in range(3))
    r = fs.simulate(q, k, v, "flash2", softcap=30.0, hardware="H100")
    assert r.prediction.launches[0].launch.kernel == "flash2_fwd_ws"
    assert r.block_sizes == K.WS_BLOCKS[128]
