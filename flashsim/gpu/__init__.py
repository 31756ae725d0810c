"""The simulator's FlashAttention-2 schedule on a real GPU, launched through CuPy.

Only this package imports CuPy, and only when a function here is called: `import
flashsim` works with no CuPy and no GPU. Inside ``with fs.gpu.emulated():`` the same
calls run the reference rung's kernels on the CPU (NumPy arrays in and out).

    out, lse = fs.gpu.attention(q, k, v, causal=True)
    dq, dk, dv = fs.gpu.attention_backward(q, k, v, out, lse, dout, causal=True)
    out, lse, traffic = fs.gpu.attention(q, k, v, count_io=True)
    traffic == fs.simulate(q, k, v, "flash2", block_sizes=fs.gpu.block_sizes(q, v)).traffic
    fs.simulate(q, k, v, softcap=30.0, precision="kernel", block_sizes=fs.gpu.block_sizes(
        q, v, softcap=30.0), softmax_max=fs.gpu.softmax_max(q, v, softcap=30.0))  # its twin
    out, lse = fs.gpu.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k)  # packed batches
    out, lse = fs.gpu.attention(q, k, v, algorithm="flash1")   # or "standard": the paper's others

Inputs: CuPy arrays, NumPy arrays (copied to the device), or any tensor exposing
``__cuda_array_interface__`` or ``__dlpack__`` (PyTorch: no copy). Results are CuPy
arrays, or PyTorch tensors when the inputs were PyTorch tensors. float16, float32 and
float64 come in any of these; bfloat16 comes as PyTorch tensors (CuPy has no bfloat16).
Non-contiguous inputs are copied to contiguous ones first. The layout and semantics are
`flashsim.simulate`'s; L is fp32, as FlashAttention stores it.

Kernels (kernels_cu/*.cu) are compiled once per (source, instrumented or not, device)
with NVRTC and cached; ``count_io=True`` runs the instrumented build, whose thread blocks
add the bytes of every tile they move to per-tensor counters, and returns that as a
`flashsim.Traffic`. Three rungs: "ref" (flash2_ref.cu, any dtype and tile), "tc"
(flash2_tc.cu, mma.sync tensor cores, Ampere and later) and "wg" (flash2_wg.cu, the
forward on Hopper's warpgroup MMAs, compute capability 9.0 only), each also for packed
varlen batches; FlashAttention-1, standard attention and (forward) Saha & Ye's square
tiles on the reference rung (flash1_ref.cu, standard_ref.cu, square_ref.cu).
"""

from ._device import (GPUUnavailableError, INSTALL_HINT, SpillWarning, THREADS, available,
                      compile_options, emulated, is_emulated, smem_limit)
from .flash2 import KERNELS, attention, attention_backward, block_sizes, softmax_max
from .decode import KVCachePlan, attention_with_kvcache, kvcache_plan
from .varlen import attention_varlen, attention_varlen_backward

__all__ = ["GPUUnavailableError", "INSTALL_HINT", "KERNELS", "KVCachePlan", "SpillWarning", "THREADS",
           "attention", "attention_backward", "attention_varlen", "attention_varlen_backward",
           "attention_with_kvcache", "available", "block_sizes", "compile_options", "emulated",
           "is_emulated", "kvcache_plan", "smem_limit", "softmax_max"]
