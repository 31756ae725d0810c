// flash1_ref.cu: FlashAttention-1 on the reference rung, the FlashAttention paper's
// Algorithm 1 (forward) and Algorithm 4 (backward) as flashsim.simulate(...,"flash1")
// runs them: K/V tiles outer, Q tiles inner, and the running O, ℓ, m (backward: dQ) read
// from and written back to HBM at every visited (i, j) pair, so an instrumented build
// counts the simulator's bytes exactly.
//
// Kernels in this file, each a rung over the last:
//   flash1_fwd<T>  forward. Grid (1, problems): one CTA per (batch, head) walks the whole
//                  loop, as FlashAttention-1 parallelised (over batch and heads only):
//                  Q tiles of different K/V steps update the same O_i, in order of j.
//                  Writes O = 0, ℓ = 0, m = −∞; then per K/V tile j reads K_j, V_j once
//                  and per visited Q tile i reads Q_i, O_i, ℓ_i, m_i, rescales and
//                  writes them back. The log-sum-exp is m + log ℓ, derived after the
//                  launch (as the simulator derives it, outside the count).
//   flash1_bwd<T>  backward (Algorithm 4). Grid (1, problems): writes dQ = 0; per K/V
//                  tile j keeps K_j, V_j, dK_j, dV_j on chip and per visited Q tile i
//                  reads Q_i, O_i, dO_i, dQ_i, ℓ_i, m_i, recomputes P = exp(S − m)/ℓ,
//                  and writes dQ_i back (in the I/O type); then writes dK_j, dV_j (zero
//                  for a tile no query row sees, which reads nothing).
// Scores, band and variants as flash2_ref.cu (common.cuh's Band and Scores); the same
// layout: Q, O (problems, Nq, d|dv), K, V (kv problems, Nk, d|dv) through kv_index; ℓ, m
// fp32 (problems, Nq); dK, dV per query problem (GQA sums them after).
// O and dQ go back to HBM in the I/O type T at every step, as the simulator counts them
// (precision="kernel" rounds them the same way); arithmetic in AccOf<T>.

#include "common.cuh"

template <typename T>
__global__ void flash1_fwd(const T* __restrict__ Q, const T* __restrict__ K,
                           const T* __restrict__ V, const int* __restrict__ kv_index,
                           T* __restrict__ O, float* __restrict__ l, float* __restrict__ m,
                           int Nq, int Nk, int d, int dv, int Br, int Bc, int left, int right,
                           typename AccOf<T>::type scale, typename AccOf<T>::type softcap,
                           const float* __restrict__ slopes, unsigned long long* io) {
    using A = typename AccOf<T>::type;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    A* sK = reinterpret_cast<A*>(smem_raw);   // Bc·d
    A* sV = sK + Bc * d;                      // Bc·dv
    A* sQ = sV + Bc * dv;                     // Br·d
    A* sO = sQ + Br * d;                      // Br·dv
    A* sS = sO + Br * dv;                     // Br·Bc: S_ij, then P̃_ij in place
    A* sm = sS + Br * Bc;                     // Br: m_i, then m_new
    A* sl = sm + Br;                          // Br: ℓ_i, then ℓ_new
    A* sa = sl + Br;                          // Br: weight of the old O_i, ℓ_i e^{m_i−m_new}/ℓ_new
    A* sb = sa + Br;                          // Br: weight of P̃_ij V_j, e^{m̃_ij−m_new}/ℓ_new

    const int tid = threadIdx.x, nt = blockDim.x;
    const int p = blockIdx.y;
    const long long row0 = (long long)p * Nq;  // this problem's first row of Q, O, ℓ, m
    const long long kv = kv_index[p];
    const T* Kp = K + kv * Nk * d;
    const T* Vp = V + kv * Nk * dv;
    const Band band{left, right, Nk - Nq};
    const A slope = slopes == nullptr ? A(0) : (A)slopes[p];
    const Scores<A> score{softcap, slope, Nk - Nq};

    for (long long x = tid; x < (long long)Nq * dv; x += nt) O[row0 * dv + x] = from_acc<T>(A(0));
    for (int r = tid; r < Nq; r += nt) { l[row0 + r] = 0.0f; m[row0 + r] = neg_inf<float>(); }
    COUNT_IO(io, IO_O_W, (long long)Nq * dv * sizeof(T));         // SRAM→HBM: O = 0 (Nq·dv)
    COUNT_IO(io, IO_l_W, (long long)Nq * 4);                      // SRAM→HBM: ℓ = 0 (Nq)
    COUNT_IO(io, IO_m_W, (long long)Nq * 4);                      // SRAM→HBM: m = −∞ (Nq)

    const int Tc = (Nk + Bc - 1) / Bc;
    for (int j = 0; j < Tc; ++j) {
        const int j0 = j * Bc, cols = min(Bc, Nk - j0);
        int ilo, ihi;
        band.q_range(j0, j0 + cols, Nq, Br, &ilo, &ihi);
        if (ihi < ilo) continue;                                   // no visible entry: skip K_j
        __syncthreads();  // the last step is done with sK, sV (and its O_i writes are seen)
        for (int x = tid; x < cols * d; x += nt) sK[x] = to_acc<A>(Kp[(long long)j0 * d + x]);
        for (int x = tid; x < cols * dv; x += nt) sV[x] = to_acc<A>(Vp[(long long)j0 * dv + x]);
        COUNT_IO(io, IO_K_R, (long long)cols * d * sizeof(T));    // HBM→SRAM: K_j (Bc·d)
        COUNT_IO(io, IO_V_R, (long long)cols * dv * sizeof(T));   // HBM→SRAM: V_j (Bc·dv)

        for (int i = ilo; i <= ihi; ++i) {
            const int i0 = i * Br, rows = min(Br, Nq - i0);
            const long long q_row = row0 + i0;
            __syncthreads();  // sK, sV loaded; the last i is done with sQ, sO, sS
            for (int x = tid; x < rows * d; x += nt) sQ[x] = to_acc<A>(Q[q_row * d + x]);
            for (int x = tid; x < rows * dv; x += nt) sO[x] = to_acc<A>(O[q_row * dv + x]);
            for (int r = tid; r < rows; r += nt) { sl[r] = (A)l[q_row + r]; sm[r] = (A)m[q_row + r]; }
            COUNT_IO(io, IO_Q_R, (long long)rows * d * sizeof(T));    // HBM→SRAM: Q_i (Br·d)
            COUNT_IO(io, IO_O_R, (long long)rows * dv * sizeof(T));   // HBM→SRAM: O_i (Br·dv)
            COUNT_IO(io, IO_l_R, (long long)rows * 4);                // HBM→SRAM: ℓ_i (Br)
            COUNT_IO(io, IO_m_R, (long long)rows * 4);                // HBM→SRAM: m_i (Br)
            __syncthreads();

            // S_ij = scale · Q_i K_jᵀ, the variants, the band (common.cuh)
            ref_scores_tile(sQ, sK, sS, rows, cols, d, Bc, i0, j0, band, score, scale);
            __syncthreads();

            for (int r = tid; r < rows; r += nt) {                    // the statistics, per row
                A m_t = neg_inf<A>();                                 // m̃_ij = rowmax(S_ij)
                for (int c = 0; c < cols; ++c) m_t = sS[r * Bc + c] > m_t ? sS[r * Bc + c] : m_t;
                // a row with no visible key keeps m = −∞; subtracting 0 then gives exp(−∞)
                // = 0 where exp(−∞ − (−∞)) would be NaN
                const A mt_safe = is_neg_inf(m_t) ? A(0) : m_t;
                A l_t = A(0);                                         // ℓ̃_ij = rowsum(P̃_ij)
                for (int c = 0; c < cols; ++c) {
                    const A pr = exp_acc(sS[r * Bc + c] - mt_safe);
                    l_t += pr;
                    sS[r * Bc + c] = round_io<T>(pr);                 // P̃ meets V in the I/O type
                }
                const A m_i = sm[r], l_i = sl[r];
                const A m_new = m_t > m_i ? m_t : m_i;
                const A mn_safe = is_neg_inf(m_new) ? A(0) : m_new;
                const A a = exp_acc(m_i - mn_safe);                   // e^{m_i − m_new}
                const A b = exp_acc(m_t - mn_safe);                   // e^{m̃_ij − m_new}
                const A l_new = a * l_i + b * l_t;
                const A inv = l_new > A(0) ? A(1) / l_new : A(0);
                sa[r] = inv * (l_i * a);
                sb[r] = inv * b;
                sm[r] = m_new;
                sl[r] = l_new;
            }
            __syncthreads();

            // O_i = diag(ℓ_new)^−1 (diag(ℓ_i e^{m_i−m_new}) O_i + e^{m̃−m_new} P̃_ij V_j)
            for (int x = tid; x < rows * dv; x += nt) {
                const int r = x / dv, k = x % dv;
                A acc = A(0);
                for (int c = 0; c < cols; ++c) acc += sS[r * Bc + c] * sV[c * dv + k];
                O[q_row * dv + x] = from_acc<T>(sa[r] * sO[x] + sb[r] * acc);
            }
            for (int r = tid; r < rows; r += nt) {
                l[q_row + r] = (float)sl[r];
                m[q_row + r] = (float)sm[r];
            }
            COUNT_IO(io, IO_O_W, (long long)rows * dv * sizeof(T));   // SRAM→HBM: O_i (Br·dv)
            COUNT_IO(io, IO_l_W, (long long)rows * 4);                // SRAM→HBM: ℓ_i (Br)
            COUNT_IO(io, IO_m_W, (long long)rows * 4);                // SRAM→HBM: m_i (Br)
        }
    }
}

template <typename T>
__global__ void flash1_bwd(const T* __restrict__ Q, const T* __restrict__ K,
                           const T* __restrict__ V, const int* __restrict__ kv_index,
                           const T* __restrict__ O, const T* __restrict__ dO,
                           const float* __restrict__ l, const float* __restrict__ m,
                           T* __restrict__ dQ, T* __restrict__ dK, T* __restrict__ dV,
                           int Nq, int Nk, int d, int dv, int Br, int Bc, int left, int right,
                           typename AccOf<T>::type scale, typename AccOf<T>::type softcap,
                           const float* __restrict__ slopes, unsigned long long* io) {
    using A = typename AccOf<T>::type;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    A* sK = reinterpret_cast<A*>(smem_raw);   // Bc·d
    A* sV = sK + Bc * d;                      // Bc·dv
    A* sdK = sV + Bc * dv;                    // Bc·d
    A* sdV = sdK + Bc * d;                    // Bc·dv
    A* sQ = sdV + Bc * dv;                    // Br·d
    A* sdO = sQ + Br * d;                     // Br·dv
    A* sdQ = sdO + Br * dv;                   // Br·d
    A* sP = sdQ + Br * d;                     // Br·Bc
    A* sdS = sP + Br * Bc;                    // Br·Bc: tanh of the softcap, then dS
    A* sm = sdS + Br * Bc;                    // Br
    A* sl = sm + Br;                          // Br
    A* sD = sl + Br;                          // Br: D_i = rowsum(dO_i ∘ O_i)

    const int tid = threadIdx.x, nt = blockDim.x;
    const int p = blockIdx.y;
    const long long row0 = (long long)p * Nq;
    const long long kv = kv_index[p];
    const T* Kp = K + kv * Nk * d;
    const T* Vp = V + kv * Nk * dv;
    const Band band{left, right, Nk - Nq};
    const A slope = slopes == nullptr ? A(0) : (A)slopes[p];
    const Scores<A> score{softcap, slope, Nk - Nq};

    for (long long x = tid; x < (long long)Nq * d; x += nt) dQ[row0 * d + x] = from_acc<T>(A(0));
    COUNT_IO(io, IO_dQ_W, (long long)Nq * d * sizeof(T));         // SRAM→HBM: dQ = 0 (Nq·d)

    const int Tc = (Nk + Bc - 1) / Bc;
    for (int j = 0; j < Tc; ++j) {
        const int j0 = j * Bc, cols = min(Bc, Nk - j0);
        int ilo, ihi;
        band.q_range(j0, j0 + cols, Nq, Br, &ilo, &ihi);
        __syncthreads();  // the last step is done with sK, sV, sdK, sdV (and dQ_i is written)
        for (int x = tid; x < cols * d; x += nt) sdK[x] = A(0);
        for (int x = tid; x < cols * dv; x += nt) sdV[x] = A(0);
        if (ihi >= ilo) {
            for (int x = tid; x < cols * d; x += nt) sK[x] = to_acc<A>(Kp[(long long)j0 * d + x]);
            for (int x = tid; x < cols * dv; x += nt) sV[x] = to_acc<A>(Vp[(long long)j0 * dv + x]);
            COUNT_IO(io, IO_K_R, (long long)cols * d * sizeof(T));    // HBM→SRAM: K_j (Bc·d)
            COUNT_IO(io, IO_V_R, (long long)cols * dv * sizeof(T));   // HBM→SRAM: V_j (Bc·dv)
        }
        for (int i = ilo; i <= ihi; ++i) {
            const int i0 = i * Br, rows = min(Br, Nq - i0);
            const long long q_row = row0 + i0;
            __syncthreads();  // the last i is done with sQ, sdO, sdQ, sP, sdS
            for (int x = tid; x < rows * d; x += nt) sQ[x] = to_acc<A>(Q[q_row * d + x]);
            for (int x = tid; x < rows * dv; x += nt) sdO[x] = to_acc<A>(dO[q_row * dv + x]);
            for (int x = tid; x < rows * d; x += nt) sdQ[x] = to_acc<A>(dQ[q_row * d + x]);
            for (int r = tid; r < rows; r += nt) { sl[r] = (A)l[q_row + r]; sm[r] = (A)m[q_row + r]; }
            COUNT_IO(io, IO_Q_R, (long long)rows * d * sizeof(T));    // HBM→SRAM: Q_i (Br·d)
            COUNT_IO(io, IO_dO_R, (long long)rows * dv * sizeof(T));  // HBM→SRAM: dO_i (Br·dv)
            COUNT_IO(io, IO_dQ_R, (long long)rows * d * sizeof(T));   // HBM→SRAM: dQ_i (Br·d)
            COUNT_IO(io, IO_l_R, (long long)rows * 4);                // HBM→SRAM: ℓ_i (Br)
            COUNT_IO(io, IO_m_R, (long long)rows * 4);                // HBM→SRAM: m_i (Br)
            __syncthreads();
            for (int r = tid; r < rows; r += nt) {                    // D_i = rowsum(dO_i ∘ O_i)
                A acc = A(0);
                for (int k = 0; k < dv; ++k) acc += sdO[r * dv + k] * to_acc<A>(O[(q_row + r) * dv + k]);
                sD[r] = acc;
            }
            COUNT_IO(io, IO_O_R, (long long)rows * dv * sizeof(T));   // HBM→SRAM: O_i (Br·dv)

            __syncthreads();  // D_i is written
            // P = exp(S − m)/ℓ, dS, and dV_j, dK_j updated (common.cuh)
            ref_bwd_step<T>(sQ, sK, sV, sdO, sm, sl, sD, sP, sdS, sdK, sdV, rows, cols, d, dv,
                            Bc, i0, j0, band, score, scale, softcap);
            for (int x = tid; x < rows * d; x += nt) {                // dQ_i += scale · dS K_j
                const int r = x / d, k = x % d;
                A acc = A(0);
                for (int c = 0; c < cols; ++c) acc += sdS[r * Bc + c] * sK[c * d + k];
                dQ[q_row * d + x] = from_acc<T>(sdQ[x] + scale * acc);
            }
            COUNT_IO(io, IO_dQ_W, (long long)rows * d * sizeof(T));   // SRAM→HBM: dQ_i (Br·d)
        }
        __syncthreads();
        T* dKj = dK + ((long long)p * Nk + j0) * d;     // per query problem; GQA sums later
        T* dVj = dV + ((long long)p * Nk + j0) * dv;
        for (int x = tid; x < cols * d; x += nt) dKj[x] = from_acc<T>(sdK[x]);
        for (int x = tid; x < cols * dv; x += nt) dVj[x] = from_acc<T>(sdV[x]);
        COUNT_IO(io, IO_dK_W, (long long)cols * d * sizeof(T));       // SRAM→HBM: dK_j (Bc·d)
        COUNT_IO(io, IO_dV_W, (long long)cols * dv * sizeof(T));      // SRAM→HBM: dV_j (Bc·dv)
    }
}
