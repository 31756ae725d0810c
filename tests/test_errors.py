"""Bad input gets a clear, typed error that names the fix."""

import numpy as np
import pytest

import flashsim as fs

rng = np.random.default_rng(0)
q = rng.standard_normal((2, 4, 10, 8))
k = rng.standard_normal((2, 4, 12, 8))
v = rng.standard_normal((2, 4, 12, 6))


@pytest.mark.parametrize("args, kwargs, exc, match", [
    ((q, k[..., :7], v), {}, ValueError, "head dim d"),
    ((q, k, v[..., :5, :]), {}, ValueError, "number of keys Nk"),
    ((q, k[:, :3], v[:, :3]), {}, ValueError, "does not divide"),
    ((q[0, 0, 0], k, v), {}, ValueError, "at least 2 dimensions"),
    ((q.astype(np.int64), k, v), {}, TypeError, "floating-point"),
    ((q, k.astype(bool), v), {}, TypeError, "floating-point"),
    ((np.where(q > 2, np.nan, q), k, v), {}, ValueError, "NaN or Inf"),
    ((q, k, np.where(v > 2, np.inf, v)), {}, ValueError, "NaN or Inf"),
    ((q, k, v), {"block_sizes": (0, 4)}, ValueError, "Br"),
    ((q, k, v), {"block_sizes": (4, -1)}, ValueError, "Bc"),
    ((q, k, v), {"block_sizes": (4,)}, TypeError, "pair"),
    ((q, k, v), {"block_sizes": (4.5, 4)}, TypeError, "integer"),
    ((q, k, v), {}, ValueError, "neither"),
    ((q, k, v), {"block_sizes": (4, 4), "sram_bytes": 4096}, ValueError, "both"),
    ((q, k, v, "flash3"), {"block_sizes": (4, 4)}, ValueError, "unknown algorithm"),
    ((q, k, v), {"block_sizes": (4, 4), "scale": float("nan")}, ValueError, "finite"),
    ((q, k, v), {"block_sizes": (4, 4), "io_dtype": "int8"}, TypeError, "floating"),
    ((q, k, v), {"sram_bytes": "12 parsecs"}, ValueError, "cannot read size"),
    ((q, k, v), {"block_sizes": (4, 4), "causal": "yes"}, TypeError, "causal"),
    ((q, k[0], v[1]), {"block_sizes": (4, 4)}, None, ""),
])
def test_bad_input(args, kwargs, exc, match):
    if exc is None:
        # k[0] and v[1] broadcast against q's batch axis: a valid call
        fs.simulate(*args, **kwargs)
        return
    with pytest.raises(exc, match=match):
        fs.simulate(*args, **kwargs)


def test_sram_too_small_names_the_minimum():
    with pytest.raises(fs.SRAMOverflowError, match="at least") as e:
        fs.simulate(q, k, v, "flash2", sram_bytes=100)
    assert isinstance(e.value, ValueError)
    need = e.value.minimum_bytes
    fs.simulate(q, k, v, "flash2", sram_bytes=need)          # the minimum works
    with pytest.raises(fs.SRAMOverflowError):
        fs.simulate(q, k, v, "flash2", sram_bytes=need - 1)
    with pytest.raises(fs.SRAMOverflowError) as e1:
        fs.count("flash1", Nq=10, Nk=10, d=8, sram_bytes=1)
    # flash1 keeps six row statistics live, flash2 three: 3·4 more bytes at 1×1 tiles
    # (d = 8, dv = 6 above; d = dv = 8 here, at fp16)
    assert e1.value.minimum_bytes == (8 + 8 + 8 + 8 + 1) * 2 + 6 * 4


def test_count_rejects_bad_sizes():
    with pytest.raises(ValueError, match="Nq"):
        fs.count("flash2", Nq=-1, Nk=4, d=8, block_sizes=(2, 2))
    with pytest.raises(ValueError, match="d must be >= 1"):
        fs.count("flash2", Nq=4, Nk=4, d=0, block_sizes=(2, 2))
    with pytest.raises(TypeError, match="integer"):
        fs.count("flash2", Nq=4.0, Nk=4, d=8, block_sizes=(2, 2))
    with pytest.raises(ValueError, match="does not divide"):
        fs.count("flash2", Nq=4, Nk=4, d=8, batch_shape=(6,), kv_batch_shape=(4,),
                 block_sizes=(2, 2))


def test_gpu_arrays_are_refused_with_a_hint():
    class FakeCupy:
        __cuda_array_interface__ = {}
    with pytest.raises(TypeError, match="asnumpy"):
        fs.simulate(FakeCupy(), k, v, block_sizes=(2, 2))
