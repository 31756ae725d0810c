"""flash_attn_func on strided layouts, timed in one process: the kernels read (B, N, H, d)
tensors and the slices of a fused QKV projection through their strides, so a call on
them costs what a call on dense tensors costs. Beside it, the same call after the
transposing copies the interface used to make (`.contiguous()` of each (B, H, N, d)
view), and SDPA's FlashAttention-2 backend on the (B, H, N, d) views.

    python3 analysis/bench_strided.py [--reps 20]      (writes analysis/out/strided.md)

Forward and forward + backward, float16, causal, 16k tokens, heads = 2048/d, N = 4k.
"""

from __future__ import annotations

import argparse
import os

import _common  # noqa: F401  (puts the repository root on sys.path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=os.path.join(_common.HERE, "out", "strided.md"))
    args = ap.parse_args(argv)
    import torch
    from triton.testing import do_bench
    import flashsim.torch as fst
    torch.manual_seed(0)
    N, rows = 4096, []
    name = torch.cuda.get_device_name()
    for d in (64, 128):
        H, B = 2048 // d, 16384 // N
        fused = torch.randn(B, N, 3 * H, d, device="cuda", dtype=torch.float16)
        sliced = [x.requires_grad_() for x in (t.detach() for t in fused.split(H, dim=2))]
        dense = [x.detach().contiguous().requires_grad_() for x in sliced]
        dout = torch.randn(B, N, H, d, device="cuda", dtype=torch.float16)

        def ours(q, k, v):
            return fst.flash_attn_func(q, k, v, causal=True)

        def copied(q, k, v):          # what a contiguous-only kernel makes the caller do
            t = [x.transpose(1, 2).contiguous() for x in (q, k, v)]
            return fst.attention(*t, causal=True).transpose(1, 2)

        def sdpa(q, k, v):
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                    is_causal=True).transpose(1, 2)

        for label, fn, inputs in (("dense (B, N, H, d)", ours, dense),
                                  ("fused-QKV slices", ours, sliced),
                                  ("slices + .contiguous() copies", copied, sliced),
                                  ("SDPA flash, fused-QKV slices", sdpa, sliced)):
            with torch.no_grad():
                fwd = do_bench(lambda: fn(*inputs), warmup=25, rep=args.reps * 10)

            def train():
                torch.autograd.grad(fn(*inputs), inputs, dout)
            both = do_bench(train, warmup=25, rep=args.reps * 10)
            rows.append((d, label, fwd, both))
            print(f"d={d:3d} {label:32s} fwd {fwd:.3f} ms  fwd+bwd {both:.3f} ms", flush=True)
    lines = [f"# flash_attn_func on strided layouts ({name})", "",
             "`python3 analysis/bench_strided.py`: float16, causal, N = 4096, 16k tokens, "
             "heads = 2048/d; triton's do_bench medians, one process.", "",
             "| d | inputs | forward (ms) | forward + backward (ms) |", "|---|---|---|---|"]
    lines += [f"| {d} | {label} | {f:.3f} | {b:.3f} |" for d, label, f, b in rows]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
