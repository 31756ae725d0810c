"""The GPU kernels against the simulator: same outputs (to each dtype's precision), and
byte for byte the same HBM traffic in the instrumented build.

Marked `gpu`: skipped where CuPy or a CUDA device is missing. Run on a GPU machine from
the repository root: python3 -m pytest -m gpu --hypothesis-profile=gpu tests/test_gpu.py
"""

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

import flashsim as fs
from flashsim.precision import make_precision
from flashsim.strategies import random_tensor
from flashsim.testing import EPS, grad_magnitudes, s_condition, same_dtype_errors

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not fs.gpu.available(), reason="no CuPy or no CUDA device")]

try:
    import torch
    HAVE_TORCH = torch.cuda.is_available()
except ImportError:
    HAVE_TORCH = False

DTYPES = ["float16", "float32", "float64"] + (["bfloat16"] if HAVE_TORCH else [])
SEQS = (1, 7, 113, 128, 203, 1023)
HEAD_DIMS = (1, 3, 16, 32, 40, 59, 64, 96, 111, 128, 160, 256)
# head dims the fast rungs run (multiples of 8 up to their largest instance), drawn for d
# and dv alike: equal to an instance's D, and below it (columns zeroed on chip)
FAST_HEAD_DIMS = (8, 16, 24, 32, 40, 64, 72, 88, 96, 112, 128, 136, 152, 160, 176, 192, 216,
                  224, 256)


def on_rung(kernel: str, d: int, dv: int, backward: bool = False):
    """Only examples the rung has an instance for (each rung's largest is 256 today, so
    this holds for every head dim drawn; it stays for instances that stop below)."""
    dims = fs.kernels.WG_BWD_HEAD_DIMS if backward else fs.kernels.WG_HEAD_DIMS
    assume(kernel != "wg" or max(d, dv) <= max(dims))


def same_dtype_error(q, k, v, dtype, causal, ref_out):
    """[out error, …] of dense attention computed in `dtype` itself (flashsim.testing)."""
    return same_dtype_errors(q, k, v, ref_out, io_dtype=dtype, causal=causal)


def _same_dtype_grad_errors(q, k, v, dout, dtype, causal, ref):
    """dq, dk, dv errors of the same-dtype dense backward (GQA groups summed)."""
    out = fs.attention_reference(q, k, v, causal=causal)[0]
    return list(same_dtype_errors(q, k, v, out, io_dtype=dtype, causal=causal, dout=dout,
                                  ref_grads=ref)[1:])


def _grad_magnitudes(q, k, v, o, dout, causal):
    return grad_magnitudes(q, k, v, o, dout, causal=causal)


@st.composite
def gpu_problems(draw, max_seq=1023, head_dims=HEAD_DIMS, dtypes=None, any_blocks=True,
                 same_dv=False, dv_dims=HEAD_DIMS):
    Nq = draw(st.one_of(st.sampled_from([n for n in SEQS if n <= max_seq]),
                        st.integers(1, min(max_seq, 300))))
    Nk = draw(st.one_of(st.sampled_from([n for n in SEQS if n <= max_seq]),
                        st.integers(1, min(max_seq, 300))))
    d = draw(st.sampled_from(head_dims))
    dv = d if same_dv else draw(st.one_of(st.just(d), st.sampled_from(dv_dims)))
    dtype = draw(st.sampled_from(dtypes or DTYPES))
    hk = draw(st.integers(1, 2))
    g = draw(st.sampled_from([1, 2, 3]))
    B = draw(st.integers(1, 2))
    # keep one launch small enough for the float64 simulator on the host
    while B * hk * g * Nq * Nk > 1_500_000 and (B > 1 or g > 1 or hk > 1):
        B, g, hk = 1, 1, max(1, hk - 1)
    causal = draw(st.booleans())
    blocks = None if not any_blocks else draw(st.one_of(
        st.none(), st.tuples(st.sampled_from([1, 16, 24, 32, 64]), st.sampled_from([8, 16, 48, 64]))))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    rnd = make_precision("kernel", dtype).io_round   # the exact values the kernel sees
    q = rnd(random_tensor(rng, (B, hk * g, Nq, d))).astype(np.float64)
    k = rnd(random_tensor(rng, (B, hk, Nk, d))).astype(np.float64)
    v = rnd(random_tensor(rng, (B, hk, Nk, dv))).astype(np.float64)
    return q, k, v, dtype, causal, blocks


def dev(x, dtype):
    """x on the device in `dtype`: bfloat16 as a PyTorch tensor (on the CPU when
    emulated: tests/test_emulate.py runs these checks there), else CuPy (NumPy)."""
    if dtype == "bfloat16":
        import torch
        t = torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16)
        return t if fs.gpu.is_emulated() else t.cuda()
    if fs.gpu.is_emulated():
        return x.astype(dtype)
    import cupy as cp
    return cp.asarray(x.astype(dtype))


def laid_out(x, salt: int = 0):
    """x (from `dev`) in one of three layouts, chosen by its shape so that every fuzzed
    example runs one and a failure replays: dense; rows padded by 8 elements (a row
    stride of d + 8: read in place where d is a multiple of 8, else copied once); or
    its last two leading axes swapped in memory ((B, N, H, d) seen as (B, H, N, d)).
    The kernels read the last two through their strides."""
    kind = (sum(x.shape) + salt) % 3
    if kind == 0 or x.ndim < 2 or (kind == 2 and x.ndim < 3):
        return x
    d = x.shape[-1]
    if type(x).__module__.split(".")[0] == "torch":
        if kind == 1:
            buf = x.new_zeros(tuple(x.shape[:-1]) + (d + 8,))
            buf[..., :d] = x
            return buf[..., :d]
        return x.transpose(-2, -3).contiguous().transpose(-2, -3)
    xp = fs.gpu._device.cupy()
    if kind == 1:
        buf = xp.zeros(x.shape[:-1] + (d + 8,), x.dtype)
        buf[..., :d] = x
        return buf[..., :d]
    return xp.ascontiguousarray(xp.swapaxes(x, -2, -3)).swapaxes(-2, -3)


def host(x):
    if type(x).__module__.split(".")[0] == "torch":
        return x.float().cpu().numpy().astype(np.float64)
    if isinstance(x, np.ndarray):
        return x.astype(np.float64)
    import cupy as cp
    return cp.asnumpy(x).astype(np.float64)


def fits(blocks, shape_d, shape_dv, dtype, backward=False):
    kernel = "flash2_bwd_main" if backward else "flash2_fwd"
    return fs.kernels.smem_bytes(kernel, *blocks, shape_d, shape_dv, dtype) <= fs.gpu.smem_limit()


def poison_outputs(monkeypatch):
    """Every output buffer starts as NaN (all-ones bits), so an unwritten element shows."""
    real = fs.gpu._arrays.empty

    def empty(_cp, shape, dtype, *args, **kw):
        a = real(_cp, shape, dtype, *args, **kw)
        a.fill(-1 if a.dtype.kind in "iu" else np.nan)   # bfloat16's bits: all ones
        return a
    monkeypatch.setattr(fs.gpu._arrays, "empty", empty)


@pytest.fixture
def poisoned(monkeypatch):
    poison_outputs(monkeypatch)


@given(gpu_problems())
def test_forward_matches_simulator(poisoned, problem):
    check_forward(*problem, kernel="ref")


TC_DTYPES = [t for t in ("float16", "bfloat16") if t in DTYPES]


def hopper():
    """The device runs the sm_90a kernels (compute capability 9.0)."""
    import cupy as cp
    return cp.cuda.Device().compute_capability == "90"


# the fast rungs, forward and backward: mma.sync everywhere, warpgroup MMAs on compute
# capability 9.0
FAST_RUNGS = ["tc", pytest.param("wg", marks=pytest.mark.skipif(
    not fs.gpu.available() or not hopper(), reason="the wg kernel needs compute capability 9.0"))]


@pytest.mark.parametrize("kernel", FAST_RUNGS)
@given(problem=gpu_problems(head_dims=FAST_HEAD_DIMS, dtypes=TC_DTYPES, any_blocks=False,
                            dv_dims=FAST_HEAD_DIMS))
def test_tensor_core_forward_matches_simulator(poisoned, kernel, problem):
    on_rung(kernel, problem[0].shape[-1], problem[2].shape[-1])
    check_forward(*problem, kernel=kernel)


def check_forward(q, k, v, dtype, causal, blocks, kernel):
    if blocks is not None and not fits(blocks, q.shape[-1], v.shape[-1], dtype):
        blocks = None
    qd, kd, vd = (laid_out(dev(x, dtype), n) for n, x in enumerate((q, k, v)))
    out, lse, traffic = fs.gpu.attention(qd, kd, vd, causal=causal, block_sizes=blocks,
                                         count_io=True, kernel=kernel)
    out_fast, lse_fast = fs.gpu.attention(qd, kd, vd, causal=causal, block_sizes=blocks,
                                          kernel=kernel)
    out, lse, out_fast, lse_fast = map(host, (out, lse, out_fast, lse_fast))
    assert not np.isnan(out).any() and not np.isnan(lse).any(), "an output was not written"
    np.testing.assert_array_equal(out, out_fast)     # instrumenting changes no result
    np.testing.assert_array_equal(lse, lse_fast)

    used = blocks or fs.gpu.block_sizes(qd, vd, kernel=kernel)
    sim = fs.simulate(q, k, v, "flash2", block_sizes=used, causal=causal, io_dtype=dtype)
    assert traffic == sim.traffic, traffic.diff(sim.traffic)
    simk = fs.simulate(q, k, v, "flash2", block_sizes=used, causal=causal, io_dtype=dtype,
                       precision="kernel")
    vmax = max(1.0, np.abs(v).max())
    fin = np.isfinite(sim.lse)
    assert np.array_equal(np.isneginf(lse), ~fin)
    # P = exp(S − L) is only as good as S: a relative error of κ = eps·√d·scale·Σ|q||k|
    kappa32, kappa = s_condition(q, k, "float32"), s_condition(q, k, dtype)
    if dtype in ("float32", "float64"):
        # 1e-5 / 1e-12 relative, unless the logits are so large that exp's condition
        # number (κ) says the dtype cannot do better
        tol = 1e-5 if dtype == "float32" else 1e-12
        np.testing.assert_allclose(out, sim.out, rtol=tol, atol=max(tol, 4 * kappa) * vmax)
    else:
        err = np.abs(out - sim.out).max(initial=0)
        base = same_dtype_error(q, k, v, dtype, causal, sim.out)[0]
        # FlashAttention's rule, plus one rounding of the output to the I/O type
        assert err <= 2 * base + EPS[dtype] * np.abs(sim.out).max(initial=0), (err, base)
    # L is fp32 in every kernel, as FlashAttention stores it
    np.testing.assert_allclose(lse[fin], sim.lse[fin], rtol=2e-7, atol=4 * kappa32)
    # against the kernel-precision simulator the only difference left is fp32 summation
    # order: S moves by κ32, and a few I/O-type roundings of P or O may fall the other way
    twin = 4 * kappa32 + (4 * EPS[dtype] if dtype in ("float16", "bfloat16") else 0)
    np.testing.assert_allclose(out, simk.out, rtol=max(twin, 1e-12), atol=max(twin, 1e-12) * vmax)
    np.testing.assert_allclose(lse[fin], simk.lse[fin], rtol=2e-7, atol=4 * kappa32)


@given(gpu_problems(max_seq=400), st.booleans())
def test_backward_matches_simulator(poisoned, problem, deterministic):
    check_backward(*problem, kernel="ref", deterministic=deterministic)


@pytest.mark.parametrize("kernel", FAST_RUNGS)
@given(problem=gpu_problems(max_seq=400, head_dims=FAST_HEAD_DIMS, dtypes=TC_DTYPES,
                            any_blocks=False, dv_dims=FAST_HEAD_DIMS),
       deterministic=st.booleans())
def test_tensor_core_backward_matches_simulator(poisoned, kernel, problem, deterministic):
    on_rung(kernel, problem[0].shape[-1], problem[2].shape[-1], backward=True)
    check_backward(*problem, kernel=kernel, deterministic=deterministic)


def check_backward(q, k, v, dtype, causal, blocks, kernel, deterministic=False):
    if blocks is not None and not fits(blocks, q.shape[-1], v.shape[-1], dtype, backward=True):
        blocks = None
    qd, kd, vd = (laid_out(dev(x, dtype), n) for n, x in enumerate((q, k, v)))
    out, lse = fs.gpu.attention(qd, kd, vd, causal=causal)
    rng = np.random.default_rng(0)
    dout = make_precision("kernel", dtype).io_round(rng.standard_normal(host(out).shape)).astype(np.float64)
    dq, dk, dv, traffic = fs.gpu.attention_backward(qd, kd, vd, out, lse,
                                                    laid_out(dev(dout, dtype), 3),
                                                    causal=causal, block_sizes=blocks,
                                                    count_io=True, kernel=kernel,
                                                    deterministic=deterministic)
    dq, dk, dv = map(host, (dq, dk, dv))
    assert not any(np.isnan(x).any() for x in (dq, dk, dv)), "a gradient was not written"
    used = blocks or fs.gpu.block_sizes(qd, vd, backward=True, kernel=kernel)
    o, L = host(out), host(lse)
    sim = fs.simulate_backward(q, k, v, o, L, dout, "flash2", block_sizes=used,
                               causal=causal, io_dtype=dtype)
    assert traffic == sim.traffic, traffic.diff(sim.traffic)
    simk = fs.simulate_backward(q, k, v, o, L, dout, "flash2", block_sizes=used,
                                causal=causal, io_dtype=dtype, precision="kernel")
    # FlashAttention's rule for gradients against the float64 result: at most 3× the
    # error of dense attention computed in the same dtype, plus one output rounding. A
    # float64 kernel keeps L, D and the dQ accumulator in fp32, so its yardstick is fp32.
    base_dtype = "float32" if dtype == "float64" else dtype
    # the true gradient: float64 throughout, from the float64 L, not the kernel's fp32 L
    ref = fs.attention_backward_reference(q, k, v, dout, causal=causal)
    errs = _same_dtype_grad_errors(q, k, v, dout, base_dtype, causal, ref)
    mags = _grad_magnitudes(q, k, v, o, dout, causal)
    for n, name in enumerate(("dq", "dk", "dv")):
        a, r, rk = (dq, dk, dv)[n], ref[n], (simk.dq, simk.dk, simk.dv)[n]
        # rounding floor: a few units of the base type's eps times the magnitude of the
        # terms each gradient sums (dS = P ∘ (dP − D) cancels; its parts need not)
        floor = 4 * EPS[base_dtype] * mags[n]
        err = np.abs(a - r).max(initial=0)
        assert err <= 3 * errs[n] + floor, (name, err, errs[n])
        # the simulated twin of the kernel (same roundings) differs by less than the
        # same-dtype baseline's own error
        err_k = np.abs(a - rk).max(initial=0)
        assert err_k <= errs[n] + floor, (name, err_k, errs[n])


@pytest.mark.parametrize("dtype", DTYPES)
def test_fully_masked_rows_and_large_logits(poisoned, dtype):
    rng = np.random.default_rng(3)
    rnd = make_precision("kernel", dtype).io_round
    q = rnd(rng.standard_normal((1, 2, 150, 64)) * 8).astype(np.float64)    # logits ~ 1e2-1e3
    k = rnd(rng.standard_normal((1, 2, 60, 64)) * 8).astype(np.float64)
    v = rnd(rng.standard_normal((1, 2, 60, 64))).astype(np.float64)
    qd, kd, vd = (dev(x, dtype) for x in (q, k, v))
    out, lse = fs.gpu.attention(qd, kd, vd, causal=True)   # rows 0..89 see no key (tc for fp16/bf16)
    o, L = host(out), host(lse)
    assert not np.isnan(o).any() and (o[..., :90, :] == 0).all()
    assert np.isneginf(L[..., :90]).all() and np.isfinite(L[..., 90:]).all()
    dout = dev(rnd(rng.standard_normal(o.shape)).astype(np.float64), dtype)
    dq, dk, dv = map(host, fs.gpu.attention_backward(qd, kd, vd, out, lse, dout, causal=True))
    assert all(np.isfinite(x).all() for x in (dq, dk, dv))
    assert (dq[..., :90, :] == 0).all()


@pytest.mark.parametrize("kernel", ["ref"] + FAST_RUNGS)
def test_a_negative_scale(poisoned, kernel):
    # the fast kernels mask a score to −∞ before they scale it, so a negative scale runs
    # on −q (flash2.negated) and the backward negates dq back: checked where masks bite
    # (ragged tiles, causal) against float64, by FlashAttention's rules
    dtype, scale = "float16", -0.15
    rng = np.random.default_rng(5)
    rnd = make_precision("kernel", dtype).io_round
    q = rnd(rng.standard_normal((1, 2, 150, 64))).astype(np.float64)
    k, v = (rnd(rng.standard_normal((1, 2, 200, 64))).astype(np.float64) for _ in range(2))
    dout = rnd(rng.standard_normal((1, 2, 150, 64))).astype(np.float64)
    qd, kd, vd, dod = (dev(x, dtype) for x in (q, k, v, dout))
    for causal in (False, True):
        out, lse = fs.gpu.attention(qd, kd, vd, causal=causal, scale=scale, kernel=kernel)
        o, L = host(out), host(lse)
        ref_o, ref_l = fs.attention_reference(q, k, v, causal=causal, scale=scale)
        ref = fs.attention_backward_reference(q, k, v, dout, causal=causal, scale=scale)
        errs = same_dtype_errors(q, k, v, ref_o, io_dtype=dtype, causal=causal, scale=scale,
                                 dout=dout, ref_grads=ref)
        assert np.abs(o - ref_o).max() <= 2 * errs[0] + EPS[dtype] * np.abs(ref_o).max()
        np.testing.assert_allclose(L, ref_l, rtol=1e-5, atol=1e-4)
        grads = map(host, fs.gpu.attention_backward(qd, kd, vd, out, lse, dod, causal=causal,
                                                    scale=scale, kernel=kernel))
        mags = grad_magnitudes(q, k, v, o, dout, causal=causal, scale=scale)
        for n, (g, r) in enumerate(zip(grads, ref)):
            err = np.abs(g - r).max()
            assert err <= 3 * errs[1 + n] + 4 * EPS[dtype] * mags[n], (n, err, errs[1 + n])


def test_numpy_in_cupy_out_and_errors():
    import cupy as cp
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((2, 33, 16)).astype(np.float32) for _ in range(3))
    out, lse = fs.gpu.attention(q, k, v)
    assert isinstance(out, cp.ndarray) and out.dtype == cp.float32 and lse.dtype == cp.float32
    ref = fs.attention_reference(q, k, v)
    np.testing.assert_allclose(cp.asnumpy(out), ref[0], rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match="share one dtype"):
        fs.gpu.attention(q, k.astype(np.float16), v)
    with pytest.raises(ValueError, match="head dim"):
        fs.gpu.attention(q, k[..., :8], v)
    with pytest.raises(ValueError, match="shared memory"):
        fs.gpu.attention(q, k, v, block_sizes=(4096, 4096))
    with pytest.raises(TypeError, match="float16, bfloat16"):
        fs.gpu.attention(q.astype(np.int32), k.astype(np.int32), v.astype(np.int32))
    with pytest.raises(ValueError, match="up to 256"):
        w = np.ones((4, 300), np.float32)
        fs.gpu.attention(w, w, w)
    with pytest.raises(ValueError, match="tensor-core kernel runs"):
        fs.gpu.attention(q, k, v, kernel="tc")           # float32: reference only
    with pytest.raises(ValueError, match="Hopper kernel runs"):
        fs.gpu.attention(q, k, v, kernel="wg")
    out, lse = fs.gpu.attention(q, k, v)
    with pytest.raises(ValueError, match="Hopper kernel runs"):
        fs.gpu.attention_backward(q, k, v, out, lse, q, kernel="wg")   # float32
    with pytest.raises(ValueError, match="kernel must be"):
        fs.gpu.attention(q, k, v, kernel="fast")


def test_cupy_bfloat16_in_cupy_bfloat16_out():
    """CuPy arrays of CuPy's bfloat16 (CuPy 14 on) give results of that dtype, forward and
    backward: the values, not their 16 bits as int16."""
    import cupy as cp
    try:
        bf16 = np.dtype("bfloat16")
        q, k, v, do = (cp.asarray(np.random.default_rng(s).standard_normal((2, 40, 64)))
                       .astype(bf16) for s in range(4))
    except TypeError:
        pytest.skip("this CuPy has no bfloat16")
    out, lse = fs.gpu.attention(q, k, v, causal=True)
    assert out.dtype == bf16 and lse.dtype == cp.float32
    f64 = [cp.asnumpy(x).astype(np.float64) for x in (q, k, v)]
    ref = fs.attention_reference(*f64, causal=True)[0]
    np.testing.assert_allclose(cp.asnumpy(out).astype(np.float64), ref, atol=2e-2)
    # (deterministic: the same bits run to run, for the comparison below)
    grads = fs.gpu.attention_backward(q, k, v, out, lse, do, causal=True, deterministic=True)
    refs = fs.attention_backward_reference(*f64, cp.asnumpy(do).astype(np.float64), causal=True)
    for g, r in zip(grads, refs):
        assert g.dtype == bf16
        np.testing.assert_allclose(cp.asnumpy(g).astype(np.float64), r, atol=0.1 + 0.05 * np.abs(r).max())
    if HAVE_TORCH:   # the same bits as PyTorch bfloat16 tensors get
        import torch
        tq, tk, tv, tdo = (torch.from_dlpack(x.view(cp.int16)).view(torch.bfloat16) for x in (q, k, v, do))
        tout, tlse = fs.gpu.attention(tq, tk, tv, causal=True)
        tgrads = fs.gpu.attention_backward(tq, tk, tv, tout, tlse, tdo, causal=True,
                                           deterministic=True)
        for a, b in zip((out, *grads), (tout, *tgrads)):
            assert bool((a.view(cp.int16) == cp.from_dlpack(b.view(torch.int16))).all())


@pytest.mark.skipif(not HAVE_TORCH, reason="PyTorch with CUDA not installed")
def test_torch_in_torch_out_without_copy():
    check_torch_in_torch_out("cuda", (1, 4, 77, 64))


def check_torch_in_torch_out(device, shape):
    """bfloat16 tensors in, bfloat16 tensors out, SDPA's values (causal)."""
    import torch
    rng = np.random.default_rng(5)
    q, k, v = (torch.from_numpy(rng.standard_normal(shape)).to(device, torch.bfloat16)
               for _ in range(3))
    out, lse = fs.gpu.attention(q, k, v, causal=True)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                           is_causal=True)
    assert (out.float() - ref).abs().max().item() < 2e-2


def check_strided(kernel, dtype, Hk, causal=True):
    """Inputs read through their strides: slices of a fused (B, N, H + 2·Hk, d) QKV
    projection, seen as (B, H, N, d), and out, dout likewise transposed, give the same
    bits and the same counted bytes as dense copies, with no copy made on the way in;
    out and the gradients come back laid out as their inputs are ((B, N, H, d) in
    memory). Forward, deterministic backward, and the packed varlen pair."""
    xp = fs.gpu._device.cupy()
    rng = np.random.default_rng(11)
    B, N, H, d = 2, 77, 4, 64
    fused = xp.asarray(rng.standard_normal((B, N, H + 2 * Hk, d)).astype(dtype))
    q, k, v = (fused[:, :, a:b].transpose(0, 2, 1, 3)
               for a, b in ((0, H), (H, H + Hk), (H + Hk, H + 2 * Hk)))
    ptr = fs.gpu._device.pointer
    assert all(ptr(fs.gpu._arrays.In(x, "x").arr) == ptr(x) for x in (q, k, v))   # no copy
    dense = [xp.ascontiguousarray(x) for x in (q, k, v)]
    kw = dict(causal=causal, kernel=kernel, count_io=True)
    o1, l1, t1 = fs.gpu.attention(q, k, v, **kw)
    o2, l2, t2 = fs.gpu.attention(*dense, **kw)
    assert t1 == t2 and bool((o1 == o2).all()) and bool((l1 == l2).all())
    assert o1.transpose(0, 2, 1, 3).flags.c_contiguous        # laid out as q is
    dout = xp.asarray(rng.standard_normal((B, N, H, d)).astype(dtype)).transpose(0, 2, 1, 3)
    out = xp.ascontiguousarray(o1.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    bw = dict(causal=causal, kernel=kernel, count_io=True, deterministic=True)
    *g1, t1 = fs.gpu.attention_backward(q, k, v, out, l1, dout, **bw)
    *g2, t2 = fs.gpu.attention_backward(*dense, xp.ascontiguousarray(out), l1,
                                        xp.ascontiguousarray(dout), **bw)
    assert t1 == t2 and all(bool((a == b).all()) for a, b in zip(g1, g2))
    if Hk == H:           # no group sums: each gradient written in place, laid out as x
        assert all(g.transpose(0, 2, 1, 3).flags.c_contiguous for g in g1)
    # packed varlen: (total, heads, d) slices of a fused (total, H + 2·Hk, d)
    cu = np.array([0, 30, 30, 77 * B], np.int32)
    flat = fused.reshape(B * N, H + 2 * Hk, d)
    q, k, v = flat[:, :H], flat[:, H:H + Hk], flat[:, H + Hk:]
    dense = [xp.ascontiguousarray(x) for x in (q, k, v)]
    kw = dict(causal=causal, kernel=kernel, count_io=True)
    o1, l1, t1 = fs.gpu.attention_varlen(q, k, v, cu, cu, **kw)
    o2, l2, t2 = fs.gpu.attention_varlen(*dense, cu, cu, **kw)
    assert t1 == t2 and bool((o1 == o2).all()) and bool((l1 == l2).all())
    dout = xp.asarray(rng.standard_normal((B * N, 2 * H, d)).astype(dtype))[:, ::2]
    *g1, t1 = fs.gpu.attention_varlen_backward(q, k, v, o1, l1, dout, cu, cu, **bw)
    *g2, t2 = fs.gpu.attention_varlen_backward(*dense, o1, l1, xp.ascontiguousarray(dout),
                                               cu, cu, **bw)
    assert t1 == t2 and all(bool((a == b).all()) for a, b in zip(g1, g2))


@pytest.mark.parametrize("kernel, dtype", [("ref", "float32"), ("tc", "float16"),
                                           ("auto", "float16")])
@pytest.mark.parametrize("Hk", [4, 2])
def test_strided_inputs_are_read_in_place(kernel, dtype, Hk):
    check_strided(kernel, dtype, Hk)


def test_a_misaligned_view_is_copied_not_misread():
    import cupy as cp
    rng = np.random.default_rng(8)
    base = cp.asarray(rng.standard_normal(2 * 100 * 64 + 1).astype(np.float16))
    q = base[1:].reshape(1, 2, 100, 64)               # starts 2 bytes into an allocation
    assert q.data.ptr % 16
    out = fs.gpu.attention(q, q, q, kernel="tc")[0]
    ref = fs.gpu.attention(q.copy(), q.copy(), q.copy(), kernel="tc")[0]
    assert bool((out == ref).all())


@pytest.mark.skipif(not fs.gpu.available() or not hopper(), reason="needs compute capability 9.0")
@pytest.mark.parametrize("dtype, softcap, alibi", [("bfloat16", None, True),
                                                   ("bfloat16", 100.0, False),
                                                   ("float16", 30.0, True),
                                                   ("float16", None, True)])
def test_a_layout_tma_cannot_address_keeps_the_reported_softmax_max(monkeypatch, dtype,
                                                                      softcap, alibi):
    """Heads 16 elements apart beyond their rows (whose 136-element strides the cp.async
    kernel reads in place, but no tensor map addresses a problem starting past a row's
    first 8 columns) with variants that flash2_fwd_ws runs under a lazy max where
    flash2_fwd_wg, the cp.async kernel with the same tiles, would run the online one: the
    inputs are copied dense and flash2_fwd_ws's instance runs, so that what
    fs.gpu.softmax_max reports (and the simulator's softmax_max="auto") holds whatever
    the layout: the dense call's instance, and its bits."""
    from flashsim.gpu import flash2
    seen = []
    real = flash2.dev.kernel
    monkeypatch.setattr(flash2.dev, "kernel", lambda name, dtype, count_io, D=None, variant=False,
                        varlen=False: (seen.append((name, variant)),
                                       real(name, dtype, count_io, D, variant, varlen))[1])
    rng = np.random.default_rng(136)
    B, H, N, d, ld = 2, 4, 300, 128, 136
    hs = N * ld + 16                                    # a head's elements, and a gap
    shape, strides = (B, H, N, d), (H * hs, hs, ld, 1)
    bufs = [dev(rng.standard_normal(B * H * hs), dtype) for _ in range(3)]
    if dtype == "bfloat16":
        import torch
        q, k, v = (torch.as_strided(x, shape, strides) for x in bufs)
        dense = [x.contiguous() for x in (q, k, v)]
    else:
        import cupy as cp
        q, k, v = (cp.lib.stride_tricks.as_strided(x, shape, tuple(2 * t for t in strides))
                   for x in bufs)
        dense = [cp.ascontiguousarray(x) for x in (q, k, v)]
    kw = dict(softcap=softcap, alibi_slopes=rng.uniform(0.05, 0.5, H).astype(np.float32)
              if alibi else None)
    assert fs.gpu.softmax_max(q, v, **kw) == "lazy"
    out, lse = (host(x) for x in fs.gpu.attention(q, k, v, **kw))
    strided = seen[-1]
    ref, lse_ref = (host(x) for x in fs.gpu.attention(*dense, **kw))
    assert strided == seen[-1] and strided[0] == "flash2_fwd_ws"
    assert np.array_equal(out, ref) and np.array_equal(lse, lse_ref)


@pytest.mark.skipif(not HAVE_TORCH, reason="PyTorch with CUDA not installed")
def test_torch_inputs_on_a_side_stream():
    """The kernels run on PyTorch's current stream: work queued before and after them on a
    side stream sees their inputs and outputs in order, with no synchronisation."""
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        q, k, v = (torch.randn(2, 4, 700, 128, device="cuda", dtype=torch.float16) * 2
                   for _ in range(3))
        out, lse = fs.gpu.attention(q, k, v, causal=True)
        ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                               is_causal=True)
        err = (out.float() - ref).abs().max()
    s.synchronize()
    assert err.item() < 2e-2


@pytest.mark.skipif(not HAVE_TORCH, reason="PyTorch with CUDA not installed")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype, d", [("bfloat16", 128), ("float16", 64), ("bfloat16", 32),
                                      ("float16", 96), ("bfloat16", 80)])
def test_torch_fast_path_equals_the_general_path(causal, dtype, d):
    """Contiguous (B, H, N, d) tensors take the cached-plan path; count_io=True takes the
    general one through the instrumented build: same bits, GQA included (and the same
    instance: each rung has its own head dims, kernels.instance_dim)."""
    tdt = getattr(torch, dtype)
    q = torch.randn(2, 6, 333, d, device="cuda", dtype=tdt)
    k, v = (torch.randn(2, 3, 517, d, device="cuda", dtype=tdt) for _ in range(2))
    o1, l1 = fs.gpu.attention(q, k, v, causal=causal)
    key = fs.gpu.flash2._plan_key(q, k, v, causal, None, "auto")
    assert fs.gpu.flash2._PLANS.get(key), "the fast path did not run"
    o2, l2, _ = fs.gpu.attention(q, k, v, causal=causal, count_io=True)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float().repeat_interleave(2, 1), v.float().repeat_interleave(2, 1),
        is_causal=False) if not causal else None
    if ref is not None:
        assert (o1.float() - ref).abs().max().item() < 2e-2


@pytest.mark.skipif(not HAVE_TORCH, reason="PyTorch with CUDA not installed")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype, d", [("bfloat16", 128), ("float16", 64)])
def test_torch_fast_backward_equals_the_general_path(monkeypatch, causal, dtype, d):
    """The backward's fast path (contiguous tensors, no GQA) against the general path:
    dK and dV the same bits, dQ within its fp32 atomics' ordering (a unit of the dtype)."""
    tdt = getattr(torch, dtype)
    q = torch.randn(2, 3, 333, d, device="cuda", dtype=tdt)
    k, v = (torch.randn(2, 3, 517, d, device="cuda", dtype=tdt) for _ in range(2))
    do = torch.randn_like(q)
    o, lse = fs.gpu.attention(q, k, v, causal=causal)

    def general(*a, **kw):
        raise AssertionError("the fast path did not run")
    with monkeypatch.context() as m:
        m.setattr(fs.gpu.flash2, "_attention_backward", general)
        fast = fs.gpu.attention_backward(q, k, v, o, lse, do, causal=causal)
    slow = fs.gpu.attention_backward(q, k, v, o, lse, do, causal=causal, count_io=True)[:3]
    assert torch.equal(fast[1], slow[1]) and torch.equal(fast[2], slow[2])
    unit = 2.0 ** (-7 if dtype == "bfloat16" else -10)
    assert ((fast[0].float() - slow[0].float()).abs()
            <= unit * slow[0].float().abs() + 1e-6).all()


def test_deterministic_outputs_for_the_forward():
    import cupy as cp
    rng = np.random.default_rng(6)
    q, k, v = (cp.asarray(rng.standard_normal((2, 3, 200, 64)).astype(np.float16)) for _ in range(3))
    a = fs.gpu.attention(q, k, v)[0]
    b = fs.gpu.attention(q, k, v)[0]
    assert bool((a == b).all())


HOPPER_ONLY = pytest.mark.skipif(not fs.gpu.available() or not hopper(),
                                 reason="the wg kernel needs compute capability 9.0")


@pytest.mark.parametrize("kernel, dtype, d", [
    ("tc", "float16", 64), ("tc", "float16", 128), ("ref", "float32", 40),
    pytest.param("wg", "float16", 64, marks=HOPPER_ONLY),
    pytest.param("wg", "bfloat16", 128, marks=HOPPER_ONLY),
    pytest.param("wg", "float16", 256, marks=HOPPER_ONLY)])
@pytest.mark.parametrize("causal", [False, True])
def test_deterministic_backward_is_the_same_bits_every_run(kernel, dtype, d, causal):
    """Many K/V tiles add into each Q tile's dQ (Nk = 1500): with atomics their order
    varies; deterministic=True must give identical bits (50 runs on the fast rungs), the
    same traffic, and values within rounding of the atomic run."""
    rng = np.random.default_rng(9)
    B, hk, g, Nq, Nk = 2, 2, 2, 333, 1500
    q, k, v, dout = (dev(rng.standard_normal(s), dtype) for s in
                     ((B, hk * g, Nq, d), (B, hk, Nk, d), (B, hk, Nk, d), (B, hk * g, Nq, d)))
    out, lse = fs.gpu.attention(q, k, v, causal=causal, kernel=kernel)
    runs = [fs.gpu.attention_backward(q, k, v, out, lse, dout, causal=causal, kernel=kernel,
                                      deterministic=True, count_io=True)
            for _ in range(3 if kernel == "ref" else 50)]
    free = fs.gpu.attention_backward(q, k, v, out, lse, dout, causal=causal, kernel=kernel,
                                     count_io=True)
    first = [host(x) for x in runs[0][:3]]
    for r in runs[1:]:
        for a, b in zip(first, (host(x) for x in r[:3])):
            assert np.array_equal(a, b)
        assert r[3] == free[3]
    # the two differ in the order of dQ's fp32 sums only: a few fp32 roundings per tile,
    # then at most one unit of the output dtype; dk and dv do not depend on the order
    tiles = -(-Nk // fs.gpu.block_sizes(q, v, backward=True, kernel=kernel)[1])
    for a, b in zip(first, (host(x) for x in free[:3])):
        scale = np.abs(b).max()
        assert np.abs(a - b).max() <= (2 * EPS[dtype] + 4 * tiles * 2.0**-24) * scale


def test_deterministic_flag_is_checked():
    import cupy as cp
    q = cp.ones((1, 1, 8, 64), cp.float16)
    with pytest.raises(TypeError, match="deterministic"):
        fs.gpu.attention_backward(q, q, q, q, cp.zeros((1, 1, 8), cp.float32), q,
                                  deterministic="yes")


# FlashAttention's own odd shapes, each dtype, both masks: a fixed grid beside the fuzzing
ODD = [(113, 203, 40), (128, 217, 59), (108, 256, 96), (1023, 1024, 111), (203, 113, 160),
       (7, 1023, 256), (1023, 7, 128)]


ODD_TC = [(113, 203, 64), (128, 217, 128), (1023, 1024, 64), (7, 1023, 128), (1023, 7, 64)]


@pytest.mark.parametrize("kernel", FAST_RUNGS)
@pytest.mark.parametrize("Nq, Nk, d", ODD_TC)
@pytest.mark.parametrize("dtype", TC_DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_odd_shapes_tensor_core(poisoned, kernel, Nq, Nk, d, dtype, causal):
    rng = np.random.default_rng(Nq * 7 + Nk + d)
    rnd = make_precision("kernel", dtype).io_round
    q, k, v = (rnd(random_tensor(rng, (2, 3, n, d))).astype(np.float64) for n in (Nq, Nk, Nk))
    check_forward(q, k, v, dtype, causal, None, kernel=kernel)


@pytest.mark.skipif(not fs.gpu.available() or not hopper(), reason="needs compute capability 9.0")
@pytest.mark.parametrize("D", fs.kernels.WG_HEAD_DIMS)
@pytest.mark.parametrize("dtype", TC_DTYPES)
def test_every_hopper_forward_instance(poisoned, D, dtype):
    """Each instance of the wg forward (tiles in 32-column blocks with the 64-byte swizzle
    at D = 32 and 96, in 64-column blocks with the 128-byte one at 64, 128, 256): at
    d = dv = D (its plain build) and below D with dv ≠ d (its padded one), ragged tiles,
    GQA, causal and not, against the simulator with exact counts."""
    rng = np.random.default_rng(D)
    rnd = make_precision("kernel", dtype).io_round
    for d, dv, causal in ((D, D, False), (D, D, True), (D - 8, max(8, D // 16 * 8), True)):
        q = rnd(random_tensor(rng, (1, 4, 203, d))).astype(np.float64)
        k = rnd(random_tensor(rng, (1, 2, 317, d))).astype(np.float64)
        v = rnd(random_tensor(rng, (1, 2, 317, dv))).astype(np.float64)
        assert fs.kernels.instance_dim("wg", d, dv) == D
        check_forward(q, k, v, dtype, causal, None, kernel="wg")


@pytest.mark.skipif(not fs.gpu.available() or not hopper(), reason="needs compute capability 9.0")
@pytest.mark.parametrize("D", fs.kernels.WG_BWD_HEAD_DIMS)
@pytest.mark.parametrize("dtype", TC_DTYPES)
def test_every_hopper_backward_instance(poisoned, D, dtype):
    """Each instance of the wg backward (D = 192 and 256: 64 keys per CTA, the warpgroups splitting
    dK, dV and dQ by columns): at d = dv = D and below D with dv ≠ d, ragged tiles, GQA,
    causal and not, both dQ modes, against the simulator with exact counts."""
    rng = np.random.default_rng(D + 1)
    rnd = make_precision("kernel", dtype).io_round
    for d, dv, causal, det in ((D, D, False, False), (D, D, True, True),
                               (D - 8, max(8, D // 16 * 8), True, False)):
        q = rnd(random_tensor(rng, (1, 4, 203, d))).astype(np.float64)
        k = rnd(random_tensor(rng, (1, 2, 317, d))).astype(np.float64)
        v = rnd(random_tensor(rng, (1, 2, 317, dv))).astype(np.float64)
        assert fs.kernels.instance_dim("wg", d, dv, backward=True) == D
        check_backward(q, k, v, dtype, causal, None, kernel="wg", deterministic=det)


@pytest.mark.skipif(not fs.gpu.available() or not hopper(), reason="needs compute capability 9.0")
@pytest.mark.parametrize("torch_in", [False, True])
def test_auto_runs_the_hopper_kernels_on_hopper(torch_in):
    """On a 9.0 device "auto" is the wg forward and backward, on the fast path too; their
    tiles are the ones block_sizes reports."""
    if torch_in and not HAVE_TORCH:
        pytest.skip("PyTorch with CUDA not installed")
    rng = np.random.default_rng(13)
    q, k, v, dout = (rng.standard_normal((2, 4, 300, 128)).astype(np.float16) for _ in range(4))
    if torch_in:
        q, k, v, dout = (torch.from_numpy(x).cuda() for x in (q, k, v, dout))
    else:
        import cupy as cp
        q, k, v, dout = (cp.asarray(x) for x in (q, k, v, dout))
    assert fs.gpu.block_sizes(q, v) == fs.kernels.WG_BLOCKS[128]
    assert fs.gpu.block_sizes(q, v, kernel="tc") == fs.kernels.TC_BLOCKS[128]
    out, lse = fs.gpu.attention(q, k, v, causal=True)
    wg, wg_lse = fs.gpu.attention(q, k, v, causal=True, kernel="wg")
    tc = fs.gpu.attention(q, k, v, causal=True, kernel="tc")[0]
    assert np.array_equal(host(out), host(wg)) and np.array_equal(host(lse), host(wg_lse))
    assert not np.array_equal(host(out), host(tc))   # two kernels (tiles of 128 vs 64 keys)
    assert np.abs(host(out) - host(tc)).max() < 1e-2
    assert fs.gpu.block_sizes(q, v, backward=True) == fs.kernels.WG_BWD_BLOCKS[128]
    grads = fs.gpu.attention_backward(q, k, v, out, lse, dout, causal=True)
    want = fs.gpu.attention_backward(q, k, v, out, lse, dout, causal=True, kernel="wg")
    tc = fs.gpu.attention_backward(q, k, v, out, lse, dout, causal=True, kernel="tc")
    for a, b, c in zip(grads[1:], want[1:], tc[1:]):   # dK, dV: no atomics, the same bits
        assert np.array_equal(host(a), host(b))
        assert np.abs(host(a) - host(c)).max() <= 1e-2 * np.abs(host(c)).max()


@pytest.mark.skipif(not fs.gpu.available() or not hopper(), reason="needs compute capability 9.0")
@pytest.mark.parametrize("torch_in", [False, True])
@pytest.mark.parametrize("kw", [dict(causal=False), dict(causal=True), dict(window=(100, 30)),
                                dict(softcap=20.0), dict(alibi_slopes=[0.25, 0.5, 0.125])])
def test_the_tma_forward_gives_the_cp_async_forwards_bits(monkeypatch, torch_in, kw):
    """flash2_fwd_ws (TMA, d = 128) runs where "auto" meets dense inputs on a 9.0 device,
    and gives flash2_fwd_wg's O and L bit for bit (same tiles, same arithmetic), and the
    same counted bytes; FLASHSIM_TMA=0 runs flash2_fwd_wg. Ragged, Nq ≠ Nk, GQA, and a
    (B, N, H, d) layout read through its strides."""
    if torch_in and not HAVE_TORCH:
        pytest.skip("PyTorch with CUDA not installed")
    from flashsim.gpu import flash2
    calls = []
    real = flash2._WsForward.__call__
    monkeypatch.setattr(flash2._WsForward, "__call__",
                        lambda self, *a, **k: (calls.append(1), real(self, *a, **k))[1])
    rng = np.random.default_rng(17)
    q = rng.standard_normal((2, 333, 3, 128)).astype(np.float16).transpose(0, 2, 1, 3)
    k, v = (rng.standard_normal((2, 3, 517, 128)).astype(np.float16) for _ in range(2))
    q[..., :2, :] *= 8                                   # outliers
    if torch_in:
        q, k, v = (torch.from_numpy(np.ascontiguousarray(x)).cuda() for x in (q, k, v))
        q = q.transpose(1, 2).contiguous().transpose(1, 2)   # (B, N, H, d) memory
    else:
        import cupy as cp
        q, k, v = (cp.asarray(x) for x in (q, k, v))
    monkeypatch.setenv("FLASHSIM_TMA", "1")
    own = None
    if fs.kernels.cap_only("float16", kw.get("softcap"), kw.get("alibi_slopes"), 128):
        # a softcap, or ALiBi, runs the softcap instance under a lazy max
        # (test_a_softcap_alone_runs_its_own_instance); the VAR instance gives wg's bits
        own = fs.gpu.attention(q, k, v, **kw)
        monkeypatch.setattr(fs.kernels, "cap_only", lambda *a: False)
        calls.clear()
    ws = fs.gpu.attention(q, k, v, **kw)
    ws_io = fs.gpu.attention(q, k, v, count_io=True, **kw)
    assert len(calls) == 2
    if own is not None:
        assert np.abs(host(own[0]) - host(ws[0])).max() <= 4 * 2.0**-11 * float(np.abs(host(v)).max())
        assert np.abs(host(own[1]) - host(ws[1])).max() <= 1e-5
    monkeypatch.setenv("FLASHSIM_TMA", "0")
    wg = fs.gpu.attention(q, k, v, **kw)
    wg_io = fs.gpu.attention(q, k, v, count_io=True, **kw)
    assert len(calls) == 2
    for a, b in zip(ws + ws_io[:2], wg + wg_io[:2]):
        assert np.array_equal(host(a), host(b))
    assert np.isfinite(host(ws[0])).all()
    assert ws_io[2] == wg_io[2]


@pytest.mark.skipif(not fs.gpu.available() or not hopper(), reason="needs compute capability 9.0")
@pytest.mark.parametrize("dtype", ("bfloat16", "float16"))
@pytest.mark.parametrize("d", (64, 96, 128))
def test_a_softcap_alone_runs_its_own_instance(monkeypatch, dtype, d):
    """A softcap runs flash2_fwd_ws's softcap instance (kernels.CAP_ONLY): in bfloat16
    under a fixed max (no running max, α or rescale; with ALiBi, m per row: the largest
    bias the row sees added), in float16 under a lazy one (a warp takes the online step
    only where some P may pass 2^12, or a row sees its first key after the tile's first
    step). ALiBi in float16 at d = 96 and 128 (kernels.diagonal_first), with a softcap or
    without, runs there too, each Q tile's diagonal key tile first; so do, in bfloat16's
    lazy instance (kernels.LAZY_BF16), bfloat16's ALiBi alone and softcaps past 54.4 at
    d = 96 and 128. ALiBi in float16 at d = 64, and in bfloat16 a softcap past 54.4 or
    ALiBi alone at d = 64, run the online VAR instance. ALiBi: steep, flat, negative and per-batch slopes, with causal, a window
    and Nq ≠ Nk (rows whose diagonal key is outside the keys). Against the simulator: the
    traffic exactly, O and L to the kernel-precision twin's tolerance, rows that see no
    key 0 and −∞; logits held at ±c by outliers, keys whose logits grow along the row (the
    lazy max moves at many steps), Nq ≠ Nk (rows past the keys under the bottom-right
    causal mask see none), ragged tiles, a window that cuts tiles (rows whose first key
    comes after their tile's first step, with a softcap of 0.5: no P near 2^12); and the
    two instances' O a few roundings of P apart, their L a few float roundings."""
    from flashsim.gpu import flash2
    seen = []
    real = flash2.dev.kernel
    monkeypatch.setattr(flash2.dev, "kernel", lambda name, dtype, count_io, D=None, variant=False,
                        varlen=False: (seen.append((name, dtype, variant)),
                                       real(name, dtype, count_io, D, variant, varlen))[1])
    rng = np.random.default_rng(d)
    rnd = make_precision("kernel", dtype).io_round
    q = rnd(rng.standard_normal((2, 4, 333, d))).astype(np.float64)
    k = rnd(rng.standard_normal((2, 2, 200, d))).astype(np.float64)
    v = rnd(rng.standard_normal((2, 2, 200, d))).astype(np.float64)
    q[:, :, :40] *= 16                                   # logits at ±c: tanh saturated
    ramp = rnd(k * np.linspace(0.2, 6, 200)[:, None])    # later keys, larger logits
    cases = [(50.0, k, dict()), (54.0, k, dict(causal=True)), (0.5, k, dict(window=(70, 3))),
             (30.0, k, dict(window=(0, 0))), (50.0, ramp, dict()), (30.0, ramp, dict(causal=True))]
    lazy_alibi = dtype == "float16" and fs.kernels.diagonal_first(d)
    if dtype == "bfloat16" or lazy_alibi:
        steep, flat = rng.uniform(0.2, 1.0, 4), rng.uniform(0, 1e-3, 4)
        cases += [(30.0, k, dict(alibi_slopes=steep)), (50.0, ramp, dict(alibi_slopes=flat)),
                  (30.0, k, dict(alibi_slopes=-flat * 50, causal=True)),
                  (5.0, k, dict(alibi_slopes=rng.uniform(-0.3, 0.3, (2, 4)), window=(70, 3))),
                  (54.0, ramp, dict(alibi_slopes=steep, causal=True))]
    bf_lazy = dtype == "bfloat16" and fs.kernels.diagonal_first(d)
    if lazy_alibi or bf_lazy:   # ALiBi without a softcap: the lazy max, diagonal first
        alone = [(None, k, dict(alibi_slopes=steep)), (None, ramp, dict(alibi_slopes=steep, causal=True)),
                 (None, k, dict(alibi_slopes=-flat * 50, window=(0, 0)))]
        if lazy_alibi:
            cases += alone
    for c, kk, kw in cases:
        variants = dict(dict(causal=False, window=None, alibi_slopes=None), softcap=c, **kw)
        seen.clear()
        check_variants_forward(q, kk, v, dtype, None, variants)
        assert seen[-1] == ("flash2_fwd_ws", dtype, fs.kernels.CAP_ONLY), (c, kw)
    if bf_lazy:          # bfloat16's lazy instance: ALiBi alone, softcaps past 54.4
        lazy = alone + [(60.0, k, dict()), (100.0, ramp, dict(causal=True)),
                        (60.0, k, dict(alibi_slopes=steep, window=(70, 3))),
                        (200.0, ramp, dict(alibi_slopes=rng.uniform(-0.3, 0.3, (2, 4))))]
        for c, kk, kw in lazy:
            variants = dict(dict(causal=False, window=None, alibi_slopes=None), softcap=c, **kw)
            seen.clear()
            check_variants_forward(q, kk, v, dtype, None, variants)
            assert seen[-1] == ("flash2_fwd_ws", dtype, fs.kernels.LAZY_BF16), (c, kw)
    # the online instance where neither applies
    sl = rng.uniform(0, 0.5, 4)
    for c, slopes in (() if lazy_alibi or bf_lazy
                      else ((60.0, None), (60.0, sl), (None, sl)) if dtype == "bfloat16"
                      else ((30.0, sl), (None, sl))):
        variants = dict(causal=False, window=None, softcap=c, alibi_slopes=slopes)
        seen.clear()
        check_variants_forward(q, k, v, dtype, None, variants)
        assert seen[-1] == ("flash2_fwd_ws", dtype, True), (dtype, c)
    # the two instances on the same inputs: a few roundings of P apart
    eps = 2.0**-8 if dtype == "bfloat16" else 2.0**-11
    pairs = [(k, dict(softcap=50.0)), (ramp, dict(softcap=50.0))]
    if lazy_alibi:
        pairs += [(k, dict(alibi_slopes=steep)), (ramp, dict(softcap=30.0, alibi_slopes=steep))]
    if bf_lazy:
        pairs += [(k, dict(alibi_slopes=steep)), (ramp, dict(softcap=100.0, alibi_slopes=steep))]
    for kk, kw in pairs:
        qd, kd, vd = (dev(x, dtype) for x in (q, kk, v))
        own = [host(x) for x in fs.gpu.attention(qd, kd, vd, **kw)]
        with monkeypatch.context() as m:
            m.setattr(fs.kernels, "cap_only", lambda *a: False)
            m.setattr(fs.kernels, "ws_lazy", lambda *a: False)
            online = [host(x) for x in fs.gpu.attention(qd, kd, vd, **kw)]
        assert not np.array_equal(own[0], online[0])
        np.testing.assert_allclose(own[0], online[0], atol=4 * eps * np.abs(v).max())
        np.testing.assert_allclose(own[1], online[1], rtol=1e-6, atol=1e-5)


@pytest.mark.skipif(not fs.gpu.available() or not hopper(), reason="needs compute capability 9.0")
@pytest.mark.parametrize("dtype", ("bfloat16", "float16"))
@pytest.mark.parametrize("d", (64, 128, 200, 256))
def test_the_cp_async_forwards_softcap_runs_its_own_instance(monkeypatch, dtype, d):
    """flash2_fwd_wg (FLASHSIM_TMA=0 at d ≤ 128; above, always) runs its softcap instance
    (kernels.wg_cap) where kernels.cap_only says: in bfloat16 a softcap ≤ 54.4, with ALiBi
    or without, under the fixed max (every D but 64, which keeps the online VAR instance);
    in float16 a softcap without ALiBi under the lazy max (with ALiBi the online VAR
    instance). Against the simulator's twin under that rule (traffic
    exactly): causal, a window, Nq ≠ Nk, steep, negative and per-batch slopes, keys whose
    logits grow along the row; and O a few roundings of P from the online instance's, L a
    few float roundings."""
    from flashsim.gpu import flash2
    seen = []
    real = flash2.dev.kernel
    monkeypatch.setattr(flash2.dev, "kernel", lambda name, dtype, count_io, D=None, variant=False,
                        varlen=False: (seen.append((name, dtype, variant)),
                                       real(name, dtype, count_io, D, variant, varlen))[1])
    monkeypatch.setenv("FLASHSIM_TMA", "0")
    D = fs.kernels.instance_dim("wg", d, d)
    rng = np.random.default_rng(d + 1)
    rnd = make_precision("kernel", dtype).io_round
    q = rnd(rng.standard_normal((2, 4, 333, d)) * 3).astype(np.float64)
    k = rnd(rng.standard_normal((2, 2, 200, d)) * 3).astype(np.float64)
    v = rnd(rng.standard_normal((2, 2, 200, d))).astype(np.float64)
    ramp = rnd(k * np.linspace(0.2, 2, 200)[:, None])      # later keys, larger logits
    steep = rng.uniform(0.2, 1.0, 4)
    for c, kk, kw in ((50.0, k, dict()), (30.0, k, dict(causal=True, alibi_slopes=steep)),
                      (5.0, k, dict(window=(70, 3), alibi_slopes=-steep / 10)),
                      (54.0, ramp, dict(alibi_slopes=rng.uniform(-0.3, 0.3, (2, 4)))),
                      (60.0, ramp, dict(causal=True)), (None, k, dict(alibi_slopes=steep)),
                      (None, ramp, dict(alibi_slopes=steep, causal=True))):
        variants = dict(dict(causal=False, window=None, alibi_slopes=None), softcap=c, **kw)
        seen.clear()
        check_variants_forward(q, kk, v, dtype, None, variants)
        sl = kw.get("alibi_slopes")
        own = fs.kernels.wg_cap(dtype, D, sl) and fs.kernels.cap_only(dtype, c, sl, D)
        assert seen[-1] == ("flash2_fwd_wg", dtype, fs.kernels.CAP_ONLY if own else True), (c, kw)
        qd, vd = dev(q, dtype), dev(v, dtype)
        assert fs.gpu.softmax_max(qd, vd, softcap=c, alibi_slopes=kw.get("alibi_slopes")) == \
            (("fixed" if dtype == "bfloat16" else "lazy") if own else "online")
    eps = 2.0**-8 if dtype == "bfloat16" else 2.0**-11
    for kw in (dict(softcap=30.0, alibi_slopes=steep), dict(softcap=30.0)):
        sl = kw.get("alibi_slopes")
        if not (fs.kernels.wg_cap(dtype, D, sl) and fs.kernels.cap_only(dtype, 30.0, sl, D)):
            continue                                       # the two instances: a few roundings
        qd, kd, vd = (dev(x, dtype) for x in (q, k, v))
        own = [host(x) for x in fs.gpu.attention(qd, kd, vd, **kw)]
        with monkeypatch.context() as m:
            m.setattr(fs.kernels, "cap_only", lambda *a: False)
            online = [host(x) for x in fs.gpu.attention(qd, kd, vd, **kw)]
        assert seen[-2:] == [("flash2_fwd_wg", dtype, fs.kernels.CAP_ONLY),
                             ("flash2_fwd_wg", dtype, True)]
        assert not np.array_equal(own[0], online[0])
        np.testing.assert_allclose(own[0], online[0], atol=4 * eps * np.abs(v).max())
        np.testing.assert_allclose(own[1], online[1], rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("dtype", TC_DTYPES)
@pytest.mark.parametrize("d", (64, 128, 200))
def test_the_mma_sync_forwards_softcap_runs_its_own_instance(monkeypatch, dtype, d):
    check_tc_softcap_instance(monkeypatch, dtype, d)


def check_tc_softcap_instance(monkeypatch, dtype, d, Nq=333, Nk=200):
    """flash2_fwd_tc runs its softcap instance (kernels.tc_cap) where kernels.cap_only
    says: in bfloat16 a softcap ≤ 54.4, with ALiBi or without, under the fixed max; in
    float16 a softcap without ALiBi under the lazy max; with ALiBi alone, or float16's
    ALiBi, the online VAR instance. Against the simulator's twin under that rule (traffic
    exactly): causal, a window, Nq ≠ Nk, steep, negative and per-batch slopes, keys whose
    logits grow along the row (which move the lazy max); and O a few roundings of P from
    the online instance's, L a few float roundings."""
    from flashsim.gpu import flash2
    seen = []
    real = flash2.dev.kernel
    monkeypatch.setattr(flash2.dev, "kernel", lambda name, dtype, count_io, D=None, variant=False,
                        varlen=False: (seen.append((name, dtype, variant)),
                                       real(name, dtype, count_io, D, variant, varlen))[1])
    D = fs.kernels.instance_dim("tc", d, d)
    rng = np.random.default_rng(d + 2)
    rnd = make_precision("kernel", dtype).io_round
    q = rnd(rng.standard_normal((2, 4, Nq, d)) * 3).astype(np.float64)
    k = rnd(rng.standard_normal((2, 2, Nk, d)) * 3).astype(np.float64)
    v = rnd(rng.standard_normal((2, 2, Nk, d))).astype(np.float64)
    ramp = rnd(k * np.linspace(0.2, 2, Nk)[:, None])        # later keys, larger logits
    steep = rng.uniform(0.2, 1.0, 4)
    for c, kk, kw in ((50.0, k, dict()), (30.0, k, dict(causal=True, alibi_slopes=steep)),
                      (5.0, k, dict(window=(70, 3), alibi_slopes=-steep / 10)),
                      (54.0, ramp, dict(alibi_slopes=rng.uniform(-0.3, 0.3, (2, 4)))),
                      (60.0, ramp, dict(causal=True)), (None, k, dict(alibi_slopes=steep))):
        variants = dict(dict(causal=False, window=None, alibi_slopes=None), softcap=c, **kw)
        seen.clear()
        check_variants_forward(q, kk, v, dtype, None, variants, kernel="tc")
        sl = kw.get("alibi_slopes")
        own = fs.kernels.tc_cap(dtype, D, sl) and fs.kernels.cap_only(dtype, c, sl, D)
        assert own == (c is not None and (c < 55 if dtype == "bfloat16" else sl is None))
        assert seen[-1] == ("flash2_fwd_tc", dtype, fs.kernels.CAP_ONLY if own else True), (c, kw)
        qd, vd = dev(q, dtype), dev(v, dtype)
        assert fs.gpu.softmax_max(qd, vd, kernel="tc", softcap=c, alibi_slopes=sl) == \
            (("fixed" if dtype == "bfloat16" else "lazy") if own else "online")
    eps = 2.0**-8 if dtype == "bfloat16" else 2.0**-11
    for kw in (dict(softcap=30.0, alibi_slopes=steep), dict(softcap=30.0)):
        if dtype == "float16" and "alibi_slopes" in kw:
            continue                                       # (the online VAR instance)
        qd, kd, vd = (dev(x, dtype) for x in (q, k, v))
        own = [host(x) for x in fs.gpu.attention(qd, kd, vd, kernel="tc", **kw)]
        with monkeypatch.context() as m:
            m.setattr(fs.kernels, "cap_only", lambda *a: False)
            online = [host(x) for x in fs.gpu.attention(qd, kd, vd, kernel="tc", **kw)]
        assert seen[-2:] == [("flash2_fwd_tc", dtype, fs.kernels.CAP_ONLY),
                             ("flash2_fwd_tc", dtype, True)]
        assert not np.array_equal(own[0], online[0])
        np.testing.assert_allclose(own[0], online[0], atol=4 * eps * np.abs(v).max())
        np.testing.assert_allclose(own[1], online[1], rtol=1e-6, atol=1e-5)


@pytest.mark.skipif(not fs.gpu.available() or not hopper(), reason="needs compute capability 9.0")
@pytest.mark.parametrize("d", (64, 128))
def test_the_tma_forwards_warpgroups_stop_at_their_own_last_key_tile(monkeypatch, d):
    """Each consumer warpgroup of flash2_fwd_ws runs only the steps its own 64 rows see
    (none for rows past N: Nq = 100, 320 and 2048 at d = 64, 130 at 128 leave a warpgroup
    of the last tile wholly past N), and masks a step only where its own rows meet the
    band: the same bits, and counted bytes, as the build in which every warpgroup runs all
    of its tile's steps (FLASHSIM_WS_WG_BOUND=0, FLASHSIM_WS_WG_MASK=0), causal, windowed
    and not, with CTAs walking several tiles (5 SMs pretended)."""
    import cupy as cp
    from flashsim.gpu import _device
    monkeypatch.setenv("FLASHSIM_TMA", "1")
    monkeypatch.setattr(_device, "num_sms", lambda device: 5)
    rng = np.random.default_rng(d)
    cases = []
    for Nq, Nk in ((100, 100), (320, 320), (130, 517), (2048, 2048)):
        q, k, v = (cp.asarray(rng.standard_normal((1, 2, n, d)).astype(np.float16))
                   for n in (Nq, Nk, Nk))
        cases += [(q, k, v, kw) for kw in (dict(), dict(causal=True), dict(window=(50, 20)))]

    _same_bits_as_the_build_with(monkeypatch, cases,
                                 ("FLASHSIM_WS_WG_BOUND=0", "FLASHSIM_WS_WG_MASK=0"))


def _same_bits_as_the_build_with(monkeypatch, cases, macros):
    """Runs each (q, k, v, kwargs) case, counted and not, with the shipped kernels and
    with those built with ``macros`` defined, and requires the same bits of O and L and
    the same counted bytes. Returns the shipped build's results."""
    from flashsim.gpu import flash2, _device

    def run():
        monkeypatch.setattr(flash2, "_PLANS", {})
        _device.module.cache_clear()
        _device.kernel_on.cache_clear()
        return [fs.gpu.attention(q, k, v, count_io=io, **kw)
                for q, k, v, kw in cases for io in (False, True)]
    shipped = run()
    real = _device.compile_options
    try:
        monkeypatch.setattr(_device, "compile_options",
                            lambda count_io: real(count_io) + tuple("-D" + m for m in macros))
        other = run()
    finally:     # no kernel built with those macros stays in the caches or is built later
        monkeypatch.setattr(_device, "compile_options", real)
        monkeypatch.setattr(flash2, "_PLANS", {})
        _device.module.cache_clear()
        _device.kernel_on.cache_clear()
    for a, b in zip(shipped, other):
        assert all(np.array_equal(host(x), host(y)) for x, y in zip(a[:2], b[:2]))
        assert a[2:] == b[2:]
        assert np.isfinite(host(a[0])).all()
    return shipped


@pytest.mark.skipif(not fs.gpu.available() or not hopper(), reason="needs compute capability 9.0")
@pytest.mark.parametrize("d,dv", [(64, 64), (128, 128), (128, 64), (96, 96)])
def test_the_tma_forward_stores_O_through_the_copy_engine(monkeypatch, d, dv):
    """flash2_fwd_ws writes O through its own tensor map (wgmma.cuh's wg_store_o_tma: each
    warpgroup's rows from Q_i's slot, one TMA store per column block): the same bits of O
    and L, and counted bytes, as the consumers' 16-byte stores (FLASHSIM_WS_O_TMA=0), with
    O laid out as (B, H, N, dv) and as (B, N, H, dv) (heads side by side in a row: the
    boxes start mid-row), dv below d (a map dv columns wide: the boxes' columns past it are
    not written), rows past N in a tile, causal and windowed, CTAs walking tiles (5 SMs
    pretended); nothing is written outside O (a poisoned frame around it stays)."""
    import cupy as cp
    from flashsim.gpu import flash2, _device
    monkeypatch.setenv("FLASHSIM_TMA", "1")
    monkeypatch.setattr(_device, "num_sms", lambda device: 5)
    rng = np.random.default_rng(d + dv)
    cases = []
    for Nq, Nk in ((100, 100), (130, 517), (1000, 1000)):
        for bnhd in (False, True):
            shp = (2, Nq, 3, d) if bnhd else (2, 3, Nq, d)
            q = cp.asarray(rng.standard_normal(shp).astype(np.float16))
            q = q.transpose(0, 2, 1, 3) if bnhd else q
            k, v = (cp.asarray(rng.standard_normal((2, 3, Nk, w)).astype(np.float16))
                    for w in (d, dv))
            cases += [(q, k, v, kw) for kw in (dict(), dict(causal=True), dict(window=(50, 20)))]

    tma = _same_bits_as_the_build_with(monkeypatch, cases, ("FLASHSIM_WS_O_TMA=0",))
    # the output alone is written: O inside a larger poisoned buffer (as the GPU tests'
    # poisoning allocator gives it) keeps the rest
    monkeypatch.setattr(flash2, "_PLANS", {})
    q, k, v, kw = cases[6]                              # Nq = 130 (B, H, N, dv), no mask
    frame = cp.full(2 * 3 * 130 * dv + 4096, 4096.0, cp.float16)     # (exact in fp16)
    real_empty = flash2.arrays.empty

    def framed(cp_, shape, dtype, torch_dtype=None, like=None):
        if len(shape) == 4 and shape[-1] == dv and torch_dtype is None:
            n = int(np.prod(shape))
            return frame[2048:2048 + n].view(dtype).reshape(shape)
        return real_empty(cp_, shape, dtype, torch_dtype, like)
    monkeypatch.setattr(flash2.arrays, "empty", framed)
    out = fs.gpu.attention(q, k, v, **kw)[0]
    assert bool((frame[:2048] == 4096.0).all()) and bool((frame[2048 + out.size:] == 4096.0).all())
    assert np.array_equal(host(out), host(tma[12][0]))


@pytest.mark.skipif(not fs.gpu.available() or not hopper(), reason="needs compute capability 9.0")
@pytest.mark.parametrize("d,kw", [
    (d, kw) for d in (64, 128)
    for kw in (dict(), dict(softcap=20.0), dict(alibi_slopes=[0.25, 0.5, 0.125]),
               dict(causal=True), dict(window=(40, 200)))
    if fs.kernels.ws_runs(d, d, d, variant="softcap" in kw or "alibi_slopes" in kw)])
def test_the_tma_forward_walks_many_tiles_per_cta(monkeypatch, d, kw):
    """flash2_fwd_ws runs one CTA per SM, each walking tiles (kernels.ws_forward_ctas):
    b, b + CTAs, … without a band, from a counter under one (causal, a window): with 5 SMs
    pretended, 2 × 3 problems of 333 queries and GQA put several ragged tiles in a CTA,
    whose Q slots, K/V ring, turns and epilogue carry from tile to tile; O and L are the
    per-tile kernel's bits (flash2_fwd_wg's), the counted bytes equal, through the general
    path and PyTorch's fast path, and a second call (the counter zeroed again) the same."""
    import cupy as cp
    from flashsim.gpu import flash2, _device
    grids, chunks = [], []
    real = flash2._TmaLaunch.__call__

    def spy(self, *a, **k):
        grids.append(self.grid)
        out = real(self, *a, **k)
        chunks.append(self.args[-2].value)
        return out
    monkeypatch.setattr(flash2._TmaLaunch, "__call__", spy)
    monkeypatch.setattr(_device, "num_sms", lambda device: 5)
    monkeypatch.setattr(flash2, "_PLANS", {})
    # under a band, chunks of 4 problems and a first one of 2 (kernels.ws_chunk)
    monkeypatch.setattr(fs.kernels, "WS_CHUNK_BYTES", 4 * 517 * 2 * d * 2)
    rng = np.random.default_rng(d + len(kw))
    q = rng.standard_normal((2, 3, 333, d)).astype(np.float16)
    k, v = (rng.standard_normal((2, 1, 517, d)).astype(np.float16) for _ in range(2))
    q[..., :2, :] *= 8                                   # outliers
    qd, kd, vd = (cp.asarray(x) for x in (q, k, v))
    monkeypatch.setenv("FLASHSIM_TMA", "1")
    ws = fs.gpu.attention(qd, kd, vd, **kw)
    ws_io = fs.gpu.attention(qd, kd, vd, count_io=True, **kw)
    assert grids == [(5, 1)] * 2
    assert chunks == [4 if kw.get("causal") or "window" in kw else 1] * 2
    again = fs.gpu.attention(qd, kd, vd, **kw)
    assert all(np.array_equal(host(a), host(b)) for a, b in zip(ws, again))
    monkeypatch.setenv("FLASHSIM_TMA", "0")
    wg = fs.gpu.attention(qd, kd, vd, **kw)
    wg_io = fs.gpu.attention(qd, kd, vd, count_io=True, **kw)
    var = "softcap" in kw or "alibi_slopes" in kw
    tiles = fs.kernels.ws_blocks(d, var)
    monkeypatch.setenv("FLASHSIM_TMA", "1")
    assert fs.gpu.block_sizes(qd, vd, **{x: y for x, y in kw.items() if x != "causal"}) == tiles
    # the same keys a tile and the same softmax (a softcap, and ALiBi at d = 128, run
    # under a lazy max, kernels.cap_only): the same bits
    same = (tiles[1] == fs.kernels.WG_BLOCKS[d][1]
            and not fs.kernels.cap_only("float16", kw.get("softcap"), kw.get("alibi_slopes"), d))
    if same:
        for a, b in zip(ws + ws_io[:2], wg + wg_io[:2]):
            assert np.array_equal(host(a), host(b))
    if tiles == fs.kernels.WG_BLOCKS[d]:
        assert ws_io[2] == wg_io[2]
    if not same:                        # d = 64's tiles, or the lazy max: the simulator's
        sim = fs.simulate(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                          "flash2", block_sizes=tiles, io_dtype="float16",
                          **{key: (np.asarray(x) if key == "alibi_slopes" else x)
                             for key, x in kw.items()})
        assert ws_io[2] == sim.traffic, ws_io[2].diff(sim.traffic)
        assert np.abs(host(ws[0]) - sim.out).max() <= 1e-2 * np.abs(sim.out).max()
        assert np.array_equal(host(ws[0]), host(ws_io[0]))
    if HAVE_TORCH and set(kw) <= {"causal"}:             # the fast path's two cases
        tq, tk, tv = (torch.from_numpy(x).cuda() for x in (q, k, v))
        monkeypatch.setenv("FLASHSIM_TMA", "1")
        for _ in range(2):
            fast, fast_lse = fs.gpu.attention(tq, tk, tv, **kw)
            assert grids[-1] == (5, 1)
            assert np.array_equal(host(fast), host(ws[0])) and np.array_equal(host(fast_lse), host(ws[1]))


@pytest.mark.skipif(not fs.gpu.available() or not hopper(), reason="needs compute capability 9.0")
@pytest.mark.parametrize("d", [64, 96])
def test_the_tma_forward_at_other_head_dims(monkeypatch, d):
    """flash2_fwd_ws at d = 64 (its own 128 × 128 tiles, where flash2_fwd_wg takes 128 × 64)
    and 96: block_sizes names the tiles that run, with the copy engine and without
    (FLASHSIM_TMA=0), and each build counts the simulator's bytes for them; a layout
    whose tensor maps are refused is copied and run with the reported tiles."""
    import cupy as cp
    from flashsim.gpu import flash2
    calls = []
    real = flash2._WsForward.__call__
    monkeypatch.setattr(flash2._WsForward, "__call__",
                        lambda self, *a, **k: (calls.append(1), real(self, *a, **k))[1])
    rng = np.random.default_rng(d)
    rnd = make_precision("kernel", "float16").io_round
    q = rnd(random_tensor(rng, (2, 3, 333, d))).astype(np.float64)
    k, v = (rnd(random_tensor(rng, (2, 3, 517, d))).astype(np.float64) for _ in range(2))
    qd, kd, vd = (cp.asarray(x.astype(np.float16)) for x in (q, k, v))

    def run(tiles):
        out, lse, traffic = fs.gpu.attention(qd, kd, vd, causal=True, count_io=True)
        assert fs.gpu.block_sizes(qd, vd) == tiles
        sim = fs.simulate(q, k, v, "flash2", block_sizes=tiles, causal=True, io_dtype="float16")
        assert traffic == sim.traffic, traffic.diff(sim.traffic)
        assert np.abs(host(out) - sim.out).max() <= 1e-2 * np.abs(sim.out).max()
        return host(out)

    monkeypatch.setenv("FLASHSIM_TMA", "1")
    ws = run(fs.kernels.WS_BLOCKS[d])
    assert len(calls) == 1
    monkeypatch.setenv("FLASHSIM_TMA", "0")
    run(fs.kernels.WG_BLOCKS[d])
    assert len(calls) == 1
    if fs.kernels.WS_BLOCKS[d] != fs.kernels.WG_BLOCKS[d]:
        # the copy engine's tiles asked for while it is off: a typed error, no launch
        with pytest.raises(ValueError, match="FLASHSIM_TMA=0"):
            fs.gpu.attention(qd, kd, vd, block_sizes=fs.kernels.WS_BLOCKS[d])
    monkeypatch.setenv("FLASHSIM_TMA", "1")
    refused = []
    plan = flash2._tma.plan
    monkeypatch.setattr(flash2._tma, "plan",
                        lambda *a: refused.append(1) if not refused else plan(*a))
    assert np.array_equal(run(fs.kernels.WS_BLOCKS[d]), ws) and refused == [1]
    # d = 64: copied, then run by the copy engine with its tiles; d = 96: flash2_fwd_wg,
    # whose tiles (and so bits) are the same
    assert len(calls) == (2 if fs.kernels.WS_BLOCKS[d] != fs.kernels.WG_BLOCKS[d] else 1)


@pytest.mark.skipif(not fs.gpu.available() or not hopper(), reason="needs compute capability 9.0")
@pytest.mark.parametrize("d,dv", [(48, 48), (80, 80), (112, 64), (120, 120), (56, 40)])
def test_the_tma_forward_below_its_instance(monkeypatch, d, dv):
    """flash2_fwd_ws runs head dims below its instance's D: the tensor maps are d (dv)
    columns wide, so the copy engine zero-fills each box's columns past them, never
    reading a neighbouring head's or a row's padding. Every layout check_forward draws
    (dense, padded rows, (B, N, H, d) memory) against the simulator, with the counted
    bytes of the tiles block_sizes reports; the PyTorch fast path launches it too, with
    the same bits."""
    from flashsim.gpu import flash2
    calls = []
    real = flash2._WsForward.__call__
    monkeypatch.setattr(flash2._WsForward, "__call__",
                        lambda self, *a, **k: (calls.append(1), real(self, *a, **k))[1])
    monkeypatch.setenv("FLASHSIM_TMA", "1")
    D = fs.kernels.instance_dim("wg", d, dv)
    assert fs.kernels.ws_runs(d, dv, D)
    rng = np.random.default_rng(d * 3 + dv)
    rnd = make_precision("kernel", "float16").io_round
    for salt, causal in ((0, False), (1, True), (2, False)):
        q = rnd(random_tensor(rng, (2, 4, 203 + salt, d))).astype(np.float64)
        k = rnd(random_tensor(rng, (2, 2, 317, d))).astype(np.float64)
        v = rnd(random_tensor(rng, (2, 2, 317, dv))).astype(np.float64)
        n = len(calls)
        check_forward(q, k, v, "float16", causal, None, kernel="auto")
        assert len(calls) == n + 2                       # counted and plain: the copy engine
        qd, vd = dev(q, "float16"), dev(v, "float16")
        assert fs.gpu.block_sizes(laid_out(qd), laid_out(vd, 2)) == fs.kernels.WS_BLOCKS[D]
    if HAVE_TORCH and dv == d:
        # (B, N, H, d) memory through the fast path, against the general path's bits
        x = [torch.from_numpy(t.astype(np.float16)).cuda().transpose(1, 2).contiguous()
             .transpose(1, 2) for t in (q, k, v)]
        n = len(calls)
        fast, fast_lse = fs.gpu.attention(*x, causal=True)
        import cupy as cp
        gen, gen_lse = fs.gpu.attention(*(cp.asarray(t.astype(np.float16)) for t in (q, k, v)),
                                        causal=True)
        assert len(calls) == n + 2
        assert np.array_equal(host(fast), host(gen)) and np.array_equal(host(fast_lse), host(gen_lse))


@pytest.mark.skipif(not fs.gpu.available() or not hopper(), reason="needs compute capability 9.0")
@pytest.mark.parametrize("d,dv,det", [
    c for c in ((96, 96, False), (112, 64, True), (120, 120, False), (72, 128, False),
                (56, 56, False), (64, 40, True), (48, 64, False))
    if fs.kernels.instance_dim("wg", c[0], c[1], True) in fs.kernels.WS_BWD_HEAD_DIMS])
def test_the_tma_backward_below_its_instance(monkeypatch, d, dv, det):
    """flash2_bwd_ws (D ∈ WS_BWD_HEAD_DIMS) runs head dims below D, its maps d (V and dO: dv)
    columns wide: gradients by FlashAttention's 3× rule against the simulator, the counted
    bytes the simulator's for the tiles block_sizes reports, dQ added as whole blocks (64 ×
    128 at D = 128, 128 × 64 at 64: the copy engine's bulk reduce-adds; the post-pass reads
    the rows below Nq and the columns below d) or in turns (deterministic), in every layout
    check_backward draws."""
    from flashsim.gpu import flash2
    calls = []
    real = flash2._TmaLaunch.__call__
    monkeypatch.setattr(flash2._TmaLaunch, "__call__",
                        lambda self, *a, **k: (calls.append(self.name), real(self, *a, **k))[1])
    monkeypatch.setenv("FLASHSIM_TMA", "1")
    assert fs.kernels.ws_runs(d, dv, fs.kernels.instance_dim("wg", d, dv, True), backward=True)
    rng = np.random.default_rng(d + dv)
    rnd = make_precision("kernel", "float16").io_round
    for causal in (False, True):
        q = rnd(random_tensor(rng, (2, 4, 203, d))).astype(np.float64)
        k = rnd(random_tensor(rng, (2, 2, 317, d))).astype(np.float64)
        v = rnd(random_tensor(rng, (2, 2, 317, dv))).astype(np.float64)
        check_backward(q, k, v, "float16", causal, None, kernel="auto", deterministic=det)
    name = "flash2_bwd_ws_det" if det else "flash2_bwd_ws"
    assert calls.count(name) >= 2, calls                 # both masks


@pytest.mark.skipif(not fs.gpu.available() or not hopper(), reason="needs compute capability 9.0")
@pytest.mark.parametrize("torch_in", [False, True])
@pytest.mark.parametrize("kw", [dict(causal=False), dict(causal=True), dict(window=(100, 30)),
                                dict(softcap=20.0), dict(alibi_slopes=[0.25, 0.5, 0.125])])
@pytest.mark.parametrize("d", fs.kernels.WS_BWD_HEAD_DIMS)
def test_the_tma_backward_gives_the_cp_async_backwards_bits(monkeypatch, torch_in, kw, d):
    """flash2_bwd_ws (TMA, d = D of each instance) runs where "auto" meets dense inputs on a 9.0 device
    (PyTorch's fast path included) and gives flash2_bwd_wg's dk and dv bit for bit (same
    tiles, same steps), dq to fp32 atomics' order, and deterministic=True the same bits
    for all three; the same counted bytes; FLASHSIM_TMA=0 runs flash2_bwd_wg. Ragged,
    Nq ≠ Nk, GQA, and a (B, N, H, d) layout read through its strides."""
    if torch_in and not HAVE_TORCH:
        pytest.skip("PyTorch with CUDA not installed")
    from flashsim.gpu import flash2
    calls, chunks = [], []
    real = flash2._TmaLaunch.__call__

    def spy(self, *a, **k):
        calls.append(self.name)
        out = real(self, *a, **k)
        chunks.append(self.args[-1].value)
        return out
    monkeypatch.setattr(flash2._TmaLaunch, "__call__", spy)
    # under a band, the K/V tiles in chunks of 3 problems and a first of 2 (kernels.ws_chunk)
    monkeypatch.setattr(fs.kernels, "WS_CHUNK_BYTES", 3 * 333 * 2 * d * 2)
    rng = np.random.default_rng(19)
    q = rng.standard_normal((2, 333, 4, d)).astype(np.float16).transpose(0, 2, 1, 3)
    k, v = (rng.standard_normal((2, 2, 517, d)).astype(np.float16) for _ in range(2))
    q[..., :2, :] *= 8                                   # outliers
    if "alibi_slopes" in kw:
        kw = dict(alibi_slopes=kw["alibi_slopes"] + [0.75])
    if torch_in:
        q, k, v = (torch.from_numpy(np.ascontiguousarray(x)).cuda() for x in (q, k, v))
        q = q.transpose(1, 2).contiguous().transpose(1, 2)   # (B, N, H, d) memory
    else:
        import cupy as cp
        q, k, v = (cp.asarray(x) for x in (q, k, v))
    monkeypatch.setenv("FLASHSIM_TMA", "0")
    out, lse = fs.gpu.attention(q, k, v, **kw)
    dout = (torch.randn_like(out) if torch_in
            else cp.asarray(rng.standard_normal(out.shape).astype(np.float16)))

    def grads(**more):
        return fs.gpu.attention_backward(q, k, v, out, lse, dout, **kw, **more)
    wg = [grads(), grads(deterministic=True), grads(count_io=True)]
    assert calls == []
    monkeypatch.setenv("FLASHSIM_TMA", "1")
    ws = [grads(), grads(deterministic=True), grads(count_io=True)]
    assert calls == ["flash2_bwd_ws", "flash2_bwd_ws_det", "flash2_bwd_ws"]
    banded = kw.get("causal") or "window" in kw
    assert chunks == [3 if banded else 1, 1, 3 if banded else 1]
    for a, b in zip(ws[0][1:] + ws[1] + ws[2][1:3], wg[0][1:] + wg[1] + wg[2][1:3]):
        assert np.array_equal(host(a), host(b))
    np.testing.assert_allclose(host(ws[0][0]), host(wg[0][0]), rtol=2e-3, atol=2e-3)
    assert all(np.isfinite(host(x)).all() for x in ws[0])
    assert ws[2][3] == wg[2][3]


@pytest.mark.parametrize("name, stem", [("flash2_fwd_wg", "flash2_wg"), ("flash2_fwd_tc", "flash2_tc"),
                                        ("flash2_bwd_postprocess", "flash2_ref")])
def test_one_instance_is_built_and_cached_on_disk(monkeypatch, tmp_path, name, stem):
    """NVRTC builds the one instance asked for (sm_90a's and the plain arch's alike), keeps
    its cubin under CUPY_CACHE_DIR and a new process reads it back (here: a cleared
    in-memory cache, and a compiler that must not be called)."""
    if stem == "flash2_wg" and not hopper():
        pytest.skip("needs compute capability 9.0")
    D = None if stem == "flash2_ref" else 64
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path))
    fs.gpu._device.module.cache_clear()
    fs.gpu._device.kernel_on.cache_clear()
    try:
        k = fs.gpu._device.kernel(name, "float16", True, D)
        assert isinstance(k, fs.gpu._device.ArchKernel) and k.shared_size_bytes >= 0
        assert len(list(tmp_path.glob(f"flashsim_{stem}_*.cubin"))) == 1
        fs.gpu._device.module.cache_clear()
        fs.gpu._device.kernel_on.cache_clear()

        def no_compile(*a):
            raise AssertionError("compiled again")
        monkeypatch.setattr(fs.gpu._device.ArchModule, "_compile", staticmethod(no_compile))
        fs.gpu._device.kernel(name, "float16", True, D)
    finally:
        fs.gpu._device.module.cache_clear()
        fs.gpu._device.kernel_on.cache_clear()


@pytest.mark.parametrize("Nq, Nk, d", ODD)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_odd_shapes(poisoned, Nq, Nk, d, dtype, causal):
    rng = np.random.default_rng(Nq * 7 + Nk + d)
    rnd = make_precision("kernel", dtype).io_round
    q, k, v = (rnd(random_tensor(rng, (1, 2, n, d))).astype(np.float64) for n in (Nq, Nk, Nk))
    qd, kd, vd = (dev(x, dtype) for x in (q, k, v))
    out, lse, traffic = fs.gpu.attention(qd, kd, vd, causal=causal, count_io=True, kernel="ref")
    o = host(out)
    used = fs.gpu.block_sizes(qd, vd, kernel="ref")
    sim = fs.simulate(q, k, v, "flash2", block_sizes=used, causal=causal, io_dtype=dtype)
    assert traffic == sim.traffic
    err = np.abs(o - sim.out).max()
    if dtype in ("float32", "float64"):
        tol = 1e-5 if dtype == "float32" else 1e-12
        bound = max(tol, 4 * s_condition(q, k, dtype)) * max(1, np.abs(v).max())
        assert err <= bound, (err, bound)
    else:
        base = same_dtype_error(q, k, v, dtype, causal, sim.out)[0]
        assert err <= 2 * base + EPS[dtype] * np.abs(sim.out).max(), (err, base)
    if Nq * Nk <= 256 * 256:   # the backward on the smaller ones (the host oracle is dense)
        dout = rnd(rng.standard_normal(o.shape)).astype(np.float64)
        grads = fs.gpu.attention_backward(qd, kd, vd, out, lse, dev(dout, dtype),
                                          causal=causal, count_io=True)
        sim_b = fs.simulate_backward(q, k, v, o, host(lse), dout, "flash2", causal=causal,
                                     block_sizes=fs.gpu.block_sizes(qd, vd, backward=True),
                                     io_dtype=dtype)
        assert grads[3] == sim_b.traffic
        assert all(np.isfinite(host(x)).all() for x in grads[:3])


@pytest.mark.parametrize("torch_in", [False, True])
def test_tiles_that_do_not_fit_fall_back_to_the_reference(monkeypatch, torch_in):
    """On a device with less shared memory per block than the tensor-core tiles need
    (64 KB here, by pretence), "auto" runs the reference kernel, the fast path included,
    and kernel="tc" says why it cannot run."""
    if torch_in and not HAVE_TORCH:
        pytest.skip("PyTorch with CUDA not installed")
    monkeypatch.setattr(fs.gpu._device, "smem_limit_on", lambda device: 64 * 1024)
    rng = np.random.default_rng(12)
    shapes = [(1, 2, 97 + torch_in, 128)] * 4      # a shape no other test has planned
    q, k, v, dout = (rng.standard_normal(s).astype(np.float16) for s in shapes)
    if torch_in:
        q, k, v, dout = (torch.from_numpy(x).cuda() for x in (q, k, v, dout))
    else:
        import cupy as cp
        q, k, v, dout = (cp.asarray(x) for x in (q, k, v, dout))
    with pytest.raises(ValueError, match="shared memory"):
        fs.gpu.attention(q, k, v, kernel="tc")
    with pytest.raises(ValueError, match="Hopper kernel"):
        fs.gpu.attention(q, k, v, kernel="wg")
    out, lse = fs.gpu.attention(q, k, v)
    ref, ref_lse = fs.gpu.attention(q, k, v, kernel="ref")
    assert np.array_equal(host(out), host(ref)) and np.array_equal(host(lse), host(ref_lse))
    with pytest.raises(ValueError, match="shared memory"):
        fs.gpu.attention_backward(q, k, v, out, lse, dout, kernel="tc")
    got = fs.gpu.attention_backward(q, k, v, out, lse, dout)
    want = fs.gpu.attention_backward(q, k, v, out, lse, dout, kernel="ref")
    for a, b in zip(got[1:], want[1:]):              # dK, dV: no atomics, the same bits
        assert np.array_equal(host(a), host(b))


# -- variants: window, softcap, ALiBi (the reference rung) ---------------------------------

@st.composite
def variant_problems(draw, dtypes=None, max_seq=130, head_dims=(8, 16, 40, 64), fast=False):
    """Variants for the reference rung (any d, dv ≠ d, its tiles drawn), or with
    ``fast`` on the fast rungs' terms (d = dv ∈ TC_HEAD_DIMS, their own tiles: blocks
    None); windows that cut tiles, and ones reaching past the matrix."""
    Nq, Nk = draw(st.integers(1, max_seq)), draw(st.integers(1, max_seq))
    d = draw(st.sampled_from(head_dims))
    dv = d if fast else draw(st.sampled_from([d, 16]))
    dtype = draw(st.sampled_from(dtypes or (TC_DTYPES if fast else DTYPES)))
    B, hk, g = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.sampled_from([1, 2]))
    causal = draw(st.booleans())
    window = draw(st.one_of(st.none(), st.tuples(st.integers(-1, max_seq + 20),
                                                 st.integers(-1, max_seq + 20))))
    softcap = draw(st.one_of(st.none(), st.floats(0.25, 100.0 if fast else 30.0)))
    alibi = draw(st.sampled_from([None, "heads", "batch"]))
    blocks = None if fast else draw(st.tuples(st.sampled_from([16, 32, 64]),
                                              st.sampled_from([16, 32, 64])))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    rnd = make_precision("kernel", dtype).io_round
    q = rnd(rng.standard_normal((B, hk * g, Nq, d)) * 2).astype(np.float64)
    k = rnd(rng.standard_normal((B, hk, Nk, d)) * 2).astype(np.float64)
    v = rnd(rng.standard_normal((B, hk, Nk, dv))).astype(np.float64)
    slopes = None if alibi is None else rng.uniform(0.0, 0.5, (B, hk * g) if alibi == "batch"
                                                     else (hk * g,))
    return q, k, v, dtype, blocks, dict(causal=causal, window=window, softcap=softcap,
                                        alibi_slopes=slopes)


def _variant_tolerance(q, k, dtype, variants, Nk):
    """fp32 rounding of S (κ32, plus the ALiBi bias's own rounding) and, in float16 and
    bfloat16, a few roundings of P or dS to the I/O type falling the other way."""
    bias = 0.5 * (Nk + q.shape[-2]) if variants["alibi_slopes"] is not None else 0.0
    ulp = 4 * s_condition(q, k, "float32") + 4 * 2.0**-24 * (1 + bias)
    return ulp + (4 * EPS[dtype] if dtype in ("float16", "bfloat16") else 0.0)


@given(variant_problems())
def test_variants_forward_match_the_simulator(poisoned, problem):
    check_variants_forward(*problem)


def fast_variant_problems(dtypes=None, max_seq=400):
    """Variants on the fast rungs' terms: float16/bfloat16, d = dv ∈ TC_HEAD_DIMS, their
    own tiles; windows that cut their 64- and 128-wide tiles (d = 256 on the tc rung)."""
    return variant_problems(dtypes=dtypes, max_seq=max_seq,
                            head_dims=fs.kernels.TC_HEAD_DIMS, fast=True)


@pytest.mark.parametrize("kernel", FAST_RUNGS)
@given(problem=fast_variant_problems())
def test_fast_rungs_run_the_variants_forward(poisoned, kernel, problem):
    on_rung(kernel, problem[0].shape[-1], problem[2].shape[-1])
    check_variants_forward(*problem, kernel=kernel)


@pytest.mark.parametrize("kernel", FAST_RUNGS)
@given(problem=fast_variant_problems(), deterministic=st.booleans())
def test_fast_rungs_run_the_variants_backward(poisoned, kernel, problem, deterministic):
    on_rung(kernel, problem[0].shape[-1], problem[2].shape[-1], backward=True)
    check_variants_backward(*problem, deterministic, kernel=kernel)


def check_variants_forward(q, k, v, dtype, blocks, variants, kernel="auto"):
    qd, kd, vd = (laid_out(dev(x, dtype), n) for n, x in enumerate((q, k, v)))
    if blocks is not None and not fits(blocks, q.shape[-1], v.shape[-1], dtype):
        blocks = None
    out, lse, traffic = fs.gpu.attention(qd, kd, vd, block_sizes=blocks, count_io=True,
                                         kernel=kernel, **variants)
    out, lse = host(out), host(lse)
    asked = dict(window=variants["window"], softcap=variants["softcap"],
                 alibi_slopes=variants["alibi_slopes"])
    # the twin under the rule for m the launch ran (the softcap instance's fixed or lazy
    # max), at the tiles it was given
    rule = fs.gpu.softmax_max(qd, vd, kernel=kernel, block_sizes=blocks, **asked)
    blocks = blocks or fs.gpu.block_sizes(qd, vd, kernel=kernel, **asked)
    assert_matches_simulator(out, lse, traffic, q, k, v, dtype, "flash2", blocks, variants,
                             softmax_max=rule)


def assert_matches_simulator(out, lse, traffic, q, k, v, dtype, algorithm, blocks, variants,
                             softmax_max="online"):
    """A GPU forward against the simulator at the tiles it ran: the traffic exactly
    (skipped tiles included), the rows that see no key (out 0, lse −∞), and out and lse
    against the kernel-precision twin (the same roundings: flash1's O at every step,
    standard's S and P, square's E_ij in the I/O type; fp32 sums in another order; the
    kernel's rule for the softmax's m, ``softmax_max``).
    Returns the float64 simulation, for the caller's rule against it."""
    sim = fs.simulate(q, k, v, algorithm, block_sizes=blocks, io_dtype=dtype, **variants)
    assert traffic == sim.traffic, traffic.diff(sim.traffic)
    simk = fs.simulate(q, k, v, algorithm, block_sizes=blocks, io_dtype=dtype,
                       precision="kernel", softmax_max=softmax_max, **variants)
    fin = np.isfinite(sim.lse)
    assert np.array_equal(np.isneginf(lse), ~fin)
    assert (out[~fin] == 0).all()
    tol = _variant_tolerance(q, k, dtype, variants, k.shape[-2])
    vmax = max(1.0, np.abs(v).max())
    np.testing.assert_allclose(out, simk.out, rtol=tol, atol=tol * vmax)
    np.testing.assert_allclose(lse[fin], simk.lse[fin], rtol=tol, atol=tol)
    return sim


@given(variant_problems(), st.booleans())
def test_variants_backward_match_the_simulator(poisoned, problem, deterministic):
    check_variants_backward(*problem, deterministic)


def check_variants_backward(q, k, v, dtype, blocks, variants, deterministic, kernel="auto"):
    qd, kd, vd = (laid_out(dev(x, dtype), n) for n, x in enumerate((q, k, v)))
    if blocks is not None and not fits(blocks, q.shape[-1], v.shape[-1], dtype, backward=True):
        blocks = None     # drawn tiles too big for this device's shared memory: the default
    out, lse = fs.gpu.attention(qd, kd, vd, **variants)
    o, L = host(out), host(lse)
    rnd = make_precision("kernel", dtype).io_round
    dout = rnd(np.random.default_rng(1).standard_normal(o.shape)).astype(np.float64)
    *grads, traffic = fs.gpu.attention_backward(qd, kd, vd, out, lse, laid_out(dev(dout, dtype), 3),
                                                block_sizes=blocks, count_io=True,
                                                deterministic=deterministic, kernel=kernel,
                                                **variants)
    blocks = blocks or fs.gpu.block_sizes(qd, vd, backward=True, kernel=kernel)
    grads = [host(x) for x in grads]
    sim = fs.simulate_backward(q, k, v, o, L, dout, "flash2", block_sizes=blocks,
                               io_dtype=dtype, **variants)
    assert traffic == sim.traffic, traffic.diff(sim.traffic)
    simk = fs.simulate_backward(q, k, v, o, L, dout, "flash2", block_sizes=blocks,
                                io_dtype=dtype, precision="kernel", **variants)
    assert_grads_near_twin(grads, simk, q, k, v, o, dout, dtype, variants)


def assert_grads_near_twin(grads, simk, q, k, v, o, dout, dtype, variants, dq_roundings=0):
    """The kernel's gradients against its kernel-precision twin: the same roundings, in
    another order of fp32 sums (L, D and the dQ accumulator are fp32 in every kernel,
    float64 ones included), relative to the terms each gradient sums, not to the sum:
    dS = P ∘ (dP − D) cancels (one visible key: dk is 0 exactly, its parts are not).
    ``dq_roundings``: times dq itself goes back to HBM in the I/O type (flash1: once per
    K/V tile), each a rounding that may fall the other way."""
    rel = 1e-4 if dtype in ("float32", "float64") else 32 * EPS[dtype]
    # S is formed in fp32 by every kernel: its rounding weighs eps(fp32), not the I/O type's
    s_rounding = EPS["float32"] / EPS[dtype] if dtype in ("float16", "bfloat16") else 1.0
    mags = grad_magnitudes(q, k, v, o, dout, s_rounding=s_rounding, **variants)
    for n, (name, a, b) in enumerate(zip(("dq", "dk", "dv"), grads, (simk.dq, simk.dk, simk.dv))):
        assert np.isfinite(a).all(), name
        err, scale = np.abs(a - b).max(initial=0), max(np.abs(b).max(initial=0), mags[n])
        allowed = rel * scale + (dq_roundings * EPS[dtype] * scale if n == 0 else 0)
        assert err <= allowed, (name, err, scale)


# -- FlashAttention-1 and standard attention (the reference rung) ------------------------

PAPER_ALGORITHMS = ("flash1", "standard")
# forward-only schedules on the reference rung: Saha & Ye's square tiles
FORWARD_ALGORITHMS = PAPER_ALGORITHMS + ("square",)


def algorithm_problems(dtypes=None, max_seq=150):
    """The variants' problems (tiles drawn; windows that cut them or reach past the
    matrix; softcap with large logits; ALiBi with GQA), for flash1, standard, square."""
    return variant_problems(dtypes=dtypes, max_seq=max_seq)


@given(algorithm_problems(), st.sampled_from(FORWARD_ALGORITHMS), st.booleans())
def test_flash1_standard_and_square_forward_match_the_simulator(poisoned, problem, algorithm,
                                                                default_tiles):
    check_algorithm_forward(*problem, algorithm, default_tiles)


@given(algorithm_problems(max_seq=110), st.sampled_from(PAPER_ALGORITHMS))
def test_flash1_and_standard_backward_match_the_simulator(poisoned, problem, algorithm):
    check_algorithm_backward(*problem, algorithm)


def check_algorithm_forward(q, k, v, dtype, blocks, variants, algorithm, default_tiles=False):
    qd, kd, vd = (laid_out(dev(x, dtype), n) for n, x in enumerate((q, k, v)))
    if algorithm == "square":            # B × B tiles (the drawn Br; B < d and B < dv too)
        blocks = (blocks[0], blocks[0])
    if default_tiles or not _fits_algorithm(blocks, algorithm, False, q.shape[-1],
                                            v.shape[-1], dtype):
        blocks = None
    out, lse, traffic = fs.gpu.attention(qd, kd, vd, block_sizes=blocks, count_io=True,
                                         algorithm=algorithm, **variants)
    out_fast, lse_fast = fs.gpu.attention(qd, kd, vd, block_sizes=blocks, algorithm=algorithm,
                                          **variants)
    out, lse, out_fast, lse_fast = map(host, (out, lse, out_fast, lse_fast))
    np.testing.assert_array_equal(out, out_fast)     # instrumenting changes no result
    np.testing.assert_array_equal(lse, lse_fast)
    used = blocks or fs.gpu.block_sizes(qd, vd, algorithm=algorithm)
    sim = assert_matches_simulator(out, lse, traffic, q, k, v, dtype, algorithm, used,
                                   variants)
    vmax = max(1.0, np.abs(v).max())
    plain = all(variants[n] is None for n in ("window", "softcap", "alibi_slopes"))
    if plain and dtype in ("float16", "bfloat16"):
        # FlashAttention's rule against float64, plus one rounding of the output; flash1
        # also rounds O to the I/O type (and ℓ to fp32) once per K/V tile it visits, and
        # each rounding is weighted by at most 1 in the final O
        err = np.abs(out - sim.out).max(initial=0)
        base = same_dtype_error(q, k, v, dtype, variants["causal"], sim.out)[0]
        bound = 2 * base + EPS[dtype] * np.abs(sim.out).max(initial=0)
        if algorithm == "flash1":
            bound += -(-k.shape[-2] // used[1]) * (EPS[dtype] / 2 + 2 * EPS["float32"]) * vmax
        if algorithm == "square":
            # E_ij stored in the I/O type: each weight e(1 + δ)/Σ e(1 + δ), |δ| ≤ EPS/2,
            # moves by at most EPS relative, so O (a convex combination of V) by EPS·max|v|
            bound += EPS[dtype] * vmax
        assert err <= bound, (err, bound)


def _fits_algorithm(blocks, algorithm, backward, d, dv, dtype):
    names = fs.kernels.ALGORITHM_KERNELS[(algorithm, backward)]
    return all(fs.kernels.smem_bytes(n, *blocks, d, dv, dtype) <= fs.gpu.smem_limit()
               for n in names)


def check_algorithm_backward(q, k, v, dtype, blocks, variants, algorithm):
    qd, kd, vd = (laid_out(dev(x, dtype), n) for n, x in enumerate((q, k, v)))
    if not _fits_algorithm(blocks, algorithm, True, q.shape[-1], v.shape[-1], dtype):
        blocks = fs.gpu.block_sizes(qd, vd, backward=True, algorithm=algorithm)
    out, lse = fs.gpu.attention(qd, kd, vd, algorithm=algorithm, block_sizes=blocks,
                                **variants)
    o, L = host(out), host(lse)
    rnd = make_precision("kernel", dtype).io_round
    dout = rnd(np.random.default_rng(1).standard_normal(o.shape)).astype(np.float64)
    *grads, traffic = fs.gpu.attention_backward(qd, kd, vd, out, lse, laid_out(dev(dout, dtype), 3),
                                                block_sizes=blocks, count_io=True,
                                                algorithm=algorithm, **variants)
    again = fs.gpu.attention_backward(qd, kd, vd, out, lse, laid_out(dev(dout, dtype), 3),
                                      block_sizes=blocks, algorithm=algorithm, **variants)
    grads = [host(x) for x in grads]
    for a, b in zip(grads, again):      # no atomics: the same bits, instrumented or not
        np.testing.assert_array_equal(a, host(b))
    sim = fs.simulate_backward(q, k, v, o, L, dout, algorithm, block_sizes=blocks,
                               io_dtype=dtype, **variants)
    assert traffic == sim.traffic, traffic.diff(sim.traffic)
    simk = fs.simulate_backward(q, k, v, o, L, dout, algorithm, block_sizes=blocks,
                                io_dtype=dtype, precision="kernel", **variants)
    # flash1's dQ goes back to HBM in the I/O type once per K/V tile
    steps = -(-k.shape[-2] // blocks[1]) if algorithm == "flash1" else 0
    assert_grads_near_twin(grads, simk, q, k, v, o, dout, dtype, variants, dq_roundings=steps)


def test_algorithm_is_checked_before_any_launch():
    q = dev(np.ones((4, 8)), "float32")
    with pytest.raises(ValueError, match="algorithm must be one of"):
        fs.gpu.attention(q, q, q, algorithm="flash3")
    with pytest.raises(ValueError, match="reference kernels only"):
        fs.gpu.attention(q, q, q, algorithm="flash1", kernel="tc")
    with pytest.raises(ValueError, match="reference kernels only"):
        fs.gpu.attention_backward(q, q, q, q, np.zeros(4), q, algorithm="standard",
                                  kernel="tc")
    with pytest.raises(ValueError, match="needs .* bytes of shared memory"):
        fs.gpu.attention(q, q, q, algorithm="standard", block_sizes=(4096, 4096))
    with pytest.raises(ValueError, match="square needs Br == Bc"):
        fs.gpu.attention(q, q, q, algorithm="square", block_sizes=(4, 2))
    with pytest.raises(ValueError, match="forward schedule"):
        fs.gpu.attention_backward(q, q, q, q, np.zeros(4), q, algorithm="square")
    with pytest.raises(ValueError, match="forward schedule"):
        fs.gpu.block_sizes(q, q, algorithm="square", backward=True)


# -- packed varlen batches -----------------------------------------------------------------

@st.composite
def varlen_problems(draw, dtypes=None, max_len=70, head_dims=None):
    """A packed batch: lengths 0 and 1 among the others, Nq_b ≠ Nk_b, GQA, dv ≠ d, the
    variants (ALiBi per head or per sequence), tiles that cut the sequences. With
    ``head_dims`` (the fast rungs'): d = dv drawn from them, and the rung's own tiles
    (blocks None)."""
    B = draw(st.integers(0, 4))
    nq = draw(st.lists(st.one_of(st.sampled_from([0, 1]), st.integers(0, max_len)),
                       min_size=B, max_size=B))
    nk = draw(st.lists(st.one_of(st.sampled_from([0, 1]), st.integers(0, max_len)),
                       min_size=B, max_size=B))
    d = draw(st.sampled_from(head_dims or [8, 16, 40, 64]))
    dv = d if head_dims else draw(st.sampled_from([d, 24]))
    dtype = draw(st.sampled_from(dtypes or DTYPES))
    hk, g = draw(st.integers(1, 2)), draw(st.sampled_from([1, 2, 3]))
    causal = draw(st.booleans())
    window = draw(st.one_of(st.none(), st.tuples(st.integers(-1, 30), st.integers(-1, 30))))
    softcap = draw(st.one_of(st.none(), st.floats(0.5, 20.0)))
    alibi = draw(st.sampled_from([None, "heads", "batch"]))
    blocks = None if head_dims else draw(st.tuples(st.sampled_from([8, 16, 32]),
                                                   st.sampled_from([8, 16, 32])))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    rnd = make_precision("kernel", dtype).io_round
    cu_q = np.concatenate([[0], np.cumsum(nq)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(nk)]).astype(np.int32)
    q = rnd(rng.standard_normal((int(cu_q[-1]), hk * g, d))).astype(np.float64)
    k = rnd(rng.standard_normal((int(cu_k[-1]), hk, d))).astype(np.float64)
    v = rnd(rng.standard_normal((int(cu_k[-1]), hk, dv))).astype(np.float64)
    slopes = None if alibi is None else rng.uniform(0.0, 0.5, (B, hk * g) if alibi == "batch"
                                                     else (hk * g,))
    return q, k, v, cu_q, cu_k, dtype, blocks, dict(causal=causal, window=window,
                                                     softcap=softcap, alibi_slopes=slopes)


def _sequence_slopes(slopes, b):
    return None if slopes is None else (slopes if slopes.ndim == 1 else slopes[b])


def check_varlen(q, k, v, cu_q, cu_k, dtype, blocks, variants, deterministic=True,
                 kernel="ref"):
    """The packed launch against (1) the simulator's varlen traffic, byte for byte, and
    (2) the same kernel run on each sequence alone as a dense problem: the same tiles
    and arithmetic, so out, lse and (deterministic) the gradients are the same bits.
    ``kernel`` "tc" or "auto" (blocks None): the fast rungs' varlen instance, which is
    their softcap/ALiBi one, so the dense runs take that instance too (ALiBi slopes of
    0 where none are given: the same arithmetic as none)."""
    qd, kd, vd = (dev(x, dtype) for x in (q, k, v))
    fwd_blocks, bwd_blocks = blocks, blocks
    if blocks is None:
        fwd_blocks, bwd_blocks = (fs.gpu.block_sizes(qd, vd, varlen=True, kernel=kernel,
                                                     backward=b) for b in (False, True))
    out, lse, traffic = fs.gpu.attention_varlen(qd, kd, vd, cu_q, cu_k, block_sizes=blocks,
                                                count_io=True, kernel=kernel, **variants)
    o, L = host(out), host(lse)
    assert o.shape == (q.shape[0], q.shape[1], v.shape[2]) and L.shape == (q.shape[1], q.shape[0])
    sim = fs.count_varlen("flash2", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, heads=q.shape[1],
                          kv_heads=k.shape[1], d=q.shape[2], dv=v.shape[2],
                          block_sizes=fwd_blocks, io_dtype=dtype, causal=variants["causal"],
                          window=variants["window"])
    assert traffic == sim, traffic.diff(sim)
    rnd = make_precision("kernel", dtype).io_round
    dout = rnd(np.random.default_rng(3).standard_normal(o.shape)).astype(np.float64)
    *grads, gtraffic = fs.gpu.attention_varlen_backward(
        qd, kd, vd, out, lse, dev(dout, dtype), cu_q, cu_k, block_sizes=blocks, count_io=True,
        kernel=kernel, deterministic=deterministic, **variants)
    grads = [host(x) for x in grads]
    gsim = fs.count_varlen_backward("flash2", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                    heads=q.shape[1], kv_heads=k.shape[1], d=q.shape[2],
                                    dv=v.shape[2], block_sizes=bwd_blocks, io_dtype=dtype,
                                    causal=variants["causal"], window=variants["window"],
                                    softcap=variants["softcap"])
    assert gtraffic == gsim, gtraffic.diff(gsim)
    for b in range(len(cu_q) - 1):
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if sq.start == sq.stop:
            continue
        if sk.start == sk.stop:      # no key: out = 0, lse = −∞, no gradient for q
            assert (o[sq] == 0).all() and np.isneginf(L[:, sq]).all()
            assert (grads[0][sq] == 0).all()
            continue
        heads = lambda x: np.ascontiguousarray(np.moveaxis(x, 0, 1))   # noqa: E731
        slopes = _sequence_slopes(variants["alibi_slopes"], b)
        if slopes is None and kernel != "ref":
            slopes = np.zeros(q.shape[1])
        var = dict(variants, alibi_slopes=slopes)
        qb, kb, vb = (dev(heads(x[s]), dtype) for x, s in ((q, sq), (k, sk), (v, sk)))
        with pytest.MonkeyPatch.context() as mp:
            # the varlen instance's online max, not the fixed one a dense bfloat16 softcap
            # takes on the copy-engine forward (kernels.cap_only)
            mp.setattr(fs.kernels, "cap_only", lambda *a: False)
            ob, Lb = fs.gpu.attention(qb, kb, vb, block_sizes=blocks, kernel=kernel, **var)
        np.testing.assert_array_equal(heads(o[sq]), host(ob))
        np.testing.assert_array_equal(L[:, sq], host(Lb))
        gb = fs.gpu.attention_backward(qb, kb, vb, ob, Lb, dev(heads(dout[sq]), dtype),
                                       block_sizes=blocks, kernel=kernel,
                                       deterministic=True, **var)
        for name, a, want, s in zip(("dq", "dk", "dv"), grads, gb, (sq, sk, sk)):
            got, want = heads(a[s]), host(want)
            if deterministic or name != "dq":
                np.testing.assert_array_equal(got, want, err_msg=name)
            else:   # unordered fp32 atomics: the last bits of dQ
                np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3 * np.abs(want).max(initial=1))


@given(varlen_problems(), st.booleans())
def test_varlen_matches_each_sequence_and_the_simulators_counts(poisoned, problem, deterministic):
    check_varlen(*problem, deterministic=deterministic)


@given(varlen_problems(dtypes=["float16", "bfloat16"], max_len=400,
                       head_dims=fs.kernels.TC_HEAD_DIMS), st.booleans(),
       st.sampled_from(["auto", "tc"]))
def test_varlen_on_the_fast_rungs_matches_each_sequence_and_the_counts(poisoned, problem,
                                                                      deterministic, kernel):
    """kernel="auto": the Hopper forward and backward on 9.0; "tc": the mma.sync ones."""
    check_varlen(*problem, deterministic=deterministic, kernel=kernel)
