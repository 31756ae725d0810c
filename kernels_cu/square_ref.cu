// square_ref.cu: Saha & Ye's square-tile schedule on the reference rung, forward only, as
// flashsim.simulate(..., "square") runs it (flashsim/square.py): the two products of
// attention as blocked matrix products with B × B tiles, the exponentiated score blocks
// E_ij through HBM between them, with a per-block row max m̃_ij (so every exponent is
// ≤ 0) and FlashAttention's online rescaling in the second product. An instrumented build
// counts the simulator's bytes exactly.
//
// Kernels in this file, each a rung over the last:
//   square_fwd_scores<T>  phase 1. Grid (Tr, problems): the CTA of Q tile i walks its
//                  visited K tiles j; for each it accumulates S_ij over chunks of B
//                  columns of the head dim (Q_i[:, c] and K_j[:, c] read per chunk, so
//                  Q_i is read once per visited j), finishes the scores on the whole block
//                  (softcap, ALiBi, the band), and writes E_ij = exp(S_ij − m̃_ij) in the
//                  I/O type (tensor "P") and m̃_ij = rowmax(S_ij) in fp32 (tensor "m").
//   square_fwd_out<T>  phase 2. Grid (Tr, problems): the CTA of Q tile i walks the chunks c
//                  of B columns of dv and, per chunk, the visited j again, reading E_ij,
//                  m̃_ij and V_j[:, c]: m_new = max(m, m̃), O ← e^{m−m_new} O +
//                  e^{m̃−m_new} E V, ℓ likewise from rowsum(E) (recomputed per chunk, from
//                  the E already read); writes O_i[:, c] = O/ℓ and, after the last chunk,
//                  L_i = m + log ℓ. A Q tile that sees no key writes O_i = 0, L_i = −∞ and
//                  reads nothing.
// Layout as flash2_ref.cu: Q, O (problems, Nq, d|dv), K, V (kv problems, Nk, d|dv) through
// kv_index; E (problems, Nq, Nk) in T; m̃ (problems, Tc, Nq) fp32: row j holds block
// column j. Arithmetic in AccOf<T>; E meets V in the I/O type it was stored in.

#include "common.cuh"

template <typename T>
__global__ void square_fwd_scores(const T* __restrict__ Q, const T* __restrict__ K,
                                  const int* __restrict__ kv_index, T* __restrict__ E,
                                  float* __restrict__ Mt, int Nq, int Nk, int d, int B,
                                  int left, int right, typename AccOf<T>::type scale,
                                  typename AccOf<T>::type softcap,
                                  const float* __restrict__ slopes, unsigned long long* io) {
    using A = typename AccOf<T>::type;
    const int w = min(B, d);                  // the widest chunk of the head dim
    extern __shared__ __align__(16) unsigned char smem_raw[];
    A* sS = reinterpret_cast<A*>(smem_raw);   // B·B: S_ij, then E_ij in place
    A* sQ = sS + B * B;                       // B·w: Q_i[:, c]
    A* sK = sQ + B * w;                       // B·w: K_j[:, c]
    A* sm = sK + B * w;                       // B: m̃_ij

    const int tid = threadIdx.x, nt = blockDim.x;
    const int p = blockIdx.y;
    const int i0 = blockIdx.x * B, rows = min(B, Nq - i0);
    const long long q_row = (long long)p * Nq + i0;
    const long long kv = kv_index[p];
    const T* Kp = K + kv * Nk * d;
    const Band band{left, right, Nk - Nq};
    const A slope = slopes == nullptr ? A(0) : (A)slopes[p];
    const Scores<A> score{softcap, slope, Nk - Nq};
    const int Tc = (Nk + B - 1) / B;
    int jlo, jhi;
    band.kv_range(i0, i0 + rows, Nk, B, &jlo, &jhi);

    for (int j = jlo; j <= jhi; ++j) {
        const int j0 = j * B, cols = min(B, Nk - j0);
        __syncthreads();  // the last j is done with sS
        for (int x = tid; x < rows * cols; x += nt) sS[(x / cols) * B + x % cols] = A(0);
        for (int c0 = 0; c0 < d; c0 += B) {
            const int cw = min(B, d - c0);
            __syncthreads();  // the last chunk's products are done with sQ, sK
            for (int x = tid; x < rows * cw; x += nt)
                sQ[x] = to_acc<A>(Q[(q_row + x / cw) * d + c0 + x % cw]);
            for (int x = tid; x < cols * cw; x += nt)
                sK[x] = to_acc<A>(Kp[(long long)(j0 + x / cw) * d + c0 + x % cw]);
            COUNT_IO(io, IO_Q_R, (long long)rows * cw * sizeof(T));   // HBM→SRAM: Q_i[:, c] (B·|c|)
            COUNT_IO(io, IO_K_R, (long long)cols * cw * sizeof(T));   // HBM→SRAM: K_j[:, c] (B·|c|)
            __syncthreads();
            for (int x = tid; x < rows * cols; x += nt) {             // S_ij += Q_i[:, c] K_j[:, c]ᵀ
                const int r = x / cols, col = x % cols;
                A s = A(0);
                for (int k = 0; k < cw; ++k) s += sQ[r * cw + k] * sK[col * cw + k];
                sS[r * B + col] += s;
            }
        }
        __syncthreads();
        // the variants and the band on the complete block (softcap needs all of s)
        for (int x = tid; x < rows * cols; x += nt) {
            const int r = x / cols, col = x % cols;
            sS[r * B + col] = band.sees(i0 + r, j0 + col)
                ? score(sS[r * B + col] * scale, i0 + r, j0 + col) : neg_inf<A>();
        }
        __syncthreads();
        for (int r = tid; r < rows; r += nt) {                        // m̃_ij = rowmax(S_ij)
            A m_t = neg_inf<A>();
            for (int col = 0; col < cols; ++col) m_t = sS[r * B + col] > m_t ? sS[r * B + col] : m_t;
            sm[r] = m_t;
        }
        __syncthreads();
        for (int x = tid; x < rows * cols; x += nt) {                 // E_ij = exp(S_ij − m̃_ij)
            const int r = x / cols, col = x % cols;
            // no visible key in the row: m̃ = −∞; subtracting 0 gives exp(−∞) = 0
            const A mt_safe = is_neg_inf(sm[r]) ? A(0) : sm[r];
            E[(q_row + r) * Nk + j0 + col] = from_acc<T>(exp_acc(sS[r * B + col] - mt_safe));
        }
        for (int r = tid; r < rows; r += nt) Mt[((long long)p * Tc + j) * Nq + i0 + r] = (float)sm[r];
        COUNT_IO(io, IO_P_W, (long long)rows * cols * sizeof(T));     // SRAM→HBM: E_ij (B·B)
        COUNT_IO(io, IO_m_W, (long long)rows * 4);                    // SRAM→HBM: m̃_ij (B)
    }
}

template <typename T>
__global__ void square_fwd_out(const T* __restrict__ V, const int* __restrict__ kv_index,
                               const T* __restrict__ E, const float* __restrict__ Mt,
                               T* __restrict__ O, float* __restrict__ L, int Nq, int Nk,
                               int dv, int B, int left, int right, unsigned long long* io) {
    using A = typename AccOf<T>::type;
    const int wv = min(B, dv);                // the widest chunk of dv
    extern __shared__ __align__(16) unsigned char smem_raw[];
    A* sE = reinterpret_cast<A*>(smem_raw);   // B·B: E_ij
    A* sV = sE + B * B;                       // B·wv: V_j[:, c]
    A* sO = sV + B * wv;                      // B·wv: O_i[:, c], unnormalised
    A* sm = sO + B * wv;                      // B: m, the running max
    A* sl = sm + B;                           // B: ℓ
    A* st = sl + B;                           // B: m̃_ij
    A* sa = st + B;                           // B: e^{m − m_new}
    A* sb = sa + B;                           // B: e^{m̃_ij − m_new}

    const int tid = threadIdx.x, nt = blockDim.x;
    const int p = blockIdx.y;
    const int i0 = blockIdx.x * B, rows = min(B, Nq - i0);
    const long long q_row = (long long)p * Nq + i0;
    const long long kv = kv_index[p];
    const T* Vp = V + kv * Nk * dv;
    const Band band{left, right, Nk - Nq};
    const int Tc = (Nk + B - 1) / B;
    int jlo, jhi;
    band.kv_range(i0, i0 + rows, Nk, B, &jlo, &jhi);

    for (int c0 = 0; c0 < dv; c0 += B) {
        const int cw = min(B, dv - c0);
        __syncthreads();  // the last chunk's O is written
        for (int x = tid; x < rows * cw; x += nt) sO[x] = A(0);
        for (int r = tid; r < rows; r += nt) { sm[r] = neg_inf<A>(); sl[r] = A(0); }
        for (int j = jlo; j <= jhi; ++j) {
            const int j0 = j * B, cols = min(B, Nk - j0);
            __syncthreads();  // the last j is done with sE, sV and the weights
            for (int x = tid; x < rows * cols; x += nt)
                sE[x] = to_acc<A>(E[(q_row + x / cols) * Nk + j0 + x % cols]);
            for (int r = tid; r < rows; r += nt) st[r] = (A)Mt[((long long)p * Tc + j) * Nq + i0 + r];
            for (int x = tid; x < cols * cw; x += nt)
                sV[x] = to_acc<A>(Vp[(long long)(j0 + x / cw) * dv + c0 + x % cw]);
            COUNT_IO(io, IO_P_R, (long long)rows * cols * sizeof(T));   // HBM→SRAM: E_ij (B·B)
            COUNT_IO(io, IO_m_R, (long long)rows * 4);                  // HBM→SRAM: m̃_ij (B)
            COUNT_IO(io, IO_V_R, (long long)cols * cw * sizeof(T));     // HBM→SRAM: V_j[:, c] (B·|c|)
            __syncthreads();
            for (int r = tid; r < rows; r += nt) {                      // the rescaling, per row
                const A m_new = st[r] > sm[r] ? st[r] : sm[r];
                const A mn_safe = is_neg_inf(m_new) ? A(0) : m_new;
                const A a = exp_acc(sm[r] - mn_safe), b = exp_acc(st[r] - mn_safe);
                A rs = A(0);
                for (int col = 0; col < cols; ++col) rs += sE[r * cols + col];
                sl[r] = a * sl[r] + b * rs;
                sm[r] = m_new;
                sa[r] = a;
                sb[r] = b;
            }
            __syncthreads();
            for (int x = tid; x < rows * cw; x += nt) {                 // O ← a·O + b·E V[:, c]
                const int r = x / cw, k = x % cw;
                A acc = A(0);
                for (int col = 0; col < cols; ++col) acc += sE[r * cols + col] * sV[col * cw + k];
                sO[x] = sa[r] * sO[x] + sb[r] * acc;
            }
        }
        __syncthreads();
        for (int x = tid; x < rows * cw; x += nt) {
            const int r = x / cw;
            const A inv = sl[r] > A(0) ? A(1) / sl[r] : A(0);           // no key: O = 0
            O[(q_row + r) * dv + c0 + x % cw] = from_acc<T>(sO[x] * inv);
        }
        COUNT_IO(io, IO_O_W, (long long)rows * cw * sizeof(T));         // SRAM→HBM: O_i[:, c] (B·|c|)
        if (c0 + cw == dv) {
            for (int r = tid; r < rows; r += nt)
                L[q_row + r] = sl[r] > A(0) ? (float)(sm[r] + log_acc(sl[r])) : neg_inf<float>();
            COUNT_IO(io, IO_L_W, (long long)rows * 4);                  // SRAM→HBM: L_i = m + log ℓ (B)
        }
    }
}
