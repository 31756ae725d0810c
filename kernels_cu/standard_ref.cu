// standard_ref.cu: standard attention on the reference rung, the FlashAttention paper's
// Algorithm 0 (forward) and Algorithm 3 (backward) as flashsim.simulate(..., "standard",
// block_sizes=(Br, Bc)) runs them: every N × N matrix (S, P; backward dP, dS) goes
// through HBM, one pass per line of the algorithm, so an instrumented build counts the
// simulator's bytes exactly.
//
// The matrix products are tiled: a CTA holds one output tile and streams the tiles it
// needs, so the operand that is not held is read once per output tile (K and V once per
// Q tile of Br rows; backward, dO and Q once per K/V tile of Bc rows). The row passes
// (softmax, dS) hold a whole row of each matrix they read in shared memory, so each
// matrix is read once. No tile is skipped: standard attention computes S everywhere and
// masks it (−∞), as a dense implementation does.
//
// Kernels in this file, in the order a forward and a backward launch them:
//   standard_fwd_scores<T>  S = scale·Q Kᵀ, the variants, the band mask (−∞ outside).
//                           Grid (Tr, problems): Q_i held, K_j streamed, S_ij written.
//   standard_fwd_softmax<T> P = softmax(S), L = m + log ℓ. Grid (Nq, problems): one row.
//   standard_fwd_out<T>     O = P V. Grid (Tr, problems): O_i held, P_ij, V_j streamed.
//   standard_bwd_dv<T>      dV = Pᵀ dO. Grid (Tc, problems): dV_j held, P_ij, dO_i streamed.
//   standard_bwd_dp<T>      dP = dO Vᵀ. Grid (Tr, problems): dO_i held, V_j streamed.
//   standard_bwd_ds<T>      dS = P ∘ (dP − rowsum(P ∘ dP)), through the softcap's tanh
//                           (recovered from the stored S). Grid (Nq, problems): one row.
//   standard_bwd_dq<T>      dQ = scale·dS K. Grid (Tr, problems): as standard_fwd_out.
//   standard_bwd_dk<T>      dK = scale·dSᵀ Q. Grid (Tc, problems): as standard_bwd_dv.
// Layout as flash2_ref.cu: Q, O, dO (problems, Nq, d|dv); K, V (kv problems, Nk, d|dv)
// through kv_index; S, P, dP, dS (problems, Nq, Nk) in the I/O type T; L fp32; dK, dV per
// query problem (GQA sums them after). Arithmetic in AccOf<T>; every matrix stored in T.

#include "common.cuh"

// -- the three tiled products -------------------------------------------------------------
// out_ij = A_i B_jᵀ (rows of A and of B are the length-n vectors): a CTA per tile i of Br
// rows holds A_i and streams B_j, calling store(r, c, value) per element of each out_ij.
template <typename T, int A_READ, int B_READ, typename Store>
__device__ void rows_times_rows(const T* Ai, const T* B, int rows, int Nk, int n, int Bc,
                                typename AccOf<T>::type* sA, typename AccOf<T>::type* sB,
                                unsigned long long* io, Store store) {
    using A = typename AccOf<T>::type;
    const int tid = threadIdx.x, nt = blockDim.x;
    for (int x = tid; x < rows * n; x += nt) sA[x] = to_acc<A>(Ai[x]);
    COUNT_IO(io, A_READ, (long long)rows * n * sizeof(T));       // HBM→SRAM: Q_i | dO_i (Br·n)
    for (int j0 = 0; j0 < Nk; j0 += Bc) {
        const int cols = min(Bc, Nk - j0);
        __syncthreads();  // sA loaded; the last tile is done with sB
        for (int x = tid; x < cols * n; x += nt) sB[x] = to_acc<A>(B[(long long)j0 * n + x]);
        COUNT_IO(io, B_READ, (long long)cols * n * sizeof(T));   // HBM→SRAM: K_j | V_j (Bc·n)
        __syncthreads();
        for (int x = tid; x < rows * cols; x += nt) {
            const int r = x / cols, c = x % cols;
            A s = A(0);
            for (int k = 0; k < n; ++k) s += sA[r * n + k] * sB[c * n + k];
            store(r, j0 + c, s);
        }
    }
}

// out_i = Σ_j X_ij Y_j for the tile i of Br rows of X (Nq × Nk, row stride Nk) and Y (Nk
// rows of n): a CTA holds out_i and streams X_ij and Y_j. Returns out_i in sO (Br·n).
template <typename T, int X_READ, int Y_READ>
__device__ void tiles_times_rows(const T* Xi, const T* Y, int rows, int Nk, int n, int Bc,
                                 typename AccOf<T>::type* sO, typename AccOf<T>::type* sX,
                                 typename AccOf<T>::type* sY, unsigned long long* io) {
    using A = typename AccOf<T>::type;
    const int tid = threadIdx.x, nt = blockDim.x;
    for (int x = tid; x < rows * n; x += nt) sO[x] = A(0);
    for (int j0 = 0; j0 < Nk; j0 += Bc) {
        const int cols = min(Bc, Nk - j0);
        __syncthreads();  // the last tile is done with sX, sY
        for (int x = tid; x < rows * cols; x += nt)
            sX[x] = to_acc<A>(Xi[(long long)(x / cols) * Nk + j0 + x % cols]);
        for (int x = tid; x < cols * n; x += nt) sY[x] = to_acc<A>(Y[(long long)j0 * n + x]);
        COUNT_IO(io, X_READ, (long long)rows * cols * sizeof(T));  // HBM→SRAM: P_ij | dS_ij (Br·Bc)
        COUNT_IO(io, Y_READ, (long long)cols * n * sizeof(T));     // HBM→SRAM: V_j | K_j (Bc·n)
        __syncthreads();
        for (int x = tid; x < rows * n; x += nt) {
            const int r = x / n, k = x % n;
            A acc = A(0);
            for (int c = 0; c < cols; ++c) acc += sX[r * cols + c] * sY[c * n + k];
            sO[x] += acc;
        }
    }
    __syncthreads();
}

// out_j = Σ_i X_ijᵀ Y_i for the tile j of Bc columns of X (Nq × Nk, row stride Nk) and Y
// (Nq rows of n): a CTA holds out_j and streams X_ij and Y_i. Returns out_j in sO (Bc·n).
template <typename T, int X_READ, int Y_READ>
__device__ void tiles_t_times_rows(const T* Xj, const T* Y, int cols, int Nq, int Nk, int n,
                                   int Br, typename AccOf<T>::type* sO,
                                   typename AccOf<T>::type* sX, typename AccOf<T>::type* sY,
                                   unsigned long long* io) {
    using A = typename AccOf<T>::type;
    const int tid = threadIdx.x, nt = blockDim.x;
    for (int x = tid; x < cols * n; x += nt) sO[x] = A(0);
    for (int i0 = 0; i0 < Nq; i0 += Br) {
        const int rows = min(Br, Nq - i0);
        __syncthreads();  // the last tile is done with sX, sY
        for (int x = tid; x < rows * cols; x += nt)
            sX[x] = to_acc<A>(Xj[(long long)(i0 + x / cols) * Nk + x % cols]);
        for (int x = tid; x < rows * n; x += nt) sY[x] = to_acc<A>(Y[(long long)i0 * n + x]);
        COUNT_IO(io, X_READ, (long long)rows * cols * sizeof(T));  // HBM→SRAM: P_ij | dS_ij (Br·Bc)
        COUNT_IO(io, Y_READ, (long long)rows * n * sizeof(T));     // HBM→SRAM: dO_i | Q_i (Br·n)
        __syncthreads();
        for (int x = tid; x < cols * n; x += nt) {
            const int c = x / n, k = x % n;
            A acc = A(0);
            for (int r = 0; r < rows; ++r) acc += sX[r * cols + c] * sY[r * n + k];
            sO[x] += acc;
        }
    }
    __syncthreads();
}

// A sum over the CTA's threads, left in every thread (red: blockDim.x slots).
template <typename A, typename Op>
__device__ A block_reduce(A v, A* red, Op op) {
    __syncthreads();  // red is free
    red[threadIdx.x] = v;
    __syncthreads();
    if (threadIdx.x == 0)
        for (int t = 1; t < (int)blockDim.x; ++t) red[0] = op(red[0], red[t]);
    __syncthreads();
    return red[0];
}

// -- forward ---------------------------------------------------------------------------

template <typename T>
__global__ void standard_fwd_scores(const T* __restrict__ Q, const T* __restrict__ K,
                                    const int* __restrict__ kv_index, T* __restrict__ S,
                                    int Nq, int Nk, int d, int Br, int Bc, int left, int right,
                                    typename AccOf<T>::type scale,
                                    typename AccOf<T>::type softcap,
                                    const float* __restrict__ slopes, unsigned long long* io) {
    using A = typename AccOf<T>::type;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    A* sQ = reinterpret_cast<A*>(smem_raw);   // Br·d
    A* sK = sQ + Br * d;                      // Bc·d
    const int p = blockIdx.y, i0 = blockIdx.x * Br, rows = min(Br, Nq - i0);
    const Band band{left, right, Nk - Nq};
    const A slope = slopes == nullptr ? A(0) : (A)slopes[p];
    const Scores<A> score{softcap, slope, Nk - Nq};
    T* Si = S + ((long long)p * Nq + i0) * Nk;
    rows_times_rows<T, IO_Q_R, IO_K_R>(
        Q + ((long long)p * Nq + i0) * d, K + (long long)kv_index[p] * Nk * d, rows, Nk, d, Bc,
        sQ, sK, io, [&](int r, int c, A s) {
            Si[(long long)r * Nk + c] = from_acc<T>(
                band.sees(i0 + r, c) ? score(s * scale, i0 + r, c) : neg_inf<A>());
        });
    COUNT_IO(io, IO_S_W, (long long)rows * Nk * sizeof(T));      // SRAM→HBM: S_ij (Br·Bc), every j
}

template <typename T>
__global__ void standard_fwd_softmax(const T* __restrict__ S, T* __restrict__ P,
                                     float* __restrict__ L, int Nq, int Nk,
                                     unsigned long long* io) {
    using A = typename AccOf<T>::type;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    A* red = reinterpret_cast<A*>(smem_raw);  // blockDim.x
    T* sS = reinterpret_cast<T*>(red + blockDim.x);   // Nk: the row of S
    const int tid = threadIdx.x, nt = blockDim.x;
    const long long row = (long long)blockIdx.y * Nq + blockIdx.x;
    for (int c = tid; c < Nk; c += nt) sS[c] = S[row * Nk + c];
    COUNT_IO(io, IO_S_R, (long long)Nk * sizeof(T));             // HBM→SRAM: S_r (Nk)
    A m = neg_inf<A>();
    for (int c = tid; c < Nk; c += nt) m = to_acc<A>(sS[c]) > m ? to_acc<A>(sS[c]) : m;
    m = block_reduce(m, red, [](A a, A b) { return a > b ? a : b; });
    const A m_safe = is_neg_inf(m) ? A(0) : m;                    // a row that sees no key
    A l = A(0);
    for (int c = tid; c < Nk; c += nt) l += exp_acc(to_acc<A>(sS[c]) - m_safe);
    l = block_reduce(l, red, [](A a, A b) { return a + b; });
    const A inv = l > A(0) ? A(1) / l : A(0);
    for (int c = tid; c < Nk; c += nt)
        P[row * Nk + c] = from_acc<T>(exp_acc(to_acc<A>(sS[c]) - m_safe) * inv);
    if (tid == 0) L[row] = l > A(0) ? (float)(m + log_acc(l)) : neg_inf<float>();
    COUNT_IO(io, IO_P_W, (long long)Nk * sizeof(T));             // SRAM→HBM: P_r (Nk)
    COUNT_IO(io, IO_L_W, 4);                                     // SRAM→HBM: L_r (1)
}

template <typename T>
__global__ void standard_fwd_out(const T* __restrict__ P, const T* __restrict__ V,
                                 const int* __restrict__ kv_index, T* __restrict__ O,
                                 int Nq, int Nk, int dv, int Br, int Bc,
                                 unsigned long long* io) {
    using A = typename AccOf<T>::type;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    A* sO = reinterpret_cast<A*>(smem_raw);   // Br·dv
    A* sP = sO + Br * dv;                     // Br·Bc
    A* sV = sP + Br * Bc;                     // Bc·dv
    const int p = blockIdx.y, i0 = blockIdx.x * Br, rows = min(Br, Nq - i0);
    const long long q_row = (long long)p * Nq + i0;
    tiles_times_rows<T, IO_P_R, IO_V_R>(P + q_row * Nk, V + (long long)kv_index[p] * Nk * dv,
                                        rows, Nk, dv, Bc, sO, sP, sV, io);
    for (int x = threadIdx.x; x < rows * dv; x += blockDim.x) O[q_row * dv + x] = from_acc<T>(sO[x]);
    COUNT_IO(io, IO_O_W, (long long)rows * dv * sizeof(T));      // SRAM→HBM: O_i (Br·dv)
}

// -- backward ----------------------------------------------------------------------------

template <typename T>
__global__ void standard_bwd_dv(const T* __restrict__ P, const T* __restrict__ dO,
                                T* __restrict__ dV, int Nq, int Nk, int dv, int Br, int Bc,
                                unsigned long long* io) {
    using A = typename AccOf<T>::type;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    A* sdV = reinterpret_cast<A*>(smem_raw);  // Bc·dv
    A* sP = sdV + Bc * dv;                    // Br·Bc
    A* sdO = sP + Br * Bc;                    // Br·dv
    const int p = blockIdx.y, j0 = blockIdx.x * Bc, cols = min(Bc, Nk - j0);
    tiles_t_times_rows<T, IO_P_R, IO_dO_R>(P + (long long)p * Nq * Nk + j0,
                                          dO + (long long)p * Nq * dv, cols, Nq, Nk, dv, Br,
                                          sdV, sP, sdO, io);
    T* dVj = dV + ((long long)p * Nk + j0) * dv;   // per query problem; GQA sums later
    for (int x = threadIdx.x; x < cols * dv; x += blockDim.x) dVj[x] = from_acc<T>(sdV[x]);
    COUNT_IO(io, IO_dV_W, (long long)cols * dv * sizeof(T));     // SRAM→HBM: dV_j (Bc·dv)
}

template <typename T>
__global__ void standard_bwd_dp(const T* __restrict__ dO, const T* __restrict__ V,
                                const int* __restrict__ kv_index, T* __restrict__ dP,
                                int Nq, int Nk, int dv, int Br, int Bc, unsigned long long* io) {
    using A = typename AccOf<T>::type;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    A* sdO = reinterpret_cast<A*>(smem_raw);  // Br·dv
    A* sV = sdO + Br * dv;                    // Bc·dv
    const int p = blockIdx.y, i0 = blockIdx.x * Br, rows = min(Br, Nq - i0);
    T* dPi = dP + ((long long)p * Nq + i0) * Nk;
    rows_times_rows<T, IO_dO_R, IO_V_R>(
        dO + ((long long)p * Nq + i0) * dv, V + (long long)kv_index[p] * Nk * dv, rows, Nk, dv,
        Bc, sdO, sV, io,
        [&](int r, int c, A s) { dPi[(long long)r * Nk + c] = from_acc<T>(s); });
    COUNT_IO(io, IO_dP_W, (long long)rows * Nk * sizeof(T));     // SRAM→HBM: dP_ij (Br·Bc), every j
}

template <typename T>
__global__ void standard_bwd_ds(const T* __restrict__ P, const T* __restrict__ dP,
                                const T* __restrict__ S, T* __restrict__ dS, int Nq, int Nk,
                                typename AccOf<T>::type softcap,
                                const float* __restrict__ slopes, unsigned long long* io) {
    using A = typename AccOf<T>::type;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    A* red = reinterpret_cast<A*>(smem_raw);          // blockDim.x
    T* sP = reinterpret_cast<T*>(red + blockDim.x);   // Nk: the rows of P, dP (and S)
    T* sdP = sP + Nk;
    T* sS = sdP + Nk;
    const int tid = threadIdx.x, nt = blockDim.x;
    const int p = blockIdx.y, r = blockIdx.x;
    const long long row = (long long)p * Nq + r;
    for (int c = tid; c < Nk; c += nt) { sP[c] = P[row * Nk + c]; sdP[c] = dP[row * Nk + c]; }
    COUNT_IO(io, IO_P_R, (long long)Nk * sizeof(T));             // HBM→SRAM: P_r (Nk)
    COUNT_IO(io, IO_dP_R, (long long)Nk * sizeof(T));            // HBM→SRAM: dP_r (Nk)
    if (softcap > A(0)) {   // the softcap's tanh, from S less the ALiBi bias
        for (int c = tid; c < Nk; c += nt) sS[c] = S[row * Nk + c];
        COUNT_IO(io, IO_S_R, (long long)Nk * sizeof(T));         // HBM→SRAM: S_r (Nk)
    }
    A D = A(0);                                                   // D_r = rowsum(P ∘ dP)
    for (int c = tid; c < Nk; c += nt) D += to_acc<A>(sP[c]) * to_acc<A>(sdP[c]);
    D = block_reduce(D, red, [](A a, A b) { return a + b; });
    const A slope = slopes == nullptr ? A(0) : (A)slopes[p];
    for (int c = tid; c < Nk; c += nt) {
        A through = A(1);
        if (softcap > A(0)) {   // S = c·tanh + bias, bias = −slope·|r + Nk − Nq − c|
            const A s = to_acc<A>(sS[c]);
            const int dist = r + Nk - Nq - c;
            const A t = is_neg_inf(s) ? A(0) : (s + slope * (A)(dist < 0 ? -dist : dist)) / softcap;
            through = A(1) - t * t;
        }
        const A pr = to_acc<A>(sP[c]);
        dS[row * Nk + c] = from_acc<T>(pr * (to_acc<A>(sdP[c]) - D) * through);
    }
    COUNT_IO(io, IO_dS_W, (long long)Nk * sizeof(T));            // SRAM→HBM: dS_r (Nk)
}

template <typename T>
__global__ void standard_bwd_dq(const T* __restrict__ dS, const T* __restrict__ K,
                                const int* __restrict__ kv_index, T* __restrict__ dQ,
                                int Nq, int Nk, int d, int Br, int Bc,
                                typename AccOf<T>::type scale, unsigned long long* io) {
    using A = typename AccOf<T>::type;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    A* sdQ = reinterpret_cast<A*>(smem_raw);  // Br·d
    A* sdS = sdQ + Br * d;                    // Br·Bc
    A* sK = sdS + Br * Bc;                    // Bc·d
    const int p = blockIdx.y, i0 = blockIdx.x * Br, rows = min(Br, Nq - i0);
    const long long q_row = (long long)p * Nq + i0;
    tiles_times_rows<T, IO_dS_R, IO_K_R>(dS + q_row * Nk, K + (long long)kv_index[p] * Nk * d,
                                         rows, Nk, d, Bc, sdQ, sdS, sK, io);
    for (int x = threadIdx.x; x < rows * d; x += blockDim.x)
        dQ[q_row * d + x] = from_acc<T>(scale * sdQ[x]);
    COUNT_IO(io, IO_dQ_W, (long long)rows * d * sizeof(T));      // SRAM→HBM: dQ_i (Br·d)
}

template <typename T>
__global__ void standard_bwd_dk(const T* __restrict__ dS, const T* __restrict__ Q,
                                T* __restrict__ dK, int Nq, int Nk, int d, int Br, int Bc,
                                typename AccOf<T>::type scale, unsigned long long* io) {
    using A = typename AccOf<T>::type;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    A* sdK = reinterpret_cast<A*>(smem_raw);  // Bc·d
    A* sdS = sdK + Bc * d;                    // Br·Bc
    A* sQ = sdS + Br * Bc;                    // Br·d
    const int p = blockIdx.y, j0 = blockIdx.x * Bc, cols = min(Bc, Nk - j0);
    tiles_t_times_rows<T, IO_dS_R, IO_Q_R>(dS + (long long)p * Nq * Nk + j0,
                                          Q + (long long)p * Nq * d, cols, Nq, Nk, d, Br,
                                          sdK, sdS, sQ, io);
    T* dKj = dK + ((long long)p * Nk + j0) * d;    // per query problem; GQA sums later
    for (int x = threadIdx.x; x < cols * d; x += blockDim.x) dKj[x] = from_acc<T>(scale * sdK[x]);
    COUNT_IO(io, IO_dK_W, (long long)cols * d * sizeof(T));      // SRAM→HBM: dK_j (Bc·d)
}
