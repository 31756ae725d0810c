"""A roofline of the GPU with measured attention forward points.

    python3 analysis/roofline.py [--bench analysis/out/bench/bench.json] \
        [--heads analysis/out/bench/head_dims.json] [--out analysis/out]

Reads benchmarks written by `bench_attention.py` (each holds its GPU's name; both must
name the same GPU), takes that GPU's peaks from `flashsim.hardware`, and places each
forward measurement at two arithmetic intensities: FLOPs over the compulsory bytes (Q, K,
V read once, O and L written once: what the DRAM counters show, see
model_vs_hardware.md) and FLOPs over the simulator's HBM count for the kernel's tiling
(the intensity of a machine without L2). ``--bench``: the sequence-length grid (d = 64 and
128); ``--heads``: the head-dim grid (d = 32 … 256, `kernel="auto"`, whose tiles on a
compute-capability-9.0 GPU are the Hopper rung's for that d: `hopper_fwd_tiles`), "" to
leave it out. Writes roofline.png and roofline.md.
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


def hopper_fwd_tiles(d: int) -> tuple[int, int] | None:
    """(Br, Bc) of `kernel="auto"`'s forward on a 9.0 device at d = dv, plain attention: the
    copy-engine kernel's where it runs (fs.kernels.ws_runs), else flash2_fwd_wg's, as
    fs.gpu.block_sizes answers there."""
    D = fs.kernels.instance_dim("wg", d, d)
    if D is None:
        return None
    return fs.kernels.WS_BLOCKS[D] if fs.kernels.ws_runs(d, d, D) else fs.kernels.wg_blocks(D)


def gpu_preset(name: str):
    for key, g in PRESETS.items():
        if key.lower() in name.lower():
            return g
    raise ValueError(f"no hardware preset matches {name!r}; known: {', '.join(PRESETS)}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bench", default=os.path.join(C.DEFAULT_OUT, "bench", "bench.json"))
    ap.add_argument("--heads", default=os.path.join(C.DEFAULT_OUT, "bench", "head_dims.json"),
                    help="the head-dim grid's benchmark (\"\" to leave it out)")
    ap.add_argument("--out", default=C.DEFAULT_OUT)
    ap.add_argument("--quick", action="store_true", help="(no effect: reads a file)")
    a = ap.parse_args(argv)
    data = json.load(open(a.bench))
    g = gpu_preset(data["meta"]["gpu"])
    sources = [(a.bench, data, ("flashsim-tc", "flashsim-ref", "sdpa-flash", "sdpa-cudnn"))]
    if a.heads:
        heads = json.load(open(a.heads))
        if gpu_preset(heads["meta"]["gpu"]) is not g:
            raise SystemExit(f"{a.heads} was measured on {heads['meta']['gpu']}, "
                             f"{a.bench} on {data['meta']['gpu']}: give benchmarks of one GPU")
        sources.append((a.heads, heads, ("flashsim-auto", "sdpa-flash", "sdpa-cudnn")))
    points = []
    for path, src, impls in sources:
        grid = "heads" if src is not data else "N"
        for r in src["rows"]:
            if r.get("fwd_ms") and r["impl"] in impls:
                points.append(point(r, grid, g))
    lines = [f"# Roofline of the {g.name} with attention forward points", "",
             f"Peaks from `flashsim.hardware` ({g.source}); ridge {g.ridge:.0f} FLOP/B. "
             "Measurements: " + "; ".join(
                 f"`{os.path.relpath(path, C.ROOT)}` ({src['meta']['gpu']}, {src['meta']['date']})"
                 for path, src, _ in sources) + ". flashsim-auto is `kernel=\"auto\"` (the "
             "head-dim grid: batch·N = 16k tokens, heads = 2048/d); its HBM model takes "
             "the Hopper rung's tiles for that d. A point above the roof at the HBM model's "
             "intensity is L2 at work: the model counts every tile a CTA reads from "
             "memory, and re-reads of K and V by the CTAs of one wave are L2 hits, not "
             "DRAM traffic (model_vs_hardware.md).", "",
             "| grid | impl | dtype | d | N | causal | TFLOP/s | FLOP/B (compulsory) | FLOP/B (HBM model) | % of peak |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for p in points:
        im = f"{p['intensity_model']:.0f}" if p["intensity_model"] else "—"
        lines.append(f"| {p['grid']} | {p['impl']} | {p['dtype']} | {p['d']} | {p['N']} | "
                     f"{p['causal']} | {p['tflops']:.1f} | {p['intensity_compulsory']:.0f} | "
                     f"{im} | {100 * p['tflops'] * 1e12 / g.peak_flops:.0f} |")
    C.write_text(C.out_file(a.out, "roofline.md"), "\n".join(lines))
    return plot(points, g, " and ".join(sorted({src["meta"]["gpu"] for _, src, _ in sources})),
                a.out)


def point(r: dict, grid: str, g) -> dict:
    """One forward measurement at its two intensities."""
    B, H, N, d, causal = r["B"], r["H"], r["N"], r["d"], r["causal"]
    flops = 4 * B * H * N * N * d / (2 if causal else 1)
    low = fs.theory.compulsory(Nq=N, Nk=N, d=d, itemsize=2, problems=B * H).total_bytes
    if r["impl"] == "flashsim-auto":
        tiles = hopper_fwd_tiles(d) if g.compute_capability == 90 else None
    elif r["impl"] == "sdpa-flash" and grid == "heads":
        tiles = None    # FlashAttention-2's tiles per head dim are its own; not modelled
    else:
        tiles = TILES.get(r["impl"], {}).get(d)
    model = (fs.count("flash2", Nq=N, Nk=N, d=d, batch_shape=(B, H), block_sizes=tiles,
                      causal=causal).total_bytes if tiles else None)
    return {**{k: r[k] for k in ("impl", "dtype", "d", "N", "causal")}, "grid": grid,
            "tflops": flops / r["fwd_ms"] / 1e9,
            "intensity_compulsory": flops / low,
            "intensity_model": flops / model if model else None}


def plot(points: list[dict], g, gpu: str, out: str) -> int:
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
    colors = {"flashsim-tc": "C0", "flashsim-auto": "C4", "flashsim-ref": "C3",
              "sdpa-flash": "C1", "sdpa-cudnn": "C2"}
    markers = {"N": ("o", "d = 64, 128, N grid"), "heads": ("^", "d = 32 … 256")}
    for impl, col in colors.items():
        for grid, (mk, what) in markers.items():
            pts = [p for p in points if p["impl"] == impl and p["grid"] == grid]
            if not pts:
                continue
            ax.scatter([p["intensity_compulsory"] for p in pts], [p["tflops"] for p in pts],
                       c=col, marker=mk, s=18, zorder=3 if impl.startswith("flashsim") else 2,
                       label=f"{impl}, {what} (FLOPs / compulsory bytes)")
            pm = [p for p in pts if p["intensity_model"]]
            if pm:
                ax.scatter([p["intensity_model"] for p in pm], [p["tflops"] for p in pm],
                           facecolors="none", edgecolors=col, marker=mk, s=18,
                           label=f"{impl}, {what} (FLOPs / HBM-model bytes)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP per HBM byte)")
    ax.set_ylabel("TFLOP/s (forward, 4·B·H·N²·d, halved when causal)")
    ax.set_title(f"Attention forward on the roofline — {gpu}")
    ax.legend(fontsize=6, loc="lower right")
    ax.grid(True, which="both", alpha=0.3)
    C.save_figure(fig, out, "roofline.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
