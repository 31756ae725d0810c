// flash2_wg.cu: the Hopper rung. The forward of flash2_tc.cu (the same schedule, the same
// visited tiles, so the same traffic) on the warpgroup MMA of sm_90a.
//
//   flash2_fwd_wg<T, D, VAR, VL, CAP_ONLY>  forward, T ∈ {__half, __nv_bfloat16}, D ∈ {32, 64, 96, 128,
//                        160, 192, 224, 256}: head dims d, dv ≤ D, multiples of 8 (the
//                        columns past them zero-filled by the loads and never stored; so
//                        too in the backward below), tiles Br × Bc = 128 × 128 (D = 96,
//                        128), 128 × 64 (D = 32, 64, two CTAs per SM; above 128, P V as
//                        two products per k-step, wgmma.cuh's Parts). Over
//                        flash2_fwd_tc it changes how the
//                        products run:
//                        - wgmma.mma_async m64nNk16: a warpgroup (4 warps) issues one
//                          instruction for a 64 × N × 16 product and the tensor cores run
//                          it without holding the warps' issue slots, where mma.sync
//                          needs one instruction per 16 × 8 × 16 and chains them;
//                        - two warpgroups, 64 query rows each (warps still split along Q:
//                          a warp owns 16 whole rows of S, no inter-warp reduction);
//                        - Q_i and K_j are read by the tensor cores straight from shared
//                          memory (K-major), V_j too (MN-major, the instruction transposes
//                          it), so no ldmatrix; P stays in registers as the A operand;
//                        - shared tiles in the swizzle the tensor cores read (wgmma.cuh's
//                          Cols<D>): column blocks of 64 halves, rows of 128 bytes, 16-byte
//                          chunk c of row r at c ^ (r & 7) (the 128-byte swizzle); at D = 32,
//                          96 and 192 blocks of 32 halves, rows of 64 bytes, c ^ ((r >> 1) & 3)
//                          (the 64-byte one), so that D (at 192 each half of it) is whole
//                          blocks;
//                        - each step issues S_j = Q_i K_jᵀ and O_i += P_{j−1} V_{j−1}
//                          together and waits for S_j alone: the softmax of tile j runs
//                          while the tensor cores do the second product;
//                        - loads as in flash2_tc.cu (16-byte cp.async, K and V
//                          double-buffered), one step ahead: K_{j+1} and V_j stream in
//                          behind step j.
//                        VAR = true is the instance for softcap and ALiBi (scores
//                        finished in log2 units by tensor_core.cuh's VarScores before
//                        the mask); VL = true (with VAR) runs a packed varlen batch from
//                        common.cuh's table of real tiles; windows run on all (the band).
//                        CAP_ONLY = true (with VAR, not VL; kernels.wg_cap): the rules for
//                        m of flash2_ws.cu's softcap instance. In bfloat16 (D ∈
//                        kernels.WG_FIXED_HEAD_DIMS) a softcap ≤ 54.4, with ALiBi or
//                        without, under the fixed max (NOTES v68); in float16 a softcap
//                        without ALiBi under the lazy max (v70; with ALiBi, which the
//                        copy-engine forward runs lazily, diagonal tile first, here the
//                        lazy max measured slower than the online one).
// Needs sm_90a (flashsim.gpu compiles it with NVRTC for that target on a 9.0 device).
// Counts its traffic like the reference under -DFLASHSIM_COUNT_IO.

#include "wg_bwd.cuh"

namespace wg {

// The shipped tiles (flashsim/kernels.py's WG_BLOCKS): two warpgroups (Br = 128); at
// D = 128 Bc = 128, one CTA per SM (189 registers); at D = 64 Bc = 64 and two CTAs per SM
// (108 registers, 49 KB of shared memory each), +9–18% over one CTA of Bc = 128 on an
// H100 (kernels_cu/NOTES.md, v7); D = 32 as 64 (v20: +6–12% over Bc = 128 with two CTAs,
// +19–22% over one), D = 96 as 128 (at 128 registers, two CTAs' bound, it spills). The
// macros override them for tuning (0 = the default).
#ifndef FLASHSIM_WG_WARPGROUPS
#define FLASHSIM_WG_WARPGROUPS 2
#endif
#ifndef FLASHSIM_WG_BC
#define FLASHSIM_WG_BC 0
#endif
#ifndef FLASHSIM_WG_MINB
#define FLASHSIM_WG_MINB 0
#endif
constexpr int WARPGROUPS = FLASHSIM_WG_WARPGROUPS, THREADS = 128 * WARPGROUPS, Br = 64 * WARPGROUPS;
// (D = 192, 256: 64 keys, so that S (32 registers) fits beside O (96, 128))
template <int D> __host__ __device__ constexpr int bc() { return FLASHSIM_WG_BC ? FLASHSIM_WG_BC : (D == 96 || D == 128 ? 128 : 64); }
template <int D> __host__ __device__ constexpr int min_blocks() { return FLASHSIM_WG_MINB ? FLASHSIM_WG_MINB : (D < 96 ? 2 : 1); }

// rows [0, valid) of a ROWS × D tile (global: rows ld elements apart, `width` ≤ D
// contiguous; the instance's columns past a smaller head dim are zero-filled) into
// wgmma.cuh's Cols<D> layout, 16 bytes per thread per pass. Where the D/8 chunks of a row
// divide the threads, a thread keeps its chunk column in every pass (THREADS / (D/8) rows
// per pass, a multiple of 8, so its swizzle is fixed too); else (D = 96: 12 chunks) each
// chunk's row and column come from its index.
template <typename T, int D, int ROWS>
__device__ __forceinline__ void load_tile(unsigned s, const T* g, int ld, int valid, int width) {
    using CL = Cols<D>;
    constexpr int CH = D / 8, CPB = CL::W / 8;       // 16-byte chunks per row, per block row
    unsigned tid;
    asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(tid));
    if constexpr (THREADS % CH == 0) {
        constexpr int RPI = THREADS / CH;
        static_assert(RPI % 8 == 0, "a pass must cover whole 8-row groups");
        const int c = tid % CH, r0 = tid / CH;
        const bool in = c * 8 < width;               // width: a multiple of 8
        const unsigned dst = s + (c / CPB) * (ROWS * CL::RB) + r0 * CL::RB + (((c % CPB) ^ CL::swz(r0)) << 4);
#pragma unroll
        for (int it = 0; it < (ROWS + RPI - 1) / RPI; ++it) {
            const int r = r0 + it * RPI;
            if (ROWS % RPI != 0 && r >= ROWS) break; // only when the passes overshoot
            const bool ok = r < valid && in;
            cp_async16(dst + it * RPI * CL::RB, g + (ok ? r * ld + c * 8 : 0), ok);
        }
    } else {
        static_assert(ROWS * CH % THREADS == 0, "whole passes");
#pragma unroll
        for (int it = 0; it < ROWS * CH / THREADS; ++it) {
            const int x = tid + it * THREADS, r = x / CH, c = x % CH;
            const bool ok = r < valid && c * 8 < width;
            cp_async16(s + (c / CPB) * (ROWS * CL::RB) + r * CL::RB + (((c % CPB) ^ CL::swz(r)) << 4),
                       g + (ok ? r * ld + c * 8 : 0), ok);
        }
    }
}


}  // namespace wg

template <typename T, int D, bool VAR, bool VL, bool CAP_ONLY>
__global__ void __launch_bounds__(wg::THREADS, wg::min_blocks<D>())
flash2_fwd_wg(const T* __restrict__ Q, const T* __restrict__ K, const T* __restrict__ V,
              const long long* __restrict__ at, T* __restrict__ O, float* __restrict__ L,
              int Nq, int Nk, int ldq, int ldk, int ldv, int ldo, int d, int dv, int left, int right,
              float scale_log2, float k_in, float k_out,
              const float* __restrict__ slopes, const int* __restrict__ vl,
              unsigned long long* io) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using namespace wg;
    static_assert(D % 32 == 0 && D <= 256, "head dims: multiples of 32 up to 256");
    using CL = Cols<D>;
    constexpr int Bc = bc<D>();
    extern __shared__ unsigned char smem_raw[];
    // the swizzle is a function of the address bits, so tiles start on 1024 bytes
    const unsigned base = (smem_addr(smem_raw) + 1023) & ~1023u;
    const unsigned sQ = base;                        // Br·D
    const unsigned sK = sQ + Br * D * 2;             // 2 buffers of Bc·D
    const unsigned sV = sK + 2 * Bc * D * 2;         // 2 buffers of Bc·D

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, grp = warp >> 2;
    const int g = lane >> 2, tig = lane & 3;
    // the last Q tiles first: under a causal mask they see the most keys. VL (a packed
    // varlen batch): the tile is sequence sq.b's, its rows from sq.q0 (sq.k0) within Q's
    // (K's) problem p of Nq (Nk) rows; nq, nk its lengths (dense: Nq, Nk)
    const int p = blockIdx.y;
    const Seq sq = seq_at<VL>(vl, gridDim.x - 1 - blockIdx.x, Nq, Nk, Br);
    const int i = sq.tile, nq = sq.Nq, nk = sq.Nk;
    const int i0 = i * Br, rows = min(Br, nq - i0);
    const long long q_row = (long long)p * Nq + sq.q0 + i0;     // of L
    // the sequence's first key in K_p and V_p (strided: common.cuh's at table)
    const T* Kp = K + at_row0(at, p, AT_K) + sq.k0 * (long long)ldk;
    const T* Vp = V + at_row0(at, p, AT_V) + sq.k0 * (long long)ldv;
    // VL: the loop reads them from shared memory (after its barriers); in registers they
    // made the d = 64 varlen build spill under its 128-register bound
    __shared__ const T* s_kv[2];
    if (VL && threadIdx.x == 0) {
        s_kv[0] = Kp;
        s_kv[1] = Vp;
    }
    const Band band{left, right, nk - nq};
    int jlo, jhi;
    band.kv_range(i0, i0 + rows, nk, Bc, &jlo, &jhi);
    // VAR: the scores in log2 units over VarScores::scale(), the exponent's multiplier
    const float sl2 = VAR ? VarScores{k_in, k_out, 0.f}.scale() : scale_log2;
    // the softcap instance in float16 (CAP_ONLY, a softcap without ALiBi): the lazy max of
    // flash2_ws.cu's (softmax_lazy; NOTES v70)
    constexpr bool LAZY = VAR && CAP_ONLY && !IsBf16<T>::value;

    if (jhi < jlo) {                                 // no key visible: O_i = 0, L_i = −∞
        fwd_tile_unseen<T, THREADS>(O + at_row0(at, p, AT_O) + (sq.q0 + i0) * (long long)ldo, ldo,
                                    L + q_row, rows, dv, io);
        return;
    }
    fwd_tile_count<T>(io, rows, jlo, jhi, Bc, nk, d, dv);

    float o[D / 2];                                  // O_i: this warpgroup's 64 × D, fp32
    float s[Bc / 2];                                 // S = Q_i K_jᵀ (then P in fp32): 64 × Bc
    unsigned pf[Bc / 16][4];                         // P in T: the A operand of P V_j
    // the softcap instance (CAP_ONLY, where kernels.cap_only and wg_cap say), in bfloat16:
    // the fixed max of flash2_fwd_ws's (tensor_core.cuh's cap_fixed_m; with ALiBi per row,
    // fixed_m_alibi): no row max, α or rescale of O (NOTES v68)
    // (in float16 the lazy max: LAZY above)
    constexpr bool FIXED = VAR && CAP_ONLY && IsBf16<T>::value;
    const int r0 = grp * 64 + (warp & 3) * 16 + g;   // this thread's rows r0, r0 + 8 in the tile
    float m0 = FIXED ? cap_fixed_m(k_out) : neg_inf<float>(), m1 = m0;   // running max (log2 domain), rows g, g + 8
    // (FIXED: the slope read once; read at each step, a predicate register spilled)
    const float slope_p = FIXED && slopes != nullptr ? slopes[(VL ? sq.b * gridDim.y : 0) + p] : 0.f;
    if (FIXED && slope_p != 0.f) {
        m0 = fixed_m_alibi(m0, k_out * slope_p, i0 + r0, nk, band);
        m1 = fixed_m_alibi(m1, k_out * slope_p, i0 + r0 + 8, nk, band);
    }
    float l0 = 0.f, l1 = 0.f;                        // partial row sums of this thread
#pragma unroll
    for (int x = 0; x < D / 2; ++x) o[x] = 0.f;

    // S = Q_i K_jᵀ from K buffer kb: D/16 instructions of 64 × Bc × 16, the first
    // overwriting S; committed as one group
    auto issue_s = [&](unsigned kb) {
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            // the VAR instance (which runs head dims below D) stops at d: its columns past
            // d are zeros (d ≥ 8: the first step, which sets S, always runs)
            if (VAR && kk > 0 && kk * 16 >= d) break;
            const unsigned blk = kk / CL::KSTEPS;    // the column block, and 16 columns =
            const unsigned step = (kk % CL::KSTEPS) << 5;   // 32 bytes into it per k-step
            const unsigned long long da = desc(sQ + blk * (Br * CL::RB) + grp * 64 * CL::RB + step, 16, CL::SBO, CL::MODE);
            const unsigned long long db = desc(kb + blk * (Bc * CL::RB) + step, 16, CL::SBO, CL::MODE);
            Wgmma<T, Bc>::ss(s, da, db, kk > 0);
        }
        wgmma_commit();
    };
    // O_i += P V_j from V buffer vb: Bc/16 instructions of 64 × D × 16, one group (D >
    // 128: two per step, 64 × H0 × 16 and 64 × H1 × 16 on V's column blocks of either part
    // (wgmma.cuh's Parts), into O's registers 0 … H0/2 − 1 and H0/2 … D/2 − 1, which
    // wg_store_o reads as one product of D columns)
    auto issue_pv = [&](unsigned vb) {
#pragma unroll
        for (int kk = 0; kk < Bc / 16; ++kk) {
            if constexpr (D > 128) {
                using PT = Parts<D>;
                Wgmma<T, PT::H0>::rs(o, pf[kk], desc(vb + kk * 16 * CL::RB, Bc * CL::RB, CL::SBO, CL::MODE));
                Wgmma<T, PT::H1>::rs(o + PT::H0 / 2, pf[kk], desc(vb + PT::B0 * (Bc * CL::RB) + kk * 16 * CL::RB,
                                                                  Bc * CL::RB, CL::SBO, CL::MODE));
            } else {
                Wgmma<T, D>::rs(o, pf[kk], desc(vb + kk * 16 * CL::RB, Bc * CL::RB, CL::SBO, CL::MODE));
            }
        }
        wgmma_commit();
    };
    // the online softmax of tile j on S (wgmma.cuh's wg_softmax), and P to T
    auto softmax = [&](int j, float& a0, float& a1) {
        wg_softmax<Bc, Br, VAR, FIXED>(s, m0, m1, l0, l1, a0, a1, j * Bc, i0, r0, tig, nq, nk, band,
                                sl2, k_in, k_out, FIXED ? slope_p : VAR && slopes != nullptr ? slopes[(VL ? sq.b * gridDim.y : 0) + p] : 0.f);
    };
    auto pack_p = [&]() { wg_pack_p<T, Bc>(s, pf); };
    // (flashsim launches it without slopes, kernels.wg_cap; with them it would still be
    // right, in key order, which v65 measured slow)
    const float slope_l = LAZY && slopes != nullptr ? slopes[p] : 0.f;
    auto lazy_step = [&](int j, float& a0, float& a1) {
        softmax_lazy<T, Bc>(s, pf, m0, m1, l0, l1, a0, a1, sl2);
    };
    // the lazy step's scores (the softcap's tanh, the mask), finished in s alone, which
    // P_{j−1} V_{j−1} does not touch: they run beside that product (NOTES v62)
    auto scores = [&](int j) {
        wg_scores<Bc, Br, VAR>(s, j * Bc, i0, r0, tig, nq, nk, band, k_in, k_out, slope_l);
    };

    // The loop overlaps the softmax of tile j with the tensor cores' O_i += P_{j−1} V_{j−1}:
    // each step issues S_j = Q_i K_jᵀ and that product, waits for S_j only, runs the
    // softmax while the second product runs, then waits for it and scales O_i. Loads run
    // one step ahead: K_j and V_{j−1} are waited for at the top of step j, behind which
    // K_{j+1} and V_j stream in. Buffers: K_j and V_j in (j − jlo) & 1.
    load_tile<T, D, Br>(sQ, Q + at_row0(at, p, AT_Q) + (sq.q0 + i0) * (long long)ldq, ldq, rows, d);   // HBM→SRAM: Q_i (Br·d)
    {
        const int j0 = jlo * Bc;
        load_tile<T, D, Bc>(sK, Kp + (long long)j0 * ldk, ldk, min(Bc, nk - j0), d);   // HBM→SRAM: K_j (Bc·d)
    }
    cp_async_commit();
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();
    {
        const int j0 = jlo * Bc;
        load_tile<T, D, Bc>(sV, Vp + (long long)j0 * ldv, ldv, min(Bc, nk - j0), dv);   // HBM→SRAM: V_j (Bc·dv)
        if (jlo < jhi)
            load_tile<T, D, Bc>(sK + Bc * D * 2, Kp + (long long)(j0 + Bc) * ldk, ldk, min(Bc, nk - j0 - Bc), d);
        cp_async_commit();
    }
    wgmma_fence();
    issue_s(sK);
    wgmma_wait<0>();
    fence_regs<Bc / 2>(s);
    {
        float a0, a1;                                // O_i is still 0: nothing to scale
        softmax(jlo, a0, a1);
    }
    pack_p();

    for (int j = jlo + 1; j <= jhi; ++j) {
        const int buf = (j - jlo) & 1;
        cp_async_wait<0>();                          // K_j, V_{j−1} landed (this thread's part)
        fence_proxy_async();
        __syncthreads();                             // ... every thread's; and the buffers of
                                                     // step j − 2 are read by everyone
        {
            const int j0 = j * Bc;
            load_tile<T, D, Bc>(sV + buf * Bc * D * 2, (VL ? s_kv[1] : Vp) + (long long)j0 * ldv, ldv, min(Bc, nk - j0), dv);   // HBM→SRAM: V_j (Bc·dv)
            if (j < jhi)                             // HBM→SRAM: K_{j+1} (Bc·d)
                load_tile<T, D, Bc>(sK + (buf ^ 1) * Bc * D * 2, (VL ? s_kv[0] : Kp) + (long long)(j0 + Bc) * ldk, ldk, min(Bc, nk - j0 - Bc), d);
            cp_async_commit();
        }
        fence_regs<Bc / 2>(s);
        fence_regs<D / 2>(o);
        wgmma_fence();
        issue_s(sK + buf * Bc * D * 2);
        issue_pv(sV + (buf ^ 1) * Bc * D * 2);
        wgmma_wait<1>();                             // S_j is done, P_{j−1} V_{j−1} may run on
        fence_regs<Bc / 2>(s);
        float a0, a1;
        if constexpr (LAZY) {
            scores(j);                               // beside P_{j−1} V_{j−1}
            wgmma_wait<0>();                         // P_j goes straight to pf: the product
            fence_regs<D / 2>(o);                    // must have read P_{j−1}
#pragma unroll
            for (int kk = 0; kk < Bc / 16; ++kk)
                asm volatile("" : "+r"(pf[kk][0]), "+r"(pf[kk][1]), "+r"(pf[kk][2]), "+r"(pf[kk][3]));
            lazy_step(j, a0, a1);
            if (!__all_sync(0xffffffffu, a0 == 1.f && a1 == 1.f)) {   // a warp that moved m
#pragma unroll
                for (int t = 0; t < D / 8; ++t) {
                    o[4 * t] *= a0; o[4 * t + 1] *= a0; o[4 * t + 2] *= a1; o[4 * t + 3] *= a1;
                }
            }
            continue;
        }
        softmax(j, a0, a1);
        wgmma_wait<0>();
        fence_regs<D / 2>(o);
#pragma unroll
        for (int kk = 0; kk < Bc / 16; ++kk)         // the product has read P_{j−1}: only now
            asm volatile("" : "+r"(pf[kk][0]), "+r"(pf[kk][1]), "+r"(pf[kk][2]), "+r"(pf[kk][3]));
        if constexpr (!FIXED) {                      // (FIXED: α = 1)
#pragma unroll
            for (int t = 0; t < D / 8; ++t) {
                o[4 * t] *= a0; o[4 * t + 1] *= a0; o[4 * t + 2] *= a1; o[4 * t + 3] *= a1;
            }
        }
        pack_p();
    }
    cp_async_wait<0>();                              // V_jhi landed
    fence_proxy_async();
    __syncthreads();
    fence_regs<D / 2>(o);
    wgmma_fence();
    issue_pv(sV + ((jhi - jlo) & 1) * Bc * D * 2);
    wgmma_wait<0>();
    fence_regs<D / 2>(o);

    // finish: reduce ℓ over the quad, divide once, write O_i and L_i
    T* Oi = O + at_row0(at, p, AT_O) + (sq.q0 + i0) * (long long)ldo;
    wg_store_o16<T, D, Br>(o, sQ, Oi, ldo, L + q_row, l0, l1, m0, m1, r0, lane, tig, rows, dv);
#else
    // built for a target without wgmma: flashsim.gpu launches this kernel only on sm_90a
    __trap();
#endif
}

// flash2_bwd_wg<T, D, VAR, VL>, flash2_bwd_wg_det<T, D, VAR, VL>: the backward main loop
// on warpgroup MMAs (the pre-pass is flash2_tc.cu's flash2_bwd_preprocess_tc, the
// post-pass the reference's). The schedule, tiles and traffic of flash2_bwd_tc: K/V-outer,
// one CTA per K/V tile j of Bc = 128 keys (64 above D = 128), the visited Q tiles streaming
// through shared memory (double-buffered, 16-byte cp.async) in steps of BrB queries (128
// at D = 32 and 64, 64 above). Head dims D ∈ {32, 64, 128, 160, 192, 224, 256}. Two warpgroups, 64 keys each: dK_j and dV_j of its
// keys stay in a warpgroup's registers (wgmma accumulators) for the whole loop; above 128
// both warpgroups take all 64 keys and split the columns (wg_bwd.cuh's step_wide). A
// step's products and elementwise work are wg_bwd.cuh's (step shared with flash2_ws.cu's
// flash2_bwd_ws, which loads by TMA).
// mma.sync needs ldmatrix for every fragment of the five products and 8 warps to keep
// the tensor cores fed; here the tensor cores read shared memory themselves and the
// warps only run the elementwise work and the atomics.
template <typename T, int D, bool DET, bool VAR, bool VL>
__device__ __forceinline__ void
bwd_wg(FLASHSIM_BWD_PARAMS) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using namespace wg;
    static_assert(D % 32 == 0 && D <= 256, "head dims: multiples of 32 up to 256");
    static_assert(wg::THREADS == wgb::THREADS, "load_tile's passes assume two warpgroups");
    constexpr int Bc = wgb::bc<D>(), BrB = wgb::brb<D>();
    constexpr bool WIDE = D > 128;                   // wg_bwd.cuh's step_wide: columns split
    constexpr int ACC = WIDE ? Parts<D>::H0 / 2 : D / 2;   // a thread's share of dK_j, of dV_j
    constexpr float LOG2E = 1.4426950408889634f;
    extern __shared__ unsigned char smem_raw[];
    const unsigned base = (smem_addr(smem_raw) + 1023) & ~1023u;
    const unsigned sK = base;                        // Bc·D, Cols<D>: D/W column blocks of Bc rows
    const unsigned sV = sK + Bc * D * 2;             // Bc·D
    const unsigned sQ = sV + Bc * D * 2;             // 2 × BrB·D
    const unsigned sdO = sQ + 2 * BrB * D * 2;       // 2 × BrB·D
    const unsigned sdS = sdO + 2 * BrB * D * 2;      // dSᵀ: Bc keys × BrB queries (BrB/64 blocks)
    const unsigned sP = sdS + Bc * BrB * 2;          // WIDE: Pᵀ, laid out as dSᵀ
    float* sL = reinterpret_cast<float*>(smem_raw + (sP + (WIDE ? Bc * BrB * 2 : 0) - smem_addr(smem_raw)));   // 2 × BrB, L·log2(e)
    float* sD = sL + 2 * BrB;                                                                     // 2 × BrB

    const int tid = threadIdx.x;
    // deterministic mode takes the tiles from the last (flash2_bwd_tc's order and turns)
    const int p = blockIdx.y;
    const Seq sq = seq_at<VL>(vl, DET ? gridDim.x - 1 - blockIdx.x : blockIdx.x, Nq, Nk, BrB);
    const int j = sq.tile, nq = sq.Nq, nk = sq.Nk;
    const int j0 = j * Bc, cols = min(Bc, nk - j0);
    const Band band{left, right, nk - nq};
    int ilo, ihi;                                    // visited Q tiles, in units of BrB rows
    band.q_range(j0, j0 + cols, nq, BrB, &ilo, &ihi);
    const wgb::Tile tile{sK, sV, j0, cols, nq, nk, band};

    float dv_acc[ACC], dk_acc[ACC];                  // dV_j, dK_j of the warpgroup's 64 keys (WIDE: its columns)
#pragma unroll
    for (int x = 0; x < ACC; ++x) dv_acc[x] = dk_acc[x] = 0.f;

    // the sequence's first rows in Q_p and dO_p, read back from shared memory in the loop
    // (flash2_bwd_tc: held in registers across it they spill)
    __shared__ const T* s_qdo[2];
    if (tid == 0) {
        s_qdo[0] = Q + at_row0(at, p, AT_Q) + sq.q0 * (long long)ldq;
        s_qdo[1] = dO + at_row0(at, p, AT_dO) + sq.q0 * (long long)lddo;
    }
    // late (WIDE, in the loop): L_i, D_i of row tid (< BrB ≤ THREADS) read into *late and
    // stored by store_ld at the end of the step before, so that no warp waits on the
    // global loads before its step's products (warpgroup 0's would hold both warpgroups
    // there): +2–8% at d = 160–256 on an H100 (kernels_cu/NOTES.md v25.1); at D = 64 the two
    // registers held across the step cost 5–10%, so the narrow step stores them at once
    static_assert(BrB <= wgb::THREADS, "a row of L, D per thread");
    auto load_q_step = [&](int i, int buf, const T* Qs, const T* dOs, float2* late) {
        const int i0 = i * BrB, rows = min(BrB, nq - i0);
        const long long q_row = (long long)p * Nq + sq.q0 + i0;      // of L, D
        load_tile<T, D, BrB>(sQ + buf * BrB * D * 2, Qs + (long long)i0 * ldq, ldq, rows, d);     // HBM→SRAM: Q_i (Br·d)
        load_tile<T, D, BrB>(sdO + buf * BrB * D * 2, dOs + (long long)i0 * lddo, lddo, rows, dv); // HBM→SRAM: dO_i (Br·dv)
        // L·log2(e), and +∞ for rows past Nq and rows that see no key (L = −∞): there
        // 2^(s − ∞) = 0 makes P, and so dS, zero without a per-element test
        if (late == nullptr) {
            for (int r = tid; r < BrB; r += THREADS) {
                const float l = r < rows ? L[q_row + r] : neg_inf<float>();         // HBM→SRAM: L_i (Br)
                sL[buf * BrB + r] = l == neg_inf<float>() ? -neg_inf<float>() : l * LOG2E;
                sD[buf * BrB + r] = r < rows ? Dv[q_row + r] : 0.f;                 // HBM→SRAM: D_i (Br)
            }
        } else if (tid < BrB) {
            late->x = tid < rows ? L[q_row + tid] : neg_inf<float>();                // HBM→SRAM: L_i (Br)
            late->y = tid < rows ? Dv[q_row + tid] : 0.f;                            // HBM→SRAM: D_i (Br)
        }
        cp_async_commit();
    };
    auto store_ld = [&](int buf, float2 ld) {
        if (tid < BrB) {
            sL[buf * BrB + tid] = ld.x == neg_inf<float>() ? -neg_inf<float>() : ld.x * LOG2E;
            sD[buf * BrB + tid] = ld.y;
        }
    };
    auto slope = [&]() {
        return slopes != nullptr ? slopes[(VL ? seq_again<VL>(vl, DET, Nq, Nk, BrB).b * gridDim.y : 0) + opaque_ctaid_y()] : 0.f;
    };
    auto wait = [&](int i, int rows) {
        wgb::Turn t{nullptr, 0};
        t.counter = dq_turn<DET, VL>(sem, vl, p, Nq, Nk, BrB, Bc, i, j, rows, nk, band, &t.mine);
        if constexpr (DET) wait_turn(t.counter, t.mine);
        return t;
    };
    auto pass = [&](wgb::Turn t) {
        if constexpr (DET) pass_turn(t.counter, t.mine);   // tile j − 1 adds next
    };

    if (ihi >= ilo) {
        load_tile<T, D, Bc>(sK, K + at_row0(at, p, AT_K) + (sq.k0 + j0) * (long long)ldk, ldk, cols, d);   // HBM→SRAM: K_j (Bc·d)
        load_tile<T, D, Bc>(sV, V + at_row0(at, p, AT_V) + (sq.k0 + j0) * (long long)ldv, ldv, cols, dv);   // HBM→SRAM: V_j (Bc·dv)
        cp_async_commit();
        __syncthreads();                             // s_qdo
        load_q_step(ilo, 0, s_qdo[0], s_qdo[1], nullptr);
    }
    for (int i = ilo; i <= ihi; ++i) {
        const int buf = (i - ilo) & 1;
        // step i's tiles have landed and every warp is done with step i − 1 (its buffers,
        // dSᵀ): step i + 1 may stream in
        cp_async_wait<0>();
        fence_proxy_async();
        __syncthreads();
        float2 ld = make_float2(0.f, 0.f);
        if (i < ihi) load_q_step(i + 1, buf ^ 1, s_qdo[0], s_qdo[1], WIDE ? &ld : nullptr);
        if constexpr (WIDE)
            wgb::step_wide<T, D, VAR, 0, 1>(tile, (long long)p * Nq + sq.q0, i, sQ + buf * BrB * D * 2, sdO + buf * BrB * D * 2,
                                            sdS, sP, sL + buf * BrB, sD + buf * BrB, dv_acc, dk_acc, scale, k_in, k_out,
                                            dQacc, d, slope, [] {}, wait, pass);
        else
            wgb::step<T, D, VAR, 0, 1>(tile, (long long)p * Nq + sq.q0, i, sQ + buf * BrB * D * 2, sdO + buf * BrB * D * 2, sdS,
                                    sL + buf * BrB, sD + buf * BrB, dv_acc, dk_acc, scale, k_in, k_out,
                                    dQacc, d, slope, [] {}, wait, pass);
        if (WIDE && i < ihi) store_ld(buf ^ 1, ld);  // published by the next step's barrier
    }
    // the traffic, counted once after the loop, as flash2_bwd_tc's
    if (ihi >= ilo) bwd_tile_count<T>(io, cols, min(nq, (ihi + 1) * BrB) - ilo * BrB, d, dv);

    // dK_j = scale · Σ dSᵀ Q, dV_j = Σ Pᵀ dO, per query problem (GQA sums later)
    T* dKj = dK + at_row0_here(at, opaque_ctaid_y(), AT_dK) + (sq.k0 + j0) * (long long)lddk;
    T* dVj = dV + at_row0_here(at, opaque_ctaid_y(), AT_dV) + (sq.k0 + j0) * (long long)lddv;
    if constexpr (WIDE) wgb::store_dkv_wide<T, D, 0>(tile, dk_acc, dv_acc, dKj, dVj, lddk, lddv, d, dv, scale);
    else wgb::store_dkv<T, D, 0>(tile, dk_acc, dv_acc, dKj, dVj, lddk, lddv, d, dv, scale);
    COUNT_IO(io, IO_dK_W, (long long)cols * d * sizeof(T));       // SRAM→HBM: dK_j (Bc·d)
    COUNT_IO(io, IO_dV_W, (long long)cols * dv * sizeof(T));      // SRAM→HBM: dV_j (Bc·dv)
#else
    __trap();
#endif
}

// dQ by unordered fp32 atomics (sem is not read; pass a null pointer)
template <typename T, int D, bool VAR, bool VL>
__global__ void __launch_bounds__(wgb::THREADS, 1) flash2_bwd_wg(FLASHSIM_BWD_PARAMS) {
    bwd_wg<T, D, false, VAR, VL>(FLASHSIM_BWD_ARGS);
}

// dQ in turns, the same bits on every run (sem: one zeroed int per (problem, step))
template <typename T, int D, bool VAR, bool VL>
__global__ void __launch_bounds__(wgb::THREADS, 1) flash2_bwd_wg_det(FLASHSIM_BWD_PARAMS) {
    bwd_wg<T, D, true, VAR, VL>(FLASHSIM_BWD_ARGS);
}
