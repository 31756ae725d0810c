// flash2_ws.cu: the Hopper kernels fed by the copy engine, with specialised warps.
//
//   flash2_fwd_ws<T, D, VAR, MAX>  forward, T ∈ {__half, __nv_bfloat16}, D ∈ {64, 96, 128} (d, dv
//                        ≤ D: the tensor maps are d (dv) columns wide, so the copy engine
//                        zero-fills the columns past them): the schedule, visited tiles
//                        and so the traffic of
//                        flash2_fwd_wg with tiles of 128 × 128 at D = 96 and 128 (its
//                        own) and 192 × 128 at D = 64 (the cp.async kernel takes 128 × 64
//                        there, two CTAs per SM: NOTES v16, v21, v22; its softcap/ALiBi
//                        instance 192 × 64, the cp.async kernel's keys: v54), its shared layout
//                        (wgmma.cuh's Cols<D>: 64-byte-swizzled blocks of 32 columns at
//                        D = 96), its consumer warpgroups of 64 query rows each (two, three
//                        at D = 64) and their loop (S_j and P_{j−1} V_{j−1} issued together,
//                        the softmax of tile j beside the second product). Over
//                        flash2_fwd_wg it changes who moves the data:
//                        - a producer warpgroup, of which one thread issues the loads: TMA
//                          (cp.async.bulk.tensor) copies of Q_i and of K_j, V_j into a ring
//                          of STAGES slots. The copy engine writes the tiles in the 128- (or 64-)byte
//                          swizzle the tensor cores read (the tensor map's swizzle mode,
//                          flash2_wg.cu's layout), zero-fills rows past N, and completes a
//                          slot's "full" mbarrier by its byte count; the consumers free a slot
//                          by arriving on its "empty" mbarrier once their products have read
//                          it. No CTA barrier in the loop, and no consumer instruction spent
//                          on addresses or copies;
//                        - setmaxnreg: the producer drops to PRODUCER_REGS registers per
//                          thread, the consumers take them (CONSUMER_REGS);
//                        - ping-pong (FLASHSIM_WS_PINGPONG, on by default): named
//                          barriers make the warpgroups take turns issuing their products,
//                          so that one's softmax runs while another's products hold the
//                          tensor cores;
//                        - one CTA per SM walking the tiles (kernels.ws_forward_ctas), Q_i
//                          in two slots: the producer loads the next tile's Q_i and first
//                          K_j, V_j while the consumers finish this one, and the turns run
//                          on across tiles; in the grid's order without a band (NOTES
//                          v44), from a tile counter under one, heaviest first (v45). The
//                          producer publishes each tile's problem, first row and O's
//                          coordinates with its Q_i, and a warpgroup frees the slot its O_i
//                          left from only during the next tile's first S, so that a tile's
//                          boundary holds no divisions, global loads or copy waits (v86);
//                        - each consumer warpgroup runs only the steps its own 64 rows see
//                          (none for rows past N), the producer freeing the K/V slots of
//                          the rest for it, and masks only where its rows meet the band
//                          (FLASHSIM_WS_WG_BOUND, FLASHSIM_WS_WG_MASK; the same bits: v48);
//                          in the plain instances a step whose key tile's upper half none
//                          of its rows see runs P V over the lower half (FLASHSIM_WS_HALF_PV;
//                          the same bits: v88).
//                        VAR = true is the softcap/ALiBi instance; windows run on both.
//                        MAX (with VAR) is the softmax's max: 0 the online one. 1, fixed
//                        (bfloat16's softcap instance, kernels.cap_only; with ALiBi or
//                        without): no row max, α or rescale of O (tensor_core.cuh's
//                        cap_fixed_m; with ALiBi per row, fixed_m_alibi; NOTES v56,
//                        v66). 2, lazy (float16's softcap instance, and bfloat16's lazy
//                        one for ALiBi or a softcap past the fixed max's headroom,
//                        kernels.ws_lazy; v90): a step's exponentials take the steps
//                        before's m, and a warp reduces its rows' max and takes the
//                        online step only where some P may pass 2^12 (tensor_core.cuh's
//                        softmax_lazy; v57, v59); with ALiBi (a softcap or none, at D = 96 and 128,
//                        whose tiles are square) each Q tile visits its diagonal key
//                        tile first, where its rows' biases are largest (v69); in
//                        bfloat16 ALiBi alone on a key tile on one side of the warp's
//                        diagonal keys is a term per key and an offset of the max per
//                        row (wgmma.cuh's wg_side: one FFMA a score, v91).
//                        The tensor maps (flashsim/gpu/_tma.py) describe each of Q, K, V as
//                        (columns ld, rows N, problems): rows past N of a problem are
//                        outside the tensor, so a ragged last tile arrives zero-filled. A
//                        packed varlen batch has no such bound per sequence and runs on
//                        flash2_fwd_wg.
//   flash2_bwd_ws<T, D, VAR>, flash2_bwd_ws_det<T, D, VAR>  the backward main loop,
//                        D ∈ {64, 128}, built for kernels.py's WS_BWD_HEAD_DIMS (d, dv ≤
//                        D: the columns past them arrive zero-filled, as
//                        in the forward): flash2_bwd_wg's tiles and steps with a
//                        producer warpgroup that loads by TMA and adds dQ through
//                        the copy engine's reduce-adds (below; NOTES v23, v37, v39).
// Needs sm_90a (flashsim.gpu compiles it with NVRTC for that target on a 9.0 device).
// Counts its traffic like the reference under -DFLASHSIM_COUNT_IO (the accounting rules'
// rows, whatever the copy engine zero-fills).

#include "wg_bwd.cuh"

namespace ws {

using namespace wg;

#ifndef FLASHSIM_WS_PINGPONG
#define FLASHSIM_WS_PINGPONG 1
#endif
#ifndef FLASHSIM_WS_SETMAXNREG
#define FLASHSIM_WS_SETMAXNREG 1
#endif
#ifndef FLASHSIM_WS_STAGES
#define FLASHSIM_WS_STAGES 2
#endif
#ifndef FLASHSIM_WS_RESCALE_LATE
#define FLASHSIM_WS_RESCALE_LATE 0
#endif
// 1: each consumer warpgroup stops at the last K/V tile its own 64 rows see (none for rows
// past N), and the producer arrives on the slots' "empty" barriers for the warps that skip
// a step; 0: every warpgroup runs each of the tile's steps (NOTES v48)
#ifndef FLASHSIM_WS_WG_BOUND
#define FLASHSIM_WS_WG_BOUND 1
#endif
// 1: the softmax masks a step's scores only where the warpgroup's own rows meet the band's
// edge (or N); 0: wherever the tile's rows do
#ifndef FLASHSIM_WS_WG_MASK
#define FLASHSIM_WS_WG_MASK 1
#endif
// 1: O_i leaves through the copy engine (wgmma.cuh's wg_store_o_tma: a TMA store of each
// warpgroup's rows from Q_i's slot, issued by one thread); 0: the consumers' 16-byte
// stores (wg_store_o16)
#ifndef FLASHSIM_WS_O_TMA
#define FLASHSIM_WS_O_TMA 1
#endif
// 1 (with O_TMA): the first thread of a warpgroup frees O_i's slot (waits for the copy
// engine to have read it) only once the next tile's first S is issued, not before that
// tile's first turn; 0: at the end of the epilogue
#ifndef FLASHSIM_WS_O_FREE_LATE
#define FLASHSIM_WS_O_FREE_LATE 1
#endif
// 1: the producer publishes each tile's index, problem, first row (tile()'s divisions) and
// O's tensor-map coordinates with its Q_i (tinfo), so that the consumers spend no divisions
// or global loads at a tile's boundary; 0: the consumers compute them
#ifndef FLASHSIM_WS_TILE_SMEM
#define FLASHSIM_WS_TILE_SMEM 1
#endif
// 1 (plain instances, Bc = 128): P_j V_j over the key tile's lower half alone where its
// upper half lies past the last key a warpgroup's rows see (under a causal mask at square
// tiles, warpgroup 0's diagonal tile; a ragged last tile): P is 0 there, so the same bits
// for half the product (NOTES v88). S_j over half the keys, a wgmma of N = Bc/2 beside
// N = Bc on the same accumulators, made ptxas serialise the warpgroup MMAs (C7511)
#ifndef FLASHSIM_WS_HALF_PV
#define FLASHSIM_WS_HALF_PV 1
#endif
// consumer warpgroups (64 query rows each) per CTA: three at D = 64, where a warpgroup's
// two products are short beside its softmax and a third one's work fills the tensor cores
// while two wait on their softmax chains; two at 96 and 128, whose registers (O's D/2
// per thread) leave no room for a third
#ifndef FLASHSIM_WS_CONSUMERS64
#define FLASHSIM_WS_CONSUMERS64 3
#endif
template <int D> __host__ __device__ constexpr int consumers() { return D == 64 ? FLASHSIM_WS_CONSUMERS64 : 2; }
template <int D> __host__ __device__ constexpr int threads() { return 128 * (1 + consumers<D>()); }
template <int D> __host__ __device__ constexpr int br() { return 64 * consumers<D>(); }
constexpr int STAGES = FLASHSIM_WS_STAGES;
#ifndef FLASHSIM_WS_BC64
#define FLASHSIM_WS_BC64 128
#endif
#ifndef FLASHSIM_WS_MINB64
#define FLASHSIM_WS_MINB64 1
#endif
// flashsim/kernels.py's WS_BLOCKS (the macros: for tuning)
// (the softcap/ALiBi instance at D = 64: 64 keys, flash2_fwd_wg's, so that a packed varlen
// batch, which runs there, and each of its sequences agree bit for bit; with 128 its
// consumers spilled)
template <int D, bool VAR> __host__ __device__ constexpr int bc() { return D == 64 ? (VAR ? 64 : FLASHSIM_WS_BC64) : 128; }
// one CTA per SM: two at D = 64 would leave the consumers 104 registers, and they spill
template <int D> __host__ __device__ constexpr int min_blocks() { return D == 64 ? FLASHSIM_WS_MINB64 : 1; }
// the registers the launch bounds give each thread (65536 per SM over threads·min_blocks,
// in multiples of 8), and their split: the producer keeps 24, the consumers take the rest
// (the instrumented build's producer, which also counts the tiles' bytes, keeps 32: at 24
// it spilled 8 bytes once O left through the copy engine)
template <int D> __host__ __device__ constexpr int launch_regs() { return (65536 / (threads<D>() * min_blocks<D>())) & ~7; }
#ifdef FLASHSIM_COUNT_IO
constexpr int PRODUCER_REGS = 32;
#else
constexpr int PRODUCER_REGS = 24;
#endif
template <int D> __host__ __device__ constexpr int consumer_regs() {
    return ((launch_regs<D>() * (1 + consumers<D>()) - PRODUCER_REGS) / consumers<D>()) & ~7;
}

}  // namespace ws

template <typename T, int D, bool VAR, int MAX>
__global__ void __launch_bounds__(ws::threads<D>(), ws::min_blocks<D>())
flash2_fwd_ws(const __grid_constant__ wg::TensorMap tmQ, const __grid_constant__ wg::TensorMap tmK,
              const __grid_constant__ wg::TensorMap tmV, const __grid_constant__ wg::TensorMap tmO,
              const int* __restrict__ crd,
              const long long* __restrict__ at, T* __restrict__ O, float* __restrict__ L,
              int Nq, int Nk, int ldo, int d, int dv, int left, int right, float scale_log2,
              float k_in, float k_out, const float* __restrict__ slopes, unsigned long long* io,
              int problems, int chunk, unsigned* __restrict__ tile_counter) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using namespace ws;
    static_assert(D == 64 || D == 96 || D == 128, "head dims 64, 96 and 128");
    using CL = Cols<D>;
    constexpr int Bc = bc<D, VAR>(), CONSUMERS = consumers<D>(), THREADS = threads<D>(), Br = br<D>();
    constexpr unsigned TILE_Q = Br * D * 2, TILE_KV = Bc * D * 2;   // bytes of one tile
    extern __shared__ unsigned char smem_raw[];
    // the swizzle is a function of the address bits, so tiles start on 1024 bytes
    const unsigned base = (smem_addr(smem_raw) + 1023) & ~1023u;
    // Q_i in two slots of Br·D where a CTA walks several tiles (the next tile's loads while
    // O_i of this one goes out through its slot), else one; then STAGES slots of Bc·D
    // each for K and V (kernels.ws_forward_smem). mbarriers: per Q slot full, empty; per
    // K/V slot K full, K empty, V full, V empty
    const int nx = (Nq + Br - 1) / Br, ntiles = nx * problems;
    const unsigned sQ0 = base;
    const unsigned sK = sQ0 + ((int)gridDim.x < ntiles ? 2 : 1) * TILE_Q;
    const unsigned sV = sK + STAGES * TILE_KV;
    __shared__ __align__(8) unsigned long long bars[4 + 4 * STAGES];
    __shared__ int tile_in[2];                       // the tile whose Q_i slot q holds
    // TILE_SMEM: per Q slot, its tile's index (−1: no more), problem and first row (tile()'s
    // divisions) and O's tensor-map column and problem coordinates, written by the producer
    // before its arrival on the slot's "full" barrier (which publishes them)
    enum { TI_T, TI_P, TI_I0, TI_CO, TI_ZO };
    __shared__ __align__(16) int tinfo[2][8];
    __shared__ int wl_in[3];                         // the producer's: wg_last of its tile
    static_assert(CONSUMERS <= 3, "wl_in holds three consumer warpgroups' bounds");
    const unsigned b0 = smem_addr(bars);
    auto fullQ = [&](int q) { return b0 + 8 * q; };
    auto emptyQ = [&](int q) { return b0 + 8 * (2 + q); };
    auto fullK = [&](int s) { return b0 + 8 * (4 + s); };
    auto emptyK = [&](int s) { return b0 + 8 * (4 + STAGES + s); };
    auto fullV = [&](int s) { return b0 + 8 * (4 + 2 * STAGES + s); };
    auto emptyV = [&](int s) { return b0 + 8 * (4 + 3 * STAGES + s); };

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, grp = warp >> 2;
    const int g = lane >> 2, tig = lane & 3;
    const int nq = Nq, nk = Nk;
    const Band band{left, right, nk - nq};
    // The tiles: problems in chunks of `chunk` (the first one shorter where they do not
    // divide, so that the launch ends on a whole chunk), a chunk's tiles in turn Q tile
    // nx − 1 of each of its problems, then Q tile nx − 2 of each, …: tile r of a chunk of g
    // problems from pb, r = x·g + p', is Q tile nx − 1 − x of problem pb + p'. The last Q
    // tiles first: under a causal mask they see the most keys. With chunk = 1 (no band)
    // that is t = x + nx·p, the order in which the hardware starts the CTAs of a grid of
    // nx × problems; under a band kernels.ws_chunk takes as many problems as keep
    // their K and V in a share of L2, so that the launch ends on its lightest tiles, not on
    // one problem's heavy ones (NOTES v46). CTA b runs tile b first, then
    // (G = gridDim.x, one CTA per SM: kernels.ws_forward_ctas) tiles b + G, b + 2G, …
    // without a counter (tiles of equal cost), or, under a band, G + the tickets it draws
    // from tile_counter (zeroed before the launch), so that whichever CTA frees first
    // takes the next tile, heaviest first. Its producer draws and loads tile t + 1's Q_i
    // and first K_j, V_j while the consumers finish tile t, and tells them the tile
    // through Q_i's slot (tile_in; a tile ≥ ntiles: no more)
    struct Tile { int p, i0, rows, jlo, jhi; };
    auto tile = [&](int t) {
        Tile x;
        const int first = problems - (problems - 1) / chunk * chunk;   // 1 … chunk problems
        int r = t, gc = first, pb = 0;               // tile r of the chunk of gc problems from pb
        if (t >= first * nx) {
            const int c = (t - first * nx) / (chunk * nx);
            r = t - first * nx - c * chunk * nx, gc = chunk, pb = first + c * chunk;
        }
        const int xi = r / gc;
        x.p = pb + (r - xi * gc);
        x.i0 = (nx - 1 - xi) * Br;
        x.rows = min(Br, nq - x.i0);
        band.kv_range(x.i0, x.i0 + x.rows, nk, Bc, &x.jlo, &x.jhi);
        return x;
    };

    // The key tile of a Q tile's step n: jlo + n, or, with ALiBi under the lazy max (at
    // square tiles: kernels.diagonal_first), first the tile holding the
    // diagonal key of the Q tile's middle row, then the others in order. ALiBi's logits
    // rise along a row towards its diagonal key: in key order the lazy max moved at most
    // steps (NOTES v65); from the tile of the largest biases it moves at almost none
    // (v69). The producer and the consumers both take it; the ring's slots and phases stay
    // per step. (MAX, with VAR, the softmax's max: 0 the online one, 1 fixed, 2 lazy: below)
    constexpr bool FIXED = VAR && MAX == 1, LAZY = VAR && MAX == 2;
    static_assert(!FIXED || IsBf16<T>::value, "the fixed max is bfloat16's");
    constexpr bool DIAG_FIRST = LAZY && Br == Bc;
    const bool diag = DIAG_FIRST && slopes != nullptr;
    auto key_tile = [&](const Tile& x, int n) {
        if (!diag) return x.jlo + n;
        const int jd = min(max((x.i0 + x.rows / 2 + nk - nq) / Bc, x.jlo), x.jhi);
        return n == 0 ? jd : x.jlo + n - (x.jlo + n - 1 < jd ? 1 : 0);
    };

    // the last step consumer warpgroup c's own rows see: jlo − 1 where they see none or
    // lie past N. Rows see one interval of keys, so a warpgroup's steps are the tile's first
    // ones; the last warpgroup with rows below N sees the tile's last key tile, so some
    // warpgroup runs every step. The producer and the consumers both compute it. (Diagonal
    // first, a warpgroup's key tiles need not be the first steps: every warpgroup runs
    // every step, masking what its rows do not see.)
    auto wg_last = [&](const Tile& x, int c) {
        if (!FLASHSIM_WS_WG_BOUND || diag) return x.jhi;
        const int r = min(64, x.rows - 64 * c);
        int lo = 0, hi = -1;
        if (r > 0) band.kv_range(x.i0 + 64 * c, x.i0 + 64 * c + r, nk, Bc, &lo, &hi);
        return hi < x.jlo ? x.jlo - 1 : min(hi, x.jhi);
    };

    if (threadIdx.x == 0) {
        for (int q = 0; q < 2; ++q) {
            mbar_init(fullQ(q), 1);                  // the producer's arrival, and the bytes
            mbar_init(emptyQ(q), 4 * CONSUMERS);     // one arrival per consumer warp
        }
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(fullK(s), 1);
            mbar_init(fullV(s), 1);
            mbar_init(emptyK(s), 4 * CONSUMERS);
            mbar_init(emptyV(s), 4 * CONSUMERS);
        }
        mbar_init_fence();
    }
    __syncthreads();

    if (grp == 0) {
        // -- the producer: one thread walks the tiles the consumers will visit --------
        if (FLASHSIM_WS_SETMAXNREG) setmaxnreg_dec<PRODUCER_REGS>();
        if (threadIdx.x == 0) {
            int n = 0;                               // K/V fills so far
            for (int kq = 0;; ++kq) {                // kq: Q fills so far
                const int q = kq & 1;
                mbar_wait(emptyQ(q), ((kq >> 1) & 1) ^ 1);   // O_i of its last tile is out
                // drawn once the last tile's loads are issued: as late as the next Q_i
                // may still arrive before the consumers need it
                const int ti = kq == 0 ? (int)blockIdx.x
                             : tile_counter ? (int)gridDim.x + (int)atomicAdd(tile_counter, 1u)
                                            : (int)blockIdx.x + kq * (int)gridDim.x;
                tile_in[q] = ti;                     // published by the arrival below
                if (FLASHSIM_WS_TILE_SMEM) tinfo[q][TI_T] = ti < ntiles ? ti : -1;   // −1: no more
                if (ti >= ntiles) {                  // no more: the consumers stop here
                    mbar_arrive(fullQ(q));
                    break;
                }
                const Tile x = tile(ti);
                if (FLASHSIM_WS_TILE_SMEM) tinfo[q][TI_P] = x.p, tinfo[q][TI_I0] = x.i0;
                if (x.jhi < x.jlo) {                 // the consumers write it: no loads
                    fwd_tile_unseen_count<T>(io, x.rows, dv);
                    mbar_arrive(fullQ(q));
                    continue;
                }
                fwd_tile_count<T>(io, x.rows, x.jlo, x.jhi, Bc, nk, d, dv);
                // the warps past their own last tile at step j: the producer frees the
                // step's slots for them, once it has filled them (so the arrivals count
                // toward that fill's phase). The bounds wait in shared memory: in
                // registers they would spill the producer's 24
                if (FLASHSIM_WS_WG_BOUND)
#pragma unroll
                    for (int c = 0; c < CONSUMERS; ++c) wl_in[c] = wg_last(x, c);
                auto skipping = [&](int j) {
                    unsigned n = 0;
                    if (FLASHSIM_WS_WG_BOUND)
#pragma unroll
                        for (int c = 0; c < CONSUMERS; ++c) n += j > *(volatile int*)&wl_in[c];
                    return 4u * n;
                };
                // crd: per problem, the column and problem coordinates of row 0 of Q, K, V
                // (and O: the consumers')
                const int* c6 = crd + 8 * x.p;
                const int cq = c6[0], zq = c6[1], ck = c6[2], zk = c6[3], cv = c6[4], zv = c6[5];
                if (FLASHSIM_WS_TILE_SMEM) tinfo[q][TI_CO] = c6[6], tinfo[q][TI_ZO] = c6[7];   // (O's)
                mbar_expect_tx(fullQ(q), TILE_Q);    // HBM→SRAM: Q_i (Br·d)
#pragma unroll
                for (int cb = 0; cb < D / CL::W; ++cb)
                    tma_load_3d(sQ0 + q * TILE_Q + cb * Br * CL::RB, &tmQ, cq + cb * CL::W, x.i0, zq, fullQ(q));
                for (int j = x.jlo; j <= x.jhi; ++j, ++n) {   // step j − jlo
                    const int s = n % STAGES;
                    const unsigned ph = (n / STAGES) & 1;
                    const int j0 = key_tile(x, j - x.jlo) * Bc;
                    mbar_wait(emptyK(s), ph ^ 1);    // the slot's last K has been read
                    mbar_expect_tx(fullK(s), TILE_KV);   // HBM→SRAM: K_j (Bc·d)
#pragma unroll
                    for (int cb = 0; cb < D / CL::W; ++cb)
                        tma_load_3d(sK + s * TILE_KV + cb * Bc * CL::RB, &tmK, ck + cb * CL::W, j0, zk, fullK(s));
                    const unsigned skip = skipping(j);
                    if (skip) mbar_arrive_n(emptyK(s), skip);
                    mbar_wait(emptyV(s), ph ^ 1);
                    mbar_expect_tx(fullV(s), TILE_KV);   // HBM→SRAM: V_j (Bc·d)
#pragma unroll
                    for (int cb = 0; cb < D / CL::W; ++cb)
                        tma_load_3d(sV + s * TILE_KV + cb * Bc * CL::RB, &tmV, cv + cb * CL::W, j0, zv, fullV(s));
                    if (skip) mbar_arrive_n(emptyV(s), skip);
                }
            }
        }
        return;
    }

    // -- the consumers: warpgroup cw owns query rows 64·cw … 64·cw + 63 of each tile ---
    if (FLASHSIM_WS_SETMAXNREG) setmaxnreg_inc<consumer_regs<D>()>();
    // (through a shuffle, which ptxas knows gives every lane the same value: then the
    // bounds, slots and descriptors that follow from it stay in uniform registers)
    const int cw = __shfl_sync(0xffffffffu, grp, 0) - 1;
    // VAR: the scores in log2 units over VarScores::scale(), the exponent's multiplier
    const float sl2 = VAR ? VarScores{k_in, k_out, 0.f}.scale() : scale_log2;
    // FIXED (bfloat16's softcap instance, kernels.cap_only): a fixed max, with ALiBi or
    // not (tensor_core.cuh's cap_fixed_m, fixed_m_alibi); LAZY (float16's softcap instance,
    // and bfloat16's lazy one, kernels.ws_lazy): a lazy running max (tensor_core.cuh's
    // softmax_lazy; with ALiBi, the diagonal key tile first: key_tile)
    float o[D / 2];                                  // O_i: this warpgroup's 64 × D, fp32
    float s[Bc / 2];                                 // S = Q_i K_jᵀ (then P in fp32): 64 × Bc
    unsigned pf[Bc / 16][4];                         // P in T: the A operand of P V_j
    const int r0 = cw * 64 + (warp & 3) * 16 + g;    // this thread's rows r0, r0 + 8 in a tile

    // ping-pong: the warpgroups take turns issuing their products, in order 0, 1, …: cw
    // waits at barrier 1 + cw before issuing and, once they are issued, lets the next one
    // go (barrier 1 + next); each barrier counts the waiting warpgroup's 128 threads and
    // the previous one's 128 arrivals. The turns run on from one tile to the next.
    const int next = cw + 1 == CONSUMERS ? 0 : cw + 1;
    auto turn_wait = [&]() { if (FLASHSIM_WS_PINGPONG) named_sync(1 + cw, 256); };
    auto turn_pass = [&]() { if (FLASHSIM_WS_PINGPONG) named_arrive(1 + next, 256); };
    // a warp's share of freeing a slot, once its products have read it
    auto release = [&](unsigned bar) { if (lane == 0) mbar_arrive(bar); };
    if (FLASHSIM_WS_PINGPONG && next == 0) named_arrive(1, 256);   // warpgroup 0 goes first

    int nb = 0;                                      // K/V fills before this tile
    // FLASHSIM_WS_O_FREE_LATE: the slot the last tile's O_i left from, freed by the first
    // thread once the copy engine has read it (0: none pending)
    unsigned o_slot = 0;
    auto free_o_slot = [&]() {
        if (FLASHSIM_WS_O_TMA && FLASHSIM_WS_O_FREE_LATE && o_slot && (threadIdx.x & 127) == 0)
            wg_free_o_slot(o_slot);
        o_slot = 0;
    };
    for (int kq = 0;; ++kq) {                        // kq: Q fills before this tile
        // the tile: TILE_SMEM, its index, problem and first row as the producer published
        // them with Q_i (tinfo); else from the producer under a counter (its Q_i's arrival
        // publishes it; read by the lane that frees the slot, which makes the read ordered
        // before the producer's next write there, and passed to the warp), or known here, and
        // its Q_i waited for only before the first product
        int ti = (int)blockIdx.x + kq * (int)gridDim.x;
        int4 tv = make_int4(0, 0, 0, 0);             // TILE_SMEM: the slot's tinfo
        int zo = 0;
        if (FLASHSIM_WS_TILE_SMEM) {
            // (read by each warp's first lane, which frees the slot, so that the reads are
            // ordered before the producer's next writes there; passed to the warp through
            // shuffles, which ptxas knows give every lane the same value)
            mbar_wait(fullQ(kq & 1), (kq >> 1) & 1);
            if (lane == 0) tv = *reinterpret_cast<const int4*>(tinfo[kq & 1]), zo = tinfo[kq & 1][TI_ZO];
            tv.x = __shfl_sync(0xffffffffu, tv.x, 0), tv.y = __shfl_sync(0xffffffffu, tv.y, 0);
            tv.z = __shfl_sync(0xffffffffu, tv.z, 0), tv.w = __shfl_sync(0xffffffffu, tv.w, 0);
            zo = __shfl_sync(0xffffffffu, zo, 0);
            ti = tv.x;
        } else if (tile_counter) {
            mbar_wait(fullQ(kq & 1), (kq >> 1) & 1);
            if (lane == 0) ti = *(volatile int*)&tile_in[kq & 1];
            ti = __shfl_sync(0xffffffffu, ti, 0);
        }
        if (FLASHSIM_WS_TILE_SMEM ? ti < 0 : ti >= ntiles) {
            free_o_slot();
            break;
        }
        Tile tl;
        if (FLASHSIM_WS_TILE_SMEM) {
            // the problem and first row (tile()'s divisions) from the producer, the rest here
            // (from them, ptxas compiles the masks as it does from tile())
            tl.p = tv.y, tl.i0 = tv.z;
            tl.rows = min(Br, nq - tl.i0);
            band.kv_range(tl.i0, tl.i0 + tl.rows, nk, Bc, &tl.jlo, &tl.jhi);
        } else {
            tl = tile(ti);
        }
        const int p = tl.p, i0 = tl.i0, rows = tl.rows, jlo = tl.jlo, jhi = tl.jhi;
        const long long q_row = (long long)p * Nq + i0;   // of L
        T* Oi = O + at_row0(at, p, AT_O) + i0 * (long long)ldo;
        if (jhi < jlo) {                             // no key visible: O_i = 0, L_i = −∞
            free_o_slot();
            fwd_tile_unseen_write<T, THREADS - 128>(Oi, ldo, L + q_row, rows, dv, threadIdx.x - 128);
            mbar_wait(fullQ(kq & 1), (kq >> 1) & 1); // (the producer's arrival, no Q_i)
            __syncwarp();
            release(emptyQ(kq & 1));
            continue;
        }
        const unsigned sQ = sQ0 + (kq & 1) * TILE_Q;
        float m0 = FIXED ? cap_fixed_m(k_out) : neg_inf<float>(), m1 = m0;   // running max (log2), rows g, g + 8
        if (FIXED && slopes != nullptr) {           // with ALiBi: m per row (fixed_m_alibi)
            const float bias = k_out * slopes[p];   // (slopes hold slope / softcap)
            m0 = fixed_m_alibi(m0, bias, i0 + r0, nk, band);
            m1 = fixed_m_alibi(m1, bias, i0 + r0 + 8, nk, band);
        }
        float l0 = 0.f, l1 = 0.f;                    // partial row sums of this thread
#pragma unroll
        for (int x = 0; x < D / 2; ++x) o[x] = 0.f;

        // S = Q_i K_jᵀ from K slot kb: D/16 instructions of 64 × Bc × 16, one group
        auto issue_s = [&](unsigned kb) {
            const unsigned long long dq = desc(sQ + cw * 64 * CL::RB, 16, CL::SBO, CL::MODE),
                                     dk = desc(kb, 16, CL::SBO, CL::MODE);
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                const unsigned blk = kk / CL::KSTEPS;    // the column block, and 16 columns =
                const unsigned step = (kk % CL::KSTEPS) << 5;   // 32 bytes into it per k-step
                Wgmma<T, Bc>::ss(s, desc_plus(dq, blk * (Br * CL::RB) + step), desc_plus(dk, blk * (Bc * CL::RB) + step), kk > 0);
            }
            wgmma_commit();
        };
        // HALF_PV: step j's key tile holds no key of this warpgroup's rows in its upper half
        // (past klast, the last key they see). (Not in the softcap/ALiBi instances: there the
        // test's code measured 2–3% slower where it never applies)
        constexpr bool HALF = FLASHSIM_WS_HALF_PV && Bc == 128 && !VAR;
        const int klast = band.right < 0 ? nk - 1
                        : min(nk - 1, i0 + min(cw * 64 + 63, rows - 1) + band.off + band.right);
        auto half = [&](int j) { return HALF && klast < key_tile(tl, j - jlo) * Bc + Bc / 2; };
        // O_i += P V_j from V slot vb: Bc/16 instructions of 64 × D × 16 (h: the first Bc/32,
        // the keys where P may be nonzero), one group
        auto issue_pv = [&](unsigned vb, bool h) {
            const unsigned long long dv = desc(vb, Bc * CL::RB, CL::SBO, CL::MODE);
            if constexpr (HALF) {
                if (h) {
#pragma unroll
                    for (int kk = 0; kk < Bc / 32; ++kk) Wgmma<T, D>::rs(o, pf[kk], desc_plus(dv, kk * 16 * CL::RB));
                    wgmma_commit();
                    return;
                }
            }
#pragma unroll
            for (int kk = 0; kk < Bc / 16; ++kk) Wgmma<T, D>::rs(o, pf[kk], desc_plus(dv, kk * 16 * CL::RB));
            wgmma_commit();
        };
        // the online softmax of tile j on S (wgmma.cuh's wg_softmax), and P to T
        // (its mask test over the warpgroup's 64 rows, or the tile's Br: the same scores)
        constexpr int BrM = FLASHSIM_WS_WG_MASK ? 64 : Br, W0 = FLASHSIM_WS_WG_MASK ? 64 : 0;
        auto kt = [&](int j) { return key_tile(tl, j - jlo); };   // step j's key tile
        // SIDE: ALiBi alone on a key tile on one side of the diagonal key of each row of the
        // warp, as a term per key and a frame offset per row (wgmma.cuh's wg_side,
        // wg_scores_side; NOTES v91), in bfloat16's lazy instance: float16's lazy instance
        // also runs the softcap alone, which measured up to 3% slower with the pass beside it
        constexpr bool SIDE = LAZY && IsBf16<T>::value;
        auto softmax = [&](int j, float& a0, float& a1) {
            wg_softmax<Bc, BrM, VAR, FIXED>(s, m0, m1, l0, l1, a0, a1, kt(j) * Bc, i0 + cw * W0, r0 - cw * W0, tig,
                                     nq, nk, band, sl2, k_in, k_out,
                                     VAR && slopes != nullptr ? slopes[p] : 0.f);
        };
        auto pack_p = [&]() { wg_pack_p<T, Bc>(s, pf); };
        float lf0 = 0.f, lf1 = 0.f;                  // the lazy step's frame offsets (SIDE)
        auto lazy_step = [&](int j, float& a0, float& a1) {
            softmax_lazy<T, Bc, SIDE>(s, pf, m0, m1, l0, l1, a0, a1, sl2, lf0, lf1);
        };
        // the lazy step's scores (the softcap's tanh, the mask), finished in s alone, which
        // P_{j−1} V_{j−1} does not touch: they run beside that product (NOTES v62)
        auto scores = [&](int j) {
            if constexpr (SIDE) {
                float kbs;
                if (k_out == 0.f && slopes != nullptr
                    && wg_side<Bc>(kt(j) * Bc, i0 + cw * W0, r0 - cw * W0, g, tig, band, slopes[p], sl2,
                                   &kbs, &lf0, &lf1)) {
                    wg_scores_side<Bc, BrM>(s, kt(j) * Bc, i0 + cw * W0, r0 - cw * W0, tig, nk, band,
                                            k_in, kbs);
                    return;
                }
                lf0 = lf1 = 0.f;
            }
            wg_scores<Bc, BrM, VAR>(s, kt(j) * Bc, i0 + cw * W0, r0 - cw * W0, tig, nq, nk, band, k_in,
                                    k_out, VAR && slopes != nullptr ? slopes[p] : 0.f);
        };

        // Step n (j = jlo + n, key tile kt(j), the CTA's fill nb + n of the K/V slots: slot
        // (nb + n) % STAGES, whose parity the waits name): S_j and P_{j−1} V_{j−1} issued
        // together; K's slot freed once S_j is done, V's once the second product is. (ptxas
        // places the wait for the second product above the softmax: NOTES v43.)
        // (unsigned: no sign fix-ups on the path from a step's top to its waits)
        auto slot = [&](int j) { return (int)((unsigned)(nb + j - jlo) % STAGES); };
        auto parity = [&](int j) { return (unsigned)(nb + j - jlo) / STAGES & 1; };
        mbar_wait(fullQ(kq & 1), (kq >> 1) & 1);
        // this warpgroup's steps: jlo … wl (none where wl < jlo); the producer frees the
        // slots of the rest for it, and it takes their turns after its epilogue
        const int wl = wg_last(tl, cw);
        if (wl >= jlo) {
        mbar_wait(fullK(slot(jlo)), parity(jlo));
        turn_wait();
        wgmma_fence();
        issue_s(sK + slot(jlo) * TILE_KV);
        bool hp = half(jlo);                         // step j − 1's: its P V over half the keys
        turn_pass();
        free_o_slot();                               // the last tile's O_i, read by now
        wgmma_wait<0>();
        fence_regs<Bc / 2>(s);
        release(emptyK(slot(jlo)));
        {
            float b0, b1;                            // O_i is still 0: nothing to scale
            softmax(jlo, b0, b1);
        }
        pack_p();

        // O's rescale by the α of tile j − 1 (a0, a1): FLASHSIM_WS_RESCALE_LATE = 0 does it
        // once S_j is issued, while the tensor cores run that product, and before
        // P_{j−1} V_{j−1} is issued (the same operations in the same order: the same bits);
        // 1, at the end of the step, on the path from the softmax to the next issue
        float a0 = 1.f, a1 = 1.f;
        auto rescale = [&]() {
            if (FIXED) return;                       // α = 1
            if (LAZY && __all_sync(0xffffffffu, a0 == 1.f && a1 == 1.f)) return;
#pragma unroll
            for (int t = 0; t < D / 8; ++t) {
                o[4 * t] *= a0; o[4 * t + 1] *= a0; o[4 * t + 2] *= a1; o[4 * t + 3] *= a1;
            }
        };
        for (int j = jlo + 1; j <= wl; ++j) {
            const int sn = slot(j), sp = slot(j - 1);
            mbar_wait2(fullK(sn), parity(j), fullV(sp), parity(j - 1));
            fence_regs<Bc / 2>(s);
            fence_regs<D / 2>(o);
            turn_wait();
            wgmma_fence();
            issue_s(sK + sn * TILE_KV);
            if (!FLASHSIM_WS_RESCALE_LATE && j > jlo + 1) {   // (the first step's O is still 0)
                rescale();
                fence_regs<D / 2>(o);
                wgmma_fence();                       // O's registers, written above, read by the product
            }
            issue_pv(sV + sp * TILE_KV, hp);
            hp = half(j);
            turn_pass();
            wgmma_wait<1>();                         // S_j is done, P_{j−1} V_{j−1} may run on
            fence_regs<Bc / 2>(s);
            release(emptyK(sn));
            if constexpr (LAZY) {
                scores(j);                           // beside P_{j−1} V_{j−1} (NOTES v62)
                wgmma_wait<0>();                     // P_j goes straight to pf: the product
                fence_regs<D / 2>(o);                // must have read P_{j−1} (NOTES v43)
                release(emptyV(sp));
#pragma unroll
                for (int kk = 0; kk < Bc / 16; ++kk)
                    asm volatile("" : "+r"(pf[kk][0]), "+r"(pf[kk][1]), "+r"(pf[kk][2]), "+r"(pf[kk][3]));
                lazy_step(j, a0, a1);
                if (FLASHSIM_WS_RESCALE_LATE) rescale();
                continue;
            }
            softmax(j, a0, a1);
            wgmma_wait<0>();
            fence_regs<D / 2>(o);
            release(emptyV(sp));
#pragma unroll
            for (int kk = 0; kk < Bc / 16; ++kk)     // the product has read P_{j−1}: only now
                asm volatile("" : "+r"(pf[kk][0]), "+r"(pf[kk][1]), "+r"(pf[kk][2]), "+r"(pf[kk][3]));
            if (FLASHSIM_WS_RESCALE_LATE) rescale();
            pack_p();
        }
        {
            const int sl = slot(wl);
            mbar_wait(fullV(sl), parity(wl));
            if (!FLASHSIM_WS_RESCALE_LATE && wl > jlo) rescale();
            fence_regs<D / 2>(o);
            turn_wait();
            wgmma_fence();
            issue_pv(sV + sl * TILE_KV, hp);
            turn_pass();
            wgmma_wait<0>();
            fence_regs<D / 2>(o);
            release(emptyV(sl));
        }
        }

        // finish: reduce ℓ over the quad, divide once, write O_i and L_i (through Q_i's
        // slot, whose products are done; O = 0 and L = −∞ for rows that saw no key), then
        // free the slot for the producer
        if (FLASHSIM_WS_O_TMA) {
            free_o_slot();                           // (pending where this warpgroup ran no step)
            wg_store_o_tma<T, D, Br>(o, sQ, &tmO, FLASHSIM_WS_TILE_SMEM ? tv.w : crd[8 * p + 6],
                                     FLASHSIM_WS_TILE_SMEM ? zo : crd[8 * p + 7], i0, cw, L + q_row, l0, l1,
                                     m0, m1, r0, tig, rows, dv, emptyQ(kq & 1), !FLASHSIM_WS_O_FREE_LATE);
            if (FLASHSIM_WS_O_FREE_LATE) o_slot = emptyQ(kq & 1);
        } else {
            wg_store_o16<T, D, Br>(o, sQ, Oi, ldo, L + q_row, l0, l1, m0, m1, r0, lane, tig, rows, dv);
            __syncwarp();
            release(emptyQ(kq & 1));
        }
        // the turns of the steps past wl: a tile has jhi − jlo + 2 (the first S, a step per
        // later tile, the last P V)
        for (int t = wl < jlo ? jlo - 2 : wl; t < jhi; ++t) {
            turn_wait();
            turn_pass();
        }
        nb += jhi - jlo + 1;
    }
    // the last warpgroup's last pass (or, with no tile seen, the first arrival) is
    // taken, so that no arrival is left on a barrier at the end
    if (cw == 0) turn_wait();
    // O's last stores written before the CTA's end (wg_store_o_tma's threads)
    if (FLASHSIM_WS_O_TMA && (threadIdx.x & 127) == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
#else
    // built for a target without wgmma: flashsim.gpu launches this kernel only on sm_90a
    __trap();
#endif
}

// flash2_bwd_ws<T, D, VAR>, flash2_bwd_ws_det<T, D, VAR>: the backward main loop of
// flash2_bwd_wg (its schedule, tiles, steps — wg_bwd.cuh's — and so its bits and counted
// bytes) with the data moved as flash2_fwd_ws moves it:
//   - a producer warpgroup: one thread issues TMA copies of K_j, V_j (once) and of Q_i,
//     dO_i per step into a ring of STAGES slots, completing a slot's "full" mbarrier by
//     their bytes; one warp brings L_i·log2(e) and D_i of the step beside them and
//     arrives on it too. The consumers free a slot ("empty"), every thread once its
//     products and its own loads of L_i, D_i have read it. Rows past Nq arrive
//     zero-filled (the tensor map's bound), with L = +∞, so P and dS are 0 there as in
//     flash2_bwd_wg;
//   - dQ_i (not _det): the consumers store it into one of two shared buffers (one at
//     D = 64: wsb::dq_buffers) in the
//     order they hold it (common.cuh's dq_tiled_at: 16-byte stores, a warp's 512 bytes
//     contiguous, no bank conflicts), and a third producer warp has the copy engine add
//     the buffer to dQacc's block of the step, summed in L2, with one bulk reduce-add
//     (cp.reduce.async.bulk: dQacc lies in those blocks, which flash2_bwd_postprocess
//     reads back in rows), where flash2_bwd_wg's warps issue 16 two-float atomics per
//     thread per step. With two buffers the consumers store step i + 1's dQ while the
//     copy engine still reads step i's; _det keeps the atomics, in turns, into dQacc in
//     rows;
//   - setmaxnreg: the producer keeps PRODUCER_REGS registers, the two consumer
//     warpgroups take the rest, 240 (at D = 64, whose steps are 128 queries, only with
//     dSᵀ formed beside Pᵀ: step_mid's EARLY; in flash2_bwd_wg's order it spills);
//   - no CTA barrier in the loop: the consumers meet only at the step's dSᵀ barrier
//     (named, 256 threads), and dSᵀ is double-buffered, so that a warpgroup may write the
//     next step's while the other still reads this one's (a warpgroup passes step i + 1's
//     barrier only once the other has arrived there, after its step i product read dSᵀ);
//   - step i + 1's Sᵀ issued right after step i's dQ_i stores, before they are published
//     (FLASHSIM_WS_BWD_AHEAD), so that the tensor cores do not wait for them to drain.
// 1: the next step's Sᵀ issued before this step's dQ_i is published (bwd_ws's loop); 0: the
// step as flash2_bwd_wg's (NOTES v40)
#ifndef FLASHSIM_WS_BWD_AHEAD
#define FLASHSIM_WS_BWD_AHEAD 1
#endif
namespace wsb {
constexpr int THREADS = 384, STAGES = 2, PRODUCER_REGS = 24;
constexpr int CONSUMER_REGS = ((65536 / THREADS & ~7) * 3 - PRODUCER_REGS) / 2 & ~7;   // 240
// dQ_i's shared buffers (not _det): two at D = 128; one at D = 64, where with two the
// tiles and buffers of 128-row steps would fill all 227 KB a CTA may take, leaving no room
// for the mbarriers. The copy engine reads a block within a fraction of a step, so the
// consumers rarely find their one buffer still being read (kernels.py's WS_BWD_DQ_BUFFERS)
template <int D> __host__ __device__ constexpr int dq_buffers() { return D == 64 ? 1 : 2; }
}  // namespace wsb

template <typename T, int D, bool DET, bool VAR>
__device__ __forceinline__ void
bwd_ws(const wg::TensorMap* tmQ, const wg::TensorMap* tmK, const wg::TensorMap* tmV,
       const wg::TensorMap* tmdO, const int* __restrict__ crd,
       const long long* __restrict__ at,
       const float* __restrict__ L, const float* __restrict__ Dv, float* __restrict__ dQacc,
       T* __restrict__ dK, T* __restrict__ dV, int Nq, int Nk, int lddk, int lddv, int d, int dv,
       int left, int right, float scale, float k_in, float k_out, const float* __restrict__ slopes,
       int* __restrict__ sem, unsigned long long* io, int chunk) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using namespace wg;
    static_assert(D == 64 || D == 128, "head dims 64 and 128");
    constexpr int Bc = wgb::Bc, BrB = wgb::brb<D>(), STAGES = wsb::STAGES;
    constexpr unsigned TILE_KV = Bc * D * 2, TILE_Q = BrB * D * 2, TILE_dS = Bc * BrB * 2;
    constexpr float LOG2E = 1.4426950408889634f;
    extern __shared__ unsigned char smem_raw[];
    const unsigned base = (smem_addr(smem_raw) + 1023) & ~1023u;
    const unsigned sK = base;                        // Bc·D, D/64 column blocks of Bc rows
    const unsigned sV = sK + TILE_KV;                // Bc·D
    const unsigned sQ = sV + TILE_KV;                // STAGES slots of BrB·D
    const unsigned sdO = sQ + STAGES * TILE_Q;       // STAGES slots of BrB·D
    const unsigned sdS = sdO + STAGES * TILE_Q;      // 2 × dSᵀ: Bc keys × BrB queries
    // dQ_i (not DET), in NDQ buffers: BrB rows of D fp32 in dQacc's tiled order (common.cuh's
    // dq_tiled_at), what the copy engine adds to dQacc's block of the step
    constexpr int NDQ = wsb::dq_buffers<D>();
    constexpr unsigned TILE_dQ = DET ? 0 : BrB * D * 4;
    const unsigned sdQ = sdS + 2 * TILE_dS;          // NDQ × TILE_dQ
    float* sL = reinterpret_cast<float*>(smem_raw + (sdQ + NDQ * TILE_dQ - smem_addr(smem_raw)));   // STAGES × BrB
    float* sD = sL + STAGES * BrB;                   // STAGES × BrB
    // mbarriers: K_j, V_j full; per slot full, empty; per dQ_i buffer full, empty
    __shared__ __align__(8) unsigned long long bars[5 + 2 * STAGES];
    const unsigned bKV = smem_addr(bars);
    auto full = [&](int s) { return bKV + 8 * (1 + s); };
    auto empty = [&](int s) { return bKV + 8 * (1 + STAGES + s); };
    auto dQfull = [&](int b) { return bKV + 8 * (1 + 2 * STAGES + b); };
    auto dQempty = [&](int b) { return bKV + 8 * (3 + 2 * STAGES + b); };
    // the problem, read again where it is used (the consumers have no register to keep it
    // in): blockIdx.y, or under chunks of problems where thread 0 left it
    __shared__ int tile_p;
    auto problem = [&]() { return chunk > 1 ? *(volatile int*)&tile_p : (int)opaque_ctaid_y(); };

    const int warp = threadIdx.x >> 5, grp = warp >> 2, lane = threadIdx.x & 31;
    // deterministic mode takes the tiles from the last (flash2_bwd_wg_det's order)
    int p = blockIdx.y, j = DET ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    if (!DET && chunk > 1) {
        // under a band (kernels.ws_chunk): the hardware starts CTA t = x + nx·y in turn;
        // problems in chunks of `chunk` (the first one shorter where they do not divide),
        // a chunk's K/V tiles in turn tile 0 of each of its problems (under a causal mask
        // seen by the most queries), then tile 1 of each, …, so that the launch ends on
        // light tiles, not on one problem's heavy ones (the forward's order, NOTES v46)
        const int nx = gridDim.x, t = blockIdx.x + nx * blockIdx.y;
        const int first = (int)gridDim.y - ((int)gridDim.y - 1) / chunk * chunk;
        int r = t, gc = first, pb = 0;
        if (t >= first * nx) {
            const int c = (t - first * nx) / (chunk * nx);
            r = t - first * nx - c * chunk * nx, gc = chunk, pb = first + c * chunk;
        }
        j = r / gc;
        p = pb + (r - j * gc);
    }
    const int nq = Nq, nk = Nk;
    const int j0 = j * Bc, cols = min(Bc, nk - j0);
    const Band band{left, right, nk - nq};
    int ilo, ihi;                                    // visited Q tiles, in units of BrB rows
    band.q_range(j0, j0 + cols, nq, BrB, &ilo, &ihi);
    // the traffic, counted once before the roles part, as flash2_bwd_wg's after its loop
    if (ihi >= ilo) bwd_tile_count<T>(io, cols, min(nq, (ihi + 1) * BrB) - ilo * BrB, d, dv);
    COUNT_IO(io, IO_dK_W, (long long)cols * d * sizeof(T));       // SRAM→HBM: dK_j (Bc·d)
    COUNT_IO(io, IO_dV_W, (long long)cols * dv * sizeof(T));      // SRAM→HBM: dV_j (Bc·dv)
    if (threadIdx.x == 0) {
        mbar_init(bKV, 1);
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full(s), 1 + 32);              // the TMA thread's arrival (and the
            mbar_init(empty(s), wgb::THREADS);       // bytes), L/D's warp; every consumer
        }                                            // thread (each read L_i, D_i itself)
        for (int b = 0; b < 2; ++b) {
            mbar_init(dQfull(b), wgb::THREADS);      // every consumer thread's stores
            mbar_init(dQempty(b), 1);                // the reducing warp's
        }
        mbar_init_fence();
        tile_p = p;
    }
    __syncthreads();

    if (grp == 0) {
        // -- the producer -----------------------------------------------------------------
        if (FLASHSIM_WS_SETMAXNREG) setmaxnreg_dec<wsb::PRODUCER_REGS>();
        if (ihi < ilo) return;
        if (threadIdx.x == 0) {
            // crd: per problem, the column and problem coordinates of row 0 of Q, K, V, dO
            const int cq = crd[8 * p], zq = crd[8 * p + 1], ck = crd[8 * p + 2], zk = crd[8 * p + 3],
                      cv = crd[8 * p + 4], zv = crd[8 * p + 5], co = crd[8 * p + 6], zo = crd[8 * p + 7];
            mbar_expect_tx(bKV, 2 * TILE_KV);        // HBM→SRAM: K_j (Bc·d), V_j (Bc·dv)
#pragma unroll
            for (int cb = 0; cb < D / 64; ++cb) {
                tma_load_3d(sK + cb * Bc * 128, tmK, ck + cb * 64, j0, zk, bKV);
                tma_load_3d(sV + cb * Bc * 128, tmV, cv + cb * 64, j0, zv, bKV);
            }
            for (int i = ilo; i <= ihi; ++i) {
                const int n = i - ilo, s = n % STAGES;
                mbar_wait(empty(s), ((n / STAGES) & 1) ^ 1);   // the slot's last step is read
                mbar_expect_tx(full(s), 2 * TILE_Q); // HBM→SRAM: Q_i (Br·d), dO_i (Br·dv)
#pragma unroll
                for (int cb = 0; cb < D / 64; ++cb) {
                    tma_load_3d(sQ + s * TILE_Q + cb * BrB * 128, tmQ, cq + cb * 64, i * BrB, zq, full(s));
                    tma_load_3d(sdO + s * TILE_Q + cb * BrB * 128, tmdO, co + cb * 64, i * BrB, zo, full(s));
                }
            }
        } else if (warp == 1) {
            for (int i = ilo; i <= ihi; ++i) {
                const int n = i - ilo, s = n % STAGES, i0 = i * BrB, rows = min(BrB, nq - i0);
                const long long q_row = (long long)p * Nq + i0;
                mbar_wait(empty(s), ((n / STAGES) & 1) ^ 1);
                // L·log2(e), and +∞ for rows past Nq and rows that see no key (L = −∞):
                // there 2^(s − ∞) = 0 makes P, and so dS, zero without a per-element test
                for (int r = lane; r < BrB; r += 32) {
                    const float l = r < rows ? L[q_row + r] : neg_inf<float>();   // HBM→SRAM: L_i (Br)
                    sL[s * BrB + r] = l == neg_inf<float>() ? -neg_inf<float>() : l * LOG2E;
                    sD[s * BrB + r] = r < rows ? Dv[q_row + r] : 0.f;               // HBM→SRAM: D_i (Br)
                }
                mbar_arrive(full(s));                // release: the stores above come first
            }
        } else if (warp == 2 && !DET) {
            // dQacc_i += dQ_i: the copy engine adds the step's shared dQ_i in L2, one bulk
            // reduce-add of the block (dQacc in blocks of BrB × D per problem and step,
            // common.cuh's dq_tiled_at: rows past Nq and columns past d add zeros to the
            // block's padding), once both warpgroups stored theirs; the consumers store the
            // next step's into the other buffer meanwhile
            if (lane == 0) {
                const int Tr = (nq + BrB - 1) / BrB;
                for (int i = ilo; i <= ihi; ++i) {
                    const int n = i - ilo, b = n % NDQ;
                    mbar_wait(dQfull(b), (n / NDQ) & 1);
                    bulk_reduce_add_f32(dQacc + ((long long)p * Tr + i) * (BrB * D), sdQ + b * TILE_dQ, TILE_dQ);
                    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
                    asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");   // the buffer is read
                    mbar_arrive(dQempty(b));
                }
                asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");   // and added
            }
        }
        return;
    }

    // -- the consumers: warpgroup grp − 1 owns keys 64·(grp − 1) … of the tile -----------
    if (FLASHSIM_WS_SETMAXNREG) setmaxnreg_inc<wsb::CONSUMER_REGS>();
    const wgb::Tile tile{sK, sV, j0, cols, nq, nk, band};
    float dv_acc[D / 2], dk_acc[D / 2];              // dV_j, dK_j of the warpgroup's 64 keys
#pragma unroll
    for (int x = 0; x < D / 2; ++x) dv_acc[x] = dk_acc[x] = 0.f;
    auto slope = [&]() { return slopes != nullptr ? slopes[problem()] : 0.f; };
    // deterministic: the consumers (threads 128 … 383) wait for and pass the turn
    auto wait = [&](int i, int rows) {
        wgb::Turn t{nullptr, 0};
        if constexpr (!DET) {                        // the buffer's last dQ has left it
            t.mine = (i - ilo) % NDQ;                // the step's buffer, for pass
            mbar_wait(dQempty(t.mine), (((i - ilo) / NDQ) & 1) ^ 1);
            return t;
        }
        t.counter = dq_turn<DET, false>(sem, nullptr, p, Nq, Nk, BrB, Bc, i, j, rows, nk, band, &t.mine);
        if constexpr (DET) {
            if (threadIdx.x == 128) {
                int v;
                do {
                    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(t.counter) : "memory");
                } while (v != t.mine);
            }
            named_sync(2, wgb::THREADS);
        }
        return t;
    };
    auto pass = [&](wgb::Turn t) {
        if constexpr (!DET) {                        // this thread's part of dQ_i is in sdQ
            fence_proxy_async();
            mbar_arrive(dQfull(t.mine));
        }
        if constexpr (DET) {
            named_sync(2, wgb::THREADS);             // every consumer thread has added
            if (threadIdx.x == 128)
                asm volatile("st.release.gpu.global.b32 [%0], %1;\n" :: "l"(t.counter), "r"(t.mine + 1) : "memory");
        }
    };
    if (ihi >= ilo) mbar_wait(bKV, 0);
#if FLASHSIM_WS_BWD_AHEAD
    // step i + 1's Sᵀ issued as soon as step i's dQ_i stores are, before they are fenced
    // and published (and before dPᵀ, issued after): the tensor cores start on it while
    // the stores drain (NOTES v40: 2% off the backward's time). The loop's body is step
    // i's stores, then the rest of step i + 1, whose products are all waited for within
    // it: none is in flight across the back edge (ptxas would serialise every wgmma), the
    // first step's products and the last step's stores lie outside it. Issued among the
    // stores, or with dPᵀ too, the step needs more than the consumers' 240 registers
    // (ptxas serialises the products, C7512, or spills).
    float s_acc[BrB / 2], dp_acc[BrB / 2], dq[wgb::DqBlock<D>::QN / 2];
    auto rest = [&](int i) {                         // step i from the wait for its Sᵀ to dQ_i's product
        const wgb::Thread<1> th;                     // (from %tid.x where used, per step)
        const int n = i - ilo, s = n % STAGES;
        wgb::step_mid<T, D, VAR, 1, 1, D == 64>(th, tile, i, sQ + s * TILE_Q, sdO + s * TILE_Q, sdS + (n & 1) * TILE_dS,
                                       sL + s * BrB, sD + s * BrB, dv_acc, dk_acc, s_acc, dp_acc, dq, scale,
                                       k_in, k_out, slope, [&] { mbar_arrive(empty(s)); });
    };
    if (ihi >= ilo) {
        {
            const wgb::Thread<1> th;
            mbar_wait(full(0), 0);
            wgb::step_s<T, D, 1>(th, tile, sQ, s_acc);
            wgb::step_dp<T, D, 1>(th, tile, sdO, dp_acc);
        }
        rest(ilo);
        for (int i = ilo; i < ihi; ++i) {
            const int n = i - ilo, s1 = (n + 1) % STAGES;
            const wgb::Thread<1> th;
            wgb::step_dq<T, D, 1, !DET>(th, tile, (long long)p * Nq, i, dq, scale, dQacc, d, wait, pass,
                                        sdQ + (n % NDQ) * TILE_dQ, [&] {
                mbar_wait(full(s1), ((n + 1) / STAGES) & 1);
                wgb::step_s<T, D, 1>(th, tile, sQ + s1 * TILE_Q, s_acc);
            });
            wgb::step_dp<T, D, 1>(th, tile, sdO + s1 * TILE_Q, dp_acc);
            rest(i + 1);
        }
        const wgb::Thread<1> th;
        wgb::step_dq<T, D, 1, !DET>(th, tile, (long long)p * Nq, ihi, dq, scale, dQacc, d, wait, pass,
                                    sdQ + ((ihi - ilo) % NDQ) * TILE_dQ);
    }
#else
    for (int i = ilo; i <= ihi; ++i) {
        const int n = i - ilo, s = n % STAGES;
        mbar_wait(full(s), (n / STAGES) & 1);
        wgb::step<T, D, VAR, 1, 1, !DET>(tile, (long long)p * Nq, i, sQ + s * TILE_Q, sdO + s * TILE_Q,
                                   sdS + (n & 1) * TILE_dS, sL + s * BrB, sD + s * BrB, dv_acc, dk_acc,
                                   scale, k_in, k_out, dQacc, d, slope,
                                   [&] { mbar_arrive(empty(s)); }, wait, pass, sdQ + (n % NDQ) * TILE_dQ);
    }
#endif
    // dK_j = scale · Σ dSᵀ Q, dV_j = Σ Pᵀ dO, per query problem (GQA sums later)
    wgb::store_dkv<T, D, 1>(tile, dk_acc, dv_acc,
                            dK + at_row0_here(at, problem(), AT_dK) + j0 * (long long)lddk,
                            dV + at_row0_here(at, problem(), AT_dV) + j0 * (long long)lddv,
                            lddk, lddv, d, dv, scale);
#else
    __trap();
#endif
}

#define FLASHSIM_BWD_WS_PARAMS                                                                   \
    const __grid_constant__ wg::TensorMap tmQ, const __grid_constant__ wg::TensorMap tmK,       \
    const __grid_constant__ wg::TensorMap tmV, const __grid_constant__ wg::TensorMap tmdO,      \
    const int* __restrict__ crd, const long long* __restrict__ at, const float* __restrict__ L, \
    const float* __restrict__ Dv, float* __restrict__ dQacc, T* __restrict__ dK,               \
    T* __restrict__ dV, int Nq, int Nk, int lddk, int lddv, int d, int dv, int left, int right, \
    float scale, float k_in, float k_out, const float* __restrict__ slopes,                    \
    int* __restrict__ sem, unsigned long long* io, int chunk
#define FLASHSIM_BWD_WS_ARGS &tmQ, &tmK, &tmV, &tmdO, crd, at, L, Dv, dQacc, dK, dV, Nq, Nk, \
    lddk, lddv, d, dv, left, right, scale, k_in, k_out, slopes, sem, io, chunk

// dQ by the copy engine's reduce-adds from shared memory, in no fixed order, into dQacc in
// blocks of DQ_BLOCK per problem and step (common.cuh's dq_tiled_at; sem is not read: pass
// a null pointer)
template <typename T, int D, bool VAR>
__global__ void __launch_bounds__(wsb::THREADS, 1) flash2_bwd_ws(FLASHSIM_BWD_WS_PARAMS) {
    bwd_ws<T, D, false, VAR>(FLASHSIM_BWD_WS_ARGS);
}

// dQ in turns, the same bits on every run (sem: one zeroed int per (problem, step); dQacc
// as (problems, Nq, d), as flash2_bwd_wg's)
template <typename T, int D, bool VAR>
__global__ void __launch_bounds__(wsb::THREADS, 1) flash2_bwd_ws_det(FLASHSIM_BWD_WS_PARAMS) {
    bwd_ws<T, D, true, VAR>(FLASHSIM_BWD_WS_ARGS);
}
