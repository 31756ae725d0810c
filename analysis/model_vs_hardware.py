"""The three-level model (flashsim.hierarchy) held against Nsight Compute's counters.

    python3 analysis/model_vs_hardware.py [--quick] [--out analysis/out]     # on a GPU
    python3 analysis/model_vs_hardware.py --from-json analysis/out/model_vs_hardware.json

Runs itself under Nsight Compute (`ncu --clock-control none --cache-control all`, which
flushes L2 before every profiled launch) over forward launches of every rung (wg, tc,
ref) and backward launches (pre-pass, main kernel, post-pass; atomic and deterministic),
N from 1k to 256k, 1 to 64 heads, GQA, d = 64 and 128, causal and not, float16; reads
DRAM bytes read and written, L2 sectors read, written and reduced (from the SMs) and the
kernel's duration; and puts beside each the prediction of
`fs.count(..., hardware=<the device's preset>)` (three levels and time) for the same
launch. ``--probe`` also measures the L2's read bandwidth and how many bytes it keeps
between two passes over a buffer. ``--from-json`` rebuilds the tables from a saved run
(no GPU: the model is recomputed, the measurements are read back).

η, the fraction of peak FLOP/s each kernel's inner loop sustains (`hierarchy.EFFICIENCY`),
is calibrated on the rows marked "calib" (N = 16384, 8 heads, no mask) and printed as
``eta_measured`` for every row; the time errors are reported over the other rows.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

from _common import ROOT, out_file, write_json, write_text  # (puts the repository root on sys.path)

import flashsim as fs  # noqa: E402
from flashsim import hierarchy  # noqa: E402

# (direction, kernel, N, heads, kv heads, d, causal, deterministic); batch 1, float16.
# kernel is the rung: wg / tc / ref. "calib" rows set η.
CONFIGS = [
    ("fwd", "wg", 1024, 16, 16, 64, False, False),
    ("fwd", "wg", 4096, 16, 16, 64, True, False),
    ("fwd", "wg", 16384, 8, 8, 64, False, False),
    ("fwd", "wg", 16384, 8, 8, 128, False, False),
    ("fwd", "wg", 2048, 64, 8, 128, False, False),
    ("fwd", "wg", 16384, 1, 1, 128, False, False),
    ("fwd", "wg", 32768, 1, 1, 128, False, False),
    ("fwd", "wg", 49152, 1, 1, 128, False, False),
    ("fwd", "wg", 65536, 1, 1, 128, False, False),
    ("fwd", "wg", 81920, 1, 1, 128, False, False),
    ("fwd", "wg", 196608, 1, 1, 128, False, False),
    ("fwd", "wg", 32768, 1, 1, 128, True, False),
    ("fwd", "wg", 49152, 1, 1, 128, True, False),
    ("fwd", "wg", 98304, 1, 1, 128, True, False),
    ("fwd", "wg", 65536, 1, 1, 128, True, False),
    ("fwd", "wg", 98304, 1, 1, 128, False, False),
    ("fwd", "wg", 131072, 1, 1, 128, False, False),
    ("fwd", "wg", 131072, 1, 1, 128, True, False),
    ("fwd", "wg", 262144, 1, 1, 128, False, False),
    ("fwd", "wg", 262144, 1, 1, 128, True, False),
    ("fwd", "wg", 262144, 1, 1, 64, False, False),
    ("fwd", "tc", 16384, 8, 8, 64, False, False),
    ("fwd", "tc", 16384, 8, 8, 128, False, False),
    ("fwd", "tc", 65536, 1, 1, 128, True, False),
    ("fwd", "tc", 131072, 1, 1, 128, False, False),
    ("fwd", "tc", 4096, 32, 4, 64, True, False),
    ("fwd", "tc", 262144, 1, 1, 64, False, False),
    ("fwd", "ref", 4096, 4, 4, 64, False, False),
    ("fwd", "ref", 8192, 1, 1, 128, True, False),
    ("bwd", "tc", 16384, 8, 8, 64, False, False),
    ("bwd", "tc", 16384, 8, 8, 128, False, False),
    ("bwd", "tc", 65536, 1, 1, 128, True, False),
    ("bwd", "tc", 131072, 1, 1, 128, False, False),
    ("bwd", "tc", 262144, 1, 1, 64, True, False),
    ("bwd", "tc", 4096, 32, 4, 64, True, False),
    ("bwd", "tc", 16384, 8, 8, 64, False, True),
    ("bwd", "tc", 16384, 8, 8, 128, False, True),
    ("bwd", "tc", 65536, 1, 1, 128, True, True),
    ("bwd", "ref", 4096, 4, 4, 64, False, False),
]
QUICK = [c for c in CONFIGS if c[2] * c[3] <= 65536 and c[1] != "ref"][:6]
METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum",
           "lts__t_sectors_srcunit_tex_op_read.sum", "lts__t_sectors_srcunit_tex_op_write.sum",
           "lts__t_sectors_srcunit_tex_op_red.sum", "lts__t_sectors_srcunit_tex_op_atom.sum",
           "gpu__time_duration.sum")
SECTOR = 32
PROBE_MB = (8, 12, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80)


def is_calib(cfg) -> bool:
    """The rows η is measured on (hierarchy.EFFICIENCY)."""
    return (cfg[2] == 16384 and cfg[3] == 8 and not cfg[6]) or (cfg[1] == "ref" and cfg[2] == 4096)


def preset_for(gpu_name: str):
    for key in ("H200", "H100", "A100"):
        if key in gpu_name:
            return fs.hardware.PRESETS[key]
    raise SystemExit(f"no flashsim.hardware preset for {gpu_name!r}")


# -- the profiled process -------------------------------------------------------------

def launch(configs):
    """Run each configuration once (what ncu profiles): a backward row first runs its
    forward for out and lse (profiled too, and set aside)."""
    import cupy as cp
    rng = np.random.default_rng(0)
    for direction, kernel, N, H, Hk, d, causal, det in configs:
        q = cp.asarray(rng.standard_normal((1, H, N, d), dtype=np.float32).astype(np.float16))
        k, v = (cp.asarray(rng.standard_normal((1, Hk, N, d), dtype=np.float32).astype(np.float16))
                for _ in range(2))
        fwd_kernel = kernel if direction == "fwd" else ("tc" if kernel == "tc" else "ref")
        out, lse = fs.gpu.attention(q, k, v, causal=causal, kernel=fwd_kernel)
        if direction == "bwd":
            dout = cp.asarray(rng.standard_normal((1, H, N, d), dtype=np.float32).astype(np.float16))
            fs.gpu.attention_backward(q, k, v, out, lse, dout, causal=causal, kernel=kernel,
                                      deterministic=det)
        cp.cuda.Device().synchronize()
        del q, k, v, out, lse
        cp.get_default_memory_pool().free_all_blocks()


PROBE_SRC = r"""
extern "C" __global__ void probe_read(const int4* __restrict__ x, long long n, int passes,
                                      long long shift, int bcast, int* out) {
    // every pass reads all n 16-byte words, bypassing L1 (ld.global.cg); passes after the
    // first start ``shift`` words further on, so a thread reads what another SM loaded.
    // bcast: every CTA reads all n words (as every CTA of a head reads all of K and V)
    long long tid = bcast ? threadIdx.x : blockIdx.x * (long long)blockDim.x + threadIdx.x;
    long long stride = bcast ? blockDim.x : (long long)gridDim.x * blockDim.x;
    int acc = 0;
    for (int p = 0; p < passes; ++p) {
        long long off = p == 0 ? 0 : shift;
        for (long long i = tid; i < n; i += stride) {
            int4 w = __ldcg(&x[(i + off) % n]);
            acc ^= w.x ^ w.y ^ w.z ^ w.w;
        }
    }
    if (acc == 0x7fffffff) out[0] = acc;
}
"""


def probe_kernel():
    import cupy as cp
    return cp.RawKernel(PROBE_SRC, "probe_read")


TINY = 5


def probe_launch():
    """TINY launches that read 256 bytes (the duration of a launch that does nothing), then
    two passes over buffers of PROBE_MB megabytes, same and shifted mapping (ncu reads the
    DRAM bytes of each)."""
    import cupy as cp
    fn = probe_kernel()
    out = cp.zeros(1, cp.int32)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    tiny = cp.ones(64, cp.int32)
    for _ in range(TINY):
        fn((sms,), (256,), (tiny, np.int64(16), np.int32(1), np.int64(0), np.int32(0), out))
    for mb in PROBE_MB:
        n = mb * 10**6 // 16
        x = cp.asarray(np.random.default_rng(mb).integers(0, 2**31, size=4 * n, dtype=np.int32))
        for shift in (0, n // 2):
            fn((sms * 4,), (256,), (x, np.int64(n), np.int32(2), np.int64(shift), np.int32(0),
                                    out))
        # every SM reads the whole buffer twice, one CTA per SM
        fn((sms,), (256,), (x, np.int64(n), np.int32(2), np.int64(0), np.int32(1), out))
        cp.cuda.Device().synchronize()


def probe_bandwidth():
    """L2 read bandwidth (16 MB buffer, 50 passes) and DRAM read bandwidth (2 GB, 3 passes)
    timed with CUDA events, after a warm-up."""
    import cupy as cp
    fn = probe_kernel()
    out = cp.zeros(1, cp.int32)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    res = {}
    for name, mb, passes in (("l2_read_bytes_per_s", 16, 50), ("dram_read_bytes_per_s", 2000, 3)):
        n = mb * 10**6 // 16
        x = cp.asarray(np.random.default_rng(1).integers(0, 2**31, size=4 * n, dtype=np.int32))
        times = []
        for _ in range(6):
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record()
            fn((sms * 8,), (256,), (x, np.int64(n), np.int32(passes), np.int64(0), np.int32(0),
                                    out))
            b.record()
            b.synchronize()
            times.append(cp.cuda.get_elapsed_time(a, b) / 1e3)
        res[name] = passes * n * 16 / float(np.median(times[1:]))
        del x
    return res


# -- ncu ------------------------------------------------------------------------------

def run_ncu(args: list[str], regex: str) -> list[dict]:
    ncu = shutil.which("ncu")
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "ncu.csv")
        cmd = [ncu, "--clock-control", "none", "--cache-control", "all", "--metrics",
               ",".join(METRICS), "-k", f"regex:{regex}", "--csv", "--print-units", "base",
               "--log-file", log, sys.executable, os.path.abspath(__file__)] + args
        subprocess.run(cmd, check=True)
        text = open(log).read()
    rows = list(csv.DictReader(io.StringIO(text[text.index('"ID"'):])))
    by_id: dict[str, dict] = {}
    for r in rows:
        by_id.setdefault(r["ID"], {"kernel": r["Kernel Name"]})[r["Metric Name"]] = \
            float(r["Metric Value"].replace(",", ""))
    return [by_id[i] for i in sorted(by_id, key=int)]


def kernel_base(name: str) -> str:
    import re
    m = re.search(r"(flash2_\w+|probe_read)", name)
    return m.group(1) if m else name


# -- prediction and tables --------------------------------------------------------------

def predict(cfg, hw):
    direction, kernel, N, H, Hk, d, causal, det = cfg
    kw = dict(Nq=N, Nk=N, d=d, batch_shape=(1, H), kv_batch_shape=(1, Hk), causal=causal,
              io_dtype="float16", hardware=hw, launch=kernel)
    if direction == "fwd":
        return fs.count("flash2", **kw)
    return fs.count_backward("flash2", deterministic=det, **kw)


def measured_of(m: dict) -> dict:
    return {"dram_read": m["dram__bytes_read.sum"], "dram_write": m["dram__bytes_write.sum"],
            "l2_read": m["lts__t_sectors_srcunit_tex_op_read.sum"] * SECTOR,
            "l2_write": m["lts__t_sectors_srcunit_tex_op_write.sum"] * SECTOR,
            "l2_red": (m["lts__t_sectors_srcunit_tex_op_red.sum"]
                       + m["lts__t_sectors_srcunit_tex_op_atom.sum"]) * SECTOR,
            "time_s": m["gpu__time_duration.sum"] * 1e-9, "ncu_kernel": m["kernel"]}


def build_rows(configs, measured: list[dict], hw) -> list[dict]:
    """One row per profiled kernel of interest, prediction beside measurement."""
    rows, it = [], iter(measured)
    for cfg in configs:
        pred = predict(cfg, hw)
        if cfg[0] == "bwd":
            next(it)                                     # the forward that made out, lse
        for lp in pred.launches:
            m = next(it)
            if kernel_base(m["ncu_kernel"]) != lp.launch.kernel:
                raise RuntimeError(f"expected {lp.launch.kernel}, ncu saw {m['ncu_kernel']}")
            lv = lp.levels
            F = hierarchy.step_flops(lp.launch, hierarchy_shape(cfg))
            eta = (lp.makespan * F / (hw.peak_flops / lp.launch.slots) / m["time_s"]
                   if F else None)
            rows.append({
                "direction": cfg[0], "rung": cfg[1], "N": cfg[2], "heads": cfg[3],
                "kv_heads": cfg[4], "d": cfg[5], "causal": cfg[6], "deterministic": cfg[7],
                "calib": is_calib(cfg) and lp.launch.phase in ("forward", "backward-main"),
                "kernel": lp.launch.kernel, "grid": list(lp.launch.grid),
                "ctas_per_sm": lp.launch.ctas_per_sm, "waves": lp.launch.waves,
                "Br": lp.launch.Br, "Bc": lp.launch.Bc, "superblock": lp.superblock,
                "kv_bytes_per_head": cfg[2] * cfg[5] * 2 * 2,
                "pred_dram_read": lv.dram.read_bytes + lv.dram.reduce_bytes,
                "pred_dram_write": lv.dram.write_bytes,
                "pred_l2_read": lv.sm_l2.read_bytes, "pred_l2_write": lv.sm_l2.write_bytes,
                "pred_l2_red": lv.sm_l2.reduce_bytes,
                "two_level_read": None, "two_level_write": None,
                "compulsory_read": lv.compulsory.read_bytes,
                "compulsory_write": lv.compulsory.write_bytes,
                "pred_writeback": lp.writeback.total_bytes,
                "pred_time_s": lp.time_s, "pred_time_parts": lp.time_parts,
                "eta_measured": eta, **measured_of_row(m)})
        two = pred.traffic
        rows[-len(pred.launches)]["two_level_read"] = two.read_bytes
        rows[-len(pred.launches)]["two_level_write"] = two.write_bytes
    return rows


def measured_of_row(m):
    return {k: v for k, v in m.items() if k.startswith(("dram", "l2", "time", "ncu"))}


def hierarchy_shape(cfg):
    from flashsim.problem import make_shape
    return make_shape(Nq=cfg[2], Nk=cfg[2], d=cfg[5], batch_shape=(1, cfg[3]),
                      kv_batch_shape=(1, cfg[4]))


def ratio(a, b):
    return a / b if b else (1.0 if a == b else float("inf"))


def summarize(rows):
    """|measured/predicted − 1| by quantity: (mean, max, rows). DRAM rows where at least
    1 MB is predicted; time rows not used to calibrate η."""
    def errs(key_m, key_p, sel):
        out = [abs(ratio(r[key_m], r[key_p]) - 1) for r in rows if sel(r)]
        return (float(np.mean(out)), float(np.max(out)), len(out)) if out else (0.0, 0.0, 0)
    # DRAM and L2 read errors, also over the rows the lockstep assumption covers (all but
    # the two CTAs per SM of wg at d = 64 and the deterministic backward's turn-taking)
    lock = lambda r: not (r["kernel"] == "flash2_fwd_wg" and r["d"] == 64) and r["kernel"] != "flash2_bwd_tc_det"  # noqa: E731
    return {
        "DRAM read, lockstep rows": errs("dram_read", "pred_dram_read",
                                         lambda r: r["pred_dram_read"] >= 1e6 and lock(r)),
        "DRAM read": errs("dram_read", "pred_dram_read", lambda r: r["pred_dram_read"] >= 1e6),
        "DRAM write": errs("dram_write", "pred_dram_write", lambda r: r["pred_dram_write"] >= 1e6),
        "L2 read": errs("l2_read", "pred_l2_read", lambda r: r["pred_l2_read"] > 0),
        "L2 write": errs("l2_write", "pred_l2_write", lambda r: r["pred_l2_write"] > 0),
        "L2 reduce": errs("l2_red", "pred_l2_red", lambda r: r["pred_l2_red"] > 0),
        "time, forward and backward main kernels": errs(
            "time_s", "pred_time_s", lambda r: not r["calib"] and r["kernel"] in MAIN),
        "time, backward pre- and post-passes": errs(
            "time_s", "pred_time_s", lambda r: r["kernel"] not in MAIN),
    }


MAIN = ("flash2_fwd", "flash2_fwd_tc", "flash2_fwd_wg", "flash2_fwd_ws", "flash2_bwd_main",
        "flash2_bwd_tc", "flash2_bwd_tc_det")


def misses(r) -> list[str]:
    """The quantities of one row outside the issue's targets: DRAM bytes within 10% (where
    at least 1 MB is predicted), L2 reads within 5%, time within 15%."""
    out = []
    for label, km, kp, tol, floor in (("DRAM read", "dram_read", "pred_dram_read", 0.10, 1e6),
                                      ("DRAM write", "dram_write", "pred_dram_write", 0.10, 1e6),
                                      ("L2 read", "l2_read", "pred_l2_read", 0.05, 0),
                                      ("time", "time_s", "pred_time_s", 0.15, 0)):
        if max(r[kp], r[km]) > floor and abs(ratio(r[km], r[kp]) - 1) > tol:
            out.append(label)
    return out


WHY = """## Why rows miss

- **DRAM writes** (mean error above): L2 writes back some dirty lines earlier than an
  LRU would, a few MB per launch (the forward's O, the pre-pass's D and dQacc); where
  tens of MB are written the model is within a few percent, where a few MB are it can be
  off by half.
- **L2 reads**: `lts__t_sectors_srcunit_tex_op_read` counts what reaches the L2 slices.
  When many CTAs read the same tile at the same moment (no mask, several CTAs per head in
  step) part of those requests are merged before the slices, so the count is 0.3–0.9× the
  SMs' requests; the reference kernel's plain loads also hit in L1. The model counts
  every SM request (the two-level count, exact as the instrumented kernels show).
- **L2 writes**: the fast kernels store O, dK, dV from MMA fragments in 16-byte pieces, so
  each 32-byte sector is written by two requests and counted twice (m/p = 2.0 for wg,
  1.5 for tc); the deterministic backward also writes its turn counters.
- **wg at d = 64, N = 262144 (DRAM read 1.89×)**: two CTAs share each SM there, and they
  drift apart by about half a K/V sweep, so every K/V tile is read twice per wave; the
  lockstep dispatch keeps them together. The tc kernel at d = 64 with two CTAs per SM
  stays in step (1.02×).
- **Deterministic backward under a causal mask (0.2×)**: CTAs wait for their turn to add
  into dQ, which holds neighbouring K/V tiles together and lets the L2 serve the Q-side
  tiles many times; the model has no waits, and its LRU re-reads them.
- **Near the L2 cliff** (one head's K + V between 25 and 34 MB): the re-read fraction
  turns on within a few MB, so small differences in what L2 keeps move the count by 10–30%.
- **Time of the pre- and post-passes** (10–50 µs kernels): their duration is set by
  latency and ramp-up rather than bandwidth; the model's memory terms are 1.3–10× short.
"""


def render(rows, meta) -> str:
    MB = 1e6
    s = summarize(rows)
    md = [f"# The three-level model against Nsight Compute — {meta['gpu']}, {meta['date']}", "",
          f"`{meta['ncu']}` (L2 flushed before each launch), float16, batch 1, one row per "
          f"kernel launch. Prediction: `fs.count(..., hardware=fs.hardware.{meta['preset']}, "
          "launch=<rung>)` / `fs.count_backward(...)`, the three-level model of "
          "`flashsim.hierarchy` with the hardware preset alone (nothing fitted to these "
          "rows but η, on the rows marked calib). DRAM = `dram__bytes_{read,write}.sum`; L2 = "
          "sectors from the SMs (`lts__t_sectors_srcunit_tex_op_{read,write,red+atom}.sum` × "
          "32 B); time = `gpu__time_duration.sum`. MB = 10⁶ bytes; m/p = measured ÷ "
          "predicted. K/V MB = one head's K + V; ★ where it exceeds what L2 keeps of a "
          "buffer every SM reads. The last column names what misses its target (DRAM "
          "within 10%, L2 reads within 5%, time within 15%).", "",
          "| dir | kernel | N | heads (kv) | d | causal | waves | K/V MB | DRAM read MB meas | pred | m/p "
          "| DRAM write MB meas | pred | m/p | L2 read MB meas | pred | m/p | L2 red MB meas | pred "
          "| time ms meas | pred | m/p | misses |",
          "|" + "---|" * 24]
    hw = fs.hardware.PRESETS[meta["preset"]]
    keeps = hw.l2_retention[0] if hw.l2_retention else hw.l2_bytes // hw.l2_partitions
    for r in rows:
        star = " ★" if r["kv_bytes_per_head"] > keeps else ""
        calib = " calib" if r["calib"] else ""
        det = " det" if r["deterministic"] else ""
        md.append(
            f"| {r['direction']}{det} | {r['kernel']}{calib} | {r['N']} | {r['heads']} ({r['kv_heads']}) "
            f"| {r['d']} | {'yes' if r['causal'] else 'no'} | {r['waves']:.2f} "
            f"| {r['kv_bytes_per_head'] / MB:.1f}{star} "
            f"| {r['dram_read'] / MB:.1f} | {r['pred_dram_read'] / MB:.1f} "
            f"| {ratio(r['dram_read'], r['pred_dram_read']):.3f} "
            f"| {r['dram_write'] / MB:.1f} | {r['pred_dram_write'] / MB:.1f} "
            f"| {ratio(r['dram_write'], r['pred_dram_write']):.3f} "
            f"| {r['l2_read'] / MB:.1f} | {r['pred_l2_read'] / MB:.1f} "
            f"| {ratio(r['l2_read'], r['pred_l2_read']):.3f} "
            f"| {r['l2_red'] / MB:.1f} | {r['pred_l2_red'] / MB:.1f} "
            f"| {r['time_s'] * 1e3:.3f} | {r['pred_time_s'] * 1e3:.3f} "
            f"| {ratio(r['time_s'], r['pred_time_s']):.2f} | {', '.join(misses(r)) or '-'} |")
    md += ["", "Errors |m/p − 1| (mean, max, rows; DRAM rows with ≥ 1 MB predicted, time "
           "rows not used for calibration; lockstep rows: all but wg at d = 64 and the "
           "deterministic backward, see below):", ""]
    for k, (mean, mx, n) in s.items():
        md.append(f"- {k}: mean {mean:.1%}, max {mx:.1%} over {n} rows")
    return "\n".join(md) + "\n\n" + WHY


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--probe", action="store_true", help="also measure L2 bandwidth and retention")
    ap.add_argument("--probe-only", action="store_true",
                    help="measure L2 bandwidth and retention only (writes <name>.json)")
    ap.add_argument("--out", default=os.path.join(ROOT, "analysis", "out"))
    ap.add_argument("--name", default="model_vs_hardware", help="output file stem")
    ap.add_argument("--from-json", default=None, metavar="FILE",
                    help="rebuild the tables from a saved run (no GPU)")
    ap.add_argument("--launch", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--probe-launch", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    configs = QUICK if a.quick else CONFIGS
    if a.launch:
        launch(configs)
        return 0
    if a.probe_launch:
        probe_launch()
        return 0
    if a.from_json:
        saved = json.load(open(a.from_json))
        meta = saved["meta"]
        cfgs = [tuple(c) for c in meta["configs"]]
        hw = fs.hardware.PRESETS[meta["preset"]]
        rows = build_rows(cfgs, saved["measured"], hw)
        return finish(a, rows, meta, saved["measured"], saved.get("probe"))
    if not fs.gpu.available():
        print("model_vs_hardware needs a CUDA GPU and CuPy (pip install \"flashsim[cuda12]\")")
        return 2
    if shutil.which("ncu") is None:
        print("model_vs_hardware needs Nsight Compute's ncu on PATH")
        return 2
    import cupy as cp
    props = cp.cuda.runtime.getDeviceProperties(0)
    gpu = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    hw = preset_for(gpu)
    l2_dev = int(cp.cuda.Device().attributes["L2CacheSize"])
    if not a.probe_only:
        launch([c[:2] + (1024, 2, 2) + c[5:] for c in configs])   # compile outside the profile
    probe = None
    if a.probe or a.probe_only:
        probe = probe_bandwidth()
        pm = run_ncu(["--probe-launch"], "probe_read")
        probe["tiny_launch_s"] = float(np.median([m["gpu__time_duration.sum"] * 1e-9
                                                  for m in pm[:TINY]]))
        pm = pm[TINY:]
        probe["retention"] = [
            {"MB": mb, "shift": sh, "dram_read_over_size": m["dram__bytes_read.sum"] / (mb * 1e6)}
            for (mb, sh), m in zip([(mb, sh) for mb in PROBE_MB
                                    for sh in ("same", "half", "broadcast")], pm)]
        print(json.dumps(probe, indent=1))
        if a.probe_only:
            write_json(out_file(a.out, f"{a.name}.json"),
                       {"meta": {"gpu": gpu, "date": datetime.date.today().isoformat(),
                                 "l2_bytes_device": l2_dev}, "probe": probe})
            return 0
    measured = run_ncu(["--launch"] + (["--quick"] if a.quick else []), "flash2_")
    meta = {"gpu": gpu, "preset": [k for k, v in fs.hardware.PRESETS.items() if v is hw][0],
            "date": datetime.date.today().isoformat(), "l2_bytes_device": l2_dev,
            "l2_bytes": hw.l2_bytes, "configs": [list(c) for c in configs],
            "ncu": f"ncu --clock-control none --cache-control all --metrics {','.join(METRICS)}"}
    measured = [measured_of(m) for m in measured]
    rows = build_rows(configs, measured, hw)
    return finish(a, rows, meta, measured, probe)


def finish(a, rows, meta, measured, probe):
    meta = dict(meta)
    meta["l2_bytes"] = fs.hardware.PRESETS[meta["preset"]].l2_bytes
    write_json(out_file(a.out, f"{a.name}.json"),
               {"meta": meta, "measured": measured, "probe": probe, "rows": rows})
    text = render(rows, meta)
    write_text(out_file(a.out, f"{a.name}.md"), text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
