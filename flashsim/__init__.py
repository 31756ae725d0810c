"""flashsim: IO-aware attention, counted.

A two-level memory (HBM and an SRAM of the size you choose) that runs standard
attention, FlashAttention-1 and FlashAttention-2 tile by tile, counts every HBM byte
per tensor, and computes the real result so the math is checked too.

    >>> import numpy as np, flashsim as fs
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 300, 64)).astype(np.float16) for _ in range(3))
    >>> r = fs.simulate(q, k, v, "flash2", sram_bytes="64KiB")
    >>> r.traffic == fs.count("flash2", Nq=300, Nk=300, d=64, batch_shape=(2,),
    ...                       sram_bytes="64KiB")
    True
"""

from . import gpu, hardware, hierarchy, theory
from .backward import Gradients, count_backward, simulate_backward
from .count import count
from .errors import SRAMOverflowError
from .hierarchy import Launch, Levels, Prediction
from .kvcache import KVCacheResult, count_kvcache, num_splits_heuristic, simulate_kvcache
from .problem import ALGORITHMS
from .reference import attention_backward_reference, attention_reference, attention_same_dtype
from .simulate import Result, simulate
from .softmax import softmax
from .traffic import Traffic, format_table
from .varlen import (VarlenGradients, VarlenResult, count_varlen, count_varlen_backward,
                     simulate_varlen, simulate_varlen_backward)

__version__ = "0.1.0"

__all__ = ["simulate", "count", "simulate_backward", "count_backward", "Traffic", "Result",
           "Gradients", "SRAMOverflowError", "theory", "softmax", "attention_reference",
           "attention_backward_reference", "attention_same_dtype", "gpu", "format_table", "ALGORITHMS", "simulate_varlen",
           "count_varlen", "VarlenResult", "simulate_varlen_backward", "count_varlen_backward",
           "VarlenGradients", "hardware", "hierarchy", "Levels", "Prediction", "Launch",
           "simulate_kvcache", "count_kvcache", "KVCacheResult", "num_splits_heuristic"]
