"""Softmax over the last axis, three ways, with memory accesses counted.

After Milakov & Gimelshein (2018), "Online normalizer calculation for softmax".
For a row x of length n, y_i = exp(x_i) / d with d = Σ_j exp(x_j). The three methods
differ in how many times each element of x crosses memory (reads of x plus writes
of y; the scalars m and d of a row live in registers and are not counted):

naive (3 accesses per element)
    pass 1 reads x:             d = Σ exp(x_j)
    pass 2 reads x, writes y:   y_i = exp(x_i) / d
    Not numerically safe: exp(x) overflows to inf once x ≳ 709.8 (float64), giving
    inf/inf = NaN, and underflows to 0 for x ≲ −745, giving 0/0 = NaN (a row of all
    −inf is the extreme case). The result is whatever NumPy gives; its warnings are
    silenced so nothing is printed.

safe (4 accesses per element)
    pass 1 reads x:             m = max_j x_j
    pass 2 reads x:             d = Σ exp(x_j − m)
    pass 3 reads x, writes y:   y_i = exp(x_i − m) / d
    Every exponent is ≤ 0, so nothing overflows and d ≥ 1 (the max term is
    exp(0) = 1) — but the max costs a whole extra pass over x.

online (3 accesses per element)
    pass 1 reads x once, keeping the running max m and the normaliser d together.
    For each new chunk c of the row:
        m_new = max(m, max(c))
        d     = d · exp(m − m_new) + Σ exp(c_j − m_new)
        m     = m_new
    pass 2 reads x, writes y:   y_i = exp(x_i − m) / d
    The invariant after each chunk is d = Σ_{j seen} exp(x_j − m) for the current m:
    rescaling the old sum by exp(m − m_new) moves it onto the new reference point.
    Every exponent is still ≤ 0, so online is exactly as safe as `safe`, while the
    max and the sum share one pass, so it costs what `naive` costs: 3 accesses. This
    is the same rescaling FlashAttention applies to its running (m, ℓ) per query row.

In code the normaliser d is called ``l`` (ℓ), as in the rest of the package (m, l, L).

Conventions:
  * −inf entries are allowed (masked entries) and get probability 0.
  * A row whose entries are all −inf has no finite reference point; its output is
    defined as all zeros for `safe` and `online` (never NaN). `naive` gives 0/0 = NaN
    there, as NumPy does.
  * NaN and +inf are rejected: neither has a meaningful softmax.
  * The math is float64 whatever the float dtype of x.

The passes really stream over the last axis in chunks of ``block`` columns
(vectorised over all rows at once) and the access counts are tallied as each chunk is
touched, so ``reads`` and ``writes`` come from the loops themselves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

METHODS = ("naive", "safe", "online")

__all__ = ["softmax", "SoftmaxResult", "METHODS"]


@dataclass(frozen=True, eq=False)  # eq=False: == on arrays inside is ambiguous
class SoftmaxResult:
    """What `softmax` returns.

    y: float64, same shape as x; method: the method used; reads, writes: element
    reads of x and element writes of y, counted chunk by chunk.
    """
    y: np.ndarray
    method: str
    reads: int
    writes: int

    @property
    def accesses_per_element(self) -> float:
        """(reads + writes) / x.size; 0.0 for an empty x."""
        size = self.y.size
        return (self.reads + self.writes) / size if size else 0.0


class _Counter:
    """Element reads/writes of memory, tallied as each chunk is touched."""

    def __init__(self, rows: int):
        self.rows = rows
        self.reads = 0
        self.writes = 0

    def read(self, chunk: np.ndarray) -> np.ndarray:
        self.reads += self.rows * chunk.shape[-1]
        return chunk

    def write(self, out: np.ndarray, cols: slice, values: np.ndarray) -> None:
        out[..., cols] = values
        self.writes += self.rows * values.shape[-1]


def softmax(x, method: str = "online", *, block: int = 128) -> SoftmaxResult:
    """Softmax of ``x`` over its last axis by ``method`` ∈ {"naive", "safe", "online"}.

    ``x`` is a float array of any shape with at least one axis; leading axes are
    independent rows. ``block`` is the number of columns each streaming step touches.
    Returns a `SoftmaxResult` with y (float64) and the counted reads and writes.
    """
    method = _check_method(method)
    block = _check_block(block)
    x = _check_x(x)

    n = x.shape[-1]
    counter = _Counter(math.prod(x.shape[:-1]))
    y = np.empty(x.shape, dtype=np.float64)
    chunks = [slice(c0, min(c0 + block, n)) for c0 in range(0, n, block)]

    # The caller asked for the method as it is, overflow included; NumPy's warnings
    # would only repeat what the docstring says.
    with np.errstate(over="ignore", under="ignore", invalid="ignore", divide="ignore"):
        if method == "naive":
            _naive(x, y, chunks, counter)
        elif method == "safe":
            _safe_softmax(x, y, chunks, counter)
        else:
            _online(x, y, chunks, counter)

    return SoftmaxResult(y=y, method=method, reads=counter.reads, writes=counter.writes)


# -- the three methods -----------------------------------------------------------------

def _naive(x, y, chunks, counter: _Counter) -> None:
    l = np.zeros(x.shape[:-1])
    for cols in chunks:                                        # pass 1: reads x
        l += np.exp(counter.read(x[..., cols])).sum(axis=-1)
    for cols in chunks:                                        # pass 2: reads x, writes y
        counter.write(y, cols, np.exp(counter.read(x[..., cols])) / l[..., None])


def _safe_softmax(x, y, chunks, counter: _Counter) -> None:
    m = np.full(x.shape[:-1], -np.inf)
    for cols in chunks:                                        # pass 1: reads x
        m = np.maximum(m, counter.read(x[..., cols]).max(axis=-1))
    m0 = _finite_ref(m)
    l = np.zeros(x.shape[:-1])
    for cols in chunks:                                        # pass 2: reads x
        l += np.exp(counter.read(x[..., cols]) - m0[..., None]).sum(axis=-1)
    l = _divisor(l)
    for cols in chunks:                                        # pass 3: reads x, writes y
        p = np.exp(counter.read(x[..., cols]) - m0[..., None])
        counter.write(y, cols, p / l[..., None])


def _online(x, y, chunks, counter: _Counter) -> None:
    m = np.full(x.shape[:-1], -np.inf)
    l = np.zeros(x.shape[:-1])
    for cols in chunks:                                        # pass 1: reads x once
        c = counter.read(x[..., cols])
        m_new = np.maximum(m, c.max(axis=-1))
        m_ref = _finite_ref(m_new)
        # Move the old sum onto the new reference point, then add this chunk's terms.
        l = l * np.exp(m - m_ref) + np.exp(c - m_ref[..., None]).sum(axis=-1)
        m = m_new
    m0 = _finite_ref(m)
    l = _divisor(l)
    for cols in chunks:                                        # pass 2: reads x, writes y
        p = np.exp(counter.read(x[..., cols]) - m0[..., None])
        counter.write(y, cols, p / l[..., None])


def _finite_ref(m: np.ndarray) -> np.ndarray:
    # A row with only −inf so far has m = −∞; subtracting 0 instead keeps
    # exp(−∞ − 0) = 0 where exp(−∞ − (−∞)) would be NaN.
    return np.where(np.isneginf(m), 0.0, m)


def _divisor(l: np.ndarray) -> np.ndarray:
    # l = 0 only for an all −inf row (otherwise the max term contributes exp(0) = 1).
    # Its numerators exp(−∞ − 0) are all 0, so dividing by 1 gives the documented
    # all-zeros row instead of 0/0 = NaN.
    return np.where(l > 0, l, 1.0)


# -- validation ------------------------------------------------------------------------

def _check_method(method) -> str:
    if not isinstance(method, str) or method not in METHODS:
        raise ValueError(f"unknown softmax method {method!r}; choose one of "
                         f"{', '.join(repr(m) for m in METHODS)}")
    return method


def _check_block(block) -> int:
    if isinstance(block, (bool, np.bool_)) or not isinstance(block, (int, np.integer)):
        raise TypeError(f"block must be a positive integer (columns per chunk), "
                        f"got {block!r}")
    if block < 1:
        raise ValueError(f"block must be a positive integer (columns per chunk), "
                         f"got {block}; use e.g. block=128")
    return int(block)


def _check_x(x) -> np.ndarray:
    try:
        arr = np.asarray(x)
    except (TypeError, ValueError) as e:
        raise TypeError(f"x must be a numeric float array; np.asarray(x) failed: {e}") from None
    kind = arr.dtype.kind
    if kind in "iu":
        raise TypeError(f"x has integer dtype {arr.dtype}; softmax needs floats, "
                        "convert with x.astype(float)")
    if kind == "b":
        raise TypeError("x has boolean dtype; softmax needs floats, convert with "
                        "x.astype(float)")
    if kind == "c":
        raise TypeError(f"x has complex dtype {arr.dtype}; softmax is defined for real "
                        "floats only, pass x.real if that is what you mean")
    if kind != "f":
        raise TypeError(f"x must be a numeric float array, got dtype {arr.dtype}; "
                        "pass a NumPy array of floats")
    if arr.ndim == 0:
        raise ValueError("x must have at least one axis (softmax runs over the last "
                         "one); wrap a scalar with np.atleast_1d(x)")
    arr = arr.astype(np.float64, copy=False)
    if np.isnan(arr).any():
        raise ValueError("x contains NaN, which has no softmax; remove or replace it "
                         "(use -inf to mask an entry out)")
    if np.isposinf(arr).any():
        raise ValueError("x contains +inf, which has no well-defined softmax; clip it "
                         "to a finite value (use -inf to mask an entry out)")
    return arr
