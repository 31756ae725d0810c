"""The flash algorithms never hold an Nq × Nk array: their traced peak stays within a
small multiple of the inputs and output, where S alone would be N²·8 bytes."""

import tracemalloc

import numpy as np
import pytest

import flashsim as fs


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["flash1", "flash2"])
def test_peak_memory_is_linear_in_n(algorithm):
    N, d = 16384, 64
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((N, d)) for _ in range(3))
    io_bytes = 4 * q.nbytes                                  # q + k + v + out
    tracemalloc.start()
    try:
        r = fs.simulate(q, k, v, algorithm, block_sizes=(256, 256))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= 8 * io_bytes, f"{peak / 2**20:.1f} MiB traced"
    assert peak < N * N * 8 / 16                             # far below one N×N array
    assert r.out.shape == (N, d) and np.isfinite(r.out).all()


def test_standard_does_materialise_s():
    # the contrast that makes the point: Algorithm 0 holds S and P
    N, d = 1024, 16
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((N, d)) for _ in range(3))
    tracemalloc.start()
    try:
        fs.simulate(q, k, v, "standard")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak >= N * N * 8
