"""flashsim.testing: the README's "Fuzz your own kernel" example run on a wrong and a
correct NumPy kernel, FlashAttention's rule on outputs, lse and gradients, and the
traffic comparison."""

import re
from pathlib import Path

import numpy as np
import pytest

import flashsim as fs
from flashsim.testing import assert_attention_close, assert_traffic_equal, register_profiles

README = Path(__file__).resolve().parent.parent / "README.md"


def _heads(q, k, v):
    """K/V repeated over the query heads of their GQA group."""
    if q.ndim >= 3 and k.ndim >= 3 and k.shape[-3] != q.shape[-3]:
        g = q.shape[-3] // k.shape[-3]
        k, v = np.repeat(k, g, axis=-3), np.repeat(v, g, axis=-3)
    return k, v


def blockwise(q, k, v, causal=False, rescale_sum=True, Bc=16):
    """Online-softmax attention over K/V blocks in float32, the output in q's dtype. With
    ``rescale_sum=False`` it forgets to rescale the running sum ℓ when the row max grows
    (O is rescaled): right whenever the first block holds each row's max, wrong otherwise."""
    k, v = _heads(q, k, v)
    f = np.float32
    q32, k32, v32 = (x.astype(f) for x in (q, k, v))
    Nq, Nk = q.shape[-2], k.shape[-2]
    lead = np.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    m = np.full(lead + (Nq,), -np.inf, f)
    ell = np.zeros(lead + (Nq,), f)
    O = np.zeros(lead + (Nq, v.shape[-1]), f)
    scale = f(1 / np.sqrt(q.shape[-1]))
    rows = np.arange(Nq)[:, None]
    for j0 in range(0, Nk, Bc):
        S = scale * q32 @ np.swapaxes(k32[..., j0:j0 + Bc, :], -1, -2)
        if causal:
            cols = np.arange(j0, min(j0 + Bc, Nk))[None, :]
            S = np.where(cols <= rows + Nk - Nq, S, -np.inf)
        m_new = np.maximum(m, S.max(axis=-1))
        safe = np.where(np.isneginf(m_new), 0, m_new)
        P = np.exp(S - safe[..., None])
        alpha = np.exp(np.where(np.isneginf(m), -np.inf, m - safe))
        ell = (alpha if rescale_sum else 1) * ell + P.sum(axis=-1)
        O = alpha[..., None] * O + P @ v32[..., j0:j0 + Bc, :]
        m = m_new
    out = np.where(ell[..., None] > 0, O / np.where(ell > 0, ell, 1)[..., None], 0)
    return out.astype(q.dtype)


def readme_example(kernel):
    """The README's example with ``my_attention`` = kernel; returns its test function."""
    text = README.read_text()
    section = text[text.index("## Fuzz your own kernel"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    code = code.replace("from my_package import my_attention", "")
    ns = {"my_attention": kernel}
    exec(compile(code, "README.md (Fuzz your own kernel)", "exec"), ns)
    return ns["test_my_attention"]


def test_the_readme_example_catches_a_wrong_kernel():
    test = readme_example(lambda q, k, v, causal: blockwise(q, k, v, causal, rescale_sum=False))
    with pytest.raises(AssertionError, match=r"out: max error .*dense attention in float16") as e:
        test()
    # Hypothesis reports the shrunk example that fails (its wording varies by version)
    report = str(e.value) + "".join(getattr(e.value, "__notes__", []))
    assert re.search(r"(Falsifying example|Failing test case): test_my_attention\(", report)


def test_the_readme_example_passes_a_correct_kernel():
    readme_example(blockwise)()


def test_the_rule_on_outputs_lse_and_gradients():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 4, 40, 16)).astype(np.float16)
    k = rng.standard_normal((2, 2, 56, 16)).astype(np.float16)
    v = rng.standard_normal((2, 2, 56, 16)).astype(np.float16)
    r = fs.simulate(q, k, v, "flash2", block_sizes=(16, 16), causal=True, precision="kernel")
    out = r.out.astype(np.float16)
    assert_attention_close(out, q, k, v, causal=True, lse=r.lse)
    do = rng.standard_normal(out.shape).astype(np.float16)
    g = fs.simulate_backward(q, k, v, r.out, r.lse, do, "flash2", block_sizes=(16, 16),
                             causal=True, precision="kernel")
    assert_attention_close(out, q, k, v, causal=True, dout=do, grads=(g.dq, g.dk, g.dv))
    # a wrong element, a wrong lse, a wrong gradient: each named
    bad = out.copy()
    bad[1, 2, 7, 3] += np.float16(0.05)
    with pytest.raises(AssertionError, match=r"out: .* at index \(1, 2, 7, 3\)"):
        assert_attention_close(bad, q, k, v, causal=True)
    with pytest.raises(AssertionError, match="lse: max error"):
        assert_attention_close(out, q, k, v, causal=True, lse=r.lse + 1e-3)
    dk = g.dk.copy()
    dk[0, 1, 5, 2] += 5.0
    with pytest.raises(AssertionError, match=r"dk: max error .* at index \(0, 1, 5, 2\)"):
        assert_attention_close(out, q, k, v, causal=True, dout=do, grads=(g.dq, dk, g.dv))
    # float64 is held to 1e-10 relative
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    ref, _ = fs.attention_reference(q64, k64, v64)
    assert_attention_close(ref, q64, k64, v64)
    with pytest.raises(AssertionError, match="1e-10 relative"):
        assert_attention_close(ref + 1e-6, q64, k64, v64)
    with pytest.raises(ValueError, match="io_dtype must be one of"):
        assert_attention_close(out, q, k, v, io_dtype="int8")
    with pytest.raises(ValueError, match="needs the dout"):
        assert_attention_close(out, q, k, v, grads=(g.dq, g.dk, g.dv))


def test_traffic_equal_shows_what_differs():
    a = fs.count("flash2", Nq=100, Nk=100, d=64, block_sizes=(32, 32))
    assert_traffic_equal(a, fs.count("flash2", Nq=100, Nk=100, d=64, block_sizes=(32, 32)))
    b = fs.count("flash2", Nq=100, Nk=100, d=64, block_sizes=(16, 32))
    with pytest.raises(AssertionError, match=r"read +K +51,200 +89,600 +-38,400") as e:
        assert_traffic_equal(a, b)
    assert str(e.value).startswith("traffic differs from the simulator's")
    assert "Q" not in str(e.value)          # only what differs
    with pytest.raises(TypeError, match="two flashsim.Traffic"):
        assert_traffic_equal(a, {"K": 1})


def test_profiles_register():
    from hypothesis import settings
    register_profiles()
    assert settings.get_profile("flashsim-dev").max_examples == 25
