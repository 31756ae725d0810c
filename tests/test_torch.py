"""flashsim.torch: the attention op in PyTorch — values and gradients against SDPA,
torch.compile without graph breaks, torch.library.opcheck, flash_attn's interface — on
the CPU (the reference path); the same ops run the kernels on CUDA tensors."""

import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional
fst = pytest.importorskip("flashsim.torch")
import flashsim as fs  # noqa: E402


def sdpa(q, k, v, causal):
    """SDPA with GQA groups expanded and the bottom-right causal mask."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    mask = None
    if causal:
        Nq, Nk = q.shape[-2], k.shape[-2]
        mask = torch.ones(Nq, Nk, dtype=torch.bool).tril(Nk - Nq)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)])
def test_values_and_gradients_match_sdpa(causal, dtype, heads):
    torch.manual_seed(0)
    H, Hk = heads
    q = torch.randn(2, H, 37, 16, dtype=dtype, requires_grad=True)
    k = torch.randn(2, Hk, 45, 16, dtype=dtype, requires_grad=True)
    v = torch.randn(2, Hk, 45, 24, dtype=dtype, requires_grad=True)
    out = fst.attention(q, k, v, causal=causal)
    ref = sdpa(q, k, v, causal)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    g = torch.randn_like(out)
    (out * g).sum().backward()
    grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    (ref * g).sum().backward()
    # the backward takes the forward's lse, stored in fp32 as the kernels store it, so the
    # gradients carry fp32's precision whatever the inputs' type
    for a, x in zip(grads, (q, k, v)):
        torch.testing.assert_close(a, x.grad, rtol=2e-6, atol=2e-6)


def test_compiles_without_graph_breaks():
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 20, 8, requires_grad=True) for _ in range(3))

    def step(q, k, v):
        return fst.attention(q, k, v, causal=True).square().sum()

    compiled = torch.compile(step, fullgraph=True)
    loss = compiled(q, k, v)
    torch.testing.assert_close(loss, step(q, k, v))
    loss.backward()
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in (q, k, v))


def test_opcheck():
    torch.manual_seed(2)
    q, k, v = torch.randn(1, 2, 9, 8), torch.randn(1, 1, 11, 8), torch.randn(1, 1, 11, 8)
    torch.library.opcheck(fst.attention_fwd, (q, k, v, True, 0.3, False))
    out, lse = fst.attention_fwd(q, k, v, True, 0.3, False)
    torch.library.opcheck(fst.attention_bwd, (q, k, v, out, lse, torch.randn_like(out), True,
                                              0.3, False))
    # (B, N, H, d) layouts read as (B, H, N, d), dv ≠ d: the outputs come back laid out as
    # their inputs, as the fakes promise
    q, k = (torch.randn(1, n, h, 8).transpose(1, 2) for n, h in ((9, 2), (11, 1)))
    v = torch.randn(1, 11, 1, 6).transpose(1, 2)
    torch.library.opcheck(fst.attention_fwd, (q, k, v, True, 0.3, False))
    out, lse = fst.attention_fwd(q, k, v, True, 0.3, False)
    assert out.shape == (1, 2, 9, 6) and out.transpose(1, 2).is_contiguous()
    grads = fst.attention_bwd(q, k, v, out, lse, torch.randn_like(out), True, 0.3, False)
    assert all(g.stride() == x.stride() for g, x in zip(grads, (q, k, v)))


def test_no_grad_and_bfloat16():
    q, k, v = (torch.randn(1, 2, 16, 8, dtype=torch.bfloat16) for _ in range(3))
    with torch.no_grad():
        out = fst.attention(q, k, v)
    assert out.dtype == torch.bfloat16 and not out.requires_grad
    torch.testing.assert_close(out.float(), sdpa(q.float(), k.float(), v.float(), False),
                               rtol=1e-2, atol=1e-2)
    out, lse = fst.attention_with_lse(q.float(), k.float(), v.float())
    assert lse.shape == (1, 2, 16) and lse.dtype == torch.float32


def test_flash_attn_interface():
    torch.manual_seed(3)
    q = torch.randn(2, 30, 4, 16)             # (batch, seqlen, heads, d)
    k, v = torch.randn(2, 30, 2, 16), torch.randn(2, 30, 2, 16)
    out = fst.flash_attn_func(q, k, v, causal=True, softmax_scale=0.2)
    ref = fst.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
                        scale=0.2).transpose(1, 2)
    assert out.shape == (2, 30, 4, 16)
    torch.testing.assert_close(out, ref)
    for kw, name in ((dict(dropout_p=0.1), "dropout_p"),
                     (dict(return_attn_probs=True), "return_attn_probs")):
        with pytest.raises(fst.UnsupportedArgument, match=name):
            fst.flash_attn_func(q, k, v, **kw)


def test_flash_attn_variants_match_the_float64_reference():
    """window_size, softcap and alibi_slopes pass through to the kernels' semantics
    (flashsim.attention_reference's), values and gradients."""
    torch.manual_seed(4)
    q = torch.randn(2, 21, 4, 16, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 25, 2, 16, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 25, 2, 8, dtype=torch.float64, requires_grad=True)
    slopes = torch.rand(2, 4) * 0.5
    kw = dict(causal=True, window_size=(6, 0), softcap=5.0, alibi_slopes=slopes)
    out = fst.flash_attn_func(q, k, v, **kw)
    want, _ = fs.attention_reference(*(x.detach().transpose(1, 2).numpy() for x in (q, k, v)),
                                     causal=True, window=(6, 0), softcap=5.0,
                                     alibi_slopes=slopes.numpy())
    np.testing.assert_allclose(out.detach().transpose(1, 2).numpy(), want, atol=1e-12)
    out.square().sum().backward()
    g = [x.grad.clone() for x in (q, k, v)]
    # the gradients against autograd through an explicit float64 computation
    for x in (q, k, v):
        x.grad = None
    ref = _explicit(q, k, v, causal=True, window=(6, 0), softcap=5.0, slopes=slopes)
    ref.square().sum().backward()
    # (the backward takes the fp32 lse, as the kernels store it: fp32's precision)
    for a, b in zip(g, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _explicit(q, k, v, *, causal, window, softcap, slopes):
    """Attention written out in PyTorch ((B, N, H, d) layout), the variants in
    flashsim.variants' order: softcap, then ALiBi, then the band (bottom-right)."""
    B, Nq, H, d = q.shape
    Nk, g = k.shape[1], H // k.shape[2]
    kk, vv = (x.repeat_interleave(g, dim=2) for x in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) / d ** 0.5
    s = softcap * torch.tanh(s / softcap)
    r = torch.arange(Nq)[:, None] + (Nk - Nq)
    c = torch.arange(Nk)[None, :]
    s = s - slopes[:, :, None, None] * (r - c).abs()
    left, right = window
    seen = (c >= r - left) & (c <= r + (0 if causal else right))
    s = s.masked_fill(~seen, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1), vv)


def test_flash_attn_varlen_func_matches_each_sequence():
    """Packed sequences (lengths 0 and 1 among them, GQA, causal, a window) give each
    sequence's own flash_attn_func result and gradients; opcheck on the varlen ops."""
    torch.manual_seed(5)
    nq, nk = [3, 0, 1, 9], [5, 2, 0, 9]
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(nq)]), dtype=torch.int32)
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(nk)]), dtype=torch.int32)
    q = torch.randn(sum(nq), 4, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(sum(nk), 2, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(sum(nk), 2, 8, dtype=torch.float64, requires_grad=True)
    kw = dict(causal=True, window_size=(4, 0), softcap=3.0)
    out = fst.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(nq), max(nk), **kw)
    assert out.shape == (sum(nq), 4, 8)
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    for b in range(len(nq)):
        sq, sk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        if nq[b] == 0:
            continue
        if nk[b] == 0:                         # no key: out = 0, no gradient for q
            assert (out[sq] == 0).all() and (dq[sq] == 0).all()
            continue
        qb, kb, vb = (x[s].detach().clone().requires_grad_()[None]
                      for x, s in ((q, sq), (k, sk), (v, sk)))
        ob = fst.flash_attn_func(qb, kb, vb, **kw)
        torch.testing.assert_close(out[sq], ob[0], rtol=1e-12, atol=1e-12)
        gb = torch.autograd.grad(ob, (qb, kb, vb), dout[sq][None])
        for got, want in zip((dq[sq], dk[sk], dv[sk]), gb):
            torch.testing.assert_close(got, want[0], rtol=1e-9, atol=1e-10)
    args = (q.detach(), k.detach(), v.detach(), cu_q, cu_k, max(nq), max(nk), True, 0.3, False,
            4, 0, 3.0, None)
    torch.library.opcheck(fst.attention_varlen_fwd, args)
    o, lse = fst.attention_varlen_fwd(*args)
    assert lse.shape == (4, sum(nq)) and lse.dtype == torch.float32
    torch.library.opcheck(fst.attention_varlen_bwd, args[:3] + (o, lse, torch.randn_like(o))
                          + args[3:])
    with pytest.raises(fst.UnsupportedArgument, match="block_table"):
        fst.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 9, block_table=torch.zeros(1))
    with pytest.raises(ValueError, match="3-D packed"):
        fst.flash_attn_varlen_func(q[None], k, v, cu_q, cu_k, 9, 9)
    with pytest.raises(ValueError, match="must start at 0"):
        fst.flash_attn_varlen_func(q, k, v, cu_q + 1, cu_k, 9, 9)


def test_bad_input():
    q = torch.randn(1, 4, 8, 16)
    with pytest.raises(ValueError, match="4-D"):
        fst.attention(q[0], q[0], q[0])
    with pytest.raises(ValueError, match="must divide heads"):
        fst.attention(q, torch.randn(1, 3, 8, 16), torch.randn(1, 3, 8, 16))
    with pytest.raises(TypeError, match="share a dtype"):
        fst.attention(q, q.double(), q)
    with pytest.raises(TypeError, match="causal must be"):
        fst.attention(q, q, q, causal=1)


def test_import_flashsim_does_not_import_torch():
    code = "import sys, flashsim; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_hugging_face_backend_matches_sdpa():
    """A small random Llama-style model (GQA, causal) with attn_implementation="fsim"
    gives SDPA's logits, gradients and greedy generations, trains the same, and runs
    padded batches (left and right padding) as packed varlen batches."""
    import copy
    transformers = pytest.importorskip("transformers")
    name = fst.register_hf()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2)
    ours = transformers.LlamaForCausalLM(copy.deepcopy(cfg)).double()
    ref = transformers.LlamaForCausalLM(copy.deepcopy(cfg)).double()
    ref.load_state_dict(ours.state_dict())
    ours.set_attn_implementation(name)
    ref.set_attn_implementation("sdpa")
    assert ours.config._attn_implementation == name
    ids = torch.randint(0, 97, (2, 40))
    a, b = ours(ids, labels=ids), ref(ids, labels=ids)
    torch.testing.assert_close(a.logits, b.logits, rtol=1e-10, atol=1e-12)
    a.loss.backward()
    b.loss.backward()
    # (the backward takes the fp32 lse, as the kernels store it: fp32's precision)
    for p, q in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    # a few training steps follow the same losses
    losses = []
    for model in (ours, ref):
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        run = []
        for _ in range(10):
            opt.zero_grad()
            loss = model(ids, labels=ids).loss
            loss.backward()
            opt.step()
            run.append(loss.item())
        losses.append(run)
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-6)
    assert losses[0][-1] < losses[0][0]
    mask = torch.ones(2, 5, dtype=torch.long)
    assert torch.equal(ours.generate(ids[:, :5], attention_mask=mask, max_new_tokens=4,
                                     do_sample=False),
                       ref.generate(ids[:, :5], attention_mask=mask, max_new_tokens=4,
                                    do_sample=False))
    # padded batches run as packed varlen batches: left padding (generation) and right
    # padding (training), logits at the real tokens and gradients equal to SDPA's (the
    # same weights again: the training above moved each model by its own roundings)
    ref.load_state_dict(ours.state_dict())
    for padded in (torch.tensor([[1] * 40, [0] * 5 + [1] * 35]),
                   torch.tensor([[1] * 31 + [0] * 9, [1] * 40])):
        for model in (ours, ref):
            model.zero_grad()
        a, b = ours(ids, attention_mask=padded), ref(ids, attention_mask=padded)
        real = padded.bool()
        torch.testing.assert_close(a.logits[real], b.logits[real], rtol=1e-10, atol=1e-12)
        a.logits[real].square().sum().backward()
        b.logits[real].square().sum().backward()
        # fp32 lse again, relative to each gradient's scale (this loss is not a mean)
        for p, q in zip(ours.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5,
                                       atol=1e-5 * float(q.grad.abs().max()))
    left = torch.tensor([[1] * 8, [0] * 3 + [1] * 5])
    assert torch.equal(ours.generate(ids[:, :8], attention_mask=left, max_new_tokens=4,
                                     do_sample=False),
                       ref.generate(ids[:, :8], attention_mask=left, max_new_tokens=4,
                                    do_sample=False))
    with pytest.raises(ValueError, match="contains 'flash'"):
        fst.register_hf("flashsim")


def test_flash_attn_with_kvcache_appends_in_place_and_attends():
    """flash_attn's decoding call, contiguous and paged: the new rows land in the caller's
    caches, and out equals flash_attn_func over each sequence's cache rows (causal,
    bottom-right), lse with return_softmax_lse."""
    torch.manual_seed(6)
    B, Hk, H, d, Nq, Nnew = 2, 2, 4, 16, 3, 2
    lens = torch.tensor([5, 0], dtype=torch.int32)
    q = torch.randn(B, Nq, H, d, dtype=torch.float64)
    kn, vn = torch.randn(B, Nnew, Hk, d, dtype=torch.float64), torch.randn(B, Nnew, Hk, d, dtype=torch.float64)
    kc, vc = torch.randn(B, 16, Hk, d, dtype=torch.float64), torch.randn(B, 16, Hk, d, dtype=torch.float64)
    # the same rows in a paged cache: pages of 16 rows, sequence b in page 2 − b
    kp, vp = torch.zeros(3, 16, Hk, d, dtype=torch.float64), torch.zeros(3, 16, Hk, d, dtype=torch.float64)
    kp[2], kp[1], vp[2], vp[1] = kc[0], kc[1], vc[0], vc[1]
    table = torch.tensor([[2], [1]], dtype=torch.int32)
    out, lse = fst.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, causal=True,
                                           return_softmax_lse=True)
    paged = fst.flash_attn_with_kvcache(q, kp, vp, kn, vn, cache_seqlens=lens, causal=True,
                                        block_table=table)
    assert out.shape == q.shape and lse.shape == (B, H, Nq)
    torch.testing.assert_close(paged, out, rtol=0, atol=0)
    for b in range(B):
        n = int(lens[b]) + Nnew
        torch.testing.assert_close(kc[b, int(lens[b]):n], kn[b], rtol=0, atol=0)   # in place
        torch.testing.assert_close(kp[2 - b, int(lens[b]):n], kn[b], rtol=0, atol=0)
        want = fst.flash_attn_func(q[b:b + 1], kc[b:b + 1, :n], vc[b:b + 1, :n], causal=True)
        torch.testing.assert_close(out[b:b + 1], want, rtol=1e-12, atol=1e-12)
    for kw in (dict(rotary_cos=q), dict(softcap=5.0), dict(cache_leftpad=lens)):
        with pytest.raises(fst.UnsupportedArgument, match=next(iter(kw))):
            fst.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, **kw)
    with pytest.raises(ValueError, match="paged cache needs cache_seqlens"):
        fst.flash_attn_with_kvcache(q, kp, vp, block_table=table)
