"""Saha & Ye's square tiles on the GPU (reference rung) beside flash2 at the same tiles:
time, counted HBM bytes (equal to `fs.count`'s), and the outputs' agreement.

    python3 analysis/square_gpu.py [--n 1024] [--d 64] [--problems 64] [--blocks 16,32,64]

float16, one process, CUDA events after warm-up, medians over --reps. For each B in
--blocks: `fs.gpu.attention(..., algorithm="square", block_sizes=(B, B))` and flash2's
reference kernel at (B, B), each with its instrumented count checked against
`fs.count` at the same tiles (the counts are of the instrumented build; the times of the
fast build). Square moves more bytes than flash2 when B ≥ d (it writes E, N² elements,
and reads it back once per chunk of dv), and wins in the simulator only where SRAM is
below d² (`analysis/traffic_vs_sram.py`); the reference rung's time follows its
arithmetic, not its bytes. Writes analysis/out/square_gpu.md and .json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from _common import cuda_time  # (puts the repository root on sys.path)

import flashsim as fs  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--problems", type=int, default=64)
    ap.add_argument("--blocks", default="16,32,64")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args(argv)
    import cupy as cp
    name = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"].decode()
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((a.problems, a.n, a.d)).astype(np.float16) for _ in range(3))
    qd, kd, vd = (cp.asarray(x) for x in (q, k, v))
    rows = []
    for B in (int(x) for x in a.blocks.split(",")):
        outs = {}
        for alg in ("square", "flash2"):
            kw = dict(algorithm=alg, block_sizes=(B, B), causal=False)
            if alg == "flash2":
                kw["kernel"] = "ref"
            out, _, traffic = fs.gpu.attention(qd, kd, vd, count_io=True, **kw)
            want = fs.count(alg, Nq=a.n, Nk=a.n, d=a.d, batch_shape=(a.problems,),
                            block_sizes=(B, B), io_dtype="float16")
            ms = cuda_time(cp, lambda: fs.gpu.attention(qd, kd, vd, **kw), reps=a.reps)
            outs[alg] = cp.asnumpy(out).astype(np.float32)
            rows.append(dict(B=B, algorithm=alg, ms=ms, hbm_gb=traffic.total_bytes / 1e9,
                             equals_count=traffic == want))
        rows[-2]["max_abs_vs_flash2"] = float(np.abs(outs["square"] - outs["flash2"]).max())
    lines = [f"# Square tiles against flash2 on the reference rung, {name}, float16, "
             f"N = {a.n}, d = {a.d}, {a.problems} problems, no mask", "",
             "| B | algorithm | ms | HBM GB (counted) | = fs.count | max abs(O − O_flash2) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        err = f"{r['max_abs_vs_flash2']:.2e}" if "max_abs_vs_flash2" in r else ""
        lines.append(f"| {r['B']} | {r['algorithm']} | {r['ms']:.1f} | {r['hbm_gb']:.3f} | "
                     f"{r['equals_count']} | {err} |")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "square_gpu.md").write_text("\n".join(lines) + "\n")
    (OUT / "square_gpu.json").write_text(json.dumps(dict(device=name, args=vars(a), rows=rows),
                                                    indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
