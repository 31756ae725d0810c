"""flash2_fwd_ws's synchronisation, as kernels_cu/ws_protocol.py models it: random tile
sequences (per-warpgroup bounds, warpgroups past N, tiles with no visible key, 1–3 K/V
stages, two or three consumers, with and without the tile counter) under random
interleavings finish without a deadlock, an over-arrival or an arrival left behind, every
warpgroup taking the same turns; and the checker does catch a broken protocol (a producer
that does not arrive for the warpgroups that skip a step)."""

import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "kernels_cu"))
import ws_protocol as W  # noqa: E402


def _cases(n, seed):
    rng = random.Random(seed)
    for i in range(n):
        C = rng.choice((2, 3))
        yield i, C, rng.choice((1, 2, 3)), W.random_tiles(rng, C, rng.randrange(1, 7))


def test_the_consumer_loop_finishes_under_random_interleavings():
    for i, C, stages, tiles in _cases(2000, 50):
        for counter in (0, 1):
            # the O slot freed at the epilogue, or by its first warp during the next tile
            result, turns = W.run(tiles, C, stages, counter, i, free_late=bool(i & 1))
            assert result == "ok", (C, stages, counter, tiles)
            # jhi − jlo + 2 turns per tile with a visible key, for every warpgroup;
            # warpgroup 0 the ring's last pass too
            n = sum(jhi - jlo + 2 for jlo, jhi, _ in tiles if jhi >= jlo)
            assert turns == [n + 1] + [n] * (C - 1)


def test_the_checker_catches_a_producer_that_leaves_skipped_slots_unfreed():
    # warpgroup 1's rows end at key tile 1 of 0…3: with one stage the producer's second
    # fill waits for warpgroup 1's arrival on a slot it never reads
    assert W.run([(0, 3, [3, 1])], 2, 1, 0, 0)[0] == "ok"
    assert W.run([(0, 3, [3, 1])], 2, 1, 0, 0, frees_skipped=False)[0] == "deadlock"
    results = [W.run(t, C, s, 0, i, frees_skipped=False)[0] for i, C, s, t in _cases(300, 1)]
    assert results.count("deadlock") > 0 and results.count("ok") < len(results)


def test_the_checker_catches_an_o_slot_never_freed_late():
    # the third tile's Q_i (or, after two tiles, the producer's end mark) goes into the
    # first one's slot, which waits for each warpgroup's first warp to arrive there during
    # the second tile
    tiles = [(0, 1, [1, 1])] * 3
    for n in (2, 3):
        assert W.run(tiles[:n], 2, 2, 0, 0)[0] == "ok"
        assert W.run(tiles[:n], 2, 2, 0, 0, frees_late=False)[0] == "deadlock"
    # with one tile no slot is refilled: the arrival left behind is what shows
    assert W.run(tiles[:1], 2, 2, 0, 0, frees_late=False)[0] == "arrival left"
