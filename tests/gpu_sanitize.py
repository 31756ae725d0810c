"""A fuzzed set of launches of every kernel, for compute-sanitizer (not a pytest file).

    for tool in memcheck racecheck synccheck; do
        compute-sanitizer --tool $tool --error-exitcode 1 python3 tests/gpu_sanitize.py
    done
    FLASHSIM_TMA=0 compute-sanitizer --tool initcheck --error-exitcode 1 python3 tests/gpu_sanitize.py

(initcheck without the copy engine: it does not count a TMA store as a write, so the Hopper
forward's O, stored that way, reads as uninitialised wherever the backward reads it.)

(racecheck is the slowest tool: `python3 tests/gpu_sanitize.py 3` runs 3 shapes.)

Each dtype, both masks, ragged sizes, GQA, block sizes that do not divide N, both the
fast and the instrumented builds, every rung that runs on the device, forward and
backward (the instrumented one in the deterministic mode, whose tiles take turns adding
into dQ); every rung with a window, softcap and ALiBi; and the decoding kernels
(kernels_cu/splitkv_tc.cu, the parts merged through memory and in clusters), packed
varlen batches (every rung), FlashAttention-1, standard attention and square tiles
(flash1_ref.cu, standard_ref.cu, square_ref.cu), inputs read through their strides
(slices of a fused QKV, dense and packed), and on sm_90 the copy-engine forward's CTAs
walking several tiles each.
"""

import sys

import numpy as np

sys.path.insert(0, ".")
import flashsim as fs  # noqa: E402

try:
    import torch
    HAVE_TORCH = torch.cuda.is_available()
except ImportError:
    HAVE_TORCH = False


def dev(x, dtype):
    if dtype == "bfloat16":
        return torch.from_numpy(x.astype(np.float32)).to("cuda", torch.bfloat16)
    import cupy as cp
    return cp.asarray(x.astype(dtype))


def fitting(blocks, d: int, dv: int, dtype: str):
    """``blocks`` where the reference flash2 kernels' tiles fit the device's shared
    memory in both directions (a large d in float64 may not), else None (their own)."""
    if blocks is None:
        return None
    limit = fs.gpu._device.smem_limit()
    need = max(fs.kernels.smem_bytes(k, *blocks, d, dv, dtype)
               for k in ("flash2_fwd", "flash2_bwd_main"))
    return blocks if need <= limit else None


def main(n_cases: int = 8) -> int:
    rng = np.random.default_rng(0)
    dtypes = ["float16", "float32", "float64"] + (["bfloat16"] if HAVE_TORCH else [])
    launches = fast_variants = 0
    for case in range(n_cases):
        Nq, Nk = (int(x) for x in rng.choice([1, 7, 33, 65, 130], 2))
        d = int(rng.choice([3, 16, 40, 64, 96, 128, 192]))
        dv = int(rng.choice([d, d, 24]))
        hk, g = int(rng.integers(1, 3)), int(rng.integers(1, 3))
        blocks = [None, (16, 32), (7, 5)][case % 3]
        for dtype in dtypes:
            for causal in (False, True):
                q = rng.standard_normal((2, hk * g, Nq, d))
                k = rng.standard_normal((2, hk, Nk, d))
                v = rng.standard_normal((2, hk, Nk, dv))
                qd, kd, vd = (dev(x, dtype) for x in (q, k, v))
                for count_io in (False, True):
                    # (fast: head dims multiples of 8 up to 128, on the instance above them)
                    if dtype in ("float16", "bfloat16") and fs.kernels.head_dim_instance(d, dv):
                        # the mma.sync forward too: "auto" picks the Hopper one on sm_90
                        fs.gpu.attention(qd, kd, vd, causal=causal, count_io=count_io,
                                         kernel="tc")
                        launches += 1
                    # auto: the fastest rung that runs the inputs (wg or tc, else ref)
                    for kernel in ("ref", "auto"):
                        b = fitting(blocks, d, dv, dtype) if kernel == "ref" else None
                        out, lse = fs.gpu.attention(qd, kd, vd, causal=causal, block_sizes=b,
                                                    count_io=count_io, kernel=kernel)[:2]
                        dout = dev(rng.standard_normal(tuple(out.shape)), dtype)
                        fs.gpu.attention_backward(qd, kd, vd, out, lse, dout, causal=causal,
                                                  block_sizes=b, count_io=count_io, kernel=kernel,
                                                  deterministic=count_io)
                        launches += 4
                # the variants (reference rung): a window cutting tiles, softcap, ALiBi
                # per (batch, head)
                var = dict(window=(int(rng.integers(0, 40)), int(rng.integers(-1, 10))),
                           softcap=float(rng.uniform(1, 20)),
                           alibi_slopes=rng.uniform(0, 0.5, (2, hk * g)))
                out, lse = fs.gpu.attention(qd, kd, vd, causal=causal,
                                            block_sizes=fitting(blocks, d, dv, dtype),
                                            count_io=True, **var)[:2]
                dout = dev(rng.standard_normal(tuple(out.shape)), dtype)
                fs.gpu.attention_backward(qd, kd, vd, out, lse, dout, causal=causal,
                                          block_sizes=fitting(blocks, d, dv, dtype), count_io=True,
                                          deterministic=causal, **var)
                launches += 4
                if dtype in ("float16", "bfloat16") and fs.kernels.head_dim_instance(d, dv):
                    # the fast rungs' softcap/ALiBi instances: tc, and auto (wg on sm_90)
                    for kernel in ("tc", "auto"):
                        out, lse = fs.gpu.attention(qd, kd, vd, causal=causal, kernel=kernel,
                                                    count_io=kernel == "tc", **var)[:2]
                        fs.gpu.attention_backward(qd, kd, vd, out, lse, dout, causal=causal,
                                                  kernel=kernel, deterministic=not causal,
                                                  **var)
                    launches += 8
                    fast_variants += 8
    launches += decoding(rng, n_cases, [d for d in dtypes if d in ("float16", "bfloat16")])
    launches += varlen(rng, n_cases, dtypes)
    launches += paper_algorithms(rng, n_cases, dtypes)
    launches += strided()
    launches += walking(rng, [d for d in dtypes if d in ("float16", "bfloat16")])
    import cupy as cp
    cp.cuda.Device().synchronize()
    print(f"{launches} kernel launches ({n_cases} shapes × {len(dtypes)} dtypes × 2 masks × "
          f"2 builds × the rungs, and the decoding kernels; {fast_variants} of the fast rungs' "
          "softcap/ALiBi instances)")
    return 0


def varlen(rng, n_cases, dtypes):
    """Packed batches (the reference rung): lengths 0 and 1 among others, GQA, a window,
    softcap and per-sequence ALiBi, both builds, the deterministic backward."""
    launches = 0
    for case in range(n_cases):
        nq = rng.choice([0, 1, 17, 40], 3)
        nk = rng.choice([0, 1, 23, 40], 3)
        cu_q = np.concatenate([[0], np.cumsum(nq)]).astype(np.int32)
        cu_k = np.concatenate([[0], np.cumsum(nk)]).astype(np.int32)
        d, hk, g = (16, 40)[case % 2], 2, (1, 2)[case % 2]
        var = dict(causal=bool(case % 2), window=(int(rng.integers(0, 20)), -1),
                   softcap=float(rng.uniform(1, 20)), alibi_slopes=rng.uniform(0, 0.5, (3, hk * g)))
        for dtype in dtypes:
            q = dev(rng.standard_normal((int(cu_q[-1]), hk * g, d)), dtype)
            k = dev(rng.standard_normal((int(cu_k[-1]), hk, d)), dtype)
            v = dev(rng.standard_normal((int(cu_k[-1]), hk, 24)), dtype)
            for count_io in (False, True):
                out, lse = fs.gpu.attention_varlen(q, k, v, cu_q, cu_k, count_io=count_io,
                                                   block_sizes=(16, 8), kernel="ref", **var)[:2]
                dout = dev(rng.standard_normal(tuple(out.shape)), dtype)
                fs.gpu.attention_varlen_backward(q, k, v, out, lse, dout, cu_q, cu_k,
                                                 block_sizes=(16, 8), count_io=count_io,
                                                 kernel="ref", deterministic=count_io, **var)
                launches += 4
    return launches + varlen_fast(rng, n_cases, [t for t in dtypes
                                                 if t in ("float16", "bfloat16")])


def walking(rng, dtypes):
    """The copy-engine forward's CTAs walking several tiles each (one CTA per SM; 3 SMs
    pretended, so that 2 × 3 problems of 130 queries put up to 6 tiles in a CTA, in a
    fixed order or, under a band, from the tile counter in chunks of 4 problems and 2):
    plain, softcap, causal and a window, both builds, d = 64 and 128. Elsewhere, none."""
    if fs.gpu._device.cc(0) != 90:
        return 0
    import flashsim.gpu.flash2 as f2
    real, f2._PLANS = fs.gpu._device.num_sms, {}
    chunk_bytes = fs.kernels.WS_CHUNK_BYTES
    fs.gpu._device.num_sms = lambda device: 3
    launches = 0
    try:
        for dtype in dtypes:
            for d in (64, 128):
                q, k, v = (dev(rng.standard_normal((2, 3, n, d)), dtype) for n in (130, 200, 200))
                fs.kernels.WS_CHUNK_BYTES, f2._PLANS = 4 * 200 * 2 * d * 2, {}
                for var in ({}, {"softcap": 10.0}, {"causal": True}, {"window": (50, 20)}):
                    for count_io in (False, True):
                        fs.gpu.attention(q, k, v, count_io=count_io, **var)
                        launches += 1
    finally:
        fs.gpu._device.num_sms, f2._PLANS = real, {}
        fs.kernels.WS_CHUNK_BYTES = chunk_bytes
    return launches


def strided():
    """test_gpu.check_strided on every rung, with and without GQA: slices of a fused QKV
    read in place, dense and packed, forward and both backward modes."""
    sys.path.insert(0, "tests")
    import test_gpu as G
    launches = 0
    for kernel, dtype in (("ref", "float32"), ("tc", "float16"), ("auto", "float16")):
        for hk in (4, 2):
            G.check_strided(kernel, dtype, hk)
            launches += 28
    return launches


def varlen_fast(rng, n_cases, dtypes):
    """Packed batches on the fast rungs' varlen instances (tc, and auto: wg on sm_90):
    lengths 0 and 1, sequences longer than a tile, GQA, the variants, both builds, both
    backward modes."""
    launches = 0
    for case in range(n_cases):
        nq = rng.choice([0, 1, 70, 200], 3)
        nk = rng.choice([0, 1, 90, 260], 3)
        cu_q = np.concatenate([[0], np.cumsum(nq)]).astype(np.int32)
        cu_k = np.concatenate([[0], np.cumsum(nk)]).astype(np.int32)
        d, hk, g = (64, 128)[case % 2], 2, (1, 2)[(case // 2) % 2]
        var = dict(causal=bool(case % 3 == 1),
                   window=None if case % 3 else (int(rng.integers(0, 100)), -1),
                   softcap=None if case % 4 == 3 else float(rng.uniform(1, 20)),
                   alibi_slopes=None if case % 4 == 2 else rng.uniform(0, 0.5, (3, hk * g)))
        for dtype in dtypes:
            q = dev(rng.standard_normal((int(cu_q[-1]), hk * g, d)), dtype)
            k = dev(rng.standard_normal((int(cu_k[-1]), hk, d)), dtype)
            v = dev(rng.standard_normal((int(cu_k[-1]), hk, d)), dtype)
            for count_io in (False, True):
                for kernel in ("tc", "auto"):
                    out, lse = fs.gpu.attention_varlen(q, k, v, cu_q, cu_k, count_io=count_io,
                                                       kernel=kernel, **var)[:2]
                    launches += 1
                dout = dev(rng.standard_normal(tuple(out.shape)), dtype)
                for kernel in ("tc", "auto"):
                    fs.gpu.attention_varlen_backward(q, k, v, out, lse, dout, cu_q, cu_k,
                                                     count_io=count_io, kernel=kernel,
                                                     deterministic=count_io, **var)
                    launches += 3
    return launches


def paper_algorithms(rng, n_cases, dtypes):
    """flash1_ref.cu, standard_ref.cu and square_ref.cu: ragged sizes, GQA, dv ≠ d, tiles
    that do not divide N, a window, softcap and ALiBi, both builds, forward and backward
    (square: forward)."""
    launches = 0
    for case in range(n_cases):
        Nq, Nk = (int(x) for x in rng.choice([1, 7, 33, 65, 130], 2))
        d = int(rng.choice([3, 16, 40, 64]))
        dv, hk, g = int(rng.choice([d, 24])), 2, (1, 2)[case % 2]
        blocks = [None, (16, 32), (7, 5)][case % 3]
        var = [dict(causal=True), dict(window=(int(rng.integers(0, 40)), 3),
                                       softcap=float(rng.uniform(1, 20)),
                                       alibi_slopes=rng.uniform(0, 0.5, (2, hk * g)))][case % 2]
        for dtype in dtypes:
            q = dev(rng.standard_normal((2, hk * g, Nq, d)), dtype)
            k = dev(rng.standard_normal((2, hk, Nk, d)), dtype)
            v = dev(rng.standard_normal((2, hk, Nk, dv)), dtype)
            for algorithm in ("flash1", "standard"):
                for count_io in (False, True):
                    out, lse = fs.gpu.attention(q, k, v, algorithm=algorithm, block_sizes=blocks,
                                                count_io=count_io, **var)[:2]
                    dout = dev(rng.standard_normal(tuple(out.shape)), dtype)
                    fs.gpu.attention_backward(q, k, v, out, lse, dout, algorithm=algorithm,
                                              block_sizes=blocks, count_io=count_io, **var)
                    launches += 2 if algorithm == "flash1" else 10
                # square tiles (forward only): B below d and dv too, so both phases chunk
                for count_io in (False, True):
                    fs.gpu.attention(q, k, v, algorithm="square", count_io=count_io,
                                     block_sizes=None if blocks is None else (blocks[1],) * 2,
                                     **var)
                    launches += 2
    return launches


def decoding(rng, n_cases, dtypes):
    """splitkv_tc.cu: paged and contiguous caches with ragged lengths (0 included),
    appends across page edges, GQA packing into 16-, 32- and 64-row tiles, split or not,
    the parts merged through memory or in a cluster (9.0), both builds."""
    dv = fs.gpu._device
    clusters = dv.cc(dv.cupy().cuda.Device().id) >= 90
    launches = 0
    for case in range(n_cases):
        d = (64, 128)[case % 2]
        batch, kvh = int(rng.integers(1, 4)), int(rng.integers(1, 3))
        g, Nq = (1, 8, 4, 2)[case % 4], (1, 2, 16, 5)[case % 4]
        lens = rng.integers(0, 700, batch).astype(np.int32)
        lens[0] = 0 if case % 3 == 0 else lens[0]
        Nnew = (0, 3)[case % 2]
        for dtype in dtypes:
            for paged in (False, True):
                page = 48
                if paged:
                    max_pages = int(-(-(lens.max() + Nnew) // page)) + 1
                    pages = batch * max_pages + 1
                    table = rng.permutation(pages)[:batch * max_pages].astype(np.int32)
                    table = table.reshape(batch, max_pages)
                    shape = (pages, page, kvh, d)
                else:
                    table, shape = None, (batch, int(lens.max()) + Nnew + 7, kvh, d)
                kc, vc = (dev(rng.standard_normal(shape), dtype) for _ in range(2))
                q = dev(rng.standard_normal((batch, Nq, kvh * g, d)), dtype)
                new = [dev(rng.standard_normal((batch, Nnew, kvh, d)), dtype)
                       for _ in range(2)] if Nnew else [None, None]
                # the merge through memory, and (9.0) in a cluster
                runs = [(1, False), (3, False)]
                if clusters:
                    runs += [(2, True), (8, True)]
                for splits, cluster in runs:
                    for count_io in (False, True):
                        fs.gpu.attention_with_kvcache(
                            q, kc, vc, cache_seqlens=lens, block_table=table, k=new[0],
                            v=new[1], causal=bool(case % 2), num_splits=splits,
                            cluster=cluster, count_io=count_io)
                        launches += 1 + bool(Nnew)
    return launches


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 8))
