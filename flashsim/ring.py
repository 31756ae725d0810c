"""Ring attention over simulated ranks: context parallelism, with the interconnect as a
level of the memory.

A sequence of N tokens is split over ``world_size`` = W ranks. Each holds its slice of
Q, K and V; the K/V slices travel round the ring (rank r sends to r + 1, receives from
r − 1), and at every step each rank runs FlashAttention-2 on the K/V it holds and merges
the partial result into its own by log-sum-exp, exactly (O = Σ exp(L_t − L)·O_t,
L = log Σ exp L_t). After W steps every rank has attended to every key.

Slices (``assignment``): "contiguous" gives rank r the r-th of W equal chunks;
"zigzag" cuts the sequence into 2W chunks and gives rank r chunks r and 2W − 1 − r, so
that under a causal mask every rank has the same work (one early and one late chunk).
N must divide into W (contiguous) or 2W (zig-zag) chunks. Each step runs flash2 once per
(Q chunk, K/V chunk) pair the rank holds: a pair whose keys all follow its queries under a
causal mask is skipped, a pair on the diagonal runs with the causal mask, any other pair
without one.

Traffic per rank (summed over ranks in ``traffic``; per rank in ``ranks``):
- each pair's flash2 (forward) or flash2 backward, as `fs.count` / `fs.count_backward`
  count it with the given tiles;
- forward merge, per Q chunk after its first computed pair: read the running "Oring"
  (fp32, rows·dv) and "Lring" (fp32), the pair's O (I/O type) and L, write Oring and
  Lring; the first pair writes Oring, Lring from its O and L (read once, written once);
  at the end Oring is read and O written (I/O type), Lring read and L written.
- backward: each pair's dQ, dK, dV (I/O type) are added into fp32 accumulators: "dQring"
  (the rank's own) and "dKring", "dVring" (which travel with the K/V they belong to): read
  the pair's gradient, read and write the accumulator (write only the first time); at
  the end dQring, and the returned dKring, dVring, are read and dQ, dK, dV written.

Interconnect (``links``: per rank, `Traffic` with ``writes`` = bytes sent and ``reads`` =
bytes received, by tensor): the forward sends the K/V block it holds at steps 0 … W − 2
(W − 1 sends); the backward sends K/V W − 1 times and the fp32 dK/dV accumulators W
times (the last send brings each home). Closed form in `ring_interconnect`.

Time (``time_s``), with the transfer of step t overlapped with its compute:
``Σ_t max(max_r compute_{r,t}, max_r link_{r,t})``, compute = the pairs' FLOPs over η ·
peak_flops (η of the project's forward or backward kernel on that hardware,
`flashsim.hierarchy.EFFICIENCY`), link = bytes sent over ``hardware.link_bytes_per_s``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .problem import STAT_BYTES, check_arrays, check_size, itemsize_of
from .traffic import Traffic

ASSIGNMENTS = ("contiguous", "zigzag")


def chunks(N: int, world_size: int, assignment: str) -> list[list[tuple[int, int]]]:
    """Per rank, its (start, stop) chunks of the sequence, in order."""
    W = check_size("world_size", world_size, 1)
    if assignment not in ASSIGNMENTS:
        raise ValueError(f"assignment must be one of {ASSIGNMENTS}, got {assignment!r}")
    parts = W if assignment == "contiguous" else 2 * W
    if N % parts:
        raise ValueError(f"N = {N} does not split into {parts} equal chunks for "
                         f"world_size={W} ({assignment}); pad the sequence to a multiple "
                         f"of {parts}")
    c = N // parts
    if assignment == "contiguous":
        return [[(r * c, (r + 1) * c)] for r in range(W)]
    return [[(r * c, (r + 1) * c), ((2 * W - 1 - r) * c, (2 * W - r) * c)] for r in range(W)]


def _pair_kind(qc, kc, causal: bool) -> str | None:
    """None (skip), "full" or "diag" for Q chunk qc against K/V chunk kc."""
    if not causal:
        return "full"
    if kc[0] >= qc[1]:
        return None                       # every key after every query
    if kc[1] <= qc[0]:
        return "full"
    return "diag"                          # the same chunk


@dataclass(frozen=True)
class RingRun:
    """What both directions report: the traffic summed over the ranks, per-rank HBM
    traffic, per-rank interconnect traffic (writes = sent, reads = received), the
    predicted time and each step's terms."""
    traffic: Traffic
    ranks: tuple
    links: tuple
    time_s: float
    steps: tuple
    world_size: int
    assignment: str


@dataclass(frozen=True)
class RingResult(RingRun):
    """What `simulate_ring` returns: out, lse as `fs.simulate`'s, and the ring's report."""
    out: np.ndarray = None
    lse: np.ndarray = None


@dataclass(frozen=True)
class RingGradients(RingRun):
    """What `simulate_ring_backward` returns: dq, dk, dv, and the ring's report."""
    dq: np.ndarray = None
    dk: np.ndarray = None
    dv: np.ndarray = None


def _merge(O, L, Ot, Lt):
    """Exact merge of two partial results by their log-sum-exps (−inf: saw nothing)."""
    M = np.maximum(L, Lt)
    Ms = np.where(np.isneginf(M), 0.0, M)
    a, b = np.exp(L - Ms), np.exp(Lt - Ms)
    s = a + b
    with np.errstate(divide="ignore", invalid="ignore"):
        Ln = np.where(s > 0, Ms + np.log(np.where(s > 0, s, 1.0)), -np.inf)
        On = np.where((s > 0)[..., None], (a[..., None] * O + b[..., None] * Ot)
                      / np.where(s > 0, s, 1.0)[..., None], 0.0)
    return On, Ln


def _hw_terms(hardware, d, backward):
    from .hardware import get as get_hardware
    from .hierarchy import efficiency
    hw = get_hardware(hardware)
    if backward:
        kernel = "flash2_bwd_tc"
    else:
        kernel = "flash2_fwd_wg" if hw.compute_capability == 90 else "flash2_fwd_tc"
    eta = efficiency(kernel, d if d in (64, 128) else 128)
    return hw, eta


def _ring(q, k, v, world_size, assignment, causal, tiles, scale, io_dtype, hardware,
          backward=None):
    """The forward (backward=None) or backward (backward=(out, lse, dout)) ring."""
    from .backward import simulate_backward
    from .simulate import simulate
    N, Nk = q.shape[-2], k.shape[-2]
    if N != Nk:
        raise ValueError(f"ring attention splits one sequence: Nq must equal Nk, got {N} "
                         f"and {Nk}")
    W = check_size("world_size", world_size, 1)
    parts = chunks(N, W, assignment)
    b = itemsize_of(q.dtype if io_dtype is None else io_dtype)
    q, k, v, shape = check_arrays(q, k, v)
    d, dv = shape.d, shape.dv
    P = shape.problems                                   # (batch, query head) problems
    Pk = int(np.prod(shape.kv_batch_shape))              # K/V heads that travel
    hw, eta = _hw_terms(hardware, d, backward is not None)
    kw = dict(block_sizes=tiles[0], sram_bytes=tiles[1], scale=scale, io_dtype=io_dtype)
    ranks = [Traffic() for _ in range(W)]
    steps = []
    s4 = STAT_BYTES
    if backward is None:
        O_acc: dict = {}                      # (rank, Q chunk) -> running O, L
        L_acc: dict = {}
    else:
        o, lse, do = backward
        dq, dk, dv_ = (np.zeros(x.shape) for x in (q, k, v))
        first_dq, first_dkv = set(), set()    # accumulators written once already
    for t in range(W):
        step_compute = []
        for r in range(W):
            src = (r - t) % W                 # whose K/V rank r holds at step t
            flops = 0
            for qc in parts[r]:
                for kc in parts[src]:
                    kind = _pair_kind(qc, kc, causal)
                    if kind is None:
                        continue
                    qs, ks = slice(*qc), slice(*kc)
                    qq, kk, vv = q[..., qs, :], k[..., ks, :], v[..., ks, :]
                    rows, keys = qc[1] - qc[0], kc[1] - kc[0]
                    vis = rows * keys if kind == "full" else rows * (rows + 1) // 2
                    if backward is None:
                        res = simulate(qq, kk, vv, "flash2", causal=kind == "diag", **kw)
                        key = (r, qc)
                        if key not in O_acc:
                            O_acc[key], L_acc[key] = res.out, res.lse
                            extra = Traffic(reads={"O": rows * dv * b, "L": rows * s4},
                                            writes={"Oring": rows * dv * s4, "Lring": rows * s4})
                        else:
                            O_acc[key], L_acc[key] = _merge(O_acc[key], L_acc[key], res.out,
                                                            res.lse)
                            extra = Traffic(
                                reads={"Oring": rows * dv * s4, "Lring": rows * s4,
                                       "O": rows * dv * b, "L": rows * s4},
                                writes={"Oring": rows * dv * s4, "Lring": rows * s4})
                        ranks[r] = ranks[r] + res.traffic + P * extra
                        flops += P * 2 * vis * (d + dv)
                    else:
                        g = simulate_backward(qq, kk, vv, o[..., qs, :], lse[..., qs],
                                              do[..., qs, :], "flash2", causal=kind == "diag",
                                              **kw)
                        dq[..., qs, :] += g.dq
                        dk[..., ks, :] += g.dk
                        dv_[..., ks, :] += g.dv
                        # the pair's dQ (per query head) into the rank's fp32 dQring; its
                        # dK, dV (per query head, as the kernels write them) summed into
                        # the travelling fp32 dKring, dVring (per K/V head)
                        q_side = Traffic(reads={"dQ": rows * d * b, "dK": keys * d * b,
                                                "dV": keys * dv * b,
                                                "dQring": rows * d * s4 if (r, qc) in first_dq else 0},
                                         writes={"dQring": rows * d * s4})
                        again = kc in first_dkv
                        kv_side = Traffic(reads={"dKring": keys * d * s4 if again else 0,
                                                 "dVring": keys * dv * s4 if again else 0},
                                          writes={"dKring": keys * d * s4,
                                                  "dVring": keys * dv * s4})
                        first_dq.add((r, qc))
                        first_dkv.add(kc)
                        ranks[r] = ranks[r] + g.traffic + P * q_side + Pk * kv_side
                        flops += P * 2 * vis * (3 * d + 2 * dv)
            step_compute.append(flops / (eta * hw.peak_flops))
        steps.append(step_compute)
    # the end: accumulators out to the I/O type
    for r in range(W):
        rows = sum(c1 - c0 for c0, c1 in parts[r])
        if backward is None:
            ranks[r] = ranks[r] + P * Traffic(
                reads={"Oring": rows * dv * s4, "Lring": rows * s4},
                writes={"O": rows * dv * b, "L": rows * s4})
        else:
            ranks[r] = ranks[r] + P * Traffic(reads={"dQring": rows * d * s4},
                                              writes={"dQ": rows * d * b}) \
                + Pk * Traffic(reads={"dKring": rows * d * s4, "dVring": rows * dv * s4},
                               writes={"dK": rows * d * b, "dV": rows * dv * b})
    links = ring_interconnect(N, W, d, dv, b, Pk, assignment, backward=backward is not None)
    step_terms = []
    total = 0.0
    for t in range(W):
        link = _step_sent(N, W, d, dv, b, Pk, t, backward is not None) / hw.link_bytes_per_s
        comp = max(steps[t])
        step_terms.append({"compute_s": comp, "link_s": link, "time_s": max(comp, link),
                           "compute_per_rank_s": tuple(steps[t])})
        total += max(comp, link)
    report = dict(traffic=sum(ranks, Traffic()), ranks=tuple(ranks), links=links, time_s=total,
                  steps=tuple(step_terms), world_size=W, assignment=assignment)
    if backward is None:
        O = np.zeros(shape.batch_shape + (N, dv))
        L = np.zeros(shape.batch_shape + (N,))
        for (r, qc), val in O_acc.items():
            O[..., qc[0]:qc[1], :] = val
            L[..., qc[0]:qc[1]] = L_acc[(r, qc)]
        return RingResult(out=O, lse=L, **report)
    return RingGradients(dq=dq, dk=dk, dv=dv_, **report)


def _step_sent(N, W, d, dv, b, problems, t, backward):
    """Bytes one rank sends after step t (the same for every rank: equal slices)."""
    if W == 1:
        return 0
    rows = N // W
    kv = rows * (d + dv) * b * problems if t < W - 1 else 0
    return kv + (rows * (d + dv) * STAT_BYTES * problems if backward else 0)


def ring_interconnect(N: int, world_size: int, d: int, dv: int, itemsize: int,
                      problems: int, assignment: str = "contiguous",
                      backward: bool = False) -> tuple:
    """Per rank, the interconnect `Traffic` (writes = sent, reads = received): K and V of
    its slice's size W − 1 times; in the backward, also the fp32 dK, dV accumulators W
    times. ``problems``: the (batch, K/V head) pairs whose K/V travel."""
    W = check_size("world_size", world_size, 1)
    chunks(N, W, assignment)                      # the same divisibility rules
    rows = N // W
    kv = {"K": (W - 1) * rows * d * itemsize * problems,
          "V": (W - 1) * rows * dv * itemsize * problems}
    if backward:
        kv.update(dKring=W * rows * d * STAT_BYTES * problems,
                  dVring=W * rows * dv * STAT_BYTES * problems)
    if W == 1:
        return (Traffic(),)
    return tuple(Traffic(reads=kv, writes=kv) for _ in range(W))


def simulate_ring(q, k, v, *, world_size: int, assignment: str = "contiguous",
                  causal: bool = False, block_sizes=None, sram_bytes=None, scale=None,
                  io_dtype=None, hardware="H100") -> RingResult:
    """Ring attention's forward over ``world_size`` simulated ranks (see the module)."""
    q, k, v = (np.asarray(x) for x in (q, k, v))
    return _ring(q, k, v, world_size, assignment, causal, (block_sizes, sram_bytes), scale,
                 io_dtype, hardware)


def simulate_ring_backward(q, k, v, out, lse, dout, *, world_size: int,
                           assignment: str = "contiguous", causal: bool = False,
                           block_sizes=None, sram_bytes=None, scale=None, io_dtype=None,
                           hardware="H100") -> RingGradients:
    """Ring attention's backward: each rank's pairs through flash2's backward with the
    global out and lse, dQ kept, dK and dV accumulated as they travel (see the module)."""
    q, k, v = (np.asarray(x) for x in (q, k, v))
    out, lse, dout = (np.asarray(x, np.float64) for x in (out, lse, dout))
    return _ring(q, k, v, world_size, assignment, causal, (block_sizes, sram_bytes), scale,
                 io_dtype, hardware, backward=(out, lse, dout))


__all__ = ["simulate_ring", "simulate_ring_backward", "ring_interconnect", "chunks",
           "RingRun", "RingResult", "RingGradients", "ASSIGNMENTS"]
