"""Variable-length (packed) batches, as FlashAttention's ``flash_attn_varlen_func``.

The sequences of a batch are concatenated along the token axis instead of padded:

    q (total_q, Hq, d), k (total_k, Hk, d), v (total_k, Hk, dv)
    cu_seqlens_q = [0, Nq_0, Nq_0 + Nq_1, …, total_q]    (batch + 1 integers)
    cu_seqlens_k = [0, Nk_0, Nk_0 + Nk_1, …, total_k]

Sequence b is q[cu_q[b]:cu_q[b+1]] against k, v[cu_k[b]:cu_k[b+1]] and attends only
within itself; a causal mask or a window is aligned to the bottom-right corner of each
sequence's own Nq_b × Nk_b score matrix. Lengths of 0 are allowed (an empty query
sequence does nothing; an empty key sequence gives out = 0, lse = −∞).

Each sequence is run as its own `flashsim.simulate` problem (heads as the batch axis,
so GQA works as there), and the traffic is the sum over sequences: a kernel that
works on packed data moves only the real rows, never padding.

The backward (`simulate_varlen_backward`) takes the forward's packed out (total_q, Hq, dv)
and lse (Hq, total_q) with dout like out, and runs each sequence through
`flashsim.simulate_backward` the same way; `count_varlen_backward` sums
`flashsim.count_backward`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .backward import _check_backward_algorithm, _check_saved, count_backward, simulate_backward
from .count import count
from .problem import check_algorithm, check_size, itemsize_of
from .simulate import simulate
from .tiling import resolve_block_sizes
from .traffic import Traffic


@dataclass(frozen=True)
class VarlenResult:
    """What `simulate_varlen` returns.

    out: (total_q, Hq, dv) float64, packed like q. lse: (Hq, total_q) float64, heads
    first, as FlashAttention's varlen forward returns its softmax_lse (natural log; −inf
    for a row that sees no key). traffic: HBM bytes summed over the sequences;
    per_sequence: each sequence's traffic. block_sizes: (Br, Bc) shared by every
    sequence (None for standard attention). sram_peak_bytes: the largest peak over the
    sequences (None for standard attention; 0 for an empty batch).
    """
    out: np.ndarray
    lse: np.ndarray
    traffic: Traffic
    per_sequence: tuple
    block_sizes: tuple[int, int] | None
    sram_peak_bytes: int | None
    algorithm: str
    cu_seqlens_q: np.ndarray
    cu_seqlens_k: np.ndarray


@dataclass(frozen=True)
class VarlenGradients:
    """What `simulate_varlen_backward` returns.

    dq (total_q, Hq, d), dk (total_k, Hk, d), dv (total_k, Hk, dv): float64, packed like
    q, k, v (GQA groups summed into their K/V head). traffic: HBM bytes summed over the
    sequences; per_sequence: each sequence's traffic. block_sizes: (Br, Bc) shared by
    every sequence (None for standard attention without block_sizes). sram_peak_bytes:
    the largest peak over the sequences (None for standard attention; 0 for an empty
    batch).
    """
    dq: np.ndarray
    dk: np.ndarray
    dv: np.ndarray
    traffic: Traffic
    per_sequence: tuple
    block_sizes: tuple[int, int] | None
    sram_peak_bytes: int | None
    algorithm: str
    cu_seqlens_q: np.ndarray
    cu_seqlens_k: np.ndarray


def check_cu_seqlens(name: str, cu, total: int | None = None) -> np.ndarray:
    """Validate cumulative sequence lengths: 1-D integers, starting at 0,
    non-decreasing, ending at the packed length ``total`` (if given)."""
    a = np.asarray(cu)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an integer array (e.g. int32), got dtype {a.dtype}")
    if a.ndim != 1 or a.shape[0] < 1:
        raise ValueError(f"{name} must be 1-D of length batch + 1 (>= 1), got shape {a.shape}")
    a = a.astype(np.int64)
    if a[0] != 0:
        raise ValueError(f"{name} must start at 0, got {name}[0] = {a[0]}")
    if (np.diff(a) < 0).any():
        b = int(np.argmax(np.diff(a) < 0))
        raise ValueError(f"{name} must be non-decreasing (lengths >= 0), but "
                         f"{name}[{b + 1}] = {a[b + 1]} < {name}[{b}] = {a[b]}")
    if total is not None and a[-1] != total:
        raise ValueError(f"{name}[-1] = {a[-1]} must equal the packed length {total} "
                         f"(the number of tokens along axis 0)")
    return a


def _check_batches(cu_q: np.ndarray, cu_k: np.ndarray) -> int:
    if cu_q.shape[0] != cu_k.shape[0]:
        raise ValueError(f"cu_seqlens_q describes {cu_q.shape[0] - 1} sequences but "
                         f"cu_seqlens_k {cu_k.shape[0] - 1}; both need batch + 1 entries")
    return cu_q.shape[0] - 1


def _packed(name: str, x, what: str) -> np.ndarray:
    if not isinstance(x, np.ndarray):
        x = np.asarray(x)
    if x.ndim != 3:
        raise ValueError(f"{name} must be 3-D packed ({what}), got shape {x.shape}")
    return x


def _slopes_per_sequence(alibi_slopes, batch: int, Hq: int):
    if alibi_slopes is None:
        return [None] * batch
    s = np.asarray(alibi_slopes)
    if s.ndim == 1 and s.shape == (Hq,):
        return [s] * batch
    if s.ndim == 2 and s.shape == (batch, Hq):
        return [s[b] for b in range(batch)]
    raise ValueError(f"alibi_slopes must have shape ({Hq},) or ({batch}, {Hq}) "
                     f"(per sequence and query head); got {s.shape}")


@dataclass(frozen=True)
class _Packed:
    """A validated packed batch: arrays, cumulative lengths and per-sequence slopes."""
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    cu_q: np.ndarray
    cu_k: np.ndarray
    slopes: list

    @property
    def batch(self) -> int:
        return self.cu_q.shape[0] - 1

    def sequences(self):
        """(b, query slice, key slice) for each sequence."""
        for b in range(self.batch):
            yield (b, slice(int(self.cu_q[b]), int(self.cu_q[b + 1])),
                   slice(int(self.cu_k[b]), int(self.cu_k[b + 1])))


def _no_ring(algorithm: str) -> None:
    if algorithm == "ring":
        raise ValueError("packed varlen batches run one sequence per problem; ring attention "
                         "splits one sequence over ranks: use fs.simulate(..., 'ring')")


def _prepare(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes) -> _Packed:
    """The checks the forward and the backward share."""
    q = _packed("q", q, "total_q, heads, d")
    k = _packed("k", k, "total_k, kv_heads, d")
    v = _packed("v", v, "total_k, kv_heads, dv")
    if k.shape[0] != v.shape[0] or k.shape[1] != v.shape[1]:
        raise ValueError(f"k {k.shape} and v {v.shape} must have the same tokens and heads "
                         "(axes 0 and 1)")
    cu_q = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0])
    cu_k = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0])
    batch = _check_batches(cu_q, cu_k)
    return _Packed(q, k, v, cu_q, cu_k, _slopes_per_sequence(alibi_slopes, batch, q.shape[1]))


def _heads_first(x: np.ndarray, rows: slice) -> np.ndarray:
    """Packed (tokens, heads, ·) rows → (heads, N_b, ·), the layout `simulate` takes."""
    return np.moveaxis(x[rows], 0, 1)


def _tokens_first(x: np.ndarray) -> np.ndarray:
    """(heads, N_b, ·) → packed (N_b, heads, ·)."""
    return np.moveaxis(x, 0, 1)


def _totals(results, standard: bool):
    """(summed traffic, per-sequence traffic, max SRAM peak) of per-sequence results."""
    per_seq = tuple(r.traffic for r in results)
    peak = None if standard else max((r.sram_peak_bytes for r in results), default=0)
    return sum(per_seq, Traffic()), per_seq, peak


def _check_saved_packed(name: str, x, want: tuple, layout: str, **kw) -> np.ndarray:
    x = x if isinstance(x, np.ndarray) else np.asarray(x)
    if x.shape != want:
        raise ValueError(f"{name} must have the packed shape ({layout}) = {want}, "
                         f"got {x.shape}")
    return _check_saved(name, x, want, **kw)      # dtype, NaN / Inf


def simulate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, algorithm: str = "flash2", *,
                    sram_bytes=None, block_sizes=None, causal: bool = False, scale=None,
                    io_dtype=None, window=None, softcap=None, alibi_slopes=None,
                    num_splits=None) -> VarlenResult:
    """Run ``algorithm`` on a packed batch and count its HBM traffic.

    q (total_q, Hq, d), k (total_k, Hk, d), v (total_k, Hk, dv); Hk divides Hq (GQA);
    cu_seqlens_q/k: integer arrays of shape (batch + 1,) (see the module docstring).
    ``alibi_slopes``: (Hq,) or (batch, Hq). Other options as in `flashsim.simulate`,
    applied to every sequence. Returns a `VarlenResult` (lse is (Hq, total_q)).
    """
    algorithm = check_algorithm(algorithm)
    _no_ring(algorithm)
    p = _prepare(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes)
    q, Hq, dv = p.q, p.q.shape[1], p.v.shape[2]
    if io_dtype is None:
        io_dtype = q.dtype
    # validate the tiling once (also for an empty batch); every sequence shares it
    blocks = resolve_block_sizes(algorithm, sram_bytes=sram_bytes, block_sizes=block_sizes,
                                 d=q.shape[2], dv=dv, itemsize=itemsize_of(io_dtype))

    out = np.zeros((q.shape[0], Hq, dv))
    lse = np.full((Hq, q.shape[0]), -np.inf)
    results = []
    for b, sq, sk in p.sequences():
        r = simulate(_heads_first(q, sq), _heads_first(p.k, sk), _heads_first(p.v, sk),
                     algorithm, sram_bytes=sram_bytes, block_sizes=block_sizes,
                     causal=causal, scale=scale, io_dtype=io_dtype, window=window,
                     softcap=softcap, alibi_slopes=p.slopes[b], num_splits=num_splits)
        out[sq] = _tokens_first(r.out)                 # (Hq, Nq_b, dv) → (Nq_b, Hq, dv)
        lse[:, sq] = r.lse                             # (Hq, Nq_b)
        results.append(r)
    traffic, per_seq, peak = _totals(results, algorithm == "standard")
    return VarlenResult(out=out, lse=lse, traffic=traffic, per_sequence=per_seq,
                        block_sizes=blocks, sram_peak_bytes=peak, algorithm=algorithm,
                        cu_seqlens_q=p.cu_q, cu_seqlens_k=p.cu_k)


def simulate_varlen_backward(q, k, v, out, lse, dout, cu_seqlens_q, cu_seqlens_k,
                             algorithm: str = "flash2", *, sram_bytes=None, block_sizes=None,
                             causal: bool = False, scale=None, io_dtype=None, window=None,
                             softcap=None, alibi_slopes=None,
                             precision: str = "float64") -> VarlenGradients:
    """Gradients of a packed batch with respect to q, k, v, run per sequence with
    `flashsim.simulate_backward` (``algorithm`` ∈ {"standard", "flash1", "flash2"}).

    q, k, v, cu_seqlens_q/k and ``alibi_slopes`` as in `simulate_varlen`; ``out``
    (total_q, Hq, dv) and ``lse`` (Hq, total_q) are its results, ``dout`` is shaped like
    ``out``. A sequence with no query or no key gets zero gradients (and the traffic
    `flashsim.count_backward` gives it). Returns a `VarlenGradients`.
    """
    algorithm = _check_backward_algorithm(algorithm)
    p = _prepare(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes)
    q, k, v = p.q, p.k, p.v
    total_q, Hq, d, dv = q.shape[0], q.shape[1], q.shape[2], v.shape[2]
    out = _check_saved_packed("out", out, (total_q, Hq, dv), "total_q, heads, dv")
    dout = _check_saved_packed("dout", dout, (total_q, Hq, dv), "total_q, heads, dv")
    lse = _check_saved_packed("lse", lse, (Hq, total_q), "heads, total_q: heads first, as "
                              "simulate_varlen returns it", allow_neg_inf=True)
    if io_dtype is None:
        io_dtype = q.dtype
    rule = "standard" if algorithm == "standard" else f"{algorithm}-backward"
    blocks = resolve_block_sizes(rule, sram_bytes=sram_bytes, block_sizes=block_sizes,
                                 d=d, dv=dv, itemsize=itemsize_of(io_dtype))

    dq, dk, dvv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    results = []
    for b, sq, sk in p.sequences():
        g = simulate_backward(_heads_first(q, sq), _heads_first(k, sk), _heads_first(v, sk),
                              _heads_first(out, sq), lse[:, sq], _heads_first(dout, sq),
                              algorithm, sram_bytes=sram_bytes, block_sizes=block_sizes,
                              causal=causal, scale=scale, io_dtype=io_dtype, window=window,
                              softcap=softcap, alibi_slopes=p.slopes[b], precision=precision)
        dq[sq], dk[sk], dvv[sk] = (_tokens_first(x) for x in (g.dq, g.dk, g.dv))
        results.append(g)
    traffic, per_seq, peak = _totals(results, algorithm == "standard")
    return VarlenGradients(dq=dq, dk=dk, dv=dvv, traffic=traffic, per_sequence=per_seq,
                           block_sizes=blocks, sram_peak_bytes=peak, algorithm=algorithm,
                           cu_seqlens_q=p.cu_q, cu_seqlens_k=p.cu_k)


def _count_sum(counter, cu_seqlens_q, cu_seqlens_k, heads, kv_heads, **kw) -> Traffic:
    """Sum ``counter(Nq=…, Nk=…, batch_shape=(heads,), …)`` over the sequences."""
    cu_q = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q)
    cu_k = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k)
    batch = _check_batches(cu_q, cu_k)
    heads = check_size("heads", heads, 1)
    kv_heads = heads if kv_heads is None else check_size("kv_heads", kv_heads, 1)
    kw.update(batch_shape=(heads,), kv_batch_shape=(kv_heads,))
    if batch == 0:   # still validate the options
        counter(Nq=0, Nk=0, **kw)
    total = Traffic()
    for b in range(batch):
        total = total + counter(Nq=int(cu_q[b + 1] - cu_q[b]),
                                Nk=int(cu_k[b + 1] - cu_k[b]), **kw)
    return total


def count_varlen(algorithm: str, *, cu_seqlens_q, cu_seqlens_k, heads: int,
                 kv_heads: int | None = None, d: int, dv: int | None = None,
                 sram_bytes=None, block_sizes=None, causal: bool = False,
                 io_dtype="float16", window=None, num_splits=None) -> Traffic:
    """HBM traffic of a packed batch without arrays: the sum of `flashsim.count` over
    the sequences; equal to ``simulate_varlen(...).traffic`` for the same problem."""
    algorithm = check_algorithm(algorithm)
    _no_ring(algorithm)
    return _count_sum(lambda **kw: count(algorithm, **kw), cu_seqlens_q, cu_seqlens_k,
                      heads, kv_heads, d=d, dv=dv, sram_bytes=sram_bytes,
                      block_sizes=block_sizes, causal=causal, io_dtype=io_dtype,
                      window=window, num_splits=num_splits)


def count_varlen_backward(algorithm: str, *, cu_seqlens_q, cu_seqlens_k, heads: int,
                          kv_heads: int | None = None, d: int, dv: int | None = None,
                          sram_bytes=None, block_sizes=None, causal: bool = False,
                          io_dtype="float16", window=None, softcap=None) -> Traffic:
    """Backward HBM traffic of a packed batch without arrays: the sum of
    `flashsim.count_backward` over the sequences; equal to
    ``simulate_varlen_backward(...).traffic`` for the same problem."""
    algorithm = _check_backward_algorithm(algorithm)
    return _count_sum(lambda **kw: count_backward(algorithm, **kw), cu_seqlens_q,
                      cu_seqlens_k, heads, kv_heads, d=d, dv=dv, sram_bytes=sram_bytes,
                      block_sizes=block_sizes, causal=causal, io_dtype=io_dtype,
                      window=window, softcap=softcap)


__all__ = ["simulate_varlen", "count_varlen", "VarlenResult", "check_cu_seqlens",
           "simulate_varlen_backward", "count_varlen_backward", "VarlenGradients"]
