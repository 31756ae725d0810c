"""Which tile pairs a mask leaves to visit: checked against the elementwise mask."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from flashsim.strategies import seq_lens
from flashsim.tiling import CAUSAL, FULL, Band, Tiles, parse_size

BANDS = st.sampled_from([FULL, CAUSAL, Band(3, 0), Band(0, 5), Band(7, 2), Band(None, 4),
                         Band(2, None), Band(0, 0)])


@given(seq_lens(80, allow_zero=True), seq_lens(80, allow_zero=True),
       st.integers(1, 20), st.integers(1, 20), BANDS)
def test_visited_pairs_are_exactly_those_with_a_visible_entry(Nq, Nk, Br, Bc, band):
    tiles = Tiles(Nq, Nk, Br, Bc, band)
    full = band.allowed(np.arange(Nq), np.arange(Nk), Nk - Nq)
    jlo, jhi = tiles.kv_ranges()
    ilo, ihi = tiles.q_ranges()
    for i in range(tiles.Tr):
        for j in range(tiles.Tc):
            block = full[i * Br:(i + 1) * Br, j * Bc:(j + 1) * Bc]
            visible = bool(block.any())
            assert (jlo[i] <= j <= jhi[i]) == visible
            assert (ilo[j] <= i <= ihi[j]) == visible
            if visible:
                assert tiles.partial(i, j) == (not block.all())
                np.testing.assert_array_equal(tiles.mask(i, j), block)


def test_causal_is_bottom_right_aligned():
    m = CAUSAL.allowed(np.arange(2), np.arange(5), 5 - 2)
    np.testing.assert_array_equal(m, [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    m = CAUSAL.allowed(np.arange(5), np.arange(2), 2 - 5)
    np.testing.assert_array_equal(m, [[0, 0], [0, 0], [0, 0], [1, 0], [1, 1]])


def test_parse_size():
    assert parse_size("192KiB") == 192 * 1024
    assert parse_size("1.5MiB") == 3 * 2**19
    assert parse_size("100KB") == 100_000
    assert parse_size(4096) == parse_size("4096") == 4096
