"""flashsim.softmax: naive, safe and online softmax, values and counted accesses."""

import warnings

import numpy as np
import pytest
import scipy.special
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from flashsim.softmax import METHODS, SoftmaxResult, softmax

BLOCKS = (1, 3, 7, 64, 128, 1000)
# (reads, writes) per element of x: naive and online 2+1, safe 3+1.
SPLIT = {"naive": (2, 1), "safe": (3, 1), "online": (2, 1)}


@st.composite
def arrays(draw, lo=-30.0, hi=30.0):
    lead = draw(st.lists(st.integers(1, 4), min_size=0, max_size=3))
    n = draw(st.integers(1, 300))
    return draw(hnp.arrays(np.float64, tuple(lead) + (n,),
                           elements=st.floats(lo, hi, allow_nan=False, allow_infinity=False)))


def test_exports():
    assert METHODS == ("naive", "safe", "online")
    import flashsim
    assert flashsim.softmax is softmax


@settings(max_examples=100, deadline=None)
@given(x=arrays(), method=st.sampled_from(METHODS), block=st.sampled_from(BLOCKS))
def test_matches_scipy(x, method, block):
    r = softmax(x, method, block=block)
    assert isinstance(r, SoftmaxResult)
    assert r.method == method
    assert r.y.shape == x.shape and r.y.dtype == np.float64
    np.testing.assert_allclose(r.y, scipy.special.softmax(x, axis=-1), rtol=1e-12, atol=0)


@settings(max_examples=100, deadline=None)
@given(x=arrays(), method=st.sampled_from(METHODS), block=st.sampled_from(BLOCKS))
def test_access_counts(x, method, block):
    r = softmax(x, method, block=block)
    reads, writes = SPLIT[method]
    assert r.reads == reads * x.size
    assert r.writes == writes * x.size
    assert r.accesses_per_element == reads + writes


@pytest.mark.parametrize("block", [1, 5, 128])
def test_large_values_safe_and_online_naive_overflows(block):
    rng = np.random.default_rng(0)
    x = rng.uniform(-1e4, 1e4, size=(3, 2, 77))
    ref = scipy.special.softmax(x, axis=-1)
    for method in ("safe", "online"):
        np.testing.assert_allclose(softmax(x, method, block=block).y, ref,
                                   rtol=1e-12, atol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")       # naive must not print overflow warnings
        naive = softmax(x, "naive", block=block).y
    assert not np.isfinite(naive).all()


@pytest.mark.parametrize("method", ["safe", "online"])
@pytest.mark.parametrize("block", [1, 2, 128])
def test_neg_inf(method, block):
    x = np.array([[-np.inf] * 5,
                  [0.0, -np.inf, 1.0, -np.inf, 2.0],
                  [-np.inf, -np.inf, -np.inf, -np.inf, 3.0]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = softmax(x, method, block=block).y
    assert not np.isnan(y).any()
    np.testing.assert_array_equal(y[0], 0.0)
    assert y[1, 1] == 0.0 and y[1, 3] == 0.0
    np.testing.assert_allclose(y[1, [0, 2, 4]], scipy.special.softmax([0.0, 1.0, 2.0]),
                               rtol=1e-12)
    np.testing.assert_array_equal(y[2], [0, 0, 0, 0, 1])


@pytest.mark.parametrize("method", METHODS)
def test_one_d_and_float32(method):
    x = np.linspace(-3, 3, 11, dtype=np.float32)
    r = softmax(x, method, block=4)
    assert r.y.shape == (11,) and r.y.dtype == np.float64
    np.testing.assert_allclose(r.y, scipy.special.softmax(x.astype(np.float64)), rtol=1e-12)
    assert r.reads + r.writes == (4 if method == "safe" else 3) * 11


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("shape", [(0,), (4, 0), (0, 5), (2, 0, 3)])
def test_empty(method, shape):
    r = softmax(np.zeros(shape), method)
    assert r.y.shape == shape
    assert r.reads == r.writes == 0
    assert r.accesses_per_element == 0.0


def test_result_is_frozen():
    r = softmax(np.zeros(3))
    with pytest.raises(AttributeError):
        r.reads = 0


@pytest.mark.parametrize("method", ["fast", "Online", None, 3])
def test_bad_method(method):
    with pytest.raises(ValueError, match="choose one of"):
        softmax(np.zeros(3), method)


@pytest.mark.parametrize("block", [1.0, "8", True, None])
def test_block_wrong_type(block):
    with pytest.raises(TypeError, match="positive integer"):
        softmax(np.zeros(3), block=block)


@pytest.mark.parametrize("block", [0, -1])
def test_block_not_positive(block):
    with pytest.raises(ValueError, match="positive integer"):
        softmax(np.zeros(3), block=block)


def test_integer_x():
    with pytest.raises(TypeError, match="astype"):
        softmax(np.arange(3))


@pytest.mark.parametrize("x", [np.array([True, False]), np.array([1 + 1j]),
                               np.array(["a", "b"]), np.array([object()])])
def test_non_float_x(x):
    with pytest.raises(TypeError, match="float"):
        softmax(x)


def test_scalar_x():
    with pytest.raises(ValueError, match="axis"):
        softmax(np.float64(1.0))


def test_nan_x():
    with pytest.raises(ValueError, match="NaN"):
        softmax(np.array([0.0, np.nan]))


def test_pos_inf_x():
    with pytest.raises(ValueError, match=r"\+inf"):
        softmax(np.array([0.0, np.inf]))
