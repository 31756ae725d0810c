"""Scratch: the new instances under compute-sanitizer: wg forward/backward at D = 160, 224; tc at 32, 96, 160, 192, 224."""
import sys
import numpy as np
import torch
import flashsim as fs
rng = np.random.default_rng(7)
n = 0
wg = [(160, 160, 70, 130, False, False, False), (144, 128, 33, 200, True, True, True), (224, 224, 130, 65, True, False, False),
      (200, 208, 7, 300, False, True, True)]
tc = wg + [(96, 96, 65, 129, True, False, True), (80, 88, 100, 77, False, True, False), (32, 32, 129, 200, True, True, False),
           (192, 128, 50, 70, False, False, True), (24, 16, 40, 50, False, False, False)]
for kernel, cases in (("wg", wg), ("tc", tc)):
    if kernel not in sys.argv[1]:
        continue
    for d, dv, Nq, Nk, causal, io, det in cases:
        dt = "float16" if n % 2 == 0 else "bfloat16"
        q = rng.standard_normal((2, 3, Nq, d)); k = rng.standard_normal((2, 3, Nk, d)); v = rng.standard_normal((2, 3, Nk, dv)); do = rng.standard_normal((2, 3, Nq, dv))
        t = [torch.as_tensor(x, device="cuda").to(getattr(torch, dt)) for x in (q, k, v, do)]
        if n % 3 == 1:
            t = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in t]
        out, lse = fs.gpu.attention(*t[:3], causal=causal, kernel=kernel)[:2]
        fs.gpu.attention_backward(*t[:3], out, lse, t[3], causal=causal, count_io=io, deterministic=det, kernel=kernel)
        n += 1
torch.cuda.synchronize()
print("cases", n)
