"""The `flashsim` command line, run in-process through `flashsim.cli.main`."""

import csv
import importlib.util
import json
import pathlib
import subprocess
import sys
import time

from pathlib import Path

import pytest

import flashsim as fs
from flashsim.cli import main

# the three schedules of the FlashAttention papers; splitkv and square have their own tests
CORE = ("standard", "flash1", "flash2")


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, *argv):
    code, out, err = run(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


# -- flashsim (no arguments) -------------------------------------------------------------

def test_default_example(capsys):
    code, out, err = run(capsys)
    assert code == 0, err
    for name in ("standard", "flash1", "flash2"):
        assert name in out
    assert "N = 2048" in out and "d = 64" in out and "192 KiB" in out
    assert out.count("matches closed form: yes") == 3
    assert "matches closed form: no" not in out
    assert "flashsim simulate --help" in out and "flashsim sweep --help" in out
    # the per-tensor table has a read/write column pair per algorithm
    assert "standard read" in out and "flash1 write" in out and "flash2 read" in out
    # accuracy lines: tiny float64 differences
    errs = [float(line.split()[-1]) for line in out.splitlines()
            if line.strip().split(" ")[0] in CORE and "e-" in line.split()[-1]]
    assert len(errs) == 3 and max(errs) < 1e-10


def test_python_dash_m():
    root = pathlib.Path(fs.__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, "-m", "flashsim", "simulate", "--help"],
                       capture_output=True, text=True, cwd=str(root))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: flashsim simulate")
    assert "--algorithm" in r.stdout and "--no-math" in r.stdout


# -- flashsim simulate -------------------------------------------------------------------

@pytest.mark.parametrize("algorithm", CORE)
def test_simulate_totals_equal_count(capsys, algorithm):
    d = run_json(capsys, "simulate", "--algorithm", algorithm, "--seq", "300",
                 "--head-dim", "32", "--sram", "32KiB")
    want = fs.count(algorithm, Nq=300, Nk=300, d=32, batch_shape=(1, 1), sram_bytes="32KiB")
    assert d["traffic"] == want.to_dict()
    assert d["traffic"]["total_bytes"] == want.total_bytes
    assert d["matches_theory"] is True and d["matches_count"] is True
    assert d["math"] is True and d["max_abs_error"] < 1e-10
    if algorithm != "standard":
        Br, Bc = d["block_sizes"]
        assert d["sram_peak_bytes"] <= 32 * 1024
        assert d["Tr"] == -(-300 // Br) and d["Tc"] == -(-300 // Bc)


def test_simulate_text_output(capsys):
    code, out, err = run(capsys, "simulate", "--seq", "300", "--head-dim", "32",
                         "--sram", "32KiB")
    assert code == 0, err
    total = fs.count("flash2", Nq=300, Nk=300, d=32, sram_bytes="32KiB").total_bytes
    assert f"{total:,} B" in out
    assert "matches closed form: yes" in out
    assert "Br = " in out and "Tr = " in out and "SRAM peak" in out
    assert "Theorem 2" in out and "order-of-magnitude" in out


def test_simulate_dtype_counts_bytes(capsys):
    a = run_json(capsys, "simulate", "--seq", "200", "--head-dim", "16", "--dtype", "float32",
                 "--block-sizes", "32", "32")
    b = run_json(capsys, "simulate", "--seq", "200", "--head-dim", "16", "--dtype", "bfloat16",
                 "--block-sizes", "32", "32")
    assert a["traffic"]["reads"]["Q"] == 2 * b["traffic"]["reads"]["Q"]
    assert a["problem"]["itemsize"] == 4 and b["problem"]["itemsize"] == 2
    assert a["block_sizes"] == [32, 32] and a["sram_bytes"] is None


def test_no_math_huge_is_fast(capsys):
    t0 = time.perf_counter()
    for alg in CORE:
        d = run_json(capsys, "simulate", "--algorithm", alg, "--no-math",
                     "--seq", "1048576", "--head-dim", "128")
        want = fs.count(alg, Nq=2**20, Nk=2**20, d=128, sram_bytes="192KiB")
        assert d["traffic"] == want.to_dict()
        assert d["matches_theory"] is True and d["math"] is False
        if alg != "standard":
            assert 0 < d["sram_bound_bytes"] <= 192 * 1024
    assert time.perf_counter() - t0 < 5
    code, out, _ = run(capsys, "simulate", "--no-math", "--seq", "1048576", "--head-dim", "128")
    assert code == 0 and "SRAM bound" in out and "matches closed form: yes" in out


@pytest.mark.parametrize("algorithm", CORE)
def test_causal(capsys, algorithm):
    base = ["simulate", "--algorithm", algorithm, "--seq", "256", "--head-dim", "32",
            "--sram", "16KiB"]
    c = run_json(capsys, *base, "--causal")
    n = run_json(capsys, *base)
    assert c["problem"]["causal"] is True and c["matches_theory"] and c["matches_count"]
    want = fs.count(algorithm, Nq=256, Nk=256, d=32, sram_bytes="16KiB", causal=True)
    assert c["traffic"] == want.to_dict()
    if algorithm != "standard":
        assert c["traffic"]["total_bytes"] < n["traffic"]["total_bytes"]
    code, out, err = run(capsys, *base, "--causal")
    assert code == 0 and "causal" in out and "matches closed form: yes" in out


def test_gqa_kv_heads(capsys):
    argv = ["simulate", "--seq", "128", "--seq-k", "192", "--head-dim", "16",
            "--head-dim-v", "8", "--batch", "2", "--heads", "4", "--kv-heads", "2",
            "--sram", "8KiB", "--causal"]
    d = run_json(capsys, *argv)
    want = fs.count("flash2", Nq=128, Nk=192, d=16, dv=8, batch_shape=(2, 4),
                    kv_batch_shape=(2, 2), sram_bytes="8KiB", causal=True)
    assert d["traffic"] == want.to_dict()
    assert d["problem"]["kv_heads"] == 2 and d["problem"]["problems"] == 8
    assert d["max_abs_error"] < 1e-10
    code, out, err = run(capsys, *argv)
    assert code == 0 and "GQA" in out


# -- errors --------------------------------------------------------------------------------

@pytest.mark.parametrize("argv", [
    ["simulate", "--sram", "10B"],
    ["simulate", "--block-sizes", "0", "4"],
    ["simulate", "--heads", "3", "--kv-heads", "2"],
    ["simulate", "--sram", "12 parsecs"],
    ["simulate", "--seq", "0"],
    ["simulate", "--algorithm", "standard", "--seq", "40000"],      # too slow: --no-math
    ["simulate", "--block-sizes", "1", "1", "--seq", "4096"],       # too many tile steps
    ["sweep", "--min", "1MiB", "--max", "1KiB"],
    ["sweep", "--points", "0"],
])
def test_bad_input_exits_2(capsys, argv):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert err.startswith("flashsim: error: ")
    assert "Traceback" not in err


def test_too_slow_suggests_no_math(capsys):
    code, _, err = run(capsys, "simulate", "--algorithm", "standard", "--seq", "40000")
    assert code == 2 and "--no-math" in err
    code, _, _ = run(capsys, "simulate", "--algorithm", "standard", "--seq", "40000",
                     "--no-math")
    assert code == 0


def test_sram_overflow_message(capsys):
    code, _, err = run(capsys, "simulate", "--sram", "10B")
    assert code == 2 and "SRAM" in err and "10" in err


def test_argparse_errors(capsys):
    with pytest.raises(SystemExit) as e:
        main(["simulate", "--algorithm", "flash3"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(["simulate", "--sram", "1KiB", "--block-sizes", "4", "4"])
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err


# -- flashsim sweep ----------------------------------------------------------------------

def test_sweep_table(capsys):
    code, out, err = run(capsys, "sweep", "--seq", "1024", "--head-dim", "64",
                         "--min", "256B", "--max", "1MiB", "--points", "7")
    assert code == 0, err
    lines = out.splitlines()
    header = next(line for line in lines if "SRAM M" in line)
    for name in ("standard", "flash1", "flash2", "Br×Bc"):
        assert name in header
    body = lines[lines.index(header) + 2:lines.index(header) + 2 + 7]
    assert len(body) == 7
    assert body[0].split()[:2] == ["256", "B"] and body[0].split()[-1] == "-"  # no tile fits
    assert "MiB" in out
    std = fs.count("standard", Nq=1024, Nk=1024, d=64).total_bytes
    assert f"{std / 2**20:.2f} MiB" in body[-1]


def test_sweep_csv(capsys, tmp_path):
    path = tmp_path / "sweep.csv"
    code, out, err = run(capsys, "sweep", "--seq", "512", "--head-dim", "32", "--causal",
                         "--min", "1KiB", "--max", "64KiB", "--points", "7",
                         "--csv", str(path))
    assert code == 0, err
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["sram_bytes"]) for r in rows] == [1024 * 2**i for i in range(7)]
    for r in rows:
        M = int(r["sram_bytes"])
        for alg in CORE:
            want = fs.count(alg, Nq=512, Nk=512, d=32, sram_bytes=M, causal=True)
            assert int(r[f"{alg}_bytes"]) == want.total_bytes
        assert int(r["flash2_Br"]) >= 1 and int(r["flash1_Bc"]) >= 1


def test_sweep_progress_many_points(capsys):
    code, out, err = run(capsys, "sweep", "--seq", "256", "--points", "60")
    assert code == 0
    assert "60/60" in err


def test_sweep_plot(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "sweep.png"
    code, out, err = run(capsys, "sweep", "--seq", "512", "--points", "5", "--plot", str(path))
    assert code == 0, err
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def test_sweep_plot_without_matplotlib(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import now raises ImportError
    code, out, err = run(capsys, "sweep", "--points", "3", "--plot", str(tmp_path / "x.png"))
    assert code == 2
    assert 'pip install "flashsim[analysis]"' in err
    assert not (tmp_path / "x.png").exists()


def test_simulate_hardware_prints_three_levels(capsys):
    code, out, err = run(capsys, "simulate", "--hardware", "H100", "--seq", "131072",
                         "--head-dim", "128")
    assert code == 0, err
    assert "flash2_fwd_ws: grid 1024×1 of 384 threads" in out and "7.76 waves" in out
    assert "SM↔L2 read" in out and "L2↔DRAM read" in out and "compulsory read" in out
    assert "predicted time" in out
    d = run_json(capsys, "simulate", "--hardware", "h100", "--seq", "2000", "--heads", "4",
                 "--kv-heads", "2", "--backward", "--deterministic", "--causal")
    want = fs.count_backward("flash2", Nq=2000, Nk=2000, d=64, batch_shape=(1, 4),
                             kv_batch_shape=(1, 2), causal=True, hardware="H100",
                             deterministic=True)
    assert [x["kernel"] for x in d["launches"]] == [lp.launch.kernel for lp in want.launches]
    assert d["levels"] == want.levels.to_dict() and d["time_s"] == want.time_s
    assert d["launches"][1]["kernel"] == "flash2_bwd_ws_det"


@pytest.mark.parametrize("argv, message", [
    (("--hardware", "H100", "--algorithm", "flash1"), "run flash2"),
    (("--hardware", "H100", "--sram", "192KiB"), "drop --sram"),
    (("--hardware", "V100"), "unknown hardware"),
    (("--backward",), "go with --hardware"),
    (("--hardware", "A100", "--launch", "wg"), "compute capability 9.0"),
])
def test_simulate_hardware_errors(capsys, argv, message):
    code, out, err = run(capsys, "simulate", *argv)
    assert code == 2 and message in err


def test_simulate_ring(capsys):
    code, out, err = run(capsys, "simulate", "--algorithm", "ring", "--world-size", "4",
                         "--assignment", "zigzag", "--causal", "--seq", "256", "--heads", "2")
    assert code == 0, err
    assert "ring attention over 4 ranks (zigzag slices)" in out
    assert "rank 3 read" in out and "interconnect per rank" in out
    d = run_json(capsys, "simulate", "--algorithm", "ring", "--world-size", "2", "--seq", "128")
    assert len(d["ranks"]) == 2 and d["links"][0]["writes"]["K"] == 64 * 64 * 2
    code, out, err = run(capsys, "simulate", "--world-size", "2")
    assert code == 2 and "--algorithm ring" in err
    code, out, err = run(capsys, "simulate", "--algorithm", "ring", "--world-size", "3",
                         "--seq", "100")
    assert code == 2 and "pad the sequence" in err


@pytest.mark.skipif(fs.gpu.available(), reason="a GPU is visible here")
def test_bench_says_it_needs_a_gpu(capsys):
    code, out, err = run(capsys, "bench", "--quick", "--ds", "64", "--causal", "yes")
    assert code == 2 and "needs a CUDA GPU" in err and out == ""


def test_bench_redraws_a_saved_run_and_checks_its_options(capsys, tmp_path):
    import json
    import shutil
    saved = Path(__file__).resolve().parent.parent / "analysis" / "out" / "bench" / "bench.json"
    copy = tmp_path / "bench.json"
    shutil.copy(saved, copy)
    code, out, err = run(capsys, "bench", "--plot-only", str(copy))
    if importlib.util.find_spec("matplotlib"):
        assert code in (0, None)
        assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:                                 # the figure needs matplotlib: it says so
        assert code == 2 and "flashsim[analysis]" in out
    assert json.loads(copy.read_text())["rows"]
    with pytest.raises(SystemExit):
        main(["bench", "--ds", "sixty-four"])
    with pytest.raises(SystemExit):
        main(["bench", "--causal", "maybe"])


@pytest.mark.parametrize("args, says", [
    (["--kernels", "wgmma"], "'wgmma': flashsim's kernels are auto, ref, tc, wg"),
    (["--only", "sdpa-flash,cudnn"], "'cudnn': the implementations are flashsim-auto"),
    (["--kernels", "tc", "--only", "flashsim-auto,sdpa-cudnn"],
     "--only names flashsim-auto, which --kernels (tc) does not time: add auto to --kernels"),
    (["--ns", "2k"], "--ns takes sequence lengths"),
    (["--ns", "4096,0"], "--ns takes sequence lengths"),
])
def test_bench_checks_its_kernels_and_implementations_before_looking_for_a_gpu(capsys, args, says):
    # a name it does not know would otherwise time nothing of it, shape after shape
    with pytest.raises(SystemExit) as e:
        main(["bench", *args])
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_kernels_build_with_an_nvrtc_that_is_not_there_says_so(capsys):
    code, out, err = run(capsys, "kernels", "build", "--nvrtc", "/nowhere/libnvrtc.so.13")
    assert code == 2 and "no NVRTC library at /nowhere/libnvrtc.so.13" in err
