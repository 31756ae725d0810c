"""The analysis scripts (smoke tests at --quick sizes, run in-process), the hardware
presets, and `flashsim sweep --backward / --algorithms`."""

import csv
import dataclasses
import importlib.util
import json
import pathlib
import sys

import pytest

import flashsim as fs
from flashsim import hardware
from flashsim.cli import main as cli_main

ANALYSIS = pathlib.Path(__file__).resolve().parent.parent / "analysis"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def load(name):
    """Import analysis/<name>.py as a module (its `import _common` needs analysis/ on
    sys.path, as when it runs as a script)."""
    if str(ANALYSIS) not in sys.path:
        sys.path.insert(0, str(ANALYSIS))
    spec = importlib.util.spec_from_file_location(f"analysis_{name}", ANALYSIS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def has_matplotlib():
    try:
        import matplotlib  # noqa: F401
        return True
    except ImportError:
        return False


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# -- flashsim.hardware --------------------------------------------------------------------

def test_ridge_points():
    # peak dense fp16 tensor-core FLOP/s ÷ peak HBM bytes/s
    assert hardware.A100.ridge == pytest.approx(312e12 / 2.039e12)
    assert hardware.A100.ridge == pytest.approx(153.0, abs=0.1)
    assert hardware.H100.ridge == pytest.approx(989.4e12 / 3.35e12)
    assert hardware.H100.ridge == pytest.approx(295.3, abs=0.1)
    assert hardware.H200.ridge == pytest.approx(989.4e12 / 4.8e12)
    assert hardware.H200.ridge == pytest.approx(206.1, abs=0.1)


def test_presets():
    assert hardware.PRESETS == {"A100": hardware.A100, "H100": hardware.H100,
                                "H200": hardware.H200}
    assert hardware.A100.smem_per_sm == 164 * 1024 and hardware.A100.l1_smem_per_sm == 192 * 1024
    for g in (hardware.H100, hardware.H200):
        assert g.smem_per_sm == 228 * 1024 and g.l1_smem_per_sm == 256 * 1024
        assert g.num_sms == 132 and g.peak_flops == 989.4e12
    assert hardware.A100.num_sms == 108
    for g in hardware.PRESETS.values():
        assert "datasheet" in g.source and g.smem_per_block < g.smem_per_sm <= g.l1_smem_per_sm
        assert g.l2_bytes > 0
        assert g.bound(g.ridge * 0.99) == "memory" and g.bound(g.ridge) == "compute"
    assert "80GB" in hardware.A100.name and "2,039" in hardware.A100.source


def test_presets_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        hardware.H100.peak_flops = 1.0


# -- analysis scripts ----------------------------------------------------------------------

def test_arithmetic_intensity(tmp_path):
    mod = load("arithmetic_intensity")
    assert mod.main(["--quick", "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "arithmetic_intensity.csv")
    # N ∈ {256, 1024}, d = 64; QKᵀ and standard against 3 GPUs, flash2 at each GPU's SRAM
    assert len(rows) == 2 * (3 + 3 + 3)
    for r in rows:
        N, d = int(r["N"]), int(r["d"])
        gpu = hardware.PRESETS[r["gpu"]]
        if r["kernel"] == "S=QK^T":
            want = 2 * N * N * d / ((2 * N * d + N * N) * 2)
        elif r["kernel"] == "standard":
            want = 4 * N * N * d / fs.count("standard", Nq=N, Nk=N, d=d).total_bytes
        else:
            assert int(r["sram_bytes"]) == gpu.smem_per_sm
            want = 4 * N * N * d / fs.count("flash2", Nq=N, Nk=N, d=d,
                                            sram_bytes=gpu.smem_per_sm).total_bytes
        assert float(r["intensity_flop_per_byte"]) == pytest.approx(want, abs=1e-3)
        assert r["bound"] == ("compute" if want >= gpu.ridge else "memory")
    md = (tmp_path / "arithmetic_intensity.md").read_text()
    assert "| 256 | 64 |" in md and "| 1k | 64 |" in md
    assert "ridge" in md and "153.0" in md and "295.3" in md and "206.1" in md


def test_softmax_max(tmp_path):
    """analysis/softmax_max.py: each rule's O error against float64 in the kernels'
    precision, with ALiBi or without; the rules the Hopper softcap instance runs stay
    within a few times the online one's, and float16 under a fixed max does not."""
    mod = load("softmax_max")
    assert mod.main(["--quick", "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "softmax_max.csv")
    # 2 dtypes × softcap 30 × scales 1, 3 × ALiBi or not × 3 rules
    assert len(rows) == 2 * 1 * 2 * 2 * 3
    by = {(r["dtype"], float(r["logit_scale"]), r["alibi"] == "True", r["rule"]): r for r in rows}
    runs = {("bfloat16", False): "fixed", ("float16", False): "lazy",
            ("bfloat16", True): "fixed", ("float16", True): "lazy"}   # d = 128
    for (dtype, scale, alibi, rule), r in by.items():
        assert (r["kernel_runs_it"] == "True") == (rule == runs[(dtype, alibi)])
        err = float(r["max_err"])
        online = float(by[(dtype, scale, alibi, "online")]["max_err"])
        if rule != "online" and (r["kernel_runs_it"] == "True" or rule == "lazy"):
            assert 0 < err <= 3 * online and float(r["max_lse_err"]) < 1e-4
    for alibi in (False, True):
        assert float(by[("float16", 1.0, alibi, "fixed")]["max_err"]) > \
            100 * float(by[("float16", 1.0, alibi, "online")]["max_err"])
    md = (tmp_path / "softmax_max.md").read_text()
    assert "| bfloat16 | 30 | 3 | no | **fixed** |" in md and "| float16 | 30 | 3 | no | **lazy** |" in md
    assert "| bfloat16 | 30 | 3 | yes | **fixed** |" in md and "| float16 | 30 | 3 | yes | **lazy** |" in md


def test_traffic_vs_sram(tmp_path):
    mod = load("traffic_vs_sram")
    code = mod.main(["--quick", "--out", str(tmp_path)])
    rows = read_csv(tmp_path / "traffic_vs_sram.csv")
    N, d = 1024, 128
    Ms = [int(r["M_elements"]) for r in rows]
    assert d * d in Ms and Ms == sorted(Ms) and Ms[-1] == N * d
    by = {int(r["M_elements"]): r for r in rows}
    r = by[d * d]
    assert int(r["fwd_flash2"]) == fs.count("flash2", Nq=N, Nk=N, d=d,
                                            sram_bytes=2 * d * d).total_bytes
    assert int(r["fwd_square"]) == fs.count("square", Nq=N, Nk=N, d=d,
                                            sram_bytes=2 * d * d).total_bytes
    assert int(r["bwd_flash1"]) == fs.count_backward("flash1", Nq=N, Nk=N, d=d,
                                                     sram_bytes=2 * d * d).total_bytes
    # the smallest SRAM sizes fit square tiles but no flash tile: skipped, not failed
    assert by[Ms[0]]["fwd_flash2"] == "" and by[Ms[0]]["fwd_square"] != ""
    # square beats flash2 well below d², loses well above
    M_lo, M_hi = d * d // 4, 4 * d * d
    assert int(by[M_lo]["fwd_square"]) < int(by[M_lo]["fwd_flash2"])
    assert int(by[M_hi]["fwd_square"]) > int(by[M_hi]["fwd_flash2"])
    if has_matplotlib():
        assert code == 0
        assert (tmp_path / "traffic_vs_sram.png").read_bytes()[:8] == PNG_MAGIC
    else:
        assert code == 2


def test_plotting_script_without_matplotlib(tmp_path, monkeypatch, capsys):
    mod = load("fig2_middle")
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # import now raises ImportError
    assert mod.main(["--quick", "--out", str(tmp_path)]) == 2
    assert 'pip install "flashsim[analysis]"' in capsys.readouterr().err
    assert (tmp_path / "fig2_middle.json").exists() and not (tmp_path / "fig2_middle.png").exists()


def test_fig2_left(tmp_path, capsys):
    mod = load("fig2_left")
    assert mod.main(["--quick", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "fig2_left.json").read_text())
    rows = {r["algorithm"]: r for r in data["rows"]}
    assert set(rows) == {"standard", "flash1", "flash2"}
    kw = dict(Nq=1024, Nk=1024, d=64, batch_shape=(2, 16))
    for a, r in rows.items():
        sram = None if a == "standard" else "100KiB"
        want = fs.count(a, sram_bytes=sram, **kw).total_bytes \
            + fs.count_backward(a, sram_bytes=sram, **kw).total_bytes
        assert r["hbm_gb"] == pytest.approx(want / 1e9)
    # matmul FLOPs: forward 4·N²·d per head; backward 8·N²·d (standard), 10·N²·d (flash)
    assert rows["standard"]["gflops"] == pytest.approx(12 * 1024**2 * 64 * 32 / 1e9)
    assert rows["flash2"]["gflops"] == pytest.approx(14 * 1024**2 * 64 * 32 / 1e9)
    md = (tmp_path / "fig2_left.md").read_text()
    assert "standard (flashsim)" in md and "flash1 (flashsim)" in md
    assert "| 66.6 |" in md and "| 75.2 |" in md and "41.7" in md and "7.3" in md
    if not fs.gpu.available():
        assert "needs a GPU" in md and data["gpu_timing_ms"] is None
        assert "runtime column needs" in capsys.readouterr().out


def test_fig2_middle(tmp_path):
    mod = load("fig2_middle")
    code = mod.main(["--quick", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "fig2_middle.json").read_text())
    series = {}
    for r in data["rows"]:
        series.setdefault(r["series"], []).append(r)
        assert r["hbm_bytes"] == fs.count(r["algorithm"], Nq=1024, Nk=1024, d=64,
                                          batch_shape=(2, 16),
                                          block_sizes=(r["Br"], r["Bc"])).total_bytes
    assert [r["B"] for r in series["flash1"]] == [64, 128, 256, 512]
    assert all(r["Br"] == 64 for r in series["flash1"])            # Br = min(B, d)
    assert all(r["Bc"] == 64 for r in series["flash2"])            # Bc = min(B, d)
    for name in ("flash1", "flash2"):                               # traffic falls with B
        gb = [r["hbm_bytes"] for r in series[name]]
        assert gb == sorted(gb, reverse=True) and gb[0] > gb[-1]
    assert len({r["hbm_bytes"] for r in series["flash2_bc"]}) == 1  # Bc does not matter
    md = (tmp_path / "fig2_middle.md").read_text()
    assert "| 512 | 64×512 |" in md
    if has_matplotlib():
        assert code == 0
        assert (tmp_path / "fig2_middle.png").read_bytes()[:8] == PNG_MAGIC


# -- flashsim sweep --backward / --algorithms ----------------------------------------------

def test_sweep_backward_csv(capsys, tmp_path):
    path = tmp_path / "bwd.csv"
    code = cli_main(["sweep", "--backward", "--seq", "512", "--head-dim", "32", "--causal",
                     "--min", "4KiB", "--max", "64KiB", "--points", "5", "--csv", str(path)])
    out = capsys.readouterr().out
    assert code == 0 and "backward" in out
    rows = read_csv(path)
    assert len(rows) == 5
    for r in rows:
        M = int(r["sram_bytes"])
        for a in ("standard", "flash1", "flash2"):
            want = fs.count_backward(a, Nq=512, Nk=512, d=32, sram_bytes=M, causal=True)
            assert int(r[f"{a}_bytes"]) == want.total_bytes


def test_sweep_square_forward(capsys, tmp_path):
    path = tmp_path / "sq.csv"
    code = cli_main(["sweep", "--seq", "512", "--head-dim", "64", "--algorithms",
                     "flash2,square", "--min", "256B", "--max", "64KiB", "--points", "4",
                     "--csv", str(path)])
    out = capsys.readouterr().out
    assert code == 0
    assert "square" in out and "square Br×Bc" in out and "standard" not in out.split("\n")[3]
    rows = read_csv(path)
    assert list(rows[0]) == ["sram_bytes", "flash2_bytes", "square_bytes", "flash2_Br",
                             "flash2_Bc", "square_Br", "square_Bc"]
    assert rows[0]["flash2_bytes"] == "" and rows[0]["square_bytes"] != ""   # 256 B: square only
    for r in rows:
        M = int(r["sram_bytes"])
        assert int(r["square_bytes"]) == fs.count("square", Nq=512, Nk=512, d=64,
                                                  sram_bytes=M).total_bytes


@pytest.mark.parametrize("argv", [
    ["sweep", "--backward", "--algorithms", "square"],
    ["sweep", "--algorithms", "flash3"],
    ["sweep", "--algorithms", ","],
])
def test_sweep_bad_algorithms(capsys, argv):
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("flashsim: error: ") and "Traceback" not in err


def test_roofline_from_the_committed_benchmark(tmp_path):
    mod = load("roofline")
    assert mod.main(["--out", str(tmp_path)]) in (0, 2)   # 2: figure skipped, no matplotlib
    text = (tmp_path / "roofline.md").read_text()
    assert "flashsim-tc" in text and "sdpa-flash" in text and "ridge" in text
    bench = json.load(open(ANALYSIS / "out" / "bench" / "bench.json"))
    tc = [r for r in bench["rows"] if r["impl"] == "flashsim-tc" and r["fwd_ms"]]
    assert text.count("| flashsim-tc |") == len(tc)
    heads = json.load(open(ANALYSIS / "out" / "bench" / "head_dims.json"))
    auto = [r for r in heads["rows"] if r["impl"] == "flashsim-auto" and r["fwd_ms"]]
    assert text.count("| heads | flashsim-auto |") == len(auto) > 0
    # every head dim of the grid has its Hopper tiles, so an HBM-model intensity
    assert not [line for line in text.splitlines()
                if line.startswith("| heads | flashsim-auto |") and "| — |" in line]
    if has_matplotlib():
        assert (tmp_path / "roofline.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.skipif(fs.gpu.available(), reason="a GPU is visible here")
def test_model_vs_hardware_says_it_needs_a_gpu(capsys, tmp_path):
    mod = load("model_vs_hardware")
    assert mod.main(["--out", str(tmp_path)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out
    configs = mod.CONFIGS
    assert len(configs) >= 24
    assert {c[1] for c in configs} == {"wg", "tc", "ref"} and {c[0] for c in configs} == {"fwd", "bwd"}
    assert any(c[7] for c in configs) and any(c[6] for c in configs)        # det, causal
    assert any(c[3] != c[4] for c in configs)                                # GQA
    past_l2 = [c for c in configs if c[2] * c[5] * 2 * 2 > fs.hardware.H100.l2_bytes]
    assert len(past_l2) >= 8


def test_model_vs_hardware_rebuilds_its_tables_from_a_saved_run(tmp_path):
    """--from-json recomputes the model beside saved measurements (here, the model's own
    numbers standing in for ncu's, so every ratio is 1)."""
    mod = load("model_vs_hardware")
    configs = mod.CONFIGS[:3] + [c for c in mod.CONFIGS if c[0] == "bwd"][:1]
    measured = []
    for cfg in configs:
        pred = mod.predict(cfg, fs.hardware.H100)
        if cfg[0] == "bwd":
            measured.append({"ncu_kernel": "void flash2_fwd_tc<__half, 64>(...)",
                             "dram_read": 1, "dram_write": 1, "l2_read": 1, "l2_write": 1,
                             "l2_red": 0, "time_s": 1e-3})
        for lp in pred.launches:
            lv = lp.levels
            measured.append({"ncu_kernel": f"void {lp.launch.kernel}<__half, 64>(int)",
                             "dram_read": lv.dram.read_bytes, "dram_write": lv.dram.write_bytes,
                             "l2_read": lv.sm_l2.read_bytes, "l2_write": lv.sm_l2.write_bytes,
                             "l2_red": lv.sm_l2.reduce_bytes, "time_s": lp.time_s})
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps({"meta": {"gpu": "test", "preset": "H100", "date": "today",
                                          "configs": [list(c) for c in configs], "ncu": "ncu"},
                                 "measured": measured}))
    assert mod.main(["--from-json", str(saved), "--out", str(tmp_path), "--name", "t"]) == 0
    rows = json.loads((tmp_path / "t.json").read_text())["rows"]
    assert len(rows) == 3 + 3
    assert all(mod.ratio(r["dram_read"], r["pred_dram_read"]) == 1 for r in rows)
    assert "DRAM read" in (tmp_path / "t.md").read_text()

def test_l2_cliff(tmp_path):
    mod = load("l2_cliff")
    code = mod.main(["--quick", "--out", str(tmp_path), "--measured", str(tmp_path / "none.json")])
    rows = list(csv.DictReader(open(tmp_path / "l2_cliff.csv")))
    assert len(rows) == 2 * len(mod.QUICK_NS)
    for r in rows:
        # below the cliff the three-level model reads what it must, far below the two-level count
        assert int(r["three_level_read"]) == int(r["compulsory_read"]) < int(r["two_level_read"])
    if has_matplotlib():
        assert code == 0 and (tmp_path / "l2_cliff.png").read_bytes()[:8] == PNG_MAGIC
    else:
        assert code == 2


def test_decode_time(tmp_path):
    mod = load("decode_time")
    code = mod.main(["--quick", "--out", str(tmp_path)])
    rows = list(csv.DictReader(open(tmp_path / "decode_time.csv")))
    assert len(rows) == 2 * 3 * 3 * len(mod.QUICK_LENGTHS)
    for r in rows:
        # every step reads at least the K/V cache; GQA packing reads it once per K/V head
        assert int(r["bytes"]) >= int(r["kv_cache_bytes"])
        assert float(r["predicted_s"]) >= float(r["floor_s"])
    assert code == (0 if has_matplotlib() else 2)


def test_head_dims_table_rebuilds_from_the_committed_benchmark(tmp_path):
    """analysis/head_dims.py turns the committed head_dims.json into the committed
    head_dims.md, and its ratios are the rows' TFLOP/s divided (ours over SDPA's)."""
    mod = load("head_dims")
    src = ANALYSIS / "out" / "bench" / "head_dims.json"
    out = tmp_path / "head_dims.md"
    assert mod.main([str(src), "--out", str(out)]) == 0
    assert out.read_text() == (ANALYSIS / "out" / "bench" / "head_dims.md").read_text()
    rows = json.load(open(src))["rows"]
    cells = mod.ratios(rows)
    ours = next(r for r in rows if r["impl"] == "flashsim-auto")
    flash = next(r for r in rows if r["impl"] == "sdpa-flash" and all(
        r[k] == ours[k] for k in ("dtype", "d", "N", "causal")))
    key = (ours["dtype"], ours["d"], ours["N"], ours["causal"])
    assert cells[key]["fwd"]["sdpa-flash"] == pytest.approx(ours["fwd_tflops"] / flash["fwd_tflops"])
    assert cells[key]["bwd"]["sdpa-flash"] == pytest.approx(ours["bwd_tflops"] / flash["bwd_tflops"])
    # every head dim of the grid has its summary row
    ds = sorted({r["d"] for r in rows})
    assert all(f"\n| {d} | " in out.read_text() for d in ds)


NCU_SOURCE = '''"Kernel Name","void k1<__half, (int)128, (bool)0>(wg::TensorMap, const int *, T1 *)",
"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","Instructions Executed","stall_wait","stall_barrier","stall_wait (Not Issued)"
"0x10","      MUFU.EX2 R1, R1","10","5","1000","6","0","3"
"0x20","@!P0  BRA 0x10","4","0","500000","0","1","0"
"0x30","      MUFU.RCP R2, R2","2","0","1000","2","0","0"
"Kernel Name","cudnn_sdpa_fprop_kernel0",
"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","Instructions Executed","stall_wait","stall_barrier","stall_wait (Not Issued)"
"0x10","      FADD.FTZ R1, R1, R2","1","0","2000","1","0","0"
'''


def test_ncu_compare_sets_two_kernels_side_by_side(tmp_path, capsys):
    import gzip
    mod = load("ncu_compare")
    src = tmp_path / "src.csv.gz"
    src.write_bytes(gzip.compress(NCU_SOURCE.encode()))
    kernels = mod.read_source(src)
    assert [mod.short_name(n) for n, _ in kernels] == ["k1<__half, 128, 0>", "cudnn_sdpa_fprop_kernel0"]
    ops = mod.by_opcode(kernels[0][1])
    assert ops["MUFU"]["executed"] == 2000 and ops["MUFU"]["samples"] == 12
    assert ops["MUFU"]["reasons"] == {"wait": 8, "unnamed": 4}    # the not-issued column is a share of wait
    assert ops["BRA"]["reasons"] == {"barrier": 1, "unnamed": 3}  # samples no column names
    out = tmp_path / "cmp.md"
    assert mod.main([str(src), "--out", str(out)]) == 0
    text = out.read_text()
    assert "| stall samples | 16 | 1 |" in text
    assert "| `MUFU` | 0.00 M, 12 (wait 8, unnamed 4) | – |" in text
    assert "| `FADD` | – | 0.00 M, 1 (wait 1) |" in text


def test_ncu_compare_says_what_page_it_needs(tmp_path, capsys):
    mod = load("ncu_compare")
    details_page = tmp_path / "details.csv"
    details_page.write_text('"ID","Kernel Name","Metric Name","Metric Value"\n"0","k","Duration","1"\n')
    assert mod.main([str(details_page)]) == 2
    assert "--page source --csv --print-source sass" in capsys.readouterr().err
