// wg_bwd.cuh: one step of the Hopper backward's main loop, shared by flash2_wg.cu's
// flash2_bwd_wg (its consumers load the tiles with cp.async) and flash2_ws.cu's
// flash2_bwd_ws (a producer warpgroup loads them with TMA): the products, the
// elementwise work and dQ's additions of one step of BrB queries against the CTA's K/V
// tile of Bc keys, which two warpgroups of 64 keys each share (above D = 128, step_wide
// below: 64 keys, the warpgroups splitting the columns). The tiles of K_j, V_j, Q_i, dO_i
// lie as wgmma.cuh's Cols<D> (D = 32: one 32-column block, the 64-byte swizzle). Per step:
//   1. Sᵀ = K_j Q_iᵀ and dPᵀ = V_j dO_iᵀ: A and B from shared memory (K-major), 64 keys ×
//      BrB queries per warpgroup, two commit groups;
//   2. once Sᵀ is done: Pᵀ = 2^(Sᵀ·scale·log2e − L·log2e) in registers, and at once
//      dV_j += Pᵀ dO_i (A = Pᵀ from registers: the accumulator layout is the A layout;
//      B = dO_i MN-major), which runs while the warps wait for dPᵀ;
//   3. dSᵀ = Pᵀ ∘ (dPᵀ − D), then dK_j += dSᵀ Q_i the same way, and dSᵀ into shared
//      memory (the 128-byte swizzle) for
//   4. dQ_i = dS K_j after a barrier of the two warpgroups (each needs every key's dS):
//      A = dSᵀ MN-major (the instruction transposes it), B = K_j MN-major; each
//      warpgroup one 64 × 64 block of dQ_i (D = 128: its half of the columns; D = 64: its
//      half of the queries; D = 32: its half of the queries, 64 × 32), added to the fp32 accumulator with two-float atomics (in
//      turns where the caller's wait/pass order them), or stored to shared memory for
//      the caller to add (flash2_bwd_ws: a bulk reduce-add).

#pragma once
#include "wgmma.cuh"

namespace wgb {
constexpr int Bc = 128, THREADS = 256;               // keys per CTA (D ≤ 128); the two warpgroups' threads
template <int D> __host__ __device__ constexpr int brb() { return D <= 64 ? 128 : 64; }
// keys per CTA: above 128 a warpgroup's dK_j, dV_j of 64 keys would take D registers per
// thread, so the CTA takes 64 keys and the warpgroups split their columns (step_wide)
template <int D> __host__ __device__ constexpr int bc() { return D > 128 ? 64 : Bc; }

// What a CTA's steps share: its K/V tile in shared memory and where its rows are
struct Tile {
    unsigned sK, sV;        // K_j, V_j: D/W column blocks of Bc rows (Cols<D>)
    int j0, cols;           // first key of the tile, keys in it (< Bc: the last tile)
    int nq, nk;             // the sequence's lengths
    Band band;
};

// The thread's place: warpgroup (0, 1: of the two that share the tile; WG0 warpgroups
// before them in the CTA), warp within it, lane. Read from %tid.x where used: held across
// the loop they cost registers an instance at 255 does not have.
template <int WG0> struct Thread {
    int grp, warp, lane;
    __device__ __forceinline__ Thread() {
        unsigned tid;
        asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(tid));
        grp = (int)(tid >> 7) - WG0, warp = (tid >> 5) & 3, lane = tid & 31;
    }
    __device__ __forceinline__ int key() const { return grp * 64 + warp * 16 + (lane >> 2); }
};

// One step: queries i·BrB … of the sequence, whose Q_i, dO_i are at qb, dob (D/64 blocks
// of BrB rows), L_i·log2(e) (+∞ for rows past Nq and rows that see no key) at sLb and D_i
// at sDb; dSᵀ goes through sdS (Bc keys × BrB queries), which no warpgroup may still be
// reading from the step before (the caller's barriers or buffers see to it). dv_acc,
// dk_acc: the warpgroup's dV_j, dK_j. slope(): the ALiBi slope (VAR), read per step.
// read(): called once this warpgroup's products have read Q_i and dO_i (and L_i, D_i).
// wait(i, rows) before the step's atomics into dQacc, pass(its Turn) after them: the
// caller's order of the K/V tiles' additions (the deterministic mode), or none.
// SDQ: dQ_i goes instead into shared memory at sdQ (fp32, common.cuh's dq_tiled_at order,
// as the copy engine adds it to dQacc in one bulk reduce-add), for the caller to add; wait
// and pass then bracket those stores.
struct Turn { int* counter; int mine; };

// step_wide's products of one part (HP columns, from column block b0) of dV_j, dK_j, dQ_i:
// a function of HP, not a generic lambda (NVRTC compiles no lambda templates in device code)
template <typename T, int D, int HP>
__device__ __forceinline__ void wide_products(float* dv_acc, float* dk_acc, float* dq, unsigned sP,
                                              unsigned sdS, unsigned dob, unsigned qb, unsigned sK,
                                              unsigned b0) {
    using namespace wg;
    using CL = Cols<D>;
    constexpr int BrB = brb<D>(), Bc = bc<D>();
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BrB / 16; ++kk)
        Wgmma<T, HP>::template ss<0, 1>(dv_acc, desc(sP + (kk << 5), 16, 1024),
                                        desc(dob + b0 * (BrB * CL::RB) + kk * 16 * CL::RB, BrB * CL::RB, CL::SBO, CL::MODE), 1);
    wgmma_commit();
#pragma unroll
    for (int kk = 0; kk < BrB / 16; ++kk)
        Wgmma<T, HP>::template ss<0, 1>(dk_acc, desc(sdS + (kk << 5), 16, 1024),
                                        desc(qb + b0 * (BrB * CL::RB) + kk * 16 * CL::RB, BrB * CL::RB, CL::SBO, CL::MODE), 1);
    wgmma_commit();
#pragma unroll
    for (int kk = 0; kk < Bc / 16; ++kk)
        Wgmma<T, HP>::template ss<1, 1>(dq, desc(sdS + kk * 16 * 128, Bc * 128, 1024),
                                        desc(sK + b0 * (Bc * CL::RB) + kk * 16 * CL::RB, Bc * CL::RB, CL::SBO, CL::MODE), kk > 0);
    wgmma_commit();
}
// step's parts: 1. Sᵀ = K_j Q_iᵀ (step_s) and dPᵀ = V_j dO_iᵀ (step_dp), 64 keys × BrB
// queries, k = D, a commit group each; 2.–4. (step_mid); dQ_i's additions (step_dq). Each
// wgmma's descriptors are the operand tile's, computed once per group, plus an immediate
// (desc_plus): built per instruction, they cost ~200 of the ~970 instructions a consumer
// warp issued per step (NOTES v38)
template <typename T, int D, int WG0>
__device__ __forceinline__ void step_s(const Thread<WG0>& th, const Tile& c, unsigned qb, float* s) {
    using namespace wg;
    using CL = Cols<D>;                              // W = 64 (D = 64, 128), 32 (D = 32)
    constexpr int BrB = brb<D>();
    const unsigned long long dk = desc(c.sK + th.grp * 64 * CL::RB, 16, CL::SBO, CL::MODE),
                             dq = desc(qb, 16, CL::SBO, CL::MODE);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const unsigned blk = kk / CL::KSTEPS, stp = (kk % CL::KSTEPS) << 5;   // 16 columns: 32 bytes
        Wgmma<T, BrB>::ss(s, desc_plus(dk, blk * (Bc * CL::RB) + stp), desc_plus(dq, blk * (BrB * CL::RB) + stp), kk > 0);
    }
    wgmma_commit();
}
template <typename T, int D, int WG0>
__device__ __forceinline__ void step_dp(const Thread<WG0>& th, const Tile& c, unsigned dob, float* dp) {
    using namespace wg;
    using CL = Cols<D>;
    constexpr int BrB = brb<D>();
    const unsigned long long dv = desc(c.sV + th.grp * 64 * CL::RB, 16, CL::SBO, CL::MODE),
                             ddo = desc(dob, 16, CL::SBO, CL::MODE);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const unsigned blk = kk / CL::KSTEPS, stp = (kk % CL::KSTEPS) << 5;
        Wgmma<T, BrB>::ss(dp, desc_plus(dv, blk * (Bc * CL::RB) + stp), desc_plus(ddo, blk * (BrB * CL::RB) + stp), kk > 0);
    }
    wgmma_commit();
}
// dQ_i's block of the warpgroup: queries (qblk) and columns (nblk); QN columns or queries
template <int D> struct DqBlock {
    static constexpr int QB = brb<D>() / 64;         // query blocks: the warpgroups split
    static constexpr int QN = D < 64 ? D : 64;       // queries (D ≤ 64) or columns (D = 128)
};
// 2.–4. up to dQ_i's product, issued and waited for with the rest (s, dp: step_s's and
// step_dp's accumulators, Sᵀ and dPᵀ the last two groups in flight). read() is called once
// the products have read Q_i and dO_i (and L_i, D_i). EARLY: wait for dPᵀ with Sᵀ and form
// dSᵀ beside Pᵀ (the same operations on the same values), so that neither Pᵀ in fp32 nor
// the softcap's 1 − tanh² is held across dV_j's issue (step_mid below says when).
template <typename T, int D, bool VAR, int WG0, int BAR, bool EARLY, typename Slope, typename Read>
__device__ __forceinline__ void step_mid_in(const Thread<WG0>& th, const Tile& c, int i, unsigned qb, unsigned dob, unsigned sdS,
                                         const float* sLb, const float* sDb, float* dv_acc, float* dk_acc,
                                         float* s, float* dp, float* dq, float scale, float k_in, float k_out,
                                         Slope slope, Read read) {
    using namespace wg;
    using CL = Cols<D>;
    constexpr int Bc = wgb::Bc, BrB = brb<D>();
    constexpr float LOG2E = 1.4426950408889634f;
    const float scale_log2 = scale * LOG2E;
    const int g = th.lane >> 2, tig = th.lane & 3;
    const int kr = th.key();                         // this thread's keys kr, kr + 8 in the tile
    const int i0 = i * BrB;
    const int j0 = c.j0;

    wgmma_wait<EARLY ? 0 : 1>();                     // Sᵀ is done; dPᵀ may run on
    fence_regs<BrB / 2>(s);
    if constexpr (EARLY) fence_regs<BrB / 2>(dp);

    // 2. Pᵀ, then dV_j += Pᵀ dO_i. Register 4t + e holds key kr + 8·(e ≥ 2), query
    //    8t + 2·tig + (e & 1) of the step. Keys past Nk and pairs outside the band are
    //    zeroed only in the steps that have them.
    const Band& band = c.band;
    const bool partial = c.cols < Bc
        || (band.left >= 0 && j0 - (i0 + BrB - 1) - band.off < -band.left)
        || (band.right >= 0 && j0 + Bc - 1 - i0 - band.off > band.right);
    // the mask apart from the exponentials' loop (below) in VAR too at D = 128 (NOTES v63):
    // at D = 64 flash2_bwd_ws's step (128 queries in the early order) spilled with it; the
    // wg rung's D = 32 built at 255 registers, not yet run
    constexpr bool APART = !VAR || D == 128;
    VarScores vs{};
    float dist0 = 0.f;
    if constexpr (VAR) {
        vs = VarScores{k_in, k_out, slope()};
        dist0 = (float)(i0 + tig * 2 + (c.nk - c.nq) - j0 - kr);   // q + off − key, per step
    }
    // Pᵀ (and EARLY's dSᵀ) in a loop with no test, the mask in a loop of its own behind
    // one branch: tested per t, each step without one took BrB/8 branches, and their
    // targets' instruction fetches stalled the warps (Nsight Compute at D = 64: "no
    // instruction" a sixth of the stall samples; v42, and v63 for VAR). A masked score's
    // dSᵀ is then +0 where Pᵀ·(dPᵀ − D) gave ±0: the same sums.
    if constexpr (VAR) {
#pragma unroll
        for (int t = 0; t < BrB / 8; ++t) {
            const float2 l2 = *reinterpret_cast<const float2*>(sLb + t * 8 + tig * 2);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float l = (e & 1) ? l2.y : l2.x;
                float tanh_s = 0.f;
                s[4 * t + e] = ex2(fmaf(vs(s[4 * t + e], dist0 + (float)(t * 8 + (e & 1) - (e < 2 ? 0 : 8)), &tanh_s), vs.scale(), -l));
                if (!APART && partial) {
                    const int key = j0 + kr + (e < 2 ? 0 : 8), q = i0 + t * 8 + tig * 2 + (e & 1);
                    if (key >= c.nk || !band.sees(q, key)) s[4 * t + e] = 0.f;
                }
                if constexpr (EARLY) {               // dSᵀ through the softcap (th = 0 without)
                    const float2 dd = *reinterpret_cast<const float2*>(sDb + t * 8 + tig * 2);
                    dp[4 * t + e] = s[4 * t + e] * (dp[4 * t + e] - ((e & 1) ? dd.y : dd.x)) * fmaf(-tanh_s, tanh_s, 1.f);
                }
            }
        }
    } else {
#pragma unroll
        for (int t = 0; t < BrB / 8; ++t) {
            const float2 l2 = *reinterpret_cast<const float2*>(sLb + t * 8 + tig * 2);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                s[4 * t + e] = ex2(fmaf(s[4 * t + e], scale_log2, -((e & 1) ? l2.y : l2.x)));
                if constexpr (EARLY) {
                    const float2 dd = *reinterpret_cast<const float2*>(sDb + t * 8 + tig * 2);
                    dp[4 * t + e] = s[4 * t + e] * (dp[4 * t + e] - ((e & 1) ? dd.y : dd.x));
                }
            }
        }
    }
    if (APART && partial) {
#pragma unroll
        for (int t = 0; t < BrB / 8; ++t)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = j0 + kr + (e < 2 ? 0 : 8), q = i0 + t * 8 + tig * 2 + (e & 1);
                if (key >= c.nk || !band.sees(q, key)) {
                    s[4 * t + e] = 0.f;
                    if constexpr (EARLY) dp[4 * t + e] = 0.f;
                }
            }
    }
    unsigned pf[BrB / 16][4], dsf[BrB / 16][4];      // Pᵀ, dSᵀ in T: A operands, k-step of 16 queries
#pragma unroll
    for (int t = 0; t < BrB / 8; ++t) {
        pf[t >> 1][(t & 1) * 2 + 0] = pack<T>(s[4 * t], s[4 * t + 1]);
        pf[t >> 1][(t & 1) * 2 + 1] = pack<T>(s[4 * t + 2], s[4 * t + 3]);
    }
    fence_regs<D / 2>(dv_acc);
    wgmma_fence();
    const unsigned long long ddo = desc(dob, BrB * CL::RB, CL::SBO, CL::MODE);
#pragma unroll
    for (int kk = 0; kk < BrB / 16; ++kk) Wgmma<T, D>::rs(dv_acc, pf[kk], desc_plus(ddo, kk * 16 * CL::RB));
    wgmma_commit();
    if constexpr (!EARLY) {
        wgmma_wait<1>();                             // dPᵀ is done; dV_j's product may run on
        fence_regs<BrB / 2>(dp);
    }

    // 3. dSᵀ = Pᵀ ∘ (dPᵀ − D) (EARLY: formed above), dK_j += dSᵀ Q_i, dSᵀ to shared
    //    memory: key row kr, query q at block q/64, 16-byte chunk (q%64)/8 ^ (kr & 7)
#pragma unroll
    for (int t = 0; t < BrB / 8; ++t) {
        if constexpr (!EARLY) {
            const float2 dd = *reinterpret_cast<const float2*>(sDb + t * 8 + tig * 2);
#pragma unroll
            for (int e = 0; e < 4; ++e) dp[4 * t + e] = s[4 * t + e] * (dp[4 * t + e] - ((e & 1) ? dd.y : dd.x));
        }
        dsf[t >> 1][(t & 1) * 2 + 0] = pack<T>(dp[4 * t], dp[4 * t + 1]);
        dsf[t >> 1][(t & 1) * 2 + 1] = pack<T>(dp[4 * t + 2], dp[4 * t + 3]);
        const unsigned at0 = sdS + (t >> 3) * (Bc * 128) + kr * 128 + (((t & 7) ^ g) << 4) + tig * 4;
        asm volatile("st.shared.b32 [%0], %1;\n" :: "r"(at0), "r"(dsf[t >> 1][(t & 1) * 2 + 0]) : "memory");
        asm volatile("st.shared.b32 [%0], %1;\n" :: "r"(at0 + 8 * 128), "r"(dsf[t >> 1][(t & 1) * 2 + 1]) : "memory");
    }
    fence_regs<D / 2>(dk_acc);
    wgmma_fence();
    const unsigned long long dqb = desc(qb, BrB * CL::RB, CL::SBO, CL::MODE);
#pragma unroll
    for (int kk = 0; kk < BrB / 16; ++kk) Wgmma<T, D>::rs(dk_acc, dsf[kk], desc_plus(dqb, kk * 16 * CL::RB));
    wgmma_commit();
    fence_proxy_async();                             // dSᵀ, written by the warps, read by wgmma
    asm volatile("bar.sync %0, %1;\n" :: "n"(BAR), "n"(wgb::THREADS) : "memory");   // every key's dSᵀ

    // 4. dQ_i += scale · dS K_j: block (qblk, nblk) of 64 queries × QN columns, k = Bc
    static_assert(D == 32 || D == 64 || D == 128, "the narrow step's instances");
    using DB = DqBlock<D>;
    const int qblk = th.grp % DB::QB, nblk = th.grp / DB::QB;
    const unsigned long long dds = desc(sdS + qblk * (Bc * 128), Bc * 128, 1024),
                             dk = desc(c.sK + nblk * (DB::QN / CL::W) * (Bc * CL::RB), Bc * CL::RB, CL::SBO, CL::MODE);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < Bc / 16; ++kk)
        Wgmma<T, DB::QN>::template ss<1, 1>(dq, desc_plus(dds, kk * 16 * 128), desc_plus(dk, kk * 16 * CL::RB), kk > 0);
    wgmma_commit();
    wgmma_wait<0>();                                 // and dV_j's, dK_j's products
    fence_regs<DB::QN / 2>(dq);
    fence_regs<D / 2>(dv_acc);
    fence_regs<D / 2>(dk_acc);
#pragma unroll
    for (int kk = 0; kk < BrB / 16; ++kk) {          // the products have read Pᵀ, dSᵀ: only now
        asm volatile("" : "+r"(pf[kk][0]), "+r"(pf[kk][1]), "+r"(pf[kk][2]), "+r"(pf[kk][3]));
        asm volatile("" : "+r"(dsf[kk][0]), "+r"(dsf[kk][1]), "+r"(dsf[kk][2]), "+r"(dsf[kk][3]));
    }
    read();
}
// 2.–4. in one of two orders. EARLY (flash2_bwd_ws at D = 64, whose 128-query steps
// would otherwise need more than a consumer's 240 registers) and a VAR launch with a
// softcap (whose 1 − tanh² per score would otherwise be held) take the early one; the rest,
// ALiBi alone included (its dSᵀ needs no tanh), wait for Sᵀ alone and let dPᵀ run on under
// Pᵀ's exponentials. The two orders are whole copies of the step, each with its own
// waits: with the waits alone behind the branch, ptxas could not tell which accumulators
// were in flight and serialised the products (C7514).
template <typename T, int D, bool VAR, int WG0, int BAR, bool EARLY = false, typename Slope, typename Read>
__device__ __forceinline__ void step_mid(const Thread<WG0>& th, const Tile& c, int i, unsigned qb, unsigned dob, unsigned sdS,
                                         const float* sLb, const float* sDb, float* dv_acc, float* dk_acc,
                                         float* s, float* dp, float* dq, float scale, float k_in, float k_out,
                                         Slope slope, Read read) {
    // (uniform over the launch.) Where EARLY, a VAR step without a softcap still gets a copy
    // of its own, compiled knowing k_out = 0 (VarScores' softcap test gone from its loop)
    if (VAR && k_out != 0.f)
        step_mid_in<T, D, VAR, WG0, BAR, true>(th, c, i, qb, dob, sdS, sLb, sDb, dv_acc, dk_acc, s, dp, dq, scale,
                                               k_in, k_out, slope, read);
    else if (EARLY)
        step_mid_in<T, D, VAR, WG0, BAR, true>(th, c, i, qb, dob, sdS, sLb, sDb, dv_acc, dk_acc, s, dp, dq, scale,
                                               k_in, 0.f, slope, read);
    else
        step_mid_in<T, D, VAR, WG0, BAR, false>(th, c, i, qb, dob, sdS, sLb, sDb, dv_acc, dk_acc, s, dp, dq, scale,
                                                k_in, 0.f, slope, read);
}
// dQ_i's block, its product done, added to dQacc (or stored to sdQ: SDQ), between the
// caller's wait and pass (step's); then() runs between the last store and pass (flash2_bwd_ws
// issues the next step's first product there)
struct Nothing { __device__ __forceinline__ void operator()() const {} };
template <typename T, int D, int WG0, bool SDQ, typename Wait, typename Pass, typename Then = Nothing>
__device__ __forceinline__ void step_dq(const Thread<WG0>& th, const Tile& c, long long q_row0, int i, const float* dq, float scale,
                                        float* __restrict__ dQacc, int d, Wait wait, Pass pass, unsigned sdQ,
                                        Then then = Then{}) {
    using namespace wg;
    constexpr int BrB = brb<D>();
    using DB = DqBlock<D>;
    const int g = th.lane >> 2, tig = th.lane & 3;
    const int i0 = i * BrB, rows = min(BrB, c.nq - i0);
    const int qblk = th.grp % DB::QB, nblk = th.grp / DB::QB;
    const long long q_row = q_row0 + i0;
    const Turn turn = wait(i, rows);
    const int r0 = qblk * 64 + th.warp * 16 + g, r1 = r0 + 8;
#pragma unroll
    for (int t = 0; t < DB::QN / 8; ++t) {
        const int col = nblk * DB::QN + t * 8 + tig * 2;
        if constexpr (SDQ) {                         // every row and column, in the block's order
            // (common.cuh's dq_tiled_at): registers 4t … 4t + 3 are float4 t of the thread,
            // the warp's 32 lanes 512 contiguous bytes
            static_assert(BrB * D == DQ_BLOCK && DB::QN == 64, "the tiled dQ block: 64 × 128 or 128 × 64");
            st_shared_f4(sdQ + (t * 256 + th.grp * 128 + th.warp * 32 + th.lane) * 16, scale * dq[4 * t],
                         scale * dq[4 * t + 1], scale * dq[4 * t + 2], scale * dq[4 * t + 3]);
        } else {
            if (col >= d) break;                     // the instance's columns past d
            if (r0 < rows) add2(dQacc + (q_row + r0) * d + col, scale * dq[4 * t], scale * dq[4 * t + 1]);
            if (r1 < rows) add2(dQacc + (q_row + r1) * d + col, scale * dq[4 * t + 2], scale * dq[4 * t + 3]);
        }
    }
    then();
    pass(turn);
}
// One step, its products issued, waited for and dQ_i added in turn
template <typename T, int D, bool VAR, int WG0, int BAR, bool SDQ = false, typename Slope, typename Read,
          typename Wait, typename Pass>
__device__ __forceinline__ void step(const Tile& c, long long q_row0, int i, unsigned qb, unsigned dob, unsigned sdS,
                                     const float* sLb, const float* sDb, float* dv_acc, float* dk_acc,
                                     float scale, float k_in, float k_out, float* __restrict__ dQacc,
                                     int d, Slope slope, Read read, Wait wait, Pass pass,
                                     unsigned sdQ = 0) {
    const Thread<WG0> th;
    float s[brb<D>() / 2], dp[brb<D>() / 2], dq[DqBlock<D>::QN / 2];
    step_s<T, D, WG0>(th, c, qb, s);
    step_dp<T, D, WG0>(th, c, dob, dp);
    // (at D = 64 a VAR instance in the late order needs 255 registers and spills)
    step_mid<T, D, VAR, WG0, BAR, VAR && D == 64>(th, c, i, qb, dob, sdS, sLb, sDb, dv_acc, dk_acc, s, dp, dq, scale,
                                                   k_in, k_out, slope, read);
    step_dq<T, D, WG0, SDQ>(th, c, q_row0, i, dq, scale, dQacc, d, wait, pass, sdQ);
}

// One step above D = 128 (step_wide: D = 160, 192, 224, 256): the CTA's 64 keys meet BrB =
// 64 queries. dK_j and dV_j (64 × D each) are split by columns: warpgroup h keeps part h
// of both (wgmma.cuh's Parts: columns 0 … H0 − 1 and H0 … D − 1; H0/2 + H0/2 registers
// per thread, 64 + 64 at 224 and 256, 48 + 48 at 160 and 192) and computes that part of
// dQ_i. The tiles of K_j, V_j, Q_i, dO_i lie as wgmma.cuh's Cols<D> (D = 160, 192, 224:
// 32-column blocks, the 64-byte swizzle, so that a part is whole blocks). The elementwise work
// is split by queries, so that each warpgroup forms its own scores and no fp32 value
// crosses between them:
//   1. warpgroup h: Sᵀ = K_j Q_iᵀ and dPᵀ = V_j dO_iᵀ for queries 32·h … 32·h + 31 (64 keys
//      × 32 queries each, k = D, A and B K-major), two commit groups;
//   2. Pᵀ = 2^(Sᵀ·scale·log2e − L·log2e) (masked) and dSᵀ = Pᵀ ∘ (dPᵀ − D) (∘ the
//      softcap's 1 − tanh², VAR) of those queries, both into shared memory in T (sP,
//      sdS: key rows, the 128-byte swizzle);
//   3. one barrier (every query's Pᵀ and dSᵀ), then dV_j[:, h] += Pᵀ dO_i[:, h],
//      dK_j[:, h] += dSᵀ Q_i[:, h] (A K-major, B MN-major) and dQ_i[:, h] = dS K_j[:, h]
//      (A = dSᵀ MN-major, B = K_j MN-major), then dQ's additions as step's.
// sP and sdS are free again by the next step: the products have read them before this
// step's last wait, and the caller's barrier separates the steps.
template <typename T, int D, bool VAR, int WG0, int BAR, typename Slope, typename Read,
          typename Wait, typename Pass>
__device__ __forceinline__ void step_wide(const Tile& c, long long q_row0, int i, unsigned qb, unsigned dob,
                                          unsigned sdS, unsigned sP, const float* sLb, const float* sDb,
                                          float* dv_acc, float* dk_acc, float scale, float k_in, float k_out,
                                          float* __restrict__ dQacc, int d, Slope slope, Read read, Wait wait,
                                          Pass pass) {
    using namespace wg;
    static_assert(D > 128 && D % 32 == 0 && D <= 256, "the wide step is the instances' above 128");
    using CL = Cols<D>;
    using PT = Parts<D>;                             // warpgroup h's columns: part h
    constexpr int Bc = bc<D>(), BrB = brb<D>(), H = PT::H0, QH = BrB / 2;   // (the larger part), queries
    constexpr float LOG2E = 1.4426950408889634f;
    const float scale_log2 = scale * LOG2E;
    const Thread<WG0> th;
    const int g = th.lane >> 2, tig = th.lane & 3;
    const int kr = th.warp * 16 + g;                 // this thread's keys kr, kr + 8 in the tile
    const int qh = th.grp * QH;                      // the warpgroup's first query of the step
    const int i0 = i * BrB, rows = min(BrB, c.nq - i0);
    const int j0 = c.j0;

    // 1. Sᵀ, dPᵀ of this warpgroup's queries: 64 keys × QH, k = D
    float s[QH / 2], dp[QH / 2];
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const unsigned blk = kk / CL::KSTEPS, stp = (kk % CL::KSTEPS) << 5;   // 16 columns: 32 bytes
        Wgmma<T, QH>::ss(s, desc(c.sK + blk * (Bc * CL::RB) + stp, 16, CL::SBO, CL::MODE),
                         desc(qb + blk * (BrB * CL::RB) + qh * CL::RB + stp, 16, CL::SBO, CL::MODE), kk > 0);
    }
    wgmma_commit();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const unsigned blk = kk / CL::KSTEPS, stp = (kk % CL::KSTEPS) << 5;
        Wgmma<T, QH>::ss(dp, desc(c.sV + blk * (Bc * CL::RB) + stp, 16, CL::SBO, CL::MODE),
                         desc(dob + blk * (BrB * CL::RB) + qh * CL::RB + stp, 16, CL::SBO, CL::MODE), kk > 0);
    }
    wgmma_commit();
    wgmma_wait<VAR ? 0 : 1>();                       // Sᵀ is done; dPᵀ may run on (VAR: both)
    fence_regs<QH / 2>(s);
    if constexpr (VAR) fence_regs<QH / 2>(dp);

    // 2. Pᵀ (into s and sP), then dSᵀ (into dp and sdS). Register 4t + e holds key kr +
    //    8·(e ≥ 2), query qh + 8t + 2·tig + (e & 1) of the step, 16-byte chunk qh/8 + t of
    //    the key's row (swizzled by kr & 7 = g).
    const Band& band = c.band;
    const bool partial = c.cols < Bc
        || (band.left >= 0 && j0 - (i0 + BrB - 1) - band.off < -band.left)
        || (band.right >= 0 && j0 + Bc - 1 - i0 - band.off > band.right);
    VarScores vs{};
    float dist0 = 0.f;
    if constexpr (VAR) {
        vs = VarScores{k_in, k_out, slope()};
        dist0 = (float)(i0 + qh + tig * 2 + (c.nk - c.nq) - j0 - kr);
    }
    float soft[QH / 2];                              // VAR: 1 − tanh² per score
#pragma unroll
    for (int t = 0; t < QH / 8; ++t) {
        const float2 l2 = *reinterpret_cast<const float2*>(sLb + qh + t * 8 + tig * 2);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float l = (e & 1) ? l2.y : l2.x;
            if constexpr (VAR) {
                float tanh_s = 0.f;                  // VarScores leaves it without a softcap
                s[4 * t + e] = ex2(fmaf(vs(s[4 * t + e], dist0 + (float)(t * 8 + (e & 1) - (e < 2 ? 0 : 8)), &tanh_s), vs.scale(), -l));
                soft[4 * t + e] = fmaf(-tanh_s, tanh_s, 1.f);
            } else {
                s[4 * t + e] = ex2(fmaf(s[4 * t + e], scale_log2, -l));
            }
            if (partial) {
                const int key = j0 + kr + (e < 2 ? 0 : 8), q = i0 + qh + t * 8 + tig * 2 + (e & 1);
                if (key >= c.nk || !band.sees(q, key)) s[4 * t + e] = 0.f;
            }
        }
        const unsigned at0 = sP + kr * 128 + ((((qh >> 3) + t) ^ g) << 4) + tig * 4;
        asm volatile("st.shared.b32 [%0], %1;\n" :: "r"(at0), "r"(pack<T>(s[4 * t], s[4 * t + 1])) : "memory");
        asm volatile("st.shared.b32 [%0], %1;\n" :: "r"(at0 + 8 * 128), "r"(pack<T>(s[4 * t + 2], s[4 * t + 3])) : "memory");
    }
    if constexpr (!VAR) {
        wgmma_wait<0>();                             // dPᵀ is done
        fence_regs<QH / 2>(dp);
    }
#pragma unroll
    for (int t = 0; t < QH / 8; ++t) {
        const float2 dd = *reinterpret_cast<const float2*>(sDb + qh + t * 8 + tig * 2);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            dp[4 * t + e] = s[4 * t + e] * (dp[4 * t + e] - ((e & 1) ? dd.y : dd.x));
            if constexpr (VAR) dp[4 * t + e] *= soft[4 * t + e];
        }
        const unsigned at0 = sdS + kr * 128 + ((((qh >> 3) + t) ^ g) << 4) + tig * 4;
        asm volatile("st.shared.b32 [%0], %1;\n" :: "r"(at0), "r"(pack<T>(dp[4 * t], dp[4 * t + 1])) : "memory");
        asm volatile("st.shared.b32 [%0], %1;\n" :: "r"(at0 + 8 * 128), "r"(pack<T>(dp[4 * t + 2], dp[4 * t + 3])) : "memory");
    }
    fence_proxy_async();                             // Pᵀ, dSᵀ, written by the warps, read by wgmma
    asm volatile("bar.sync %0, %1;\n" :: "n"(BAR), "n"(THREADS) : "memory");   // every query's Pᵀ, dSᵀ

    // 3. dV_j[:, h] += Pᵀ dO_i[:, h], dK_j[:, h] += dSᵀ Q_i[:, h] (k = BrB queries);
    //    dQ_i[:, h] = scale · dS K_j[:, h] (k = Bc keys), h the warpgroup's part of the
    //    columns (wide_products). The B operands (MN-major): the part's column blocks
    //    from block B0·h, LBO the block stride. Where the parts differ (D = 160, 224)
    //    each warpgroup takes its own branch, whose instructions have its part's N.
    fence_regs<H / 2>(dv_acc);
    fence_regs<H / 2>(dk_acc);
    float dq[H / 2];
    const unsigned b0 = th.grp * PT::B0;             // the part's first column block
    if constexpr (PT::H0 == PT::H1) wide_products<T, D, PT::H0>(dv_acc, dk_acc, dq, sP, sdS, dob, qb, c.sK, b0);
    else if (th.grp == 0) wide_products<T, D, PT::H0>(dv_acc, dk_acc, dq, sP, sdS, dob, qb, c.sK, b0);
    else wide_products<T, D, PT::H1>(dv_acc, dk_acc, dq, sP, sdS, dob, qb, c.sK, b0);
    wgmma_wait<0>();
    fence_regs<H / 2>(dq);
    fence_regs<H / 2>(dv_acc);
    fence_regs<H / 2>(dk_acc);
    read();
    const long long q_row = q_row0 + i0;
    const Turn turn = wait(i, rows);
    const int r0 = th.warp * 16 + g, r1 = r0 + 8;
#pragma unroll
    for (int t = 0; t < H / 8; ++t) {
        const int col = th.grp * H + t * 8 + tig * 2;
        if (col >= d) break;                         // the instance's columns past d (and,
                                                     // part 1, past D: H1 ≤ H)
        if (r0 < rows) add2(dQacc + (q_row + r0) * d + col, scale * dq[4 * t], scale * dq[4 * t + 1]);
        if (r1 < rows) add2(dQacc + (q_row + r1) * d + col, scale * dq[4 * t + 2], scale * dq[4 * t + 3]);
    }
    pass(turn);
}

// dK_j = scale · Σ dSᵀ Q, dV_j = Σ Pᵀ dO from the warpgroup's accumulators into rows kr,
// kr + 8 of the tile's keys (columns past d, dv: not stored)
template <typename T, int D, int WG0>
__device__ __forceinline__ void store_dkv(const Tile& c, const float* dk_acc, const float* dv_acc,
                                          T* dKj, T* dVj, int lddk, int lddv, int d, int dv, float scale) {
    const Thread<WG0> th;
    const int kr = th.key(), r1 = kr + 8, tig = th.lane & 3;
#pragma unroll
    for (int t = 0; t < D / 8; ++t) {
        const int col = t * 8 + tig * 2;
        if (kr < c.cols) {
            if (col < d) *reinterpret_cast<unsigned*>(dKj + (long long)kr * lddk + col) = pack<T>(scale * dk_acc[4 * t], scale * dk_acc[4 * t + 1]);
            if (col < dv) *reinterpret_cast<unsigned*>(dVj + (long long)kr * lddv + col) = pack<T>(dv_acc[4 * t], dv_acc[4 * t + 1]);
        }
        if (r1 < c.cols) {
            if (col < d) *reinterpret_cast<unsigned*>(dKj + (long long)r1 * lddk + col) = pack<T>(scale * dk_acc[4 * t + 2], scale * dk_acc[4 * t + 3]);
            if (col < dv) *reinterpret_cast<unsigned*>(dVj + (long long)r1 * lddv + col) = pack<T>(dv_acc[4 * t + 2], dv_acc[4 * t + 3]);
        }
    }
}

// The same from step_wide's accumulators: all 64 keys, warpgroup h's part of the columns
// of dK_j, dV_j (wgmma.cuh's Parts; part 1's registers past H1/2 hold columns past D,
// which d, dv ≤ D leave unstored)
template <typename T, int D, int WG0>
__device__ __forceinline__ void store_dkv_wide(const Tile& c, const float* dk_acc, const float* dv_acc,
                                               T* dKj, T* dVj, int lddk, int lddv, int d, int dv, float scale) {
    const Thread<WG0> th;
    const int kr = th.warp * 16 + (th.lane >> 2), r1 = kr + 8, tig = th.lane & 3;
#pragma unroll
    for (int t = 0; t < wg::Parts<D>::H0 / 8; ++t) {
        const int col = th.grp * wg::Parts<D>::H0 + t * 8 + tig * 2;
        if (kr < c.cols) {
            if (col < d) *reinterpret_cast<unsigned*>(dKj + (long long)kr * lddk + col) = pack<T>(scale * dk_acc[4 * t], scale * dk_acc[4 * t + 1]);
            if (col < dv) *reinterpret_cast<unsigned*>(dVj + (long long)kr * lddv + col) = pack<T>(dv_acc[4 * t], dv_acc[4 * t + 1]);
        }
        if (r1 < c.cols) {
            if (col < d) *reinterpret_cast<unsigned*>(dKj + (long long)r1 * lddk + col) = pack<T>(scale * dk_acc[4 * t + 2], scale * dk_acc[4 * t + 3]);
            if (col < dv) *reinterpret_cast<unsigned*>(dVj + (long long)r1 * lddv + col) = pack<T>(dv_acc[4 * t + 2], dv_acc[4 * t + 3]);
        }
    }
}

}  // namespace wgb
