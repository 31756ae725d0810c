"""The CUDA side without a GPU: the sources compile for sm_80 and sm_90 with no spills,
the counters the kernels report map onto the simulator's tensor names, and flashsim.gpu
fails clearly where CuPy or a device is missing."""

import shutil

import pytest

import flashsim as fs
from flashsim import kernels
from flashsim.traffic import TENSOR_ORDER


def test_io_counters_name_simulator_tensors():
    counters = kernels.io_counters()
    assert len(counters) == len(set(counters))
    assert {t for t, _ in counters} <= set(TENSOR_ORDER)
    assert ("dQacc", "read") in counters and ("L", "write") in counters


def test_default_block_sizes_fit_the_shared_memory():
    for d in (1, 40, 64, 128, 256):
        for dtype in kernels.CUDA_TYPES:
            for backward, kernel in ((False, "flash2_fwd"), (True, "flash2_bwd_main")):
                Br, Bc = kernels.default_block_sizes(d, d, dtype, 227 * 1024, backward)
                assert kernels.smem_bytes(kernel, Br, Bc, d, d, dtype) <= 227 * 1024
    assert kernels.default_block_sizes(64, 64, "float16", 227 * 1024) == (64, 64)
    with pytest.raises(ValueError, match="no tile fits"):
        kernels.default_block_sizes(256, 256, "float64", 100)


def test_the_build_report_flags_serialised_warpgroup_mmas():
    """ptxas's C7511 advisory names the function whose wgmma it serialised: that instance's
    row says so, the others do not."""
    a, b = (i for i in kernels.instances("flash2_ws.cu") if i.kernel == "flash2_fwd_ws"
            and i.dtype == "bfloat16" and i.D == 128 and not i.varlen and i.variant in (True, False))
    log = "\n".join(
        f"ptxas info    : Compiling entry function '{i.mangled}vN2wg9TensorMapE' for 'sm_90a'\n"
        + (f"ptxas info    : (C7511) Potential Performance Loss: wgmma.mma_async instructions "
           f"are serialized due to insufficient register resources for the wgmma pipeline in "
           f"the function '{i.mangled}vN2wg9TensorMapE'\n" if i is a else "")
        + "ptxas info    : Used 168 registers, used 16 barriers, 128 bytes smem\n"
          "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" for i in (a, b))
    rows = kernels._parse_ptxas(log, "flash2_ws.cu", False)
    assert [(r.variant, r.wgmma_serialized) for r in rows] == [(a.variant, True), (b.variant, False)]
    assert "wgmma serialized" in kernels.format_build(rows, "sm_90").splitlines()[3]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_every_kernel_compiles_without_spills(arch, kernel_build):
    rows = kernel_build(arch)
    expected = {(i.kernel, i.dtype, i.D, i.variant, i.varlen, inst)
                for i in kernels.instances() for inst in (False, True)
                if kernels.source_arch(i.source, arch)
                and kernels.runs_on(i.kernel, int(arch[3:5]))}
    # reference: 4 kernels × 4 dtypes, flash1 2 × 4, standard 8 × 4, square 2 × 4; tc: the
    # backward's pre-pass × 2 dtypes × 3 head dims (64, 128, 256), the forward × 2 × 8 head
    # dims (32, 64, …, 256) and the backward's 2 kernels × 2 × 7 (all but 224), each plain,
    # softcap/ALiBi and varlen, and the forward's softcap alone at 8 + 7 (kernels.tc_cap); wg (sm_90a only), plain, softcap/ALiBi and varlen: the
    # forward × 2 dtypes × 8 head dims, and its softcap alone in bfloat16 at 7 (all but 64,
    # kernels.WG_FIXED_HEAD_DIMS) and float16 at 8 (WG_LAZY_HEAD_DIMS), the backward's 2 kernels × 2 × 7 (all but 96); the wg forward fed by
    # TMA (sm_90a only): d = 64, 96, 128 × 2, plain, softcap/ALiBi and the softcap alone
    # (kernels.CAP_ONLY), and bfloat16's lazy one at 96, 128 (LAZY_BF16), and its backward's 2
    # kernels at d = 64, 128 × 2, plain and softcap/ALiBi; decoding: 4 × 2 × 2 (the append, 3
    # tiles), and on sm_90 each tile in clusters of 3 sizes, 9 × 2 × 2
    assert len(expected) == 2 * (4 * 4 + 2 * 4 + 8 * 4 + 2 * 4 + (6 + 48 + 15 + 84)
                                 + (48 + 15 + 84 + 20 + 16 + 9 * 4 if arch == "sm_90" else 0) + 4 * 4)
    assert {(r.kernel, r.dtype, r.D, r.variant, r.varlen, r.instrumented)
            for r in rows} == expected
    assert all(r.registers > 0 for r in rows)
    # ptxas serialises the warpgroup MMAs of no kernel but the Hopper backward's fallback
    # head dims (their dK, dV of 160 and 224 columns fill the registers): a new one is a
    # regression, which no spill count shows
    assert {(r.kernel, r.D) for r in rows if r.wgmma_serialized} <= {
        (k, D) for k in ("flash2_bwd_wg", "flash2_bwd_wg_det") for D in (160, 224)}
    # neither build touches local memory: the instrumented kernels count their traffic
    # where registers are free, so the counters cost no spill either
    assert all(r.spill_stores == 0 and r.spill_loads == 0 and r.stack == 0 for r in rows)


def test_nvrtc_builds_the_reference_rung_as_the_launcher_does(tmp_path, monkeypatch):
    # the runtime's compiler, where a libnvrtc is found (pip install nvidia-cuda-nvrtc, or
    # FLASHSIM_NVRTC); one program per instance, its ptxas report parsed as nvcc's
    try:
        kernels.find_nvrtc()
    except FileNotFoundError:
        pytest.skip("no NVRTC library here (pip install nvidia-cuda-nvrtc)")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    rows = kernels.build("sm_90", source="flash2_ref.cu", instrumented=False, nvrtc=True)
    assert {(r.kernel, r.dtype) for r in rows} == {
        (k, dt) for k in kernels.SOURCES["flash2_ref.cu"] for dt in kernels.CUDA_TYPES}
    assert all(r.registers > 0 and r.stack == 0 and not r.instrumented for r in rows)
    # kept, then read back: the same rows
    assert kernels.build("sm_90", source="flash2_ref.cu", instrumented=False, nvrtc=True) == rows


def test_nvrtc_named_but_missing_says_so(monkeypatch):
    with pytest.raises(FileNotFoundError, match="no NVRTC library at /nowhere/libnvrtc.so"):
        kernels.build("sm_90", nvrtc="/nowhere/libnvrtc.so")
    monkeypatch.setenv("FLASHSIM_NVRTC", "/nowhere/libnvrtc.so.13")
    with pytest.raises(FileNotFoundError, match="no NVRTC library at"):
        kernels.find_nvrtc()


def test_a_kernel_built_with_local_memory_warns_and_fails_the_tests():
    # nvcc's builds are checked above; the NVRTC on a user's machine (or the test device)
    # may be another version, and its spill is seen only by the loaded kernel's attribute
    from flashsim.gpu import _device

    class Built:                     # what the loader gets back: a kernel with the attribute
        def __init__(self, n):
            self.local_size_bytes = n
    _device.check_local_memory(Built(0), "flash2_fwd_ws<__half, 128, false, 0>")
    with pytest.warns(fs.gpu.SpillWarning, match=r"flash2_fwd_ws<__half, 128.*\(instrumented\) "
                      r"uses 8 bytes of local memory"):
        _device.check_local_memory(Built(8), "flash2_fwd_ws<__half, 128, true, 0>", True)
    # the suite's configuration makes the warning an error, so a GPU test that loads such a
    # kernel fails
    import warnings
    with pytest.raises(fs.gpu.SpillWarning):
        warnings.warn("spilled", fs.gpu.SpillWarning)


def test_the_hopper_source_builds_for_sm_90a_only():
    assert kernels.source_arch("flash2_wg.cu", "sm_90") == "sm_90a"
    assert kernels.source_arch("flash2_wg.cu", "sm_90a") == "sm_90a"
    assert kernels.source_arch("flash2_wg.cu", "sm_80") is None
    assert kernels.source_arch("flash2_tc.cu", "sm_80") == "sm_80"


def test_build_rejects_a_bad_arch():
    with pytest.raises(ValueError, match="sm_80"):
        kernels.build("ampere")


@pytest.mark.skipif(fs.gpu.available(), reason="a GPU is visible here")
def test_gpu_functions_say_what_is_missing():
    with pytest.raises(fs.gpu.GPUUnavailableError, match=r"flashsim\[cuda1[23]\]|no CUDA device"):
        fs.gpu.attention([[1.0]], [[1.0]], [[1.0]])


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_the_launch_tables_registers_give_each_builds_occupancy(arch, kernel_build):
    """kernels.REGISTERS (read by the launch model) against a fresh build: for every fast
    instance, the CTAs per SM that its own register count allows at the tiles it runs are
    what the table's count allows, and the table never undercounts."""
    from flashsim.hardware import A100, H100
    hw, cc = (H100, 90) if arch == "sm_90" else (A100, 80)
    # flash1 and standard attention are outside the launch model (kernels.ALGORITHM_GRIDS)
    unmodeled = set(kernels.SOURCES["flash1_ref.cu"] + kernels.SOURCES["standard_ref.cu"]
                    + kernels.SOURCES["square_ref.cu"])
    assert {r.kernel for r in kernel_build(arch)} - set(kernels.REGISTERS[arch]) == unmodeled
    for r in kernel_build(arch):
        if r.instrumented or r.kernel in unmodeled:
            continue
        table = kernels.registers(r.kernel, r.D, cc)
        assert table >= r.registers, (r.kernel, r.dtype, r.D)
        d = r.D or 64
        if r.kernel in ("flash2_fwd_wg", "flash2_fwd_ws"):
            Br, Bc = kernels.WG_BLOCKS[d]
        elif r.kernel in ("flash2_fwd_tc",):
            Br, Bc = kernels.tc_blocks(d, cc // 10, r.variant)
        elif r.kernel in ("flash2_bwd_tc", "flash2_bwd_tc_det"):
            Br, Bc = kernels.tc_bwd_blocks(d, cc // 10)
        elif r.kernel in ("flash2_bwd_wg", "flash2_bwd_wg_det", "flash2_bwd_ws",
                          "flash2_bwd_ws_det"):
            Br, Bc = kernels.wg_blocks(d, backward=True)
        elif r.kernel.startswith("splitkv_fwd_tc_m"):     # …_m<Br>, …_m<Br>_cl<CL>
            Br, Bc = int(r.kernel.split("_m")[1].split("_")[0]), kernels.SPLITKV_BC
        else:
            Br, Bc = kernels.default_block_sizes(d, d, r.dtype, hw.smem_per_block,
                                                 r.kernel == "flash2_bwd_main")
        smem = kernels.smem_bytes(r.kernel, Br, Bc, d, d, r.dtype)
        threads = kernels.threads(r.kernel, d, cc)

        def occupancy(regs):
            return kernels.ctas_per_sm(threads=threads, registers=regs, smem=smem,
                                       smem_per_sm=hw.smem_per_sm)
        assert occupancy(table) == occupancy(r.registers), (r.kernel, r.dtype, r.D)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_the_build_cache_reuses_reports_until_a_source_changes(tmp_path, monkeypatch):
    """kernels.build keeps ptxas's report per compilation, keyed by the source and the
    headers it includes: a second build compiles nothing; an edit to a header it includes
    compiles again; an edit to another kernel's source or header does not."""
    import shutil as sh
    kdir = tmp_path / "kernels_cu"
    sh.copytree(kernels.kernel_dir(), kdir)
    monkeypatch.setattr(kernels, "kernel_dir", lambda: kdir)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cached = tmp_path / "cache" / "flashsim" / "build"
    first = kernels.build("sm_80", source="square_ref.cu", instrumented=False)
    n = len(list(cached.iterdir()))
    assert n == len(kernels.SOURCES["square_ref.cu"])
    calls = []
    real = kernels.subprocess.run
    monkeypatch.setattr(kernels.subprocess, "run",
                        lambda cmd, **kw: (calls.append(cmd), real(cmd, **kw))[1])
    assert kernels.build("sm_80", source="square_ref.cu", instrumented=False) == first
    assert not [c for c in calls if "-cubin" in c]          # no compilation ran
    (kdir / "common.cuh").write_text((kdir / "common.cuh").read_text() + "\n// edited\n")
    assert kernels.build("sm_80", source="square_ref.cu", instrumented=False) == first
    assert len([c for c in calls if "-cubin" in c]) == n
    assert len(list(cached.iterdir())) == 2 * n
    for other in ("flash2_tc.cu", "wgmma.cuh"):              # not square_ref.cu's
        (kdir / other).write_text((kdir / other).read_text() + "\n// edited\n")
    assert kernels.build("sm_80", source="square_ref.cu", instrumented=False) == first
    assert len([c for c in calls if "-cubin" in c]) == n


def test_a_source_depends_on_the_headers_it_includes():
    inc = {src: kernels.includes(src) for src in kernels.SOURCES}
    assert inc["square_ref.cu"] == ["common.cuh", "square_ref.cu"]
    # through a chain of headers: flash2_ws.cu → wg_bwd.cuh → wgmma.cuh → tensor_core.cuh
    assert inc["flash2_ws.cu"] == ["common.cuh", "flash2_ws.cu", "tensor_core.cuh",
                                   "wg_bwd.cuh", "wgmma.cuh"]
    assert "wgmma.cuh" not in inc["flash2_tc.cu"] and "warp.cuh" in inc["flash2_tc.cu"]
    for src, names in inc.items():                # every source includes the common header
        assert src in names and "common.cuh" in names


def test_the_gpu_build_cache_key_holds_the_headers_a_source_includes(tmp_path, monkeypatch):
    # flashsim.gpu keys a source's NVRTC builds by its text and this digest: an edit to a
    # header it includes (through another) must change it, one to any other header not
    from flashsim.gpu import _device
    (tmp_path / "a.cu").write_text('#include "x.cuh"\n')
    (tmp_path / "x.cuh").write_text('#include "y.cuh"\n')
    (tmp_path / "y.cuh").write_text("// y\n")
    (tmp_path / "z.cuh").write_text("// z\n")
    monkeypatch.setattr(kernels, "kernel_dir", lambda: tmp_path)
    a, every = _device.headers_digest("a.cu"), _device.headers_digest()
    (tmp_path / "z.cuh").write_text("// z, edited\n")
    assert _device.headers_digest("a.cu") == a and _device.headers_digest() != every
    (tmp_path / "y.cuh").write_text("// y, edited\n")
    assert _device.headers_digest("a.cu") != a


def test_each_rung_picks_its_own_instance_of_a_head_dim():
    # the tc backward has D = 160 and 192 instances on 9.0; on Ampere, whose A100 cannot
    # hold their steps of 64, D = 192 takes steps of 32 and runs d = 160 too; d = 224 runs
    # D = 256 (its own instance's varlen build spilled)
    assert kernels.instance_dim("tc", 160, 160, backward=True, cc_major=9) == 160
    assert kernels.instance_dim("tc", 168, 168, backward=True, cc_major=9) == 192
    assert kernels.instance_dim("tc", 192, 128, backward=True, cc_major=9) == 192
    assert kernels.instance_dim("tc", 160, 160, backward=True, cc_major=8) == 192
    assert kernels.instance_dim("tc", 192, 192, backward=True, cc_major=8) == 192
    assert kernels.instance_dim("tc", 200, 192, backward=True, cc_major=8) == 256
    assert kernels.tc_bwd_blocks(192, 8) == (32, 64) and kernels.tc_bwd_blocks(192, 9) == (64, 64)
    assert kernels.instance_dim("tc", 200, 200, backward=True, cc_major=9) == 256
    assert kernels.instance_dim("tc", 96, 88, backward=True, cc_major=8) == 96
    # the forwards have every instance; the pre-pass (rows reduced by shuffles: a power
    # of two) keeps 64, 128, 256
    assert kernels.instance_dim("tc", 160, 160) == 160 and kernels.instance_dim("tc", 24, 8) == 32
    assert kernels.instance_dim("tc", 200, 216) == 224
    assert kernels.pre_instance(160, 160) == 256 and kernels.pre_instance(96, 96) == 128
    assert kernels.instance_dim("wg", 160, 160) == 160
    assert kernels.instance_dim("wg", 200, 128) == 224
    assert kernels.instance_dim("wg", 160, 160, backward=True) == 160   # step_wide
    assert kernels.instance_dim("wg", 32, 24, backward=True) == 32
    assert kernels.instance_dim("wg", 40, 32, backward=True) == 64
    assert kernels.instance_dim("wg", 96, 96, backward=True) == 128     # no 96 backward
    assert kernels.instance_dim("wg", 192, 128, backward=True) == 192
    assert kernels.instance_dim("wg", 232, 128, backward=True) == 256
    assert kernels.instance_dim("wg", 264, 264, backward=True) is None
    assert kernels.instance_dim("tc", 136, 136, backward=True) == 160
    assert kernels.padded(136, 136, 160) and not kernels.padded(192, 192, 192)
    assert kernels.padded(152, 152)               # below the forward's 160
    # shared rows of the tc rung: D rounded up to 64 halves
    assert [kernels.tc_row(D) for D in (32, 64, 96, 160, 224)] == [64, 64, 128, 192, 256]
    # an A100 (166,912 bytes a CTA): the 192 instance's sm_90 steps of 64 would fill that
    # to the byte before its static shared memory; its steps of 32 take 109,056
    assert kernels.tc_supports(192, 192, "float16", 80, 166912, backward=True)
    assert kernels.smem_bytes("flash2_bwd_tc", *kernels.TC_BWD_BLOCKS[192], 192, 192,
                              "float16") == 166912
    assert kernels.smem_bytes("flash2_bwd_tc", *kernels.TC_BWD_BLOCKS_AMPERE[192], 192, 192,
                              "float16") == 109056


def test_the_copy_engine_forward_runs_where_its_tiles_keep_the_bits():
    """flash2_fwd_ws: D ∈ WS_HEAD_DIMS, forward, head dims below D too (the copy engine
    zero-fills the columns past them); softcap/ALiBi in tiles of flash2_fwd_wg's keys (so
    a varlen batch and its sequences agree bit for bit), 192 × 64 at D = 64."""
    for D in kernels.WS_HEAD_DIMS:
        assert kernels.ws_runs(D, D, D)
        assert kernels.ws_runs(D, D, D, backward=True) == (D in kernels.WS_BWD_HEAD_DIMS)
        # the softcap/ALiBi instance takes flash2_fwd_wg's keys a tile at every D
        assert kernels.ws_runs(D, D, D, variant=True)
        assert kernels.ws_blocks(D, True)[1] == kernels.WG_BLOCKS[D][1]
        assert kernels.ws_blocks(D, True)[0] == kernels.WS_BLOCKS[D][0]   # its rows: threads
    assert kernels.ws_runs(56, 56, 64) and kernels.ws_runs(64, 32, 64)
    assert kernels.ws_runs(80, 80, 96) and kernels.ws_runs(80, 80, 96, variant=True)
    assert kernels.ws_runs(112, 64, 128) and kernels.ws_runs(48, 48, 64, variant=True)
    assert not kernels.ws_runs(80, 80, 96, backward=True)
    assert not kernels.ws_runs(32, 32, 32) and not kernels.ws_runs(256, 256, 256)
    assert kernels.wg_supports(64, 64, "float16", 90, 227 * 1024, (192, 128))
    assert not kernels.wg_supports(64, 64, "float16", 90, 227 * 1024, (192, 128), variant=True)
    assert kernels.wg_supports(64, 64, "float16", 90, 227 * 1024, (192, 64), variant=True)
    assert not kernels.wg_supports(64, 64, "float16", 90, 227 * 1024, (192, 64))
    assert not kernels.wg_supports(64, 64, "float16", 90, 227 * 1024, (128, 128))
    # the backward fed by TMA at d = 64 and 128 (softcap/ALiBi too): flash2_bwd_wg's tiles
    assert kernels.WS_BWD_HEAD_DIMS == (64, 128)
    assert kernels.ws_runs(128, 128, 128, backward=True, variant=True)
    assert kernels.ws_runs(64, 64, 64, backward=True, variant=True)
    assert kernels.ws_runs(120, 120, 128, backward=True)          # below D too
    assert kernels.ws_runs(112, 64, 128, backward=True) and kernels.ws_runs(48, 40, 64, backward=True)
    assert not kernels.ws_runs(32, 32, 32, backward=True) and not kernels.ws_runs(96, 96, 96, backward=True)
    assert kernels.smem_bytes("flash2_bwd_ws", 64, 128, 128, 128, "float16") <= 227 * 1024
    assert kernels.smem_bytes("flash2_bwd_ws", 128, 128, 64, 64, "float16") <= 227 * 1024
    # a producer warpgroup and one consumer per 64 rows: three at d = 64, two at 96 and 128
    assert [kernels.threads("flash2_fwd_ws", D, 90) for D in (64, 96, 128)] == [512, 384, 384]
    assert kernels.wg_supports(64, 64, "float16", 90, 227 * 1024, (128, 64), variant=True)


def test_a_softcap_alone_takes_the_copy_engine_forwards_own_instance():
    """kernels.cap_only: a softcap runs flash2_fwd_ws's CAP_ONLY instance, in float16 at
    any softcap without ALiBi (a lazy max) and in bfloat16, with ALiBi or without, where
    its fixed max leaves every P ≤ 2^CAP_HEADROOM (softcap ≤ 54.4); ALiBi in float16,
    with a softcap or without, runs there (lazily, the diagonal key tile first) at the
    instances whose tiles are square (96, 128), not at 64 (192 × 64) or unnamed; no
    softcap in bfloat16, or other dtypes, do not."""
    cap_only = kernels.cap_only
    assert cap_only("bfloat16", 30.0, None) and cap_only("bfloat16", 54.4, None)
    assert not cap_only("bfloat16", 54.5, None)
    assert cap_only("float16", 0.5, None) and cap_only("float16", 1e4, None)
    for dtype in ("float16", "bfloat16"):
        assert not cap_only(dtype, None, None) and not cap_only(dtype, None, None, 128)
    assert not cap_only("bfloat16", None, [0.1, 0.2]) and not cap_only("bfloat16", None, [0.1], 128)
    assert not cap_only("float16", 30.0, [0.1, 0.2]) and not cap_only("float16", None, [0.1, 0.2])
    for D in (96, 128):
        assert kernels.diagonal_first(D)
        assert cap_only("float16", 30.0, [0.1, 0.2], D) and cap_only("float16", None, [0.1], D)
    assert not kernels.diagonal_first(64) and not kernels.diagonal_first(256)
    assert not cap_only("float16", 30.0, [0.1, 0.2], 64) and not cap_only("float16", None, [0.1], 64)
    assert kernels.ws_blocks(64, True)[0] != kernels.ws_blocks(64, True)[1]
    assert cap_only("bfloat16", 30.0, [0.1, -0.2]) and not cap_only("bfloat16", 54.5, [0.1])
    assert not cap_only("float32", 30.0, None) and not cap_only("float32", 30.0, [0.1], 128)
    # the bound: 2C − 125 ≤ CAP_HEADROOM at c = 54.4, C = c·log2 e
    import math
    assert 2 * 54.4 * math.log2(math.e) - 125 <= kernels.CAP_HEADROOM < 2 * 54.5 * math.log2(math.e) - 125
    D_of = {(i.dtype, i.D) for i in kernels.instances("flash2_ws.cu")
            if i.kernel == "flash2_fwd_ws" and i.variant == kernels.CAP_ONLY}
    assert D_of == {(t, D) for t in ("float16", "bfloat16") for D in kernels.WS_HEAD_DIMS}
    # the cp.async forward's: bfloat16 (the fixed max) at every D but 64, float16 (the lazy
    # one, without ALiBi) at every D, no varlen one
    wg = [i for i in kernels.instances("flash2_wg.cu")
          if i.kernel == "flash2_fwd_wg" and i.variant == kernels.CAP_ONLY]
    assert {(i.dtype, i.D) for i in wg} == (
        {("bfloat16", D) for D in kernels.WG_FIXED_HEAD_DIMS}
        | {("float16", D) for D in kernels.WG_HEAD_DIMS})
    assert not any(i.varlen for i in wg) and 64 not in kernels.WG_FIXED_HEAD_DIMS
    assert set(kernels.WG_FIXED_HEAD_DIMS) == set(kernels.WG_HEAD_DIMS) - {64}
    assert all(kernels.wg_cap("bfloat16", D) != (D == 64) for D in kernels.WG_HEAD_DIMS)
    assert all(kernels.wg_cap("float16", D) for D in kernels.WG_HEAD_DIMS)
    assert not any(kernels.wg_cap("float16", D, [0.1]) for D in kernels.WG_HEAD_DIMS)
    assert all(kernels.wg_cap("bfloat16", D, [0.1]) for D in kernels.WG_FIXED_HEAD_DIMS)
    assert not kernels.wg_cap("float32", 128)
    # the mma.sync forward's: bfloat16 (the fixed max) at every D, float16 (the lazy one,
    # without ALiBi) at every D but 32, no varlen one
    tc = [i for i in kernels.instances("flash2_tc.cu")
          if i.kernel == "flash2_fwd_tc" and i.variant == kernels.CAP_ONLY]
    assert {(i.dtype, i.D) for i in tc} == (
        {("bfloat16", D) for D in kernels.TC_HEAD_DIMS}
        | {("float16", D) for D in kernels.TC_LAZY_HEAD_DIMS})
    assert set(kernels.TC_LAZY_HEAD_DIMS) == set(kernels.TC_HEAD_DIMS) - {32}
    assert not any(i.varlen for i in tc)
    assert all(i.expr.endswith(", true, false, true>") for i in tc)
    # flash2_fwd_ws's MAX argument: 1 (fixed) in bfloat16's softcap instance, 2 (lazy) in
    # float16's
    ws = [i for i in kernels.instances("flash2_ws.cu")
          if i.kernel == "flash2_fwd_ws" and i.variant == kernels.CAP_ONLY]
    assert all(i.expr.endswith(", true, 1>" if i.dtype == "bfloat16" else ", true, 2>") for i in ws)
    assert all(kernels.tc_cap("float16", D) != (D == 32) for D in kernels.TC_HEAD_DIMS)
    assert not any(kernels.tc_cap("float16", D, [0.1]) for D in kernels.TC_HEAD_DIMS)
    assert all(kernels.tc_cap("bfloat16", D, [0.1]) for D in kernels.TC_HEAD_DIMS)
    assert not kernels.tc_cap("float32", 128)


def test_the_copy_engine_forwards_banded_order_takes_chunks_of_problems_that_fit_l2():
    """Under a band flash2_fwd_ws hands out its tiles heaviest first across a chunk of
    problems whose K and V fit WS_CHUNK_BYTES; without a band, or where one problem's K and
    V fill it, a chunk is one problem (the grid's own order)."""
    chunk = kernels.ws_chunk
    assert chunk(256, 2048, 64, 64, banded=False) == 1
    kv = lambda N, d: N * 2 * d * 2                          # K and V of one problem, bytes
    for P, N, d in ((256, 2048, 64), (64, 4096, 128), (16, 16384, 128), (3, 512, 64)):
        g = chunk(P, N, d, d, banded=True)
        assert 1 <= g <= P
        assert g == P or g * kv(N, d) <= kernels.WS_CHUNK_BYTES < (g + 1) * kv(N, d)
    assert chunk(64, 4096, 128, 128, banded=True) == kernels.WS_CHUNK_BYTES // kv(4096, 128) >= 2
    assert chunk(16, 1 << 20, 128, 128, banded=True) == 1    # one problem's K, V past it
    assert chunk(3, 512, 64, 64, banded=True) == 3           # every problem in one chunk
    assert chunk(8, 4096, 128, 64, banded=True) == kernels.WS_CHUNK_BYTES // (4096 * 192 * 2)


@pytest.mark.parametrize("nx,P,chunk", [(3, 5, 2), (8, 6, 4), (5, 7, 1), (4, 3, 3), (1, 9, 4)])
def test_the_copy_engine_order_takes_every_tile_once_in_chunks_of_problems(nx, P, chunk):
    """kernels.ws_order: every (x, p) once; with chunk = 1 the grid's order; otherwise a
    first chunk of the remainder (or a whole one), and within each chunk x ascending, its
    problems in turn."""
    x, p = kernels.ws_order(nx, P, chunk)
    assert sorted(zip(x.tolist(), p.tolist())) == [(a, b) for a in range(nx) for b in range(P)]
    if chunk == 1:
        assert x.tolist() == [t % nx for t in range(nx * P)]
        assert p.tolist() == [t // nx for t in range(nx * P)]
    first = P % chunk or chunk
    bounds = [0, first] + list(range(first + chunk, P + 1, chunk))
    at = 0
    for lo, hi in zip(bounds, bounds[1:]):
        g = hi - lo
        assert x[at:at + g * nx].tolist() == [t // g for t in range(g * nx)]
        assert p[at:at + g * nx].tolist() == [lo + t % g for t in range(g * nx)]
        at += g * nx
    assert at == nx * P


def test_the_copy_engine_forward_walks_tiles_on_one_cta_per_sm():
    """flash2_fwd_ws: one CTA per SM, each walking tiles (in a fixed order without a band,
    from a counter under one), or one per tile where there are fewer tiles than SMs; a
    walking CTA holds Q_i in two slots, and its shared memory still fits an SM at every
    instance (the launch model sizes its occupancy by the walking one)."""
    assert kernels.ws_forward_ctas(2048, 132) == 132
    assert kernels.ws_forward_ctas(133, 132) == 132
    assert kernels.ws_forward_ctas(18, 132) == 18
    for D in kernels.WS_HEAD_DIMS:
        Br, Bc = kernels.WS_BLOCKS[D]
        one, two = (kernels.ws_forward_smem(Br, Bc, D, walking=w) for w in (False, True))
        assert two - one == Br * D * 2                       # Q_i's second slot
        assert kernels.smem_bytes("flash2_fwd_ws", Br, Bc, D, D, "float16") == two
        assert two + 96 <= 227 * 1024                        # and the kernel's mbarriers


def test_bfloat16s_alibi_takes_the_copy_engine_forwards_lazy_instance():
    """kernels.ws_lazy: in bfloat16, ALiBi alone and a softcap past the fixed max's bound
    (with ALiBi or without) run flash2_fwd_ws's lazy instance (LAZY_BF16, MAX = 2) at the
    instances whose tiles are square (96, 128); what the softcap instance takes (cap_only),
    float16, no variant and D = 64 do not."""
    ws_lazy = kernels.ws_lazy
    for D in (96, 128):
        assert ws_lazy("bfloat16", None, [0.1, -0.2], D)
        assert ws_lazy("bfloat16", 54.5, None, D) and ws_lazy("bfloat16", 100.0, [0.1], D)
        assert not ws_lazy("bfloat16", 30.0, None, D) and not ws_lazy("bfloat16", 30.0, [0.1], D)
        assert not ws_lazy("bfloat16", None, None, D)
        assert not ws_lazy("float16", None, [0.1], D) and not ws_lazy("float16", 100.0, None, D)
    assert not ws_lazy("bfloat16", None, [0.1], 64) and not ws_lazy("bfloat16", None, [0.1])
    lazy = [i for i in kernels.instances("flash2_ws.cu")
            if i.kernel == "flash2_fwd_ws" and i.variant == kernels.LAZY_BF16]
    assert {(i.dtype, i.D) for i in lazy} == {("bfloat16", D) for D in kernels.WS_HEAD_DIMS
                                             if kernels.diagonal_first(D)} == {("bfloat16", 96), ("bfloat16", 128)}
    assert all(i.expr == f"flash2_fwd_ws<__nv_bfloat16, {i.D}, true, 2>" for i in lazy)
    assert all(i.mangled == f"_Z13flash2_fwd_wsI13__nv_bfloat16Li{i.D}ELb1ELi2EE" for i in lazy)
