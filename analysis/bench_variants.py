"""What the variants cost on the fast rungs: window, softcap and ALiBi against plain
attention, forward (on a 9.0 device the Hopper rung, "ws" where the copy-engine forward
takes the inputs and the cp.async kernel beside it, and tc) and backward (wg on 9.0, and tc), on one GPU.

    python3 analysis/bench_variants.py [--ns 4096] [--ds 64,128] [--dtypes float16] [--reps 30]
                                       [--rungs wg,tc] [--power]

Each case's kernels are recorded from one `fs.gpu.attention` / `attention_backward`
call (the launches it makes, with their grids and arguments) and replayed, so the
times are the kernels' alone, not the general path's Python (which converts the slopes
and checks the inputs on every call). CUDA events around each replay, after warm-up,
medians over --reps, the cases taking turns (flashsim.bench.interleaved). float16 (and
bfloat16 with --dtypes float16,bfloat16: PyTorch tensors, which CuPy lacks), batch·N = 16k
tokens, heads = 2048/d. TFLOP/s count the FLOPs of the tiles the band
leaves (a window of w keys: ~N·w pairs), so a windowed launch that runs in time
proportional to its tiles keeps its TFLOP/s. Writes analysis/out/bench/variants.md and
.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import numpy as np

import flashsim as fs
from flashsim.bench import PowerSampler, interleaved

OUT = Path(__file__).resolve().parent / "out" / "bench"


def record(call):
    """The launches ``call()`` makes, to replay: (kernel, grid, block, args, smem) for
    those through the loader, and the copy-engine kernels' launchers with their arguments
    (flash2_fwd_ws and flash2_bwd_ws launch through their own parameter arrays, and
    re-encode their tensor maps per call from a cache)."""
    dev, f2 = fs.gpu._device, fs.gpu.flash2
    tma, wsf = f2._TmaLaunch, f2._WsForward
    launches = []
    real, real_tma, real_wsf, real_key = dev.launch, tma.__call__, wsf.__call__, f2._plan_key

    def spy(cp, kernel, grid, smem, args, threads=dev.THREADS):
        launches.append(("cupy", (kernel, grid, threads, args, smem)))
        return real(cp, kernel, grid, smem, args, threads)

    def spy_tma(self, *args, **kw):     # (the forward's are recorded whole, below)
        if not isinstance(self, wsf):
            launches.append(("ws", (real_tma, self, args, kw)))
        return real_tma(self, *args, **kw)

    def spy_wsf(self, *args, **kw):     # with its tile counter, zeroed again per replay
        launches.append(("ws", (real_wsf, self, args, kw)))
        return real_wsf(self, *args, **kw)
    # PyTorch's plain launches take the general path here: the fast path's launchers pass
    # raw pointers to buffers freed after the call, which a replay would write into
    dev.launch, tma.__call__, wsf.__call__ = spy, spy_tma, spy_wsf
    f2._plan_key = lambda *a, **kw: None
    try:
        result = call()
    finally:
        dev.launch, tma.__call__, wsf.__call__, f2._plan_key = real, real_tma, real_wsf, real_key
    if not launches:
        raise RuntimeError("record: the call launched nothing that can be replayed")
    for how, launch in launches:
        if how == "cupy" and launch[4] > 48 * 1024:
            launch[0].max_dynamic_shared_size_bytes = launch[4]

    def replay():
        for how, launch in launches:
            if how == "ws":
                fn, self, args, kw = launch
                fn(self, *args, **kw)
            else:
                kernel, grid, threads, args, smem = launch
                kernel(tuple(grid), (threads,), args, shared_mem=smem)
    replay.result = result          # the outputs the launches write, kept alive
    replay.ws = any(how == "ws" for how, _ in launches)
    replay.launches = len(launches)
    return replay


def pairs(Nq, Nk, causal, window):
    """(query, key) pairs the band leaves: what the FLOPs count."""
    band = fs.variants.make_band(causal, window)
    if band.unbounded:
        return Nq * Nk
    return int(band.allowed(np.arange(Nq), np.arange(Nk), Nk - Nq).sum())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ns", default="4096")
    ap.add_argument("--ds", default="64,128")
    ap.add_argument("--dtypes", default="float16", help="float16 and/or bfloat16")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rungs", default="wg,tc", help="wg (the Hopper rung, ws beside it) "
                    "and/or tc")
    ap.add_argument("--power", action="store_true",
                    help="the mean SM clock (MHz) and board power (W) over each case's timed "
                         "windows, and its energy per call (mJ), from nvidia-smi every 50 ms "
                         "(flashsim.bench.PowerSampler)")
    a = ap.parse_args(argv)
    if a.power:
        import shutil
        if shutil.which("nvidia-smi") is None:
            ap.error("--power reads the GPU's clock and power through nvidia-smi, which is "
                     "not on PATH: leave --power out")
    rungs = a.rungs.split(",")
    if not rungs or not set(rungs) <= {"wg", "tc"}:
        ap.error(f"--rungs: wg and/or tc, not {a.rungs}")
    import cupy as cp
    rng = np.random.default_rng(0)
    dev = cp.cuda.Device()
    name = cp.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()
    wg = dev.compute_capability == "90" and "wg" in rungs
    tc = ["tc"] if "tc" in rungs else []
    if not wg and not tc:
        ap.error(f"--rungs {a.rungs}: nothing to time on {name} (wg needs compute capability 9.0)")
    dtypes = a.dtypes.split(",")
    if not set(dtypes) <= {"float16", "bfloat16"}:
        ap.error(f"--dtypes: float16 and/or bfloat16, not {a.dtypes}")

    def normal(shape, dtype):
        x = rng.standard_normal(shape).astype(np.float32)
        if dtype == "float16":
            return cp.asarray(x.astype(np.float16))
        import torch
        return torch.as_tensor(x, device="cuda").to(torch.bfloat16)
    rows = []
    sampler = PowerSampler(dev.pci_bus_id) if a.power else None
    spans = {}                  # id(row) -> the host times of its windows
    for dtype, d, N in ((t, int(x), int(n)) for t in dtypes for x in a.ds.split(",")
                        for n in a.ns.split(",")):
        H, B = 2048 // d, 16384 // N
        q, k, v, do = (normal((B, H, N, d), dtype) for _ in range(4))
        slopes = (2.0 ** (-8.0 * (np.arange(H) + 1) / H)).astype(np.float32)
        cases = {
            "plain": dict(),
            "causal": dict(causal=True),
            "window 1024 causal": dict(window=(1024, 0)),
            "softcap 30": dict(softcap=30.0),
            "alibi": dict(alibi_slopes=slopes),
            "softcap 30 + alibi": dict(softcap=30.0, alibi_slopes=slopes),
            "causal softcap + alibi": dict(causal=True, softcap=30.0, alibi_slopes=slopes),
        }
        fns, flop = {}, {}
        for case, kw in cases.items():
            npairs = pairs(N, N, kw.get("causal", False), kw.get("window"))
            for kern in (["wg"] if wg else []) + tc:
                # the Hopper forward as "auto" runs it (ws where the copy engine takes
                # the case: d = 64 and 128, softcap/ALiBi at 64 in 64-key tiles) and,
                # beside ws, the cp.async kernel (FLASHSIM_TMA=0)
                for tma in ("1", "0") if kern == "wg" else ("1",):
                    os.environ["FLASHSIM_TMA"] = tma
                    replay = record(lambda: fs.gpu.attention(q, k, v, kernel=kern, **kw))
                    what = "fwd ws" if replay.ws else f"fwd {kern}"
                    if (case, what) not in fns:
                        fns[(case, what)] = (replay, None)
                        flop[(case, what)] = 4 * B * H * npairs * d
                os.environ.pop("FLASHSIM_TMA", None)
            out, lse = fs.gpu.attention(q, k, v, **kw)
            for kern in (["wg"] if wg and d in fs.kernels.WG_BWD_HEAD_DIMS else []) + tc:
                replay = record(lambda: fs.gpu.attention_backward(
                    q, k, v, out, lse, do, kernel=kern, **kw))
                what = "bwd ws" if replay.ws else f"bwd {kern}"   # ws: d = 128 on "wg"
                fns[(case, what)] = (replay, None)
                flop[(case, what)] = 2.5 * 4 * B * H * npairs * d
        shape_spans = {}
        times = interleaved(cp, fns, a.reps, spans=shape_spans)
        for (case, what), t in times.items():
            ms = float(np.median(t))
            rows.append(dict(dtype=dtype, d=d, N=N, case=case, kernel=what, ms=ms,
                             tflops=flop[(case, what)] / ms / 1e9))
            spans[id(rows[-1])] = shape_spans.get((case, what), [])
        if sampler:
            power(sampler, rows, spans)
        # the tables so far, after each shape: a run cut short keeps what it timed
        write(rows, name, dtypes)
        print(f"{dtype} d={d} N={N} done", file=sys.stderr, flush=True)
    if sampler:                 # the samples nvidia-smi had not yet passed on
        sampler.stop()
        power(sampler, rows, spans)
    print(write(rows, name, dtypes))


def power(sampler, rows, spans):
    """Each row's mean clock and power over its windows, and its energy per call."""
    for r in rows:
        got = sampler.mean(spans.get(id(r), ()))
        if got:
            r["mhz"], r["watts"], r["mj"] = round(got[0], 1), round(got[1], 1), round(got[1] * r["ms"], 3)


def write(rows, name, dtypes):
    """variants.md and .json from ``rows``; returns the table."""
    def key(r):
        return r["dtype"], r["d"], r["N"], r["kernel"]
    base = {key(r): r["ms"] for r in rows if r["case"] == "plain"}
    causal = {key(r): r["ms"] for r in rows if r["case"] == "causal"}
    pw = any("mhz" in r for r in rows)
    lines = [f"# Variants on the fast rungs, {name}, {', '.join(dtypes)}, batch·N = 16k tokens",
             "", "| dtype | d | N | case | kernel | ms | TFLOP/s | time / plain (same mask) |"
             + (" MHz | W | mJ / call |" if pw else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|" * 3 if pw else "")]
    for r in rows:
        ref = causal if ("causal" in r["case"] and "window" not in r["case"]) else base
        rel = r["ms"] / ref[key(r)]
        lines.append(f"| {r['dtype']} | {r['d']} | {r['N']} | {r['case']} | {r['kernel']} | "
                     f"{r['ms']:.3f} | {r['tflops']:.0f} | {rel:.3f} |"
                     + (f" {r.get('mhz', '')} | {r.get('watts', '')} | {r.get('mj', '')} |"
                        if pw else ""))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "variants.md").write_text("\n".join(lines) + "\n")
    (OUT / "variants.json").write_text(json.dumps(dict(device=name, rows=rows), indent=1))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
