"""The ``flashsim`` command line.

    flashsim                      built-in example: standard vs flash1 vs flash2
    flashsim simulate [...]       one algorithm on one problem (real math, or --no-math)
    flashsim sweep [...]          HBM traffic against SRAM size M (forward, or --backward)
    flashsim bench [...]          the kernels timed beside PyTorch SDPA on this GPU

Library errors (bad sizes, an SRAM too small for any tile, ...) are printed as
``flashsim: error: <message>`` with exit status 2, like argparse's own errors.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys

import numpy as np

from . import theory
from .backward import BACKWARD_ALGORITHMS, count_backward
from .count import count
from .problem import itemsize_of, make_shape

CORE_ALGORITHMS = ("standard", "flash1", "flash2")
# `flashsim simulate` also runs these (the default comparison and sweep stay on the core three)
SIMULATE_ALGORITHMS = CORE_ALGORITHMS + ("splitkv", "square", "ring")
# `flashsim sweep --algorithms` takes these (splitkv needs a split count, so it is left out)
SWEEP_ALGORITHMS = CORE_ALGORITHMS + ("square",)
from .reference import attention_reference
from .simulate import simulate
from .splitkv import CLUSTER_MAX, theory_splitkv
from .tiling import Tiles, band_for, cdiv, parse_size, resolve_block_sizes, sram_footprint
from .traffic import format_table
from .hardware import PRESETS, get as get_hardware
from .hierarchy import RUNGS

PROG = "flashsim"
DTYPES = ("float16", "bfloat16", "float32", "float64")
DEFAULT_SRAM = "192KiB"

# Math runs beyond these limits would take minutes or exhaust memory; --no-math counts
# the same bytes with no arrays at all.
MAX_STANDARD_MATRIX_BYTES = 2 * 2**30      # one float64 Nq×Nk matrix per problem, all problems
MAX_SCORE_ENTRIES = 2**31                  # B·H·Nq·Nk for any math run
MAX_TILE_STEPS = 200_000                   # visited (Q tile, K/V tile) pairs of a flash run
MAX_REFERENCE_ENTRIES = 2**24              # largest B·H·Nq·Nk checked against the reference

NAMES = {"standard": "standard attention", "flash1": "FlashAttention-1",
         "flash2": "FlashAttention-2", "splitkv": "split-KV FlashAttention-2, flash-decoding",
         "square": "square tiles for SRAM < d², Saha & Ye"}


class CLIError(ValueError):
    """An input the command line refuses (reported like the library's ValueErrors)."""


# -- formatting helpers ---------------------------------------------------------------

def human_bytes(n: float | int | None, compact: bool = False) -> str:
    """'33.00 MiB', '512 B'; with ``compact``, whole values drop the decimals ('192 KiB')."""
    if n is None:
        return "-"
    n = float(n)
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            v = n / size
            return f"{v:.0f} {unit}" if compact and v == int(v) else f"{v:.2f} {unit}"
    return f"{n:.0f} B"


def human_size(n) -> str:
    """An SRAM size: '192 KiB', '1.50 MiB'."""
    return human_bytes(n, compact=True)


def _exact(n: int, compact: bool = False) -> str:
    return f"{human_bytes(n, compact)} ({n:,} B)"


def _causal_word(causal: bool) -> str:
    return "causal" if causal else "non-causal"


def _steps(Nq: int, Nk: int, Br: int, Bc: int, causal: bool) -> int:
    """Visited (Q tile, K/V tile) pairs: the Python-loop iterations of a flash run."""
    tiles = Tiles(Nq, Nk, Br, Bc, band_for(causal))
    jlo, jhi = tiles.kv_ranges()
    return int(np.maximum(jhi - jlo + 1, 0).sum())


# -- parser ------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="IO-aware attention, counted: HBM traffic of standard attention, "
                    "FlashAttention-1 and FlashAttention-2 on a two-level memory. "
                    "With no command, runs a built-in example (N = 2048, d = 64, "
                    "float16, SRAM 192 KiB).",
        epilog="Run 'flashsim simulate --help', 'flashsim sweep --help', "
               "'flashsim bench --help' or 'flashsim kernels build --help' for each command.")
    sub = p.add_subparsers(dest="command", metavar="{simulate,sweep,kernels,bench}")

    s = sub.add_parser(
        "simulate", help="run one algorithm on one problem and count its HBM traffic",
        description="Run one algorithm tile by tile on random inputs (or, with --no-math, "
                    "count the bytes only) and report the HBM traffic per tensor, the "
                    "tiling, the SRAM use and the closed-form check.")
    s.add_argument("--algorithm", "-a", choices=SIMULATE_ALGORITHMS, default="flash2",
                   help="which schedule to run (default: flash2); splitkv needs --num-splits")
    s.add_argument("--num-splits", type=int, default=None, metavar="S",
                   help="splitkv only: number of parts each Q tile's K/V range is cut into "
                        "(1 = plain flash2)")
    s.add_argument("--cluster", action="store_true",
                   help="splitkv only: a Q tile's parts merge in a thread block cluster "
                        "(distributed shared memory), no partial in HBM; at most 16 parts")
    s.add_argument("--seq", "-N", type=int, default=4096, metavar="N",
                   help="query sequence length Nq (default: 4096)")
    s.add_argument("--seq-k", type=int, default=None, metavar="Nk",
                   help="key/value sequence length Nk (default: = --seq)")
    s.add_argument("--head-dim", "-d", type=int, default=64, metavar="d",
                   help="head dimension d of Q and K (default: 64)")
    s.add_argument("--head-dim-v", type=int, default=None, metavar="dv",
                   help="head dimension dv of V and O (default: = --head-dim)")
    tiling = s.add_mutually_exclusive_group()
    tiling.add_argument("--sram", metavar="SIZE", default=None,
                        help="SRAM size M, e.g. 192KiB, 1MiB, 100KB or 65536 "
                             f"(default: {DEFAULT_SRAM}); block sizes follow the paper's rule")
    tiling.add_argument("--block-sizes", type=int, nargs=2, metavar=("Br", "Bc"),
                        help="explicit block sizes instead of --sram")
    s.add_argument("--causal", action="store_true", help="bottom-right causal mask")
    s.add_argument("--batch", "-B", type=int, default=1, help="batch size (default: 1)")
    s.add_argument("--heads", "-H", type=int, default=1, help="query heads (default: 1)")
    s.add_argument("--kv-heads", type=int, default=None, metavar="Hk",
                   help="K/V heads, dividing --heads, for GQA/MQA (default: = --heads)")
    s.add_argument("--dtype", choices=DTYPES, default="float16",
                   help="I/O element type whose bytes are counted (default: float16); "
                        "the math itself runs in float64")
    s.add_argument("--no-math", action="store_true",
                   help="count bytes only (fs.count): no arrays, fast at any N")
    s.add_argument("--seed", type=int, default=0, help="random seed for q, k, v (default: 0)")
    s.add_argument("--json", action="store_true", help="print a JSON object instead of text")
    rg = s.add_argument_group("ring attention (--algorithm ring)")
    rg.add_argument("--world-size", type=int, default=None, metavar="W",
                    help="ranks the sequence is split over (ring only)")
    rg.add_argument("--assignment", choices=("contiguous", "zigzag"), default="contiguous",
                    help="slices per rank: W contiguous chunks, or zigzag (chunks r and "
                         "2W − 1 − r of 2W; balances a causal mask)")
    hw = s.add_argument_group(
        "three levels (SM↔L2, L2↔DRAM, compulsory) for the project's GPU kernels")
    hw.add_argument("--hardware", metavar="GPU", default=None,
                    help=f"a GPU preset ({', '.join(PRESETS)}): model the kernel's launch on it "
                         "with an L2 between SRAM and DRAM and print the traffic at each level "
                         "and the predicted time (flash2; counts only, no math)")
    hw.add_argument("--launch", choices=RUNGS, default="auto",
                    help="which kernel to model: auto (as fs.gpu.attention picks), wg, tc or "
                         "ref (default: auto)")
    hw.add_argument("--backward", action="store_true",
                    help="model the backward's launches (pre-pass, main kernel, post-pass)")
    hw.add_argument("--deterministic", action="store_true",
                    help="with --backward: the deterministic main kernel")

    w = sub.add_parser(
        "sweep", help="HBM traffic against SRAM size, forward or backward",
        description="Count (fs.count, or fs.count_backward with --backward; no math) the "
                    "HBM traffic of standard attention, FlashAttention-1 and "
                    "FlashAttention-2 (and, with --algorithms, square tiles) at "
                    "geometrically spaced SRAM sizes M from --min to --max.")
    w.add_argument("--seq", "-N", type=int, default=4096, metavar="N",
                   help="sequence length Nq = Nk (default: 4096)")
    w.add_argument("--head-dim", "-d", type=int, default=64, metavar="d",
                   help="head dimension d (default: 64)")
    w.add_argument("--dtype", choices=DTYPES, default="float16",
                   help="I/O element type (default: float16)")
    w.add_argument("--causal", action="store_true", help="bottom-right causal mask")
    w.add_argument("--backward", action="store_true",
                   help="count the backward pass (fs.count_backward) instead of the forward")
    w.add_argument("--algorithms", default=",".join(CORE_ALGORITHMS), metavar="LIST",
                   help="comma-separated algorithms from "
                        f"{', '.join(SWEEP_ALGORITHMS)} (default: {','.join(CORE_ALGORITHMS)}; "
                        "square has no backward)")
    w.add_argument("--min", dest="min_size", default="16KiB", metavar="SIZE",
                   help="smallest SRAM size (default: 16KiB)")
    w.add_argument("--max", dest="max_size", default="16MiB", metavar="SIZE",
                   help="largest SRAM size (default: 16MiB)")
    w.add_argument("--points", type=int, default=13,
                   help="number of SRAM sizes, geometrically spaced (default: 13)")
    w.add_argument("--plot", metavar="FILE",
                   help="write a log-log plot (needs matplotlib: pip install \"flashsim[analysis]\")")
    w.add_argument("--csv", metavar="FILE", help="write the numbers as CSV")
    sub.add_parser("bench", add_help=False,
                   help="time flashsim's kernels beside PyTorch SDPA's backends on this GPU "
                        "(flashsim bench --help)")
    kp = sub.add_parser("kernels", help="the CUDA kernels: build them ahead of time",
                        description="Work with the CUDA kernels in kernels_cu/.")
    ksub = kp.add_subparsers(dest="kernels_command", metavar="{build}", required=True)
    kb = ksub.add_parser(
        "build", help="compile every kernel variant with nvcc or NVRTC (no GPU needed)",
        description="Compile every kernel the package can launch (each dtype, the fast "
                    "and the instrumented build) with nvcc, and print registers, static "
                    "shared memory, stack and spill bytes per variant, and where ptxas "
                    "serialised its warpgroup MMAs. Fails if any variant does not "
                    "compile.")
    kb.add_argument("--arch", action="append", default=None,
                    help="target, e.g. sm_90 or sm_80 (repeatable; default sm_90)")
    kb.add_argument("--nvcc", default=None, help="the nvcc to use (default: from PATH)")
    kb.add_argument("--nvrtc", nargs="?", const=True, default=None, metavar="LIB",
                    help="build with NVRTC, as flashsim.gpu does on the GPU's machine, "
                         "instead of nvcc: its libnvrtc.so (default: $FLASHSIM_NVRTC, the "
                         "nvidia-cuda-nvrtc wheel CuPy uses, or the toolkit's); its builds "
                         "can spill where nvcc's of the same version do not")
    kb.add_argument("--no-cache", action="store_true",
                    help="compile everything again rather than reuse ptxas's reports kept "
                         "under ~/.cache/flashsim/build (keyed by nvcc's version, the "
                         "command, and each kernel's source with the headers it includes)")
    return p


# -- flashsim (no command): the built-in example ----------------------------------------

def run_default() -> int:
    N, d, dtype, sram = 2048, 64, "float16", DEFAULT_SRAM
    b = itemsize_of(dtype)
    budget = parse_size(sram)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((N, d)).astype(np.float16) for _ in range(3))
    ref, _ = attention_reference(q, k, v)

    results = {a: simulate(q, k, v, a, sram_bytes=sram) for a in CORE_ALGORITHMS}
    std = results["standard"].traffic.total_bytes

    print("flashsim: standard attention vs FlashAttention-1 vs FlashAttention-2")
    print(f"problem: Nq = Nk = N = {N}, d = {d}, batch 1, heads 1, {dtype} I/O ({b} B/element), "
          f"SRAM M = {human_size(budget)}, non-causal")
    print("inputs:  q, k, v ~ N(0, 1) from numpy default_rng(0); the real math runs "
          "(float64) and every HBM byte is counted")
    print()
    print("HBM traffic per tensor")
    print(format_table({a: r.traffic for a, r in results.items()}))
    print()
    print(f"tiling (SRAM budget {human_size(budget)})")
    for a in ("flash1", "flash2"):
        r = results[a]
        Br, Bc = r.block_sizes
        print(f"  {a}: Br = {Br}, Bc = {Bc} (Tr = {cdiv(N, Br)}, Tc = {cdiv(N, Bc)}), "
              f"SRAM peak {human_bytes(r.sram_peak_bytes)} = {r.sram_peak_bytes:,} B "
              f"({100 * r.sram_peak_bytes / budget:.0f}% of budget)")
    print("  standard: no tiling (whole-matrix passes through HBM)")
    print()
    print("HBM traffic, total (reads + writes)")
    w = max(len(a) for a in CORE_ALGORITHMS)
    print(f"  {'':<{w}}  {'total':>10}  {'bytes':>12}    standard / algorithm")
    for a, r in results.items():
        t = r.traffic.total_bytes
        print(f"  {a:<{w}}  {human_bytes(t):>10}  {t:>12,}    {std / t:.2f}x")
    print()
    print("accuracy: max |out - attention_reference| (float64 reference)")
    for a, r in results.items():
        print(f"  {a:<{w}}  {float(np.max(np.abs(r.out - ref))):.2e}")
    print()
    print("theory: fs.theory.traffic (closed form) vs the simulated traffic")
    for a, r in results.items():
        Br, Bc = r.block_sizes or (None, None)
        t = theory.traffic(a, Nq=N, Nk=N, d=d, Br=Br, Bc=Bc, itemsize=b)
        print(f"  {a:<{w}}  matches closed form: {'yes' if t == r.traffic else 'no'}")
    print()
    print("More: flashsim simulate --help  |  flashsim sweep --help")
    return 0


# -- flashsim simulate ------------------------------------------------------------------

def run_simulate(args) -> int:
    if args.algorithm == "ring" or args.world_size is not None:
        return run_ring(args)
    if args.hardware is not None:
        return run_hardware(args)
    if args.backward or args.deterministic or args.launch != "auto":
        raise CLIError("--backward, --deterministic and --launch go with --hardware")
    if args.assignment != "contiguous":
        raise CLIError("--assignment goes with --algorithm ring")
    alg = args.algorithm
    Nq = args.seq
    Nk = args.seq if args.seq_k is None else args.seq_k
    d = args.head_dim
    dv = d if args.head_dim_v is None else args.head_dim_v
    B, H = args.batch, args.heads
    Hk = H if args.kv_heads is None else args.kv_heads
    for name, value, low in (("--seq", Nq, 1), ("--seq-k", Nk, 1), ("--head-dim", d, 1),
                             ("--head-dim-v", dv, 1), ("--batch", B, 1), ("--heads", H, 1),
                             ("--kv-heads", Hk, 1)):
        if value < low:
            raise CLIError(f"{name} must be >= {low}, got {value}")
    if Hk > H or H % Hk:
        raise CLIError(f"--kv-heads {Hk} must divide --heads {H} (GQA/MQA groups query heads "
                       "over K/V heads)")
    splits = args.num_splits
    if alg == "splitkv" and splits is None:
        raise CLIError("--algorithm splitkv needs --num-splits S (S >= 1; 1 runs plain flash2)")
    if alg != "splitkv" and splits is not None:
        raise CLIError(f"--num-splits applies to --algorithm splitkv, not {alg}")
    if splits is not None and splits < 1:
        raise CLIError(f"--num-splits must be >= 1, got {splits}")
    if args.cluster and alg != "splitkv":
        raise CLIError(f"--cluster applies to --algorithm splitkv, not {alg}")
    if args.cluster and splits > CLUSTER_MAX:
        raise CLIError(f"a cluster holds at most {CLUSTER_MAX} thread blocks: --num-splits "
                       f"{splits} with --cluster (drop --cluster, or split less)")
    sram = args.sram
    if sram is None and args.block_sizes is None:
        sram = DEFAULT_SRAM
    budget = parse_size(sram) if sram is not None else None
    b = itemsize_of(args.dtype)
    shape = make_shape(Nq=Nq, Nk=Nk, d=d, dv=dv, batch_shape=(B, H), kv_batch_shape=(B, Hk))
    problems = shape.problems

    # Validates the tiling (SRAM overflow, bad block sizes) before any array is made.
    blocks = resolve_block_sizes(alg, sram_bytes=budget,
                                 block_sizes=tuple(args.block_sizes) if args.block_sizes else None,
                                 d=d, dv=dv, itemsize=b)
    counted = count(alg, Nq=Nq, Nk=Nk, d=d, dv=dv, batch_shape=(B, H), kv_batch_shape=(B, Hk),
                    sram_bytes=budget, block_sizes=args.block_sizes and tuple(args.block_sizes),
                    causal=args.causal, io_dtype=args.dtype, num_splits=splits,
                    cluster=args.cluster)
    is_flash = alg != "standard"
    if not is_flash:
        blocks = None  # standard attention does not tile

    max_err = None
    if args.no_math:
        traffic = counted
        peak = sram_footprint(alg, *blocks, d, dv, b) if is_flash else None
    else:
        entries = problems * Nq * Nk
        hint = "use --no-math to count the same bytes without running the math"
        if not is_flash and entries * 8 > MAX_STANDARD_MATRIX_BYTES:
            raise CLIError(f"standard attention would materialise B·H·Nq·Nk = {entries:,} "
                           f"float64 scores ({human_bytes(entries * 8)}, over "
                           f"{human_size(MAX_STANDARD_MATRIX_BYTES)}); " + hint)
        if entries > MAX_SCORE_ENTRIES:
            raise CLIError(f"B·H·Nq·Nk = {entries:,} attention scores is too many for a math "
                           f"run (limit 2**31); " + hint)
        if is_flash:
            steps = _steps(Nq, Nk, *blocks, args.causal)
            if steps > MAX_TILE_STEPS:
                raise CLIError(f"{alg} with Br = {blocks[0]}, Bc = {blocks[1]} visits {steps:,} "
                               f"tile pairs (limit {MAX_TILE_STEPS:,}), which would be very slow "
                               "in Python; use larger tiles (more --sram), or " + hint)
        rng = np.random.default_rng(args.seed)
        q = rng.standard_normal((B, H, Nq, d), dtype=np.float32)
        k = rng.standard_normal((B, Hk, Nk, d), dtype=np.float32)
        v = rng.standard_normal((B, Hk, Nk, dv), dtype=np.float32)
        r = simulate(q, k, v, alg, sram_bytes=budget,
                     block_sizes=None if budget is not None else tuple(args.block_sizes),
                     causal=args.causal, io_dtype=args.dtype, num_splits=splits,
                     cluster=args.cluster)
        traffic, peak = r.traffic, r.sram_peak_bytes
        if entries <= MAX_REFERENCE_ENTRIES:
            ref, _ = attention_reference(q, k, v, causal=args.causal)
            max_err = float(np.max(np.abs(r.out - ref))) if r.out.size else 0.0

    Br, Bc = blocks if blocks else (None, None)
    if alg == "splitkv":
        closed = theory_splitkv(Nq=Nq, Nk=Nk, d=d, dv=dv, Br=Br, Bc=Bc, causal=args.causal,
                                itemsize=b, problems=problems, num_splits=splits,
                                cluster=args.cluster)
    else:
        closed = theory.traffic(alg, Nq=Nq, Nk=Nk, d=d, dv=dv, Br=Br, Bc=Bc,
                                causal=args.causal, itemsize=b, problems=problems)
    matches = closed == traffic

    # Theorem 2's Θ shapes (elements, per problem), N = √(Nq·Nk) when Nq ≠ Nk.
    N_eff = Nq if Nq == Nk else math.isqrt(Nq * Nk)
    if is_flash:
        M_bytes = budget if budget is not None else sram_footprint(alg, Br, Bc, d, dv, b)
        M = max(1, M_bytes // b)
        if alg == "square" and hasattr(theory, "theta_small_sram"):
            theta = theory.theta_small_sram(N_eff, d, M)
            theta_formula = "N²·d/√M" if M < d * d else "N²·d²/M"
        else:
            theta = theory.theorem2_flash(N_eff, d, M)
            theta_formula = "N²·d²/M"
    else:
        M = None
        theta = theory.theorem2_standard(N_eff, d)
        theta_formula = "N·d + N²"
    theta_bytes = theta * b * problems

    if args.json:
        out = {
            "algorithm": alg,
            "num_splits": splits,
            "cluster": bool(args.cluster),
            "problem": {"Nq": Nq, "Nk": Nk, "d": d, "dv": dv, "batch": B, "heads": H,
                        "kv_heads": Hk, "problems": problems, "causal": bool(args.causal),
                        "dtype": args.dtype, "itemsize": b},
            "math": not args.no_math,
            "seed": None if args.no_math else args.seed,
            "sram_bytes": budget,
            "block_sizes": list(blocks) if blocks else None,
            "Tr": cdiv(Nq, Br) if Br else None,
            "Tc": cdiv(Nk, Bc) if Bc else None,
            "sram_peak_bytes": None if args.no_math else peak,
            "sram_bound_bytes": peak if args.no_math else None,
            "traffic": traffic.to_dict(),
            "theory_traffic": closed.to_dict(),
            "matches_theory": matches,
            "matches_count": counted == traffic,
            "theorem2": {"formula": theta_formula, "N": N_eff, "d": d, "M_elements": M,
                         "elements_per_problem": theta, "bytes": theta_bytes},
            "max_abs_error": max_err,
        }
        print(json.dumps(out, indent=2))
        return 0

    heads = f"heads {H}" + (f" (K/V heads {Hk}, GQA groups of {H // Hk})" if Hk != H else "")
    seqs = f"Nq = Nk = {Nq}" if Nq == Nk else f"Nq = {Nq}, Nk = {Nk}"
    dims = f"d = {d}" if dv == d else f"d = {d}, dv = {dv}"
    def line(label: str, text: str) -> None:
        print(f"{label:<13}{text}")

    print(f"flashsim simulate: {alg} ({NAMES[alg]})")
    line("problem", f"{seqs}, {dims}, batch {B}, {heads}, {args.dtype} I/O ({b} B/element), "
                    f"{_causal_word(args.causal)}")
    if alg == "splitkv":
        merge = ("merged in a thread block cluster, no partial in HBM" if args.cluster
                 else "fp32 partials Osplit, Lsplit combined per Q tile")
        line("splits", f"{splits} per Q tile" + (" (1: the unsplit flash2 kernel)" if splits == 1
                                                 else f"; {merge}"))
    if args.no_math:
        line("mode", "--no-math: bytes counted by fs.count, no arrays")
    else:
        line("mode", f"real math on random normal q, k, v (seed {args.seed}); every HBM byte "
                     "counted")
    print()
    print("HBM traffic per tensor")
    print(traffic.table())
    print()
    line("total", f"{_exact(traffic.total_bytes)}: reads {human_bytes(traffic.read_bytes)}, "
                  f"writes {human_bytes(traffic.write_bytes)}")
    if is_flash:
        how = "from --block-sizes" if budget is None else "paper's rule, fitted to the SRAM budget"
        line("tiling", f"Br = {Br}, Bc = {Bc}, Tr = {cdiv(Nq, Br)}, Tc = {cdiv(Nk, Bc)} ({how})")
        vs = (f" of the {_exact(budget, compact=True)} budget ({100 * peak / budget:.0f}%)"
              if budget is not None else " (no budget given: --block-sizes)")
        if args.no_math:
            line("SRAM bound", f"{_exact(peak)}{vs} (footprint formula, tiling.sram_footprint)")
        else:
            line("SRAM peak", f"{_exact(peak)}{vs}")
    else:
        line("tiling", "none: standard attention writes S and P to HBM, so the SRAM size "
                       "does not change its traffic")
    if max_err is not None:
        line("accuracy", f"max |out - attention_reference| = {max_err:.2e}")
    elif not args.no_math:
        line("accuracy", "reference check skipped (too large for the dense float64 reference)")
    print()
    line("closed form", f"fs.theory.traffic = {_exact(closed.total_bytes)}; "
                        f"matches closed form: {'yes' if matches else 'no'}")
    if not matches:
        for (direction, name), (got, want) in traffic.diff(closed).items():
            line("", f"{direction} {name}: simulated {got:,} B, closed form {want:,} B")
    m_text = f", M = {M:,} elements" if M is not None else ""
    if is_flash and budget is None:
        m_text += " (the tiles' SRAM footprint)"
    n_text = f"N = {N_eff}" if Nq == Nk else f"N = √(Nq·Nk) ≈ {N_eff}"
    line("Theorem 2", f"Θ({theta_formula}) with {n_text}, d = {d}{m_text}")
    plural = "problem" if problems == 1 else "problems"
    line("", f"= {theta:,.0f} elements per problem ≈ {human_bytes(theta_bytes)} for {problems} "
             f"{plural}; simulated / Θ = {traffic.total_bytes / theta_bytes:.2f}")
    line("", "(an order-of-magnitude shape for reference, not an exact count)")
    return 0


# -- flashsim sweep ---------------------------------------------------------------------

def _sram_sizes(lo: int, hi: int, points: int) -> list[int]:
    if points == 1:
        return [lo]
    sizes = np.geomspace(lo, hi, points)
    return sorted({int(round(x)) for x in sizes})


def run_sweep(args) -> int:
    N, d, b = args.seq, args.head_dim, itemsize_of(args.dtype)
    lo, hi = parse_size(args.min_size), parse_size(args.max_size)
    if N < 1 or d < 1:
        raise CLIError(f"--seq and --head-dim must be >= 1, got {N} and {d}")
    if lo < 1 or hi < lo:
        raise CLIError(f"need 1 B <= --min <= --max, got --min {args.min_size} and "
                       f"--max {args.max_size}")
    if args.points < 1:
        raise CLIError(f"--points must be >= 1, got {args.points}")
    algs = _sweep_algorithms(args.algorithms, args.backward)
    tiled = [a for a in algs if a != "standard"]
    plt = _import_pyplot() if args.plot else None

    sizes = _sram_sizes(lo, hi, args.points)
    rows = []  # (M, {alg: total or None}, {alg: (Br, Bc) or None})
    minimum = {}
    from tqdm import tqdm
    # a progress bar on stderr for long sweeps (tqdm: in place on a terminal, sparse in logs)
    for M in tqdm(sizes, desc="sweep", unit="SRAM size", disable=len(sizes) <= 50,
                  file=sys.stderr, mininterval=1.0):
        totals, blocks = {}, {}
        for a in algs:
            try:
                rule = f"{a}-backward" if args.backward and a != "standard" else a
                blocks[a] = resolve_block_sizes(rule, sram_bytes=M, block_sizes=None, d=d, dv=d,
                                                itemsize=b)
                counter = count_backward if args.backward else count
                totals[a] = counter(a, Nq=N, Nk=N, d=d, sram_bytes=M, causal=args.causal,
                                    io_dtype=args.dtype).total_bytes
            except ValueError as e:  # SRAMOverflowError: no tile fits
                if getattr(e, "minimum_bytes", None) is None:
                    raise
                totals[a], blocks[a] = None, None
                minimum[a] = e.minimum_bytes
        rows.append((M, totals, blocks))

    print(f"flashsim sweep: {'backward' if args.backward else 'forward'} HBM traffic "
          "(reads + writes) against SRAM size M")
    print(f"problem: Nq = Nk = N = {N}, d = {d}, {args.dtype} I/O ({b} B/element), "
          f"{_causal_word(args.causal)}; {len(sizes)} sizes from {human_size(lo)} "
          f"to {human_size(hi)}")
    print()
    header = ["SRAM M"] + list(algs) + [f"{a} Br×Bc" for a in tiled]
    table = [header]
    for M, totals, blocks in rows:
        table.append([human_size(M)] + [human_bytes(totals[a]) for a in algs]
                     + [f"{blocks[a][0]}×{blocks[a][1]}" if blocks[a] else "-" for a in tiled])
    widths = [max(len(r[c]) for r in table) for c in range(len(header))]
    for k, r in enumerate(table):
        print("  ".join(cell.rjust(w) for cell, w in zip(r, widths)).rstrip())
        if k == 0:
            print("  ".join("-" * w for w in widths))
    for a, need in minimum.items():
        print(f"- : {a} has no tile that fits; it needs at least {need:,} B of SRAM")
    if "standard" in algs:
        print("(standard attention does not tile: its traffic does not depend on M)")

    if args.csv:
        with open(args.csv, "w", newline="") as f:
            wr = csv.writer(f)
            wr.writerow(["sram_bytes"] + [f"{a}_bytes" for a in algs]
                        + [f"{a}_{x}" for a in tiled for x in ("Br", "Bc")])
            for M, totals, blocks in rows:
                wr.writerow([M] + ["" if totals[a] is None else totals[a] for a in algs]
                            + [("" if blocks[a] is None else blocks[a][i])
                               for a in tiled for i in (0, 1)])
        print(f"wrote {args.csv}")
    if args.plot:
        _plot(plt, rows, args, algs)
        print(f"wrote {args.plot}")
    return 0


def _sweep_algorithms(text: str, backward: bool) -> tuple[str, ...]:
    algs = tuple(dict.fromkeys(a.strip() for a in text.split(",") if a.strip()))
    if not algs:
        raise CLIError("--algorithms needs at least one algorithm")
    for a in algs:
        if a not in SWEEP_ALGORITHMS:
            raise CLIError(f"--algorithms: unknown algorithm {a!r}; choose from "
                           f"{', '.join(SWEEP_ALGORITHMS)}")
        if backward and a not in BACKWARD_ALGORITHMS:
            raise CLIError(f"--backward: {a} has no backward pass; choose from "
                           f"{', '.join(BACKWARD_ALGORITHMS)}")
    return algs


class _MissingMatplotlib(Exception):
    pass


def _import_pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise _MissingMatplotlib(
            "--plot needs matplotlib, which is not installed; "
            'pip install "flashsim[analysis]" (or pip install matplotlib)') from None
    return plt


def _plot(plt, rows, args, algs=CORE_ALGORITHMS) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = {"standard": ("standard attention", "o-"), "flash1": ("FlashAttention-1", "s-"),
              "flash2": ("FlashAttention-2", "^-"), "square": ("square tiles (Saha & Ye)", "D-")}
    for a in algs:
        xs = [M for M, totals, _ in rows if totals[a] is not None]
        ys = [totals[a] for _, totals, _ in rows if totals[a] is not None]
        if xs:
            label, style = styles[a]
            ax.plot(xs, ys, style, label=label, markersize=4)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("SRAM size M (bytes)")
    ax.set_ylabel(f"{'backward' if args.backward else 'forward'} HBM traffic (bytes)")
    ax.set_title(f"N = {args.seq}, d = {args.head_dim}, {args.dtype}"
                 + (", causal" if args.causal else ""))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)
    plt.close(fig)


def run_kernels_build(args) -> int:
    from . import kernels
    spilled = set()
    for arch in args.arch or ["sm_90"]:
        rows = kernels.build(arch, nvcc=args.nvcc, cache=not args.no_cache, nvrtc=args.nvrtc)
        print(kernels.format_build(rows, arch + (" by NVRTC" if args.nvrtc else "")))
        print()
        spilled |= {"instrumented" if r.instrumented else "fast path"
                    for r in rows if r.spill_stores or r.spill_loads}
    if "fast path" in spilled:
        print("note: some fast-path variants spill registers to local memory "
              "(see 'spill st/ld')")
    elif spilled:
        print("note: no fast-path variant spills; some instrumented (byte-counting) "
              "variants do, which costs them speed, not correctness")
    return 0


# -- entry point ------------------------------------------------------------------------

def run_ring(args) -> int:
    """`flashsim simulate --algorithm ring --world-size W`: per-rank HBM and interconnect
    traffic of ring attention over W simulated ranks."""
    if args.algorithm != "ring" or args.world_size is None:
        raise CLIError("--world-size goes with --algorithm ring, which needs it")
    if args.no_math or args.backward:
        raise CLIError("--algorithm ring runs the forward's math on every rank; drop "
                       "--no-math and --backward")
    N, W = args.seq, args.world_size
    if args.seq_k not in (None, N):
        raise CLIError("ring attention splits one sequence: --seq-k must equal --seq")
    B, H = args.batch, args.heads
    Hk = H if args.kv_heads is None else args.kv_heads
    if Hk < 1 or H % Hk:
        raise CLIError(f"--kv-heads {Hk} must divide --heads {H}")
    if B * H * N * N > MAX_SCORE_ENTRIES:
        raise CLIError(f"B·H·N² = {B * H * N * N:,} attention scores is too many for a math "
                       "run (limit 2**31)")
    sram = args.sram if args.block_sizes is None else None
    if sram is None and args.block_sizes is None:
        sram = DEFAULT_SRAM
    rng = np.random.default_rng(args.seed)
    d, dv = args.head_dim, args.head_dim_v or args.head_dim
    q = rng.standard_normal((B, H, N, d), dtype=np.float32)
    k = rng.standard_normal((B, Hk, N, d), dtype=np.float32)
    v = rng.standard_normal((B, Hk, N, dv), dtype=np.float32)
    r = simulate(q, k, v, "ring", world_size=W, assignment=args.assignment,
                 causal=args.causal, io_dtype=args.dtype, hardware=args.hardware or "H100",
                 sram_bytes=sram, block_sizes=tuple(args.block_sizes) if args.block_sizes else None)
    ring = r.ring
    if args.json:
        print(json.dumps({"algorithm": "ring", "world_size": W, "assignment": args.assignment,
                          "ranks": [t.to_dict() for t in ring.ranks],
                          "links": [t.to_dict() for t in ring.links],
                          "traffic": r.traffic.to_dict(), "time_s": ring.time_s,
                          "steps": [{k_: (list(v_) if isinstance(v_, tuple) else v_)
                                     for k_, v_ in st.items()} for st in ring.steps]},
                         indent=2))
        return 0
    print(f"flashsim simulate: ring attention over {W} ranks ({args.assignment} slices), "
          f"N = {N}, d = {d}, batch {B}, heads {H}"
          + (f" (K/V heads {Hk})" if Hk != H else "") + f", {args.dtype}, "
          f"{_causal_word(args.causal)}; tiles {r.block_sizes[0]}×{r.block_sizes[1]}")
    print()
    print("HBM traffic per rank")
    print(format_table({f"rank {i}": t for i, t in enumerate(ring.ranks[:4])}))
    if W > 4:
        print(f"(ranks 4 … {W - 1} not shown; --json has all)")
    print()
    print("interconnect per rank (read = received, write = sent)")
    print(ring.links[0].table())
    print()
    hw = get_hardware(args.hardware or "H100")
    print(f"predicted on {hw.name} (NVLink {hw.link_bytes_per_s / 1e9:.0f} GB/s each way): "
          f"{ring.time_s * 1e6:.1f} µs over {W} steps, each the larger of its compute and "
          "its transfer")
    fine = np.abs(r.out - simulate(q, k, v, "flash2", causal=args.causal, sram_bytes=sram,
                                   block_sizes=tuple(args.block_sizes) if args.block_sizes
                                   else None).out).max()
    print(f"max |out − flash2's out on one device| = {fine:.2e}")
    return 0


def run_hardware(args) -> int:
    """`flashsim simulate --hardware H100`: the three-level prediction of a kernel launch."""
    if args.algorithm != "flash2":
        raise CLIError(f"--hardware models the project's kernels, which run flash2; got "
                       f"--algorithm {args.algorithm}")
    if args.sram is not None:
        raise CLIError("--hardware uses the kernel's tiles: drop --sram (--block-sizes sets "
                       "the reference kernel's)")
    if args.deterministic and not args.backward:
        raise CLIError("--deterministic applies to --backward")
    Nq = args.seq
    Nk = args.seq if args.seq_k is None else args.seq_k
    B, H = args.batch, args.heads
    Hk = H if args.kv_heads is None else args.kv_heads
    if Hk < 1 or H % Hk:
        raise CLIError(f"--kv-heads {Hk} must divide --heads {H}")
    kw = dict(Nq=Nq, Nk=Nk, d=args.head_dim, dv=args.head_dim_v, batch_shape=(B, H),
              kv_batch_shape=(B, Hk), causal=args.causal, io_dtype=args.dtype,
              block_sizes=tuple(args.block_sizes) if args.block_sizes else None,
              hardware=args.hardware, launch=args.launch)
    if args.backward:
        pred = count_backward("flash2", deterministic=args.deterministic, **kw)
    else:
        pred = count("flash2", **kw)
    hw = get_hardware(args.hardware)
    if args.json:
        print(json.dumps({
            "hardware": hw.name, "backward": args.backward,
            "problem": {"Nq": Nq, "Nk": Nk, "d": args.head_dim, "batch": B, "heads": H,
                        "kv_heads": Hk, "causal": bool(args.causal), "dtype": args.dtype},
            "launches": [{"kernel": lp.launch.kernel, "grid": list(lp.launch.grid),
                          "threads": lp.launch.threads, "ctas_per_sm": lp.launch.ctas_per_sm,
                          "waves": lp.launch.waves, "block_sizes": [lp.launch.Br, lp.launch.Bc],
                          "levels": lp.levels.to_dict(), "writeback": lp.writeback.to_dict(),
                          "time_s": lp.time_s, "time_parts": lp.time_parts,
                          "superblock": lp.superblock} for lp in pred.launches],
            "levels": pred.levels.to_dict(), "time_s": pred.time_s,
            "two_level": pred.traffic.to_dict()}, indent=2))
        return 0
    seqs = f"Nq = Nk = {Nq}" if Nq == Nk else f"Nq = {Nq}, Nk = {Nk}"
    heads = f"heads {H}" + (f" (K/V heads {Hk})" if Hk != H else "")
    print(f"flashsim simulate --hardware: flash2 {'backward' if args.backward else 'forward'} "
          f"on {hw.name}")
    print(f"problem: {seqs}, d = {args.head_dim}, batch {B}, {heads}, {args.dtype}, "
          f"{_causal_word(args.causal)}")
    print(f"L2: {human_bytes(hw.l2_bytes)}"
          + (f", keeping {human_bytes(hw.l2_retention[0])} to {human_bytes(hw.l2_retention[1])} "
             "of a streamed buffer (an average of LRU capacities)" if hw.l2_retention else
             " (one LRU)"))
    print()
    print(pred.table())
    print()
    lv = pred.levels
    comp = lv.compulsory.total_bytes
    dram, after = lv.dram.total_bytes, pred.writeback.total_bytes
    print(f"DRAM: {human_bytes(dram)} during the launch{'es' if len(pred.launches) > 1 else ''} "
          f"+ {human_bytes(after)} of writes left in L2 = {(dram + after) / comp:.2f}x the "
          f"compulsory {human_bytes(comp)}; the two-level count (every SRAM fill from memory) "
          f"is {human_bytes(pred.traffic.total_bytes)} = {pred.traffic.total_bytes / comp:.2f}x")
    print(f"predicted time: {pred.time_s * 1e3:.3f} ms "
          f"({pred.flops / pred.time_s / 1e12:.0f} TFLOP/s of matrix products)"
          if pred.flops else f"predicted time: {pred.time_s * 1e3:.3f} ms")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        from .bench import main as bench_main     # its own options (flashsim bench --help)
        return bench_main(argv[1:], prog=f"{PROG} bench")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command is None:
            return run_default()
        if args.command == "simulate":
            return run_simulate(args)
        if args.command == "kernels":
            return run_kernels_build(args)
        return run_sweep(args)
    except (ValueError, TypeError, OSError, RuntimeError, _MissingMatplotlib) as e:
        # ValueError covers fs.SRAMOverflowError; OSError an unwritable --csv/--plot path
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
