"""Build, check and time variants of the tensor-core forward kernel side by side.

    python3 analysis/tune_tc.py [--n 4096] [--reps 20]

Each variant is flash2_tc.cu compiled with other tile macros (warps per CTA, Bc, the
minimum blocks per SM given to __launch_bounds__); each is checked against the
reference kernel's output on the same inputs and timed with CUDA events (median).
Needs a GPU and CuPy; prints one table (TFLOP/s by 4·B·H·N²·d).
"""

import argparse
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import flashsim as fs  # noqa: E402
from flashsim import kernels as K  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--variants", default="4:64:1,8:64:1,4:32:1,8:32:1,4:128:1,4:64:2",
                    help="warps:Bc:minblocks[:m-tiles per warp], comma-separated")
    ap.add_argument("--dims", type=lambda t: [int(x) for x in t.split(",")], default=None,
                    help="head dims to try (default 64,128)")
    a = ap.parse_args(argv)
    import cupy as cp
    src = (K.kernel_dir() / "flash2_tc.cu").read_text()
    rng = np.random.default_rng(0)
    N = a.n
    for D in (64, 128):
        H = 2048 // D
        B = 16384 // N
        q, k, v = (cp.asarray(rng.standard_normal((B * H, N, D)).astype(np.float16))
                   for _ in range(3))
        ref = cp.asnumpy(fs.gpu.attention(q, k, v, kernel="ref")[0]).astype(np.float32)
        kv_index = cp.arange(B * H, dtype=cp.int32)
        flops = 4 * B * H * N * N * D
        for var in a.variants.split(","):
            warps, bc, minb, *rest = (int(x) for x in var.split(":"))
            mt = rest[0] if rest else 1
            if a.dims and D not in a.dims:
                continue
            Br = 16 * warps * mt
            opts = fs.gpu.compile_options(False) + (f"-DFLASHSIM_TC_WARPS={warps}",
                                                    f"-DFLASHSIM_TC_BC={bc}",
                                                    f"-DFLASHSIM_TC_MINBLOCKS={minb}",
                                                    f"-DFLASHSIM_TC_MT={mt}")
            try:
                mod = cp.RawModule(code=src, options=opts,
                                   name_expressions=[f"flash2_fwd_tc<__half, {D}>"])
                kern = mod.get_function(f"flash2_fwd_tc<__half, {D}>")
            except Exception as e:  # noqa: BLE001  (a variant that does not build)
                print(f"D={D} {var}: build failed: {str(e)[:200]}")
                continue
            smem = (Br * D + 4 * bc * D) * 2
            kern.max_dynamic_shared_size_bytes = smem
            O = cp.empty_like(q)
            L = cp.empty((B * H, N), cp.float32)
            io = cp.zeros(16, cp.uint64)
            args = (q, k, v, kv_index, O, L, np.int32(N), np.int32(N), np.int32(-1),
                    np.int32(-1), np.float32(math.log2(math.e) / math.sqrt(D)), io)
            grid = (-(-N // Br), B * H)

            def run():
                kern(grid, (32 * warps,), args, shared_mem=smem)
            run()
            err = float(np.abs(cp.asnumpy(O).astype(np.float32) - ref).max())
            for _ in range(3):
                run()
            ts = []
            for _ in range(a.reps):
                e0, e1 = cp.cuda.Event(), cp.cuda.Event()
                e0.record()
                run()
                e1.record()
                e1.synchronize()
                ts.append(cp.cuda.get_elapsed_time(e0, e1))
            ms = float(np.median(ts))
            print(f"D={D} N={N} warps={warps} m-tiles={mt} Br={Br} Bc={bc} minblocks={minb} "
                  f"regs={kern.num_regs} smem={smem}: {ms:.3f} ms, {flops / ms / 1e9:.1f} TF/s, "
                  f"max|O - ref| = {err:.2e}", flush=True)


if __name__ == "__main__":
    main()
