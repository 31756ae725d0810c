"""flashsim.torch on CUDA tensors: the kernels through the custom ops — values and
gradients by FlashAttention's rule against the float64 oracle, SDPA beside them,
torch.compile and opcheck on the device. Marked `gpu`; skipped without a CUDA device.

    python3 -m pytest -m gpu tests/test_torch_gpu.py
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import flashsim as fs  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not (torch.cuda.is_available() and fs.gpu.available()),
                                 reason="no CUDA device, or no CuPy")]


def tensors(B, H, Hk, Nq, Nk, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Nq, d, generator=g).to("cuda", dtype)
    k = torch.randn(B, Hk, Nk, d, generator=g).to("cuda", dtype)
    v = torch.randn(B, Hk, Nk, d, generator=g).to("cuda", dtype)
    return q, k, v


def host(x):
    return x.detach().float().cpu().numpy()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [40, 64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_values_and_gradients_by_the_rule(dtype, d, causal):
    import flashsim.torch as fst
    from flashsim.testing import assert_attention_close
    q, k, v = tensors(2, 8, 2, 333, 517, d, getattr(torch, dtype))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = fst.attention(q, k, v, causal=causal)
    dout = torch.randn_like(out)
    out.backward(dout)
    assert_attention_close(host(out), host(q), host(k), host(v), causal=causal,
                           io_dtype=dtype, dout=host(dout),
                           grads=(host(q.grad), host(k.grad), host(v.grad)))


def test_compile_and_opcheck_on_the_device():
    import flashsim.torch as fst
    q, k, v = tensors(1, 4, 4, 256, 256, 64, torch.float16, seed=1)
    q, k, v = (x.requires_grad_() for x in (q, k, v))

    def step(q, k, v):
        return fst.attention(q, k, v, causal=True).float().square().mean()

    loss = torch.compile(step, fullgraph=True)(q, k, v)
    torch.testing.assert_close(loss, step(q, k, v), rtol=1e-3, atol=1e-3)
    loss.backward()
    qd, kd, vd = (x.detach() for x in (q, k, v))
    torch.library.opcheck(fst.attention_fwd, (qd, kd, vd, True, 0.125, False))
    out, lse = fst.attention_fwd(qd, kd, vd, True, 0.125, False)
    torch.library.opcheck(fst.attention_bwd, (qd, kd, vd, out, lse, torch.randn_like(out),
                                              True, 0.125, False))


def test_flash_attn_layout_on_the_device():
    import flashsim.torch as fst
    q, k, v = tensors(2, 4, 4, 128, 128, 128, torch.bfloat16, seed=2)
    a = fst.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                            causal=True).transpose(1, 2)
    b = fst.attention(q, k, v, causal=True)
    np.testing.assert_array_equal(host(a), host(b))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_varlen_and_variants_on_the_device(monkeypatch, dtype):
    """flash_attn_varlen_func on CUDA (the packed kernels: wg or tc, forward and backward)
    gives each sequence's own flash_attn_func output and (deterministic) gradients bit for
    bit: the same varlen/variant instance arithmetic (ALiBi slopes of 0 make the dense
    call take it, and kernels.cap_only held off keeps a bfloat16 softcap from the
    copy-engine forward's fixed max); torch.compile traces it without graph breaks."""
    import flashsim.torch as fst
    dt = getattr(torch, dtype)
    nq, nk = [130, 0, 1, 257], [200, 3, 0, 257]
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(nq)]), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(nk)]), dtype=torch.int32, device="cuda")
    g = torch.Generator().manual_seed(7)
    q = torch.randn(sum(nq), 8, 64, generator=g).to("cuda", dt).requires_grad_()
    k = torch.randn(sum(nk), 2, 64, generator=g).to("cuda", dt).requires_grad_()
    v = torch.randn(sum(nk), 2, 64, generator=g).to("cuda", dt).requires_grad_()
    kw = dict(causal=True, window_size=(100, 0), softcap=20.0, deterministic=True)
    out = fst.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(nq), max(nk), **kw)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    for b in range(len(nq)):
        sq = slice(int(cu_q[b]), int(cu_q[b + 1]))
        sk = slice(int(cu_k[b]), int(cu_k[b + 1]))
        if nq[b] == 0:
            continue
        if nk[b] == 0:                         # no key: out = 0, no gradient for q
            assert (out[sq] == 0).all() and (grads[0][sq] == 0).all()
            continue
        qb, kb, vb = (x[s].detach()[None].requires_grad_() for x, s in ((q, sq), (k, sk), (v, sk)))
        with monkeypatch.context() as mp:
            mp.setattr(fs.kernels, "cap_only", lambda *a: False)
            ob = fst.flash_attn_func(qb, kb, vb, alibi_slopes=torch.zeros(8), **kw)
        np.testing.assert_array_equal(host(out[sq]), host(ob[0]))
        gb = torch.autograd.grad(ob, (qb, kb, vb), dout[sq][None])
        for name, got, want in zip(("dq", "dk", "dv"), (grads[0][sq], grads[1][sk], grads[2][sk]), gb):
            np.testing.assert_array_equal(host(got), host(want[0]), err_msg=name)

    def step(q, k, v):
        return fst.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(nq), max(nk),
                                          causal=True).float().square().mean()
    loss = torch.compile(step, fullgraph=True)(q, k, v)
    torch.testing.assert_close(loss, step(q, k, v), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("paged", [False, True])
def test_flash_attn_with_kvcache_on_the_device(paged):
    """The decoding call on CUDA (splitkv_tc.cu): the append lands in the caller's caches
    bit for bit, and out and lse match the float64 path on the same values (a float16
    output's rounding, the fp32 lse's)."""
    import flashsim.torch as fst
    g = torch.Generator().manual_seed(9)
    B, Hk, H, d, Nq, Nnew, P = 3, 2, 8, 128, 1, 2, 16
    lens = torch.tensor([40, 0, 17], dtype=torch.int32)
    q = torch.randn(B, Nq, H, d, generator=g).half()
    kn, vn = (torch.randn(B, Nnew, Hk, d, generator=g).half() for _ in range(2))
    if paged:
        kc, vc = (torch.randn(12, P, Hk, d, generator=g).half() for _ in range(2))
        table = torch.tensor([[3, 7, 1, 0], [2, 4, 5, 6], [11, 10, 9, 8]], dtype=torch.int32)
    else:
        kc, vc = (torch.randn(B, 64, Hk, d, generator=g).half() for _ in range(2))
        table = None
    cpu = [x.clone() for x in (kc, vc)]
    want, want_lse = fst.flash_attn_with_kvcache(q.double(), cpu[0].double(), cpu[1].double(),
                                                 kn.double(), vn.double(), cache_seqlens=lens,
                                                 block_table=table, causal=True,
                                                 return_softmax_lse=True)
    kd, vd = kc.cuda(), vc.cuda()
    out, lse = fst.flash_attn_with_kvcache(q.cuda(), kd, vd, kn.cuda(), vn.cuda(),
                                           cache_seqlens=lens.cuda(), causal=True,
                                           block_table=None if table is None else table.cuda(),
                                           return_softmax_lse=True)
    torch.testing.assert_close(out.double().cpu(), want, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(lse.double().cpu(), want_lse.double(), rtol=1e-5, atol=1e-5)
    for b in range(B):
        for r in range(Nnew):
            row = int(lens[b]) + r
            page, at = (int(table[b, row // P]), row % P) if paged else (b, row)
            assert torch.equal(kd[page, at].cpu(), kn[b, r]) and torch.equal(vd[page, at].cpu(), vn[b, r])


@pytest.mark.parametrize("d", [40, 96])
def test_fast_path_below_an_instance_gives_the_general_paths_bits(d):
    """PyTorch's fast path at a head dim between the instances (the one above, its VAR
    instance) gives the general path's bits: out and lse; dk and dv (summed in
    registers), dq to fp32 atomics' order."""
    import cupy as cp
    q, k, v = tensors(2, 4, 4, 300, 257, d, torch.float16)
    out, lse = fs.gpu.attention(q, k, v, causal=True)            # the fast path
    # the fast path made a launch plan for these shapes (False: it declined them)
    assert any(key[0] == tuple(q.shape) and plan is not False
               for key, plan in fs.gpu.flash2._PLANS.items())
    qc, kc, vc = (cp.from_dlpack(x) for x in (q, k, v))
    out2, lse2 = fs.gpu.attention(qc, kc, vc, causal=True, window=(-1, 0))   # general path
    assert torch.equal(out, torch.from_dlpack(out2)) and torch.equal(lse, torch.from_dlpack(lse2))
    dout = torch.randn_like(out)
    dq, dk, dv = fs.gpu.attention_backward(q, k, v, out, lse, dout, causal=True)
    dq2, dk2, dv2 = fs.gpu.attention_backward(qc, kc, vc, out2, lse2, cp.from_dlpack(dout),
                                              causal=True, window=(-1, 0))
    assert torch.equal(dk, torch.from_dlpack(dk2)) and torch.equal(dv, torch.from_dlpack(dv2))
    torch.testing.assert_close(dq, torch.from_dlpack(dq2), rtol=2e-3, atol=2e-3)


def test_strided_layouts_are_read_without_copies():
    """flash_attn_func on the slices of a fused QKV projection (B, N, 3·H, d): the same
    bits as on dense copies, out laid out (B, N, H, d), and no allocation of an input's
    size beyond the outputs, forward and backward (a hidden copy of q, k, v, out or dout
    would add one each); opcheck on strided inputs (the fakes promise the real layouts)."""
    import flashsim.torch as fst
    B, N, H, d = 2, 4096, 16, 128
    fused = torch.randn(B, N, 3 * H, d, device="cuda", dtype=torch.bfloat16)
    q, k, v = fused.split(H, dim=2)                  # rows 3·H·d apart
    out = fst.flash_attn_func(q, k, v, causal=True)
    assert out.is_contiguous()
    assert torch.equal(out, fst.flash_attn_func(q.contiguous(), k.contiguous(),
                                                v.contiguous(), causal=True))
    size, lse_size, MB = q.numel() * 2, B * H * N * 4, 2**20

    def extra(call):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        result = call()
        torch.cuda.synchronize()
        return result, torch.cuda.max_memory_allocated() - base

    with torch.no_grad():
        _, grew = extra(lambda: fst.flash_attn_func(q, k, v, causal=True))
    assert grew < size + lse_size + MB, (grew, size)           # out and lse only
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))          # (B, H, N, d) views
    o, lse = fst.attention_fwd(qt, kt, vt, True, d ** -0.5, False)
    assert o.transpose(1, 2).is_contiguous()                     # laid out as q is
    dout = torch.randn_like(o)
    # dq, dk, dv (size each), dQacc (fp32: 2·size) and D only
    grads, grew = extra(lambda: fst.attention_bwd(qt, kt, vt, o, lse, dout, True,
                                                  d ** -0.5, False))
    assert grew < 5 * size + lse_size + MB, (grew, size)
    assert all(g.transpose(1, 2).is_contiguous() for g in grads)
    dense = [x.contiguous() for x in (qt, kt, vt, o, dout)]
    a = fst.attention_bwd(qt, kt, vt, o, lse, dout, True, d ** -0.5, True)
    b = fst.attention_bwd(*dense[:4], lse, dense[4], True, d ** -0.5, True)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    small = fused[:, :256].split(H, dim=2)
    qs, ks, vs = (x.transpose(1, 2) for x in small)
    torch.library.opcheck(fst.attention_fwd, (qs, ks, vs, True, 0.125, False))
    os_, ls = fst.attention_fwd(qs, ks, vs, True, 0.125, False)
    torch.library.opcheck(fst.attention_bwd, (qs, ks, vs, os_, ls, torch.randn_like(os_),
                                              True, 0.125, False))


def _llama_curve(name, steps, batch, seq, backend=None):
    """Loss per step of a small random Llama-style model (GQA 4/2, d = 64, causal) trained
    with AdamW under bfloat16 autocast on a counting task (each sequence steps through the
    vocabulary from a random start by a random stride of 1 to 3, which the model reads
    off the earlier tokens), from one seed: the same weights and data for every
    attention."""
    import contextlib
    import transformers
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=seq)
    model = transformers.LlamaForCausalLM(cfg).cuda()
    model.set_attn_implementation(name)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    g = torch.Generator(device="cuda").manual_seed(1)
    ctx = (torch.nn.attention.sdpa_kernel(backend) if backend is not None
           else contextlib.nullcontext())
    losses = []
    with ctx:
        for _ in range(steps):
            start = torch.randint(0, 256, (batch, 1), device="cuda", generator=g)
            stride = torch.randint(1, 4, (batch, 1), device="cuda", generator=g)
            ids = (start + stride * torch.arange(seq, device="cuda")) % 256
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return np.array(losses)


def test_hugging_face_training_follows_sdpa():
    """attn_implementation="fsim" trains 50 steps along SDPA's loss curve within the
    noise between two SDPA backends (FlashAttention-2 and the math one) on the same
    weights and data, and learns the task."""
    pytest.importorskip("transformers")
    import flashsim.torch as fst
    from torch.nn.attention import SDPBackend
    name = fst.register_hf()
    steps, batch, seq = 50, 8, 512
    ours = _llama_curve(name, steps, batch, seq)
    flash = _llama_curve("sdpa", steps, batch, seq, SDPBackend.FLASH_ATTENTION)
    math_ = _llama_curve("sdpa", steps, batch, seq, SDPBackend.MATH)
    noise = np.abs(math_ - flash).max()
    dev = np.abs(ours - flash).max()
    print(f"\nloss, steps 1, 10, 25, 50: fsim {ours[[0, 9, 24, 49]].round(4)}, sdpa-flash "
          f"{flash[[0, 9, 24, 49]].round(4)}, sdpa-math {math_[[0, 9, 24, 49]].round(4)}; "
          f"max |fsim − flash| = {dev:.4f}, max |math − flash| = {noise:.4f}")
    assert ours[-1] < 0.5 * ours[0]
    assert dev <= 3 * noise + 0.02, (dev, noise)
