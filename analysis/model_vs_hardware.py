"""The HBM model held against hardware counters: DRAM bytes our kernels really move.

    python3 analysis/model_vs_hardware.py [--quick] [--out analysis/out]

Runs itself under Nsight Compute (`ncu --clock-control none --cache-control all
--metrics dram__bytes_read.sum,dram__bytes_write.sum`; `--cache-control all` flushes L2
before every profiled launch) over a sweep of forward launches of both kernels (the
reference rung and the tensor-core rung): N from 1k to 64k, 1 to 64 heads, d = 64 and
128, causal and not, float16. Beside each measured count it puts the simulator's HBM
prediction for the same tiling (`fs.count("flash2", block_sizes=<the kernel's>)`) and
the compulsory traffic (`fs.theory.compulsory`: Q, K, V read once, O and L written once).
Expect measured bytes between the two: the model counts every K/V re-read, and L2 (50 MB
on an H100) absorbs many of them. Writes model_vs_hardware.md and .json.
Needs a CUDA GPU, CuPy and ncu.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
import flashsim as fs  # noqa: E402

# (kernel, N, heads, d, causal); batch 1
CONFIGS = [
    ("tc", 1024, 16, 64, False), ("tc", 4096, 16, 64, False), ("tc", 4096, 16, 64, True),
    ("tc", 8192, 8, 128, False), ("tc", 16384, 4, 128, False), ("tc", 16384, 4, 128, True),
    ("tc", 2048, 64, 128, False), ("tc", 65536, 1, 64, False), ("tc", 65536, 1, 128, True),
    ("ref", 1024, 16, 64, False), ("ref", 4096, 4, 64, True), ("ref", 4096, 16, 128, False),
    ("ref", 16384, 1, 128, False), ("ref", 65536, 1, 64, True),
]
QUICK = [c for c in CONFIGS if c[1] <= 4096]
METRICS = "dram__bytes_read.sum,dram__bytes_write.sum"


def launch(configs):
    """Run each configuration's forward once (what ncu profiles)."""
    import cupy as cp
    rng = np.random.default_rng(0)
    for kernel, N, H, d, causal in configs:
        q, k, v = (cp.asarray(rng.standard_normal((1, H, N, d)).astype(np.float16))
                   for _ in range(3))
        fs.gpu.attention(q, k, v, causal=causal, kernel=kernel)
        cp.cuda.Device().synchronize()


def predict(kernel, N, H, d, causal):
    import cupy as cp
    probe = cp.zeros((1, 1, 1, d), cp.float16)
    blocks = fs.gpu.block_sizes(probe, probe, kernel=kernel)
    model = fs.count("flash2", Nq=N, Nk=N, d=d, batch_shape=(1, H), block_sizes=blocks,
                     causal=causal, io_dtype="float16")
    low = fs.theory.compulsory(Nq=N, Nk=N, d=d, itemsize=2, problems=H)
    return blocks, model, low


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.path.join(ROOT, "analysis", "out"))
    ap.add_argument("--launch", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    configs = QUICK if a.quick else CONFIGS
    if a.launch:
        launch(configs)
        return 0
    if not fs.gpu.available():
        print("model_vs_hardware needs a CUDA GPU and CuPy (pip install \"flashsim[cuda12]\")")
        return 2
    ncu = shutil.which("ncu")
    if ncu is None:
        print("model_vs_hardware needs Nsight Compute's ncu on PATH")
        return 2
    launch(configs[:1])                       # compile the modules outside the profile
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "ncu.csv")
        cmd = [ncu, "--clock-control", "none", "--cache-control", "all", "--metrics", METRICS,
               "-k", "regex:flash2_fwd", "--csv", "--print-units", "base", "--log-file", log,
               sys.executable, os.path.abspath(__file__), "--launch"] + (["--quick"] if a.quick else [])
        subprocess.run(cmd, check=True)
        text = open(log).read()
    rows = list(csv.DictReader(io.StringIO(text[text.index('"ID"'):])))
    by_id: dict[str, dict] = {}
    for r in rows:
        by_id.setdefault(r["ID"], {"kernel": r["Kernel Name"]})[r["Metric Name"]] = \
            float(r["Metric Value"].replace(",", ""))
    measured = [by_id[i] for i in sorted(by_id, key=int)]
    if len(measured) != len(configs):
        raise RuntimeError(f"ncu profiled {len(measured)} launches, expected {len(configs)}")
    import cupy as cp
    props = cp.cuda.runtime.getDeviceProperties(0)
    gpu = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    table = []
    for cfg, m in zip(configs, measured):
        blocks, model, low = predict(*cfg)
        rd, wr = m["dram__bytes_read.sum"], m["dram__bytes_write.sum"]
        table.append({"kernel": cfg[0], "N": cfg[1], "heads": cfg[2], "d": cfg[3],
                      "causal": cfg[4], "Br": blocks[0], "Bc": blocks[1],
                      "measured_read": rd, "measured_write": wr,
                      "model_read": model.read_bytes, "model_write": model.write_bytes,
                      "compulsory_read": low.read_bytes, "compulsory_write": low.write_bytes,
                      "ncu_kernel": m["kernel"]})
    os.makedirs(a.out, exist_ok=True)
    meta = {"gpu": gpu, "date": datetime.date.today().isoformat(),
            "ncu": f"ncu --clock-control none --cache-control all --metrics {METRICS}",
            "dtype": "float16", "batch": 1}
    with open(os.path.join(a.out, "model_vs_hardware.json"), "w") as f:
        json.dump({"meta": meta, "rows": table}, f, indent=1)
    MB = 1e6
    md = [f"# Model vs hardware: DRAM bytes of the forward kernels — {gpu}, {meta['date']}", "",
          f"`{meta['ncu']}`, L2 flushed before each launch; float16, batch 1. "
          "model = `fs.count(\"flash2\")` with the kernel's tiles; compulsory = Q, K, V read "
          "once, O and L written once. MB = 10⁶ bytes.", "",
          "| kernel | N | heads | d | causal | Br×Bc | read MB measured | model | compulsory | "
          "measured/model | measured/compulsory | write MB measured | model | compulsory |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        md.append(f"| {r['kernel']} | {r['N']} | {r['heads']} | {r['d']} | {r['causal']} | "
                  f"{r['Br']}×{r['Bc']} | {r['measured_read'] / MB:.1f} | {r['model_read'] / MB:.1f} | "
                  f"{r['compulsory_read'] / MB:.1f} | {r['measured_read'] / r['model_read']:.2f} | "
                  f"{r['measured_read'] / r['compulsory_read']:.2f} | {r['measured_write'] / MB:.1f} | "
                  f"{r['model_write'] / MB:.1f} | {r['compulsory_write'] / MB:.1f} |")
    with open(os.path.join(a.out, "model_vs_hardware.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
