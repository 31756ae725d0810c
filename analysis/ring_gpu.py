"""Ring attention on several GPUs (NCCL) held against one GPU and the simulator.

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 analysis/ring_gpu.py [--n 65536] [--out DIR]

Every rank builds the same random q, k, v (B = 1, H = 16, Hk = 4, d = 128, bfloat16),
takes its zig-zag slices (`flashsim.ring_torch.local_slices`), runs the ring forward and
backward (`flashsim.ring_torch.ring_attention`, the project's kernels per step, NCCL
send/recv overlapped with them), and rank 0 compares outputs and gradients with
`flashsim.torch.attention` on the whole sequence on one GPU (largest difference relative
to the largest value, against bfloat16's precision), the bytes each rank sent with
`flashsim.ring.ring_interconnect`, and reports the ring's time (CUDA events, median of
--reps) beside one GPU's. Writes ring_gpu.json under --out. Needs ≥ 2 GPUs, torch with
NCCL, and CuPy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")      # never NVLink multicast on shared hosts

import _common  # noqa: E402,F401  (puts the repository root on sys.path)


def main(argv=None):
    import torch
    import torch.distributed as dist
    import flashsim.ring_torch as fr
    import flashsim.torch as fst
    from flashsim.ring import ring_interconnect

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--causal", action="store_true", default=True)
    ap.add_argument("--out", default=os.path.join(_common.DEFAULT_OUT))
    a = ap.parse_args(argv)
    if "RANK" not in os.environ:
        print("run under torchrun: NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 "
              "analysis/ring_gpu.py")
        return 2
    dist.init_process_group("nccl")
    rank, W = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    g = torch.Generator(device="cpu").manual_seed(0)
    B, H, Hk, d, N = 1, 16, 4, 128, a.n
    bf = torch.bfloat16
    q = torch.randn(B, H, N, d, generator=g).to(dev, bf)
    k = torch.randn(B, Hk, N, d, generator=g).to(dev, bf)
    v = torch.randn(B, Hk, N, d, generator=g).to(dev, bf)
    dout = torch.randn(B, H, N, d, generator=g).to(dev, bf)
    ql, kl, vl, dl = fr.local_slices(q, k, v, dout, assignment="zigzag")
    ql, kl, vl = (x.requires_grad_() for x in (ql, kl, vl))

    def ring_step(stats=None):
        for x in (ql, kl, vl):
            x.grad = None
        out = fr.ring_attention(ql, kl, vl, causal=a.causal, assignment="zigzag", stats=stats)
        out.backward(dl)
        return out

    stats: dict = {}
    out = ring_step(stats)
    times = []
    for _ in range(a.reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        s.record()
        ring_step()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    gathered = [None] * W
    dist.all_gather_object(gathered, {
        "out": out.detach().cpu(), "dq": ql.grad.cpu(), "dk": kl.grad.cpu(),
        "dv": vl.grad.cpu(), "stats": stats, "time_s": sorted(times)[len(times) // 2]})
    if rank == 0:
        from flashsim.ring import chunks
        qf, kf, vf = (x.clone().requires_grad_() for x in (q, k, v))
        ref = fst.attention(qf, kf, vf, causal=a.causal)
        ref.backward(dout)
        full = {n: torch.empty_like(t).cpu() for n, t in
                (("out", ref), ("dq", qf.grad), ("dk", kf.grad), ("dv", vf.grad))}
        for r, part in enumerate(gathered):
            at = 0
            for c0, c1 in chunks(N, W, "zigzag")[r]:
                for name in full:
                    full[name][..., c0:c1, :] = part[name][..., at:at + c1 - c0, :]
                at += c1 - c0
        one = {"out": ref.detach().cpu(), "dq": qf.grad.cpu(), "dk": kf.grad.cpu(),
               "dv": vf.grad.cpu()}
        rel = {n: float((full[n].float() - one[n].float()).abs().max()
                        / one[n].float().abs().max()) for n in full}
        # both run the same kernels per tile pair in bfloat16; what differs is where the
        # ring merges (fp32 LSE) and sums dK, dV: a few bfloat16 roundings
        assert all(x < 3e-2 for x in rel.values()), rel
        single = []
        for _ in range(a.reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            for x in (qf, kf, vf):
                x.grad = None
            s.record()
            fst.attention(qf, kf, vf, causal=a.causal).backward(dout)
            e.record()
            e.synchronize()
            single.append(s.elapsed_time(e) / 1e3)
        want = ring_interconnect(N, W, d, d, 2, B * Hk, "zigzag")[0].write_bytes
        sent = sum(gathered[0]["stats"]["forward"].values())
        result = {"gpus": W, "N": N, "gpu": torch.cuda.get_device_name(0),
                  "ring_time_s": [p["time_s"] for p in gathered],
                  "forward_bytes_sent": sent, "forward_bytes_model": want,
                  "one_gpu_time_s": sorted(single)[len(single) // 2],
                  "max_relative_difference": rel}
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "ring_gpu.json"), "w") as f:
            json.dump(result, f, indent=1)
        print(json.dumps(result, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
