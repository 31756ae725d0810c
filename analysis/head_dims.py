"""The head-dim table: a benchmark run's flashsim-auto against SDPA's FlashAttention-2
(flash) and cuDNN backends, per head dim, from the bench.json `flashsim bench` writes.

    python3 analysis/bench_attention.py --ds 32,48,64,80,96,112,128,160,192,224,256 \\
        --ns 2048,4096 --kernels auto --only flashsim-auto,sdpa-flash,sdpa-cudnn --out DIR
    python3 analysis/head_dims.py DIR/bench.json [--out analysis/out/bench/head_dims.md]

Writes the ranges over dtypes, N and masks per d (ratios of TFLOP/s, ours over the
backend's: > 1 is faster), then every cell. A cell whose backend declined the shape is
left empty.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import _common  # noqa: E402  (puts the repository root on sys.path)

IMPL = "flashsim-auto"


def ratios(rows):
    """{(dtype, d, N, causal): {"fwd"|"bwd": {backend: TF/s ratio ours/theirs}, "tf": …}}"""
    by = {}
    for r in rows:
        by.setdefault((r["dtype"], r["d"], r["N"], r["causal"]), {})[r["impl"]] = r
    out = {}
    for key, impls in sorted(by.items()):
        ours = impls.get(IMPL)
        if ours is None:
            continue
        cell = {"tf": {p: ours.get(f"{p}_tflops") for p in ("fwd", "bwd")}}
        for p in ("fwd", "bwd"):
            cell[p] = {}
            for name in ("sdpa-flash", "sdpa-cudnn"):
                them = impls.get(name, {}).get(f"{p}_tflops")
                mine = ours.get(f"{p}_tflops")
                cell[p][name] = mine / them if mine and them else None
            cell[p]["tf"] = {name: impls.get(name, {}).get(f"{p}_tflops")
                             for name in ("sdpa-flash", "sdpa-cudnn")}
        out[key] = cell
    return out


def span(xs):
    xs = [x for x in xs if x is not None]
    return f"{min(xs):.2f}–{max(xs):.2f}" if xs else ""


def table(data, command: str) -> str:
    meta, cells = data["meta"], ratios(data["rows"])
    ds = sorted({k[1] for k in cells})
    lines = [f"# Every head dim on the fast rungs — {meta['gpu']}, {meta['date']}", "",
             f"`{command}` (one process; batch·N = {meta['tokens']} tokens, heads = "
             f"{meta['hidden']}/d rounded down; {meta['timing']}; CuPy {meta['cupy']}, "
             f"PyTorch {meta['torch']}). flashsim-auto is `fs.gpu.attention(kernel=\"auto\")` "
             "and `fs.gpu.attention_backward` on PyTorch tensors; flash and cuDNN are SDPA's "
             "backends. Ratios of TFLOP/s, ours over theirs.", "",
             "Ranges over dtypes, N and masks:", "",
             "| d | fwd / flash | fwd / cuDNN | bwd / flash | bwd / cuDNN |",
             "|---|---|---|---|---|"]
    for d in ds:
        cs = [c for k, c in cells.items() if k[1] == d]
        lines.append(f"| {d} | " + " | ".join(
            span(c[p][b] for c in cs) for p in ("fwd", "bwd")
            for b in ("sdpa-flash", "sdpa-cudnn")) + " |")
    lines += ["", "Every cell (TFLOP/s):", "",
              "| dtype | d | N | causal | fwd | flash | cuDNN | fwd/flash | fwd/cuDNN "
              "| bwd | flash | cuDNN | bwd/flash | bwd/cuDNN |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def f(x, fmt):
        return format(x, fmt) if x is not None else ""
    for (dtype, d, N, causal), c in cells.items():
        parts = [dtype, str(d), str(N), "yes" if causal else "no"]
        for p in ("fwd", "bwd"):
            parts += [f(c["tf"][p], ".0f"), f(c[p]["tf"]["sdpa-flash"], ".0f"),
                      f(c[p]["tf"]["sdpa-cudnn"], ".0f"), f(c[p]["sdpa-flash"], ".2f"),
                      f(c[p]["sdpa-cudnn"], ".2f")]
        lines.append("| " + " | ".join(parts) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench_json")
    ap.add_argument("--out", default=os.path.join(_common.HERE, "out", "bench", "head_dims.md"))
    ap.add_argument("--command", default="python3 analysis/bench_attention.py --ds "
                    "32,48,64,80,96,112,128,160,192,224,256 --ns 2048,4096 --dtypes "
                    "float16,bfloat16 --kernels auto --only flashsim-auto,sdpa-flash,sdpa-cudnn "
                    "--reps 8", help="the benchmark's command line, for the header")
    a = ap.parse_args(argv)
    text = table(json.load(open(a.bench_json)), a.command)
    with open(a.out, "w") as fh:
        fh.write(text)
    print(text.split("\n\nEvery cell")[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
