// Shared helpers of the flashsim CUDA kernels: element types, conversions, the band mask,
// and the I/O counters of the instrumented build.
//
// Numerics mirror the simulator's precision="kernel" mode: inputs in the I/O type T,
// arithmetic in Acc (float, or double for double inputs), P and dS rounded to T before
// they meet V, dO, K or Q, and row statistics (L, D) and the dQ accumulator in fp32.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

template <typename T> struct AccOf { using type = float; };
template <> struct AccOf<double> { using type = double; };
// bfloat16, whose exponent range is float's (tensor_core.cuh's cap_fixed_m)
template <typename T> struct IsBf16 { static constexpr bool value = false; };
template <> struct IsBf16<__nv_bfloat16> { static constexpr bool value = true; };

template <typename A> __device__ __forceinline__ A to_acc(float x) { return (A)x; }
template <typename A> __device__ __forceinline__ A to_acc(double x) { return (A)x; }
template <typename A> __device__ __forceinline__ A to_acc(__half x) { return (A)__half2float(x); }
template <typename A> __device__ __forceinline__ A to_acc(__nv_bfloat16 x) {
    return (A)__bfloat162float(x);
}

template <typename T> __device__ __forceinline__ T from_acc(float x) { return (T)x; }
template <typename T> __device__ __forceinline__ T from_acc(double x) { return (T)x; }
template <> __device__ __forceinline__ __half from_acc<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

// Round an Acc value to the I/O type and back: what a tensor-core kernel does to P and dS
// before its second matrix product.
template <typename T, typename A> __device__ __forceinline__ A round_io(A x) {
    return to_acc<A>(from_acc<T>(x));
}

template <typename A> __device__ __forceinline__ A neg_inf();
template <> __device__ __forceinline__ float neg_inf<float>() { return -__int_as_float(0x7f800000); }
template <> __device__ __forceinline__ double neg_inf<double>() {
    return -__longlong_as_double(0x7ff0000000000000LL);
}
template <typename A> __device__ __forceinline__ bool is_neg_inf(A x) { return x == neg_inf<A>(); }

__device__ __forceinline__ float exp_acc(float x) { return expf(x); }
__device__ __forceinline__ double exp_acc(double x) { return exp(x); }
__device__ __forceinline__ float log_acc(float x) { return logf(x); }
__device__ __forceinline__ double log_acc(double x) { return log(x); }
__device__ __forceinline__ float tanh_acc(float x) { return tanhf(x); }
__device__ __forceinline__ double tanh_acc(double x) { return tanh(x); }

// -- the band mask --------------------------------------------------------------------
// Query row r sees key c iff r + off − left <= c <= r + off + right, off = Nk − Nq;
// left/right < 0 mean unbounded. Causal is (−1, 0), aligned to the bottom-right corner.
struct Band {
    int left, right, off;
    __device__ __forceinline__ bool sees(int r, int c) const {
        return (left < 0 || c >= r + off - left) && (right < 0 || c <= r + off + right);
    }
    // K/V tiles [*jlo, *jhi] visited by the Q tile holding rows i0..i1-1 (empty: jhi < jlo).
    // Rows i0..i1-1 see one interval of keys, so the visited tiles are contiguous.
    __device__ void kv_range(int i0, int i1, int Nk, int Bc, int* jlo, int* jhi) const {
        int c_lo = left < 0 ? 0 : max(0, i0 + off - left);
        int c_hi = right < 0 ? Nk - 1 : min(Nk - 1, i1 - 1 + off + right);
        if (c_lo > c_hi) { *jlo = 0; *jhi = -1; return; }
        *jlo = c_lo / Bc;
        *jhi = c_hi / Bc;
    }
    // Q tiles [*ilo, *ihi] visited by the K/V tile holding keys j0..j1-1: key c is seen by
    // rows c − off − right .. c − off + left.
    __device__ void q_range(int j0, int j1, int Nq, int Br, int* ilo, int* ihi) const {
        int r_lo = right < 0 ? 0 : max(0, j0 - off - right);
        int r_hi = left < 0 ? Nq - 1 : min(Nq - 1, j1 - 1 - off + left);
        if (r_lo > r_hi) { *ilo = 0; *ihi = -1; return; }
        *ilo = r_lo / Br;
        *ihi = r_hi / Br;
    }
};

// -- where the rows are: strided tensors (the flash2 kernels) -------------------------
// Q, K, V, O and the gradients are read and written through strides, so PyTorch's
// (B, N, H, d) layouts, a packed batch's (total, H, d) and slices of a fused QKV tensor
// need no copy: row r of query problem p in tensor t starts at element
// at[p·AT_NUM + t] + r·ld_t, its d (or dv) elements contiguous; ld_t is a kernel
// parameter. flashsim.gpu builds the table once per shapes and strides
// (flashsim/gpu/_arrays.py: rows_table); the K and V columns also say which K/V problem a
// query problem reads (GQA groups, broadcast batch axes). The fp32 tensors the kernels
// make for themselves (L, D, dQacc) stay dense: (problems, Nq[, d]).
enum AtColumn { AT_Q, AT_K, AT_V, AT_O, AT_dO, AT_dQ, AT_dK, AT_dV, AT_NUM };
__device__ __forceinline__ long long at_row0(const long long* at, int p, int t) {
    return at[(long long)p * AT_NUM + t];
}
// flash2_bwd_ws's dQacc, and its shared dQ_i buffers: per query problem and step of the
// instance's BrB query rows (dq_rows: 64 at D = 128, 128 at D = 64), one block of DQ_BLOCK
// fp32 (BrB × D) in the order the consumer threads hold dQ_i (wg_bwd.cuh's step_dq: at D =
// 128 warpgroup h has columns 64·h … 64·h + 63 of the step's 64 rows, at D = 64 rows 64·h
// … 64·h + 63 of its 128, each in the m64n64 accumulator layout), so that each thread
// stores its values with 16-byte stores that no two lanes of a warp share a bank for, and
// the copy engine adds a block with one bulk reduce-add, no tensor map: float4 k (columns
// 8k … 8k + 7 of the warpgroup's 64) of thread u = 128·h + 32·warp + 4·g + tig holds the
// warpgroup's rows 16·warp + g and + 8, columns 8k + 2·tig and + 1, at float (k·256 + u)·4
// + 2·(row ≥ 8) + (col & 1). The block's rows past Nq and columns past d hold zeros (the
// products' operands are zero there) that flash2_bwd_postprocess does not read.
constexpr int DQ_BLOCK = 64 * 128;
__host__ __device__ inline int dq_rows(int D) { return DQ_BLOCK / D; }
// where row r (< dq_rows(D)), column c (< D) of a block of instance D lies in it
__host__ __device__ inline int dq_tiled_at(int r, int c, int D) {
    const int h = D == 128 ? c >> 6 : r >> 6, rr = r & 63, k = (c & 63) >> 3, tig = (c & 7) >> 1;
    const int warp = rr >> 4, g = rr & 7;
    return (k * 256 + h * 128 + warp * 32 + g * 4 + tig) * 4 + ((rr >> 3) & 1) * 2 + (c & 1);
}
// The same, read where it is used: a volatile load, which the compiler neither hoists out
// of a loop nor keeps in registers across one (the fast rungs' loops have none to spare)
__device__ __forceinline__ long long at_row0_here(const long long* at, int p, int t) {
#ifndef FLASHSIM_HOST
    long long v;
    asm volatile("ld.global.nc.s64 %0, [%1];\n" : "=l"(v) : "l"(at + (long long)p * AT_NUM + t));
    return v;
#else
    return at_row0(at, p, t);
#endif
}

// -- packed variable-length batches (flashsim.varlen) -----------------------------------
// A dense launch runs problems of Nq × Nk, tile blockIdx.x of each. A varlen launch (vl not
// null) runs the sequences of a packed batch laid out as (problems, total rows, ·): the
// kernel's Nq and Nk are the totals (each problem's row stride), sequence b's rows start
// at cu_q[b], cu_k[b] within each problem, and blockIdx.x walks only real tiles:
//   vl = [B, cu_q[0..B], cu_k[0..B], cu_t[0..B], (b, tile) per blockIdx.x]
// cu_t counts the launch's Q tiles (of Br rows) per sequence, cumulatively: the
// deterministic backward's turn counters are indexed by it. The reference kernels take
// a null or real table at run time; the fast rungs have a VL instance (seq_at below).
struct Seq {
    long long q0, k0;   // first row of the sequence in each problem's Q (O, L) and K (V)
    int Nq, Nk;         // its lengths
    int tile;           // the tile of the sequence this CTA runs
    int b;              // the sequence (0 for a dense launch)
    int t0, tiles;      // its first Q tile among all sequences', and the total (dense: 0, ⌈Nq/Br⌉)
};
__device__ __forceinline__ Seq seq_of(const int* vl, unsigned x, int Nq, int Nk, int Br) {
    if (vl == nullptr) return Seq{0, 0, Nq, Nk, (int)x, 0, 0, (Nq + Br - 1) / Br};
    const int B = vl[0];
    const int* cu_q = vl + 1;
    const int* cu_k = cu_q + B + 1;
    const int* cu_t = cu_k + B + 1;
    const int b = cu_t[B + 1 + 2 * x], tile = cu_t[B + 2 + 2 * x];
    return Seq{cu_q[b], cu_k[b], cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b], tile, b,
               cu_t[b], cu_t[B]};
}
// The fast rungs' form: VL a template argument, so that their dense instances see a
// null table and fold seq_of to the launch's own Nq, Nk (their code is unchanged by it)
template <bool VL>
__device__ __forceinline__ Seq seq_at(const int* vl, unsigned x, int Nq, int Nk, int Br) {
    return seq_of(VL ? vl : nullptr, x, Nq, Nk, Br);
}

// -- the variants' scores -----------------------------------------------------------
// S = softcap · tanh(s / softcap) − slope · |r + off − c| for s = scale · q·k (softcap 0:
// none; slope 0: no ALiBi), the order of flashsim.variants.Scores.finish. *t receives the
// tanh, which the backward needs (1 − tanh² is the softcap's derivative).
template <typename A> struct Scores {
    A softcap, slope;
    int off;
    __device__ __forceinline__ A operator()(A s, int r, int c, A* t = nullptr) const {
        if (softcap > A(0)) {
            const A th = tanh_acc(s / softcap);
            if (t != nullptr) *t = th;
            s = softcap * th;
        }
        if (slope != A(0)) {
            const int dist = r + off - c;
            s -= slope * (A)(dist < 0 ? -dist : dist);
        }
        return s;
    }
};

// -- the reference forwards' scores tile (flash2_ref.cu, flash1_ref.cu) ---------------
// S_ij = score(scale · Q_i K_jᵀ) inside the band, −∞ outside it, into sS (row stride Bc),
// for the Q tile of `rows` rows from row i0 and the K tile of `cols` keys from key j0.
template <typename A>
__device__ void ref_scores_tile(const A* sQ, const A* sK, A* sS, int rows, int cols, int d,
                                int Bc, int i0, int j0, const Band& band,
                                const Scores<A>& score, A scale) {
    for (int x = threadIdx.x; x < rows * cols; x += blockDim.x) {
        const int r = x / cols, c = x % cols;
        A s = A(0);
        for (int k = 0; k < d; ++k) s += sQ[r * d + k] * sK[c * d + k];
        sS[r * Bc + c] = band.sees(i0 + r, j0 + c) ? score(s * scale, i0 + r, j0 + c)
                                                    : neg_inf<A>();
    }
}

// -- one step of the reference backward (flash2_ref.cu, flash1_ref.cu) -----------------
// For the Q tile of `rows` rows from row i0 against the K/V tile of `cols` keys from key
// j0, all in shared memory: P = exp(S − m) (times 1/ℓ per row where sl is given: flash1's
// ℓ; flash2's m is L), dS = P ∘ (dO Vᵀ − D) through the softcap, rounded to T (it meets
// K and Q in the I/O type), then dV_j += round(P)ᵀ dO_i and dK_j += scale · dSᵀ Q_i. Call
// after a barrier that makes the tiles and D visible; leaves dS in sdS for the caller's dQ.
template <typename T, typename A>
__device__ void ref_bwd_step(const A* sQ, const A* sK, const A* sV, const A* sdO, const A* sm,
                             const A* sl, const A* sD, A* sP, A* sdS, A* sdK, A* sdV,
                             int rows, int cols, int d, int dv, int Bc, int i0, int j0,
                             const Band& band, const Scores<A>& score, A scale, A softcap) {
    const int tid = threadIdx.x, nt = blockDim.x;
    for (int x = tid; x < rows * cols; x += nt) {             // P = exp(S − m) / ℓ
        const int r = x / cols, c = x % cols;
        A s = A(0);
        for (int k = 0; k < d; ++k) s += sQ[r * d + k] * sK[c * d + k];
        const bool live = band.sees(i0 + r, j0 + c) && !is_neg_inf(sm[r]);
        A t = A(0);
        const A S = score(s * scale, i0 + r, j0 + c, &t);
        const A inv = sl == nullptr ? A(1) : (sl[r] > A(0) ? A(1) / sl[r] : A(0));
        sP[r * Bc + c] = live ? exp_acc(S - sm[r]) * inv : A(0);
        sdS[r * Bc + c] = t;   // tanh of the softcap, read back by this thread below
    }
    __syncthreads();
    for (int x = tid; x < rows * cols; x += nt) {             // dS = P ∘ (dO Vᵀ − D)
        const int r = x / cols, c = x % cols;
        A dp = A(0);
        for (int k = 0; k < dv; ++k) dp += sdO[r * dv + k] * sV[c * dv + k];
        // through the softcap: d(c·tanh(s/c))/ds = 1 − tanh²
        const A t = sdS[r * Bc + c];
        const A through = softcap > A(0) ? A(1) - t * t : A(1);
        sdS[r * Bc + c] = round_io<T>(sP[r * Bc + c] * (dp - sD[r]) * through);
    }
    __syncthreads();
    for (int x = tid; x < cols * dv; x += nt) {               // dV_j += Pᵀ dO_i
        const int c = x / dv, k = x % dv;
        A acc = A(0);
        for (int r = 0; r < rows; ++r) acc += round_io<T>(sP[r * Bc + c]) * sdO[r * dv + k];
        sdV[x] += acc;
    }
    for (int x = tid; x < cols * d; x += nt) {                // dK_j += scale · dSᵀ Q_i
        const int c = x / d, k = x % d;
        A acc = A(0);
        for (int r = 0; r < rows; ++r) acc += sdS[r * Bc + c] * sQ[r * d + k];
        sdK[x] += scale * acc;
    }
}

// -- ordered accumulation (the deterministic backward) ----------------------------------
// The K/V tiles that add into one Q tile's rows of dQacc take turns in a fixed order of
// j (increasing in the reference kernel, decreasing in the tensor-core one): turn[q tile]
// counts the tiles that have added. A CTA waits until the count is its turn (the number
// of visiting tiles before it in that order), adds, and passes the turn on. CTAs start
// in increasing blockIdx.x, and each kernel maps blockIdx.x to j so that the tile a CTA
// waits for has the lower blockIdx.x: it is running or done.
#ifndef FLASHSIM_HOST
__device__ __forceinline__ void wait_turn(const int* turn, int mine) {
    if (threadIdx.x == 0) {
        int v;
        do {
            asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(turn) : "memory");
        } while (v != mine);
    }
    __syncthreads();
}
__device__ __forceinline__ void pass_turn(int* turn, int mine) {
    __syncthreads();                              // every thread of the CTA has added
    if (threadIdx.x == 0)
        asm volatile("st.release.gpu.global.b32 [%0], %1;\n" :: "l"(turn), "r"(mine + 1) : "memory");
}
#else
// The emulator (host_emu.h) runs blocks one at a time in blockIdx order, so the tile a
// block waits for has finished, or the kernel's order of j contradicts its blockIdx
// order: that would hang a GPU, and is reported here instead.
inline void wait_turn(const int* turn, int mine) {
    if (threadIdx.x == 0 && *turn != mine)
        emu::fail("deterministic backward: block (" + std::to_string(blockIdx.x) + ", " +
                  std::to_string(blockIdx.y) + ") waits for turn " + std::to_string(mine) +
                  " but the counter says " + std::to_string(*turn) +
                  ": a block it waits for comes later in blockIdx order");
    __syncthreads();
}
inline void pass_turn(int* turn, int mine) {
    __syncthreads();
    if (threadIdx.x == 0) *turn = mine + 1;
}
#endif

// -- I/O counters (instrumented build only) --------------------------------------------
// One counter per (tensor, direction). flashsim.gpu reads this enum to name them, so
// keep the IO_<tensor>_<R|W> spelling.
enum IoCounter {
    IO_Q_R, IO_K_R, IO_V_R, IO_O_R, IO_O_W, IO_L_R, IO_L_W,
    IO_dO_R, IO_D_R, IO_D_W, IO_dQacc_R, IO_dQacc_W, IO_dQ_W, IO_dK_W, IO_dV_W,
    // decoding over a KV cache (splitkv_tc.cu): appended rows, the block table, partials
    IO_K_W, IO_V_W, IO_Knew_R, IO_Vnew_R, IO_block_table_R,
    IO_Osplit_R, IO_Osplit_W, IO_Lsplit_R, IO_Lsplit_W,
    // FlashAttention-1 (flash1_ref.cu): the running statistics and dQ through HBM
    IO_l_R, IO_l_W, IO_m_R, IO_m_W, IO_dQ_R,
    // standard attention (standard_ref.cu): the N × N matrices through HBM
    IO_S_R, IO_S_W, IO_P_R, IO_P_W, IO_dP_R, IO_dP_W, IO_dS_R, IO_dS_W,
    IO_NUM_COUNTERS
};

// Each CTA adds the bytes of every tile it moves between global memory and shared
// memory or registers; one thread per CTA does the add so it is counted once.
#ifdef FLASHSIM_COUNT_IO
// threadIdx.x is read through volatile asm so that the test is made where the count is,
// not hoisted into a register held across a kernel's main loop
#ifndef FLASHSIM_HOST
__device__ __forceinline__ bool count_thread() {
    unsigned t;
    asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(t));
    return t == 0;
}
#else
inline bool count_thread() { return threadIdx.x == 0; }
#endif
#define COUNT_IO(io, which, bytes)                                                     \
    do {                                                                               \
        if (count_thread())                                                            \
            atomicAdd(&(io)[which], (unsigned long long)(bytes));                      \
    } while (0)
#else
#define COUNT_IO(io, which, bytes) do { (void)(io); } while (0)
#endif

// -- the forward's Q tile (tensor-core rungs) ------------------------------------------
// The fast rungs' head dims are template instances D; a head dim d (dv) below the
// instance's runs on it with the columns past d (dv) zero-filled on chip and never
// stored, so every count below is of the real d and dv, as the simulator's.
// A Q tile of `rows` rows (O_i, row stride ldo, dv columns, and L_i) that sees no key
// writes O_i = 0 and L_i = −∞ and moves nothing else; the CTA's THREADS threads share
// the writes (fwd_tile_unseen_write: THREADS threads numbered from 0 by tid, which the
// copy-engine forward's consumers are, its producer counting).
template <typename T>
__device__ __forceinline__ void fwd_tile_unseen_count(unsigned long long* io, int rows, int dv) {
    COUNT_IO(io, IO_O_W, (long long)rows * dv * sizeof(T));   // SRAM→HBM: O_i (Br·dv)
    COUNT_IO(io, IO_L_W, (long long)rows * 4);                // SRAM→HBM: L_i (Br)
}
template <typename T, int THREADS>
__device__ __forceinline__ void fwd_tile_unseen_write(T* Oi, int ldo, float* Li, int rows, int dv,
                                                      int tid) {
    for (int x = tid; x < rows * dv; x += THREADS) Oi[(long long)(x / dv) * ldo + x % dv] = from_acc<T>(0.0f);
    for (int r = tid; r < rows; r += THREADS) Li[r] = neg_inf<float>();
}
template <typename T, int THREADS>
__device__ __forceinline__ void fwd_tile_unseen(T* Oi, int ldo, float* Li, int rows, int dv,
                                                unsigned long long* io) {
    fwd_tile_unseen_write<T, THREADS>(Oi, ldo, Li, rows, dv, threadIdx.x);
    fwd_tile_unseen_count<T>(io, rows, dv);
}
// The traffic of the CTA of a Q tile that visits K/V tiles jlo..jhi of Bc keys, counted
// once before the main loop, where registers are free (counts inside or after the loop
// would hold registers the loop needs).
template <typename T>
__device__ __forceinline__ void fwd_tile_count(unsigned long long* io, int rows, int jlo, int jhi,
                                               int Bc, int Nk, int d, int dv) {
    COUNT_IO(io, IO_Q_R, (long long)rows * d * sizeof(T));        // HBM→SRAM: Q_i (Br·d)
    {   // HBM→SRAM: K_j (Bc·d), V_j (Bc·dv) for j = jlo..jhi, the last tile cut at Nk
        const long long kv_rows = min(Nk, (jhi + 1) * Bc) - jlo * Bc;
        COUNT_IO(io, IO_K_R, kv_rows * d * sizeof(T));
        COUNT_IO(io, IO_V_R, kv_rows * dv * sizeof(T));
    }
    COUNT_IO(io, IO_O_W, (long long)rows * dv * sizeof(T));       // SRAM→HBM: O_i (Br·dv)
    COUNT_IO(io, IO_L_W, (long long)rows * 4);                    // SRAM→HBM: L_i (Br)
}

// The traffic of the fast backwards' CTA of a K/V tile of `cols` keys whose visited Q
// steps hold q_rows rows (the last cut at Nq), counted once (the tc backward before its
// main loop, the wg one after it): K_j, V_j once, and per step Q_i, dO_i, L_i, D_i in
// and dQacc_i in and out (dK_j and dV_j are counted where they are written)
template <typename T>
__device__ __forceinline__ void bwd_tile_count(unsigned long long* io, int cols, long long q_rows,
                                               int d, int dv) {
    COUNT_IO(io, IO_K_R, (long long)cols * d * sizeof(T));    // HBM→SRAM: K_j (Bc·d)
    COUNT_IO(io, IO_V_R, (long long)cols * dv * sizeof(T));   // HBM→SRAM: V_j (Bc·dv)
    COUNT_IO(io, IO_Q_R, q_rows * d * sizeof(T));             // HBM→SRAM: Q_i (Br·d)
    COUNT_IO(io, IO_dO_R, q_rows * dv * sizeof(T));           // HBM→SRAM: dO_i (Br·dv)
    COUNT_IO(io, IO_L_R, q_rows * 4);                         // HBM→SRAM: L_i (Br)
    COUNT_IO(io, IO_D_R, q_rows * 4);                         // HBM→SRAM: D_i (Br)
    COUNT_IO(io, IO_dQacc_R, q_rows * d * 4);                 // HBM→SRAM: dQacc_i (Br·d fp32)
    COUNT_IO(io, IO_dQacc_W, q_rows * d * 4);                 // SRAM→HBM: dQacc_i (Br·d fp32)
}
