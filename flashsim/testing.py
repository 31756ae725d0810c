"""Fuzz your own attention kernel against the simulator.

    from hypothesis import given
    from flashsim.testing import attention_problems, assert_attention_close

    @given(attention_problems(dtypes=[np.float16]))
    def test_my_kernel(p):
        out = my_kernel(p.q, p.k, p.v, causal=p.causal)
        assert_attention_close(out, p.q, p.k, p.v, causal=p.causal)

- `assert_attention_close(out, q, k, v, *, causal, scale, io_dtype, lse, dout, grads)`:
  FlashAttention's correctness rule. A kernel that computes in a low-precision I/O type
  passes when its error against the float64 result is at most twice the error of dense
  attention computed in that same type (every product accumulated in fp32 and rounded to
  the type, softmax in fp32 on the rounded scores: `flashsim.attention_same_dtype`), three
  times for gradients, plus a floor of one rounding of the output (a few units of the
  type's eps times the magnitude of what each gradient sums). float32 and float64 kernels
  are held to 1e-5 and 1e-10 relative instead, widened only by exp's condition number at
  huge logits. lse (natural log, fp32 as FlashAttention stores it) is checked where given.
- `assert_traffic_equal(measured, simulated)`: two `flashsim.Traffic` values equal byte for
  byte, else an AssertionError with a per-tensor table of what differs.
- The Hypothesis strategies of `flashsim.strategies` (`attention_problems`, `problem_sizes`,
  `seq_lens`, `head_dims`, `block_sizes`, `batch_shapes`): awkward sizes, GQA, outliers.
  `register_profiles()` adds the suite's settings profiles ("flashsim-ci": 150 examples,
  "flashsim-dev": 25) for ``--hypothesis-profile``.

Needs hypothesis for the strategies (a test dependency: ``pip install "flashsim[test]"``).
"""

from __future__ import annotations

import numpy as np

from .problem import canon_batch, canonical, check_arrays, check_scale
from .reference import attention_backward_reference, attention_reference, attention_same_dtype
from .strategies import (AttentionProblem, attention_problems, batch_shapes, block_sizes,
                         head_dims, problem_sizes, seq_lens)
from .traffic import Traffic
from .variants import Scores, make_scores

EPS = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24, "float64": 2.0**-53}
HALF = ("float16", "bfloat16")


def _dtype_name(io_dtype, out) -> str:
    name = str(getattr(io_dtype, "name", io_dtype) if io_dtype is not None else out.dtype)
    name = name.replace("torch.", "").replace("numpy.", "")
    if name not in EPS:
        raise ValueError(f"io_dtype must be one of {', '.join(EPS)} (the type the kernel "
                         f"computed in); got {name!r}. Pass io_dtype='bfloat16' for bfloat16 "
                         "values held in float32 arrays.")
    return name


def _problems(q, k, v, with_shapes=False):
    """(shape, canonical Q, K, V broadcast over the batch, [(q index, kv index)] per
    attention problem), and the unbroadcast canonical K, V shapes if asked."""
    q, k, v, shape = check_arrays(q, k, v)
    Q, K0, V0 = canonical(q, k, v, shape)
    lead = canon_batch(shape)
    K = np.broadcast_to(K0, lead[:-1] + (1,) + K0.shape[-2:])
    V = np.broadcast_to(V0, lead[:-1] + (1,) + V0.shape[-2:])
    idx = [(i, i[:-1] + (0,)) for i in np.ndindex(*lead)]
    if with_shapes:
        return shape, Q, K, V, idx, K0.shape, V0.shape
    return shape, Q, K, V, idx


def _canon_out(x, shape, trailing):
    lead = canon_batch(shape)
    return np.asarray(x, np.float64).reshape(lead + trailing)


def s_condition(q, k, dtype, scale=None) -> float:
    """eps(dtype)·√d·scale·max Σ|q||k|: how far a rounding of S = scale·QKᵀ in ``dtype``
    can move exp(S − m) relative to itself (exp's condition number at these logits)."""
    shape, Q, K, _, _ = _problems(q, k, k)
    s = check_scale(scale, shape.d)
    mag = np.abs(Q) @ np.swapaxes(np.abs(K), -1, -2)
    return float(EPS[dtype] * np.sqrt(shape.d) * s * mag.max(initial=0))


def same_dtype_errors(q, k, v, ref_out, *, io_dtype: str, causal: bool = False, scale=None,
                      dout=None, ref_grads=None) -> np.ndarray:
    """Largest error of dense attention computed in ``io_dtype`` itself against the float64
    ``ref_out`` (and, with ``dout``, of its dq, dk, dv against ``ref_grads``; dk, dv summed
    over each GQA group as the inputs' shapes have them): [out, dq, dk, dv]."""
    shape, Q, K, V, idx, k_shape, v_shape = _problems(q, k, v, with_shapes=True)
    ref = _canon_out(ref_out, shape, (shape.Nq, shape.dv))
    errs = np.zeros(4)
    if dout is not None:
        dO = _canon_out(dout, shape, (shape.Nq, shape.dv))
        dq, dk, dv = np.zeros(Q.shape), np.zeros(K.shape), np.zeros(V.shape)
    for qi, ki in idx:
        res = attention_same_dtype(Q[qi], K[ki], V[ki], None if dout is None else dO[qi],
                                   io_dtype=io_dtype, causal=causal, scale=scale)
        res = (res,) if dout is None else res
        errs[0] = max(errs[0], np.abs(res[0] - ref[qi]).max(initial=0))
        if dout is not None:
            dq[qi] = res[1]
            dk[ki] += res[2]
            dv[ki] += res[3]
    if dout is not None:
        from .backward import sum_to
        rq, rk, rv = (np.asarray(x, np.float64) for x in ref_grads)
        # GQA groups and broadcast batch axes summed, as the inputs' shapes have them
        for n, (g, like, r) in enumerate(((dq, Q.shape, rq), (dk, k_shape, rk),
                                          (dv, v_shape, rv)), start=1):
            errs[n] = np.abs(sum_to(g, like).reshape(r.shape) - r).max(initial=0)
    return errs


def grad_magnitudes(q, k, v, out, dout, *, causal: bool = False, scale=None, window=None,
                    softcap=None, alibi_slopes=None, s_rounding: float = 1.0) -> np.ndarray:
    """max over elements of Σ|terms| for dq = scale·dS K, dk = scale·dSᵀ Q, dv = Pᵀ dO, with
    |dS| bounded by P ∘ (|dO||V|ᵀ + rowsum|dO ∘ O|) from the float64 forward and P weighted
    by 1 + √d·scale·|q||k|ᵀ (a rounding of S moves P by that much relative): the size of
    what each gradient adds up, whose rounding a kernel cannot avoid. The variants
    (``window``, ``softcap``, ``alibi_slopes``, as `flashsim.simulate` takes them) shape
    P, and a softcap scales both the rounding's effect and dS by its derivative 1 − tanh².
    ``s_rounding`` scales the rounding of S relative to the tolerance's eps: 1 (default)
    for S rounded like the I/O type, eps(fp32)/eps(I/O) for kernels that form S in fp32
    from exact products, as the GPU kernels do."""
    shape, Q, K, V, idx = _problems(q, k, v)
    O = _canon_out(out, shape, (shape.Nq, shape.dv))
    dO = _canon_out(dout, shape, (shape.Nq, shape.dv))
    s = check_scale(scale, shape.d)
    sc = make_scores(shape, s, causal, window, softcap, alibi_slopes)
    slopes = None if sc.slopes is None else np.broadcast_to(sc.slopes, canon_batch(shape))
    res = np.zeros(3)
    acc_k: dict = {}
    acc_v: dict = {}
    for qi, ki in idx:
        one = Scores(s, sc.band, sc.softcap, None if slopes is None else slopes[qi])
        S, T = one.full(Q[qi], K[ki], shape.Nq, shape.Nk)
        dcap = 1.0 if T is None else 1 - T * T
        m = S.max(axis=-1, keepdims=True, initial=-np.inf)
        E = np.exp(S - np.where(np.isfinite(m), m, 0))
        P = E / np.maximum(E.sum(axis=-1, keepdims=True), 1e-300)
        Pm = P * (1 + s_rounding * np.sqrt(shape.d) * s * dcap
                  * (np.abs(Q[qi]) @ np.abs(K[ki]).T))
        ds = dcap * Pm * (np.abs(dO[qi]) @ np.abs(V[ki]).T
                          + np.abs(dO[qi] * O[qi]).sum(axis=-1, keepdims=True))
        res[0] = max(res[0], s * (ds @ np.abs(K[ki])).max(initial=0))
        acc_k[ki] = acc_k.get(ki, 0) + s * ds.T @ np.abs(Q[qi])
        acc_v[ki] = acc_v.get(ki, 0) + Pm.T @ np.abs(dO[qi])
    res[1] = max((np.max(a, initial=0) for a in acc_k.values()), default=0.0)
    res[2] = max((np.max(a, initial=0) for a in acc_v.values()), default=0.0)
    return res


def _where(err_arr) -> str:
    i = np.unravel_index(np.argmax(err_arr), err_arr.shape) if err_arr.size else ()
    return f" at index {tuple(int(x) for x in i)}"


def assert_attention_close(out, q, k, v, *, causal: bool = False, scale=None, io_dtype=None,
                           lse=None, dout=None, grads=None) -> None:
    """Check a kernel's attention output (and lse, and gradients ``grads`` = (dq, dk, dv)
    for upstream ``dout``) against the float64 oracle by FlashAttention's rule (see the
    module docstring). q, k, v, dout are the values the kernel saw (already in its I/O
    type); ``io_dtype`` defaults to out's dtype. Raises AssertionError naming the output,
    its error, the allowance and where the worst element is."""
    out = np.asarray(out)
    dtype = _dtype_name(io_dtype, out)
    if grads is not None and dout is None:
        raise ValueError("checking grads needs the dout they were computed for")
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    ref_out, ref_lse = attention_reference(q, k, v, causal=causal, scale=scale)
    out64 = out.astype(np.float64)
    if out64.shape != ref_out.shape:
        raise AssertionError(f"out has shape {out64.shape}; q, k, v make {ref_out.shape}")
    if np.isnan(out64).any():
        raise AssertionError(f"out has NaN{_where(np.isnan(out64))}")
    kappa = s_condition(q, k, "float32" if dtype in HALF else dtype, scale)
    vmax = max(1.0, float(np.abs(v).max(initial=0)))
    diff = np.abs(out64 - ref_out)
    err = float(diff.max(initial=0))
    if dtype in HALF:
        base = same_dtype_errors(q, k, v, ref_out, io_dtype=dtype, causal=causal, scale=scale)[0]
        floor = EPS[dtype] * float(np.abs(ref_out).max(initial=0))
        allowed = 2 * base + floor
        what = (f"2 × {base:.3g} (dense attention in {dtype}) + {floor:.3g} (one rounding "
                f"of the output)")
    else:
        tol = 1e-5 if dtype == "float32" else 1e-10
        allowed = max(tol, 4 * kappa) * vmax + tol * float(np.abs(ref_out).max(initial=0))
        what = f"{tol:g} relative, or exp's condition number at these logits ({kappa:.3g})"
    if not err <= allowed:
        raise AssertionError(f"out: max error {err:.3g} > {allowed:.3g} = {what}"
                             f"{_where(diff)}")
    if lse is not None:
        lse = np.asarray(lse, np.float64)
        if lse.shape != ref_lse.shape:
            raise AssertionError(f"lse has shape {lse.shape}; q, k, v make {ref_lse.shape}")
        empty = np.isneginf(ref_lse)
        if not np.array_equal(np.isneginf(lse), empty):
            raise AssertionError("lse must be −inf exactly where a row sees no key"
                                 + _where(np.isneginf(lse) != empty))
        d_l = np.where(empty, 0, np.abs(lse - np.where(empty, 0, ref_lse)))
        k32 = s_condition(q, k, "float32", scale)
        allowed_l = 4 * k32 + 2e-7 * float(np.abs(np.where(empty, 0, ref_lse)).max(initial=0)) \
            + (0 if dtype == "float64" else 1e-6)
        if not d_l.max(initial=0) <= allowed_l:
            raise AssertionError(f"lse: max error {d_l.max():.3g} > {allowed_l:.3g} (fp32 "
                                 f"storage and the scores' rounding){_where(d_l)}")
    if grads is not None:
        dout = np.asarray(dout, np.float64)
        ref = attention_backward_reference(q, k, v, dout, causal=causal, scale=scale)
        base_dtype = "float32" if dtype == "float64" else dtype
        errs = same_dtype_errors(q, k, v, ref_out, io_dtype=base_dtype, causal=causal,
                                 scale=scale, dout=dout, ref_grads=ref)[1:]
        mags = grad_magnitudes(q, k, v, ref_out, dout, causal=causal, scale=scale)
        for n, name in enumerate(("dq", "dk", "dv")):
            g = np.asarray(grads[n], np.float64)
            if g.shape != ref[n].shape:
                raise AssertionError(f"{name} has shape {g.shape}; expected {ref[n].shape}")
            diff = np.abs(g - ref[n])
            floor = 4 * EPS[base_dtype] * mags[n]
            allowed = 3 * errs[n] + floor
            if not diff.max(initial=0) <= allowed:
                raise AssertionError(
                    f"{name}: max error {diff.max():.3g} > {allowed:.3g} = 3 × {errs[n]:.3g} "
                    f"(dense attention's {name} in {base_dtype}) + {floor:.3g} (rounding of "
                    f"the terms it sums){_where(diff)}")


def assert_traffic_equal(measured: Traffic, simulated: Traffic) -> None:
    """``measured == simulated`` byte for byte, else an AssertionError listing every
    (direction, tensor) that differs with both counts and their difference."""
    if not isinstance(measured, Traffic) or not isinstance(simulated, Traffic):
        raise TypeError("assert_traffic_equal compares two flashsim.Traffic values, got "
                        f"{type(measured).__name__} and {type(simulated).__name__}")
    if measured == simulated:
        return
    lines = [f"{'':<8}{'tensor':<10}{'measured':>16}{'simulated':>16}{'difference':>16}"]
    for (direction, name), (a, b) in measured.diff(simulated).items():
        lines.append(f"{direction:<8}{name:<10}{a:>16,}{b:>16,}{a - b:>+16,}")
    raise AssertionError("traffic differs from the simulator's:\n" + "\n".join(lines))


PROFILES = {"flashsim-ci": 150, "flashsim-dev": 25}


def register_profiles() -> None:
    """Register the test suite's Hypothesis profiles (max examples as in PROFILES, no
    deadline) so ``--hypothesis-profile=flashsim-ci`` works in your suite."""
    from hypothesis import HealthCheck, settings
    for name, n in PROFILES.items():
        settings.register_profile(name, max_examples=n, deadline=None,
                                  suppress_health_check=[HealthCheck.too_slow,
                                                         HealthCheck.data_too_large])


__all__ = ["assert_attention_close", "assert_traffic_equal", "same_dtype_errors",
           "grad_magnitudes", "s_condition", "register_profiles", "PROFILES", "EPS",
           "attention_problems", "AttentionProblem", "problem_sizes", "seq_lens", "head_dims",
           "block_sizes", "batch_shapes"]
