"""A roofline of the GPU with measured attention forward points.

    python3 analysis/roofline.py [--bench analysis/out/bench/bench.json] [--out analysis/out]

Reads a benchmark written by `bench_attention.py` (it holds the GPU's name), takes that
GPU's peaks from `flashsim.hardware`, and places each forward measurement at two
arithmetic intensities: FLOPs over the compulsory bytes (Q, K, V read once, O and L
written once: what the DRAM counters show, see model_vs_hardware.md) and FLOPs over the
simulator's HBM count for the kernel's tiling (the intensity of a machine without L2).
Writes roofline.png and roofline.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import _common as C  # noqa: E402  (puts the repository root on sys.path)

import flashsim as fs  # noqa: E402
from flashsim.hardware import PRESETS  # noqa: E402

# forward tiles whose HBM count is plotted: ours, and FlashAttention-2's sm80 forward
# kernels (128×128 at d = 64, 128×64 at d = 128, its run_mha_fwd_hdim64/128 choices
# without dropout); cuDNN's tiling is not public
TILES = {"flashsim-tc": dict(fs.kernels.TC_BLOCKS), "flashsim-ref": {64: (64, 64), 128: (64, 64)},
         "sdpa-flash": {64: (128, 128), 128: (128, 64)}}


def gpu_preset(name: str):
    for key, g in PRESETS.items():
        if key.lower() in name.lower():
            return g
    raise ValueError(f"no hardware preset matches {name!r}; known: {', '.join(PRESETS)}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bench", default=os.path.join(C.DEFAULT_OUT, "bench", "bench.json"))
    ap.add_argument("--out", default=C.DEFAULT_OUT)
    ap.add_argument("--quick", action="store_true", help="(no effect: reads a file)")
    a = ap.parse_args(argv)
    data = json.load(open(a.bench))
    g = gpu_preset(data["meta"]["gpu"])
    points = []
    for r in data["rows"]:
        if not r.get("fwd_ms") or r["impl"] not in ("flashsim-tc", "flashsim-ref", "sdpa-flash",
                                                     "sdpa-cudnn"):
            continue
        B, H, N, d, causal = r["B"], r["H"], r["N"], r["d"], r["causal"]
        flops = 4 * B * H * N * N * d / (2 if causal else 1)
        low = fs.theory.compulsory(Nq=N, Nk=N, d=d, itemsize=2, problems=B * H).total_bytes
        tiles = TILES.get(r["impl"], {}).get(d)
        model = (fs.count("flash2", Nq=N, Nk=N, d=d, batch_shape=(B, H), block_sizes=tiles,
                          causal=causal).total_bytes if tiles else None)
        points.append({**{k: r[k] for k in ("impl", "dtype", "d", "N", "causal")},
                       "tflops": flops / r["fwd_ms"] / 1e9,
                       "intensity_compulsory": flops / low,
                       "intensity_model": flops / model if model else None})
    lines = [f"# Roofline of the {g.name} with attention forward points", "",
             f"Peaks from `flashsim.hardware` ({g.source}); ridge {g.ridge:.0f} FLOP/B. "
             f"Measurements: `{os.path.relpath(a.bench, C.ROOT)}` ({data['meta']['gpu']}, "
             f"{data['meta']['date']}).", "",
             "| impl | dtype | d | N | causal | TFLOP/s | FLOP/B (compulsory) | FLOP/B (HBM model) | % of peak |",
             "|---|---|---|---|---|---|---|---|---|"]
    for p in points:
        im = f"{p['intensity_model']:.0f}" if p["intensity_model"] else "—"
        lines.append(f"| {p['impl']} | {p['dtype']} | {p['d']} | {p['N']} | {p['causal']} | "
                     f"{p['tflops']:.1f} | {p['intensity_compulsory']:.0f} | {im} | "
                     f"{100 * p['tflops'] * 1e12 / g.peak_flops:.0f} |")
    C.write_text(C.out_file(a.out, "roofline.md"), "\n".join(lines))
    try:
        plt = C.pyplot()
    except C.MissingMatplotlib as e:
        print(e, file=sys.stderr)
        return 2
    import numpy as np
    fig, ax = plt.subplots(figsize=(7.5, 5))
    x = np.logspace(0, 4.5, 200)
    ax.plot(x, np.minimum(g.peak_flops, x * g.hbm_bytes_per_s) / 1e12, "k-",
            label=f"{g.name} roofline (peak {g.peak_flops / 1e12:.0f} TFLOP/s, "
                  f"{g.hbm_bytes_per_s / 1e12:.2f} TB/s)")
    colors = {"flashsim-tc": "C0", "flashsim-ref": "C3", "sdpa-flash": "C1", "sdpa-cudnn": "C2"}
    for impl, col in colors.items():
        pts = [p for p in points if p["impl"] == impl]
        if not pts:
            continue
        ax.scatter([p["intensity_compulsory"] for p in pts], [p["tflops"] for p in pts],
                   c=col, s=18, label=f"{impl} (FLOPs / compulsory bytes)")
        pm = [p for p in pts if p["intensity_model"]]
        ax.scatter([p["intensity_model"] for p in pm], [p["tflops"] for p in pm],
                   facecolors="none", edgecolors=col, s=18, label=f"{impl} (FLOPs / HBM-model bytes)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP per HBM byte)")
    ax.set_ylabel("TFLOP/s (forward, 4·B·H·N²·d, halved when causal)")
    ax.set_title(f"Attention forward on the roofline — {data['meta']['gpu']}")
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(True, which="both", alpha=0.3)
    C.save_figure(fig, a.out, "roofline.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
