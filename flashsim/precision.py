"""Arithmetic precision of a simulated run.

- ``"float64"`` (default): exact math in float64, whatever the I/O type; the oracle.
- ``"kernel"``: the numerics of the GPU kernels, so a low-precision kernel can be
  compared tightly with the simulator and not only with a float64 oracle: inputs rounded
  to the I/O type; S, the running statistics and every accumulation in fp32 (float64 for
  float64 I/O); P (and, backward, dS) rounded to the I/O type before the second matrix
  product, as a tensor-core kernel feeds them to its MMA; outputs rounded to the I/O
  type; L, D and the dQ accumulator stored as fp32.

bfloat16 rounding (round to nearest even on the top 16 bits of an fp32) is emulated,
since NumPy has no bfloat16.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .problem import itemsize_of

PRECISIONS = ("float64", "kernel")


def round_bf16(x) -> np.ndarray:
    """Round to the nearest bfloat16 (ties to even), returned as float32."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32)


def _io_kind(io_dtype) -> str:
    if isinstance(io_dtype, str) and io_dtype.strip().lower() in ("bf16", "bfloat16",
                                                                   "torch.bfloat16"):
        return "bfloat16"
    if getattr(io_dtype, "name", None) == "bfloat16" or str(io_dtype) == "torch.bfloat16":
        return "bfloat16"
    return {2: "float16", 4: "float32", 8: "float64"}.get(itemsize_of(io_dtype), "float64")


@dataclass(frozen=True)
class Precision:
    name: str
    io: str            # "float16", "bfloat16", "float32" or "float64"

    @property
    def exact(self) -> bool:
        return self.name == "float64"

    @property
    def acc(self) -> type:
        if self.exact or self.io == "float64":
            return np.float64
        return np.float32

    def cast(self, x):
        """Into the accumulation type."""
        return np.asarray(x, dtype=self.acc)

    def io_round(self, x):
        """Round to the I/O type (identity in exact mode)."""
        if self.exact or self.io == "float64":
            return x
        if self.io == "bfloat16":
            return round_bf16(x).astype(self.acc, copy=False)
        dt = np.float16 if self.io == "float16" else np.float32
        return np.asarray(x).astype(dt).astype(self.acc)

    def stat_round(self, x):
        """Round a stored statistic to fp32 (identity in exact mode)."""
        if self.exact:
            return x
        return np.asarray(x).astype(np.float32).astype(self.acc)


def make_precision(precision: str, io_dtype) -> Precision:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    return Precision(precision, _io_kind(io_dtype))


EXACT = Precision("float64", "float64")
