"""Variants of the decoding kernel (kernels_cu/splitkv_tc.cu) built side by side and timed
in one process on a few decoding steps, beside SDPA's flash and cuDNN backends: the K/V
tiles in flight (FLASHSIM_SKV_STAGES, set for every split kernel: the shipped build keeps 3 in
the 16-row kernel and 2 in the others, kernels.SPLITKV_STAGES).

    python3 analysis/tune_decode.py [--stages 2,3,4] [--out analysis/out/bench]

Each variant replaces the shipped split kernel in `flashsim.gpu.decode`'s launches (its
split count follows from its shared memory, as the launcher's does); outputs are checked
against the shipped build. bfloat16, d = 128, contiguous caches, non-causal.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys

import numpy as np

import _common as C  # noqa: E402

from flashsim import kernels as K  # noqa: E402
from flashsim.gpu import _device as dev, decode as gd  # noqa: E402
from bench_decode import D, median_ms, sdpa_ms  # noqa: E402

CONFIGS = [  # (name, heads, kv_heads, Nq, batch, L)
    ("gqa nq1 b8 64k", 32, 8, 1, 8, 65536),
    ("mha nq1 b8 64k", 32, 32, 1, 8, 65536),
    ("mha nq1 b1 16k", 32, 32, 1, 1, 16384),
    ("gqa nq4 b8 64k", 32, 8, 4, 8, 65536),
    ("gqa nq16 b8 64k", 32, 8, 16, 8, 65536),
    ("gqa nq16 b1 64k", 32, 8, 16, 1, 65536),
]


@functools.lru_cache(maxsize=None)
def variant_kernels(stages: int):
    """The bfloat16, d = 128 split kernels of one variant (built once)."""
    import cupy as cp
    code = (K.kernel_dir() / "splitkv_tc.cu").read_text()
    insts = [i for i in K.instances("splitkv_tc.cu")
             if i.kernel.startswith("splitkv_fwd") and i.D == D and i.dtype == "bfloat16"]
    opts = dev.compile_options(False) + (f"-DFLASHSIM_SKV_STAGES={stages}",)
    mod = cp.RawModule(code=code + f"\n// variant {stages}\n", options=opts,
                       name_expressions=[i.expr for i in insts])
    return {i.kernel + str(i.D) + i.dtype: mod.get_function(i.expr) for i in insts}


def run(cfg, variant, rng):
    import torch
    _, heads, kvh, Nq, batch, L = cfg
    q = torch.randn(batch, Nq, heads, D, device="cuda", dtype=torch.bfloat16)
    kc = torch.randn(batch, L, kvh, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    lens = np.full(batch, L, np.int32)
    real_kernel, real_stages = dev.kernel, K.SPLITKV_STAGES
    try:
        if variant is not None:
            ks = variant_kernels(variant)
            K.SPLITKV_STAGES = {r: variant for r in K.SPLITKV_ROWS}
            gd.dev.kernel = lambda name, dtype, count_io, D=None, *more: (
                ks[name + str(D) + dtype] if name.startswith("splitkv_fwd") else
                real_kernel(name, dtype, count_io, D, *more))
        pr = gd._problem(q, kc, vc, lens, None, None, None)
        plan = gd._plan(pr, None)
        launch, O, Lse, _ = gd._prepare(pr, plan, False, 1 / math.sqrt(D), False)
        launch()
        ms = median_ms(launch, rep_ms=100)
        out = gd.arrays.out(gd.dev.cupy(), O, "bfloat16", True).clone()
    finally:
        gd.dev.kernel = real_kernel
        K.SPLITKV_STAGES = real_stages
    bytes_ = 2 * batch * L * kvh * D * 2
    return ms, bytes_ / (ms * 1e-3), plan.num_splits, out, (q, kc, vc)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", default="2,3,4")
    ap.add_argument("--out", default=os.path.join(C.HERE, "out", "bench"))
    args = ap.parse_args(argv)
    import torch
    variants = [int(v) for v in args.stages.split(",")]
    rng = np.random.default_rng(0)
    lines = ["| config | SDPA flash | cuDNN | shipped | " +
             " | ".join(f"stages {s}" for s in variants) + " |",
             "|---" * (4 + len(variants)) + "|"]
    for cfg in CONFIGS:
        torch.manual_seed(0)
        ms0, bw0, s0, ref, (q, kc, vc) = run(cfg, None, rng)
        sd = sdpa_ms(q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2), cfg[2] != cfg[1])
        cells = [cfg[0], *(f"{sd[k]:.3f}" if sd[k] else "—" for k in ("flash", "cudnn")),
                 f"{ms0:.3f} ({bw0 / 1e12:.2f} TB/s, s={s0})"]
        for v in variants:
            torch.manual_seed(0)
            ms, bw, s, out, _ = run(cfg, v, rng)
            same = "" if torch.equal(out, ref) else f", max diff {float((out.float() - ref.float()).abs().max()):.1e}"
            cells.append(f"{ms:.3f} ({bw / 1e12:.2f}, s={s}{same})")
        lines.append("| " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tune_decode.md"), "w") as f:
        f.write(f"# {torch.cuda.get_device_name()}, bfloat16, d = {D}, times in ms "
                "(K/V bytes / time)\n\n" + "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
