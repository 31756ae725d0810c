// flash2_tc.cu: the tensor-core rung. The same FlashAttention-2 schedules as
// flash2_ref.cu (the same visited tiles, so the same traffic), on mma.sync.
//
// Kernels in this file, each a rung over the reference:
//   flash2_fwd_tc<T, D, VAR, VL, CAP_ONLY>  forward, T ∈ {__half, __nv_bfloat16},
//                        D ∈ {32, 64, …, 256}: head dims d, dv ≤ D, multiples of 8
//                        (below D the columns past them are zeroed on chip and never
//                        stored; forward and backward run them in their VAR instances,
//                        whose registers have room for the tests),
//                        tiles Br × Bc = 128 × 128 (D = 32, 64), 128 × 64 (D = 96, 128;
//                        and on Ampere at D = 32, 64), 64 × 64 (above 128, one m-tile per
//                        warp); shared rows of D rounded up to 64 halves (ds<D>). Adds
//                        over
//                        flash2_fwd (the reference):
//                        - mma.sync.m16n8k16 (fp16/bf16 in, fp32 accumulate) for S = Q Kᵀ
//                          and O += P V, so it also runs on Ampere;
//                        - warps split along Q (32 rows each, two 16-row m-tiles): each
//                          warp owns whole rows of S, so the softmax needs no inter-warp
//                          reduction;
//                        - Q_i on chip for the whole loop (shared memory; registers on
//                          Ampere); P goes from the S accumulators to the A
//                          operand of the second MMA without shared memory (the m16n8 C
//                          layout is the m16n8k16 A layout);
//                        - ldmatrix (.trans for V) from XOR-swizzled shared memory: no
//                          bank conflicts; 16-byte cp.async loads, K/V double-buffered so
//                          tile j+1 streams in while tile j is multiplied;
//                        - exp2 (one MUFU.EX2) with scale·log2(e) folded into one FMA,
//                          deferred normalisation, ℓ kept per thread until the end;
//                        - grid (Tr, batch·heads): neighbouring CTAs share K/V in L2.
//   flash2_bwd_preprocess_tc<T, D>, flash2_bwd_tc<T, D, VAR, VL>  the backward (below), at
//                        D ∈ {32, 64, 96, 128, 160, 192, 256} (160, 192 launched on sm_90
//                        only; d = 224 runs D = 256: flashsim/kernels.py says why); the
//                        post-pass is the reference's flash2_bwd_postprocess;
//                        flash2_bwd_tc_det<T, D, VAR, VL> the same in deterministic mode.
// Every kernel but the pre-pass has VAR and VL template arguments: VAR = true is the
// instance for softcap and ALiBi (tensor_core.cuh's VarScores finish S in log2 units
// before the mask; the backward multiplies dS by 1 − tanh²); VL = true (built with VAR)
// runs a packed varlen batch, walking common.cuh's table of real tiles (seq_at) as the
// reference does; the plain instance is unchanged by either. The forward's CAP_ONLY =
// true (with VAR, dense) is its softcap instance: bfloat16's softcap ≤ 54.4 under the
// fixed max, float16's (without ALiBi) under the lazy one (flashsim.kernels.tc_cap).
// Windows run on all (the band). Counts its traffic like the reference under
// -DFLASHSIM_COUNT_IO. Runs in the CPU emulation too (host_emu.h): mma.sync, ldmatrix
// and the special registers have host forms in warp.cuh and tensor_core.cuh.

#include "warp.cuh"

namespace tc {

// Tile shape: WARPS warps of MT·16 query rows each, Bc keys per K/V tile. The defaults
// are the shipped configuration (flashsim/kernels.py's TC_BLOCKS); the macros exist for
// analysis/tune_tc.py, which builds and times variants side by side.
// Shipped (tuned on an H100, kernels_cu/NOTES.md): 4 warps × 2 m-tiles (Br = 128);
// Bc = 128 at D = 64, 64 at D = 128; Q_i re-read from shared memory at every k-step (at
// D = 128 registers hold only the two m-tiles' O; at D = 64 the 128-key S does); no
// spills. Ampere keeps Bc = 64 with Q_i in registers (below).
#ifndef FLASHSIM_TC_WARPS
#define FLASHSIM_TC_WARPS 0
#endif
#ifndef FLASHSIM_TC_BC
#define FLASHSIM_TC_BC 0
#endif
#ifndef FLASHSIM_TC_MINBLOCKS
#define FLASHSIM_TC_MINBLOCKS 1
#endif
// Ampere (sm_8x) gets D = 96 and 128 tiles of the same Br × Bc with fewer registers per
// thread (8 warps × 1 m-tile forward; at 128 32-row backward steps): the sm_90 choices
// need 251-255 registers there and ptxas for sm_8x spills a few. flashsim/kernels.py
// mirrors this. The CPU emulation of an Ampere device (fs.gpu.emulated(compute_capability=80))
// defines the macro itself, having no __CUDA_ARCH__.
#ifndef FLASHSIM_TC_AMPERE
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define FLASHSIM_TC_AMPERE 1
#else
#define FLASHSIM_TC_AMPERE 0
#endif
#endif
template <int D> __host__ __device__ constexpr bool ampere8w() { return FLASHSIM_TC_AMPERE && (D == 96 || D == 128); }
// Shared tiles hold rows of DS = ds<D>() halves: D rounded up to a multiple of 64, so that
// a row is whole 128-byte lines and the swizzle below (8 chunks, c ^ (r & 7)) stays inside
// it; at D = 32, 96, 160, 224 the products read only the first D columns (the rest of the
// row is never loaded or read)
template <int D> __host__ __device__ constexpr int ds() { return (D + 63) / 64 * 64; }
template <int D> __host__ __device__ constexpr int warps() { return FLASHSIM_TC_WARPS ? FLASHSIM_TC_WARPS : (ampere8w<D>() ? 8 : 4); }
// m-tiles of 16 rows per warp: each K/V fragment loaded feeds MT MMAs (2: +15% at
// D = 64 in analysis/tune_tc.py); the macro overrides it for tuning
#ifndef FLASHSIM_TC_MT
#define FLASHSIM_TC_MT 0
#endif
// (above D = 128: one, Br = 64: O alone takes D/2 registers)
template <int D> __host__ __device__ constexpr int mtiles() { return FLASHSIM_TC_MT ? FLASHSIM_TC_MT : (ampere8w<D>() || D > 128 ? 1 : 2); }
// Q_i's A fragments held in registers for the whole loop (1), or read from shared memory
// with ldmatrix at every k-step (0), which frees D/4·MT registers for a second m-tile
// at D = 128; the macro overrides it for tuning (-1 = the default)
#ifndef FLASHSIM_TC_QREG
#define FLASHSIM_TC_QREG -1
#endif
template <int D> __host__ __device__ constexpr bool qreg() { return FLASHSIM_TC_QREG >= 0 ? FLASHSIM_TC_QREG : FLASHSIM_TC_AMPERE && D <= 128; }
// where the next K/V tile's loads are issued: at the top of the iteration, before the
// barrier (0), or after the softmax, when S's registers are free and one barrier per
// iteration suffices (1, shipped: +8% at D = 128, +1% at D = 64); -1 = the default
#ifndef FLASHSIM_TC_LATE
#define FLASHSIM_TC_LATE -1
#endif
template <int D> __host__ __device__ constexpr bool late() { return FLASHSIM_TC_LATE >= 0 ? FLASHSIM_TC_LATE : true; }
// keys per K/V tile: 128 at D = 32 and 64 on sm_90 (+4–7% over 64 on an H100, NOTES.md v5), 64
// at D = 128 (a 128-key S does not fit beside O in 255 registers) and on Ampere (whose
// ptxas spills the 128-key tile's instrumented build)
// The softcap/ALiBi instance (VAR) keeps 64 keys at D = 64: with 128 its scores' pass
// spills on sm_90 (kernels_cu/NOTES.md, v9); at D = 32 it has the room and takes 128
template <int D, bool VAR = false> __host__ __device__ constexpr int bc() {
    return FLASHSIM_TC_BC ? FLASHSIM_TC_BC : ((D == 32 || (D == 64 && !VAR)) && !FLASHSIM_TC_AMPERE ? 128 : 64);
}

// Shared tiles are rows of DS halves (ds<D>()) in 16-byte chunks; chunk c of row r lives
// at chunk c ^ (r & 7) (load_tile writes them so, swz_base/swz_step read them). The 8 rows
// an ldmatrix reads then sit in 8 different bank groups.

// Addresses into a swizzled tile without per-load arithmetic. Chunk ch = 2k + h of row r
// (k a compile-time step, h ∈ {0, 1} taken from the lane) sits at byte
// row_base + ((ch ^ (r & 7)) << 4); with row_base a multiple of 128 (rows of ≥ 64
// halves: every DS) that is (row_base + ((h ^ (r & 7)) << 4)) ^ ((k & 3) << 5) + (k >> 2)·128.
// So a thread computes one base per tile, swz_base(...), and each ldmatrix address is one
// XOR with an immediate plus an immediate offset; rows 8 apart share the base's swizzle.
template <int DS>
__device__ __forceinline__ unsigned swz_base(const void* tile, int r, int h) {
    static_assert(DS % 64 == 0, "rows of whole 128-byte lines");
    return smem_addr(tile) + r * DS * 2 + ((h ^ (r & 7)) << 4);
}
__device__ __forceinline__ unsigned swz_step(unsigned base, int k) {
    return (base ^ ((k & 3) << 5)) + ((k >> 2) << 7);
}
// rows [0, valid) of a ROWS × D tile from global (rows ld elements apart, `width` ≤ D
// contiguous) into shared, by THREADS threads, 16 bytes each per pass. The passes are
// unrolled at compile time and a thread keeps its 16-byte column c in every pass, so its
// swizzled shared address moves by constants and its global one by RPI·ld: one
// predicate, one address select and one cp.async per chunk (a runtime loop with x / CH
// and x % CH cost ~20 instructions each). An instance wider than the head dim (width <
// D) leaves the columns past width alone: zero_cols filled them with zeros once, and the
// threads that own them return at once (a per-chunk test instead held registers the
// D = 128 forward's loop needed, and it spilled).
template <typename T, int D, int ROWS, int THREADS>
__device__ __forceinline__ void load_tile(T* s, const T* g, int ld, int valid, int width) {
    constexpr int CH = D / 8, DS = ds<D>();         // 16-byte chunks per row; row stride
    // tid read through volatile asm: the compiler may not hoist it, and so keeps no
    // per-thread offsets live across the caller's loop (registers are short there)
    const unsigned tid = opaque_tid();
    if constexpr (THREADS % CH != 0) {
        // D = 96, 160, 192, 224 (12 … 28 chunks a row): a pass does not cover whole rows, so each chunk's
        // row and column come from its index (divisions by a constant)
#pragma unroll
        for (int it = 0; it < (ROWS * CH + THREADS - 1) / THREADS; ++it) {
            const int x = tid + it * THREADS, r = x / CH, c = x % CH;
            if ((ROWS * CH) % THREADS != 0 && x >= ROWS * CH) break;
            if (c * 8 >= width) continue;
            const bool ok = r < valid;
            cp_async16(s + r * DS + ((c ^ (r & 7)) << 3), g + (ok ? r * ld + c * 8 : 0), ok);
        }
        return;
    }
    constexpr int RPI = THREADS / CH;               // rows per pass
    const int c = tid % CH, r0 = tid / CH;
    if (c * 8 >= width) return;
#pragma unroll
    for (int it = 0; it < (ROWS + RPI - 1) / RPI; ++it) {
        const int r = r0 + it * RPI;
        if (ROWS % RPI != 0 && r >= ROWS) break;   // only when the passes overshoot
        const bool ok = r < valid;
        // RPI is a multiple of 8, so r & 7 = r0 & 7 in every pass
        const int sc = RPI % 8 == 0 ? c ^ (r0 & 7) : c ^ (r & 7);
        cp_async16(s + r * DS + (sc << 3), g + (ok ? r * ld + c * 8 : 0), ok);
    }
}
// zeros into the columns [width, D) of a ROWS × D swizzled tile (rows' chunks permuted
// within each group of 8, so the columns past width are some set of chunks: all chunks c
// with c ≥ width/8 before the swizzle), before any load_tile of it: they stay zero, so
// S = Q Kᵀ and dPᵀ = V dOᵀ sum only the head dim's columns
template <typename T, int D, int ROWS, int THREADS>
__device__ __forceinline__ void zero_cols(T* s, int width) {
    constexpr int CH = D / 8, DS = ds<D>();
    const int w = width / 8;
    for (int x = threadIdx.x; x < ROWS * (CH - w); x += THREADS) {
        const int r = x / (CH - w), c = w + x % (CH - w);
        *reinterpret_cast<uint4*>(s + r * DS + ((c ^ (r & 7)) << 3)) = make_uint4(0, 0, 0, 0);
    }
}

}  // namespace tc

template <typename T, int D, bool VAR, bool VL, bool CAP_ONLY>
__global__ void __launch_bounds__(32 * tc::warps<D>(), FLASHSIM_TC_MINBLOCKS)
flash2_fwd_tc(const T* __restrict__ Q, const T* __restrict__ K, const T* __restrict__ V,
              const long long* __restrict__ at, T* __restrict__ O, float* __restrict__ L,
              int Nq, int Nk, int ldq, int ldk, int ldv, int ldo, int d, int dv, int left, int right,
              float scale_log2, float k_in, float k_out,
              const float* __restrict__ slopes, const int* __restrict__ vl,
              unsigned long long* io) {
    using namespace tc;
    // each warp owns MT m-tiles of 16 query rows: every K/V fragment it loads feeds MT MMAs
    constexpr int MT = mtiles<D>(), RW = 16 * MT;
    constexpr int Br = RW * warps<D>(), THREADS = 32 * warps<D>(), Bc = bc<D, VAR>();
    constexpr int DS = ds<D>();                      // the tiles' row stride (halves)
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T* sQ = reinterpret_cast<T*>(smem_raw);          // Br·DS
    T* sK = sQ + Br * DS;                            // 2 buffers of Bc·DS
    T* sV = sK + 2 * Bc * DS;                        // 2 buffers of Bc·DS

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tig = lane & 3;         // MMA group and thread in group
    // the last Q tiles first: under a causal mask they see the most keys, and a long CTA
    // started last would run alone at the end of the grid. VL (a packed varlen batch):
    // the tile is sequence sq.b's, whose rows start at sq.q0 (sq.k0) within Q's (K's)
    // problem p, of Nq (Nk) rows; nq, nk are the sequence's lengths (dense: Nq, Nk)
    const int p = blockIdx.y;
    const Seq sq = seq_at<VL>(vl, gridDim.x - 1 - blockIdx.x, Nq, Nk, Br);
    const int i = sq.tile, nq = sq.Nq, nk = sq.Nk;
    const int i0 = i * Br, rows = min(Br, nq - i0);
    const long long q_row = (long long)p * Nq + sq.q0 + i0;     // of L
    // the sequence's first key in K_p and V_p (strided: common.cuh's at table)
    const T* Kp = K + at_row0(at, p, AT_K) + sq.k0 * (long long)ldk;
    const T* Vp = V + at_row0(at, p, AT_V) + sq.k0 * (long long)ldv;
    const Band band{left, right, nk - nq};
    int jlo, jhi;
    band.kv_range(i0, i0 + rows, nk, Bc, &jlo, &jhi);
    // VAR (the instance for softcap and ALiBi): S is finished elementwise (VarScores), in
    // log2 units over vs.scale(), which is then the exponent's multiplier instead of
    // scale·log2(e). A template argument, not a run-time test, so the plain instance
    // keeps every register it had (a run-time branch made it spill)
    const float sl2 = VAR ? VarScores{k_in, k_out, 0.f}.scale() : scale_log2;
    // Head dims d, dv below the instance's D run in the VAR instance alone (the launcher
    // sends them there, with softcap and ALiBi off): there the loads skip the columns
    // past them and the epilogue does not store them; the plain instance, at 255
    // registers, spilled with those tests, and takes d = dv = D.
    const int nd = VAR ? d : D, ndv = VAR ? dv : D;
    // VL: inside the loop the sequence's key count and its K/V rows are read from shared
    // memory (again after each barrier); held in registers they made the d = 128 instance
    // spill. Dense: the parameter Nk and registers. Written before the barrier that
    // follows Q's load.
    __shared__ int s_nk;
    __shared__ const T* s_kv[2];
    if (VL && threadIdx.x == 0) {
        s_nk = nk;
        s_kv[0] = Kp;
        s_kv[1] = Vp;
    }

    if (jhi < jlo) {                                 // no key visible: O_i = 0, L_i = −∞
        fwd_tile_unseen<T, 32 * warps<D>()>(O + at_row0(at, p, AT_O) + (sq.q0 + i0) * (long long)ldo,
                                            ldo, L + q_row, rows, dv, io);
        return;
    }
    fwd_tile_count<T>(io, rows, jlo, jhi, Bc, nk, d, dv);

    if (nd < D || ndv < D) {                          // an instance wider than the head dims
        zero_cols<T, D, Br, 32 * warps<D>()>(sQ, nd);
#pragma unroll
        for (int b = 0; b < 2; ++b) {
            zero_cols<T, D, Bc, 32 * warps<D>()>(sK + b * Bc * DS, nd);
            zero_cols<T, D, Bc, 32 * warps<D>()>(sV + b * Bc * DS, ndv);
        }
    }
    load_tile<T, D, Br, 32 * warps<D>()>(sQ, Q + at_row0(at, p, AT_Q) + (sq.q0 + i0) * (long long)ldq, ldq, rows, nd);   // HBM→SRAM: Q_i (Br·d)
    cp_async_commit();
    {
        const int j0 = jlo * Bc, cols = min(Bc, nk - j0);
        load_tile<T, D, Bc, 32 * warps<D>()>(sK, Kp + (long long)j0 * ldk, ldk, cols, nd);   // HBM→SRAM: K_j (Bc·d)
        load_tile<T, D, Bc, 32 * warps<D>()>(sV, Vp + (long long)j0 * ldv, ldv, cols, ndv);   // HBM→SRAM: V_j (Bc·dv)
        cp_async_commit();
    }
    cp_async_wait<1>();                              // Q has landed
    __syncthreads();

    // Q_i's A fragments of this warp's rows, D/16 k-steps: kept in registers, or (QREG =
    // false) read again from shared memory at each k-step, where Q_i stays for the loop
    constexpr bool QREG = qreg<D>();
    constexpr bool LATE = late<D>();
    // per-thread bases of the ldmatrix addresses (swz_base): Q_i's rows of this warp
    // (A operand), K_j's keys (B operand), V_j's keys (B operand, transposed)
    const unsigned qbase = swz_base<DS>(sQ, warp * RW + (lane & 15), lane >> 4);
    const unsigned kbase = swz_base<DS>(sK, (lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1);
    const unsigned vbase = swz_base<DS>(sV, (lane & 7) + (((lane >> 3) & 1) << 3), lane >> 4);
    unsigned qf[QREG ? MT : 1][QREG ? D / 16 : 1][4];
    if constexpr (QREG) {
#pragma unroll
        for (int mi = 0; mi < MT; ++mi)
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk)
                ldmatrix_x4(qf[mi][kk], swz_step(qbase, kk) + mi * 16 * DS * 2);
    }

    float o[MT][D / 8][4];
    float m[MT][2], l[MT][2];                        // running max (log2 domain), partial sums
    // CAP_ONLY, the softcap instance (dense launches), runs the copy engine's softcap
    // instance's rules for m (NOTES v71, v73): in bfloat16 (a softcap ≤ 54.4, with ALiBi
    // or without) the fixed max (tensor_core.cuh's cap_fixed_m, fixed_m_alibi), so a step
    // has no row max, α or rescale of O; in float16 (a softcap, no ALiBi) the lazy one
    // (softmax_lazy: after a tile's first step, O is rescaled only where an m-tile's rows
    // moved m)
    constexpr bool FIXED = CAP_ONLY && VAR && !VL && IsBf16<T>::value;
    constexpr bool LAZY = CAP_ONLY && VAR && !VL && !IsBf16<T>::value;
#pragma unroll
    for (int mi = 0; mi < MT; ++mi) {
#pragma unroll
        for (int t = 0; t < D / 8; ++t) o[mi][t][0] = o[mi][t][1] = o[mi][t][2] = o[mi][t][3] = 0.f;
        m[mi][0] = m[mi][1] = neg_inf<float>();
        if constexpr (FIXED) {   // per row with ALiBi (the slope read here: held across
            // the loop it spilled at D = 128 on sm_90)
            const float m_cap = cap_fixed_m(k_out);
            const float bias = slopes != nullptr ? k_out * slopes[opaque_ctaid_y()] : 0.f;
            const int r0 = i0 + warp * RW + mi * 16 + g;
            m[mi][0] = bias != 0.f ? fixed_m_alibi(m_cap, bias, r0, nk, band) : m_cap;
            m[mi][1] = bias != 0.f ? fixed_m_alibi(m_cap, bias, r0 + 8, nk, band) : m_cap;
        }
        l[mi][0] = l[mi][1] = 0.f;
    }

    for (int j = jlo; j <= jhi; ++j) {
        const int buf = (j - jlo) & 1;
        // stream tile j+1 into the other buffer behind tile j
        auto prefetch = [&]() {
            const int j0n = (j + 1) * Bc, colsn = min(Bc, (VL ? s_nk : Nk) - j0n);
            load_tile<T, D, Bc, 32 * warps<D>()>(sK + (buf ^ 1) * Bc * DS, (VL ? s_kv[0] : Kp) + (long long)j0n * ldk, ldk, colsn, nd);
            load_tile<T, D, Bc, 32 * warps<D>()>(sV + (buf ^ 1) * Bc * DS, (VL ? s_kv[1] : Vp) + (long long)j0n * ldv, ldv, colsn, ndv);
            cp_async_commit();
        };
        if constexpr (!LATE) {
            if (j < jhi) {
                prefetch();
                cp_async_wait<1>();
            } else {
                cp_async_wait<0>();
            }
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();

        // S = Q_i K_jᵀ: RW × Bc per warp, Bc/8 n-tiles of 8 keys per m-tile
        float s[MT][Bc / 8][4];
#pragma unroll
        for (int mi = 0; mi < MT; ++mi)
#pragma unroll
            for (int t = 0; t < Bc / 8; ++t) s[mi][t][0] = s[mi][t][1] = s[mi][t][2] = s[mi][t][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            if (VAR && kk * 16 >= d) break;          // (VAR, below D: K's columns past d are 0)
            unsigned qs[QREG ? 1 : MT][4];
            if constexpr (!QREG) {
#pragma unroll
                for (int mi = 0; mi < MT; ++mi)
                    ldmatrix_x4(qs[mi], swz_step(qbase, kk) + mi * 16 * DS * 2);
            }
#pragma unroll
            for (int t = 0; t < Bc / 8; t += 2) {
                unsigned b[4];   // (n-tile t: k lo, k hi), (n-tile t+1: k lo, k hi)
                ldmatrix_x4(b, swz_step(kbase + buf * Bc * DS * 2, kk) + t * 8 * DS * 2);
#pragma unroll
                for (int mi = 0; mi < MT; ++mi) {
                    const unsigned* a = QREG ? qf[QREG ? mi : 0][QREG ? kk : 0] : qs[QREG ? 0 : mi];
                    mma16816<T>(s[mi][t], a, b);
                    mma16816<T>(s[mi][t + 1], a, b + 2);
                }
            }
        }

        const int j0 = j * Bc;
        if constexpr (VAR) {   // before the mask: softcap(−∞) would be −softcap
            // slopes: one per problem, or (VL) per (sequence, problem)
            const VarScores vs{k_in, k_out, slopes != nullptr ? slopes[(VL ? sq.b * gridDim.y : 0) + opaque_ctaid_y()] : 0.f};
            // dist = r + (Nk − Nq) − c: one base per tile, immediates per element
            const float dist0 = (float)(i0 + warp * RW + g + (nk - nq) - j0 - tig * 2);
#pragma unroll
            for (int mi = 0; mi < MT; ++mi)
#pragma unroll
                for (int t = 0; t < Bc / 8; ++t)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        float th;
                        s[mi][t][e] = vs(s[mi][t][e], dist0 + (float)(mi * 16 + (e < 2 ? 0 : 8) - t * 8 - (e & 1)), &th);
                    }
        }
        // mask ragged keys and the band, elementwise, only where the tile needs it
        const bool ragged = j0 + Bc > (VL ? s_nk : Nk);
        const bool partial = ragged || (band.left >= 0 && j0 - (i0 + Br - 1) - band.off < -band.left)
                             || (band.right >= 0 && j0 + Bc - 1 - i0 - band.off > band.right);
        unsigned pf[MT][Bc / 16][4];                 // P as the A operand of P V
#pragma unroll
        for (int mi = 0; mi < MT; ++mi) {
            const int r0 = warp * RW + mi * 16 + g, r1 = r0 + 8;
            if (partial) {
#pragma unroll
                for (int t = 0; t < Bc / 8; ++t)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int c = j0 + t * 8 + tig * 2 + (e & 1);
                        const int r = i0 + (e < 2 ? r0 : r1);
                        if (c >= (VL ? s_nk : Nk) || !band.sees(r, c)) s[mi][t][e] = neg_inf<float>();
                    }
            }
            if constexpr (FIXED) {                   // m fixed: P, ℓ and nothing else
                const float ms0 = m[mi][0], ms1 = m[mi][1];
#pragma unroll
                for (int t = 0; t < Bc / 8; ++t) {
                    const float p0 = ex2(fmaf(s[mi][t][0], sl2, -ms0));
                    const float p1 = ex2(fmaf(s[mi][t][1], sl2, -ms0));
                    const float p2 = ex2(fmaf(s[mi][t][2], sl2, -ms1));
                    const float p3 = ex2(fmaf(s[mi][t][3], sl2, -ms1));
                    l[mi][0] += p0 + p1;
                    l[mi][1] += p2 + p3;
                    pf[mi][t >> 1][(t & 1) * 2 + 0] = pack<T>(p0, p1);
                    pf[mi][t >> 1][(t & 1) * 2 + 1] = pack<T>(p2, p3);
                }
                continue;
            }
            if constexpr (LAZY) {
                if (j > jlo) {                       // (a tile's first step: the online one)
                    float a0, a1;
                    softmax_lazy<T, Bc>(&s[mi][0][0], pf[mi], m[mi][0], m[mi][1], l[mi][0],
                                        l[mi][1], a0, a1, sl2);
                    if (!__all_sync(0xffffffffu, a0 == 1.f && a1 == 1.f)) {   // m moved
#pragma unroll
                        for (int t = 0; t < D / 8; ++t) {
                            o[mi][t][0] *= a0; o[mi][t][1] *= a0; o[mi][t][2] *= a1; o[mi][t][3] *= a1;
                        }
                    }
                    continue;
                }
            }
            // online softmax in the log2 domain: p = 2^(s·scale·log2e − m)
            float mx0 = m[mi][0], mx1 = m[mi][1];
#pragma unroll
            for (int t = 0; t < Bc / 8; ++t) {
                mx0 = fmaxf(mx0, fmaxf(s[mi][t][0], s[mi][t][1]) * sl2);
                mx1 = fmaxf(mx1, fmaxf(s[mi][t][2], s[mi][t][3]) * sl2);
            }
            quad_max(mx0, mx1);             // the 4 threads of a quad share a row
            const float ms0 = mx0 == neg_inf<float>() ? 0.f : mx0;   // no key yet: exp2(−∞) = 0
            const float ms1 = mx1 == neg_inf<float>() ? 0.f : mx1;
            const float a0 = ex2(m[mi][0] - ms0), a1 = ex2(m[mi][1] - ms1);
            m[mi][0] = mx0;
            m[mi][1] = mx1;
            l[mi][0] *= a0;
            l[mi][1] *= a1;
#pragma unroll
            for (int t = 0; t < D / 8; ++t) {
                o[mi][t][0] *= a0; o[mi][t][1] *= a0; o[mi][t][2] *= a1; o[mi][t][3] *= a1;
            }
#pragma unroll
            for (int t = 0; t < Bc / 8; ++t) {
                const float p0 = ex2(fmaf(s[mi][t][0], sl2, -ms0));
                const float p1 = ex2(fmaf(s[mi][t][1], sl2, -ms0));
                const float p2 = ex2(fmaf(s[mi][t][2], sl2, -ms1));
                const float p3 = ex2(fmaf(s[mi][t][3], sl2, -ms1));
                l[mi][0] += p0 + p1;
                l[mi][1] += p2 + p3;
                pf[mi][t >> 1][(t & 1) * 2 + 0] = pack<T>(p0, p1);   // row g
                pf[mi][t >> 1][(t & 1) * 2 + 1] = pack<T>(p2, p3);   // row g + 8
            }
        }

        // LATE: the prefetch is issued here, where S is dead and its registers are free;
        // buffer buf ^ 1 was last read in iteration j − 1, which every warp finished
        // before the barrier above, so no barrier is needed at the end of the iteration
        if constexpr (LATE) {
            if (j < jhi) prefetch();
        }

        // O_i += P V_j: k = keys (Bc/16 k-steps), n = D/8 tiles of 8 columns
#pragma unroll
        for (int kk = 0; kk < Bc / 16; ++kk) {
#pragma unroll
            for (int t = 0; t < D / 8; t += 2) {
                unsigned b[4];   // V rows are keys: .trans turns them into B fragments
                ldmatrix_x4_trans(b, swz_step(vbase + buf * Bc * DS * 2, t / 2) + kk * 16 * DS * 2);
#pragma unroll
                for (int mi = 0; mi < MT; ++mi) {
                    mma16816<T>(o[mi][t], pf[mi][kk], b);
                    mma16816<T>(o[mi][t + 1], pf[mi][kk], b + 2);
                }
            }
        }
        if constexpr (!LATE) __syncthreads();        // buffer buf is refilled next step
    }

    // finish: reduce ℓ over the quad, divide once, write O_i and L_i. The thread's row is
    // recomputed from tid (read through volatile asm, so not kept live across the loop,
    // where every register is taken)
    const unsigned tid_end = opaque_tid(), bx = opaque_ctaid_x(), by = opaque_ctaid_y();
    const unsigned nbx = opaque_nctaid_x();
    const int row_end = (tid_end >> 5) * RW + ((tid_end & 31) >> 2);
    const Seq se = seq_at<VL>(vl, nbx - 1 - bx, Nq, Nk, Br);
    const int i0e = se.tile * Br, rows_e = min(Br, se.Nq - i0e);
    const long long q_row_e = (long long)by * Nq + se.q0 + i0e;   // of L
    T* Oi = O + at_row0(at, by, AT_O) + (se.q0 + i0e) * (long long)ldo;
#pragma unroll
    for (int mi = 0; mi < MT; ++mi) {
        const int r0 = row_end + mi * 16, r1 = r0 + 8;
        float l0 = l[mi][0], l1 = l[mi][1];
        quad_sum(l0, l1);
        const float inv0 = l0 > 0.f ? 1.f / l0 : 0.f, inv1 = l1 > 0.f ? 1.f / l1 : 0.f;
#pragma unroll
        for (int t = 0; t < D / 8; ++t) {
            const int c = t * 8 + tig * 2;
            if (VAR && c >= opaque(dv)) break;       // the instance's columns past dv
            if (r0 < rows_e)
                *reinterpret_cast<unsigned*>(Oi + (long long)r0 * ldo + c) =
                    pack<T>(o[mi][t][0] * inv0, o[mi][t][1] * inv0);
            if (r1 < rows_e)
                *reinterpret_cast<unsigned*>(Oi + (long long)r1 * ldo + c) =
                    pack<T>(o[mi][t][2] * inv1, o[mi][t][3] * inv1);
        }
        if (tig == 0) {
            constexpr float LN2 = 0.6931471805599453f;
            if (r0 < rows_e) L[q_row_e + r0] = l0 > 0.f ? (m[mi][0] + log2f(l0)) * LN2 : neg_inf<float>();
            if (r1 < rows_e) L[q_row_e + r1] = l1 > 0.f ? (m[mi][1] + log2f(l1)) * LN2 : neg_inf<float>();
        }
    }
}

// flash2_bwd_tc<T, D>: the backward main loop on tensor cores (the pre-pass is
// flash2_bwd_preprocess_tc below, the post-pass the reference's). K/V-outer like
// flash2_bwd_main: one CTA per K/V tile j of Bc = 128 keys (64 above D = 128), 8 warps; the visited Q tiles
// stream through shared memory, double-buffered, in steps of BrB queries. Each step runs
// three products, each with the warps laid out so that every fragment a warp reads from
// shared memory feeds several MMAs (ldmatrix traffic, not the tensor cores, limits this
// loop):
//   1. Sᵀ = K_j Q_iᵀ and dPᵀ = V_j dO_iᵀ, warps 4 (32 keys) × 2 (BrB/2 queries); then
//      Pᵀ = exp2(Sᵀ·scale·log2e − L·log2e) and dSᵀ = Pᵀ ∘ (dPᵀ − D) elementwise, both
//      written to shared memory (keys × queries);
//   2. dV_j += Pᵀ dO_i and dK_j += dSᵀ Q_i, warps 4 (32 keys) × 2 (D/2 columns), dK_j and
//      dV_j kept in registers across the loop;
//   3. dQ_i += scale · dS K_j, warps BrB/32 (32 queries) × the rest along D, added to the
//      fp32 accumulator with atomics (two floats per instruction on sm_90).
// Two barriers per step: Pᵀ and dSᵀ complete before 2 and 3 read them; the next step's
// tiles landed and this step's readers done before they are overwritten.
//
// Deterministic mode (flash2_bwd_tc_det; sem zeroed, one int per (problem, step of BrB
// rows)): the K/V tiles that visit a step add into its rows of dQacc in decreasing j
// (common.cuh's wait_turn/pass_turn; the reference kernel takes increasing j). The
// bytes moved are those of the unordered atomics; the sum is the same bits on every run.
namespace tcb {
// query rows per step. dK_j, dV_j take D/2 registers per thread, Sᵀ and dPᵀ BrB/2: 128
// queries at D = 64, 64 at D = 128 (32 on Ampere at D = 128, where ptxas spills at 64;
// 64 on Ampere at D = 64, where 128 needs more shared memory than an A100 has); 32 at
// D = 256 (64 spilled in the varlen instances on sm_90, and needs 210 KB of shared
// memory); 64 at D = 160 and 192 (with 32, product 3 would split their columns into odd
// n-tile counts per warp; on Ampere these instances are built but not launched: their
// 163 KB of shared memory plus the static bytes exceed an A100's); 128 at D = 32 (64 on
// Ampere), 64 at 96. The macro overrides it for tuning.
#ifndef FLASHSIM_TCB_BRB
#define FLASHSIM_TCB_BRB 0
#endif
template <int D> __host__ __device__ constexpr int brb() {
    return FLASHSIM_TCB_BRB ? FLASHSIM_TCB_BRB
         : D > 128 ? (D == 256 || (FLASHSIM_TC_AMPERE && D == 192) ? 32 : 64)   // 256: 32
         : FLASHSIM_TC_AMPERE ? (D == 128 ? 32 : 64)
         : (D <= 64 ? 128 : 64);                           // 32 as 64, 96 as 128
}
// 8 warps, in products 1 and 2 four groups of KM m-tiles of 16 keys: KM = 2 (Bc = 128
// keys per CTA, half the dQ atomics of Bc = 64), or 1 above D = 128, where dK_j and dV_j
// of 32 keys would take 2·D registers (and on Ampere at D = 96, whose 128-key tile with
// its rows padded to 128 halves needs more shared memory than an A100 has)
constexpr int WARPS = 8, THREADS = 32 * WARPS;
template <int D> __host__ __device__ constexpr int km() { return D > 128 || (FLASHSIM_TC_AMPERE && D == 96) ? 1 : 2; }
template <int D> __host__ __device__ constexpr int bc() { return 4 * 16 * km<D>(); }
// product 3 (dQ): MQ m-tiles of 16 queries per warp, 2 (each K_j fragment feeds two MMAs)
// where the warps' column groups are then an even number of 8-column n-tiles, else 1
// (D = 96, 160, 224: with 2 a warp would take 3, 5 or 7 n-tiles, which the loop's
// x4 loads take in pairs)
template <int D> __host__ __device__ constexpr int mq() { return D * (brb<D>() / 32) % 128 == 0 ? 2 : 1; }
}  // namespace tcb

// The body of both backward kernels: DET = false adds into dQacc with unordered atomics
// (flash2_bwd_tc), DET = true in turns (flash2_bwd_tc_det, sem given). Two kernels, not a
// run-time branch on sem: the unordered kernel carries none of the turns' bookkeeping,
// and with j chosen at run time ptxas spilled at D = 128.
template <typename T, int D, bool DET, bool VAR, bool VL>
__device__ __forceinline__ void
bwd_tc(FLASHSIM_BWD_PARAMS) {
    using namespace tc;
    constexpr int Bc = tcb::bc<D>(), BrB = tcb::brb<D>(), THREADS = tcb::THREADS;
    constexpr int KM = tcb::km<D>(), KW = 16 * KM;   // key m-tiles, keys per warp group
    constexpr int SPS = BrB + 8;         // row stride of Pᵀ and dSᵀ: padded, no bank conflicts
    constexpr int QN = BrB / 16;         // product 1: n-tiles of 8 queries per warp (BrB/2)
    constexpr int DN = D / 16;           // product 2: n-tiles of 8 columns per warp (D/2)
    constexpr int MQ = tcb::mq<D>();     // product 3: m-tiles of 16 queries per warp,
    constexpr int WQ = BrB / (16 * MQ);  // warps along the queries (16·MQ each) ...
    constexpr int DQ = D / (tcb::WARPS / WQ) / 8;   // ... and n-tiles of 8 columns per warp
    static_assert(BrB % 32 == 0 && BrB <= 256 && QN % 2 == 0 && tcb::WARPS % WQ == 0
                  && DQ * 8 * (tcb::WARPS / WQ) == D && DQ % 2 == 0, "step shape");
    constexpr float LOG2E = 1.4426950408889634f;
    const float scale_log2 = scale * LOG2E;
    constexpr int DS = ds<D>();                   // the tiles' row stride (halves)
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T* sK = reinterpret_cast<T*>(smem_raw);       // Bc·DS
    T* sV = sK + Bc * DS;                         // Bc·DS
    T* sQ = sV + Bc * DS;                         // 2 × BrB·DS
    T* sdO = sQ + 2 * BrB * DS;                   // 2 × BrB·DS
    T* sP = sdO + 2 * BrB * DS;                   // Bc × SPS: Pᵀ, keys × queries
    T* sdS = sP + Bc * SPS;                       // Bc × SPS: dSᵀ
    float* sL = reinterpret_cast<float*>(sdS + Bc * SPS);   // 2 × BrB, L·log2(e)
    float* sD = sL + 2 * BrB;                               // 2 × BrB

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, tig = lane & 3;
    const int wk = warp & 3, wh = warp >> 2;      // KW-key group; half (queries in 1, D in 2)
    // deterministic mode adds into each Q step in decreasing j and so starts the highest
    // j first: the tile a CTA waits for was launched before it (no deadlock). Under a
    // causal mask, where tile j's first step is the diagonal, tile j + 1 reaches each
    // step one step ahead of tile j, so the turns rarely wait. In increasing j each
    // tile waited at every step for the one before it, a chain back to tile 0, the
    // longest: causal ran 2x slower than with atomics (NOTES.md, v6).
    // VL (a packed varlen batch): the K/V tile is sequence sq.b's, its rows from sq.q0
    // (sq.k0) within Q's (K's) problem p of Nq (Nk) rows; nq, nk its lengths (dense: Nq,
    // Nk); its Q steps' turn counters start at sq.t0 of sq.tiles per problem
    const int p = blockIdx.y;
    const Seq sq = seq_at<VL>(vl, DET ? gridDim.x - 1 - blockIdx.x : blockIdx.x, Nq, Nk, BrB);
    const int j = sq.tile, nq = sq.Nq, nk = sq.Nk;
    const int j0 = j * Bc, cols = min(Bc, nk - j0);
    const Band band{left, right, nk - nq};
    // head dims below D: in the VAR instance alone, as in the forward (the plain one
    // takes d = dv = D: its dQ loop spilled with the column test)
    const int nd = VAR ? d : D, ndv = VAR ? dv : D;
    // VAR (softcap and ALiBi): P from the finished scores, and dS through the softcap's
    // derivative 1 − tanh² (the scale is applied to dQ and dK at the end, as without)
    int ilo, ihi;                                 // visited Q tiles, in units of BrB rows
    band.q_range(j0, j0 + cols, nq, BrB, &ilo, &ihi);
    // the traffic, counted once before the loop, where registers are free (counter
    // updates inside or after it would hold registers it needs): K_j, V_j once, and per
    // visited step i = ilo..ihi (the last cut at Nq) Q_i, dO_i, L_i, D_i in and dQacc_i
    // in and out
    if (ihi >= ilo) bwd_tile_count<T>(io, cols, min(nq, (ihi + 1) * BrB) - ilo * BrB, d, dv);
    // (dK_j and dV_j, written after the loop, counted here too: the counters' pointer held
    // across the loop cost NVRTC's varlen build a spill)
    COUNT_IO(io, IO_dK_W, (long long)cols * d * sizeof(T));       // SRAM→HBM: dK_j (Bc·d)
    COUNT_IO(io, IO_dV_W, (long long)cols * dv * sizeof(T));     // SRAM→HBM: dV_j (Bc·dv)
    const int k0 = wk * KW + g;                   // this thread's keys: k0 + {0, 8, 16, 24} (KM = 2)
    // per-thread bases of the ldmatrix addresses (swz_base, or plain for the padded Pᵀ
    // and dSᵀ). Offsets a warp adds at run time (its key group, its half) go into the
    // base once; swz_step(swz_step(b, k0), k) = swz_step(b, k0 + k) holds where k0 is a
    // multiple of a power of two above every k added later. At D = 192 a warp's first
    // column step in products 2 and 3 (6 and 3 steps a warp) is not: there k0 + k is
    // formed at each use (QT_PRE, KT_PRE false).
    //   1: K_j, V_j rows of the warp's keys (A); Q_i, dO_i rows of its queries (B)
    //   2: Pᵀ, dSᵀ rows of its keys (A); dO_i, Q_i transposed, its columns (B)
    //   3: dSᵀ transposed, its queries (A); K_j transposed, its columns (B)
    // V_j, dO_i and dSᵀ sit a constant distance after K_j, Q_i and Pᵀ: their bases are
    // those plus an immediate.
    const unsigned kabase = swz_base<DS>(sK, wk * KW + (lane & 15), lane >> 4);
    const unsigned qbbase = swz_base<DS>(sQ, wh * (BrB / 2) + (lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1);
    const unsigned pabase = smem_addr(sP + (wk * KW + (lane & 15)) * SPS + ((lane >> 4) << 3));
    constexpr bool QT_PRE = ((DN / 2) & (DN / 2 - 1)) == 0, KT_PRE = ((DQ / 2) & (DQ / 2 - 1)) == 0;
    const unsigned qtbase0 = swz_base<DS>(sQ, (lane & 7) + (((lane >> 3) & 1) << 3), lane >> 4);
    const unsigned qtbase = QT_PRE ? swz_step(qtbase0, wh * (DN / 2)) : qtbase0;
    const int wq = warp % WQ, wd = warp / WQ;     // product 3: 32-query group, column group
    const unsigned dstbase = smem_addr(sdS + ((lane & 7) + ((lane >> 4) << 3)) * SPS + wq * 16 * MQ + (((lane >> 3) & 1) << 3));
    const unsigned ktbase0 = swz_base<DS>(sK, (lane & 7) + (((lane >> 3) & 1) << 3), lane >> 4);
    const unsigned ktbase = KT_PRE ? swz_step(ktbase0, wd * (DQ / 2)) : ktbase0;
    constexpr unsigned V_FROM_K = Bc * DS * 2, DO_FROM_Q = 2 * BrB * DS * 2, DS_FROM_P = Bc * SPS * 2;   // bytes
    const bool ragged = cols < Bc;                // keys past Nk in this tile

    float dv_acc[KM][DN][4], dk_acc[KM][DN][4];             // keys k0 + 16·mt (+8), columns wh·D/2 + 8t
#pragma unroll
    for (int mt = 0; mt < KM; ++mt)
#pragma unroll
        for (int t = 0; t < DN; ++t)
#pragma unroll
            for (int e = 0; e < 4; ++e) dv_acc[mt][t][e] = dk_acc[mt][t][e] = 0.f;

    // the sequence's first rows in Q_p and dO_p (strided: common.cuh's at table). Inside
    // the loop they are read from shared memory, written here and read after the loop's
    // first barrier: held in registers across it they made ptxas spill
    const T* Qs = Q + at_row0(at, p, AT_Q) + sq.q0 * (long long)ldq;
    const T* dOs = dO + at_row0(at, p, AT_dO) + sq.q0 * (long long)lddo;
    __shared__ const T* s_qdo[2];
    // VL: the sequence's first row of L, D and dQacc in problem p, its slope (VAR) and its
    // dQ turns (DET), found once here and read in each step from shared memory (held in
    // registers, or computed again per step from the table, they cost spills)
    __shared__ long long s_qrow;
    __shared__ float s_slope;
    __shared__ int* s_turn;
    if (tid == 0) {
        s_qdo[0] = Qs;
        s_qdo[1] = dOs;
        if constexpr (VL) {
            s_qrow = (long long)p * Nq + sq.q0;
            if constexpr (VAR) s_slope = slopes != nullptr ? slopes[sq.b * gridDim.y + p] : 0.f;
            if constexpr (DET) s_turn = sem + ((long long)p * sq.tiles + sq.t0);
        }
    }
    auto load_q_step = [&](int i, int buf, const T* Qs, const T* dOs, long long q_row0) {
        const int i0 = i * BrB, rows = min(BrB, nq - i0);
        const long long q_row = q_row0 + i0;                         // of L, D
        load_tile<T, D, BrB, THREADS>(sQ + buf * BrB * DS, Qs + (long long)i0 * ldq, ldq, rows, nd);      // HBM→SRAM: Q_i (Br·d)
        load_tile<T, D, BrB, THREADS>(sdO + buf * BrB * DS, dOs + (long long)i0 * lddo, lddo, rows, ndv);  // HBM→SRAM: dO_i (Br·dv)
        // L·log2(e), and +∞ for rows past Nq and rows that see no key (L = −∞): there
        // 2^(s − ∞) = 0 makes P, and so dS, zero without a per-element test
        for (int r = tid; r < BrB; r += THREADS) {
            const float l = r < rows ? L[q_row + r] : neg_inf<float>();
            sL[buf * BrB + r] = l == neg_inf<float>() ? -neg_inf<float>() : l * LOG2E;
            sD[buf * BrB + r] = r < rows ? Dv[q_row + r] : 0.f;
        }
        cp_async_commit();
    };

    if (ihi >= ilo && (nd < D || ndv < D)) {          // an instance wider than the head dims
        zero_cols<T, D, Bc, THREADS>(sK, nd);
        zero_cols<T, D, Bc, THREADS>(sV, ndv);
#pragma unroll
        for (int b = 0; b < 2; ++b) {
            zero_cols<T, D, BrB, THREADS>(sQ + b * BrB * DS, nd);
            zero_cols<T, D, BrB, THREADS>(sdO + b * BrB * DS, ndv);
        }
    }
    if (ihi >= ilo) {
        load_tile<T, D, Bc, THREADS>(sK, K + at_row0(at, p, AT_K) + (sq.k0 + j0) * (long long)ldk, ldk, cols, nd);  // HBM→SRAM: K_j (Bc·d)
        load_tile<T, D, Bc, THREADS>(sV, V + at_row0(at, p, AT_V) + (sq.k0 + j0) * (long long)ldv, ldv, cols, ndv);  // HBM→SRAM: V_j (Bc·dv)
        cp_async_commit();
        load_q_step(ilo, 0, Qs, dOs, (long long)p * Nq + sq.q0);
    }
    for (int i = ilo; i <= ihi; ++i) {
        const int buf = (i - ilo) & 1;
        const int i0 = i * BrB, rows = min(BrB, nq - i0);
        // once every warp is past this barrier, step i's tiles have landed and no warp
        // still reads buffer buf ^ 1 (step i − 1), Pᵀ or dSᵀ, so step i + 1 may stream in
        cp_async_wait<0>();
        __syncthreads();
        if (i < ihi) load_q_step(i + 1, buf ^ 1, s_qdo[0], s_qdo[1], VL ? s_qrow : (long long)p * Nq + sq.q0);

        // 1. Sᵀ and dPᵀ: m = the warp's KW keys (KM m-tiles), n = its BrB/2 queries, k = D
        {
            float s[KM][QN][4], dp[KM][QN][4];
#pragma unroll
            for (int mt = 0; mt < KM; ++mt)
#pragma unroll
                for (int t = 0; t < QN; ++t)
#pragma unroll
                    for (int e = 0; e < 4; ++e) s[mt][t][e] = dp[mt][t][e] = 0.f;
            const unsigned qb = qbbase + buf * BrB * DS * 2;
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                unsigned a[KM][4];
#pragma unroll
                for (int mt = 0; mt < KM; ++mt) ldmatrix_x4(a[mt], swz_step(kabase, kk) + mt * 16 * DS * 2);
#pragma unroll
                for (int t = 0; t < QN; t += 2) {
                    unsigned b[4];
                    ldmatrix_x4(b, swz_step(qb, kk) + t * 8 * DS * 2);
#pragma unroll
                    for (int mt = 0; mt < KM; ++mt) {
                        mma16816<T>(s[mt][t], a[mt], b);
                        mma16816<T>(s[mt][t + 1], a[mt], b + 2);
                    }
                }
#pragma unroll
                for (int mt = 0; mt < KM; ++mt) ldmatrix_x4(a[mt], swz_step(kabase, kk) + mt * 16 * DS * 2 + V_FROM_K);
#pragma unroll
                for (int t = 0; t < QN; t += 2) {
                    unsigned b[4];
                    ldmatrix_x4(b, swz_step(qb, kk) + t * 8 * DS * 2 + DO_FROM_Q);
#pragma unroll
                    for (int mt = 0; mt < KM; ++mt) {
                        mma16816<T>(dp[mt][t], a[mt], b);
                        mma16816<T>(dp[mt][t + 1], a[mt], b + 2);
                    }
                }
            }
            // Keys past Nk and pairs outside the band are zeroed elementwise only in the
            // tiles that have them
            const bool partial = ragged
                || (band.left >= 0 && j0 - (i0 + BrB - 1) - band.off < -band.left)
                || (band.right >= 0 && j0 + Bc - 1 - i0 - band.off > band.right);
            const float* sLb = sL + buf * BrB;
            const float* sDb = sD + buf * BrB;
            // VAR: the scores' constants, and dist = q + (Nk − Nq) − key as one base per
            // step plus immediates per element
            VarScores vs{};
            float dist0 = 0.f;
            if constexpr (VAR) {
                vs = VarScores{k_in, k_out, VL ? s_slope : slopes != nullptr ? slopes[opaque_ctaid_y()] : 0.f};
                dist0 = (float)(i0 + wh * (BrB / 2) + tig * 2 + (nk - nq) - j0 - k0);
            }
            if constexpr (!VL) {
                // Three passes over the warp's scores, so that the first is one branch-free block
                // of independent chains: P into s (VAR: dP − D times the softcap's 1 − tanh² into
                // dp); in tiles that have them, the masked scores' P set to 0; Pᵀ and dSᵀ =
                // P (dP − D) stored. (A mask test per score split the first pass into a block
                // per score, each a serial tanh → ex2 chain with nothing beside it: NOTES v76)
#pragma unroll
                for (int t = 0; t < QN; ++t) {
                    const int qc = wh * (BrB / 2) + t * 8 + tig * 2;   // this thread's two queries
                    const float2 l2 = *reinterpret_cast<const float2*>(sLb + qc);
                    float2 dd;
                    if constexpr (VAR) dd = *reinterpret_cast<const float2*>(sDb + qc);
#pragma unroll
                    for (int mt = 0; mt < KM; ++mt)
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const float l = (e & 1) ? l2.y : l2.x;
                            if constexpr (VAR) {
                                float th = 0.f;
                                const float x = vs(s[mt][t][e], dist0 + (float)(t * 8 + (e & 1) - mt * 16 - (e < 2 ? 0 : 8)), &th);
                                s[mt][t][e] = ex2(fmaf(x, vs.scale(), -l));
                                // 1 − tanh²: 1 without a softcap (th = 0)
                                dp[mt][t][e] = (dp[mt][t][e] - ((e & 1) ? dd.y : dd.x)) * fmaf(-th, th, 1.f);
                            } else {
                                s[mt][t][e] = ex2(fmaf(s[mt][t][e], scale_log2, -l));
                            }
                        }
                }
                if (partial) {
#pragma unroll
                    for (int t = 0; t < QN; ++t)
#pragma unroll
                        for (int mt = 0; mt < KM; ++mt)
#pragma unroll
                            for (int e = 0; e < 4; ++e) {
                                const int key = j0 + k0 + mt * 16 + (e < 2 ? 0 : 8);
                                const int q = i0 + wh * (BrB / 2) + t * 8 + tig * 2 + (e & 1);
                                if (key >= nk || !band.sees(q, key)) s[mt][t][e] = 0.f;
                            }
                }
#pragma unroll
                for (int t = 0; t < QN; ++t) {
                    const int qc = wh * (BrB / 2) + t * 8 + tig * 2;
                    float2 dd = make_float2(0.f, 0.f);         // (VAR: already in dp)
                    if constexpr (!VAR) dd = *reinterpret_cast<const float2*>(sDb + qc);
#pragma unroll
                    for (int mt = 0; mt < KM; ++mt) {
                        const float* pv = s[mt][t];
                        float dsv[4];
#pragma unroll
                        for (int e = 0; e < 4; ++e) dsv[e] = pv[e] * (dp[mt][t][e] - ((e & 1) ? dd.y : dd.x));
                        T* pr = sP + (k0 + mt * 16) * SPS + qc;
                        *reinterpret_cast<unsigned*>(pr) = pack<T>(pv[0], pv[1]);
                        *reinterpret_cast<unsigned*>(pr + 8 * SPS) = pack<T>(pv[2], pv[3]);
                        *reinterpret_cast<unsigned*>(pr + Bc * SPS) = pack<T>(dsv[0], dsv[1]);
                        *reinterpret_cast<unsigned*>(pr + Bc * SPS + 8 * SPS) = pack<T>(dsv[2], dsv[3]);
                    }
                }
            } else {   // varlen: one pass, the mask per score (three spilled 16 bytes on sm_90)
#pragma unroll
                for (int t = 0; t < QN; ++t) {
                    const int qc = wh * (BrB / 2) + t * 8 + tig * 2;   // this thread's two queries
                    const float2 l2 = *reinterpret_cast<const float2*>(sLb + qc);
                    const float2 dd = *reinterpret_cast<const float2*>(sDb + qc);
#pragma unroll
                    for (int mt = 0; mt < KM; ++mt) {
                        float pv[4], dsv[4];
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const int key = j0 + k0 + mt * 16 + (e < 2 ? 0 : 8), q = i0 + qc + (e & 1);
                            float dcap = 1.f;
                            if constexpr (VAR) {
                                float th = 0.f;
                                const float x = vs(s[mt][t][e], dist0 + (float)(t * 8 + (e & 1) - mt * 16 - (e < 2 ? 0 : 8)), &th);
                                pv[e] = ex2(fmaf(x, vs.scale(), -((e & 1) ? l2.y : l2.x)));
                                dcap = fmaf(-th, th, 1.f);   // 1 without a softcap (th = 0)
                            } else {
                                pv[e] = ex2(fmaf(s[mt][t][e], scale_log2, -((e & 1) ? l2.y : l2.x)));
                            }
                            if (partial && (key >= nk || !band.sees(q, key))) pv[e] = 0.f;
                            // (the three passes' order of roundings: the same bits as a
                            // dense launch of each sequence)
                            dsv[e] = pv[e] * ((dp[mt][t][e] - ((e & 1) ? dd.y : dd.x)) * dcap);
                        }
                        T* pr = sP + (k0 + mt * 16) * SPS + qc;
                        *reinterpret_cast<unsigned*>(pr) = pack<T>(pv[0], pv[1]);
                        *reinterpret_cast<unsigned*>(pr + 8 * SPS) = pack<T>(pv[2], pv[3]);
                        *reinterpret_cast<unsigned*>(pr + Bc * SPS) = pack<T>(dsv[0], dsv[1]);
                        *reinterpret_cast<unsigned*>(pr + Bc * SPS + 8 * SPS) = pack<T>(dsv[2], dsv[3]);
                    }
                }
            }
        }
        __syncthreads();                                      // Pᵀ and dSᵀ are complete

        // 2. dV_j += Pᵀ dO_i, dK_j += dSᵀ Q_i: m = the warp's KW keys, n = its D/2
        //    columns, k = BrB queries (.trans: the rows of dO_i and Q_i are queries)
        {
            const unsigned qt = qtbase + buf * BrB * DS * 2;
#pragma unroll
            for (int kk = 0; kk < BrB / 16; ++kk) {
                unsigned a[KM][4];
#pragma unroll
                for (int mt = 0; mt < KM; ++mt) ldmatrix_x4(a[mt], pabase + (mt * 16 * SPS + kk * 16) * 2);
#pragma unroll
                for (int t = 0; t < DN; t += 2) {
                    unsigned b[4];
                    ldmatrix_x4_trans(b, swz_step(qt, QT_PRE ? t / 2 : wh * (DN / 2) + t / 2) + kk * 16 * DS * 2 + DO_FROM_Q);
#pragma unroll
                    for (int mt = 0; mt < KM; ++mt) {
                        mma16816<T>(dv_acc[mt][t], a[mt], b);
                        mma16816<T>(dv_acc[mt][t + 1], a[mt], b + 2);
                    }
                }
#pragma unroll
                for (int mt = 0; mt < KM; ++mt) ldmatrix_x4(a[mt], pabase + (mt * 16 * SPS + kk * 16) * 2 + DS_FROM_P);
#pragma unroll
                for (int t = 0; t < DN; t += 2) {
                    unsigned b[4];
                    ldmatrix_x4_trans(b, swz_step(qt, QT_PRE ? t / 2 : wh * (DN / 2) + t / 2) + kk * 16 * DS * 2);
#pragma unroll
                    for (int mt = 0; mt < KM; ++mt) {
                        mma16816<T>(dk_acc[mt][t], a[mt], b);
                        mma16816<T>(dk_acc[mt][t + 1], a[mt], b + 2);
                    }
                }
            }
        }

        // 3. dQ_i += scale · dS K_j: m = the warp's 16·MQ queries, n = its D/(8/WQ) columns,
        //    k = Bc keys (.trans: dS from dSᵀ, K_j's rows are keys)
        {
            const long long q_row = (VL ? s_qrow : (long long)p * Nq + sq.q0) + i0;
            int mine = 0;
            // (VL: the turn found after the products, from s_turn: live across them, it
            // cost NVRTC's build a spill)
            int* turn = VL ? nullptr : dq_turn<DET, VL>(sem, vl, p, Nq, Nk, BrB, Bc, i, j, rows, nk, band, &mine);
            float dq[MQ][DQ][4];
#pragma unroll
            for (int mt = 0; mt < MQ; ++mt)
#pragma unroll
                for (int t = 0; t < DQ; ++t) dq[mt][t][0] = dq[mt][t][1] = dq[mt][t][2] = dq[mt][t][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < Bc / 16; ++kk) {
                unsigned a[MQ][4];
#pragma unroll
                for (int mt = 0; mt < MQ; ++mt) ldmatrix_x4_trans(a[mt], dstbase + (kk * 16 * SPS + mt * 16) * 2);
#pragma unroll
                for (int t = 0; t < DQ; t += 2) {
                    unsigned b[4];
                    ldmatrix_x4_trans(b, swz_step(ktbase, KT_PRE ? t / 2 : wd * (DQ / 2) + t / 2) + kk * 16 * DS * 2);
#pragma unroll
                    for (int mt = 0; mt < MQ; ++mt) {
                        mma16816<T>(dq[mt][t], a[mt], b);
                        mma16816<T>(dq[mt][t + 1], a[mt], b + 2);
                    }
                }
            }
            if constexpr (VL) turn = dq_turn<DET, VL, true>(DET ? s_turn : sem, vl, p, Nq, Nk, BrB, Bc, i, j, rows, nk, band, &mine);
            if constexpr (DET) wait_turn(turn, mine);
            // VAR: this warp's column tiles below d (warp-uniform: d is a multiple of 8)
            const int tn = VAR ? (opaque(d) >> 3) - (int)(opaque_tid() >> 5) / WQ * DQ : DQ;
#pragma unroll
            for (int mt = 0; mt < MQ; ++mt) {
                const int r0 = wq * 16 * MQ + mt * 16 + g, r1 = r0 + 8;
#pragma unroll
                for (int t = 0; t < DQ; ++t) {
                    const int c = wd * DQ * 8 + t * 8 + tig * 2;
                    const int lim = !VAR || t < tn ? rows : 0;  // (VAR: columns past d)
                    if (r0 < lim) add2(dQacc + (q_row + r0) * d + c, scale * dq[mt][t][0], scale * dq[mt][t][1]);
                    if (r1 < lim) add2(dQacc + (q_row + r1) * d + c, scale * dq[mt][t][2], scale * dq[mt][t][3]);
                }
            }
            if constexpr (DET) pass_turn(turn, mine);          // tile j − 1 adds next
        }
    }
    // dK_j = scale · Σ dSᵀ Q, dV_j = Σ Pᵀ dO, per query problem (GQA sums later)
    // (the table read here, not hoisted above the loop into registers it needs; VL: the
    // sequence's first key too, which held across the loop cost a spill)
    const long long kj0 = seq_again<VL>(vl, DET, Nq, Nk, BrB).k0 + j0;
    T* dKj = dK + at_row0_here(at, opaque_ctaid_y(), AT_dK) + kj0 * lddk;
    T* dVj = dV + at_row0_here(at, opaque_ctaid_y(), AT_dV) + kj0 * lddv;
#pragma unroll
    for (int mt = 0; mt < KM; ++mt) {
        const int r0 = k0 + mt * 16, r1 = r0 + 8;
#pragma unroll
        for (int t = 0; t < DN; ++t) {
            const int c = wh * (D / 2) + t * 8 + tig * 2;   // (columns past d, dv: not stored)
            if (r0 < cols) {
                if (c < d) *reinterpret_cast<unsigned*>(dKj + (long long)r0 * lddk + c) = pack<T>(scale * dk_acc[mt][t][0], scale * dk_acc[mt][t][1]);
                if (c < dv) *reinterpret_cast<unsigned*>(dVj + (long long)r0 * lddv + c) = pack<T>(dv_acc[mt][t][0], dv_acc[mt][t][1]);
            }
            if (r1 < cols) {
                if (c < d) *reinterpret_cast<unsigned*>(dKj + (long long)r1 * lddk + c) = pack<T>(scale * dk_acc[mt][t][2], scale * dk_acc[mt][t][3]);
                if (c < dv) *reinterpret_cast<unsigned*>(dVj + (long long)r1 * lddv + c) = pack<T>(dv_acc[mt][t][2], dv_acc[mt][t][3]);
            }
        }
    }
}

// dQ by unordered fp32 atomics (sem is not read; pass a null pointer)
template <typename T, int D, bool VAR, bool VL>
__global__ void __launch_bounds__(tcb::THREADS, 1) flash2_bwd_tc(FLASHSIM_BWD_PARAMS) {
    bwd_tc<T, D, false, VAR, VL>(FLASHSIM_BWD_ARGS);
}

// dQ in turns, the same bits on every run (sem: one zeroed int per (problem, step))
template <typename T, int D, bool VAR, bool VL>
__global__ void __launch_bounds__(tcb::THREADS, 1) flash2_bwd_tc_det(FLASHSIM_BWD_PARAMS) {
    bwd_tc<T, D, true, VAR, VL>(FLASHSIM_BWD_ARGS);
}

// flash2_bwd_preprocess_tc<T, D>: the backward pre-pass of the tensor-core rung, the
// reference's flash2_bwd_preprocess with 16-byte accesses: D_i = rowsum(dO_i ∘ O_i) in
// fp32, and dQacc_i zeroed (in rows, or tiled: flash2_bwd_ws's blocks of instance D = tiled). D/8 lanes share a row, each reading 8 elements of O and dO
// at once (the reference reads one element per thread, rows d apart: uncoalesced).
// Grid (⌈Nq/Br⌉, problems), 128 threads, Br = PRE_BR rows per CTA.
namespace tcb {
constexpr int PRE_BR = 64, PRE_THREADS = 128;
}

template <typename T, int D>
__global__ void __launch_bounds__(tcb::PRE_THREADS, 16)   // 16 CTAs an SM: at most 32 registers
flash2_bwd_preprocess_tc(const T* __restrict__ O, const T* __restrict__ dO,
                         const long long* __restrict__ at, float* __restrict__ Dv,
                         float* __restrict__ dQacc, int Nq, int ldo, int lddo, int d, int dv,
                         int tiled, unsigned long long* io) {
    constexpr int LPR = D / 8, RPP = tcb::PRE_THREADS / LPR;    // lanes per row, rows per pass
    const int i0 = blockIdx.x * tcb::PRE_BR, rows = min(tcb::PRE_BR, Nq - i0);
    const long long row = (long long)blockIdx.y * Nq + i0;     // of D, dQacc
    const T* Oi = O + at_row0(at, blockIdx.y, AT_O) + (long long)i0 * ldo;
    const T* dOi = dO + at_row0(at, blockIdx.y, AT_dO) + (long long)i0 * lddo;
    const int c = threadIdx.x % LPR;
    for (int r = threadIdx.x / LPR; r < tcb::PRE_BR; r += RPP) {   // every lane of a row group
        float acc = 0.f;                                            // reaches the shuffles
        if (r < rows && c * 8 < dv) {                               // (columns past dv: none)
            const uint4 o = *reinterpret_cast<const uint4*>(Oi + (long long)r * ldo + c * 8);
            const uint4 g = *reinterpret_cast<const uint4*>(dOi + (long long)r * lddo + c * 8);
            const T* oe = reinterpret_cast<const T*>(&o);
            const T* ge = reinterpret_cast<const T*>(&g);
#pragma unroll
            for (int e = 0; e < 8; ++e) acc = fmaf(to_acc<float>(ge[e]), to_acc<float>(oe[e]), acc);
        }
#pragma unroll
        for (int off = LPR / 2; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffff, acc, off);
        if (r < rows && c == 0) Dv[row + r] = acc;
    }
    // dQacc in rows of d floats (d % 8 = 0), or (tiled = the instance D of flash2_bwd_ws) in
    // its blocks of DQ_BLOCK floats per problem and step of dq_rows(D) rows, every float of
    // every block: CTA x zeroes floats x·PRE_BR·D … of its problem's blocks, the last CTA
    // up to their end (at D = 64 a block spans two CTAs' rows, and an odd count leaves the
    // last block's second half to it)
    const long long area = tiled ? (long long)((Nq + dq_rows(tiled) - 1) / dq_rows(tiled)) * DQ_BLOCK : 0;
    const long long z0 = (long long)blockIdx.x * tcb::PRE_BR * tiled;
    float4* z = reinterpret_cast<float4*>(tiled ? dQacc + blockIdx.y * area + z0 : dQacc + row * d);
    const int n4 = tiled ? (int)((blockIdx.x + 1 == gridDim.x ? area - z0 : tcb::PRE_BR * tiled) / 4) : rows * d / 4;
    for (int x = threadIdx.x; x < n4; x += tcb::PRE_THREADS) z[x] = make_float4(0.f, 0.f, 0.f, 0.f);
    COUNT_IO(io, IO_O_R, (long long)rows * dv * sizeof(T));      // HBM→SRAM: O_i (Br·dv)
    COUNT_IO(io, IO_dO_R, (long long)rows * dv * sizeof(T));     // HBM→SRAM: dO_i (Br·dv)
    COUNT_IO(io, IO_D_W, (long long)rows * 4);                   // SRAM→HBM: D_i (Br)
    COUNT_IO(io, IO_dQacc_W, (long long)rows * d * 4);           // SRAM→HBM: dQacc_i = 0 (Br·d fp32)
}
