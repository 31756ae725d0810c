"""Time the simulator against a dense NumPy attention, and trace its peak memory.

    python3 analysis/bench_simulator.py [--n 8192] [--d 64] [--block 128] [--repeats 3]

Prints a table and, with --json FILE, writes the numbers. The simulator loops over
tiles in Python and vectorises over batch and heads inside a tile, so its time is the
same O(N²d) arithmetic as the dense computation plus a per-tile overhead.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import tracemalloc

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import flashsim as fs  # noqa: E402


def dense_attention(q, k, v):
    """Dense float64 attention: materialises S and P (Nq × Nk)."""
    S = (q @ k.T) / np.sqrt(q.shape[-1])
    S -= S.max(axis=-1, keepdims=True)
    P = np.exp(S)
    return (P @ v) / P.sum(axis=-1, keepdims=True)


def median_time(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def traced_peak(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mem-n", type=int, default=16384)
    ap.add_argument("--json")
    a = ap.parse_args(argv)

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((a.n, a.d)) for _ in range(3))
    blocks = (a.block, a.block)
    dense_attention(q, k, v)                           # warm-up (BLAS threads, pages)
    fs.simulate(q[:512], k[:512], v[:512], "flash2", block_sizes=blocks)
    t_dense = median_time(lambda: dense_attention(q, k, v), a.repeats)
    rows = {"dense numpy": t_dense}
    for alg in ("flash2", "flash1"):
        rows[f"simulate {alg}"] = median_time(
            lambda: fs.simulate(q, k, v, alg, block_sizes=blocks), a.repeats)
    print(f"N = {a.n}, d = {a.d}, Br = Bc = {a.block}, float64, one head, "
          f"median of {a.repeats} ({platform.processor() or platform.machine()})")
    print(f"{'':<18}{'time (s)':>10}{'vs dense':>10}")
    for name, t in rows.items():
        print(f"{name:<18}{t:>10.3f}{t / t_dense:>9.2f}x")

    m = a.mem_n
    qm, km, vm = (rng.standard_normal((m, a.d)) for _ in range(3))
    io_bytes = 4 * qm.nbytes                            # q + k + v + out
    mem = {}
    for alg in ("flash2", "flash1"):
        peak = traced_peak(lambda: fs.simulate(qm, km, vm, alg, block_sizes=(256, 256)))
        mem[alg] = peak
        print(f"peak traced memory, {alg}, N = {m}: {peak / 2**20:.1f} MiB = "
              f"{peak / io_bytes:.2f}x the bytes of q + k + v + out "
              f"(an N×N float64 array would be {m * m * 8 / 2**20:.0f} MiB)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"n": a.n, "d": a.d, "block": a.block, "seconds": rows,
                       "mem_n": m, "peak_bytes": mem, "io_bytes": io_bytes}, f, indent=1)


if __name__ == "__main__":
    main()
