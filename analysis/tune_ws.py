"""Variants of the copy-engine forward (kernels_cu/flash2_ws.cu) built side by side, each
timed in a process of its own beside SDPA's cuDNN and flash backends: consumer warpgroups
per CTA at d = 64 (FLASHSIM_WS_CONSUMERS64, with the tile rows they give), K/V stages
(FLASHSIM_WS_STAGES).

    python3 analysis/tune_ws.py [--configs c2,c3,c3s3] [--d 64] [--ns 2048,4096,16384]

A config names macros and the Q tile's rows they give at d = 64 (CONFIGS below); its process builds
the kernels with those macros (NVRTC, all configs in parallel first, into CuPy's kernel
cache), sets fs.kernels' tables to match, and times the forward as `auto` runs it on
dense inputs, replaying its launches (the kernels' time alone). batch·N = 16k tokens,
heads = 2048/d, float16 and bfloat16, causal and not. Each case also reports the largest
error of O against float32 attention on the first problems. Writes
analysis/out/bench/tune_ws.md and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import _common as C  # noqa: E402

import flashsim as fs  # noqa: E402
from flashsim.bench import interleaved  # noqa: E402

OUT = os.path.join(C.DEFAULT_OUT, "bench")

CONFIGS = {  # name: (macros, Q tile rows at d = 64, K/V stages[, K/V tile rows at d = 64])
    "c2": (("FLASHSIM_WS_CONSUMERS64=2",), 128, 2),
    "c3": (("FLASHSIM_WS_CONSUMERS64=3",), 192, 2),
    "c3s3": (("FLASHSIM_WS_CONSUMERS64=3", "FLASHSIM_WS_STAGES=3"), 192, 3),
    "c3b64": (("FLASHSIM_WS_CONSUMERS64=3", "FLASHSIM_WS_BC64=64"), 192, 2, 64),
    # every warpgroup runs each of its tile's steps, masked over the tile's rows (NOTES v48)
    "c3all": (("FLASHSIM_WS_CONSUMERS64=3", "FLASHSIM_WS_WG_BOUND=0", "FLASHSIM_WS_WG_MASK=0"), 192, 2),
    "c3nomask": (("FLASHSIM_WS_CONSUMERS64=3", "FLASHSIM_WS_WG_MASK=0"), 192, 2),
    # O through the consumers' 16-byte stores, not the copy engine (NOTES v49)
    "c3o16": (("FLASHSIM_WS_CONSUMERS64=3", "FLASHSIM_WS_O_TMA=0"), 192, 2),
}


def child(name: str, d: int, Ns, reps: int, build_only: bool) -> list[dict]:
    """Builds (and, unless build_only, times) one config."""
    import cupy as cp
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from bench_variants import record
    macros, rows64, stages, *bc64 = CONFIGS[name]
    dev, K = fs.gpu._device, fs.kernels
    real = dev.compile_options
    dev.compile_options = lambda count_io: real(count_io) + tuple(f"-D{m}" for m in macros)
    K.WS_BLOCKS[64] = (rows64, bc64[0] if bc64 else K.WS_BLOCKS[64][1])
    K.WS_STAGES = stages
    rows = []
    for N in Ns:
        H, B = 2048 // d, 16384 // N
        for dtype in ("float16", "bfloat16"):
            tdt = getattr(torch, dtype)
            q, k, v = (torch.randn(B, H, N, d, device="cuda", dtype=tdt) for _ in range(3))
            fns, err = {}, {}
            for causal in (False, True):
                o = fs.gpu.attention(q, k, v, causal=causal)[0]
                # a NumPy scale takes the general path, whose launches record() replays
                replay = record(lambda: fs.gpu.attention(q, k, v, causal=causal,
                                                         scale=np.float32(d ** -0.5)))
                assert replay.ws and replay.launches == 1, "not the copy-engine forward"
                if build_only:
                    continue
                assert fs.gpu.block_sizes(q, v) == K.WS_BLOCKS[d]
                qf, kf, vf = (t[:1, :4].float() for t in (q, k, v))
                s = (qf @ kf.transpose(-1, -2)) / d ** 0.5
                if causal:
                    s = s.masked_fill(torch.ones(N, N, device="cuda", dtype=torch.bool).triu(1),
                                      float("-inf"))
                ref = torch.softmax(s, -1) @ vf
                err[causal] = float((o[:1, :4].float() - ref).abs().max())
                fns[(causal, "ws")] = (replay, None)
                for impl, be in (("SDPA cuDNN", SDPBackend.CUDNN_ATTENTION),
                                 ("SDPA flash", SDPBackend.FLASH_ATTENTION)):
                    fns[(causal, impl)] = (
                        lambda causal=causal: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                        lambda be=be: sdpa_kernel(be))
            if build_only:
                continue
            for (causal, impl), t in interleaved(cp, fns, reps).items():
                ms = float(np.median(t))
                flop = 4 * B * H * N * N * d / (2 if causal else 1)
                rows.append(dict(cfg=name, d=d, N=N, dtype=dtype, causal=causal, impl=impl, ms=ms,
                                 tflops=flop / ms / 1e9, err=err[causal] if impl == "ws" else None))
            print(f"{name}: N={N} {dtype} done", file=sys.stderr, flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--ns", default="2048,4096,16384")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    Ns = [int(x) for x in a.ns.split(",")]
    if a.child:
        print(json.dumps(child(a.child, a.d, Ns, a.reps, a.build_only)))
        return
    _, gpu = C.gpu_info()
    cfgs = a.configs.split(",")
    base = [sys.executable, os.path.abspath(__file__), "--d", str(a.d), "--ns", a.ns,
            "--reps", str(a.reps)]
    with ThreadPoolExecutor(len(cfgs)) as pool:     # the NVRTC builds, side by side
        list(pool.map(lambda c: subprocess.run(base + ["--child", c, "--build-only"], check=True,
                                               stdout=subprocess.DEVNULL), cfgs))
    rows = []
    for c in cfgs:
        r = subprocess.run(base + ["--child", c], check=True, stdout=subprocess.PIPE, text=True)
        rows += json.loads(r.stdout.strip().splitlines()[-1])
    ms = {(r["cfg"], r["N"], r["dtype"], r["causal"], r["impl"]): r["ms"] for r in rows}
    lines = [f"# Copy-engine forward variants, {gpu}, d = {a.d}, batch·N = 16k tokens", "",
             "| config | N | dtype | causal | ms | TFLOP/s | cuDNN time / this | flash time / this | "
             f"time / {cfgs[0]}'s | max abs err of O |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["impl"] != "ws":
            continue
        key = (r["N"], r["dtype"], r["causal"])
        lines.append(f"| {r['cfg']} | {r['N']} | {r['dtype']} | {r['causal']} | {r['ms']:.3f} | "
                     f"{r['tflops']:.0f} | {ms[(r['cfg'], *key, 'SDPA cuDNN')] / r['ms']:.3f} | "
                     f"{ms[(r['cfg'], *key, 'SDPA flash')] / r['ms']:.3f} | "
                     f"{r['ms'] / ms[(cfgs[0], *key, 'ws')]:.3f} | {r['err']:.2e} |")
    os.makedirs(OUT, exist_ok=True)
    C.write_text(os.path.join(OUT, "tune_ws.md"), "\n".join(lines))
    C.write_json(os.path.join(OUT, "tune_ws.json"), dict(device=gpu, rows=rows))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
