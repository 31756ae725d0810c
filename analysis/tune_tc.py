"""Build, check and time variants of the tensor-core kernels side by side.

    python3 analysis/tune_tc.py [--n 4096] [--reps 20] [--dims 64,128]
        [--variants warps:Bc:minblocks[:m-tiles[:qreg]],...]
        [--bwd-variants BrB,...] [--bwd-source OTHER.cu] [--define NAME=VALUE ...]

Forward variants are flash2_tc.cu compiled with other tile macros (warps per CTA, Bc,
the minimum CTAs per SM given to __launch_bounds__, 16-row m-tiles per warp, Q_i's
fragments in registers (1) or re-read from shared memory (0)); backward variants set
the query rows per step BrB (Bc = 128, 8 warps), each also built from --bwd-source (say
an earlier flash2_tc.cu, from `git show REV:kernels_cu/flash2_tc.cu`) when given, so two
versions run side by side in one process. Each variant
is checked against the reference kernel's output on the same inputs and timed with
CUDA events (median); the backward times its main loop alone (the pre- and post-pass
are shared by all variants). Needs a GPU and CuPy; prints one line per variant
(TFLOP/s by 4·B·H·N²·d forward, 2.5× that backward).
"""

import argparse
import math
import re

import numpy as np

from _common import cuda_time  # (puts the repository root on sys.path)

import flashsim as fs  # noqa: E402
from flashsim import kernels as K  # noqa: E402


DEFINES: list[str] = []   # --define: macros added to every variant


def _build(cp, src, expr, macros):
    opts = fs.gpu.compile_options(False) + tuple(f"-D{m}" for m in (*macros, *DEFINES))
    mod = cp.RawModule(code=src, options=opts, name_expressions=[expr])
    return mod.get_function(expr)


def forward(cp, src, D, N, variants, reps, rng):
    H, B = 2048 // D, 16384 // N
    q, k, v = (cp.asarray(rng.standard_normal((B * H, N, D)).astype(np.float16))
               for _ in range(3))
    ref = cp.asnumpy(fs.gpu.attention(q, k, v, kernel="ref")[0]).astype(np.float32)
    flops = 4 * B * H * N * N * D
    for var in variants:
        warps, bc, minb, *rest = (int(x) for x in var.split(":"))
        mt = rest[0] if rest else 1
        qreg = rest[1] if len(rest) > 1 else 1
        Br = 16 * warps * mt
        try:
            kern = _build(cp, src, f"flash2_fwd_tc<__half, {D}{_plain(src, 'flash2_fwd_tc')}>",
                          (f"FLASHSIM_TC_WARPS={warps}", f"FLASHSIM_TC_BC={bc}",
                           f"FLASHSIM_TC_MINBLOCKS={minb}", f"FLASHSIM_TC_MT={mt}",
                           f"FLASHSIM_TC_QREG={qreg}"))
        except Exception as e:  # noqa: BLE001  (a variant that does not build)
            print(f"fwd D={D} {var}: build failed: {str(e)[:200]}")
            continue
        smem = (Br * D + 4 * bc * D) * 2
        kern.max_dynamic_shared_size_bytes = smem
        O = cp.empty_like(q)
        L = cp.empty((B * H, N), cp.float32)
        io = cp.zeros(16, cp.uint64)
        args = (q, k, v, _rows(cp, src, B * H, N, D), O, L, np.int32(N), np.int32(N),
                *_strides(src, D, 4), np.int32(-1),
                np.int32(-1), np.float32(math.log2(math.e) / math.sqrt(D)),
                *_no_variants(src), *_no_table(src), io)
        grid = (-(-N // Br), B * H)

        def run():
            kern(grid, (32 * warps,), args, shared_mem=smem)
        run()
        err = float(np.abs(cp.asnumpy(O).astype(np.float32) - ref).max())
        ms = cuda_time(cp, run, reps=reps)
        print(f"fwd D={D} N={N} warps={warps} m-tiles={mt} qreg={qreg} Br={Br} Bc={bc} "
              f"minblocks={minb} regs={kern.num_regs} smem={smem}: {ms:.3f} ms, "
              f"{flops / ms / 1e9:.1f} TF/s, max|O - ref| = {err:.2e}", flush=True)


def _plain(src: str, kernel: str) -> str:
    """The plain instance's last template arguments (every bool false) of ``kernel`` in
    ``src``: none in an older source, up to VAR, VL and the forward's CAP_ONLY now."""
    for m in re.finditer(rf"\b{kernel}\(", src):
        head = src[src.rfind("template <", 0, m.start()):m.start()]
        if "__global__" in head:
            return ", false" * head.split(">", 1)[0].count("bool ")
    return ""


def _no_variants(src: str) -> tuple:
    """No softcap or ALiBi constants (k_in, k_out, slopes), for a source whose kernels take
    them (the plain instance reads none)."""
    return (np.float32(0), np.float32(0), np.uint64(0)) if "bool VAR" in src else ()


def _rows(cp, src: str, P: int, N: int, D: int):
    """Dense (P, N, D) tensors' row table (common.cuh's at: problem p's rows at p·N·D in
    every tensor), or the K/V index of a source from before it."""
    if "AT_NUM" in src:
        return cp.asarray(np.repeat(np.arange(P, dtype=np.int64) * N * D, 8))
    return cp.arange(P, dtype=cp.int32)


def _strides(src: str, D: int, n: int) -> tuple:
    """The n row strides (D: dense) of a source whose kernels take them."""
    return (np.int32(D),) * n if "AT_NUM" in src else ()


def _no_table(src: str) -> tuple:
    """No varlen table (vl), for a source whose kernels take it (the dense instance
    reads none)."""
    return (np.uint64(0),) if "bool VL" in src else ()


def backward(cp, sources, D, N, variants, reps, rng):
    H, B = 2048 // D, 16384 // N
    q, k, v, do = (cp.asarray(rng.standard_normal((B * H, N, D)).astype(np.float16))
                   for _ in range(4))
    out, lse = fs.gpu.attention(q, k, v, kernel="tc")
    ref = fs.gpu.attention_backward(q, k, v, out, lse, do, kernel="ref")
    ref = [cp.asnumpy(x).astype(np.float32) for x in ref]
    P = B * H
    D_ = cp.sum(do.astype(cp.float32) * out.astype(cp.float32), axis=-1)
    flops = 2.5 * 4 * P * N * N * D
    scale = np.float32(1 / math.sqrt(D))
    Bc = K.TC_BWD_BLOCKS[D][1]
    for label, text in sources:
        for var in variants:
            brb = int(var)
            try:
                kern = _build(cp, text, f"flash2_bwd_tc<__half, {D}{_plain(text, 'flash2_bwd_tc')}>",
                              (f"FLASHSIM_TCB_BRB={brb}",))
            except Exception as e:  # noqa: BLE001
                print(f"bwd D={D} {label} BrB={brb}: build failed: {str(e)[:200]}")
                continue
            # this version's layout; an older source needs at most as much
            smem = K.smem_bytes("flash2_bwd_tc", brb, Bc, D, D, "float16")
            try:
                kern.max_dynamic_shared_size_bytes = smem
            except Exception as e:  # noqa: BLE001
                print(f"bwd D={D} {label} BrB={brb}: {smem} bytes of shared memory: {e}")
                continue
            dQacc = cp.zeros((P, N, D), cp.float32)
            dK, dV = cp.empty_like(k), cp.empty_like(v)
            args = (q, k, v, _rows(cp, text, P, N, D), do, lse, D_, dQacc, dK, dV, np.int32(N),
                    np.int32(N), *_strides(text, D, 6), np.int32(-1), np.int32(-1), scale, *_no_variants(text), np.uint64(0),
                    *_no_table(text), cp.zeros(16, cp.uint64))
            grid = (-(-N // Bc), P)

            def run():
                kern(grid, (K.TC_BWD_THREADS,), args, shared_mem=smem)
            run()
            errs = [float(np.abs(cp.asnumpy(x).astype(np.float32) - r).max())
                    for x, r in zip((dQacc, dK, dV), ref)]
            ms = cuda_time(cp, run, reps=reps)
            print(f"bwd D={D} N={N} {label} BrB={brb} Bc={Bc} regs={kern.num_regs} "
                  f"smem={smem}: {ms:.3f} ms, {flops / ms / 1e9:.1f} TF/s, max err dQ/dK/dV = "
                  + "/".join(f"{e:.1e}" for e in errs), flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--variants", default="4:64:1:2:1,8:64:1:1:1,4:64:2:2:0",
                    help="forward: warps:Bc:minblocks[:m-tiles[:qreg]], comma-separated "
                         "('' for none)")
    ap.add_argument("--bwd-variants", default="",
                    help="backward: query rows per step BrB, comma-separated")
    ap.add_argument("--bwd-source", default=None,
                    help="another flash2_tc.cu whose backward is timed beside this one's")
    ap.add_argument("--dims", type=lambda t: [int(x) for x in t.split(",")], default=[64, 128],
                    help="head dims to try (default 64,128)")
    ap.add_argument("--define", action="append", default=[],
                    help="NAME=VALUE macro for every variant (repeatable)")
    a = ap.parse_args(argv)
    DEFINES[:] = a.define
    import cupy as cp
    src = (K.kernel_dir() / "flash2_tc.cu").read_text()
    rng = np.random.default_rng(0)
    for D in a.dims:
        if a.variants:
            forward(cp, src, D, a.n, a.variants.split(","), a.reps, rng)
        if a.bwd_variants:
            sources = [("this", src)]
            if a.bwd_source:
                sources.append((a.bwd_source, open(a.bwd_source).read()))
            backward(cp, sources, D, a.n, a.bwd_variants.split(","), a.reps, rng)


if __name__ == "__main__":
    main()
