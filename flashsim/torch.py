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
flash_attn's (batch, seqlen, heads, d) layout and argument names. The kernels read
(B, H, N, d) contiguous tensors, so this layout is transposed with a copy for now.
Arguments the kernels do not support yet (dropout, windows, softcap, ALiBi, attention
probabilities) raise `UnsupportedArgument` naming them.

Importing this module imports torch; ``import flashsim`` alone never does.
"""

from __future__ import annotations

import math

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


@torch.library.custom_op("flashsim::attention_fwd", mutates_args=())
def attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  scale: float, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """out (B, H, Nq, dv) in q's dtype and lse (B, H, Nq) fp32 (``deterministic`` is for
    the backward that autograd runs)."""
    if q.is_cuda:
        from . import gpu
        out, lse = gpu.attention(q.contiguous(), k.contiguous(), v.contiguous(),
                                 causal=causal, scale=scale)
        return out, lse
    from .reference import attention_reference
    out, lse = attention_reference(_to_numpy(q), _to_numpy(k), _to_numpy(v), causal=causal,
                                   scale=scale)
    return _from_numpy(out, q), _from_numpy(lse, q, torch.float32)


@attention_fwd.register_fake
def _(q, k, v, causal, scale, deterministic):
    out = q.new_empty(q.shape[:-1] + (v.shape[-1],))
    lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
    return out, lse


@torch.library.custom_op("flashsim::attention_bwd", mutates_args=())
def attention_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, dout: torch.Tensor, causal: bool, scale: float,
                  deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) shaped like q, k, v (dk, dv summed over each GQA group)."""
    if q.is_cuda:
        from . import gpu
        c = [x.contiguous() for x in (q, k, v, out, lse, dout)]
        dq, dk, dv = gpu.attention_backward(*c, causal=causal, scale=scale,
                                            deterministic=deterministic)
        return dq, dk, dv
    # the given out and lse define P = exp(S − lse), as the kernels take them (a ring's
    # partial pairs need the global lse, not their own softmax): flash2's backward in
    # float64, in one tile
    from .backward import simulate_backward
    Nq, Nk = q.shape[-2], k.shape[-2]
    g = simulate_backward(_to_numpy(q), _to_numpy(k), _to_numpy(v), _to_numpy(out),
                          _to_numpy(lse), _to_numpy(dout), "flash2", causal=causal, scale=scale,
                          block_sizes=(max(Nq, 1), max(Nk, 1)))
    return _from_numpy(g.dq, q), _from_numpy(g.dk, k), _from_numpy(g.dv, v)


@attention_bwd.register_fake
def _(q, k, v, out, lse, dout, causal, scale, deterministic):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal, ctx.scale, ctx.deterministic = causal, scale, deterministic


def _backward(ctx, dout, dlse):
    # lse is an output for the caller's own use (merging partial results); its gradient
    # is not propagated
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = attention_bwd(q, k, v, out, lse, dout.contiguous(), ctx.causal, ctx.scale,
                               ctx.deterministic)
    return dq, dk, dv, None, None, None


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


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


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              scale: float | None = None, deterministic: bool = False) -> torch.Tensor:
    """FlashAttention-2 on (B, H, Nq, d) queries and (B, Hk, Nk, d) keys/values (Hk
    dividing H), differentiable (``deterministic`` makes the backward's dQ sum in a fixed
    order on the GPU). Returns out (B, H, Nq, dv) in q's dtype."""
    _check(q, k, v)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    out, _ = attention_fwd(q, k, v, causal, scale, bool(deterministic))
    return out


def attention_with_lse(q, k, v, *, causal: bool = False, scale: float | None = None):
    """(out, lse) as `attention`, lse (B, H, Nq) fp32, natural log."""
    _check(q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return attention_fwd(q, k, v, causal, scale, False)


def flash_attn_func(q, k, v, dropout_p: float = 0.0, softmax_scale=None, causal: bool = False,
                    window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None,
                    deterministic: bool = False, return_attn_probs: bool = False):
    """flash_attn's `flash_attn_func`: q (batch, seqlen_q, heads, d), k, v (batch,
    seqlen_k, kv_heads, d); returns out (batch, seqlen_q, heads, dv)."""
    unsupported = [name for name, bad in (
        ("dropout_p", dropout_p != 0.0), ("window_size", tuple(window_size) != (-1, -1)),
        ("softcap", softcap != 0.0), ("alibi_slopes", alibi_slopes is not None),
        ("return_attn_probs", return_attn_probs)) if bad]
    if unsupported:
        raise UnsupportedArgument(
            f"flashsim's kernels do not support {', '.join(unsupported)} yet; call with the "
            "defaults (dropout_p=0.0, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, "
            "return_attn_probs=False)")
    out = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal,
                    scale=softmax_scale, deterministic=deterministic)
    return out.transpose(1, 2)


# -- Hugging Face transformers ----------------------------------------------------------

def _hf_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                  scaling=None, is_causal=None, **kwargs):
    """transformers' attention interface: query (B, H, N, d), key/value (B, Hk, Nk, d) →
    (attn_output (B, N, H, d), None)."""
    if attention_mask is not None:
        raise UnsupportedArgument(
            "flashsim's attention backend takes unpadded batches only (a padding mask needs "
            "varlen kernels, not there yet): batch sequences of one length, or use "
            "attn_implementation='sdpa' for padded ones")
    if dropout and module.training:
        raise UnsupportedArgument("flashsim's kernels do not support attention dropout yet; "
                                  "set the model's attention_dropout to 0")
    for name in ("softcap", "sliding_window"):
        if kwargs.get(name) is not None:
            raise UnsupportedArgument(f"flashsim's kernels do not support {name} yet")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    out = attention(query, key, value, causal=bool(causal) and query.shape[2] > 1,
                    scale=scaling)
    return out.transpose(1, 2).contiguous(), None


HF_NAME = "fsim"


def register_hf(name: str = HF_NAME) -> str:
    """Register ``name`` (default "fsim") with transformers' attention interface, and
    sdpa's mask function with its mask interface (no mask for a causal unpadded batch), so
    that ``from_pretrained(..., attn_implementation="fsim")`` or
    ``model.set_attn_implementation("fsim")`` runs a model's attention here. Returns the
    name. (transformers takes any implementation name containing "flash" for a request of
    a FlashAttention kernel from its hub, so the name cannot be "flashsim".)"""
    if "flash" in name:
        raise ValueError(f"transformers loads any attention implementation whose name "
                         f"contains 'flash' as a FlashAttention hub kernel; register under "
                         f"another name than {name!r} (the default is {HF_NAME!r})")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    AttentionInterface.register(name, _hf_attention)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


__all__ = ["attention", "attention_with_lse", "flash_attn_func", "attention_fwd",
           "attention_bwd", "UnsupportedArgument", "register_hf", "HF_NAME"]
