"""flashsim.ring_torch: ring attention over real processes (torch.distributed, gloo on the
CPU here; the same code runs NCCL on GPUs) against one process's attention on the whole
sequence, outputs and gradients, and the bytes each rank sends against the simulator's
closed form."""

import os
import tempfile

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)


def problem(W, heads):
    """The same float64 q, k, v, dout (full sequence) in every process and in the test."""
    torch.manual_seed(0)
    H, Hk = heads
    N = 24 * W
    q, dout = (torch.randn(2, H, N, 8, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, Hk, N, 8, dtype=torch.float64) for _ in range(2))
    return q, k, v, dout


def worker(rank, W, path, assignment, causal, heads):
    import flashsim.ring_torch as fr
    dist.init_process_group("gloo", init_method=f"file://{path}.store", rank=rank,
                            world_size=W)
    try:
        q, k, v, dout = problem(W, heads)
        ql, kl, vl, dl = fr.local_slices(q, k, v, dout, assignment=assignment)
        ql, kl, vl = (x.requires_grad_() for x in (ql, kl, vl))
        stats = {}
        out = fr.ring_attention(ql, kl, vl, causal=causal, assignment=assignment, stats=stats)
        (out * dl).sum().backward()
        torch.save({"out": out.detach(), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad,
                    "stats": stats}, f"{path}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("W, assignment, causal, heads", [
    (2, "contiguous", False, (2, 2)), (2, "zigzag", True, (4, 2)), (3, "contiguous", True, (2, 1)),
    (3, "zigzag", True, (2, 2))])
def test_ring_over_processes_equals_one_process(W, assignment, causal, heads):
    import torch.multiprocessing as mp
    import flashsim.torch as fst
    from flashsim.ring import chunks, ring_interconnect
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ring")
        mp.spawn(worker, args=(W, path, assignment, causal, heads), nprocs=W, join=True)
        parts = [torch.load(f"{path}.{r}") for r in range(W)]
    Hk, N = heads[1], 24 * W
    q, k, v, dout = problem(W, heads)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    ref = fst.attention(q, k, v, causal=causal)
    (ref * dout).sum().backward()
    for r, part in enumerate(parts):
        at = 0
        for c0, c1 in chunks(N, W, assignment)[r]:
            n = c1 - c0
            # the merge and the backward take the kernels' log-sum-exp, stored in fp32 as
            # FlashAttention stores it: fp32's precision, whatever the inputs' type
            for name, full in (("out", ref.detach()), ("dq", q.grad), ("dk", k.grad),
                               ("dv", v.grad)):
                torch.testing.assert_close(part[name][..., at:at + n, :], full[..., c0:c1, :],
                                           rtol=2e-6, atol=2e-6)
            at += n
        # bytes sent: what the simulator's closed form says each rank sends (float64 here)
        want = ring_interconnect(N, W, 8, 8, 8, 2 * Hk, assignment)[r].write_bytes
        assert sum(part["stats"]["forward"].values()) == want
        grads = ring_interconnect(N, W, 8, 8, 8, 2 * Hk, assignment, backward=True)[r]
        # the accumulators travel in fp32 in the model; here in the inputs' float64
        acc = grads.writes["dKring"] + grads.writes["dVring"]
        assert sum(part["stats"]["backward"].values()) == want + 2 * acc
