"""Decoding time against KV length, predicted from the counted bytes.

    python3 analysis/decode_time.py [--quick] [--out analysis/out] [--hardware H100]

One decoding step (`fs.count_kvcache`: split-KV over a paged cache, GQA heads packed into
each tile, the split count from `fs.num_splits_heuristic` for the GPU's SMs), for
Nq ∈ {1, 4, 16} query rows, batch ∈ {1, 8, 64}, KV lengths 1k–256k per sequence, 32
query heads over 8 K/V heads (and 32 over 32), d = 128, bfloat16, pages of 256 rows.
Decoding is memory-bound: its time is at least the bytes it moves over the GPU's copy
bandwidth (`hardware.dram_sustained_bytes_per_s`, measured here), which is what this
predicts; the figure also shows the bytes the K/V cache alone holds, the floor any kernel
must read. Writes decode_time.png and .csv.

With ``--measured`` (default: analysis/out/bench/decode.csv when present, written by
analysis/bench_decode.py on a GPU), the figure also shows the measured time of
`fs.gpu.attention_with_kvcache` on the paged cache (markers), and decode_measured.csv
holds, per measured step, the prediction for that very launch: the bytes
`fs.count_kvcache` counts with the launch's own split count and tile, over the copy
bandwidth measured in the same process.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys

import _common as C  # noqa: E402  (puts the repository root on sys.path)

import flashsim as fs  # noqa: E402

LENGTHS = [1024 * 2**k for k in range(9)]          # 1k … 256k
QUICK_LENGTHS = [1024, 8192]
D = 128


def rows(lengths, hw):
    out = []
    for heads, kv_heads in ((32, 8), (32, 32)):
        for Nq in (1, 4, 16):
            for batch in (1, 8, 64):
                for L in lengths:
                    t = fs.count_kvcache(Nq=Nq, heads=heads, kv_heads=kv_heads, d=D,
                                         cache_seqlens=[L] * batch, page_size=256,
                                         causal=True, io_dtype="bfloat16", hardware=hw)
                    kv = 2 * batch * kv_heads * L * D * 2
                    out.append({"heads": heads, "kv_heads": kv_heads, "Nq": Nq, "batch": batch,
                                "kv_len": L, "bytes": t.total_bytes, "kv_cache_bytes": kv,
                                "predicted_s": t.total_bytes / hw.dram_sustained_bytes_per_s,
                                "floor_s": kv / hw.dram_sustained_bytes_per_s})
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=C.DEFAULT_OUT)
    ap.add_argument("--hardware", default="H100", choices=list(fs.hardware.PRESETS))
    ap.add_argument("--measured", default=os.path.join(C.HERE, "out", "bench", "decode.csv"),
                    help="analysis/bench_decode.py's decode.csv ('' for none)")
    a = ap.parse_args(argv)
    hw = fs.hardware.PRESETS[a.hardware]
    table = rows(QUICK_LENGTHS if a.quick else LENGTHS, hw)
    C.write_csv(C.out_file(a.out, "decode_time.csv"), table)
    measured = measured_rows(a.measured) if a.measured and os.path.isfile(a.measured) else []
    if measured:
        C.write_csv(C.out_file(a.out, "decode_measured.csv"), measured)
    try:
        plt = C.pyplot()
    except C.MissingMatplotlib as e:
        print(e)
        return 2
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4), sharey=True)
    for ax, (heads, kv_heads) in zip(axes, ((32, 8), (32, 32))):
        for Nq, style in ((1, "-"), (16, "--")):
            for batch, color in ((1, "tab:blue"), (8, "tab:orange"), (64, "tab:green")):
                rs = [r for r in table if (r["heads"], r["kv_heads"], r["Nq"], r["batch"])
                      == (heads, kv_heads, Nq, batch)]
                ax.plot([r["kv_len"] for r in rs], [r["predicted_s"] * 1e6 for r in rs], style,
                        color=color, marker="o", ms=3, label=f"batch {batch}, Nq = {Nq}")
                ms = [r for r in measured if (r["heads"], r["kv_heads"], r["Nq"], r["batch"])
                      == (heads, kv_heads, Nq, batch) and r["paged"]]
                if ms:
                    ax.plot([r["kv_len"] for r in ms], [r["measured_s"] * 1e6 for r in ms],
                            "x" if Nq == 1 else "+", color=color, ms=7, ls="none",
                            label=f"measured ({ms[0]['device']})" if (Nq, batch) == (1, 1)
                            else None)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("KV length per sequence")
        ax.set_title(f"{heads} query heads over {kv_heads} K/V heads, d = {D}, bfloat16")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel(f"µs per decoding step: lines predicted ({hw.name.split()[0]}, "
                       f"{hw.dram_sustained_bytes_per_s / 1e12:.1f} TB/s)"
                       + (", markers measured (paged)" if measured else ""), fontsize=8)
    axes[0].legend(fontsize=7)
    C.save_figure(fig, a.out, "decode_time.png")
    return 0


def measured_rows(path):
    """bench_decode.py's rows with the prediction for each measured launch: the bytes
    counted for its split count and tile, over the copy bandwidth measured beside it."""
    out = []
    device = "GPU"
    md = os.path.join(os.path.dirname(path), "decode.md")
    if os.path.isfile(md):
        head = open(md).readline()
        device = head.split(",")[1].strip() if "," in head else device
    for r in csv.DictReader(open(path)):
        heads, kv_heads, Nq, batch, L = (int(r[k]) for k in ("heads", "kv_heads", "Nq",
                                                              "batch", "kv_len"))
        paged = r["paged"] == "True"
        # splitkv_fwd_tc_m<Br>[_cl<CL>]: a cluster's partials stay on chip
        cluster = "_cl" in r["kernel"]
        Br = int(r["kernel"].split("_m")[1].split("_")[0])
        t = fs.count_kvcache(Nq=Nq, heads=heads, kv_heads=kv_heads, d=D,
                             cache_seqlens=[L] * batch, page_size=256 if paged else None,
                             num_splits=int(r["num_splits"]), cluster=cluster,
                             block_sizes=(Br, 64), io_dtype="bfloat16")
        bw = float(r["copy_bw"])
        out.append({"device": device, "heads": heads, "kv_heads": kv_heads, "Nq": Nq,
                    "batch": batch, "kv_len": L, "paged": paged,
                    "num_splits": int(r["num_splits"]), "counted_bytes": t.total_bytes,
                    "measured_s": float(r["kernels_ms"]) * 1e-3,
                    "predicted_s": t.total_bytes / bw,
                    "measured_over_predicted": float(r["kernels_ms"]) * 1e-3 / (t.total_bytes / bw)})
    return out


if __name__ == "__main__":
    sys.exit(main())
