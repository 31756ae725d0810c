"""DRAM bytes read by one head's forward against N: the L2 cliff.

    python3 analysis/l2_cliff.py [--quick] [--out analysis/out] [--hardware H100]

For one head, d = 128, float16, the project's forward kernel on the chosen GPU (the
Hopper rung on an H100), it puts side by side: the compulsory bytes (Q, K, V read once,
O, L written once), the two-level count (`fs.count` with the kernel's tiles: every SRAM
fill from DRAM, as if there were no L2), the three-level prediction (`fs.count(...,
hardware=...)`), and the measured points of `analysis/out/model_vs_hardware.json`
(Nsight Compute's dram__bytes_read, same kernel, one head) where that file holds them;
all of them bytes read (the CSV has the writes too). While K and V fit in what L2 keeps, DRAM moves the compulsory
bytes; past it, each wave of CTAs reads K and V again. Writes l2_cliff.png and .csv.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import _common as C  # noqa: E402  (puts the repository root on sys.path)

import flashsim as fs  # noqa: E402

D = 128
NS = [1024 * 2**k for k in range(9)] + [49152, 65536 + 32768, 196608]
QUICK_NS = [1024, 4096, 16384]


def rows_for(ns, hw, causal):
    out = []
    for N in sorted(ns):
        pred = fs.count("flash2", Nq=N, Nk=N, d=D, batch_shape=(1, 1), causal=causal,
                        io_dtype="float16", hardware=hw)
        lv = pred.levels
        comp = fs.theory.compulsory(Nq=N, Nk=N, d=D, itemsize=2)
        out.append({"N": N, "causal": causal, "kv_bytes": 2 * N * D * 2,
                    "kernel": pred.launches[0].launch.kernel,
                    "compulsory_read": comp.read_bytes, "two_level_read": pred.traffic.read_bytes,
                    "three_level_read": lv.dram.read_bytes,
                    "three_level_write": lv.dram.write_bytes,
                    "written_after": pred.writeback.write_bytes})
    return out


def measured_points(path, hw_name, causal):
    """(N, DRAM bytes read) of one-head, d = 128 forward rows of the Hopper rung."""
    if not os.path.exists(path):
        return []
    saved = json.load(open(path))
    if saved["meta"]["preset"] != hw_name:
        return []
    return [(r["N"], r["dram_read"]) for r in saved["rows"]
            if r["direction"] == "fwd" and r["heads"] == 1 and r["d"] == D
            and r["causal"] == causal and r["rung"] == "wg"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=C.DEFAULT_OUT)
    ap.add_argument("--hardware", default="H100", choices=list(fs.hardware.PRESETS))
    ap.add_argument("--measured", default=os.path.join(C.DEFAULT_OUT, "model_vs_hardware.json"))
    a = ap.parse_args(argv)
    hw = fs.hardware.PRESETS[a.hardware]
    ns = QUICK_NS if a.quick else NS
    rows = rows_for(ns, hw, False) + rows_for(ns, hw, True)
    C.write_csv(C.out_file(a.out, "l2_cliff.csv"), rows)
    try:
        plt = C.pyplot()
    except C.MissingMatplotlib as e:
        print(e)
        return 2
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4), sharey=True)
    MB = 1e6
    for ax, causal in zip(axes, (False, True)):
        rs = [r for r in rows if r["causal"] == causal]
        N = [r["N"] for r in rs]
        ax.plot(N, [r["two_level_read"] / MB for r in rs], "s--", color="tab:gray",
                label="two-level count (no L2)")
        ax.plot(N, [r["three_level_read"] / MB for r in rs], "o-", color="tab:blue",
                label=f"three-level prediction ({hw.name.split()[0]})")
        ax.plot(N, [r["compulsory_read"] / MB for r in rs], ":", color="black",
                label="compulsory (Q, K, V once)")
        pts = measured_points(a.measured, a.hardware, causal)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] / MB for p in pts], "x", color="tab:red",
                    markersize=10, mew=2, label="measured (Nsight Compute)")
        lo, hi = hw.l2_retention or (hw.l2_bytes, hw.l2_bytes)
        # N at which one head's K + V (4·N·d bytes in float16) fills what L2 keeps
        ax.axvspan(lo / (4 * D), hi / (4 * D), color="tab:orange", alpha=0.15,
                   label="K + V = what L2 keeps")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("N (one head, d = 128, float16)")
        ax.set_title(f"forward, {'causal' if causal else 'no mask'}: {rs[0]['kernel']}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("DRAM bytes read (MB)")
    axes[0].legend(fontsize=8, loc="upper left")
    C.save_figure(fig, a.out, "l2_cliff.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
