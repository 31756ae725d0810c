"""Packed varlen batches on the fast rungs, against the same tokens padded to a dense
batch and against SDPA's FlashAttention-2 varlen kernels, on one GPU.

    python3 analysis/bench_varlen.py [--total 16384] [--ds 64,128] [--reps 30]

A packed batch of ~--total tokens in sequences of lengths drawn between --min and --max
(seeded), heads = 2048/d, float16, causal and not. Timed side by side (CUDA events after
warm-up, medians over --reps, the entries taking turns: flashsim.bench.interleaved):

- ``fs varlen``: `fs.gpu.attention_varlen` and its backward, their launches recorded
  and replayed (bench_variants.record: the kernels alone, not the Python around them;
  the heads-first copies of the packed arrays are part of the call and not replayed);
- ``fs padded``: `fs.gpu.attention` on the batch padded to the longest sequence (the
  dense plain instance through the PyTorch fast path; what padding costs);
- ``sdpa varlen``: PyTorch's `aten._flash_attention_forward/_backward` with the same
  cu_seqlens (FlashAttention-2's varlen kernels), where this PyTorch has them.

TFLOP/s count the real pairs only (Σ Nq_b·Nk_b, or the causal triangle), for every
entry. Writes analysis/out/bench/varlen.md and .json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from bench_variants import OUT, pairs, record

import flashsim as fs  # noqa: E402
from flashsim.bench import interleaved  # noqa: E402


def lengths(total: int, lo: int, hi: int, rng) -> np.ndarray:
    out = []
    while sum(out) < total:
        out.append(int(rng.integers(lo, hi + 1)))
    out[-1] -= sum(out) - total          # exactly `total` tokens
    return np.array([n for n in out if n > 0])


def sdpa_varlen(torch, q, k, v, cu, n_max, causal):
    """(forward, backward) closures on aten's FlashAttention-2 varlen kernels, or None."""
    fwd = getattr(torch.ops.aten, "_flash_attention_forward", None)
    bwd = getattr(torch.ops.aten, "_flash_attention_backward", None)
    if fwd is None or bwd is None:
        return None
    try:
        res = fwd(q, k, v, cu, cu, n_max, n_max, 0.0, causal, False)
        out, lse, seed, offset = res[0], res[1], res[2], res[3]
        do = torch.randn_like(out)
        bwd(do, q, k, v, out, lse, cu, cu, n_max, n_max, 0.0, causal, seed, offset)
    except (RuntimeError, TypeError) as e:
        print(f"sdpa varlen unavailable: {str(e)[:200]}", file=sys.stderr)
        return None
    return (lambda: fwd(q, k, v, cu, cu, n_max, n_max, 0.0, causal, False),
            lambda: bwd(do, q, k, v, out, lse, cu, cu, n_max, n_max, 0.0, causal, seed,
                        offset))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--total", type=int, default=16384)
    ap.add_argument("--min", type=int, default=256)
    ap.add_argument("--max", type=int, default=4096)
    ap.add_argument("--ds", default="64,128")
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args(argv)
    import cupy as cp
    import torch
    rng = np.random.default_rng(0)
    dev = cp.cuda.Device()
    name = cp.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()
    n = lengths(a.total, a.min, a.max, rng)
    cu = np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
    T, B, n_max = int(cu[-1]), len(n), int(n.max())
    rows = []
    for d in (int(x) for x in a.ds.split(",")):
        H = 2048 // d
        q, k, v, do = (torch.randn((T, H, d), dtype=torch.float16, device="cuda")
                       for _ in range(4))
        # the padded batch: sequence b in rows 0..n_b of batch entry b, the rest noise
        qp, kp, vp, dop = (torch.randn((B, H, n_max, d), dtype=torch.float16, device="cuda")
                           for _ in range(4))
        cu_t = torch.tensor(cu, device="cuda")
        for causal in (False, True):
            real = sum(pairs(int(x), int(x), causal, None) for x in n)
            fns, flop = {}, {}
            fns["fs varlen", "fwd"] = (record(lambda: fs.gpu.attention_varlen(
                q, k, v, cu, cu, causal=causal)), None)
            out, lse = fs.gpu.attention_varlen(q, k, v, cu, cu, causal=causal)
            fns["fs varlen", "bwd"] = (record(lambda: fs.gpu.attention_varlen_backward(
                q, k, v, out, lse, do, cu, cu, causal=causal)), None)
            # PyTorch tensors take the fast path (cached launch plans, ~3 µs of Python),
            # which launches without fs.gpu._device: timed as called
            fns["fs padded", "fwd"] = (lambda: fs.gpu.attention(qp, kp, vp, causal=causal),
                                       None)
            outp, lsep = fs.gpu.attention(qp, kp, vp, causal=causal)
            fns["fs padded", "bwd"] = (lambda: fs.gpu.attention_backward(
                qp, kp, vp, outp, lsep, dop, causal=causal), None)
            sd = sdpa_varlen(torch, q, k, v, cu_t, n_max, causal)
            if sd is not None:
                fns["sdpa varlen", "fwd"], fns["sdpa varlen", "bwd"] = (sd[0], None), (sd[1], None)
            for key in fns:
                flop[key] = (4 if key[1] == "fwd" else 10) * H * real * d
            times = interleaved(cp, fns, a.reps)
            for (who, what), t in times.items():
                ms = float(np.median(t))
                rows.append(dict(d=d, causal=causal, who=who, what=what, ms=ms,
                                 tflops=flop[who, what] / ms / 1e9))
            print(f"d={d} causal={causal} done", file=sys.stderr, flush=True)
    lines = [f"# Packed varlen batches, {name}, float16, {T} tokens in {B} sequences of "
             f"{int(n.min())}–{n_max} (heads = 2048/d)", "",
             "| d | causal | pass | who | ms | TFLOP/s (real pairs) | time / sdpa varlen |",
             "|---|---|---|---|---|---|---|"]
    sdpa = {(r["d"], r["causal"], r["what"]): r["ms"] for r in rows if r["who"] == "sdpa varlen"}
    for r in rows:
        ref = sdpa.get((r["d"], r["causal"], r["what"]))
        rel = f"{r['ms'] / ref:.2f}" if ref else "–"
        lines.append(f"| {r['d']} | {r['causal']} | {r['what']} | {r['who']} | {r['ms']:.3f} "
                     f"| {r['tflops']:.0f} | {rel} |")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "varlen.md").write_text("\n".join(lines) + "\n")
    (OUT / "varlen.json").write_text(json.dumps(dict(device=name, lengths=n.tolist(),
                                                     rows=rows), indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
