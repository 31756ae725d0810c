"""The reference rung's CUDA kernels, run on the CPU by `fs.gpu.emulated()`, against the
simulator: the same checks as tests/test_gpu.py (outputs to each dtype's rule, byte
counts exactly), on a machine with no GPU. Needs a C++20 compiler and the CUDA headers
(skipped without them); bfloat16 needs PyTorch (CPU tensors).
"""

import importlib.util
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import flashsim as fs

with fs.gpu.emulated():
    EMULATED = fs.gpu.available()

pytestmark = pytest.mark.skipif(not EMULATED, reason="no C++20 compiler or CUDA headers "
                                "for the CPU emulation")

import test_gpu as G   # noqa: E402  (tests/ is on sys.path: the checks are shared)
import test_kvcache_gpu as KV   # noqa: E402

# bfloat16 travels as PyTorch CPU tensors (NumPy has no bfloat16)
DTYPES = ["float16", "float32", "float64"] + (["bfloat16"] if importlib.util.find_spec("torch")
                                              else [])

# one fiber switch per thread per barrier: keep each problem to a few tiles' worth
# (EMU_EXAMPLES=80 for a longer run)
EMU = settings(max_examples=int(os.environ.get("EMU_EXAMPLES", 12)), deadline=None)


@pytest.fixture(autouse=True)
def emulated():
    with fs.gpu.emulated():
        yield


@EMU
@given(G.gpu_problems(max_seq=150, dtypes=DTYPES))
def test_forward_matches_simulator(problem):
    with pytest.MonkeyPatch.context() as m:
        G.poison_outputs(m)
        G.check_forward(*problem, kernel="ref")


@EMU
@given(G.gpu_problems(max_seq=120, dtypes=DTYPES), st.booleans())
def test_backward_matches_simulator(problem, deterministic):
    with pytest.MonkeyPatch.context() as m:
        G.poison_outputs(m)
        G.check_backward(*problem, kernel="ref", deterministic=deterministic)


TC_DTYPES = [t for t in DTYPES if t in fs.kernels.TC_DTYPES]


# the mma.sync rung (flash2_tc.cu), its warp collectives emulated lane by lane: its tiles
# are those of an H100 (the host build is the sm_90 configuration)
@EMU
@given(G.gpu_problems(max_seq=200, head_dims=G.FAST_HEAD_DIMS, dtypes=TC_DTYPES,
                      any_blocks=False, dv_dims=G.FAST_HEAD_DIMS))
def test_tensor_core_forward_matches_simulator(problem):
    with pytest.MonkeyPatch.context() as m:
        G.poison_outputs(m)
        G.check_forward(*problem, kernel="tc")


@EMU
@given(G.gpu_problems(max_seq=200, head_dims=G.FAST_HEAD_DIMS, dtypes=TC_DTYPES,
                      any_blocks=False, dv_dims=G.FAST_HEAD_DIMS), st.booleans())
def test_tensor_core_backward_matches_simulator(problem, deterministic):
    with pytest.MonkeyPatch.context() as m:
        G.poison_outputs(m)
        G.check_backward(*problem, kernel="tc", deterministic=deterministic)


# the same rung in its Ampere configuration (the emulation playing compute capability 8.0):
# its own tiles, warps and steps (fs.kernels.TC_BLOCKS_AMPERE, TC_THREADS_AMPERE,
# TC_BWD_BLOCKS_AMPERE, TC_BWD_HEAD_DIMS_AMPERE), which no test on an H100 runs
@EMU
@given(G.gpu_problems(max_seq=160, head_dims=G.FAST_HEAD_DIMS, dtypes=TC_DTYPES,
                      any_blocks=False, dv_dims=G.FAST_HEAD_DIMS), st.booleans())
def test_tensor_core_ampere_forward_and_backward_match_simulator(problem, deterministic):
    with fs.gpu.emulated(compute_capability=80), pytest.MonkeyPatch.context() as m:
        G.poison_outputs(m)
        G.check_forward(*problem, kernel="tc")
        G.check_backward(*problem, kernel="tc", deterministic=deterministic)


@EMU
@given(G.fast_variant_problems(dtypes=TC_DTYPES, max_seq=200), st.booleans())
def test_tensor_core_ampere_variants_match_the_simulator(problem, deterministic):
    with fs.gpu.emulated(compute_capability=80), pytest.MonkeyPatch.context() as m:
        G.poison_outputs(m)
        G.check_variants_forward(*problem, kernel="tc")
        G.check_variants_backward(*problem, deterministic, kernel="tc")


@pytest.mark.parametrize("cc", [90, 80])
def test_the_emulation_plays_each_compute_capability_with_its_tiles(cc):
    ampere = cc < 90
    with fs.gpu.emulated(compute_capability=cc):
        assert fs.gpu.smem_limit() == (163 if ampere else 227) * 1024
        for d in (96, 128, 160, 192, 224):
            q = np.zeros((1, 8, d), np.float16)
            D = fs.kernels.instance_dim("tc", d, d, backward=True, cc_major=cc // 10)
            assert fs.gpu.block_sizes(q, q, backward=True, kernel="tc") == \
                fs.kernels.tc_bwd_blocks(D, cc // 10)
            assert fs.gpu.block_sizes(q, q, kernel="tc") == fs.kernels.tc_blocks(d, cc // 10)
    # an A100 runs d = 160 on the D = 192 backward, an H100 on its own
    assert fs.kernels.instance_dim("tc", 160, 160, backward=True, cc_major=8) == 192
    assert fs.kernels.instance_dim("tc", 160, 160, backward=True, cc_major=9) == 160


@EMU
@given(G.fast_variant_problems(dtypes=TC_DTYPES, max_seq=260))
def test_tensor_core_variants_forward_match_the_simulator(problem):
    with pytest.MonkeyPatch.context() as m:
        G.poison_outputs(m)
        G.check_variants_forward(*problem, kernel="tc")


@EMU
@given(G.fast_variant_problems(dtypes=TC_DTYPES, max_seq=260), st.booleans())
def test_tensor_core_variants_backward_match_the_simulator(problem, deterministic):
    with pytest.MonkeyPatch.context() as m:
        G.poison_outputs(m)
        G.check_variants_backward(*problem, deterministic, kernel="tc")


@pytest.mark.parametrize("dtype", TC_DTYPES)
def test_the_tensor_core_forwards_softcap_runs_its_own_instance(monkeypatch, dtype):
    G.check_tc_softcap_instance(monkeypatch, dtype, 64, Nq=150, Nk=90)


@EMU
@given(G.varlen_problems(dtypes=DTYPES), st.booleans())
def test_varlen_matches_each_sequence_and_the_simulators_counts(problem, deterministic):
    with pytest.MonkeyPatch.context() as m:
        G.poison_outputs(m)
        G.check_varlen(*problem, deterministic=deterministic)


@EMU
@given(G.varlen_problems(dtypes=TC_DTYPES, max_len=300, head_dims=[64]), st.booleans())
def test_tensor_core_varlen_matches_each_sequence_and_the_simulators_counts(problem,
                                                                           deterministic):
    with pytest.MonkeyPatch.context() as m:
        G.poison_outputs(m)
        G.check_varlen(*problem, deterministic=deterministic, kernel="tc")


def test_varlen_bad_input_gets_the_simulators_errors_before_any_launch(monkeypatch):
    def no_launch(*a, **k):
        raise AssertionError("launched")
    monkeypatch.setattr(fs.gpu._device, "launch", no_launch)
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((9, 4, 16)), rng.standard_normal((7, 2, 16))
    cu_q, cu_k = np.array([0, 4, 9]), np.array([0, 3, 7])
    call = lambda **kw: fs.gpu.attention_varlen(   # noqa: E731
        kw.pop("q", q), kw.pop("k", k), kw.pop("v", k), kw.pop("cu_q", cu_q),
        kw.pop("cu_k", cu_k), **kw)
    with pytest.raises(ValueError, match="must start at 0"):
        call(cu_q=np.array([1, 4, 9]))
    with pytest.raises(ValueError, match="non-decreasing"):
        call(cu_k=np.array([0, 5, 3, 7]), cu_q=np.array([0, 4, 4, 9]))
    with pytest.raises(ValueError, match="packed length"):
        call(cu_q=np.array([0, 4, 8]))
    with pytest.raises(ValueError, match="both need batch"):
        call(cu_k=np.array([0, 7]))
    with pytest.raises(TypeError, match="integer"):
        call(cu_q=np.array([0.0, 4.0, 9.0]))
    with pytest.raises(ValueError, match="3-D packed"):
        call(q=q[None])
    with pytest.raises(ValueError, match="multiple of the K/V heads"):
        call(q=rng.standard_normal((9, 3, 16)))
    with pytest.raises(ValueError, match="shorter than the longest"):
        call(max_seqlen_q=4)
    with pytest.raises(ValueError, match="alibi_slopes must have shape"):
        call(alibi_slopes=np.ones(3))
    with pytest.raises(ValueError, match="softcap must be > 0"):
        call(softcap=-1.0)
    with pytest.raises(ValueError, match="tensor-core kernel runs float16/bfloat16"):
        call(kernel="tc")
    with pytest.raises(ValueError, match="packed shape"):
        fs.gpu.attention_varlen_backward(q, k, k, q[:, :, :8], np.zeros((4, 9)), q, cu_q, cu_k)


@pytest.mark.parametrize("kernel, dtype", [("ref", "float32"), ("tc", "float16")])
@pytest.mark.parametrize("Hk", [4, 2])
def test_strided_inputs_are_read_in_place(kernel, dtype, Hk):
    G.check_strided(kernel, dtype, Hk)


def test_auto_picks_the_reference_rung_and_the_hopper_rung_is_not_emulated():
    q = np.random.default_rng(0).standard_normal((1, 1, 16, 64)).astype(np.float16)
    assert fs.gpu.block_sizes(q, q) == fs.gpu.block_sizes(q, q, kernel="ref")
    assert fs.gpu.block_sizes(q, q, kernel="tc") == fs.kernels.TC_BLOCKS[64]
    with pytest.raises(ValueError, match="not emulated"):
        fs.gpu.attention(q, q, q, kernel="wg")


@pytest.mark.parametrize("dtype", DTYPES)
def test_fully_masked_rows_and_large_logits(monkeypatch, dtype):
    G.poison_outputs(monkeypatch)
    G.test_fully_masked_rows_and_large_logits(None, dtype)


@pytest.mark.parametrize("Nq, Nk, d", [(113, 203, 40), (203, 113, 160), (7, 300, 256)])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("causal", [False, True])
def test_odd_shapes(monkeypatch, Nq, Nk, d, dtype, causal):
    G.poison_outputs(monkeypatch)
    G.test_odd_shapes(None, Nq, Nk, d, dtype, causal)


@pytest.mark.parametrize("causal", [False, True])
def test_deterministic_backward_is_the_same_bits_and_traffic(causal):
    """The ordered dQ accumulation: identical bits run to run, the same bytes as the
    unordered mode, and the emulator finds every turn taken in blockIdx order (a turn
    out of order raises where a GPU would hang)."""
    rng = np.random.default_rng(9)
    q = rng.standard_normal((1, 2, 70, 24)).astype(np.float32)
    k, v = (rng.standard_normal((1, 1, 300, 24)).astype(np.float32) for _ in range(2))
    dout = rng.standard_normal(q.shape).astype(np.float32)
    out, lse = fs.gpu.attention(q, k, v, causal=causal)
    runs = [fs.gpu.attention_backward(q, k, v, out, lse, dout, causal=causal, count_io=True,
                                      deterministic=True, block_sizes=(16, 16))
            for _ in range(2)]
    free = fs.gpu.attention_backward(q, k, v, out, lse, dout, causal=causal, count_io=True,
                                     block_sizes=(16, 16))
    for a, b in zip(runs[0][:3], runs[1][:3]):
        assert np.array_equal(a, b)
    assert runs[0][3] == runs[1][3] == free[3]


def test_numpy_in_numpy_out_and_errors():
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((2, 33, 16)).astype(np.float32) for _ in range(3))
    out, lse = fs.gpu.attention(q, k, v)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32 and lse.dtype == np.float32
    np.testing.assert_allclose(out, fs.attention_reference(q, k, v)[0], rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match="share one dtype"):
        fs.gpu.attention(q, k.astype(np.float16), v)
    with pytest.raises(ValueError, match="shared memory"):
        fs.gpu.attention(q, k, v, block_sizes=(4096, 4096))
    # a head dim that is not a multiple of 8 has no fast instance: asked for by name, the
    # tensor-core rung says so
    h20 = rng.standard_normal((2, 33, 20)).astype(np.float16)
    with pytest.raises(ValueError, match="tensor-core kernel runs"):
        fs.gpu.attention(h20, h20, h20, kernel="tc")
    h = rng.standard_normal((1, 2, 40, 64)).astype(np.float16)
    assert fs.gpu.block_sizes(h, h) == fs.kernels.default_block_sizes(
        64, 64, "float16", fs.gpu.smem_limit(), False)   # "auto" is the reference rung


def test_emulation_is_scoped_and_checked():
    assert fs.gpu.is_emulated()
    with fs.gpu.emulated(False):
        assert not fs.gpu.is_emulated()
    assert fs.gpu.is_emulated()
    with pytest.raises(TypeError, match="True or False"):
        with fs.gpu.emulated("yes"):
            pass
    for cc in (86, "80", True):
        with pytest.raises(ValueError, match="90 .an H100. or 80"):
            with fs.gpu.emulated(compute_capability=cc):
                pass
    with fs.gpu.emulated(compute_capability=80):
        assert fs.gpu.is_emulated() and fs.gpu._device.emulated_cc() == 80
    assert fs.gpu._device.emulated_cc() == 90


def test_a_launch_error_is_raised_not_crashed():
    """Launch checks the emulator makes before running a block (as a driver would)."""
    kern = fs.gpu._device.kernel("flash2_bwd_postprocess", "float32", False)
    dq, at = np.zeros((1, 4, 8), np.float32), np.zeros(8, np.int64)
    ints = (np.int32(4), np.int32(8), np.int32(8), np.int32(4))   # Nq, ld, d, Br
    with pytest.raises(RuntimeError, match="1 to 1024 threads"):
        kern((1, 1), (2048,), (dq, dq, at, *ints, np.uint64(0)))
    with pytest.raises(RuntimeError, match="exceeds"):
        kern((1, 1), (32,), (dq, dq, at, *ints, np.uint64(0)), shared_mem=10**7)
    with pytest.raises(TypeError, match="fixed width"):
        kern((1, 1), (32,), (dq, dq, at, 4, *ints[1:], np.uint64(0)))


def test_torch_cpu_tensors_in_and_out():
    pytest.importorskip("torch")
    G.check_torch_in_torch_out("cpu", (1, 2, 50, 32))


# -- variants: window, softcap, ALiBi (the reference rung) ---------------------------------

@EMU
@given(G.variant_problems(dtypes=DTYPES))
def test_variants_forward_match_the_simulator(problem):
    with pytest.MonkeyPatch.context() as m:
        G.poison_outputs(m)
        G.check_variants_forward(*problem)


@EMU
@given(G.variant_problems(dtypes=DTYPES), st.booleans())
def test_variants_backward_match_the_simulator(problem, deterministic):
    with pytest.MonkeyPatch.context() as m:
        G.poison_outputs(m)
        G.check_variants_backward(*problem, deterministic)


@EMU
@given(G.algorithm_problems(dtypes=DTYPES, max_seq=100), st.sampled_from(G.FORWARD_ALGORITHMS),
       st.booleans())
def test_flash1_standard_and_square_forward_match_the_simulator(problem, algorithm,
                                                                default_tiles):
    with pytest.MonkeyPatch.context() as m:
        G.poison_outputs(m)
        G.check_algorithm_forward(*problem, algorithm, default_tiles)


@EMU
@given(G.algorithm_problems(dtypes=DTYPES, max_seq=80), st.sampled_from(G.PAPER_ALGORITHMS))
def test_flash1_and_standard_backward_match_the_simulator(problem, algorithm):
    with pytest.MonkeyPatch.context() as m:
        G.poison_outputs(m)
        G.check_algorithm_backward(*problem, algorithm)


def test_algorithm_is_checked_before_any_launch():
    G.test_algorithm_is_checked_before_any_launch()


def test_standard_rows_must_fit_shared_memory(monkeypatch):
    """The row passes hold a row of S (P, dP) in shared memory: a row too long for the
    device is refused before any launch, naming the limit and the way out."""
    monkeypatch.setattr(fs.gpu._device, "smem_limit", lambda: 8 * 1024)
    launched = []
    monkeypatch.setattr(fs.gpu._device, "launch", lambda *a, **k: launched.append(a))
    q = np.ones((2, 8), np.float16)
    k = np.ones((5000, 8), np.float16)
    with pytest.raises(ValueError, match="holds a row of 5000 keys.*algorithm='flash2'"):
        fs.gpu.attention(q, k, k, algorithm="standard", block_sizes=(2, 16))
    assert not launched


def test_variants_are_checked_before_any_launch():
    q = np.ones((1, 2, 8, 16), np.float32)
    with pytest.raises(ValueError, match=">= -1"):
        fs.gpu.attention(q, q, q, window=(-2, 0))
    with pytest.raises(ValueError, match="softcap must be > 0"):
        fs.gpu.attention(q, q, q, softcap=0.0)
    with pytest.raises(ValueError, match="alibi_slopes must have shape"):
        fs.gpu.attention(q, q, q, alibi_slopes=np.ones(3))
    with pytest.raises(ValueError, match="float16/bfloat16"):   # a variant, not a dtype, of tc's
        fs.gpu.attention(q, q, q, softcap=5.0, kernel="tc")
    out, lse = fs.gpu.attention(q, q, q, window=(0, 0))     # each row sees its own key
    np.testing.assert_allclose(out, q, rtol=1e-6)


def test_the_reference_fallback_warns_once_per_reason():
    """On a GPU, float16/bfloat16 inputs that "auto" must run on the reference kernel
    (an unsupported head dim) warn once per reason; float32 never does, nor
    does the emulation, where the reference rung is all there is."""
    import warnings
    f2 = fs.gpu.flash2
    assert f2._warn_reference("float16", "a reason under emulation") is None
    with fs.gpu.emulated(False):
        f2._WARNED.discard("a test reason")
        with pytest.warns(UserWarning, match="reference kernel.*a test reason"):
            f2._warn_reference("bfloat16", "a test reason")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            f2._warn_reference("bfloat16", "a test reason")      # once
            f2._warn_reference("float32", "another reason")      # not a fast dtype


# -- decoding over a KV cache: splitkv_tc.cu's tensor-core kernels, lane by lane ----------

@EMU
@given(KV.kvcache_problems(dtypes=DTYPES[:1] + DTYPES[3:], max_len=200))
def test_kvcache_matches_simulator(problem):
    with pytest.MonkeyPatch.context() as m:
        G.poison_outputs(m)
        KV.check_kvcache(problem)


def test_kvcache_strided_inputs():
    KV.check_strided_inputs()


@pytest.mark.parametrize("Nq,g", [(1, 8), (4, 4), (3, 8)])
def test_kvcache_tile_shapes(monkeypatch, Nq, g):
    G.poison_outputs(monkeypatch)
    plan = KV.check_kvcache(dict(dtype="float16", d=64, batch=1, Nq=Nq, kv_heads=2, g=g,
                                 page=16, lens=[600], Nnew=2, causal=True, splits=2, seed=g))
    assert plan.block_sizes[0] == fs.kernels.splitkv_rows(Nq * g)


def test_kvcache_bad_input(monkeypatch):
    KV.check_bad_input(monkeypatch)


def test_kvcache_no_cluster_in_the_emulation():
    """The emulation has no thread block clusters: the launcher merges through memory,
    and asking for a cluster is refused."""
    q = np.zeros((1, 1, 32, 64), np.float16)
    kc = np.zeros((1, 1024, 8, 64), np.float16)
    lens = np.array([1024], np.int32)
    assert not fs.gpu.kvcache_plan(q, kc, cache_seqlens=lens).cluster
    with pytest.raises(ValueError, match="emulation has no clusters"):
        fs.gpu.kvcache_plan(q, kc, cache_seqlens=lens, cluster=True)


# -- the emulator's warp collectives ----------------------------------------------------

WARP_KERNELS = r"""
#include "warp.cuh"
// out[t] = the sum over the warp of t's value, by butterfly shuffles
__global__ void warp_sum(const float* x, float* out) {
    float v = x[threadIdx.x];
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffff, v, off);
    out[threadIdx.x] = v;
}
// one m16n8k16 product, A (16×16) and B (16×8) as half, laid out as warp.cuh says
__global__ void one_mma(const __half* A, const __half* B, float* C) {
    const int lane = threadIdx.x, grp = lane >> 2, tig = lane & 3;
    auto pair = [](const __half* p) { unsigned u; memcpy(&u, p, 4); return u; };
    const unsigned a[4] = {pair(A + grp * 16 + 2 * tig), pair(A + (grp + 8) * 16 + 2 * tig),
                           pair(A + grp * 16 + 2 * tig + 8), pair(A + (grp + 8) * 16 + 2 * tig + 8)};
    __half bt[4] = {B[(2 * tig) * 8 + grp], B[(2 * tig + 1) * 8 + grp],
                    B[(2 * tig + 8) * 8 + grp], B[(2 * tig + 9) * 8 + grp]};
    unsigned b[2];
    memcpy(b, bt, 8);
    float c[4] = {0, 0, 0, 0};
    mma16816<__half>(c, a, b);
    C[grp * 8 + 2 * tig] = c[0]; C[grp * 8 + 2 * tig + 1] = c[1];
    C[(grp + 8) * 8 + 2 * tig] = c[2]; C[(grp + 8) * 8 + 2 * tig + 1] = c[3];
}
// a shuffle that half the warp never reaches
__global__ void divergent(float* out) {
    float v = 1.0f;
    if (threadIdx.x < 16) v = __shfl_xor_sync(0xffffffff, v, 1);
    out[threadIdx.x] = v;
}
"""


def _warp_module():
    from flashsim.gpu import _device, _emulate
    # the headers' digest in the source keys the build cache, as fs.gpu's own modules do
    code = WARP_KERNELS + f"\n// headers: {_device.headers_digest()}\n"
    return _emulate.RawModule(code, fs.gpu.compile_options(False),
                              ("warp_sum", "one_mma", "divergent"))


def test_warp_collectives_are_emulated_lane_by_lane():
    mod = _warp_module()
    rng = np.random.default_rng(0)
    x = rng.standard_normal(64).astype(np.float32)
    out = np.full(64, np.nan, np.float32)
    mod.get_function("warp_sum")((1,), (64,), (x, out))
    np.testing.assert_allclose(out, np.repeat([x[:32].sum(), x[32:].sum()], 32), rtol=1e-6)
    A = rng.standard_normal((16, 16)).astype(np.float16)
    B = rng.standard_normal((16, 8)).astype(np.float16)
    C = np.full((16, 8), np.nan, np.float32)
    mod.get_function("one_mma")((1,), (32,), (A, B, C))
    np.testing.assert_allclose(C, A.astype(np.float64) @ B.astype(np.float64), rtol=1e-5,
                               atol=1e-5)


def test_a_divergent_warp_collective_is_reported():
    out = np.zeros(32, np.float32)
    with pytest.raises(RuntimeError, match="warp collective"):
        _warp_module().get_function("divergent")((1,), (32,), (out,))


# head dims between the fast instances (64, 128, 256) and dv ≠ d: the instance above runs
# them, its columns past d and dv zeroed on chip and never stored; outputs to the dtype's
# rule and byte counts of the real d and dv, forward and backward (both dQ modes)
@pytest.mark.parametrize("d, dv, causal, Nq, Nk", [
    (40, 40, False, 70, 130), (96, 96, True, 129, 200), (32, 72, False, 33, 65),
    (112, 64, True, 150, 90), (8, 8, False, 17, 17), (128, 96, False, 64, 64),
    (256, 256, True, 80, 100), (192, 128, False, 70, 65), (200, 136, True, 33, 130)])
def test_tensor_core_rung_runs_head_dims_below_its_instances(d, dv, causal, Nq, Nk):
    rng = np.random.default_rng(d * 7 + dv)
    rnd = fs.precision.make_precision("kernel", "float16").io_round
    q = rnd(rng.standard_normal((1, 2, Nq, d))).astype(np.float64)
    k = rnd(rng.standard_normal((1, 1, Nk, d))).astype(np.float64)
    v = rnd(rng.standard_normal((1, 1, Nk, dv))).astype(np.float64)
    h = q.astype(np.float16)
    D = fs.kernels.head_dim_instance(d, dv)
    assert fs.gpu.block_sizes(h, v.astype(np.float16), kernel="tc") == fs.kernels.tc_blocks(
        D, 9, variant=D > min(d, dv))
    with pytest.MonkeyPatch.context() as m:
        G.poison_outputs(m)
        G.check_forward(q, k, v, "float16", causal, None, kernel="tc")
        G.check_backward(q, k, v, "float16", causal, None, kernel="tc")
        G.check_backward(q, k, v, "float16", causal, None, kernel="tc", deterministic=True)


def _tiled_index(P, Nq, d, D):
    """Where flash2_bwd_ws's threads put dQ_i's values in dQacc at instance D (the kernel's
    stores, not common.cuh's dq_tiled_at): thread u = 128·h + 32·warp + 4·g + tig of the two
    consumer warpgroups holds, in registers 4k + e of its m64n64 accumulator, row 16·warp +
    g + 8·(e ≥ 2) and column 8k + 2·tig + (e & 1) of its 64 × 64 block of the step, which
    is columns 64·h … of the step's 64 × 128 at D = 128 and rows 64·h … of its 128 × 64 at
    D = 64; it stores float4 k at float (k·256 + u)·4 of the step's block. (problem, row,
    column) and the flat index of each value in dQacc, for the rows below Nq and columns
    below d."""
    R = fs.kernels.dq_rows(D)
    Tr = -(-Nq // R)
    h, k, w, g, tig, e = np.indices((2, 8, 4, 8, 4, 4)).reshape(6, -1)
    u = 128 * h + 32 * w + 4 * g + tig
    r, c = 16 * w + g + 8 * (e >> 1), 8 * k + 2 * tig + (e & 1)
    if D == 128:
        c = c + 64 * h
    else:
        r = r + 64 * h
    at = (k * 256 + u) * 4 + e
    p, i = np.indices((P, Tr)).reshape(2, -1, 1)
    rows, cols = R * i + r, np.broadcast_to(c, (p.size, c.size))
    flat = (p * Tr + i) * fs.kernels.DQ_BLOCK + at
    keep = (rows < Nq) & (cols < d)
    return np.broadcast_to(p, rows.shape)[keep], rows[keep], cols[keep], flat[keep]


@pytest.mark.parametrize("Nq,d,D", [(150, 72, 128), (64, 128, 128), (1, 8, 128), (150, 56, 64),
                                    (64, 64, 64), (1, 8, 64), (129, 64, 64), (257, 40, 64)])
def test_the_tiled_dq_accumulator_is_zeroed_and_read_back_in_rows(Nq, d, D):
    """flash2_bwd_ws's dQacc lies in blocks of DQ_BLOCK fp32 per problem and step of
    dq_rows(D) rows (64 × 128 at D = 128, 128 × 64 at D = 64), in the order its threads hold
    dQ_i: the pre-pass zeroes every float of every block (tiled = D), and the post-pass
    reads row r, column c of dQ back from where the kernel's stores put it (dq_tiled_at
    against _tiled_index's mirror of those stores), rows past Nq and columns past d
    untouched."""
    from flashsim.gpu import _arrays as A, _device as dev
    cp, K = dev.cupy(), fs.kernels
    P, Tr = 3, -(-Nq // K.dq_rows(D))
    rng = np.random.default_rng(Nq + d)
    at = np.zeros(P * A.AT_NUM, np.int64)
    at[A.AT_dQ::A.AT_NUM] = np.arange(P) * Nq * d          # dQ dense (P, Nq, d)
    at[A.AT_O::A.AT_NUM] = at[A.AT_dO::A.AT_NUM] = np.arange(P) * Nq * d
    io = dev.counters(cp, False)
    acc = np.full((P, Tr, K.DQ_BLOCK), np.nan, np.float32)
    o = rng.standard_normal((P, Nq, d)).astype(np.float16)
    Dr = np.zeros((P, Nq), np.float32)
    name, Dp = "flash2_bwd_preprocess_tc", K.pre_instance(d, d)
    dev.launch(cp, dev.kernel(name, "float16", False, Dp), K.grid(name, Nq, Nq, 64, 64, P), 0,
               (o, o, at, Dr, acc, np.int32(Nq), np.int32(d), np.int32(d), np.int32(d),
                np.int32(d), np.int32(D), io), threads=K.threads(name, Dp, 90))
    assert not acc.any() and not np.isnan(acc).any()
    np.testing.assert_allclose(Dr, (o.astype(np.float32) ** 2).sum(-1), rtol=1e-3)
    dq = rng.standard_normal((P, Nq, d)).astype(np.float16)    # exact in fp32 and back
    acc[...] = np.nan
    p, r, c, flat = _tiled_index(P, Nq, d, D)
    assert len(np.unique(flat)) == len(flat) == P * Nq * d
    acc.reshape(-1)[flat] = dq[p, r, c]
    out = np.full((P, Nq, d), np.nan, np.float16)
    name = "flash2_bwd_postprocess"
    dev.launch(cp, dev.kernel(name, "float16", False), K.grid(name, Nq, Nq, 64, 64, P), 0,
               (acc, out, at, np.int32(Nq), np.int32(d), np.int32(d), np.int32(64),
                np.int32(D), io), threads=K.threads(name, d, 90))
    assert np.array_equal(out, dq)


class _TensorStandIn:
    """What flashsim.gpu reads of a PyTorch tensor on a GPU (its type's module, detach,
    cpu, numpy), without PyTorch."""
    __module__ = "torch"

    def __init__(self, values):
        self.values, self.dtype = np.asarray(values, np.float32), "torch.float32"

    def detach(self):
        return self

    def cpu(self):
        return _TensorStandIn(self.values)

    def numpy(self):
        return self.values


def test_alibi_slopes_held_by_a_framework_are_read_back_before_any_launch():
    """A model's ALiBi slopes are often a tensor on the GPU: fs.gpu.attention reads their
    values (as it reads cu_seqlens) and gives the result of the same slopes in NumPy; the
    wrong count still gets the simulator's ValueError."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((2, 3, 40, 16)).astype(np.float16) for _ in range(3))
    s = [0.5, 0.25, 0.125]
    out, lse = fs.gpu.attention(q, k, v, alibi_slopes=_TensorStandIn(s))
    ref, ref_lse = fs.gpu.attention(q, k, v, alibi_slopes=np.array(s))
    assert np.array_equal(out, ref) and np.array_equal(lse, ref_lse)
    with pytest.raises(ValueError, match="alibi_slopes must have shape"):
        fs.gpu.attention(q, k, v, alibi_slopes=_TensorStandIn(s[:2]))
