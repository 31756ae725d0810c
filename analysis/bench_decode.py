"""Decoding on the GPU, timed in one process beside PyTorch SDPA's backends and the
device's copy bandwidth: `fs.gpu.attention_with_kvcache` (kernels_cu/splitkv_tc.cu).

    python3 analysis/bench_decode.py [--quick] [--out analysis/out/bench]

One decoding step per configuration: Nq ∈ {1, 4, 16} query rows, batch ∈ {1, 8, 64}, KV
lengths 1k–256k per sequence (full caches), 32 query heads over 8 K/V heads (GQA) and over
32 (MHA), d = 128, bfloat16, a contiguous cache and a paged one (pages of 256 rows in a
shuffled block table). Configurations whose K/V cache would pass 8 GB are left out.

Bytes are the compulsory ones: the K/V cache rows read once, q read and out written once.
Achieved bandwidth is those bytes over the median time, beside the device's copy bandwidth
measured here (a 2 GiB device-to-device copy, bytes read plus written). Times:
- "kernels": the launch alone (the split kernel, whose last part per Q tile merges the
  partials, through memory or, on 9.0 where the parts are short, in a thread block
  cluster), prepared once, as a serving loop would replay it;
- "call": `fs.gpu.attention_with_kvcache` itself, with its input checks;
- SDPA flash, efficient and cuDNN on the same contiguous cache viewed as (batch, heads,
  L, d), non-causal (SDPA aligns a causal mask to the top left, the cache to the bottom
  right; with Nq = 1 the two agree, and non-causal costs the same work for both), with
  ``enable_gqa`` for GQA; "—" where a backend refuses the shapes.
Inputs rotate among copies when one set would sit in L2. Writes decode.csv and decode.md.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys
import time

import numpy as np

import _common as C  # noqa: E402  (puts the repository root on sys.path)

import flashsim as fs  # noqa: E402
from flashsim.gpu import decode as gd  # noqa: E402

D = 128
LENGTHS = [1024, 4096, 16384, 65536, 262144]
QUICK_LENGTHS = [4096, 65536]
MAX_KV_BYTES = 8 << 30
PAGE = 256
L2_ROTATE_BYTES = 256 << 20     # rotate input sets until each pass touches this much


def median_ms(fn, rep_ms=60):
    from triton.testing import do_bench
    return float(do_bench(fn, warmup=10, rep=rep_ms, return_mode="median"))


def copy_bandwidth():
    import torch
    n = 1 << 31
    x = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    y = torch.empty_like(x)
    ms = median_ms(lambda: y.copy_(x), rep_ms=200)
    del x, y
    return 2 * n / (ms * 1e-3)


def sdpa_ms(q, k, v, gqa):
    """{backend: ms or None} for SDPA over (B, H, Nq, d) / (B, Hkv, L, d) views."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    out = {}
    for name, be in (("flash", SDPBackend.FLASH_ATTENTION),
                     ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                     ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel([be]):
                f = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
                f()
                torch.cuda.synchronize()
                out[name] = median_ms(f)
        except Exception:   # the backend does not take these shapes or strides
            out[name] = None
    return out


def bench_one(Nq, batch, L, heads, kv_heads, paged, rng):
    import torch
    dev = "cuda"
    kv_bytes = 2 * batch * L * kv_heads * D * 2
    sets = max(1, min(8, math.ceil(L2_ROTATE_BYTES / kv_bytes)))
    lens = np.full(batch, L, np.int32)
    inputs = []
    for _ in range(sets):
        q = torch.randn(batch, Nq, heads, D, device=dev, dtype=torch.bfloat16)
        if paged:
            pages = batch * (L // PAGE)
            kc = torch.randn(pages, PAGE, kv_heads, D, device=dev, dtype=torch.bfloat16)
            vc = torch.randn_like(kc)
            table = rng.permutation(pages).astype(np.int32).reshape(batch, L // PAGE)
        else:
            kc = torch.randn(batch, L, kv_heads, D, device=dev, dtype=torch.bfloat16)
            vc = torch.randn_like(kc)
            table = None
        inputs.append((q, kc, vc, table))
    # the plan and launches, prepared once per input set
    prepared = []
    for q, kc, vc, table in inputs:
        pr = gd._problem(q, kc, vc, lens, table, None, None)
        plan = gd._plan(pr, None)
        launch, O, Lse, _ = gd._prepare(pr, plan, False, 1 / math.sqrt(D), False)
        prepared.append((launch, O, Lse))
    it = iter(range(1 << 60))
    kernels = median_ms(lambda: prepared[next(it) % sets][0]())
    call = median_ms(lambda: (lambda s: fs.gpu.attention_with_kvcache(
        s[0], s[1], s[2], cache_seqlens=lens, block_table=s[3]))(inputs[next(it) % sets]))
    # check the first sequence against SDPA's math in fp32 (the same rows, gathered)
    q, kc, vc, table = inputs[0]
    if paged:
        idx = torch.as_tensor(table[0], device=dev).long()
        k0, v0 = kc[idx].reshape(1, L, kv_heads, D), vc[idx].reshape(1, L, kv_heads, D)
    else:
        k0, v0 = kc[:1], vc[:1]
    ours, _ = fs.gpu.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table)
    import torch.nn.functional as F
    ref = F.scaled_dot_product_attention(
        q[:1].transpose(1, 2).float(), k0.transpose(1, 2).float(), v0.transpose(1, 2).float(),
        enable_gqa=kv_heads != heads).transpose(1, 2)
    rel = float((ours[:1].float() - ref).norm() / ref.norm())
    sd = {}
    if not paged:
        sd = sdpa_ms(q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2),
                     kv_heads != heads)
    del inputs, prepared
    torch.cuda.empty_cache()
    compulsory = kv_bytes + 2 * batch * Nq * heads * D * 2
    return {"heads": heads, "kv_heads": kv_heads, "Nq": Nq, "batch": batch, "kv_len": L,
            "paged": paged, "num_splits": plan.num_splits, "kernel": plan.kernel,
            "bytes": compulsory, "kernels_ms": kernels, "call_ms": call, "rel_err": rel,
            **{f"sdpa_{k}_ms": v for k, v in sd.items()}}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.path.join(C.HERE, "out", "bench"))
    args = ap.parse_args(argv)
    import torch
    rng = np.random.default_rng(0)
    bw = copy_bandwidth()
    name = torch.cuda.get_device_name()
    print(f"{name}: copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    rows = []
    lengths = QUICK_LENGTHS if args.quick else LENGTHS
    t0 = time.time()
    for heads, kv_heads in ((32, 8), (32, 32)):
        for Nq in ((1, 16) if args.quick else (1, 4, 16)):
            for batch in ((1, 8) if args.quick else (1, 8, 64)):
                for L in lengths:
                    if 2 * batch * L * kv_heads * D * 2 > MAX_KV_BYTES:
                        continue
                    for paged in (False, True):
                        r = bench_one(Nq, batch, L, heads, kv_heads, paged, rng)
                        r["copy_bw"] = bw
                        rows.append(r)
                        print(_line(r), flush=True)
    os.makedirs(args.out, exist_ok=True)
    keys = sorted({k for r in rows for k in r}, key=lambda k: list(rows[0]).index(k)
                  if k in rows[0] else 99)
    with open(os.path.join(args.out, "decode.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    with open(os.path.join(args.out, "decode.md"), "w") as f:
        f.write(f"# Decoding, {name}, bfloat16, d = {D} ({time.strftime('%Y-%m-%d')})\n\n"
                f"Copy bandwidth {bw / 1e12:.2f} TB/s. `python3 analysis/bench_decode.py"
                f"{' --quick' if args.quick else ''}`; {time.time() - t0:.0f} s. Splits \"(cluster)\": "
                "the parts merge in a thread block cluster, not through memory.\n\n")
        f.write("| heads/kv | Nq | batch | L | cache | splits | kernels ms | % copy bw | call ms "
                "| SDPA flash | efficient | cuDNN | best SDPA / kernels | rel err |\n")
        f.write("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
        for r in rows:
            f.write(_line(r, md=True) + "\n")
    return 0


def _line(r, md=False):
    fmt = lambda x: "—" if x is None else f"{x:.3f}"
    sd = [r.get(f"sdpa_{k}_ms") for k in ("flash", "efficient", "cudnn")]
    best = min([x for x in sd if x is not None], default=None)
    frac = r["bytes"] / (r["kernels_ms"] * 1e-3) / r["copy_bw"]
    cells = [f"{r['heads']}/{r['kv_heads']}", r["Nq"], r["batch"], r["kv_len"],
             "paged" if r["paged"] else "contig",
             f"{r['num_splits']}{' (cluster)' if '_cl' in r['kernel'] else ''}",
             fmt(r["kernels_ms"]),
             f"{100 * frac:.0f}%", fmt(r["call_ms"]), *map(fmt, sd),
             "—" if best is None else f"{best / r['kernels_ms']:.2f}×", f"{r['rel_err']:.1e}"]
    return ("| " + " | ".join(map(str, cells)) + " |") if md else "  ".join(map(str, cells))


if __name__ == "__main__":
    sys.exit(main())
