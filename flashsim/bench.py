"""Side-by-side GPU timing of attention, forward and backward, in one process.

    flashsim bench [--quick] [--ds 32,64,96,128,160,192,224,256] [--ns 2048,4096] [--dtypes float16] \
                   [--causal both|yes|no] [--idle] [--power] [--out bench] [--json]
    python3 analysis/bench_attention.py ...     (the same, writing to analysis/out/bench)

Times, with CUDA events after warm-up (median of --reps, the implementations taking
turns rep by rep; each rep a window of ~50 ms of calls queued behind ~1 s of untimed
calls of its own, so that each implementation runs at the clock its own power draw gives
a card at its power limit rather than its neighbour's, and the events time the GPU's
work, as in a training loop whose host runs ahead; the host's time per call is reported
apart; --idle starts each window on an idle stream instead, host time included), on inputs
several times the L2 size:
flashsim's kernels (`fs.gpu`: auto, the one it picks for the GPU and shape; wg, the Hopper
rung; tc; ref), a dense CuPy attention
(matmul, softmax, matmul; float16 only, CuPy has no bfloat16), and PyTorch SDPA's flash, cuDNN,
efficient and math backends when PyTorch is present. Grid (each part can be chosen): float16 and
bfloat16; d ∈ {64, 96, 128, 192, 256} (the fast rungs' instances and two head dims between
them); N ∈ {512 … 16k} with batch·N = 16k tokens and heads = 2048/d (rounded down);
causal and not; a progress bar (tqdm) on stderr over the shapes. TFLOP/s by FlashAttention's convention: forward 4·B·H·N²·d (halved when
causal), backward 2.5× that. Writes bench.md (table), bench.json (GPU, versions, date,
every number) and bench.png (when matplotlib is there), and prints each flashsim
kernel's ratio to SDPA-flash and to cuDNN.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys

import numpy as np

import flashsim as fs

TOKENS = 16384
HIDDEN = 2048


# the head dims of the default grid, every multiple of 32 up to 256 (heads = HIDDEN // d)
DEFAULT_DS = "32,64,96,128,160,192,224,256"


def flops(B, H, N, d, causal, backward=False):
    f = 4 * B * H * N * N * d / (2 if causal else 1)
    return f * (2.5 if backward else 1.0)


def dense_cupy(cp, q, k, v, causal, scale):
    """Unfused attention: S and P materialised (float16, fp32 softmax)."""
    S = cp.matmul(q, k.swapaxes(-1, -2)).astype(cp.float32) * scale
    if causal:
        N = S.shape[-1]
        S = cp.where(cp.tri(N, dtype=bool), S, -cp.inf)
    S -= S.max(axis=-1, keepdims=True)
    P = cp.exp(S)
    P /= P.sum(axis=-1, keepdims=True)
    return cp.matmul(P.astype(q.dtype), v)


class PowerSampler:
    """The GPU's SM clock (MHz) and board power (W), sampled by ``nvidia-smi`` every
    ``period_ms`` while the benchmark runs (``--power``), so that each timing can be read
    beside the clock and power it ran at: a card at its power limit sets its clock from the
    power drawn, and there a kernel's time is its energy per call over the cap (NOTES v47,
    v81, v89). ``gpu``: nvidia-smi's ``-i`` (an index or a PCI bus id, as CuPy's device
    gives it); ``exe``: the program to run.

    nvidia-smi's own timestamps place each sample (its output reaches a pipe in blocks),
    so ``mean`` is exact only for spans the samples read so far cover; ``stop`` ends the
    sampling and reads the rest."""

    QUERY = "timestamp,clocks.sm,power.draw"

    def __init__(self, gpu=None, period_ms: int = 50, exe: str = "nvidia-smi"):
        import shutil
        import subprocess
        import threading
        path = shutil.which(exe)
        if path is None:
            raise FileNotFoundError(f"{exe} is not on PATH: --power reads the GPU's clock and "
                                    "power through it (leave --power out to time without)")
        cmd = [path, f"--query-gpu={self.QUERY}", "--format=csv,noheader,nounits",
               "-lms", str(int(period_ms))] + ([] if gpu is None else ["-i", str(gpu)])
        self.samples: list[tuple[float, float, float]] = []     # (host time, MHz, W)
        self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                      text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        import atexit
        atexit.register(self._end)   # (a run cut short leaves no nvidia-smi behind)

    @staticmethod
    def parse(line: str):
        """(host time, MHz, W) from one line of nvidia-smi's CSV, or None (a field it could
        not read, such as "[N/A]", or a line of another form)."""
        try:
            ts, mhz, watts = (x.strip() for x in line.split(","))
            t = datetime.datetime.strptime(ts, "%Y/%m/%d %H:%M:%S.%f").timestamp()
            return t, float(mhz), float(watts)
        except ValueError:
            return None

    def _read(self):
        for line in self._proc.stdout:
            x = self.parse(line)
            if x is not None:
                self.samples.append(x)

    def mean(self, spans):
        """(mean MHz, mean W, samples) over the samples inside any of ``spans`` ((t0, t1)
        host times, time.time()'s), or None where none fell inside."""
        xs = [(mhz, w) for t, mhz, w in list(self.samples)
              if any(t0 <= t <= t1 for t0, t1 in spans)]
        if not xs:
            return None
        return (sum(m for m, _ in xs) / len(xs), sum(w for _, w in xs) / len(xs), len(xs))

    def _end(self):
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except Exception:      # (it did not stop: the samples so far stand)
                self._proc.kill()

    def stop(self):
        """End the sampling; every sample nvidia-smi wrote is read by the return. Says so
        on stderr where it wrote none (an id it did not know, say)."""
        code = self._proc.poll()
        self._end()
        self._reader.join(timeout=5)
        if not self.samples:
            print(f"--power: nvidia-smi gave no samples (exit status {code}: it ran "
                  f"{' '.join(self._proc.args)})", file=sys.stderr)


def interleaved(cp, fns, reps, warmup=3, settle_ms=1000.0, queued=True, host=None,
                window_ms=50.0, spans=None):
    """Milliseconds per call of each rep, per entry of ``fns`` ({key: (fn, context
    factory or None)}), timed with CUDA events around a window of calls lasting about
    ``window_ms`` (at least one call; 0: one call), the entries taking turns rep by rep.

    Each timed window comes after untimed calls of its own entry lasting ``settle_ms``
    (at least one). A kernel's speed depends on what ran before it: a Hopper card at its
    power limit sets its clock from the power drawn over the last tens of milliseconds,
    so a kernel timed within ~100 ms of another inherits that one's clock. On an H200 at
    its 700 W cap (d = 128, N = 4k), cuDNN's and flashsim's forwards ran 10% faster in
    the first 30 ms after SDPA-flash's (which draws less power a cycle) than after 300 ms
    of their own calls, and 3% slower right after cuDNN's backward; both settled within
    100–300 ms (kernels_cu/NOTES.md, v47). With 10 ms of settling each implementation
    was timed at its predecessor's clock. Earlier, on an H100, the kernel that followed
    SDPA-math's backward measured up to 23% slower (NOTES, "Timing"). 300 ms, the
    default until v89, was not always enough: at d = 128, N = 2k (H200, causal) a
    forward that followed the other's backward still ran up to 17% off its own pace
    100–300 ms after the switch and settled within ~600 ms (NOTES, v89), so the timed
    window now comes after 1 s.

    ``queued`` (the default): the timed window is queued behind the settling calls, as
    a training loop's calls queue behind each other, so the events time the GPU's work
    alone and the host's is hidden (while it issues calls faster than the GPU runs them;
    ``host`` gets that cost). Otherwise the window starts on an idle stream after a
    synchronize, host-side launch cost included; on an H200 a single call timed so
    measured 0.1–0.3 ms above the same kernels queued (NOTES, v46). ``host``, a dict,
    gets per key the microseconds of host time per call over the first ~10 ms of each
    settling loop (later calls may wait for room in the launch queue).

    ``spans``, a dict, gets per key and rep the host times (time.time()) between which the
    GPU ran that rep's timed window and, before it, as much of its settling as makes the
    span at least 200 ms (a PowerSampler's samples there say the clock and power that rep
    ran at); the window ends when its stop event is reached, which the host waits for."""
    import contextlib
    import time

    def timed_call(key, fn, ctx, untimed, timed, host_calls=0):
        """``untimed`` calls of fn, then ``timed`` calls timed (ms per call)."""
        with (ctx() if ctx else contextlib.nullcontext()):
            t0 = time.perf_counter()
            for i in range(untimed):
                fn()
                if host is not None and key is not None and i + 1 == host_calls:
                    host.setdefault(key, []).append(
                        (time.perf_counter() - t0) / host_calls * 1e6)
            if not queued:
                cp.cuda.Device().synchronize()
            start, stop = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            for _ in range(timed):
                fn()
            stop.record()
            stop.synchronize()
            t1 = time.time()
        ms = cp.cuda.get_elapsed_time(start, stop)
        if spans is not None and key is not None:
            before = min(max(0.0, 200.0 - ms), untimed * ms / timed)   # of the settling
            spans.setdefault(key, []).append((t1 - (ms + before) / 1e3, t1))
        return ms / timed
    # the warm-up's last call sizes each entry's settling calls and window
    calls = {}
    for key, (fn, ctx) in fns.items():
        timed_call(None, fn, ctx, warmup, 1)
        ms = max(timed_call(None, fn, ctx, 0, 1), 1e-3)
        calls[key] = (max(1, math.ceil(settle_ms / ms)), max(1, math.ceil(window_ms / ms)),
                      max(1, math.ceil(10.0 / ms)))
    times = {key: [] for key in fns}
    for _ in range(reps):
        for key, (fn, ctx) in fns.items():
            settle, window, host_calls = calls[key]
            times[key].append(timed_call(key, fn, ctx, settle, window,
                                         min(settle, host_calls)))
    return times


def _reps(text):
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n}: --reps takes at least 1 (the median of the reps)")
    return n


def _ms(text):
    ms = float(text)
    if not ms >= 0:      # NaN too
        raise argparse.ArgumentTypeError(f"{text}: milliseconds are 0 or more (0: one call)")
    return ms


def _dtypes(text):
    out = text.split(",")
    bad = [x for x in out if x not in ("float16", "bfloat16")]
    if bad:
        raise argparse.ArgumentTypeError(f"{bad[0]!r}: the benchmark's dtypes are float16 "
                                         "and bfloat16")
    return out


# the implementations beside flashsim's kernels (flashsim-KERNEL), as --only names them
OTHERS = ("dense-cupy", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "sdpa-math")


def _kernels(text):
    from flashsim.gpu.flash2 import KERNELS
    out = text.split(",")
    bad = [x for x in out if x not in KERNELS]
    if bad:
        raise argparse.ArgumentTypeError(f"{bad[0]!r}: flashsim's kernels are "
                                         f"{', '.join(KERNELS)}")
    return out


def _only(text):
    from flashsim.gpu.flash2 import KERNELS
    out = text.split(",")
    known = [f"flashsim-{k}" for k in KERNELS] + list(OTHERS)
    bad = [x for x in out if x not in known]
    if bad:
        raise argparse.ArgumentTypeError(f"{bad[0]!r}: the implementations are "
                                         f"{', '.join(known)}")
    return set(out)


def _ns(text):
    try:
        out = [int(x) for x in text.split(",")]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: --ns takes sequence lengths such as "
                                         "2048,4096")
    return out


def main(argv=None, default_out: str = "bench", prog: str | None = None):
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="N ∈ {1k, 4k, 16k}, float16 only")
    ap.add_argument("--reps", type=_reps, default=5)
    ap.add_argument("--settle-ms", type=_ms, default=1000.0,
                    help="untimed calls of the same implementation before each timed "
                         "window, for about this long (at least one call): long enough for "
                         "a card at its power limit to reach this implementation's clock")
    ap.add_argument("--window-ms", type=_ms, default=50.0,
                    help="each rep times as many calls as take about this long (at least "
                         "one; 0: one call) and reports the time per call")
    ap.add_argument("--dtypes", default=None, type=_dtypes,
                    help="float16, bfloat16 or both, comma-separated (default: both)")
    ap.add_argument("--resume", action="store_true",
                    help="keep the shapes already in OUT/bench.json (a run cut short) and "
                         "time only the rest")
    ap.add_argument("--out", default=default_out, help=f"output folder (default: {default_out})")
    ap.add_argument("--ds", default=DEFAULT_DS,
                    help=f"head dims, comma-separated (default: {DEFAULT_DS})")
    ap.add_argument("--causal", choices=("both", "yes", "no"), default="both",
                    help="time with the causal mask, without, or both (default)")
    ap.add_argument("--json", action="store_true",
                    help="print every timed row as JSON on stdout at the end")
    ap.add_argument("--kernels", default="auto,wg,tc,ref", type=_kernels,
                    help="flashsim kernels to time, comma-separated (default: all): auto "
                         "(the one fs.gpu.attention picks for the GPU and shape), wg (the "
                         "Hopper rung; skipped on other GPUs), tc, ref")
    ap.add_argument("--plot-only", metavar="BENCH_JSON", default=None,
                    help="redraw bench.png from a saved bench.json (no GPU needed)")
    ap.add_argument("--ref-max-n", type=int, default=1024,
                    help="time the reference kernels (about 1 TFLOP/s) only up to this N")
    ap.add_argument("--ns", default=None, type=_ns, help="sequence lengths N to time, "
                    "comma-separated (default: 512 to 16384)")
    ap.add_argument("--idle", action="store_true",
                    help="time each call on an idle stream after a synchronize, its host-side "
                         "launch cost included (default: queued behind its settling calls, "
                         "the GPU's time alone; host time per call is reported apart)")
    ap.add_argument("--power", action="store_true",
                    help="sample the GPU's SM clock and board power with nvidia-smi every "
                         "50 ms and report, per implementation, their means over its timed "
                         "windows (MHz, W; the JSON also the energy per call, mJ)")
    ap.add_argument("--only", default=None, type=_only,
                    help="implementations to time, comma-separated (default: all): "
                         "flashsim-KERNEL for each of --kernels, " + ", ".join(OTHERS))
    a = ap.parse_args(argv)
    if a.power and not a.plot_only:
        import shutil
        if shutil.which("nvidia-smi") is None:
            ap.error("--power reads the GPU's clock and power through nvidia-smi, which is "
                     "not on PATH: install the NVIDIA driver's tools or leave --power out")
    left = sorted(x for x in a.only or () if x.startswith("flashsim-")
                  and x[len("flashsim-"):] not in a.kernels)
    if left:
        ap.error(f"--only names {left[0]}, which --kernels ({','.join(a.kernels)}) does not "
                 f"time: add {left[0][len('flashsim-'):]} to --kernels")
    if a.plot_only:
        data = json.load(open(a.plot_only))
        return plot(data["rows"], data["meta"], os.path.splitext(a.plot_only)[0] + ".png")
    try:
        ds = [int(x) for x in a.ds.split(",")]
    except ValueError:
        ap.error(f"--ds takes head dims such as 64,128; got {a.ds!r}")
    if not fs.gpu.available():
        print("flashsim bench needs a CUDA GPU and CuPy (pip install \"flashsim[cuda12]\" or "
              "\"flashsim[cuda13]\"); --plot-only redraws a saved bench.json without one",
              file=sys.stderr)
        return 2
    import cupy as cp
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
        have_torch = torch.cuda.is_available()
    except ImportError:
        have_torch = False
    os.makedirs(a.out, exist_ok=True)
    only = a.only

    def want(name):
        return only is None or name in only
    dev = cp.cuda.runtime.getDeviceProperties(0)
    gpu = dev["name"].decode() if isinstance(dev["name"], bytes) else dev["name"]
    Ns = [1024, 4096, 16384] if a.quick else [512, 1024, 2048, 4096, 8192, 16384]
    if a.ns:
        Ns = a.ns
    dtypes = ["float16"] if a.quick else ["float16", "bfloat16"]
    if a.dtypes:
        dtypes = a.dtypes
    rows = []
    meta = {"gpu": gpu, "date": datetime.date.today().isoformat(),
            "cupy": cp.__version__, "torch": torch.__version__ if have_torch else None,
            "python": platform.python_version(), "tokens": TOKENS, "hidden": HIDDEN,
            "timing": f"CUDA events, median of {a.reps} after 3 warm-ups, implementations "
                      f"interleaved, each rep a window of ~{a.window_ms:g} ms of calls (time "
                      f"per call) after {a.settle_ms:g} ms of untimed calls of its own, "
                      + ("on an idle stream after a synchronize (host time "
                         "included)" if a.idle else "queued behind them (GPU "
                         "time; host µs per call apart)")}
    json_path = os.path.join(a.out, "bench.json")
    if a.resume and os.path.exists(json_path):
        rows = json.load(open(json_path))["rows"]
    done = {(r["dtype"], r["d"], r["N"], r["causal"]) for r in rows}

    def save():      # after every shape, so that a run cut short keeps what it timed
        with open(json_path, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    rng = np.random.default_rng(0)
    sampler = PowerSampler(cp.cuda.Device().pci_bus_id) if a.power else None
    if sampler:
        meta["power"] = ("nvidia-smi every 50 ms: the mean SM clock and board power over "
                         "each implementation's timed windows, each with as much of its "
                         "settling before it as makes 200 ms")
    spans = {}                  # (shape, name, "fwd"|"bwd") -> the host times of its windows

    def fill_power(rs):
        """rs' clock and power (fwd_mhz, fwd_w, fwd_mj, bwd_…) from the samples so far."""
        for r in rs:
            for way in ("fwd", "bwd"):
                got = sampler.mean(spans.get(((r["dtype"], r["d"], r["N"], r["causal"]),
                                              r["impl"], way), ()))
                if got and r.get(f"{way}_ms"):
                    r[f"{way}_mhz"], r[f"{way}_w"] = round(got[0], 1), round(got[1], 1)
                    r[f"{way}_mj"] = round(got[1] * r[f"{way}_ms"], 3)
    backends = {}
    if have_torch:
        backends = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
                    "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION, "sdpa-math": SDPBackend.MATH}
    from tqdm import tqdm
    masks = {"both": (False, True), "yes": (True,), "no": (False,)}[a.causal]
    shapes = [(dtype, d, N, causal) for dtype in dtypes for d in ds for N in Ns
              for causal in masks if (dtype, d, N, causal) not in done]
    for dtype, d, N, causal in tqdm(shapes, desc="bench", unit="shape", file=sys.stderr):
        H = HIDDEN // d
        B = TOKENS // N
        scale = 1 / math.sqrt(d)
        tdt = getattr(torch, dtype) if have_torch else None
        if have_torch:
            q, k, v, do = (torch.randn(B, H, N, d, device="cuda", dtype=tdt)
                           for _ in range(4))
        else:
            q, k, v, do = (cp.asarray(rng.standard_normal((B, H, N, d)).astype(dtype))
                           for _ in range(4))
        ff, fb = flops(B, H, N, d, causal), flops(B, H, N, d, causal, True)
        cfg = dict(dtype=dtype, d=d, N=N, B=B, H=H, causal=causal)

        def add(name, fwd_reps, bwd_reps, fwd_host, bwd_host):
            fwd_ms = float(np.median(fwd_reps))
            bwd_ms = float(np.median(bwd_reps)) if bwd_reps else None
            rows.append({**cfg, "impl": name, "fwd_ms": fwd_ms, "bwd_ms": bwd_ms,
                         "fwd_host_us": float(np.median(fwd_host)) if fwd_host else None,
                         "bwd_host_us": float(np.median(bwd_host)) if bwd_host else None,
                         "fwd_ms_reps": [round(t, 5) for t in fwd_reps],
                         "bwd_ms_reps": [round(t, 5) for t in bwd_reps or ()],
                         "fwd_tflops": ff / fwd_ms / 1e9 if fwd_ms else None,
                         "bwd_tflops": fb / bwd_ms / 1e9 if bwd_ms else None})
            # each result as it comes, above the progress bar (stdout stays for the table
            # or the JSON)
            tqdm.write(f"{dtype} d={d} N={N} causal={causal} {name}: "
                       f"fwd {fwd_ms and round(ff / fwd_ms / 1e9, 1)} TF/s, "
                       f"bwd {bwd_ms and round(fb / bwd_ms / 1e9, 1)} TF/s", file=sys.stderr)

        # every implementation's forward and backward, timed interleaved: rep r
        # of each before rep r + 1 of any, so a slow spell of the GPU (clocks,
        # a neighbour) lands on all of them alike and the ratios stay fair
        fns = {}     # (name, "fwd"|"bwd") -> (fn, context factory or None)
        for kern in a.kernels:
            if not want(f"flashsim-{kern}") or (kern == "ref" and N > a.ref_max_n):
                continue
            try:
                out, lse = fs.gpu.attention(q, k, v, causal=causal, kernel=kern)
            except ValueError as e:    # wg off Hopper
                tqdm.write(f"  flashsim-{kern}: {str(e)[:80]}", file=sys.stderr)
                continue
            fns[f"flashsim-{kern}", "fwd"] = (
                lambda kern=kern: fs.gpu.attention(q, k, v, causal=causal,
                                                   kernel=kern), None)
            fns[f"flashsim-{kern}", "bwd"] = (
                lambda kern=kern, out=out, lse=lse: fs.gpu.attention_backward(
                    q, k, v, out, lse, do, causal=causal, kernel=kern), None)
        if want("dense-cupy") and dtype == "float16" and B * H * N * N * 4 <= 8 * 2**30:
            qc, kc, vc = (cp.from_dlpack(x) if have_torch else x for x in (q, k, v))
            fns["dense-cupy", "fwd"] = (
                lambda qc=qc, kc=kc, vc=vc: dense_cupy(cp, qc, kc, vc, causal, scale),
                None)
        for name, be in backends.items():
            if not want(name):
                continue
            if name == "sdpa-math" and B * H * N * N * 4 > 8 * 2**30:
                continue
            qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))
            try:
                with sdpa_kernel(be):
                    o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
                    torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True)
            except RuntimeError as e:   # backend not available for this shape
                tqdm.write(f"  {name}: {str(e).splitlines()[0][:80]}", file=sys.stderr)
                continue
            # the backend is chosen outside the timed span, as a caller would
            # choose it once
            ctx = (lambda be=be: sdpa_kernel(be))
            fns[name, "fwd"] = (lambda qg=qg, kg=kg, vg=vg: F.scaled_dot_product_attention(
                qg, kg, vg, is_causal=causal), ctx)
            fns[name, "bwd"] = (lambda o=o, qg=qg, kg=kg, vg=vg: torch.autograd.grad(
                o, (qg, kg, vg), do, retain_graph=True), ctx)
        host, shape_spans = {}, {}
        reps = interleaved(cp, fns, a.reps, settle_ms=a.settle_ms, queued=not a.idle,
                           host=host, window_ms=a.window_ms, spans=shape_spans)
        for (name, way), sp in shape_spans.items():
            spans[(dtype, d, N, causal), name, way] = sp
        for name in dict.fromkeys(n for n, _ in fns):
            add(name, reps[name, "fwd"], reps.get((name, "bwd")), host.get((name, "fwd")),
                host.get((name, "bwd")))
        if sampler:
            fill_power(rows[-len(dict.fromkeys(n for n, _ in fns)):])
        del fns
        del q, k, v, do
        save()
    if sampler:         # the samples nvidia-smi had not yet passed on
        sampler.stop()
        fill_power([r for r in rows if (r["dtype"], r["d"], r["N"], r["causal"]) not in done])
    save()
    md = table(rows, meta)
    with open(os.path.join(a.out, "bench.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    if a.json:
        print(json.dumps({"meta": meta, "rows": rows}))
    else:
        print("\n".join(md[-len(rows):]) if len(rows) < 60 else f"{len(rows)} rows written")
    plot(rows, meta, os.path.join(a.out, "bench.png"))


def table(rows, meta):
    """bench.md's lines: a heading, the protocol, and a row per implementation and shape
    with its ratios to SDPA-flash and cuDNN of the same shape (and, where --power measured
    them, the clock and power of its windows)."""
    power = any("fwd_mhz" in r for r in rows)
    md = [f"# Attention, forward and backward TFLOP/s — {meta['gpu']}, {meta['date']}", "",
          f"batch·N = {TOKENS} tokens, heads = {HIDDEN}/d; {meta['timing']}; "
          f"CuPy {meta['cupy']}, PyTorch {meta['torch']}.", "",
          "| dtype | d | N | causal | impl | fwd TF/s | bwd TF/s | fwd vs flash | fwd vs cuDNN "
          "| bwd vs flash | bwd vs cuDNN | fwd host µs | bwd host µs |"
          + (" fwd MHz | fwd W | bwd MHz | bwd W |" if power else ""),
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" * 4 if power else "")]
    ref = {(r["dtype"], r["d"], r["N"], r["causal"], r["impl"]): r for r in rows}
    for r in rows:
        key = (r["dtype"], r["d"], r["N"], r["causal"])
        fl, cu = ref.get(key + ("sdpa-flash",)), ref.get(key + ("sdpa-cudnn",))

        def ratio(x, y, field):
            return f"{x[field] / y[field]:.2f}" if x.get(field) and y and y.get(field) else ""

        def us(x):
            return "" if x is None else f"{x:.0f}"
        md.append(f"| {r['dtype']} | {r['d']} | {r['N']} | {r['causal']} | {r['impl']} | "
                  f"{r['fwd_tflops'] or 0:.1f} | "
                  f"{'' if r['bwd_tflops'] is None else format(r['bwd_tflops'], '.1f')} | "
                  f"{ratio(r, fl, 'fwd_tflops')} | {ratio(r, cu, 'fwd_tflops')} | "
                  f"{ratio(r, fl, 'bwd_tflops')} | {ratio(r, cu, 'bwd_tflops')} | "
                  f"{us(r.get('fwd_host_us'))} | {us(r.get('bwd_host_us'))} |"
                  + ("".join(f" {us(r.get(f))} |" for f in ("fwd_mhz", "fwd_w", "bwd_mhz",
                                                             "bwd_w")) if power else ""))
    return md


def plot(rows, meta, path):
    """Forward and backward TFLOP/s against N, one panel per (d, causal), float16."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print('no plot: pip install "flashsim[analysis]"')
        return 2
    fig, axes = plt.subplots(2, 4, figsize=(16, 7), sharex=True)
    impls = sorted({r["impl"] for r in rows})
    for col, (d, causal) in enumerate([(64, False), (64, True), (128, False), (128, True)]):
        for row, key in enumerate(("fwd_tflops", "bwd_tflops")):
            ax = axes[row, col]
            for n, impl in enumerate(impls):
                pts = sorted((r["N"], r[key]) for r in rows if r["impl"] == impl and r["d"] == d
                             and r["causal"] == causal and r["dtype"] == "float16" and r.get(key))
                if pts:
                    ax.plot(*zip(*pts), "o-", color=f"C{n}", label=impl, ms=3)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{'forward' if row == 0 else 'backward'}, d = {d}, "
                         f"{'causal' if causal else 'non-causal'}", fontsize=9)
            ax.grid(alpha=0.3)
            if col == 0:
                ax.set_ylabel("TFLOP/s")
            if row == 1:
                ax.set_xlabel("N (batch·N = 16k tokens)")
    if axes[0, 0].get_legend_handles_labels()[0]:      # no float16 rows: nothing drawn
        axes[0, 0].legend(fontsize=7)
    fig.suptitle(f"Attention TFLOP/s, float16 — {meta['gpu']}, {meta['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
