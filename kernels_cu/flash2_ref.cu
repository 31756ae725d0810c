// flash2_ref.cu: the readable reference rung. FlashAttention-2's schedule, SIMT, shared-
// memory tiles, exactly the simulator's loop order, tiles, skipping and statistics, so
// that an instrumented build counts the same HBM bytes as flashsim.simulate.
//
// Scores: S = softcap(scale·Q Kᵀ) − slope·|r + Nk − Nq − c| inside the band (left, right),
// −∞ outside it; softcap 0 and slopes null turn those off (flashsim.variants).
//
// Kernels in this file, each a rung over the last:
//   flash2_fwd<T>           forward. Grid (Tr, problems): one CTA per Q tile i reads Q_i
//                           once, streams the visited K_j, V_j, keeps m, ℓ and the
//                           unnormalised O_i on chip and writes O_i and L_i once.
//   flash2_bwd_preprocess<T> backward pre-pass. Grid (Tr, problems): D_i = rowsum(dO_i ∘
//                           O_i) in fp32, and the fp32 dQ accumulator zeroed.
//   flash2_bwd_main<T>      backward main loop. Grid (Tc, problems): one CTA per K/V tile
//                           j keeps K_j, V_j, dK_j, dV_j on chip, streams the visited Q_i,
//                           dO_i, L_i, D_i, recomputes P = exp(S − L) and adds its share
//                           of dQ_i to the accumulator with fp32 atomics (in order
//                           of j when sem is given: the deterministic mode).
//   flash2_bwd_postprocess<T> backward post-pass: dQ = dQacc in the I/O type (dQacc in rows,
//                           or tiled: flash2_bwd_ws's blocks, common.cuh's dq_tiled_at).
// T ∈ {__half, __nv_bfloat16, float, double}; arithmetic in AccOf<T> (float; double for
// double). Layout: strided (common.cuh's at table and row strides ld): row r of query
// problem p of Q, O, dO, dQ, dK, dV and of the K/V problem it reads (GQA groups,
// broadcast batch) wherever the caller's tensors hold it; L, D, dQacc (problems, Nq[, d]).
// flash2_fwd and flash2_bwd_main also run packed variable-length batches (vl not null:
// common.cuh's seq_of): the problems are heads over (heads, total rows, ·), each CTA one
// real tile of one sequence, the pre- and post-pass one problem of all the rows.
// Every HBM↔SRAM move is tagged like the simulator's, e.g. "HBM→SRAM: K_j (Bc·d)".
//
// Build: compiled at run time by flashsim.gpu through CuPy (RawModule, name_expressions
// flash2_fwd<__half> …), or ahead of time with `flashsim kernels build --arch sm_90`.
// -DFLASHSIM_COUNT_IO gives the instrumented build.

#include "common.cuh"

template <typename T>
__global__ void flash2_fwd(const T* __restrict__ Q, const T* __restrict__ K,
                           const T* __restrict__ V, const long long* __restrict__ at,
                           T* __restrict__ O, float* __restrict__ L,
                           int Nq, int Nk, int ldq, int ldk, int ldv, int ldo, int d, int dv, int Br, int Bc, int left, int right,
                           typename AccOf<T>::type scale, typename AccOf<T>::type softcap,
                           const float* __restrict__ slopes, const int* __restrict__ vl,
                           unsigned long long* io) {
    using A = typename AccOf<T>::type;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    A* sQ = reinterpret_cast<A*>(smem_raw);   // Br·d
    A* sK = sQ + Br * d;                      // Bc·d
    A* sV = sK + Bc * d;                      // Bc·dv
    A* sS = sV + Bc * dv;                     // Br·Bc: S_ij, then P_ij in place
    A* sO = sS + Br * Bc;                     // Br·dv, unnormalised until the end
    A* sm = sO + Br * dv;                     // Br: running max m_i
    A* sl = sm + Br;                          // Br: running sum ℓ_i
    A* sa = sl + Br;                          // Br: rescale e^{m_old − m_new}

    const int tid = threadIdx.x, nt = blockDim.x;
    // the sequence and tile: problem p's only one (dense), or one of a packed batch's
    const Seq sq = seq_of(vl, blockIdx.x, Nq, Nk, Br);
    const int i = sq.tile, p = blockIdx.y;
    const int nq = sq.Nq, nk = sq.Nk;                 // this sequence's lengths
    const int i0 = i * Br, rows = min(Br, nq - i0);
    const long long q_row = (long long)p * Nq + sq.q0 + i0;          // of L
    const T* Qi = Q + at_row0(at, p, AT_Q) + (sq.q0 + i0) * (long long)ldq;
    T* Oi = O + at_row0(at, p, AT_O) + (sq.q0 + i0) * (long long)ldo;
    float* Li = L + q_row;
    const T* Kp = K + at_row0(at, p, AT_K) + sq.k0 * (long long)ldk;
    const T* Vp = V + at_row0(at, p, AT_V) + sq.k0 * (long long)ldv;
    const Band band{left, right, nk - nq};
    // slopes per query problem, or per (sequence, problem) in a packed batch
    const A slope = slopes == nullptr ? A(0) : (A)slopes[(long long)sq.b * gridDim.y + p];
    const Scores<A> score{softcap, slope, nk - nq};
    int jlo, jhi;
    band.kv_range(i0, i0 + rows, nk, Bc, &jlo, &jhi);

    if (jhi < jlo) {  // no row of this tile sees a key: O_i = 0, L_i = −∞, nothing read
        for (int x = tid; x < rows * dv; x += nt) Oi[(long long)(x / dv) * ldo + x % dv] = from_acc<T>(A(0));
        for (int r = tid; r < rows; r += nt) Li[r] = neg_inf<float>();
        COUNT_IO(io, IO_O_W, (long long)rows * dv * sizeof(T));   // SRAM→HBM: O_i (Br·dv)
        COUNT_IO(io, IO_L_W, (long long)rows * 4);                // SRAM→HBM: L_i (Br)
        return;
    }
    for (int x = tid; x < rows * d; x += nt) sQ[x] = to_acc<A>(Qi[(long long)(x / d) * ldq + x % d]);
    COUNT_IO(io, IO_Q_R, (long long)rows * d * sizeof(T));        // HBM→SRAM: Q_i (Br·d)
    for (int x = tid; x < rows * dv; x += nt) sO[x] = A(0);
    for (int r = tid; r < rows; r += nt) { sm[r] = neg_inf<A>(); sl[r] = A(0); }

    for (int j = jlo; j <= jhi; ++j) {
        const int j0 = j * Bc, cols = min(Bc, nk - j0);
        __syncthreads();  // the last step is done with sK, sV, sS
        for (int x = tid; x < cols * d; x += nt) sK[x] = to_acc<A>(Kp[(long long)(j0 + x / d) * ldk + x % d]);
        for (int x = tid; x < cols * dv; x += nt) sV[x] = to_acc<A>(Vp[(long long)(j0 + x / dv) * ldv + x % dv]);
        COUNT_IO(io, IO_K_R, (long long)cols * d * sizeof(T));    // HBM→SRAM: K_j (Bc·d)
        COUNT_IO(io, IO_V_R, (long long)cols * dv * sizeof(T));   // HBM→SRAM: V_j (Bc·dv)
        __syncthreads();

        // S_ij = scale · Q_i K_jᵀ, the variants, the band (common.cuh)
        ref_scores_tile(sQ, sK, sS, rows, cols, d, Bc, i0, j0, band, score, scale);
        __syncthreads();

        for (int r = tid; r < rows; r += nt) {                    // online softmax, per row
            const A m_old = sm[r];
            A m_new = m_old;
            for (int c = 0; c < cols; ++c) m_new = sS[r * Bc + c] > m_new ? sS[r * Bc + c] : m_new;
            // a row with no visible key so far keeps m = −∞; subtracting 0 then gives
            // exp(−∞) = 0 where exp(−∞ − (−∞)) would be NaN
            const A m_safe = is_neg_inf(m_new) ? A(0) : m_new;
            A rowsum = A(0);
            for (int c = 0; c < cols; ++c) {
                const A pr = exp_acc(sS[r * Bc + c] - m_safe);
                rowsum += pr;
                sS[r * Bc + c] = round_io<T>(pr);                 // P meets V in the I/O type
            }
            const A alpha = exp_acc(m_old - m_safe);
            sa[r] = alpha;
            sl[r] = alpha * sl[r] + rowsum;
            sm[r] = m_new;
        }
        __syncthreads();

        for (int x = tid; x < rows * dv; x += nt) {               // O_i = diag(α) O_i + P V_j
            const int r = x / dv, k = x % dv;
            A acc = A(0);
            for (int c = 0; c < cols; ++c) acc += sS[r * Bc + c] * sV[c * dv + k];
            sO[x] = sa[r] * sO[x] + acc;
        }
    }
    __syncthreads();
    for (int x = tid; x < rows * dv; x += nt) {                   // diag(ℓ)^−1 O_i, once
        const A l = sl[x / dv];
        Oi[(long long)(x / dv) * ldo + x % dv] = from_acc<T>(l > A(0) ? sO[x] / l : A(0));
    }
    for (int r = tid; r < rows; r += nt)
        Li[r] = sl[r] > A(0) ? (float)(sm[r] + log_acc(sl[r])) : neg_inf<float>();
    COUNT_IO(io, IO_O_W, (long long)rows * dv * sizeof(T));       // SRAM→HBM: O_i (Br·dv)
    COUNT_IO(io, IO_L_W, (long long)rows * 4);                    // SRAM→HBM: L_i (Br)
}

template <typename T>
__global__ void flash2_bwd_preprocess(const T* __restrict__ O, const T* __restrict__ dO,
                                      const long long* __restrict__ at,
                                      float* __restrict__ D, float* __restrict__ dQacc,
                                      int Nq, int ldo, int lddo, int d, int dv, int Br,
                                      unsigned long long* io) {
    using A = typename AccOf<T>::type;
    const int tid = threadIdx.x, nt = blockDim.x;
    const int i0 = blockIdx.x * Br, rows = min(Br, Nq - i0);
    const long long row = (long long)blockIdx.y * Nq + i0;        // of D, dQacc
    const T* Oi = O + at_row0(at, blockIdx.y, AT_O) + (long long)i0 * ldo;
    const T* dOi = dO + at_row0(at, blockIdx.y, AT_dO) + (long long)i0 * lddo;
    for (int r = tid; r < rows; r += nt) {                        // D_i = rowsum(dO_i ∘ O_i)
        A acc = A(0);
        const T* o = Oi + (long long)r * ldo;
        const T* g = dOi + (long long)r * lddo;
#pragma unroll 1
        for (int k = 0; k < dv; ++k) acc += to_acc<A>(g[k]) * to_acc<A>(o[k]);
        D[row + r] = (float)acc;
    }
    for (long long x = tid; x < (long long)rows * d; x += nt) dQacc[row * d + x] = 0.0f;
    COUNT_IO(io, IO_O_R, (long long)rows * dv * sizeof(T));       // HBM→SRAM: O_i (Br·dv)
    COUNT_IO(io, IO_dO_R, (long long)rows * dv * sizeof(T));      // HBM→SRAM: dO_i (Br·dv)
    COUNT_IO(io, IO_D_W, (long long)rows * 4);                    // SRAM→HBM: D_i (Br)
    COUNT_IO(io, IO_dQacc_W, (long long)rows * d * 4);            // SRAM→HBM: dQacc_i = 0 (Br·d fp32)
}

template <typename T>
__global__ void flash2_bwd_main(const T* __restrict__ Q, const T* __restrict__ K,
                                const T* __restrict__ V, const long long* __restrict__ at,
                                const T* __restrict__ dO, const float* __restrict__ L,
                                const float* __restrict__ D, float* __restrict__ dQacc,
                                T* __restrict__ dK, T* __restrict__ dV,
                                int Nq, int Nk, int ldq, int ldk, int ldv, int lddo, int lddk,
                                int lddv, int d, int dv, int Br, int Bc, int left,
                                int right, typename AccOf<T>::type scale,
                                typename AccOf<T>::type softcap,
                                const float* __restrict__ slopes, int* __restrict__ sem,
                                const int* __restrict__ vl, unsigned long long* io) {
    using A = typename AccOf<T>::type;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    A* sK = reinterpret_cast<A*>(smem_raw);   // Bc·d
    A* sV = sK + Bc * d;                      // Bc·dv
    A* sdK = sV + Bc * dv;                    // Bc·d
    A* sdV = sdK + Bc * d;                    // Bc·dv
    A* sQ = sdV + Bc * dv;                    // Br·d
    A* sdO = sQ + Br * d;                     // Br·dv
    A* sP = sdO + Br * dv;                    // Br·Bc
    A* sdS = sP + Br * Bc;                    // Br·Bc: dP, then dS in place
    A* sL = sdS + Br * Bc;                    // Br
    A* sD = sL + Br;                          // Br

    const int tid = threadIdx.x, nt = blockDim.x;
    // the sequence and K/V tile (seq_of: dense, or a packed batch's real tiles)
    const Seq sq = seq_of(vl, blockIdx.x, Nq, Nk, Br);
    const int j = sq.tile, p = blockIdx.y;
    const int nq = sq.Nq, nk = sq.Nk;
    const int j0 = j * Bc, cols = min(Bc, nk - j0);
    const T* Kj = K + at_row0(at, p, AT_K) + (sq.k0 + j0) * (long long)ldk;
    const T* Vj = V + at_row0(at, p, AT_V) + (sq.k0 + j0) * (long long)ldv;
    // per query problem (GQA: the caller sums each group's afterwards)
    T* dKj = dK + at_row0(at, p, AT_dK) + (sq.k0 + j0) * (long long)lddk;
    T* dVj = dV + at_row0(at, p, AT_dV) + (sq.k0 + j0) * (long long)lddv;
    const Band band{left, right, nk - nq};
    const A slope = slopes == nullptr ? A(0) : (A)slopes[(long long)sq.b * gridDim.y + p];
    const Scores<A> score{softcap, slope, nk - nq};
    int ilo, ihi;
    band.q_range(j0, j0 + cols, nq, Br, &ilo, &ihi);

    for (int x = tid; x < cols * d; x += nt) sdK[x] = A(0);
    for (int x = tid; x < cols * dv; x += nt) sdV[x] = A(0);
    if (ihi >= ilo) {
        for (int x = tid; x < cols * d; x += nt) sK[x] = to_acc<A>(Kj[(long long)(x / d) * ldk + x % d]);
        for (int x = tid; x < cols * dv; x += nt) sV[x] = to_acc<A>(Vj[(long long)(x / dv) * ldv + x % dv]);
        COUNT_IO(io, IO_K_R, (long long)cols * d * sizeof(T));    // HBM→SRAM: K_j (Bc·d)
        COUNT_IO(io, IO_V_R, (long long)cols * dv * sizeof(T));   // HBM→SRAM: V_j (Bc·dv)
    }
    for (int i = ilo; i <= ihi; ++i) {
        const int i0 = i * Br, rows = min(Br, nq - i0);
        const long long q_row = (long long)p * Nq + sq.q0 + i0;  // of L, D, dQacc
        const T* Qi = Q + at_row0(at, p, AT_Q) + (sq.q0 + i0) * (long long)ldq;
        const T* dOi = dO + at_row0(at, p, AT_dO) + (sq.q0 + i0) * (long long)lddo;
        __syncthreads();  // the last step is done with sQ, sdO, sP, sdS
        for (int x = tid; x < rows * d; x += nt) sQ[x] = to_acc<A>(Qi[(long long)(x / d) * ldq + x % d]);
        for (int x = tid; x < rows * dv; x += nt) sdO[x] = to_acc<A>(dOi[(long long)(x / dv) * lddo + x % dv]);
        for (int r = tid; r < rows; r += nt) { sL[r] = (A)L[q_row + r]; sD[r] = (A)D[q_row + r]; }
        COUNT_IO(io, IO_Q_R, (long long)rows * d * sizeof(T));    // HBM→SRAM: Q_i (Br·d)
        COUNT_IO(io, IO_dO_R, (long long)rows * dv * sizeof(T));  // HBM→SRAM: dO_i (Br·dv)
        COUNT_IO(io, IO_L_R, (long long)rows * 4);                // HBM→SRAM: L_i (Br)
        COUNT_IO(io, IO_D_R, (long long)rows * 4);                // HBM→SRAM: D_i (Br)
        __syncthreads();

        // P = exp(S − L), dS, and dV_j, dK_j updated (common.cuh)
        ref_bwd_step<T>(sQ, sK, sV, sdO, sL, (const A*)nullptr, sD, sP, sdS, sdK, sdV, rows,
                        cols, d, dv, Bc, i0, j0, band, score, scale, softcap);
        int* turn = sem + ((long long)p * sq.tiles + sq.t0 + i);
        int mine = 0;                                             // visiting tiles before j
        if (sem != nullptr) {                                     // deterministic: in order of j
            int jlo, jhi;
            band.kv_range(i0, i0 + rows, nk, Bc, &jlo, &jhi);
            mine = j - jlo;
            wait_turn(turn, mine);
        }
        for (int x = tid; x < rows * d; x += nt) {                // dQacc_i += scale · dS K_j
            const int r = x / d, k = x % d;
            A acc = A(0);
            for (int c = 0; c < cols; ++c) acc += sdS[r * Bc + c] * sK[c * d + k];
            atomicAdd(&dQacc[q_row * d + x], (float)(scale * acc));
        }
        if (sem != nullptr) pass_turn(turn, mine);
        COUNT_IO(io, IO_dQacc_R, (long long)rows * d * 4);        // HBM→SRAM: dQacc_i (Br·d fp32)
        COUNT_IO(io, IO_dQacc_W, (long long)rows * d * 4);        // SRAM→HBM: dQacc_i (Br·d fp32)
    }
    __syncthreads();
    for (int x = tid; x < cols * d; x += nt) dKj[(long long)(x / d) * lddk + x % d] = from_acc<T>(sdK[x]);
    for (int x = tid; x < cols * dv; x += nt) dVj[(long long)(x / dv) * lddv + x % dv] = from_acc<T>(sdV[x]);
    COUNT_IO(io, IO_dK_W, (long long)cols * d * sizeof(T));       // SRAM→HBM: dK_j (Bc·d)
    COUNT_IO(io, IO_dV_W, (long long)cols * dv * sizeof(T));      // SRAM→HBM: dV_j (Bc·dv)
}

template <typename T>
__global__ void flash2_bwd_postprocess(const float* __restrict__ dQacc, T* __restrict__ dQ,
                                       const long long* __restrict__ at, int Nq, int lddq,
                                       int d, int Br, int tiled, unsigned long long* io) {
    using A = typename AccOf<T>::type;
    const int i0 = blockIdx.x * Br, rows = min(Br, Nq - i0);
    const long long row = (long long)blockIdx.y * Nq + i0;        // of dQacc
    T* dQi = dQ + at_row0(at, blockIdx.y, AT_dQ) + (long long)i0 * lddq;
    if (sizeof(T) == 2 && tiled && i0 % dq_rows(tiled) == 0 && Br <= dq_rows(tiled)) {
        // flash2_bwd_ws's blocks at instance D = tiled (64 or 128; common.cuh's
        // dq_tiled_at), this CTA's rows within one: read in the blocks' own order, a float4
        // a thread (a warp's 512 bytes contiguous), each holding rows r, r + 8 at columns
        // c, c + 1, put in rows in shared memory, then written out along the rows, 16 bytes
        // a thread where the layout allows (gathered from global memory, or written as the
        // blocks lie, the pass ran at a third of the copy bandwidth)
        const int R = dq_rows(tiled), pitch = tiled + 8;    // in T; 16 bytes of padding a row
        __shared__ __align__(16) unsigned short sdq[128 * (64 + 8)];   // ≥ 64 · (128 + 8)
        const float4* blk = reinterpret_cast<const float4*>(
            dQacc + ((long long)blockIdx.y * ((Nq + R - 1) / R) + i0 / R) * DQ_BLOCK);
        for (int f = threadIdx.x; f < DQ_BLOCK / 4; f += blockDim.x) {
            // f = k·256 + h·128 + warp·32 + g·4 + tig (common.cuh)
            const int k = f >> 8, h = (f >> 7) & 1, rr = ((f >> 5) & 3) * 16 + ((f >> 2) & 7);
            const int c = (tiled == 128 ? h * 64 : 0) + k * 8 + (f & 3) * 2;
            const int r = (tiled == 128 ? 0 : h * 64) + rr;
            if (r >= rows) continue;
            const float4 v = blk[f];
            T* s0 = reinterpret_cast<T*>(sdq) + r * pitch + c;
            s0[0] = from_acc<T>((A)v.x), s0[1] = from_acc<T>((A)v.y);
            s0[8 * pitch] = from_acc<T>((A)v.z), s0[8 * pitch + 1] = from_acc<T>((A)v.w);
        }
        __syncthreads();
        const T* sd = reinterpret_cast<const T*>(sdq);
        if (d % 8 == 0 && lddq % 8 == 0 && reinterpret_cast<unsigned long long>(dQi) % 16 == 0) {
            const int per = d / 8;                      // 16-byte pieces a row
            for (int x = threadIdx.x; x < rows * per; x += blockDim.x) {
                const int r = x / per, c = (x - r * per) * 8;
                *reinterpret_cast<uint4*>(dQi + (long long)r * lddq + c) =
                    *reinterpret_cast<const uint4*>(sd + r * pitch + c);
            }
        } else {
            for (int x = threadIdx.x; x < rows * d; x += blockDim.x) {
                const int r = x / d, c = x - r * d;
                dQi[(long long)r * lddq + c] = sd[r * pitch + c];
            }
        }
    } else if (tiled) {      // (rows across blocks: element by element)
        const int R = dq_rows(tiled);
        const long long blk0 = (long long)blockIdx.y * ((Nq + R - 1) / R);
        for (long long x = threadIdx.x; x < (long long)rows * d; x += blockDim.x) {
            const int r = i0 + (int)(x / d), c = (int)(x % d);
            dQi[(x / d) * lddq + c] = from_acc<T>((A)dQacc[(blk0 + r / R) * DQ_BLOCK + dq_tiled_at(r % R, c, tiled)]);
        }
    } else {
        for (long long x = threadIdx.x; x < (long long)rows * d; x += blockDim.x)
            dQi[(x / d) * lddq + x % d] = from_acc<T>((A)dQacc[row * d + x]);
    }
    COUNT_IO(io, IO_dQacc_R, (long long)rows * d * 4);            // HBM→SRAM: dQacc_i (Br·d fp32)
    COUNT_IO(io, IO_dQ_W, (long long)rows * d * sizeof(T));       // SRAM→HBM: dQ_i (Br·d)
}
