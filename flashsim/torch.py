"""PyTorch-native attention: the project's kernels as a differentiable, compilable op.

    import flashsim.torch as fst
    out = fst.attention(q, k, v, causal=True)        # (B, H, N, d); k, v (B, Hk, N, d)
    out.sum().backward()                             # gradients through the backward kernels
    torch.compile(model, fullgraph=True)             # no graph breaks

The forward and backward are registered with `torch.library.custom_op` as
``flashsim::attention_fwd`` and ``flashsim::attention_bwd``, with `register_fake` (shapes
for tracing) and `register_autograd`, so `loss.backward()`, `torch.compile`, autocast (the
op runs in the inputs' dtype; cast before calling under autocast) and `torch.no_grad()`
behave as with `scaled_dot_product_attention`. On CUDA tensors the ops run
`flashsim.gpu` (the fastest rung for the inputs, on the current stream); on CPU tensors
they run the float64 dense reference (`flashsim.attention_reference`, and flash2's
backward from the given out and lse) and return the inputs' dtype, so models and tests
run anywhere.

`flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, ...)` takes
flash_attn's (batch, seqlen, heads, d) layout and argument names, and
`flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
...)` its packed (total, heads, d) batches (ops ``flashsim::attention_varlen_fwd/_bwd``);
windows, softcap and ALiBi slopes pass through. The kernels read these layouts (and
slices of a fused QKV projection) through their strides, without copies, and write out
and the gradients laid out as their inputs are (`torch.empty_like`). Arguments the kernels do
not support yet (dropout, a block table, attention probabilities) raise
`UnsupportedArgument` naming them. `flash_attn_with_kvcache` runs one decoding step over a
contiguous or paged KV cache (`flashsim.gpu.attention_with_kvcache`). `register_hf` makes this the attention of a
transformers model, padded batches through the varlen op.

Importing this module imports torch; ``import flashsim`` alone never does.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch

_NP = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64}


class UnsupportedArgument(NotImplementedError):
    """An argument of flash_attn's interface that flashsim's kernels do not support yet."""


def _to_numpy(x: torch.Tensor) -> np.ndarray:
    # bfloat16 has no NumPy type: its values are exact in float32
    y = x.detach()
    return (y.float() if y.dtype == torch.bfloat16 else y).cpu().numpy()


def _from_numpy(a: np.ndarray, like: torch.Tensor, dtype=None) -> torch.Tensor:
    return torch.from_numpy(np.array(a)).to(device=like.device,
                                                         dtype=dtype or like.dtype)


def _empty_like(x: torch.Tensor, last: int) -> torch.Tensor:
    """An output shaped like ``x`` but for its last axis, laid out as flashsim.gpu lays
    its outputs out (so the fakes below promise what the kernels return):
    `torch.empty_like` when the shapes agree, else x's axes in the order of its strides,
    dense."""
    if last == x.shape[-1]:
        return torch.empty_like(x)
    lead = x.dim() - 1
    order = sorted(range(lead), key=lambda a: -x.stride(a))
    t = x.new_empty(tuple(x.shape[a] for a in order) + (last,))
    return t.permute(*(order.index(a) for a in range(lead)), lead)


def _like(a: np.ndarray, x: torch.Tensor) -> torch.Tensor:
    """A result of the float64 path in x's dtype, device and layout (`_empty_like`)."""
    return _empty_like(x, a.shape[-1]).copy_(torch.from_numpy(np.array(a)))


def _window(left: int, right: int):
    """flash_attn's (-1, -1) is no window; flashsim's is None."""
    return None if (left, right) == (-1, -1) else (left, right)


def _slopes(alibi_slopes):
    """ALiBi slopes as float64 NumPy for flashsim (a few numbers: one small copy)."""
    return None if alibi_slopes is None else _to_numpy(alibi_slopes).astype(np.float64)


@torch.library.custom_op("flashsim::attention_fwd", mutates_args=())
def attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  scale: float, deterministic: bool, window_left: int = -1,
                  window_right: int = -1, softcap: float = 0.0,
                  alibi_slopes: Optional[torch.Tensor] = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """out (B, H, Nq, dv) in q's dtype and lse (B, H, Nq) fp32 (``deterministic`` is for
    the backward that autograd runs; window (−1, −1), softcap 0 and no slopes: none)."""
    var = dict(causal=causal, scale=scale, window=_window(window_left, window_right),
               softcap=softcap or None, alibi_slopes=_slopes(alibi_slopes))
    if q.is_cuda:
        from . import gpu
        out, lse = gpu.attention(q, k, v, **var)      # read through their strides
        return out, lse
    from .reference import attention_reference
    out, lse = attention_reference(_to_numpy(q), _to_numpy(k), _to_numpy(v), **var)
    return _like(out, q), _from_numpy(lse, q, torch.float32)


@attention_fwd.register_fake
def _(q, k, v, causal, scale, deterministic, window_left=-1, window_right=-1, softcap=0.0,
      alibi_slopes=None):
    out = _empty_like(q, v.shape[-1])
    lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
    return out, lse


@torch.library.custom_op("flashsim::attention_bwd", mutates_args=())
def attention_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, dout: torch.Tensor, causal: bool, scale: float,
                  deterministic: bool, window_left: int = -1, window_right: int = -1,
                  softcap: float = 0.0, alibi_slopes: Optional[torch.Tensor] = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) shaped like q, k, v (dk, dv summed over each GQA group)."""
    var = dict(causal=causal, scale=scale, window=_window(window_left, window_right),
               softcap=softcap or None, alibi_slopes=_slopes(alibi_slopes))
    if q.is_cuda:
        from . import gpu
        dq, dk, dv = gpu.attention_backward(q, k, v, out, lse.contiguous(), dout,
                                            deterministic=deterministic, **var)
        return dq, dk, dv
    # the given out and lse define P = exp(S − lse), as the kernels take them (a ring's
    # partial pairs need the global lse, not their own softmax): flash2's backward in
    # float64, in one tile
    from .backward import simulate_backward
    Nq, Nk = q.shape[-2], k.shape[-2]
    g = simulate_backward(_to_numpy(q), _to_numpy(k), _to_numpy(v), _to_numpy(out),
                          _to_numpy(lse), _to_numpy(dout), "flash2",
                          block_sizes=(max(Nq, 1), max(Nk, 1)), **var)
    return _like(g.dq, q), _like(g.dk, k), _like(g.dv, v)


@attention_bwd.register_fake
def _(q, k, v, out, lse, dout, causal, scale, deterministic, window_left=-1, window_right=-1,
      softcap=0.0, alibi_slopes=None):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale, deterministic, wl, wr, softcap, alibi_slopes = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.variant = (wl, wr, softcap, alibi_slopes)
    ctx.causal, ctx.scale, ctx.deterministic = causal, scale, deterministic


def _backward(ctx, dout, dlse):
    # lse is an output for the caller's own use (merging partial results); its gradient
    # is not propagated
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = attention_bwd(q, k, v, out, lse, dout, ctx.causal, ctx.scale,
                               ctx.deterministic, *ctx.variant)
    return dq, dk, dv, None, None, None, None, None, None, None


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


# -- packed varlen batches --------------------------------------------------------------

def _whole(cu_q, cu_k) -> tuple[int, int]:
    """One tile per sequence for the float64 path (its tiling changes no value)."""
    return (max(1, int(np.diff(cu_q).max(initial=1))), max(1, int(np.diff(cu_k).max(initial=1))))


@torch.library.custom_op("flashsim::attention_varlen_fwd", mutates_args=())
def attention_varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                         max_seqlen_q: int, max_seqlen_k: int, causal: bool, scale: float,
                         deterministic: bool, window_left: int, window_right: int,
                         softcap: float, alibi_slopes: Optional[torch.Tensor]
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed (total_q, H, d) queries against (total_k, Hk, d) keys/values: out (total_q,
    H, dv) in q's dtype and lse (H, total_q) fp32, flash_attn's varlen layout."""
    var = dict(causal=causal, scale=scale, window=_window(window_left, window_right),
               softcap=softcap or None, alibi_slopes=_slopes(alibi_slopes))
    cu_q, cu_k = _to_numpy(cu_seqlens_q), _to_numpy(cu_seqlens_k)
    if q.is_cuda:
        from . import gpu
        return gpu.attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=max_seqlen_q,
                                    max_seqlen_k=max_seqlen_k, **var)
    from .varlen import simulate_varlen
    r = simulate_varlen(_to_numpy(q), _to_numpy(k), _to_numpy(v), cu_q, cu_k,
                        block_sizes=_whole(cu_q, cu_k), **var)
    return _like(r.out, q), _from_numpy(r.lse, q, torch.float32)


@attention_varlen_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
      deterministic, window_left, window_right, softcap, alibi_slopes):
    out = _empty_like(q, v.shape[-1])
    lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    return out, lse


@torch.library.custom_op("flashsim::attention_varlen_bwd", mutates_args=())
def attention_varlen_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
                         cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                         max_seqlen_q: int, max_seqlen_k: int, causal: bool, scale: float,
                         deterministic: bool, window_left: int, window_right: int,
                         softcap: float, alibi_slopes: Optional[torch.Tensor]
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) packed like q, k, v (dk, dv summed over each GQA group)."""
    var = dict(causal=causal, scale=scale, window=_window(window_left, window_right),
               softcap=softcap or None, alibi_slopes=_slopes(alibi_slopes))
    cu_q, cu_k = _to_numpy(cu_seqlens_q), _to_numpy(cu_seqlens_k)
    if q.is_cuda:
        from . import gpu
        return gpu.attention_varlen_backward(q, k, v, out, lse.contiguous(), dout, cu_q, cu_k,
                                             max_seqlen_q=max_seqlen_q,
                                             max_seqlen_k=max_seqlen_k,
                                             deterministic=deterministic, **var)
    from .varlen import simulate_varlen_backward
    g = simulate_varlen_backward(*(_to_numpy(x) for x in (q, k, v, out, lse, dout)), cu_q,
                                 cu_k, block_sizes=_whole(cu_q, cu_k), **var)
    return _like(g.dq, q), _like(g.dk, k), _like(g.dv, v)


@attention_varlen_bwd.register_fake
def _(q, k, v, out, lse, dout, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
      scale, deterministic, window_left, window_right, softcap, alibi_slopes):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_varlen(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, deterministic, *variant = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
    ctx.rest = (max_q, max_k, causal, scale, deterministic, *variant)


def _backward_varlen(ctx, dout, dlse):
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = attention_varlen_bwd(q, k, v, out, lse, dout, cu_q, cu_k, *ctx.rest)
    return (dq, dk, dv) + (None,) * 11


attention_varlen_fwd.register_autograd(_backward_varlen, setup_context=_setup_varlen)


def _check(q, k, v):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, heads, seqlen, head_dim), got "
                             f"shape {tuple(x.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, "
                         f"{v.device}")
    B, H, _, d = q.shape
    if k.shape[0] != B or v.shape[0] != B or k.shape[-1] != d or k.shape[:3] != v.shape[:3]:
        raise ValueError(f"shapes do not fit: q {tuple(q.shape)}, k {tuple(k.shape)}, v "
                         f"{tuple(v.shape)} (k and v: (batch, kv_heads, seqlen_k, ·), "
                         "k's head_dim = q's)")
    if H % k.shape[1]:
        raise ValueError(f"kv_heads ({k.shape[1]}) must divide heads ({H}) for GQA/MQA")


def _variant_args(window, softcap, alibi_slopes) -> tuple:
    """(window_left, window_right, softcap, alibi_slopes) as the ops take them: window
    (left, right) with −1 unbounded (None: none), softcap c > 0 (None or 0: none), the
    slopes a tensor of (heads,) or (batch, heads) (fp32; None: none)."""
    if window is None:
        left, right = -1, -1
    else:
        try:
            left, right = (int(x) for x in window)
        except (TypeError, ValueError):
            raise TypeError(f"window must be a pair (left, right), got {window!r}") from None
        if left < -1 or right < -1:
            raise ValueError(f"window sizes must be >= -1 (-1: unbounded), got {window!r}")
    c = 0.0 if softcap is None else float(softcap)
    if c < 0:
        raise ValueError(f"softcap must be > 0 (0 or None: none), got {softcap!r}")
    if alibi_slopes is not None and not isinstance(alibi_slopes, torch.Tensor):
        alibi_slopes = torch.as_tensor(np.asarray(alibi_slopes, np.float32))
    return left, right, c, alibi_slopes


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              scale: float | None = None, deterministic: bool = False, window=None,
              softcap: float | None = None, alibi_slopes=None) -> torch.Tensor:
    """FlashAttention-2 on (B, H, Nq, d) queries and (B, Hk, Nk, d) keys/values (Hk
    dividing H), differentiable (``deterministic`` makes the backward's dQ sum in a fixed
    order on the GPU). ``window=(left, right)``, ``softcap`` and ``alibi_slopes`` ((H,)
    or (B, H)) as in `flashsim.simulate`. Returns out (B, H, Nq, dv) in q's dtype."""
    _check(q, k, v)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    out, _ = attention_fwd(q, k, v, causal, scale, bool(deterministic),
                           *_variant_args(window, softcap, alibi_slopes))
    return out


def attention_with_lse(q, k, v, *, causal: bool = False, scale: float | None = None,
                       window=None, softcap=None, alibi_slopes=None):
    """(out, lse) as `attention`, lse (B, H, Nq) fp32, natural log."""
    _check(q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return attention_fwd(q, k, v, causal, scale, False,
                         *_variant_args(window, softcap, alibi_slopes))


def _refuse(dropout_p, return_attn_probs, **more):
    unsupported = [name for name, bad in (("dropout_p", dropout_p != 0.0),
                                          ("return_attn_probs", return_attn_probs),
                                          *more.items()) if bad]
    if unsupported:
        raise UnsupportedArgument(
            f"flashsim's kernels do not support {', '.join(unsupported)} yet; call with "
            "dropout_p=0.0 and return_attn_probs=False")


def flash_attn_func(q, k, v, dropout_p: float = 0.0, softmax_scale=None, causal: bool = False,
                    window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None,
                    deterministic: bool = False, return_attn_probs: bool = False):
    """flash_attn's `flash_attn_func`: q (batch, seqlen_q, heads, d), k, v (batch,
    seqlen_k, kv_heads, d); returns out (batch, seqlen_q, heads, dv). ``window_size``,
    ``softcap`` and ``alibi_slopes`` ((heads,) or (batch, heads), fp32) as flash_attn
    takes them; dropout and the attention probabilities raise `UnsupportedArgument`."""
    _refuse(dropout_p, return_attn_probs)
    out = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal,
                    scale=softmax_scale, deterministic=deterministic,
                    window=tuple(window_size), softcap=softcap or None,
                    alibi_slopes=alibi_slopes)
    return out.transpose(1, 2)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p: float = 0.0, softmax_scale=None, causal: bool = False,
                           window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None,
                           deterministic: bool = False, return_attn_probs: bool = False,
                           block_table=None):
    """flash_attn's `flash_attn_varlen_func`: packed q (total_q, heads, d), k, v (total_k,
    kv_heads, d), int32 cu_seqlens_q/k (batch + 1,) starting at 0, the longest sequences'
    lengths; returns out (total_q, heads, dv), differentiable. Causal masks and windows
    are aligned to each sequence's bottom-right corner. On CUDA the packed kernels
    (`flashsim.gpu.attention_varlen`), elsewhere the float64 simulator."""
    _refuse(dropout_p, return_attn_probs, block_table=block_table is not None)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            raise ValueError(f"{name} must be a 3-D packed tensor (total, heads, head_dim), "
                             f"got {getattr(x, 'shape', type(x).__name__)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    cu = []
    for name, x in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(x, torch.Tensor):
            x = torch.as_tensor(np.asarray(x))
        if x.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must hold integers (int32), got {x.dtype}")
        cu.append(x)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    out, _ = attention_varlen_fwd(q, k, v, cu[0], cu[1], int(max_seqlen_q), int(max_seqlen_k),
                                  bool(causal), scale, bool(deterministic),
                                  *_variant_args(tuple(window_size), softcap or None,
                                                 alibi_slopes))
    return out


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal: bool = False, window_size=(-1, -1), softcap: float = 0.0,
                            rotary_interleaved: bool = True, alibi_slopes=None,
                            num_splits: int = 0, return_softmax_lse: bool = False):
    """flash_attn's `flash_attn_with_kvcache`, one decoding step: k, v (batch, Nnew,
    kv_heads, d), if given, are written into the caches in place at rows cache_seqlens[b]
    …, then q (batch, Nq, heads, d) attends over each sequence's cache_seqlens[b] + Nnew
    rows (causal: aligned to the bottom right). Caches (batch, capacity, kv_heads, d), or
    paged (num_pages, page_size, kv_heads, d) with ``block_table`` (batch, max_pages)
    int32. ``cache_seqlens``: an int or (batch,) integers (None: the contiguous cache is
    full after the append). ``num_splits`` 0: the occupancy heuristic. Returns out (batch, Nq, heads, d),
    and lse (batch, heads, Nq) fp32 with ``return_softmax_lse``. On CUDA the decoding
    kernels (`flashsim.gpu.attention_with_kvcache`; float16/bfloat16, d ∈ {64, 128}),
    elsewhere the float64 simulator (`flashsim.simulate_kvcache`). Not a training op (no
    gradients, as flash_attn's). Rotary embeddings, cache_batch_idx, cache_leftpad,
    windows, softcap and ALiBi raise `UnsupportedArgument`."""
    unsupported = [name for name, bad in (
        ("rotary_cos", rotary_cos is not None), ("rotary_sin", rotary_sin is not None),
        ("cache_batch_idx", cache_batch_idx is not None),
        ("cache_leftpad", cache_leftpad is not None),
        ("window_size", tuple(window_size) != (-1, -1)), ("softcap", softcap != 0.0),
        ("alibi_slopes", alibi_slopes is not None)) if bad]
    if unsupported:
        raise UnsupportedArgument(f"flashsim's decoding kernels do not support "
                                  f"{', '.join(unsupported)} yet")
    batch = q.shape[0]
    if cache_seqlens is None:
        if block_table is not None:
            raise ValueError("a paged cache needs cache_seqlens (the rows each sequence holds)")
        cache_seqlens = k_cache.shape[1] - (0 if k is None else k.shape[1])
    if isinstance(cache_seqlens, (int, np.integer)):
        cache_seqlens = torch.full((batch,), int(cache_seqlens), dtype=torch.int32)
    splits = None if num_splits in (0, None) else num_splits
    if q.is_cuda:
        from . import gpu
        out, lse = gpu.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens,
                                              block_table=block_table, k=k, v=v, causal=causal,
                                              scale=softmax_scale, num_splits=splits)
    else:
        from .kvcache import simulate_kvcache
        host = (lambda x: None if x is None else _to_numpy(torch.as_tensor(x)))  # noqa: E731
        r = simulate_kvcache(_to_numpy(q), _to_numpy(k_cache), _to_numpy(v_cache),
                             cache_seqlens=host(cache_seqlens), block_table=host(block_table),
                             k=host(k), v=host(v), causal=causal, num_splits=splits,
                             scale=softmax_scale)
        if k is not None:                # the append lands in the caller's caches
            k_cache.copy_(_from_numpy(r.k_cache, k_cache))
            v_cache.copy_(_from_numpy(r.v_cache, v_cache))
        out, lse = _from_numpy(r.out, q), _from_numpy(r.lse, q, torch.float32)
    return (out, lse) if return_softmax_lse else out


# -- Hugging Face transformers ----------------------------------------------------------

def _hf_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                  scaling=None, is_causal=None, **kwargs):
    """transformers' attention interface: query (B, H, N, d), key/value (B, Hk, Nk, d) →
    (attn_output (B, N, H, d), None). ``attention_mask``: None (no padding), or the 2-D
    padding mask over the keys (B, Nk) that transformers' flash-attention mask function
    gives (register_hf registers it), run as a packed varlen batch."""
    if dropout and module.training:
        raise UnsupportedArgument("flashsim's kernels do not support attention dropout yet; "
                                  "set the model's attention_dropout to 0")
    for name in ("softcap", "sliding_window"):
        if kwargs.get(name) is not None:
            raise UnsupportedArgument(f"flashsim's kernels do not support {name} yet")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(causal) and query.shape[2] > 1
    if attention_mask is not None:
        B, Nk = key.shape[0], key.shape[2]
        if attention_mask.dim() != 2 or tuple(attention_mask.shape) != (B, Nk):
            raise UnsupportedArgument(
                f"flashsim's attention backend takes a 2-D padding mask over the keys "
                f"(batch, {Nk}), as transformers' flash-attention mask function gives it; got "
                f"shape {tuple(attention_mask.shape)} (a static cache's mask, or a 4-D one: "
                "register the backend with flashsim.torch.register_hf, or use "
                "attn_implementation='sdpa')")
        return _padded(query, key, value, attention_mask.bool(), causal, scaling), None
    out = attention(query, key, value, causal=causal, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _padded(query, key, value, mask, causal, scale):
    """A padded batch through the varlen op: the real tokens packed (the queries are the
    last Nq key positions, as in prefill and decoding), attended per sequence with the
    causal mask at each one's bottom-right corner, and scattered back; padded query rows
    give 0. Returns (B, Nq, H, dv)."""
    B, H, Nq, d = query.shape
    Nk, dv = key.shape[2], value.shape[-1]
    mask_q = mask[:, Nk - Nq:]
    idx_q = mask_q.reshape(-1).nonzero().squeeze(1)
    idx_k = mask.reshape(-1).nonzero().squeeze(1)

    def cu(m):
        return torch.nn.functional.pad(m.sum(1).cumsum(0), (1, 0)).to(torch.int32)

    def packed(x, idx):
        return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[-1])[idx]

    out = flash_attn_varlen_func(packed(query, idx_q), packed(key, idx_k),
                                 packed(value, idx_k), cu(mask_q), cu(mask),
                                 int(mask_q.sum(1).max()), int(mask.sum(1).max()),
                                 softmax_scale=scale, causal=causal)
    full = out.new_zeros((B * Nq, H, dv)).index_put((idx_q,), out)
    return full.reshape(B, Nq, H, dv)


HF_NAME = "fsim"


def register_hf(name: str = HF_NAME) -> str:
    """Register ``name`` (default "fsim") with transformers' attention interface, and
    its flash-attention mask function with the mask interface (None for an unpadded
    batch, else the 2-D padding mask, which the backend runs as a varlen batch), so
    that ``from_pretrained(..., attn_implementation="fsim")`` or
    ``model.set_attn_implementation("fsim")`` runs a model's attention here. Returns the
    name. (transformers takes any implementation name containing "flash" for a request of
    a FlashAttention kernel from its hub, so the name cannot be "flashsim".)"""
    if "flash" in name:
        raise ValueError(f"transformers loads any attention implementation whose name "
                         f"contains 'flash' as a FlashAttention hub kernel; register under "
                         f"another name than {name!r} (the default is {HF_NAME!r})")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
    AttentionInterface.register(name, _hf_attention)
    AttentionMaskInterface.register(name, flash_attention_mask)
    return name


__all__ = ["attention", "attention_with_lse", "flash_attn_func", "flash_attn_varlen_func",
           "flash_attn_with_kvcache",
           "attention_fwd", "attention_bwd", "attention_varlen_fwd", "attention_varlen_bwd",
           "UnsupportedArgument", "register_hf", "HF_NAME"]
