// Helpers shared by the tensor-core rungs (flash2_tc.cu, flash2_wg.cu, flash2_ws.cu):
// shared-memory addresses, 16-byte cp.async, exp2 in one instruction, the variants'
// scores, the softcap instances' fixed and lazy softmax max, and packing two fp32 values
// into the I/O type's pair.
#pragma once

#include "common.cuh"

#ifndef FLASHSIM_HOST
__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16 bytes global → shared (dst a shared-space address); src-size 0 fills the 16 bytes
// with zeros: rows past N cost no read
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
    cp_async16(smem_addr(dst), src, valid);
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N));
}

// 2^x in one MUFU.EX2: exp2f without fast-math adds a range test and two multiplies per
// element to keep denormal results. Flushing P < 2^-126 to zero is far below rounding:
// a row's P sums to at least 1 (forward, the maximum contributes 1) or to 1 (backward)
__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// Special registers read through volatile asm: the compiler may not hoist the read, and
// so keeps no value derived from it live across the caller's loops (registers are short
// there); it reads the register again where the value is needed.
#define FLASHSIM_OPAQUE_SREG(name, reg)                                                 \
    __device__ __forceinline__ unsigned name() {                                        \
        unsigned v;                                                                     \
        asm volatile("mov.u32 %0, %%" reg ";\n" : "=r"(v));                             \
        return v;                                                                       \
    }
FLASHSIM_OPAQUE_SREG(opaque_tid, "tid.x")
FLASHSIM_OPAQUE_SREG(opaque_ctaid_x, "ctaid.x")
FLASHSIM_OPAQUE_SREG(opaque_ctaid_y, "ctaid.y")
FLASHSIM_OPAQUE_SREG(opaque_nctaid_x, "nctaid.x")
#undef FLASHSIM_OPAQUE_SREG
// x as a value the compiler cannot derive anything from ahead of this point: a
// parameter (the head dims) read where it is used, not hoisted into a register held
// across a loop at 255 registers
__device__ __forceinline__ int opaque(int x) {
    asm volatile("" : "+r"(x));
    return x;
}
#else
// The CPU emulation (host_emu.h). A shared-space address is the byte offset from the
// block's dynamic shared memory, which the loader aligns to 1024 bytes as the GPU does,
// so the kernels' swizzle arithmetic on addresses works unchanged.
inline unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(static_cast<const unsigned char*>(p) - emu::smem_base());
}
inline void* smem_ptr(unsigned addr) { return emu::smem_base() + addr; }
// the copy happens at once, and 2^x flushes what the GPU's ex2.approx.ftz flushes
inline void cp_async16(void* dst, const void* src, bool valid) {
    if (valid) std::memcpy(dst, src, 16);
    else std::memset(dst, 0, 16);
}
inline void cp_async16(unsigned dst, const void* src, bool valid) {
    cp_async16(smem_ptr(dst), src, valid);
}
inline unsigned opaque_tid() { return threadIdx.x; }
inline unsigned opaque_ctaid_x() { return blockIdx.x; }
inline unsigned opaque_ctaid_y() { return blockIdx.y; }
inline unsigned opaque_nctaid_x() { return gridDim.x; }
inline int opaque(int x) { return x; }
inline void cp_async_commit() {}
template <int N> inline void cp_async_wait() {}
inline float ex2(float x) {
    const float y = std::exp2(x);
    return y < 1.17549435e-38f ? 0.0f : y;
}
#endif

// tanh(x) for the softcap (VarScores): one MUFU.TANH (sm_75 on), maximum relative error
// 1.1e-5 (measured on an H100: analysis/tanh_error.py, kernels_cu/NOTES.md v18); the
// softmax then sees softcap·tanh to within softcap·1.1e-5 in its logits, below one
// float16 rounding of P for softcaps up to ~44 (and bfloat16's up to ~350). The CPU
// emulation takes libm's tanh.
#ifndef FLASHSIM_HOST
__device__ __forceinline__ float tanh_fast(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
#else
inline float tanh_fast(float x) { return std::tanh(x); }
#endif

// The variants' scores on the fast rungs, in log2 units (the exponent ex2 takes): for
// s = q·k and dist = r + off − c,
//   softcap·log2(e)·tanh(scale·s / softcap) − slope·log2(e)·|dist|
// (the order of common.cuh's Scores), or scale·log2(e)·s − … without a softcap. The
// score is returned over scale() (softcap·log2(e), or 1), which the softmax's FFMA
// x·scale() − m applies as it applies scale·log2(e) to plain scores: the max of
// scale()·x is scale()·(the max of x), so one multiply per score less. The kernels take
// k_in and k_out as parameters and the slopes already in these units (over scale():
// flashsim/gpu/flash2.py's _fast_variants): read from the parameter bank where used,
// they hold no register across the loop in instances already at 255. *t receives the
// tanh (the backward's 1 − tanh²).
struct VarScores {
    float k_in;     // scale / softcap (the tanh's argument), or scale·log2(e)
    float k_out;    // softcap·log2(e); 0: no softcap
    float k_bias;   // slope·log2(e) / scale(); 0: no ALiBi
    __device__ __forceinline__ float scale() const { return k_out != 0.f ? k_out : 1.f; }
    // dist as a float (an exact integer below 2^24): the callers add compile-time offsets
    // to a per-tile base with FADDs; an int → float conversion per score ran on the
    // quarter-rate conversion pipe, beside MUFU's
    __device__ __forceinline__ float operator()(float s, float dist, float* t) const {
        float x;
        if (k_out != 0.f) {
            *t = tanh_fast(s * k_in);
            x = *t;
        } else {
            x = s * k_in;
        }
        if (k_bias != 0.f) x = fmaf(-k_bias, fabsf(dist), x);
        return x;
    }
};

// -- the fixed softmax max under a softcap (flash2_fwd_ws, flash2_fwd_wg, flash2_fwd_tc) --
// A softcap c bounds every logit to [−c, c]: in log2 units x ∈ [−C, C], C = c·log2(e)
// (VarScores' k_out). bfloat16 has float's exponent range, so P = 2^(x − m) needs no
// running max there: with m = min(C, 125 − C) every P lies in [2^−125, 2^max(0, 2C − 125)],
// normal in float and in bfloat16. Without the running max a step has no row max to
// reduce, no α and no rescale of O, and the softcap's chain tanh → row max → ex2 becomes
// tanh → ex2 per score (NOTES v56). flashsim.kernels.cap_only says where it runs
// (2C − 125 ≤ 32: c ≤ 54.4, Gemma 2's 50 and Grok's 30 included; P ≤ 2^32 leaves ℓ and O
// finite unless |V| ≥ 2^(96 − log2 Nk)); float16's range, 2^−24 … 2^16, is too narrow (its
// softcap takes softmax_lazy, below, NOTES v57, v59).
__device__ __forceinline__ float cap_fixed_m(float k_out) { return fminf(k_out, 125.f - k_out); }

// The fixed max of query row r under a softcap with ALiBi (NOTES v66): its logits (log2
// units) are C·tanh(·) − bias·|r + off − key| over its visible keys, so they lie in
// [−C + B, C + B], B the largest of −bias·|dist| there (at the nearest key for bias ≥ 0,
// the farthest below 0): the softcap alone's bounds shifted by B, which m + B keeps, as
// both of cap_fixed_m's guarantees do. A row with no visible key keeps m (its ℓ stays 0).
// ``bias``: the slope in log2 units, slope·log2(e).
__device__ __forceinline__ float fixed_m_alibi(float m, float bias, int r, int nk,
                                               const Band& band) {
    const int dq = r + band.off;                         // the row's diagonal key (ALiBi's 0)
    const int klo = band.left < 0 ? 0 : max(0, dq - band.left);
    const int khi = band.right < 0 ? nk - 1 : min(nk - 1, dq + band.right);
    if (klo > khi) return m;
    const int dnear = dq < klo ? klo - dq : (dq > khi ? dq - khi : 0);
    const int dfar = max(abs(dq - klo), abs(dq - khi));
    return m - bias * (float)(bias >= 0.f ? dnear : dfar);
}

// The sequence of this CTA (blockIdx.x, or from the end: ``reversed``) read again from a
// varlen batch's table (common.cuh's seq_at), for fields used once per step (the slope's
// sequence, the turn counters): held across a main loop at 255 registers they spilled
template <bool VL>
__device__ __forceinline__ Seq seq_again(const int* vl, bool reversed, int Nq, int Nk, int Br) {
    const unsigned x = opaque_ctaid_x();
    return seq_at<VL>(vl, reversed ? opaque_nctaid_x() - 1 - x : x, Nq, Nk, Br);
}

// dQacc[x], dQacc[x + 1] += (a, b) (the fast backwards' dQ): one vector reduction on
// sm_90, two before it
__device__ __forceinline__ void add2(float* x, float a, float b) {
#if __CUDA_ARCH__ >= 900
    atomicAdd(reinterpret_cast<float2*>(x), make_float2(a, b));
#else
    atomicAdd(x, a);
    atomicAdd(x + 1, b);
#endif
}

// The deterministic backward's turn counter for Q step i (of BrB rows, `rows` of them
// real) of query problem p, and in *mine the turn of K/V tile j (of Bc keys) there: the
// number of tiles after j that visit the step, which add first (common.cuh's wait_turn).
// Dense: one counter per (problem, step); VL: per problem, the sequence's steps from its
// first. (The problem re-read from the special register: held across the callers' loops
// it cost a spill.) HELD (VL): sem is already the sequence's first counter in problem p,
// which the caller found once (flash2_bwd_tc_det, whose NVRTC build spilled otherwise)
template <bool DET, bool VL, bool HELD = false>
__device__ __forceinline__ int* dq_turn(int* sem, const int* vl, int p, int Nq, int Nk, int BrB,
                                        int Bc, int i, int j, int rows, int nk,
                                        const Band& band, int* mine) {
    int* turn = sem + ((long long)opaque_ctaid_y() * ((Nq + BrB - 1) / BrB) + i);
    if constexpr (DET && VL && HELD) {
        turn = sem + i;
    } else if constexpr (DET && VL) {
        const Seq st = seq_again<VL>(vl, true, Nq, Nk, BrB);
        turn = sem + ((long long)p * st.tiles + st.t0 + i);
    }
    if constexpr (DET) {
        int jlo, jhi;
        band.kv_range(i * BrB, i * BrB + rows, nk, Bc, &jlo, &jhi);
        *mine = jhi - j;
    }
    return turn;
}

// (lo, hi) rounded to T and packed into one register, lo in the low half: the layout of
// an MMA operand pair
template <typename T> __device__ __forceinline__ unsigned pack(float lo, float hi);
template <> __device__ __forceinline__ unsigned pack<__half>(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&h);
}
template <> __device__ __forceinline__ unsigned pack<__nv_bfloat16>(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&h);
}

// The 4 threads of an MMA quad hold one row's columns (rows g and g + 8 for the pair):
// each row's max, or sum, over the quad, left in all four threads
__device__ __forceinline__ void quad_max(float& r0, float& r1) {
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
        r0 = fmaxf(r0, __shfl_xor_sync(0xffffffff, r0, off));
        r1 = fmaxf(r1, __shfl_xor_sync(0xffffffff, r1, off));
    }
}
__device__ __forceinline__ void quad_sum(float& r0, float& r1) {
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
        r0 += __shfl_xor_sync(0xffffffff, r0, off);
        r1 += __shfl_xor_sync(0xffffffff, r1, off);
    }
}

// The softmax with a lazy running max over one m16 tile of a warp's S (the mma C layout:
// rows g, g + 8, keys 8t + 2·tig, +1): the float16 softcap instances' (flash2_fwd_ws,
// flash2_fwd_wg, flash2_fwd_tc), whose range holds no fixed max; not a tile's first
// step, which takes the online one (wgmma.cuh's wg_softmax). P =
// 2^(S·sl2 − m) with the m of the steps before, so that the exponentials wait for no row
// max, packed to T into pf as they come, and each thread's shares of the rows' Σ P summed
// (the caller has finished the scores, tanh and mask, with wg_scores before it waited for
// the product that reads pf, so that the softcap's MUFU work runs beside that product:
// NOTES v62). A share (Bc/4 keys) bounds each of its P, as every P ≥ 0: where no thread of
// the warp holds a share above 2^12, every P ≤ 2^12 (float16's range ends at 2^16), α = 1,
// and the step is done with no row max (NOTES v59). Otherwise, or where a row of the warp
// has seen no key yet (m = −∞: its P were taken against 0), the warp reduces its rows' max
// from their scores, still in s, and each row whose max passed m takes the online step:
// m moves to the row max, α = 2^(m_old − m), P and ℓ = ℓ_old·α + Σ P again. m only moves
// up, to a row max, and L = m + log2 ℓ holds for any m. FRAME (flash2_fwd_ws's ALiBi
// alone on one side of the diagonal: wgmma.cuh's wg_side): s holds each logit less this
// thread's frame offset for its row, f0 (row r0), f1 (r0 + 8) in log2 units, and m the
// logits' own max; the other instances' code is as before.
template <typename T, int Bc, bool FRAME = false>
__device__ __forceinline__ void softmax_lazy(const float* s, unsigned (*pf)[4], float& m0, float& m1,
                                             float& l0, float& l1, float& a0, float& a1, float sl2,
                                             float f0 = 0.f, float f1 = 0.f) {
    const float ms0 = FRAME ? (m0 == neg_inf<float>() ? 0.f : m0) - f0 : m0 == neg_inf<float>() ? 0.f : m0;
    const float ms1 = FRAME ? (m1 == neg_inf<float>() ? 0.f : m1) - f1 : m1 == neg_inf<float>() ? 0.f : m1;
    float st0 = 0.f, st1 = 0.f;                            // this thread's shares of Σ P
#pragma unroll
    for (int t = 0; t < Bc / 8; ++t) {
        const float p0 = ex2(fmaf(s[4 * t], sl2, -ms0)), p1 = ex2(fmaf(s[4 * t + 1], sl2, -ms0));
        const float p2 = ex2(fmaf(s[4 * t + 2], sl2, -ms1)), p3 = ex2(fmaf(s[4 * t + 3], sl2, -ms1));
        st0 += p0 + p1;
        st1 += p2 + p3;
        pf[t >> 1][(t & 1) * 2 + 0] = pack<T>(p0, p1);
        pf[t >> 1][(t & 1) * 2 + 1] = pack<T>(p2, p3);
    }
    a0 = a1 = 1.f;
    constexpr float bound = 4096.f;                        // 2^12
    // (!(x <= bound): an infinite or NaN share fires too)
    const bool quiet = st0 <= bound && st1 <= bound && m0 != neg_inf<float>() && m1 != neg_inf<float>();
    if (__any_sync(0xffffffffu, !quiet)) {
        float mx0 = neg_inf<float>(), mx1 = neg_inf<float>();
#pragma unroll
        for (int t = 0; t < Bc / 8; ++t) {
            mx0 = fmaxf(mx0, fmaxf(s[4 * t], s[4 * t + 1]));
            mx1 = fmaxf(mx1, fmaxf(s[4 * t + 2], s[4 * t + 3]));
        }
        if (FRAME) {                     // (each thread's own frame, before the quad's max)
            mx0 = fmaf(mx0, sl2, f0);
            mx1 = fmaf(mx1, sl2, f1);
        }
        quad_max(mx0, mx1);              // the 4 threads of a quad share a row
        if (!FRAME) {
            mx0 *= sl2;
            mx1 *= sl2;
        }
        // row r0 + 8h: the online step where its max passed m (−∞ > −∞ is false: a row
        // that still sees no key keeps m = −∞, and its P are 0)
        auto again = [&](int h, float mx, float f, float& m, float& l, float& st, float& a) {
            if (mx > m) {
                a = ex2(m - mx);
                m = mx;
                l = __fmul_rn(l, a);
                st = 0.f;
                const float mf = FRAME ? mx - f : mx;
#pragma unroll
                for (int t = 0; t < Bc / 8; ++t) {
                    const float p0 = ex2(fmaf(s[4 * t + 2 * h], sl2, -mf)),
                                p1 = ex2(fmaf(s[4 * t + 2 * h + 1], sl2, -mf));
                    st += p0 + p1;
                    pf[t >> 1][(t & 1) * 2 + h] = pack<T>(p0, p1);
                }
            }
        };
        again(0, mx0, f0, m0, l0, st0, a0);
        again(1, mx1, f1, m1, l1, st1, a1);
    }
    l0 += st0;
    l1 += st1;
}
// The fast backward main loops' parameters (flash2_bwd_tc, flash2_bwd_wg and their
// deterministic forms: one signature, so one launcher serves them all)
#define FLASHSIM_BWD_PARAMS                                                                 \
    const T* __restrict__ Q, const T* __restrict__ K, const T* __restrict__ V,             \
    const long long* __restrict__ at, const T* __restrict__ dO,                            \
    const float* __restrict__ L, const float* __restrict__ Dv, float* __restrict__ dQacc, \
    T* __restrict__ dK, T* __restrict__ dV, int Nq, int Nk, int ldq, int ldk, int ldv,     \
    int lddo, int lddk, int lddv, int d, int dv, int left, int right,                      \
    float scale, float k_in, float k_out, const float* __restrict__ slopes,                \
    int* __restrict__ sem, const int* __restrict__ vl,                                     \
    unsigned long long* io
#define FLASHSIM_BWD_ARGS Q, K, V, at, dO, L, Dv, dQacc, dK, dV, Nq, Nk, ldq, ldk, ldv, lddo, lddk, lddv, d, dv, left, right, scale, k_in, k_out, slopes, sem, vl, io
