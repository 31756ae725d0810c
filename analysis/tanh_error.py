"""The error of the GPU's tanh.approx.f32 (MUFU.TANH), which the fast rungs' softcap
uses (kernels_cu/tensor_core.cuh, tanh_fast), against float64 tanh.

    python3 analysis/tanh_error.py

Sweeps every 7th fp32 bit pattern in [2^-20, 16) (tanh is odd, and rounds to 1 above 9)
and prints the largest relative and absolute errors, overall and per range, as JSON.
Needs a CUDA device and CuPy.
"""

import json

import numpy as np


def main():
    import cupy as cp
    kernel = cp.RawKernel(r'''
extern "C" __global__ void tanh_approx(const float* x, float* y, long long n) {
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) { float r; asm("tanh.approx.f32 %0, %1;" : "=f"(r) : "f"(x[i])); y[i] = r; }
}''', "tanh_approx")
    lo, hi = np.float32(2.0**-20).view(np.int32), np.float32(16.0).view(np.int32)
    x = np.arange(lo, hi, 7, dtype=np.int32).view(np.float32)
    xd = cp.asarray(x)
    yd = cp.empty_like(xd)
    kernel(((x.size + 255) // 256,), (256,), (xd, yd, np.int64(x.size)))
    y = cp.asnumpy(yd).astype(np.float64)
    t = np.tanh(x.astype(np.float64))
    rel, ab = np.abs(y - t) / np.abs(t), np.abs(y - t)
    res = dict(device=cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), inputs=int(x.size),
               max_rel=float(rel.max()), at_x=float(x[rel.argmax()]), max_abs=float(ab.max()))
    for a, b in ((0, 0.5), (0.5, 2), (2, 5), (5, 16)):
        m = (x >= a) & (x < b)
        res[f"[{a}, {b})"] = dict(max_rel=float(rel[m].max()), max_abs=float(ab[m].max()))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
