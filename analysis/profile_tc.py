"""One launch of each tensor-core kernel at one of the benchmark's shapes (default d = 128,
N = 4096, float16, no mask), for Nsight Compute; on a compute capability 9.0 device the
Hopper kernels run too (as kernel="wg" picks them: flash2_fwd_ws and flash2_bwd_ws at
d = 128, fed by the copy engine):

    ncu --clock-control none --section SpeedOfLight --section WarpStateStats \
        --section Occupancy --section MemoryWorkloadAnalysis -k regex:"flash2_(fwd|bwd)_(tc|wg)" -c 3 \
        python3 analysis/profile_tc.py [--d 128] [--n 4096] [--dtype bfloat16] [--causal] [--sdpa]

With --sdpa, PyTorch SDPA's flash kernels run too (add them to -k, e.g.
-k regex:"flash2_(fwd|bwd)_tc|flash_fwd_kernel|flash_bwd_dq_dk_dv" -c 4); with --cudnn its
cuDNN backend's (e.g. -k regex:"flash2_bwd_wg|cudnn|sdpa" -c 4).
"""

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import flashsim as fs  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--sdpa", action="store_true",
                    help="also one forward and backward of PyTorch SDPA's flash backend "
                         "(FlashAttention-2) on the same inputs, to profile beside ours")
    ap.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16",
                    help="bfloat16 needs PyTorch (CuPy has no bfloat16 arrays)")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--cudnn", action="store_true",
                    help="also one forward and backward of SDPA's cuDNN backend")
    a = ap.parse_args(argv)
    import cupy as cp
    B, H = 16384 // a.n, 2048 // a.d
    if a.dtype == "bfloat16" or a.sdpa or a.cudnn:
        import torch
        torch.manual_seed(0)
        q, k, v, do = (torch.randn(B, H, a.n, a.d, device="cuda", dtype=getattr(torch, a.dtype))
                       for _ in range(4))
    else:
        rng = np.random.default_rng(0)
        q, k, v, do = (cp.asarray(rng.standard_normal((B, H, a.n, a.d)).astype(np.float16))
                       for _ in range(4))
    if cp.cuda.Device().compute_capability == "90":      # the Hopper kernels
        o_wg, l_wg = fs.gpu.attention(q, k, v, causal=a.causal, kernel="wg")
        fs.gpu.attention_backward(q, k, v, o_wg, l_wg, do, causal=a.causal, kernel="wg")
    out, lse = fs.gpu.attention(q, k, v, causal=a.causal, kernel="tc")
    fs.gpu.attention_backward(q, k, v, out, lse, do, causal=a.causal, kernel="tc")
    cp.cuda.Device().synchronize()
    for want, name in ((a.sdpa, "FLASH_ATTENTION"), (a.cudnn, "CUDNN_ATTENTION")):
        if not want:
            continue
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
        qt, kt, vt = (x.detach().clone().requires_grad_() for x in (q, k, v))
        with sdpa_kernel(getattr(SDPBackend, name)):
            o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=a.causal)
            o.backward(do)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
