"""Ring attention across processes with `torch.distributed`: the schedule of
`flashsim.ring` on real devices, one process per GPU (NCCL) or per CPU worker (gloo).

    # torchrun --nproc-per-node 2 train.py      (NCCL_NVLS_ENABLE=0 on shared hosts)
    import torch.distributed as dist, flashsim.ring_torch as fr
    dist.init_process_group("nccl")
    q, k, v = fr.local_slices(q_full, k_full, v_full, assignment="zigzag")   # this rank's
    out = fr.ring_attention(q, k, v, causal=True, assignment="zigzag")      # differentiable
    out.sum().backward()

Each rank holds its slice of the sequence (`flashsim.ring.chunks`: W contiguous chunks, or
chunks r and 2W − 1 − r of 2W for "zigzag"), along the sequence axis of (B, H, n, d)
tensors. At every step it sends the K/V block it holds to rank r + 1 and receives the next
from rank r − 1 (`batch_isend_irecv`, started before the step's attention so the transfer
overlaps it), runs `flashsim.torch.attention_fwd` on each (Q chunk, K/V chunk) pair that
the mask leaves (the diagonal with the causal mask), and merges by log-sum-exp exactly.
The backward runs `flashsim.torch.attention_bwd` per pair with the final out and lse,
keeps dQ, and passes dK, dV accumulators (fp32, fp64 for fp64 inputs) round with their K/V (W sends, the last
one home). ``stats`` (a dict) receives this rank's bytes sent per step,
``stats["forward"][t]`` and ``stats["backward"][t]``, to hold against
`flashsim.ring.ring_interconnect`.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .ring import chunks
from .torch import attention_bwd, attention_fwd


def _world(group):
    return dist.get_world_size(group), dist.get_rank(group)


def _local_chunks(N: int, W: int, r: int, assignment: str):
    """This rank's chunks: [(global start, global stop, local start)]."""
    out, at = [], 0
    for c0, c1 in chunks(N, W, assignment)[r]:
        out.append((c0, c1, at))
        at += c1 - c0
    return out


def local_slices(*tensors, assignment: str = "contiguous", group=None):
    """This rank's part of each full (B, H, N, ·) tensor, along the sequence axis."""
    W, r = _world(group)
    N = tensors[0].shape[-2]
    parts = chunks(N, W, assignment)[r]
    return tuple(torch.cat([t[..., c0:c1, :] for c0, c1 in parts], dim=-2).contiguous()
                 for t in tensors)


def _kind(qc, kc, causal):
    if not causal:
        return "full"
    if kc[0] >= qc[1]:
        return None
    if kc[1] <= qc[0]:
        return "full"
    return "diag"


def _exchange(tensors, W, r, group, stats, key):
    """Send ``tensors`` to rank r + 1 and receive as many from r − 1 (started, not
    waited): (requests, receive buffers)."""
    if W == 1:
        return [], tensors
    nxt, prv = (r + 1) % W, (r - 1) % W
    bufs = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), dist.get_global_rank(group, nxt)
                      if group is not None else nxt, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, b, dist.get_global_rank(group, prv)
                       if group is not None else prv, group) for b in bufs]
    if stats is not None:
        direction, step = key
        sent = stats.setdefault(direction, {})
        sent[step] = sent.get(step, 0) + sum(t.numel() * t.element_size() for t in tensors)
    return dist.batch_isend_irecv(ops), bufs


def _merge(O, L, Ot, Lt):
    """Exact log-sum-exp merge of two partial results (lse −inf: saw nothing)."""
    M = torch.maximum(L, Lt)
    Ms = torch.where(torch.isinf(M) & (M < 0), torch.zeros_like(M), M)
    a, b = torch.exp(L - Ms), torch.exp(Lt - Ms)
    s = a + b
    safe = torch.where(s > 0, s, torch.ones_like(s))
    On = torch.where((s > 0)[..., None], (a[..., None] * O + b[..., None] * Ot) / safe[..., None],
                     torch.zeros_like(O))
    Ln = torch.where(s > 0, Ms + torch.log(safe), torch.full_like(s, -math.inf))
    return On, Ln


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, assignment, group, stats, deterministic):
        W, r = _world(group)
        N = q.shape[-2] * W
        mine = _local_chunks(N, W, r, assignment)
        acc = torch.promote_types(q.dtype, torch.float32)     # fp32, or the inputs' fp64
        out = torch.zeros(q.shape[:-1] + (v.shape[-1],), dtype=acc, device=q.device)
        lse = torch.full(q.shape[:-1], -math.inf, dtype=acc, device=q.device)
        kv = (k.contiguous(), v.contiguous())
        for t in range(W):
            src = (r - t) % W
            reqs, nxt = (_exchange(kv, W, r, group, stats, ("forward", t)) if t < W - 1
                         else ([], kv))
            theirs = _local_chunks(N, W, src, assignment)
            for q0, q1, ql in mine:
                for k0, k1, kl in theirs:
                    kind = _kind((q0, q1), (k0, k1), causal)
                    if kind is None:
                        continue
                    n, m = q1 - q0, k1 - k0
                    o, lo = attention_fwd(q[..., ql:ql + n, :].contiguous(),
                                          kv[0][..., kl:kl + m, :].contiguous(),
                                          kv[1][..., kl:kl + m, :].contiguous(),
                                          kind == "diag", scale, deterministic)
                    sl = slice(ql, ql + n)
                    out[..., sl, :], lse[..., sl] = _merge(out[..., sl, :], lse[..., sl],
                                                           o.to(acc), lo.to(acc))
            for req in reqs:
                req.wait()
            kv = nxt
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse.float())
        ctx.causal, ctx.scale, ctx.assignment, ctx.group = causal, scale, assignment, group
        ctx.stats, ctx.deterministic = stats, deterministic
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, stats = ctx.group, ctx.stats
        W, r = _world(group)
        N = q.shape[-2] * W
        mine = _local_chunks(N, W, r, ctx.assignment)
        dout = dout.contiguous()
        acc = torch.promote_types(q.dtype, torch.float32)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=q.device)
        dv = torch.zeros(v.shape, dtype=acc, device=q.device)
        kv = (k.contiguous(), v.contiguous())
        for t in range(W):
            src = (r - t) % W
            theirs = _local_chunks(N, W, src, ctx.assignment)
            for q0, q1, ql in mine:
                for k0, k1, kl in theirs:
                    kind = _kind((q0, q1), (k0, k1), ctx.causal)
                    if kind is None:
                        continue
                    n, m = q1 - q0, k1 - k0
                    qs, ks = slice(ql, ql + n), slice(kl, kl + m)
                    a, b, c = attention_bwd(q[..., qs, :].contiguous(),
                                            kv[0][..., ks, :].contiguous(),
                                            kv[1][..., ks, :].contiguous(),
                                            out[..., qs, :].contiguous(),
                                            lse[..., qs].contiguous(),
                                            dout[..., qs, :].contiguous(), kind == "diag",
                                            ctx.scale, ctx.deterministic)
                    dq[..., qs, :] += a.to(acc)
                    dk[..., ks, :] += b.to(acc)
                    dv[..., ks, :] += c.to(acc)
            # the accumulators travel with their K/V: W sends, the last brings them home
            send = (dk, dv) + (kv if t < W - 1 else ())
            reqs, got = _exchange(send, W, r, group, stats, ("backward", t))
            for req in reqs:
                req.wait()
            dk, dv = got[0], got[1]
            if t < W - 1:
                kv = (got[2], got[3])
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None


def ring_attention(q, k, v, *, causal: bool = False, scale: float | None = None,
                   assignment: str = "contiguous", group=None, stats: dict | None = None,
                   deterministic: bool = False) -> torch.Tensor:
    """This rank's attention output over the whole ring's keys: q (B, H, n, d), k, v
    (B, Hk, n, ·) are its slices (`local_slices`); differentiable (see the module)."""
    if not dist.is_initialized():
        raise RuntimeError("ring_attention needs torch.distributed initialised "
                           "(dist.init_process_group('nccl') under torchrun, or 'gloo')")
    W, _ = _world(group)
    parts = 1 if assignment == "contiguous" else 2
    if q.shape[-2] % parts or k.shape[-2] != q.shape[-2]:
        raise ValueError(f"each rank holds {parts} equal chunk(s) of one sequence: q and k "
                         f"must have the same local length, divisible by {parts}; got "
                         f"{q.shape[-2]} and {k.shape[-2]}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return _Ring.apply(q, k, v, bool(causal), scale, assignment, group, stats,
                       bool(deterministic))


__all__ = ["ring_attention", "local_slices"]
