// Hopper (sm_90a) helpers of the warpgroup-MMA kernels (flash2_wg.cu, flash2_ws.cu): the
// wgmma wrappers and shared-memory descriptors, the async-proxy fence, and the copy
// engine's side: mbarriers and TMA tile loads.
#pragma once

#include "tensor_core.cuh"

namespace wg {
// cp.async writes shared memory through the generic proxy, wgmma reads it through the
// async proxy: each writing thread orders the two before the barrier that publishes it
__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Shared-memory matrix descriptor (PTX ISA, "Matrix Descriptor Format"): start address,
// leading- and stride-dimension byte offsets, all in 16-byte units, and the swizzle mode
// (1 = 128 bytes, 2 = 64 bytes). For the K-major tiles (Q_i as A, K_j as B) one
// instruction reads 16 columns of one column block: 8-row groups are 8 rows of the block
// apart (SBO) and the leading offset is unused. For V_j (B, MN-major) one instruction
// reads 16 keys × D columns: 8-key groups SBO apart, the column blocks Bc rows (LBO).
__device__ __forceinline__ unsigned long long desc(unsigned addr, unsigned lbo, unsigned sbo,
                                                   unsigned swizzle = 1) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4)
         | (unsigned long long)((lbo >> 4) & 0x3FFF) << 16
         | (unsigned long long)((sbo >> 4) & 0x3FFF) << 32
         | (unsigned long long)swizzle << 62;
}
// desc(addr + off, …) from d = desc(addr, …), off a multiple of 16 bytes: the start address
// is the low field, and no shared-memory address (< 2^18) carries out of it, so one add of
// an immediate to the low word where desc() takes five instructions per wgmma (which sat
// between the wgmma issues of a group: ptxas cannot fold the mask)
__device__ __forceinline__ unsigned long long desc_plus(unsigned long long d, unsigned off) {
    const unsigned lo = (unsigned)d + (off >> 4), hi = (unsigned)(d >> 32);
    return (unsigned long long)hi << 32 | lo;
}

// How a tile of D columns lies in shared memory: D/W column blocks of W columns, each
// ROWS rows of RB = 2W bytes, 16-byte chunk c of row r at c ^ swz(r). W = 64 (rows of
// 128 bytes, the 128-byte swizzle: c ^ (r & 7)) where 64 divides D; else W = 32 (D = 32,
// 96: rows of 64 bytes, the 64-byte swizzle, c ^ ((r >> 1) & 3)), so that every block is
// whole and one descriptor mode serves the tile. D = 192 takes W = 32 too: the wide
// backward (wg_bwd.cuh's step_wide) gives each warpgroup D/2 = 96 columns, an MN-major
// operand that must start on a block. Both patterns repeat every 8 rows.
template <int D> struct Cols {
    static constexpr int W = D % 64 == 0 && D != 192 ? 64 : 32;
    static constexpr int RB = 2 * W;             // bytes per row of a block
    static constexpr int SBO = 8 * RB;           // bytes per 8-row group
    static constexpr int KSTEPS = W / 16;        // 16-column k-steps per block
    static constexpr unsigned MODE = W == 64 ? 1 : 2;   // the descriptor's swizzle mode
    static __device__ __forceinline__ int swz(int r) { return W == 64 ? (r & 7) : ((r >> 1) & 3); }
};
// Above 128 columns a product with D columns of output runs as two (the forward's P V,
// the wide backward's dV_j, dK_j, dQ_i halves), each an MN-major operand that starts on
// a column block: part 0 takes H0 = D/2 rounded up to whole blocks, part 1 the H1 = D − H0
// after it (192: 96 + 96, 256: 128 + 128, 160: 96 + 64, 224: 128 + 96). Register x of part
// 1 is register H0/2 + x of the whole: the m64nN layouts of the two parts, one after the
// other, are the m64nD layout of the whole.
template <int D> struct Parts {
    static constexpr int H0 = (D / 2 + Cols<D>::W - 1) / Cols<D>::W * Cols<D>::W, H1 = D - H0;
    static constexpr int B0 = H0 / Cols<D>::W;   // column blocks of part 0
};

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory");
}
// The accumulators are written by the tensor cores between the issue and the wait; the
// compiler sees them as written at the issue. Passing them through an empty asm after
// the wait (and before the issue) keeps every other use on the right side of the wait.
template <int R> __device__ __forceinline__ void fence_regs(float* r) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+f"(r[i]) :: "memory");
}

template <typename T, int N> struct Wgmma;
// The wrappers, one macro per N (the accumulator's registers are spelled out; PTX has no
// register arrays), instantiated for float16 ("f16") and bfloat16 ("bf16").
#define FLASHSIM_WGMMA_64(CTY, TY)                                                                                       \
template <> struct Wgmma<CTY, 64> {                                                                                      \
    /* D (64 × 64) (+)= A B, A and B from shared memory (descriptors), K-major, or                                       \
       MN-major where TA (TB) is 1: the instruction transposes them (the backward's dQ =                                 \
       dS K_j reads dSᵀ and K_j so) */                                                                                   \
    template <int TA = 0, int TB = 0>                                                                                    \
    static __device__ __forceinline__ void ss(float* d, unsigned long long a, unsigned long long b, int accumulate) {    \
        asm volatile(                                                                                                    \
            "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                                                 \
            "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " "                                                  \
            "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"                                                    \
            "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, %35, %36;\n}\n"        \
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),            \
              "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),      \
              "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),    \
              "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])     \
            : "l"(a), "l"(b), "r"(accumulate), "n"(TA), "n"(TB));                                                        \
    }                                                                                                                    \
    /* D (64 × 64) += A B, A from registers (the m16n8k16 A layout per warp), B from                                     \
       shared memory MN-major (trans-b = 1) */                                                                           \
    static __device__ __forceinline__ void rs(float* d, const unsigned* a, unsigned long long b) {                       \
        asm volatile(                                                                                                    \
            "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " "                                                  \
            "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"                                                    \
            "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32, %33, %34, %35}, %36, 1, 1, 1, 1;\n" \
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),            \
              "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),      \
              "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),    \
              "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])     \
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));                                                       \
    }                                                                                                                    \
};
FLASHSIM_WGMMA_64(__half, "f16")
FLASHSIM_WGMMA_64(__nv_bfloat16, "bf16")
#define FLASHSIM_WGMMA_128(CTY, TY)                                                                                      \
template <> struct Wgmma<CTY, 128> {                                                                                     \
    /* D (64 × 128) (+)= A B, A and B from shared memory (descriptors), K-major, or                                      \
       MN-major where TA (TB) is 1 (the D = 256 backward's dK, dV and dQ halves) */                                      \
    template <int TA = 0, int TB = 0>                                                                                    \
    static __device__ __forceinline__ void ss(float* d, unsigned long long a, unsigned long long b, int accumulate) {    \
        asm volatile(                                                                                                    \
            "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                                                 \
            "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " "                                                 \
            "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"                                                    \
            "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"                                           \
            "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"                                           \
            "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, p, 1, 1, %67, %68;\n}\n"          \
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),            \
              "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),      \
              "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),    \
              "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),    \
              "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),    \
              "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),    \
              "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),    \
              "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])     \
            : "l"(a), "l"(b), "r"(accumulate), "n"(TA), "n"(TB));                                                        \
    }                                                                                                                    \
    /* D (64 × 128) += A B, A from registers (the m16n8k16 A layout per warp), B from                                    \
       shared memory MN-major (trans-b = 1) */                                                                           \
    static __device__ __forceinline__ void rs(float* d, const unsigned* a, unsigned long long b) {                       \
        asm volatile(                                                                                                    \
            "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " "                                                 \
            "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"                                                    \
            "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"                                           \
            "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"                                           \
            "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64, %65, %66, %67}, %68, 1, 1, 1, 1;\n" \
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),            \
              "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),      \
              "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),    \
              "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),    \
              "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),    \
              "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),    \
              "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),    \
              "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])     \
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));                                                       \
    }                                                                                                                    \
};
FLASHSIM_WGMMA_128(__half, "f16")
FLASHSIM_WGMMA_128(__nv_bfloat16, "bf16")
// the P V_j products of the D = 32 and D = 96 instances (rs); the D = 256 backward's half
// steps and the D = 32 backward's dQ (ss)
#define FLASHSIM_WGMMA_RS_32(CTY, TY)                                                                                 \
template <> struct Wgmma<CTY, 32> {                                                                                   \
    /* D (64 × 32) (+)= A B, A and B from shared memory, K-major (the D = 256 backward's                              \
       Sᵀ, dPᵀ of half a step's queries), or MN-major where TA (TB) is 1 (the D = 32                                  \
       backward's dQ) */                                                                                              \
    template <int TA = 0, int TB = 0>                                                                                 \
    static __device__ __forceinline__ void ss(float* d, unsigned long long a, unsigned long long b, int accumulate) { \
        asm volatile(                                                                                                 \
            "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"                                                              \
            "wgmma.mma_async.sync.aligned.m64n32k16.f32." TY "." TY " "                                               \
            "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, %16, %17, p, 1, 1, %19, %20;\n}\n"              \
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),         \
              "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])    \
            : "l"(a), "l"(b), "r"(accumulate), "n"(TA), "n"(TB));                                                     \
    }                                                                                                                 \
    /* D (64 × 32) += A B, A from registers, B from shared memory MN-major */                                         \
    static __device__ __forceinline__ void rs(float* d, const unsigned* a, unsigned long long b) {                    \
        asm volatile(                                                                                                 \
            "wgmma.mma_async.sync.aligned.m64n32k16.f32." TY "." TY " "                                               \
            "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}"                                                 \
            ", {%16, %17, %18, %19}, %20, 1, 1, 1, 1;\n"                                                              \
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),         \
              "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])    \
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));                                                    \
    }                                                                                                                 \
};
FLASHSIM_WGMMA_RS_32(__half, "f16")
FLASHSIM_WGMMA_RS_32(__nv_bfloat16, "bf16")
#define FLASHSIM_WGMMA_RS_96(CTY, TY)                                                                                 \
template <> struct Wgmma<CTY, 96> {                                                                                   \
    /* D (64 × 96) (+)= A B, A and B from shared memory, K-major, or MN-major where TA                                \
       (TB) is 1 (the D = 192 backward's dK, dV and dQ halves) */                                                     \
    template <int TA = 0, int TB = 0>                                                                                 \
    static __device__ __forceinline__ void ss(float* d, unsigned long long a, unsigned long long b, int accumulate) { \
        asm volatile(                                                                                                 \
            "{\n.reg .pred p;\nsetp.ne.b32 p, %50, 0;\n"                                                              \
            "wgmma.mma_async.sync.aligned.m64n96k16.f32." TY "." TY " "                                               \
            "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"                                                 \
            "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"                                        \
            "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47}, %48, %49, p, 1, 1, %51, %52;\n}\n"      \
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),         \
              "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),   \
              "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
              "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
              "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
              "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])  \
            : "l"(a), "l"(b), "r"(accumulate), "n"(TA), "n"(TB));                                                     \
    }                                                                                                                 \
    /* D (64 × 96) += A B, A from registers, B from shared memory MN-major */                                         \
    static __device__ __forceinline__ void rs(float* d, const unsigned* a, unsigned long long b) {                    \
        asm volatile(                                                                                                 \
            "wgmma.mma_async.sync.aligned.m64n96k16.f32." TY "." TY " "                                               \
            "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"                                                 \
            "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"                                        \
            "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47}"                                        \
            ", {%48, %49, %50, %51}, %52, 1, 1, 1, 1;\n"                                                              \
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),         \
              "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),   \
              "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
              "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
              "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
              "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])  \
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));                                                    \
    }                                                                                                                 \
};
FLASHSIM_WGMMA_RS_96(__half, "f16")
FLASHSIM_WGMMA_RS_96(__nv_bfloat16, "bf16")

// -- the forwards' online softmax on a warpgroup's S (flash2_fwd_wg, flash2_fwd_ws) -------
// h[t] = max(h[t], h[t + W]) (MAX = false: min), halving W down to 1: two rows' max of
// h[0 … 2W − 1] in h[0], as a tree of independent compares
template <int W, bool MAX = true> __device__ __forceinline__ void fold_max(float* h0, float* h1) {
    if constexpr (W > 0) {
#pragma unroll
        for (int t = 0; t < W; ++t) {
            h0[t] = MAX ? fmaxf(h0[t], h0[t + W]) : fminf(h0[t], h0[t + W]);
            h1[t] = MAX ? fmaxf(h1[t], h1[t + W]) : fminf(h1[t], h1[t + W]);
        }
        fold_max<W / 2, MAX>(h0, h1);
    }
}
// The ragged keys and the band's edge masked to −∞ where the tile needs it (the scores of
// wg_scores, wg_scores_side)
template <int Bc, int Br>
__device__ __forceinline__ void wg_mask(float* s, int j0, int i0, int r0, int tig, int nk,
                                        const Band& band) {
    const bool partial = j0 + Bc > nk || (band.left >= 0 && j0 - (i0 + Br - 1) - band.off < -band.left)
                         || (band.right >= 0 && j0 + Bc - 1 - i0 - band.off > band.right);
    if (partial) {
#pragma unroll
        for (int t = 0; t < Bc / 8; ++t)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int c = j0 + t * 8 + tig * 2 + (e & 1);
                const int r = i0 + r0 + (e < 2 ? 0 : 8);
                if (c >= nk || !band.sees(r, c)) s[4 * t + e] = neg_inf<float>();
            }
    }
}
// ALiBi alone (flash2_fwd_ws's lazy instance in bfloat16) on a key tile that lies on one side of the
// diagonal key of every row of the warp (wg_side says which): there −b·|dist| = −b·σ·dist,
// σ = ±1 for the whole tile, and with dist = dist0 + 8·(e ≥ 2) − 8t − (e & 1) (wg_scores'
// terms) it splits into a term per key, b·σ·(8t + (e & 1)), an FFMA with an immediate,
// and a term per row, −b·σ·(dist0 + 8·(e ≥ 2)), which the softmax takes into its max (the
// frame offsets f0, f1 of wg_side; softmax_lazy): two operations a score where |dist|'s
// FADD and FFMA and the scale's FMUL were three (NOTES v91; with a softcap the pass measured
// slower, and the softcap keeps wg_scores). ``kbs``: b·σ.
template <int Bc, int Br>
__device__ __forceinline__ void wg_scores_side(float* s, int j0, int i0, int r0, int tig, int nk,
                                               const Band& band, float k_in, float kbs) {
#pragma unroll
    for (int t = 0; t < Bc / 8; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            s[4 * t + e] = fmaf(kbs, (float)(8 * t + (e & 1)), s[4 * t + e] * k_in);
    wg_mask<Bc, Br>(s, j0, i0, r0, tig, nk, band);
}
// Whether the key tile from j0 lies on one side of the diagonal key of each row of the
// warp whose thread holds rows i0 + r0, + 8 (r0 − g its first; g the thread's row in
// its quad): then b·σ in *kbs and the thread's frame offsets, −b·σ·dist0·sl2 and
// −b·σ·(dist0 + 8)·sl2 (log2 units), in *f0, *f1, where dist0 = r0's distance to the
// thread's first key of the tile (its own: f differs along a quad). ``kb``: b, ALiBi's
// slope in the scores' units (VarScores' k_bias)
template <int Bc>
__device__ __forceinline__ bool wg_side(int j0, int i0, int r0, int g, int tig, const Band& band,
                                        float kb, float sl2, float* kbs, float* f0, float* f1) {
    const int rw = i0 + r0 - g + band.off;           // the warp's first row's diagonal key
    // (σ through a shuffle, which ptxas knows gives every lane the same value: a branch
    // on it is uniform, and the warpgroup's MMAs around it are not serialized)
    const float sg = __shfl_sync(0xffffffffu, rw - (j0 + Bc - 1) >= 0 ? 1.f : (rw + 15 - j0 <= 0 ? -1.f : 0.f), 0);
    if (sg == 0.f) return false;
    *kbs = kb * sg;
    const float dist0 = (float)(i0 + r0 + band.off - j0 - tig * 2);
    *f0 = -*kbs * dist0 * sl2;
    *f1 = -*kbs * (dist0 + 8.f) * sl2;
    return true;
}
// The scores of wg_softmax: VAR's (softcap, ALiBi) finished in log2 units over sl2, and the
// ragged keys and the band's edge masked to −∞ where the tile needs it. SPLIT (the online
// softmax's callers): ALiBi alone in a pass of its own, below
template <int Bc, int Br, bool VAR, bool SPLIT = false>
__device__ __forceinline__ void wg_scores(float* s, int j0, int i0, int r0, int tig, int nq, int nk,
                                          const Band& band, float k_in, float k_out, float slope) {
    if constexpr (VAR) {
        const VarScores vs{k_in, k_out, slope};
        const float dist0 = (float)(i0 + r0 + (nk - nq) - j0 - tig * 2);   // r + off − c, per tile
        if (!SPLIT || k_out != 0.f) {
#pragma unroll
            for (int t = 0; t < Bc / 8; ++t)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float th;
                    s[4 * t + e] = vs(s[4 * t + e], dist0 + (float)((e < 2 ? 0 : 8) - t * 8 - (e & 1)), &th);
                }
        } else {
            // ALiBi alone: its bias unconditional (a slope of 0 adds −0·|dist|, which leaves
            // s·k_in as it is). Left to VarScores' test per score, ptxas (flash2_fwd_wg's
            // online instance, 240 registers) split this pass into a branch per 4 scores,
            // basic blocks it schedules one at a time (NOTES v79). With the softcap the
            // test stays (a softcap alone then skips the distances too); the fixed and lazy
            // softmaxes keep the one pass, which split measured slower there
#pragma unroll
            for (int t = 0; t < Bc / 8; ++t)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    s[4 * t + e] = fmaf(-vs.k_bias, fabsf(dist0 + (float)((e < 2 ? 0 : 8) - t * 8 - (e & 1))),
                                        s[4 * t + e] * k_in);
        }
    }
    wg_mask<Bc, Br>(s, j0, i0, r0, tig, nk, band);
}
// S_j is this warpgroup's 64 × Bc tile in the m64nNk16 accumulator layout: register 4t + e
// holds row r (= r0 + 8·(e ≥ 2) of the Q tile starting at query i0) and key 8t + 2·tig +
// (e & 1) of tile j (first key j0). Finishes the scores (VAR: VarScores with the problem's
// slope, before the mask, since softcap(−∞) would be −softcap), masks ragged keys and the
// band where the tile needs it, updates the running max m (log2 domain) and the partial
// sums ℓ of rows r0, r0 + 8, leaves P = 2^(S·sl2 − m) in s (fp32), and returns in a0, a1
// the factors (α) that O's rows must be scaled by. FIXED (flash2_fwd_ws's softcap instance
// in bfloat16, tensor_core.cuh's cap_fixed_m): m stays the fixed max the caller set, and α = 1.
template <int Bc, int Br, bool VAR, bool FIXED = false>
__device__ __forceinline__ void wg_softmax(float* s, float& m0, float& m1, float& l0, float& l1,
                                           float& a0, float& a1, int j0, int i0, int r0, int tig,
                                           int nq, int nk, const Band& band, float sl2,
                                           float k_in, float k_out, float slope) {
    wg_scores<Bc, Br, VAR, !FIXED>(s, j0, i0, r0, tig, nq, nk, band, k_in, k_out, slope);
    float ms0 = m0, ms1 = m1;                // FIXED: the caller's max, and α = 1
    a0 = a1 = 1.f;
    if constexpr (!FIXED) {
        // the row max of the raw scores in a tree, then scaled once (NOTES v85): rounding
        // x·sl2 is monotone in x, so this is the max of the scaled scores bit for bit, with
        // Bc/4 multiplies fewer and a chain of log2(Bc/4) compares, not Bc/8 compare-multiplies.
        // A negative scale (sl2 < 0) takes the raw scores' min
        float h0[Bc / 4], h1[Bc / 4];
#pragma unroll
        for (int t = 0; t < Bc / 8; ++t) {
            h0[2 * t] = s[4 * t], h0[2 * t + 1] = s[4 * t + 1];
            h1[2 * t] = s[4 * t + 2], h1[2 * t + 1] = s[4 * t + 3];
        }
        if (sl2 >= 0.f) fold_max<Bc / 8>(h0, h1);
        else fold_max<Bc / 8, false>(h0, h1);
        float mx0 = fmaxf(m0, h0[0] * sl2), mx1 = fmaxf(m1, h1[0] * sl2);
        quad_max(mx0, mx1);              // the 4 threads of a quad share a row
        ms0 = mx0 == neg_inf<float>() ? 0.f : mx0;   // no key yet: exp2(−∞) = 0
        ms1 = mx1 == neg_inf<float>() ? 0.f : mx1;
        a0 = ex2(m0 - ms0);
        a1 = ex2(m1 - ms1);
        m0 = mx0;
        m1 = mx1;
        // rounded here (mul.rn: never fused into the FADD below), so that every build of a
        // kernel, fast or instrumented, adds the same ℓ·α: ptxas may fuse a plain mul.f32
        // into the add that follows in one build and not in another
        l0 = __fmul_rn(l0, a0);
        l1 = __fmul_rn(l1, a1);
    }
#pragma unroll
    for (int t = 0; t < Bc / 8; ++t) {
        s[4 * t] = ex2(fmaf(s[4 * t], sl2, -ms0));
        s[4 * t + 1] = ex2(fmaf(s[4 * t + 1], sl2, -ms0));
        s[4 * t + 2] = ex2(fmaf(s[4 * t + 2], sl2, -ms1));
        s[4 * t + 3] = ex2(fmaf(s[4 * t + 3], sl2, -ms1));
        l0 += s[4 * t] + s[4 * t + 1];
        l1 += s[4 * t + 2] + s[4 * t + 3];
    }
}
// P (fp32, in s) to T: the registers of keys 16k..16k+15 are, pairwise, the m16n8k16 A
// fragment of k-step k (rows g and g + 8), the A operand of P V_j
template <typename T, int Bc>
__device__ __forceinline__ void wg_pack_p(const float* s, unsigned (*pf)[4]) {
#pragma unroll
    for (int t = 0; t < Bc / 8; ++t) {
        pf[t >> 1][(t & 1) * 2 + 0] = pack<T>(s[4 * t], s[4 * t + 1]);
        pf[t >> 1][(t & 1) * 2 + 1] = pack<T>(s[4 * t + 2], s[4 * t + 3]);
    }
}

#ifndef FLASHSIM_O_SMEM
#define FLASHSIM_O_SMEM 1
#endif
// plain shared-memory accesses at 32-bit shared addresses (the epilogues)
__device__ __forceinline__ void st_shared_b32(unsigned addr, unsigned v) {
    asm volatile("st.shared.b32 [%0], %1;\n" :: "r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ uint4 ld_shared_v4(unsigned addr) {
    uint4 v;
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr) : "memory");
    return v;
}
// L_i (natural log) of a row from its max m (log2 domain) and quad-reduced ℓ: −∞ for a
// row that saw no key (ℓ = 0, whose log2f is −∞, m being finite or −∞: no select, so
// that ptxas keeps the log's chain in the block around it, not in a branch of its own)
__device__ __forceinline__ float wg_l_of(float l, float m) {
    constexpr float LN2 = 0.6931471805599453f;
    return (m + log2f(l)) * LN2;
}
// L_i of rows r0, r0 + 8 (of `rows`), as wg_l_of gives them (L0, L1)
__device__ __forceinline__ void wg_put_l(float* Li, float L0, float L1, int r0, int tig, int rows) {
    if (tig == 0) {
        if (r0 < rows) Li[r0] = L0;
        if (r0 + 8 < rows) Li[r0 + 8] = L1;
    }
}
__device__ __forceinline__ void wg_store_l(float* Li, float l0, float l1, float m0, float m1,
                                           int r0, int tig, int rows) {
    wg_put_l(Li, wg_l_of(l0, m0), wg_l_of(l1, m1), r0, tig, rows);
}
// 1: wg_o_to_shared writes a warp's 16 rows with stmatrix, four 8 × 8 matrices (two rows'
// halves of two 16-byte chunks) an instruction; 0: a 4-byte store per two columns of a
// row (4× the instructions, NOTES v87). The same bytes either way
#ifndef FLASHSIM_WG_STMATRIX
#define FLASHSIM_WG_STMATRIX 1
#endif
__device__ __forceinline__ void stmatrix_x4(unsigned addr, unsigned a, unsigned b, unsigned c, unsigned d) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n"
                 :: "r"(addr), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}
// O_i's rows r0, r0 + 8 times 1/ℓ (inv0, inv1), rounded to T, into the same rows of the Q
// tile at sQ (Br rows in Cols<D>'s swizzled column blocks, the layout a TMA box of them
// has): the accumulators' columns t·8 + 2·tig, +1 are chunk t of the row. With stmatrix,
// register i of a thread (rows g, g + 8 of chunks t, t + 1) is matrix i's row g (or g + 8),
// columns 2·tig, +1 (the accumulators' layout), and lane l names the address of row
// (l & 7) + 8·((l >> 3) & 1) of chunk t + (l >> 4): chunk t is even and t, t + 1 share a
// column block, so the swizzled chunk is (t mod W/8) ^ (l >> 4) ^ swz(row)
template <typename T, int D, int Br>
__device__ __forceinline__ void wg_o_to_shared(const float* o, unsigned sQ, float inv0, float inv1,
                                               int r0, int tig) {
    using CL = Cols<D>;
    if constexpr (FLASHSIM_WG_STMATRIX && D % 16 == 0) {
        const int lane = threadIdx.x & 31;
        const int r = r0 - (lane >> 2) + (lane & 7) + (((lane >> 3) & 1) << 3);
        const unsigned row = sQ + r * CL::RB, sw = (unsigned)(CL::swz(r) ^ (lane >> 4)) << 4;
#pragma unroll
        for (int t = 0; t < D / 8; t += 2) {
            const unsigned blk = (t * 8 / CL::W) * (Br * CL::RB), c = (t * 8 % CL::W) / 8;
            stmatrix_x4(row + blk + ((c << 4) ^ sw),
                        pack<T>(o[4 * t] * inv0, o[4 * t + 1] * inv0),
                        pack<T>(o[4 * t + 2] * inv1, o[4 * t + 3] * inv1),
                        pack<T>(o[4 * t + 4] * inv0, o[4 * t + 5] * inv0),
                        pack<T>(o[4 * t + 6] * inv1, o[4 * t + 7] * inv1));
        }
    } else {
        const int r1 = r0 + 8;
#pragma unroll
        for (int t = 0; t < D / 8; ++t) {
            const unsigned blk = sQ + (t * 8 / CL::W) * (Br * CL::RB), c = (t * 8 % CL::W) / 8;
            st_shared_b32(blk + r0 * CL::RB + ((c ^ CL::swz(r0)) << 4) + tig * 4,
                          pack<T>(o[4 * t] * inv0, o[4 * t + 1] * inv0));
            st_shared_b32(blk + r1 * CL::RB + ((c ^ CL::swz(r1)) << 4) + tig * 4,
                          pack<T>(o[4 * t + 2] * inv1, o[4 * t + 3] * inv1));
        }
    }
}
// The forwards' epilogue: ℓ reduced over the quad, O_i's rows r0, r0 + 8 (of `rows`) divided
// once and written (dv of the instance's D columns, rows ldo apart), and L_i (natural log)
template <typename T, int D>
__device__ __forceinline__ void wg_store_o(const float* o, T* Oi, int ldo, float* Li, float l0,
                                           float l1, float m0, float m1, int r0, int tig,
                                           int rows, int dv) {
    quad_sum(l0, l1);
    const float inv0 = l0 > 0.f ? 1.f / l0 : 0.f, inv1 = l1 > 0.f ? 1.f / l1 : 0.f;
    const int r1 = r0 + 8;
#pragma unroll
    for (int t = 0; t < D / 8; ++t) {
        const int c = t * 8 + tig * 2;
        if (c >= dv) break;                          // the instance's columns past dv
        if (r0 < rows)
            *reinterpret_cast<unsigned*>(Oi + (long long)r0 * ldo + c) = pack<T>(o[4 * t] * inv0, o[4 * t + 1] * inv0);
        if (r1 < rows)
            *reinterpret_cast<unsigned*>(Oi + (long long)r1 * ldo + c) = pack<T>(o[4 * t + 2] * inv1, o[4 * t + 3] * inv1);
    }
    wg_store_l(Li, l0, l1, m0, m1, r0, tig, rows);
}

// The forwards' epilogue through shared memory: a warp's 16 rows of O_i, divided by ℓ and
// rounded to T, go into the same rows of the Q tile at sQ (Br rows in Cols<D>'s swizzled
// column blocks; the warpgroup's own rows, which its S products alone read, and the last
// of those is done) and then to HBM 16 bytes per thread per store: a warp's store covers
// whole rows (two at D = 128), where the accumulators' layout gives 4-byte stores of 8
// rows × 16 bytes each, half of each 32-byte sector (NOTES v30). Columns past dv and rows
// past `rows` are not stored; L_i as wg_store_o writes it. D = 32 (rows of 64 bytes, two
// CTAs per SM) measured 0–3% slower this way and keeps wg_store_o, as do rows whose
// address or stride is not 16-byte aligned, and FLASHSIM_O_SMEM=0 (for A/B).
template <typename T, int D, int Br>
__device__ __forceinline__ void wg_store_o16(const float* o, unsigned sQ, T* Oi, int ldo, float* Li,
                                             float l0, float l1, float m0, float m1, int r0,
                                             int lane, int tig, int rows, int dv) {
    if (!FLASHSIM_O_SMEM || D < 64
        || ((reinterpret_cast<unsigned long long>(Oi) | (unsigned)ldo * sizeof(T)) & 15)) {
        wg_store_o<T, D>(o, Oi, ldo, Li, l0, l1, m0, m1, r0, tig, rows, dv);   // 4-byte stores
        return;
    }
    using CL = Cols<D>;
    quad_sum(l0, l1);
    const float inv0 = l0 > 0.f ? 1.f / l0 : 0.f, inv1 = l1 > 0.f ? 1.f / l1 : 0.f;
    wg_o_to_shared<T, D, Br>(o, sQ, inv0, inv1, r0, tig);
    __syncwarp();
    constexpr int CH = D / 8;                        // 16-byte chunks per row
    const int row0 = r0 - (lane >> 2);               // the warp's first row in the tile
#pragma unroll
    for (int x = lane; x < 16 * CH; x += 32) {
        const int r = row0 + x / CH, ch = x % CH;
        const unsigned c = ch % (CL::W / 8);
        const uint4 v = ld_shared_v4(sQ + (ch / (CL::W / 8)) * (Br * CL::RB) + r * CL::RB + ((c ^ CL::swz(r)) << 4));
        if (r < rows && ch * 8 < dv) *reinterpret_cast<uint4*>(Oi + (long long)r * ldo + ch * 8) = v;
    }
    wg_store_l(Li, l0, l1, m0, m1, r0, tig, rows);
}

// -- mbarriers and the tensor memory accelerator (TMA) ----------------------------------
// A tensor map (CUtensorMap: 128 bytes, built on the host by cuTensorMapEncodeTiled)
// describes a tensor in global memory and the box one TMA instruction copies; the kernel
// takes it by value as a __grid_constant__ parameter and hands the instruction its address.
struct alignas(64) TensorMap { unsigned long long bits[16]; };

// mbarrier (shared memory, 8 bytes): `count` arrivals and, for TMA, a byte count complete
// a phase; waiters name the phase by its parity
__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(count) : "memory");
}
// the barriers' initialisation made visible to the async proxy (TMA) and other threads,
// before the CTA barrier that follows it
__device__ __forceinline__ void mbar_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// one arrival that also announces `bytes` to come from TMA loads into this phase
__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(bar) : "memory");
}
// `count` arrivals at once (the copy-engine forward's producer, for consumer warps that
// skip a step)
__device__ __forceinline__ void mbar_arrive_n(unsigned bar, unsigned count) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], %1;\n" :: "r"(bar), "r"(count) : "memory");
}
// wait until the phase of this parity has completed (a fresh barrier is in phase 0, so
// waiting on parity 1 returns at once: "the previous phase" of an empty slot)
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
    unsigned done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     "selp.u32 %0, 1, 0, p;\n}\n" : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    } while (!done);
}
// both phases, their first tests issued together: a test's answer takes a round trip
// through the barrier's unit, and two tests one after the other (each waited for by its
// branch) cost two (the copy-engine forward's consumers wait for K_j and V_{j−1} at a step's top;
// NOTES v85)
__device__ __forceinline__ void mbar_wait2(unsigned a, unsigned pa, unsigned b, unsigned pb) {
    unsigned da, db;
    asm volatile("{\n.reg .pred p, q;\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 p, [%2], %3;\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 q, [%4], %5;\n"
                 "selp.u32 %0, 1, 0, p;\nselp.u32 %1, 1, 0, q;\n}\n"
                 : "=r"(da), "=r"(db) : "r"(a), "r"(pa), "r"(b), "r"(pb) : "memory");
    if (!da) mbar_wait(a, pa);
    if (!db) mbar_wait(b, pb);
}
// one box of a 3-D tensor map (coordinates innermost first) into shared memory at dst,
// completing `bytes` of bar's phase; rows outside the tensor arrive as zeros and still
// count their bytes
__device__ __forceinline__ void tma_load_3d(unsigned dst, const TensorMap* map, int c0, int c1, int c2,
                                            unsigned bar) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes "
                 "[%0], [%1, {%2, %3, %4}], [%5];\n"
                 :: "r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
                 : "memory");
}
// a box of a 3-D tensor map from shared memory at src (laid out, and swizzled, as
// tma_load_3d writes a box) to global memory, in the thread's bulk group: the copy engine
// writes only the box's elements inside the tensor
__device__ __forceinline__ void tma_store_3d(const TensorMap* map, int c0, int c1, int c2, unsigned src) {
    asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%1, %2, %3}], [%4];\n"
                 :: "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(src)
                 : "memory");
}
// bytes (a multiple of 16) of fp32 at dst in global memory += those at src in shared
// memory (both 16-byte aligned), added in L2 by the copy engine (a bulk reduce-add, no
// tensor map: flash2_bwd_ws's dQ blocks, common.cuh's dq_tiled_at)
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, unsigned src, unsigned bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
                 :: "l"(dst), "r"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void st_shared_f4(unsigned addr, float x, float y, float z, float w) {
    asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" :: "r"(addr), "f"(x), "f"(y), "f"(z), "f"(w)
                 : "memory");
}
// hand registers between warpgroups (every warp of a warpgroup executes the same one):
// the producer keeps few, the consumers take what it gave up
template <int N> __device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(N));
}
template <int N> __device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(N));
}
// a barrier among `threads` threads of the CTA (id 0 is __syncthreads')
__device__ __forceinline__ void named_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" :: "r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" :: "r"(id), "r"(threads) : "memory");
}

// The first thread of a warpgroup frees the slot O_i left from (its last arrival on the slot's
// "empty" barrier) once the copy engine has read it
__device__ __forceinline__ void wg_free_o_slot(unsigned empty_bar) {
    asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
    mbar_arrive(empty_bar);
}
// The copy-engine forward's epilogue through the copy engine: a warpgroup's 64 rows of O_i,
// divided by ℓ and rounded to T, go into its rows of the Q tile at sQ (wg_store_o16's
// layout: the swizzle a TMA box of them reads), each writing thread fences them for the
// async proxy, and once the warpgroup's 128 threads have (named barrier 4 + cw), its
// first thread has the copy engine store them, a box of CL::W columns × 64 rows per column
// block, through tmO (O's tensor map: (columns, rows Nq, problems), the warpgroup's rows
// from row i0 + 64·cw at column co of problem zo; rows past Nq and columns past dv lie
// outside it and are not written). Each warp's first lane arrives on empty_bar, that
// thread once the copy engine has read the slot (free_now; else the caller's
// wg_free_o_slot, later). L_i as wg_store_o writes it.
template <typename T, int D, int Br>
__device__ __forceinline__ void wg_store_o_tma(const float* o, unsigned sQ, const TensorMap* tmO,
                                               int co, int zo, int i0, int cw, float* Li,
                                               float l0, float l1, float m0, float m1, int r0,
                                               int tig, int rows, int dv, unsigned empty_bar,
                                               bool free_now = true) {
    using CL = Cols<D>;
    quad_sum(l0, l1);
    const float inv0 = l0 > 0.f ? 1.f / l0 : 0.f, inv1 = l1 > 0.f ? 1.f / l1 : 0.f;
    // L in every lane, before O's stores (its log2's chain of FMAs runs beside them), stored
    // by the quad's first once the copy is under way
    const float L0 = wg_l_of(l0, m0), L1 = wg_l_of(l1, m1);
    wg_o_to_shared<T, D, Br>(o, sQ, inv0, inv1, r0, tig);
    fence_proxy_async();
    named_sync(4 + cw, 128);
    if ((threadIdx.x & 127) == 0) {
        if (rows > 64 * cw) {
#pragma unroll
            for (int cb = 0; cb < D / CL::W; ++cb)
                if (cb * CL::W < dv)
                    tma_store_3d(tmO, co + cb * CL::W, i0 + 64 * cw, zo,
                                 sQ + cb * (Br * CL::RB) + cw * 64 * CL::RB);
        }
        asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
        if (free_now) wg_free_o_slot(empty_bar);
    } else if ((threadIdx.x & 31) == 0) {
        // the other warps' arrivals, each from the lane that read the tile's index from
        // the slot's tile_in (an arrival orders its own thread's accesses), count toward
        // the same phase, which completes only with the first thread's, after the copy
        mbar_arrive(empty_bar);
    }
    wg_put_l(Li, L0, L1, r0, tig, rows);
}

}  // namespace wg
