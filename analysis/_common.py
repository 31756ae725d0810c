"""Shared helpers of the analysis scripts: import path, output files, tables, plotting
and GPU timing. Not part of the package; the scripts import it as ``_common``."""

from __future__ import annotations

import csv
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# run from a checkout without installing: the repository root comes first
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

DEFAULT_OUT = os.path.join(HERE, "out")
INSTALL_HINT = 'pip install "flashsim[analysis]"'


class MissingMatplotlib(RuntimeError):
    pass


def pyplot():
    """matplotlib.pyplot on the Agg backend, or MissingMatplotlib with the install hint."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MissingMatplotlib(
            f"plotting needs matplotlib, which is not installed: {INSTALL_HINT} "
            "(or pip install matplotlib); the numbers were written without the figure"
        ) from None
    return plt


def save_figure(fig, out_dir: str, name: str) -> str:
    """Lay out and write a figure as out_dir/name (130 dpi); returns its path."""
    fig.tight_layout()
    path = out_file(out_dir, name)
    fig.savefig(path, dpi=130)
    print(f"wrote {os.path.relpath(path)}")
    return path


def out_file(out_dir: str, name: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    return os.path.join(out_dir, name)


def write_text(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text if text.endswith("\n") else text + "\n")
    print(f"wrote {os.path.relpath(path)}")


def write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
    print(f"wrote {os.path.relpath(path)}")


def write_csv(path: str, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {os.path.relpath(path)}")


def md_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def human_n(n: int) -> str:
    """1024 -> '1k', 16384 -> '16k', 300 -> '300'."""
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def gpu_info():
    """(cupy module, GPU name) when CuPy and a GPU are there, else (None, None)."""
    import flashsim as fs
    if not fs.gpu.available():
        return None, None
    import cupy as cp
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    name = props["name"]
    return cp, name.decode() if isinstance(name, bytes) else name


def time_on_gpu(time_fn, *args):
    """(timing, GPU name): ``time_fn(cp, *args)`` on the GPU when there is one, else
    (None, None) after saying that the runtime column needs one."""
    cp, gpu = gpu_info()
    if cp is None:
        print("no GPU (fs.gpu.available() is False): the runtime column needs CuPy and a "
              "CUDA GPU; leaving it empty")
        return None, None
    print(f"timing on {gpu} ...")
    return time_fn(cp, *args), gpu


def cuda_time(cp, fn, warmup: int = 3, reps: int = 10) -> float:
    """Median milliseconds of fn() over ``reps`` runs timed with CUDA events."""
    import numpy as np
    for _ in range(warmup):
        fn()
    cp.cuda.Device().synchronize()
    times = []
    for _ in range(reps):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop))
    return float(np.median(times))
