"""HBM traffic against SRAM size M, forward and backward, with the Θ shapes.

    python3 analysis/traffic_vs_sram.py [--quick] [--out analysis/out]

Counts (fs.count, fs.count_backward; no math) the HBM bytes of standard attention,
FlashAttention-1 (flash1), FlashAttention-2 (flash2) and, forward only, Saha & Ye's
square tiles (square: no backward exists) at N = 4096 (--quick: 1024), d = 128, fp16,
for M (SRAM size in fp16 elements) from d/2 up to N·d, geometrically spaced with the
powers of two and M = d² included. Sizes at which an algorithm has no tile that fits
(fs.SRAMOverflowError) are skipped. Overlays, in bytes:

- Θ(N²d²/M) (fs.theory.theorem2_flash forward, theorem5_backward backward), scaled to
  meet flash2 at M = 4d²;
- Θ(N²d/√M) (fs.theory.theta_small_sram, drawn for M ≤ d² where it differs), scaled to
  meet square at M = d²/16;
- the exact compulsory traffic (fs.theory.compulsory: inputs read once, outputs written
  once), a true lower bound;

and a vertical line at M = d², where square and flash2 cross. Writes
traffic_vs_sram.csv and traffic_vs_sram.png.
"""

from __future__ import annotations

import argparse
import math
import sys

import numpy as np

import _common as C  # noqa: E402  (puts the repository root on sys.path)
import flashsim as fs  # noqa: E402

NAME = "traffic_vs_sram"
D = 128
ITEMSIZE = 2
FORWARD = ("standard", "flash1", "flash2", "square")
BACKWARD = ("standard", "flash1", "flash2")
LABELS = {"standard": "standard attention", "flash1": "FlashAttention-1",
          "flash2": "FlashAttention-2", "square": "square tiles (Saha & Ye)"}
STYLE = {"standard": dict(color="tab:gray", marker="o"),
         "flash1": dict(color="tab:blue", marker="s"),
         "flash2": dict(color="tab:orange", marker="^"),
         "square": dict(color="tab:green", marker="D")}


def sram_sizes(N: int, d: int, per_octave: int) -> list[int]:
    """M in elements from d/2 to N·d: per_octave points per doubling, plus d²."""
    lo, hi = max(1, d // 2), N * d
    octaves = math.log2(hi / lo)
    ms = np.geomspace(lo, hi, int(round(octaves * per_octave)) + 1)
    return sorted({int(round(m)) for m in ms} | {d * d})


def measure(N: int, d: int, Ms: list[int]) -> list[dict]:
    rows = []
    for M in Ms:
        sram = M * ITEMSIZE
        row = {"M_elements": M, "sram_bytes": sram}
        for a in FORWARD:
            try:
                t = fs.count(a, Nq=N, Nk=N, d=d, sram_bytes=sram)
                row[f"fwd_{a}"] = t.total_bytes
            except fs.SRAMOverflowError:
                row[f"fwd_{a}"] = None
        for a in BACKWARD:
            try:
                t = fs.count_backward(a, Nq=N, Nk=N, d=d, sram_bytes=sram)
                row[f"bwd_{a}"] = t.total_bytes
            except fs.SRAMOverflowError:
                row[f"bwd_{a}"] = None
        row["theta_flash_elements"] = fs.theory.theorem2_flash(N, d, M)
        row["theta_small_sram_elements"] = fs.theory.theta_small_sram(N, d, M)
        rows.append(row)
    return rows


def _at(rows, key, M):
    return next(r[key] for r in rows if r["M_elements"] == M)


def _crossover(rows):
    """(largest M at which square moves fewer bytes than flash2, smallest M at which it
    moves more), over the sizes where both fit; block-size rounding makes the ratio
    slightly non-monotone, so the two can differ by more than one step."""
    both = [(r["M_elements"], r["fwd_square"] / r["fwd_flash2"]) for r in rows
            if r["fwd_square"] is not None and r["fwd_flash2"] is not None]
    below = max((M for M, q in both if q < 1), default=None)
    above = min((M for M, q in both if q > 1), default=None)
    return below, above


def plot(plt, rows, N, d, path, anchor_flash, anchor_square):
    comp_f = fs.theory.compulsory(Nq=N, Nk=N, d=d, itemsize=ITEMSIZE).total_bytes
    comp_b = fs.theory.compulsory(Nq=N, Nk=N, d=d, itemsize=ITEMSIZE, backward=True).total_bytes
    Ms = np.array([r["M_elements"] for r in rows], dtype=float)
    fig, axes = plt.subplots(1, 2, figsize=(13, 6.6), sharey=True)
    panels = (("forward", "fwd", FORWARD, comp_f, fs.theory.theorem2_flash,
               "Θ(N²d²/M), Theorem 2"),
              ("backward", "bwd", BACKWARD, comp_b, fs.theory.theorem5_backward,
               "Θ(N²d²/M), Theorem 5"))
    for ax, (title, pre, algs, comp, theta, theta_name) in zip(axes, panels):
        for a in algs:
            pts = [(r["M_elements"], r[f"{pre}_{a}"]) for r in rows if r[f"{pre}_{a}"] is not None]
            if not pts:
                continue
            x, y = zip(*pts)
            ax.plot(x, y, label=LABELS[a], markersize=3.5, linewidth=1.4, **STYLE[a])
        # Θ(N²d²/M), scaled to flash2 at the anchor
        k = _at(rows, f"{pre}_flash2", anchor_flash) / theta(N, d, anchor_flash)
        sel = Ms >= d
        ax.plot(Ms[sel], [k * theta(N, d, int(m)) for m in Ms[sel]], "--", color="tab:red",
                linewidth=1.2,
                label=f"{theta_name}, scaled to FlashAttention-2 at M = {anchor_flash // (d * d)}d²")
        if pre == "fwd":
            ks = _at(rows, "fwd_square", anchor_square) / fs.theory.theta_small_sram(N, d, anchor_square)
            sel = Ms <= d * d
            ax.plot(Ms[sel], [ks * fs.theory.theta_small_sram(N, d, int(m)) for m in Ms[sel]],
                    ":", color="tab:purple", linewidth=1.8,
                    label=f"Θ(N²d/√M), Saha & Ye (M < d²), scaled to square at "
                          f"M = d²/{d * d // anchor_square}")
        ax.axhline(comp, color="black", linewidth=1, linestyle="-.",
                   label=f"compulsory: {'Q, K, V, O, dO, L read, dQ, dK, dV written' if pre == 'bwd' else 'Q, K, V read, O, L written'} once")
        ax.axvline(d * d, color="black", linewidth=0.8, alpha=0.6)
        ax.text(d * d * 1.08, 0.97, "M = d²", transform=ax.get_xaxis_transform(),
                va="top", fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlim(Ms.min() / 1.2, Ms.max() * 1.2)
        ax.set_xlabel("SRAM size M (fp16 elements)")
        top = ax.secondary_xaxis("top", functions=(lambda m: m * ITEMSIZE, lambda b: b / ITEMSIZE))
        top.set_xlabel("SRAM size (bytes)", fontsize=9)
        ax.set_title(f"{title} (N = {N}, d = {d}, fp16)", fontsize=11)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2,
                  frameon=False)
    axes[0].set_ylabel("HBM traffic, reads + writes (bytes)")
    fig.suptitle("HBM traffic against SRAM size M (fs.count / fs.count_backward); "
                 "points where no tile fits are skipped", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="N = 1024, fewer SRAM sizes")
    ap.add_argument("--out", default=C.DEFAULT_OUT, help="output folder (default: analysis/out)")
    a = ap.parse_args(argv)
    N, d = (1024, D) if a.quick else (4096, D)
    Ms = sram_sizes(N, d, per_octave=2 if a.quick else 4)
    rows = measure(N, d, Ms)
    anchor_flash, anchor_square = 4 * d * d, d * d // 16
    C.write_csv(C.out_file(a.out, f"{NAME}.csv"),
                [{k: ("" if v is None else v) for k, v in r.items()} for r in rows])
    dd = d * d
    f2, sq = _at(rows, "fwd_flash2", dd), _at(rows, "fwd_square", dd)
    below, above = _crossover(rows)
    print(f"N = {N}, d = {d}: {len(rows)} SRAM sizes from M = {Ms[0]} to {Ms[-1]} elements")
    print(f"at M = d² = {dd}: square / flash2 = {sq / f2:.2f}; square moves fewer bytes than "
          f"flash2 up to M = {below}, more from M = {above}")
    for M in (dd // 4, 4 * dd):
        if M in Ms:
            r = next(r for r in rows if r["M_elements"] == M)
            print(f"at M = {M}: square / flash2 = {r['fwd_square'] / r['fwd_flash2']:.2f}")
    try:
        plt = C.pyplot()
    except C.MissingMatplotlib as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    path = C.out_file(a.out, f"{NAME}.png")
    plot(plt, rows, N, d, path, anchor_flash, anchor_square)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
