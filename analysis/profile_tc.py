"""One launch of each tensor-core kernel at one of the benchmark's shapes (default d = 128,
N = 4096, float16, no mask), for Nsight Compute; on a compute capability 9.0 device the
Hopper kernels run too (as kernel="wg" picks them: flash2_fwd_ws and flash2_bwd_ws at
d = 128, fed by the copy engine):

    ncu --clock-control none --section SpeedOfLight --section WarpStateStats \
        --section Occupancy --section MemoryWorkloadAnalysis -k regex:"flash2_(fwd|bwd)_(tc|wg)" -c 3 \
        python3 analysis/profile_tc.py [--d 128] [--n 4096] [--dtype bfloat16] [--causal] [--sdpa]

With --sdpa, PyTorch SDPA's flash kernels run too (add them to -k, e.g.
-k regex:"flash2_(fwd|bwd)_tc|flash_fwd_kernel|flash_bwd_dq_dk_dv" -c 4); with --cudnn its
cuDNN backend's (e.g. -k regex:"flash2_bwd_wg|cudnn|sdpa" -c 4). --kernels picks flashsim's
(default wg,tc; auto: the kernels fs.gpu.attention picks), --forward-only leaves out the
backwards, and --nvtx runs everything once more inside an NVTX range "prof" after a first
pass that builds and warms it, for ncu --nvtx --nvtx-include "prof/" (the source-page
comparison of analysis/ncu_compare.py):

    ncu --nvtx --nvtx-include "prof/" --section WarpStateStats --section SourceCounters \
        --section InstructionStats --import-source no -o R \
        python3 analysis/profile_tc.py --d 128 --n 2048 --kernels auto --forward-only --cudnn --nvtx
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
    ap.add_argument("--kernels", default="wg,tc",
                    help="flashsim's kernels, comma-separated: auto, wg (on 9.0 only), tc, ref "
                         "(default wg,tc)")
    ap.add_argument("--forward-only", action="store_true", help="no backwards")
    ap.add_argument("--nvtx", action="store_true",
                    help="a first pass to build and warm up, then the same inside NVTX range 'prof'")
    a = ap.parse_args(argv)
    kernels = a.kernels.split(",")
    bad = [x for x in kernels if x not in fs.gpu.flash2.KERNELS]
    if bad:
        ap.error(f"{bad[0]!r}: flashsim's kernels are {', '.join(fs.gpu.flash2.KERNELS)}")
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
    def run():
        for kern in kernels:
            if kern == "wg" and cp.cuda.Device().compute_capability != "90":
                continue                                 # the Hopper kernels
            out, lse = fs.gpu.attention(q, k, v, causal=a.causal, kernel=kern)
            if not a.forward_only:
                fs.gpu.attention_backward(q, k, v, out, lse, do, causal=a.causal, kernel=kern)
        cp.cuda.Device().synchronize()
        for want, name in ((a.sdpa, "FLASH_ATTENTION"), (a.cudnn, "CUDNN_ATTENTION")):
            if not want:
                continue
            import torch.nn.functional as F
            from torch.nn.attention import SDPBackend, sdpa_kernel
            qt, kt, vt = (x.detach().clone().requires_grad_() for x in (q, k, v))
            with sdpa_kernel(getattr(SDPBackend, name)):
                o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=a.causal)
                if not a.forward_only:
                    o.backward(do)
            torch.cuda.synchronize()
    run()
    if a.nvtx:      # PyTorch's markers where it is loaded, else CuPy's
        if "torch" in sys.modules:
            push, pop = sys.modules["torch"].cuda.nvtx.range_push, sys.modules["torch"].cuda.nvtx.range_pop
        else:
            from cupy.cuda import nvtx
            push, pop = nvtx.RangePush, nvtx.RangePop
        push("prof")
        run()
        pop()


if __name__ == "__main__":
    main()
