"""Kernels' Nsight Compute reports side by side, per SASS opcode: how many instructions of
each kind a kernel executes, where its warps' stall samples fall and why, and its hottest
lines — the reading of our forward beside cuDNN's in kernels_cu/NOTES.md (v81, v83). No GPU
needed: it reads the CSV pages ncu exports from a report.

    ncu --nvtx --nvtx-include "prof/" --section WarpStateStats --section SourceCounters \\
        --import-source no -o REPORT python3 ...          (the kernels under an NVTX range)
    ncu -i REPORT.ncu-rep --page source --csv --print-source sass > src.csv
    ncu -i REPORT.ncu-rep --page details --csv > details.csv           (optional)
    python3 analysis/ncu_compare.py src.csv [--details details.csv] [--top 24] [--out FILE.md]

Either file may be gzipped (.gz). The source page holds one block per kernel launch (its
"Kernel Name" line, a header, a row per SASS instruction); the details page's launches are
matched to them in order. Opcodes are the mnemonic without its modifiers (MUFU.EX2 →
MUFU) and without a predicate.
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import io
import re
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
# from the details page, in this order where present
DETAILS = ("Duration", "Elapsed Cycles", "SM Active Cycles", "sm__cycles_active.min",
           "sm__cycles_active.max", "SM Frequency", "Compute (SM) Throughput",
           "Issue Slots Busy", "Executed Ipc Active", "Warp Cycles Per Issued Instruction",
           "L2 Cache Throughput", "DRAM Throughput", "Grid Size", "Block Size",
           "Registers Per Thread", "Dynamic Shared Memory Per Block")


def _open(path):
    return io.TextIOWrapper(gzip.open(path), encoding="utf-8") if str(path).endswith(".gz") \
        else open(path, encoding="utf-8")


def short_name(name: str) -> str:
    """A kernel's name without `void`, its parameter list and the casts of its template
    arguments: flash2_fwd_ws<__half, 128, 0, 0>."""
    name = re.sub(r"^void ", "", name.strip())
    name = re.sub(r"\((int|bool|unsigned int|long)\)", "", name)
    depth = 0
    for i, ch in enumerate(name):          # cut at the parameter list's "(" outside <...>
        depth += ch == "<"
        depth -= ch == ">"
        if ch == "(" and depth == 0:
            return name[:i]
    return name


def opcode(source: str) -> str:
    toks = [t for t in source.split() if not t.startswith("@")]
    return toks[0].split(".")[0].rstrip(";") if toks else "?"


def read_source(path):
    """[(kernel name, [row dict per SASS instruction])] from ncu's source page."""
    kernels, name, header = [], None, None
    for row in csv.reader(_open(path)):
        if not row:
            continue
        if row[0] == "Kernel Name":
            name, header = row[1], None
            kernels.append((name, []))
        elif name is not None and header is None:
            header = row
            missing = [c for c in ("Source", SAMPLES, EXECUTED) if c not in header]
            if missing:
                raise ValueError(f"{path}: the source page has no {missing[0]!r} column; "
                                 "profile with --section SourceCounters and export with "
                                 "--page source --csv --print-source sass")
        elif header is not None and len(row) == len(header):
            kernels[-1][1].append(dict(zip(header, row)))
    if not kernels:
        raise ValueError(f"{path}: no \"Kernel Name\" block; export the source page "
                         "(--page source --csv --print-source sass)")
    return kernels


def _num(text) -> float:
    try:
        return float(str(text).replace(",", ""))
    except ValueError:
        return 0.0


def stall_reasons(row) -> dict:
    """A line's stall samples by reason (issued or not), e.g. {"wait": 12, "barrier": 3}.
    Samples that no exported column names (ncu 2025 has none for a warpgroup's arrive, for
    one) are "unnamed"."""
    out = {c[len("stall_"):]: _num(v) for c, v in row.items()
           if c.startswith("stall_") and "(Not Issued)" not in c and _num(v)}
    rest = _num(row[SAMPLES]) - sum(out.values())
    if rest > 0:
        out["unnamed"] = rest
    return out


def by_opcode(rows) -> dict:
    """{opcode: {"executed": warp instructions, "samples": stall samples, "reasons": Counter}}"""
    out = collections.defaultdict(lambda: {"executed": 0.0, "samples": 0.0,
                                           "reasons": collections.Counter()})
    for r in rows:
        o = out[opcode(r["Source"])]
        o["executed"] += _num(r[EXECUTED])
        o["samples"] += _num(r[SAMPLES])
        o["reasons"].update(stall_reasons(r))
    return dict(out)


def read_details(path):
    """[(kernel name, {metric: "value unit"})] from ncu's details page, in launch order."""
    launches = {}
    for r in csv.DictReader(_open(path)):
        m = launches.setdefault(r["ID"], (r["Kernel Name"], {}))[1]
        m[r["Metric Name"]] = (r["Metric Value"] + " " + r.get("Metric Unit", "")).strip()
    return [launches[k] for k in sorted(launches, key=int)]


def _reasons(counter, n=3):
    return ", ".join(f"{k} {v:.0f}" for k, v in counter.most_common(n)) or "–"


def report(kernels, details=None, top: int = 24) -> str:
    names = [short_name(n) for n, _ in kernels]
    ops = [by_opcode(rows) for _, rows in kernels]
    lines = ["| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    lines.append("| stall samples | " + " | ".join(
        f"{sum(o['samples'] for o in k.values()):,.0f}" for k in ops) + " |")
    lines.append("| warp instructions executed | " + " | ".join(
        f"{sum(o['executed'] for o in k.values()) / 1e6:.1f} M" for k in ops) + " |")
    if details:
        if len(details) != len(kernels):
            print(f"ncu_compare: {len(details)} launches in the details page, {len(kernels)} "
                  "in the source page; the details are matched in order", file=sys.stderr)
        for metric in DETAILS:
            vals = [d[1].get(metric, "") for d in details[:len(kernels)]]
            if any(vals):
                lines.append(f"| {metric} | " + " | ".join(vals) + " |")
    out = ["## Kernels", "", *lines, ""]

    keys = sorted(set().union(*ops), key=lambda o: -max(k.get(o, {"samples": 0})["samples"]
                                                         for k in ops))[:top]
    head = "| opcode | " + " | ".join(f"{n}: executed, samples (top stalls)" for n in names) + " |"
    out += [f"## Per opcode (the {len(keys)} with the most samples in some kernel)", "", head,
            "|---|" + "---|" * len(names)]
    for o in keys:
        cells = []
        for k in ops:
            x = k.get(o)
            cells.append("–" if x is None else
                         f"{x['executed'] / 1e6:.2f} M, {x['samples']:,.0f} ({_reasons(x['reasons'])})")
        out.append(f"| `{o}` | " + " | ".join(cells) + " |")
    out.append("")

    for n, (_, rows) in zip(names, kernels):
        hot = sorted(rows, key=lambda r: -_num(r[SAMPLES]))[:top]
        out += [f"## Hottest lines: {n}", "", "| line | SASS | executed | samples (top stalls) |",
                "|---|---|---|---|"]
        index = {id(r): i for i, r in enumerate(rows)}
        for r in sorted(hot, key=lambda r: index[id(r)]):
            out.append(f"| {index[id(r)]} | `{r['Source'].strip()}` | {_num(r[EXECUTED]) / 1e6:.2f} M "
                       f"| {_num(r[SAMPLES]):,.0f} ({_reasons(collections.Counter(stall_reasons(r)))}) |")
        out.append("")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", help="ncu --page source --csv --print-source sass (.csv or .csv.gz)")
    ap.add_argument("--details", help="ncu --page details --csv of the same report")
    ap.add_argument("--top", type=int, default=24, help="opcodes and lines to list (default 24)")
    ap.add_argument("--out", help="write the markdown here (default: stdout)")
    a = ap.parse_args(argv)
    try:
        kernels = read_source(a.source)
        details = read_details(a.details) if a.details else None
    except (OSError, ValueError, KeyError) as e:
        print(f"ncu_compare: {e}", file=sys.stderr)
        return 2
    text = report(kernels, details, a.top)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
        print(f"wrote {a.out}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
