"""Side-by-side GPU timing of attention, forward and backward, in one process:
`flashsim bench` (flashsim/bench.py, where every option is described), writing to
analysis/out/bench/ by default.

    python3 analysis/bench_attention.py [--quick] [--ds 32,64,96,128,160,192,224,256] [--ns ...] [--dtypes ...]
                                        [--causal both|yes|no] [--out DIR] [--json]
"""

from __future__ import annotations

import os
import sys

import _common  # noqa: E402  (puts the repository root on sys.path)

from flashsim.bench import main as bench_main  # noqa: E402


def main(argv=None):
    return bench_main(argv, default_out=os.path.join(_common.HERE, "out", "bench"),
                      prog="bench_attention.py")


if __name__ == "__main__":
    sys.exit(main())
