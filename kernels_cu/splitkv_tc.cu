// splitkv_tc.cu: decoding over a KV cache (flashsim.kvcache's schedule) on tensor cores.
// A few query rows per sequence meet a long cache: the work is reading K and V once, so
// the kernels are built to keep the memory busy, and they count what they move exactly
// as the simulator does (-DFLASHSIM_COUNT_IO).
//
// Kernels in this file, in the order a decoding step runs them:
//   kvcache_append<T, D>       new rows k, v (batch, Nnew, kv_heads, D) written into the
//                              cache at rows cache_seqlens[b] … + Nnew − 1, through the
//                              block table when the cache is paged; one CTA per sequence,
//                              each page's table entry read once.
//   splitkv_fwd_tc<T, D, WM>   split-KV attention of the packed query rows over the
//                              cache (flash2's inner loop per part, mma.sync m16n8k16):
//                              - the g = heads / kv_heads query heads of a K/V head packed
//                                into the rows of one Q tile (row r: position r / g, head
//                                r mod g), so each K/V tile is read once per K/V head;
//                              - grid (num_splits, Q tiles, batch · kv_heads): part p of
//                                Q tile i covers K/V tiles ⌊p·n/s⌋ … ⌊(p+1)·n/s⌋ − 1 of
//                                its n, as flashsim.splitkv.split_bounds cuts them;
//                              - 4 warps as WM row groups of 16 × (4 / WM) key groups: at
//                                decoding's few rows (WM = 1, Br = 16) every warp takes a
//                                quarter of each K/V tile's keys with its own online
//                                softmax, and the four are merged through shared memory
//                                at the end; Br = 32 and 64 for more packed rows;
//                              - K/V tiles of Bc = 64 keys in a STAGES-deep cp.async
//                                pipeline, rows gathered through the block table (page
//                                ids staged in shared memory, each read once; a tile's
//                                page offset found once per tile where pages hold whole
//                                tiles), swizzled for ldmatrix;
//                              - num_splits = 1 writes O and L directly (flash2); more
//                                write fp32 partials Osplit, Lsplit, and the last part of
//                                each Q tile to finish merges them by their log-sum-exp
//                                into O (I/O type) and L (fp32): the combine, without a
//                                second launch (a counter per Q tile in `sem`, reset by
//                                the CTA that merges), its threads spread over the rows
//                                and columns with many parts' loads in flight (a tile
//                                of few rows: one online pass, a thread per 4 columns).
//   splitkv_fwd_tc_cl<T, D, WM, CL>
//                              the same parts as one thread block cluster of CL CTAs
//                              (compute capability 9.0; s = CL): each part's partial
//                              stays in its shared memory, and after the cluster's
//                              barrier every part merges a share of the tile's rows
//                              from all of them (distributed shared memory): no
//                              partial, fence or counter in memory.
//
// Layouts: q and O (batch, Nq, heads, D); L (batch, heads, Nq); the caches (pages,
// page_rows, kv_heads, D), a contiguous cache being one page of `capacity` rows per
// sequence; Osplit (s, batch · kv_heads, M, D) and Lsplit (s, batch · kv_heads, M) fp32
// with M = Nq · g packed rows; sem (Q tiles × batch · kv_heads) int32, zero between launches.

#include "warp.cuh"

namespace skv {

constexpr int WARPS = 4, THREADS = 32 * WARPS;
constexpr int Bc = 64;                 // keys per K/V tile (kernels.py: SPLITKV_BC)
constexpr int PAGE_CHUNK = THREADS;    // page ids staged in shared memory at a time

// K/V tiles in flight per CTA (kernels.py: SPLITKV_STAGES, per Br): 3 in the 16-row
// kernel (decoding's Nq = 1 and GQA groups up to 16 rows; two CTAs still share an SM, and
// with the launcher's fewer, longer parts it ran 0.79–0.99× the time of 2 stages on an
// H100: NOTES.md v33), 2 in the 32- and 64-row ones (3 would leave the 64-row tile one
// CTA per SM, and ran up to 5% slower there). FLASHSIM_SKV_STAGES > 0 sets every kernel's,
// for analysis/tune_decode.py, which builds and times variants side by side.
#ifndef FLASHSIM_SKV_STAGES
#define FLASHSIM_SKV_STAGES 0
#endif
template <int WM> __host__ __device__ constexpr int stages() {
    return FLASHSIM_SKV_STAGES > 0 ? FLASHSIM_SKV_STAGES : (WM == 1 ? 3 : 2);
}

// Element offset of 16-byte chunk c of row r in a swizzled tile of D-wide rows: chunk c
// of row r sits at chunk c ^ (r & 7), so the 8 rows one ldmatrix reads hit 8 bank groups.
template <int D> __device__ __forceinline__ int swz(int r, int c) {
    return r * D + ((c ^ (r & 7)) << 3);
}

// The K/V tiles [ja, jz) this CTA visits, and the visible keys of its rows.
struct Part {
    int ja, jz;        // K/V tiles of this part
    int n;             // K/V tiles the Q tile visits in all (0: it sees no key)
};
// Keys of Q tile rows [i0, i1) (packed, G per position) in a sequence of L keys: all
// L, or under the causal mask (aligned to the bottom right) c ≤ r / G + L − Nq.
__device__ __forceinline__ Part part_of(int i0, int i1, int G, int L, int Nq, bool causal,
                                        int p, int s) {
    const int c_hi = causal ? min(L - 1, (i1 - 1) / G + L - Nq) : L - 1;
    const int n = c_hi < 0 ? 0 : c_hi / Bc + 1;
    return Part{(int)((long long)n * p / s), (int)((long long)n * (p + 1) / s), n};
}

// Where row `row` of a sequence lives in the cache: page ids come from `pages` (the
// staged part of the block table, pages[x − base] for page x) or, for a contiguous
// cache (no table), the sequence's own slot.
struct Pages {
    const int* table;     // this sequence's row of the block table, or nullptr
    int seq, page_rows, num_pages;
    int* staged;          // shared: page ids of pages base … base + PAGE_CHUNK − 1
    int base;
    // element offset of cache row `row`, head offset excluded; -1 for a page id out of
    // range (the launcher checks the table; this keeps a bad one from reading anywhere)
    __device__ __forceinline__ long long row_offset(int row, int row_stride) const {
        // a contiguous cache: row < Lk ≤ page_rows (the capacity), no division
        if (!table) return ((long long)seq * page_rows + row) * row_stride;
        const int x = row / page_rows;
        const int pg = staged[x - base];
        if (pg < 0 || pg >= num_pages) return -1;
        return ((long long)pg * page_rows + row % page_rows) * row_stride;
    }
};

}  // namespace skv

// -- append -----------------------------------------------------------------------------

template <typename T, int D>
__global__ void __launch_bounds__(skv::THREADS)
kvcache_append(const T* __restrict__ Knew, const T* __restrict__ Vnew, T* __restrict__ Kc,
               T* __restrict__ Vc, const int* __restrict__ block_table,
               const int* __restrict__ cache_seqlens, int Nnew, int kv_heads, int page_rows,
               int max_pages, int num_pages, unsigned long long* io) {
    using namespace skv;
    __shared__ int page;
    const int b = blockIdx.x;
    const int s0 = cache_seqlens[b];
    const long long row_stride = (long long)kv_heads * D;
    constexpr int CH = D * (int)sizeof(T) / 16;          // 16-byte chunks per head row
    const int first = s0 / page_rows, last = (s0 + Nnew - 1) / page_rows;
    if (Nnew <= 0) return;
    COUNT_IO(io, IO_Knew_R, (long long)Nnew * row_stride * sizeof(T));  // HBM→SRAM: k
    COUNT_IO(io, IO_Vnew_R, (long long)Nnew * row_stride * sizeof(T));  // HBM→SRAM: v
    COUNT_IO(io, IO_K_W, (long long)Nnew * row_stride * sizeof(T));     // SRAM→HBM: K rows
    COUNT_IO(io, IO_V_W, (long long)Nnew * row_stride * sizeof(T));     // SRAM→HBM: V rows
    if (block_table != nullptr)
        COUNT_IO(io, IO_block_table_R, (long long)(last - first + 1) * 4);
    for (int x = first; x <= last; ++x) {
        // one read of the page's table entry, shared by the CTA
        if (threadIdx.x == 0) page = block_table ? block_table[(long long)b * max_pages + x] : b;
        __syncthreads();
        const int pg = page;
        const int r0 = max(s0, x * page_rows), r1 = min(s0 + Nnew, (x + 1) * page_rows);
        if (pg >= 0 && pg < num_pages) {
            const long long n = (long long)(r1 - r0) * kv_heads * CH;
            for (long long e = threadIdx.x; e < n; e += THREADS) {
                const int row = r0 + (int)(e / (kv_heads * CH));
                const long long within = e % (kv_heads * CH);    // head · CH + chunk
                const long long src = ((long long)b * Nnew + (row - s0)) * row_stride * sizeof(T) / 16 + within;
                const long long dst = ((long long)pg * page_rows + row % page_rows) * row_stride * sizeof(T) / 16 + within;
                reinterpret_cast<uint4*>(Kc)[dst] = reinterpret_cast<const uint4*>(Knew)[src];
                reinterpret_cast<uint4*>(Vc)[dst] = reinterpret_cast<const uint4*>(Vnew)[src];
            }
        }
        __syncthreads();    // `page` is rewritten for the next page
    }
}

// -- combine ----------------------------------------------------------------------------

// Merge the parts' partials of the Q tile's `rows` packed rows (rows row0 … of a part's
// slot, the parts' slots `stride` rows apart) into O and L, by the CTA:
//   L = log Σ_p exp(Lsplit_p),   O = Σ_p exp(Lsplit_p − L) Osplit_p
// first a group of threads per row for L (into sLse), then a thread per 4 columns of a
// row for O, whose loop over the parts is unrolled so that up to 8 parts' loads are in
// flight at once:
// the partials come from L2 (the loads bypass L1: other CTAs wrote them), and a merge
// that waited on them one part, or one row, at a time was latency-bound (a warp per row,
// rows in turn: 46.7 µs against 33.6 for 64 rows of 16 parts on an H100, kernels_cu/
// NOTES.md v27). A part that saw none of the tile's keys wrote no partial and is skipped
// (outside the loops' unrolled path, whose loads have no test between them).
template <typename T, int D>
__device__ __forceinline__ void combine_tile(const float* Osplit, const float* Lsplit, T* O, float* L,
                                             float* sLse, long long row0, long long stride, int i0,
                                             int rows, int b, int kvh, int G, int Nq, int heads,
                                             int n, int s, int tid) {
    constexpr int C4 = D / 4;                             // float4 columns per row
    auto nonempty = [&](int p) { return (long long)n * p / s < (long long)n * (p + 1) / s; };
    const bool all = n >= s;                              // every part has a partial
    // L: GS threads per row (32 at up to 4 rows, 2 at 64), each over parts sub, sub + GS, …,
    // reduced by shuffles within the group (the rows of a pass run together)
    int GS = 32;
    while (GS > 1 && GS * rows > skv::THREADS) GS >>= 1;
    const int sub = tid % GS, per = skv::THREADS / GS;
    for (int r0 = 0; r0 < rows; r0 += per) {         // the same passes for every thread
        const int r = r0 + tid / GS;
        const bool on = r < rows;
        const float* l = Lsplit + row0 + r;
        float mx = neg_inf<float>();
        if (on && all) {
#pragma unroll 4
            for (int p = sub; p < s; p += GS) mx = fmaxf(mx, __ldcg(l + p * stride));
        } else if (on) {
            for (int p = sub; p < s; p += GS)
                if (nonempty(p)) mx = fmaxf(mx, __ldcg(l + p * stride));
        }
        for (int off = GS / 2; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, off));
        float sum = 0.0f;
        if (on && all && !is_neg_inf(mx)) {
#pragma unroll 4
            for (int p = sub; p < s; p += GS) sum += expf(__ldcg(l + p * stride) - mx);
        } else if (on && !is_neg_inf(mx)) {
            for (int p = sub; p < s; p += GS)
                if (nonempty(p)) sum += expf(__ldcg(l + p * stride) - mx);
        }
        for (int off = GS / 2; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffff, sum, off);
        if (on && sub == 0) {
            const float lse = sum > 0.0f ? mx + logf(sum) : neg_inf<float>();
            sLse[r] = lse;
            L[((long long)b * heads + kvh * G + (i0 + r) % G) * Nq + (i0 + r) / G] = lse;
        }
    }
    __syncthreads();
    for (int x = tid; x < rows * C4; x += skv::THREADS) {
        const int r = x / C4, c = (x % C4) * 4;
        const float lse = sLse[r];
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        const float* l = Lsplit + row0 + r;
        const float* src = Osplit + (row0 + r) * D + c;
        auto add = [&](int p) {
            const float w = expf(__ldcg(l + p * stride) - lse);
            const float4 o = __ldcg(reinterpret_cast<const float4*>(src + p * stride * D));
            acc[0] += w * o.x; acc[1] += w * o.y; acc[2] += w * o.z; acc[3] += w * o.w;
        };
        if (is_neg_inf(lse)) {                            // a row with no key: O = 0
        } else if (all) {                                 // no test between the loads
#pragma unroll 8
            for (int p = 0; p < s; ++p) add(p);
        } else {
            for (int p = 0; p < s; ++p)
                if (nonempty(p)) add(p);
        }
        const int q = i0 + r;
        T* dst = O + (((long long)b * Nq + q / G) * heads + kvh * G + q % G) * D + c;
#pragma unroll
        for (int e = 0; e < 4; ++e) dst[e] = from_acc<T>(acc[e]);
    }
}

// The same merge for a tile of few rows in the 16-row kernel (rows · D/4 ≤ the CTA's
// threads: Nq = 1 with up to 4 query heads per K/V head at d = 128, 8 at d = 64): a thread
// per 4 columns of a row
// loads every part's L and those 4 columns of O, CH parts at a time all in flight, and
// merges them online (a running max, the sums rescaled to it): one pass over the
// partials, no shared memory, no barrier, one L2 round trip per CH parts where
// combine_tile waits for three (L for the max, L again for the sum, L and O for the
// weights). At Nq = 1 the combine was ~3 µs of a 13–20 µs decoding step on an H100
// (NOTES.md v34).
template <typename T, int D>
__device__ __forceinline__ void combine_few(const float* Osplit, const float* Lsplit, T* O, float* L,
                                            long long row0, long long stride, int i0, int rows,
                                            int b, int kvh, int G, int Nq, int heads, int n,
                                            int s, int tid) {
    constexpr int C4 = D / 4, CH = 8;
    if (tid >= rows * C4) return;
    const int r = tid / C4, c = (tid % C4) * 4;
    auto nonempty = [&](int p) { return (long long)n * p / s < (long long)n * (p + 1) / s; };
    const bool all = n >= s;                              // every part has a partial
    const float* l = Lsplit + row0 + r;
    const float* src = Osplit + (row0 + r) * D + c;
    float m = neg_inf<float>(), sum = 0.0f, acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int p0 = 0; p0 < s; p0 += CH) {
        float lv[CH];
        float4 ov[CH];
#pragma unroll
        for (int u = 0; u < CH; ++u) {                    // the loads first, all of them
            const int p = p0 + u;
            const bool ok = p < s && (all || nonempty(p));
            lv[u] = ok ? __ldcg(l + p * stride) : neg_inf<float>();
            ov[u] = ok ? __ldcg(reinterpret_cast<const float4*>(src + p * stride * D))
                       : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
        float mx = m;
#pragma unroll
        for (int u = 0; u < CH; ++u) mx = fmaxf(mx, lv[u]);
        if (is_neg_inf(mx)) continue;                     // no part with a key yet
        const float a = expf(m - mx);                     // 0 while m = −∞
        sum *= a;
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[e] *= a;
#pragma unroll
        for (int u = 0; u < CH; ++u) {
            const float w = expf(lv[u] - mx);             // 0 for a part without keys
            sum += w;
            acc[0] += w * ov[u].x; acc[1] += w * ov[u].y; acc[2] += w * ov[u].z; acc[3] += w * ov[u].w;
        }
        m = mx;
    }
    const int q = i0 + r;
    if (c == 0) L[((long long)b * heads + kvh * G + q % G) * Nq + q / G] = sum > 0.0f ? m + logf(sum) : neg_inf<float>();
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;     // a row with no key: O = 0
    T* dst = O + (((long long)b * Nq + q / G) * heads + kvh * G + q % G) * D + c;
#pragma unroll
    for (int e = 0; e < 4; ++e) dst[e] = from_acc<T>(acc[e] * inv);
}

// -- thread block clusters (compute capability 9.0) ------------------------------------

// The cluster's barrier (every thread of every CTA arrives; the release/acquire pair makes
// each CTA's shared-memory writes before it visible to the others' reads after it), and
// loads from CTA `rank`'s shared memory at the address its own copy of `p` has.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && !defined(FLASHSIM_HOST)
#define SKV_CLUSTER(n) __cluster_dims__(n, 1, 1)
__device__ __forceinline__ void cluster_arrive() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
    asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
__device__ __forceinline__ unsigned cluster_addr(const void* p, int rank) {
    unsigned a;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n"
                 : "=r"(a) : "r"((unsigned)__cvta_generic_to_shared(p)), "r"(rank));
    return a;
}
__device__ __forceinline__ float ld_cluster(unsigned a) {
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(a) : "memory");
    return v;
}
__device__ __forceinline__ float4 ld_cluster4(unsigned a) {
    float4 v;
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(a) : "memory");
    return v;
}
#else
// no clusters before 9.0, nor in the CPU emulation: no cluster kernel is instantiated
// there (kernels.runs_on); these stand-ins keep the rest of the source compiling
#define SKV_CLUSTER(n)
#ifdef FLASHSIM_HOST
#define SKV_NO_CLUSTER() std::abort()
#else
#define SKV_NO_CLUSTER() __trap()
#endif
__device__ __forceinline__ void cluster_arrive() { SKV_NO_CLUSTER(); }
__device__ __forceinline__ void cluster_wait() { SKV_NO_CLUSTER(); }
__device__ __forceinline__ unsigned cluster_addr(const void*, int) { SKV_NO_CLUSTER(); return 0; }
__device__ __forceinline__ float ld_cluster(unsigned) { SKV_NO_CLUSTER(); return 0.0f; }
__device__ __forceinline__ float4 ld_cluster4(unsigned) {
    SKV_NO_CLUSTER();
    return make_float4(0.0f, 0.0f, 0.0f, 0.0f);
}
#endif

// The merge of a cluster's CL parts, spread over its CTAs: each part's partial (O
// normalised by its own ℓ, fp32, rows × D, and L) sits in that part's shared memory; CTA
// `rank` takes its share of the tile's rows × D/4 float4 columns, a thread per column
// loading the CL parts' L and float4 of O at once (one round trip over the cluster's
// network, where the merge through memory waits for a fence, an atomic and L2 round
// trips), then O = Σ_p exp(L_p − L) O_p, L = log Σ_p exp(L_p). Ends with the cluster's
// barrier: every part keeps its shared memory until all have read it.
template <typename T, int D, int CL>
__device__ __forceinline__ void combine_cluster(const float* sPO, const float* sPL, T* O, float* L,
                                                int i0, int rows, int b, int kvh, int G, int Nq,
                                                int heads, int rank, int tid,
                                                unsigned long long* io) {
    constexpr int C4 = D / 4;
    const int n = rows * C4, x0 = n * rank / CL, x1 = n * (rank + 1) / CL;
    COUNT_IO(io, IO_O_W, (long long)(x1 - x0) * 4 * sizeof(T));       // SRAM→HBM: O_i, a share
    COUNT_IO(io, IO_L_W, (long long)((x1 + C4 - 1) / C4 - (x0 + C4 - 1) / C4) * 4);  // L of its rows
    for (int x = x0 + tid; x < x1; x += skv::THREADS) {
        const int r = x / C4, c = (x % C4) * 4;
        float lv[CL];
        float4 ov[CL];
#pragma unroll
        for (int u = 0; u < CL; ++u) {                    // the loads first, all of them
            lv[u] = ld_cluster(cluster_addr(sPL + r, u));
            ov[u] = ld_cluster4(cluster_addr(sPO + r * D + c, u));
        }
        float mx = neg_inf<float>();
#pragma unroll
        for (int u = 0; u < CL; ++u) mx = fmaxf(mx, lv[u]);
        float sum = 0.0f, acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (!is_neg_inf(mx)) {                            // a row with no key: O = 0
#pragma unroll
            for (int u = 0; u < CL; ++u) {
                const float w = expf(lv[u] - mx);         // 0 for a part without keys
                sum += w;
                acc[0] += w * ov[u].x; acc[1] += w * ov[u].y; acc[2] += w * ov[u].z; acc[3] += w * ov[u].w;
            }
        }
        const int q = i0 + r;
        if (c == 0) L[((long long)b * heads + kvh * G + q % G) * Nq + q / G] = sum > 0.0f ? mx + logf(sum) : neg_inf<float>();
        const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
        T* dst = O + (((long long)b * Nq + q / G) * heads + kvh * G + q % G) * D + c;
#pragma unroll
        for (int e = 0; e < 4; ++e) dst[e] = from_acc<T>(acc[e] * inv);
    }
    cluster_arrive();
    cluster_wait();
}

// -- split-KV attention --------------------------------------------------------------------

// The split kernels' parameters, and the body's arguments from them
#define SKV_PARAMS                                                                              \
    const T* __restrict__ Q, const T* __restrict__ Kc, const T* __restrict__ Vc,               \
    const int* __restrict__ block_table, const int* __restrict__ seqlens, T* __restrict__ O,   \
    float* __restrict__ L, float* __restrict__ Osplit, float* __restrict__ Lsplit,             \
    int* __restrict__ sem, int Nq, int heads, int kv_heads, int page_rows, int max_pages,      \
    int num_pages, int causal, float scale, float scale_log2, unsigned long long* io
#define SKV_ARGS Q, Kc, Vc, block_table, seqlens, O, L, Osplit, Lsplit, sem, Nq, heads,         \
    kv_heads, page_rows, max_pages, num_pages, causal, scale, scale_log2, io

// The body of both split kernels: splitkv_fwd_tc (CL = 1: partials through memory, the
// last part merges) and splitkv_fwd_tc_cl (the s = CL parts of a Q tile are one cluster
// and merge through distributed shared memory).
template <typename T, int D, int WM, int CL>
__device__ __forceinline__ void splitkv_body(SKV_PARAMS) {
    using namespace skv;
    constexpr int WN = WARPS / WM;            // key groups: each warp's share of a tile
    constexpr int KW = Bc / WN;               // keys per warp per tile (16, 32 or 64)
    constexpr int NT = KW / 8;                // its n-tiles of S
    constexpr int Br = 16 * WM;               // packed query rows per Q tile
    constexpr int CH = D / 8;                 // 16-byte chunks per row
    constexpr int STAGES = stages<WM>();      // K/V tiles in flight
    constexpr int RPI = THREADS / CH;         // rows per load pass
    static_assert(KW % 16 == 0, "each warp's keys must be whole k-steps of P V");

    extern __shared__ __align__(128) unsigned char smem_raw[];
    T* sQ = reinterpret_cast<T*>(smem_raw);                   // Br · D
    T* sK = sQ + Br * D;                                      // STAGES · Bc · D
    T* sV = sK + STAGES * Bc * D;                             // STAGES · Bc · D
    int* sPage = reinterpret_cast<int*>(sV + STAGES * Bc * D);        // PAGE_CHUNK
    float* sM = reinterpret_cast<float*>(sPage + PAGE_CHUNK);        // WN · Br
    float* sL = sM + WN * Br;                                        // WN · Br
    float* sW = sL + WN * Br;                                        // WN · Br
    float* sO = reinterpret_cast<float*>(sK);   // WN · Br · D, over the K/V tiles at the end
    // the part's partial (cluster): Br · D, then its L: Br, also over the K/V tiles; with
    // one key group its O is the partial, weighed in place (each value by its thread)
    constexpr int PO = WN == 1 ? 0 : WN * Br * D;
    float* sPO = sO + PO;
    float* sPL = sPO + Br * D;
    static_assert(CL == 1 || (PO + Br * D + Br) * 4 <= 2 * STAGES * Bc * D * (int)sizeof(T),
                  "the merge's buffers fit in the K/V stages");

    const int s = gridDim.x, p = blockIdx.x, i = blockIdx.y;
    const int z = blockIdx.z, b = z / kv_heads, kvh = z % kv_heads;
    const int G = heads / kv_heads, M = Nq * G;
    const int i0 = i * Br, rows = min(Br, M - i0);
    const int Lk = seqlens[b];
    const Part part = part_of(i0, i0 + rows, G, Lk, Nq, causal != 0, p, s);
    // an empty part: no partial, no work; but a Q tile that sees no key at all still
    // writes O = 0 and L = −∞, once (the combine's job, done here as nothing is merged).
    // In a cluster (n is the same for all its parts) an empty part of a tile with keys
    // stays for the merge's barriers, its partial empty (L = −∞)
    const bool empty = part.ja == part.jz;
    if (CL > 1 ? part.n == 0 && p != 0 : s > 1 && empty && !(part.n == 0 && p == 0)) return;

    const long long row_stride = (long long)kv_heads * D;
    // packed row r → (position r / G, head kvh·G + r mod G)
    auto q_offset = [&](int r) {
        return (((long long)b * Nq + r / G) * heads + kvh * G + r % G) * D;
    };
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp / WN, wn = warp % WN;
    const int grp = lane >> 2, tig = lane & 3;

    if (CL > 1 ? part.n == 0 : empty) {   // the tile sees no key: O = 0, L = −∞ (flash2)
        for (int x = tid; x < rows * D; x += THREADS)
            O[q_offset(i0 + x / D) + x % D] = from_acc<T>(0.0f);
        for (int r = tid; r < rows; r += THREADS)
            L[((long long)b * heads + kvh * G + (i0 + r) % G) * Nq + (i0 + r) / G] = neg_inf<float>();
        COUNT_IO(io, IO_O_W, (long long)rows * D * sizeof(T));       // SRAM→HBM: O_i (Br·d)
        COUNT_IO(io, IO_L_W, (long long)rows * 4);                   // SRAM→HBM: L_i (Br)
        return;
    }

    const int key_a = part.ja * Bc, key_z = min(Lk, part.jz * Bc);
    if (CL == 1 || !empty) {
        COUNT_IO(io, IO_Q_R, (long long)rows * D * sizeof(T));             // HBM→SRAM: Q_i (Br·d)
        COUNT_IO(io, IO_K_R, (long long)(key_z - key_a) * D * sizeof(T));  // HBM→SRAM: K_j, j ∈ part
        COUNT_IO(io, IO_V_R, (long long)(key_z - key_a) * D * sizeof(T));  // HBM→SRAM: V_j, j ∈ part
        if (block_table != nullptr)   // each page of the part's keys: its table entry, once
            COUNT_IO(io, IO_block_table_R, (long long)((key_z - 1) / page_rows - key_a / page_rows + 1) * 4);
    }

    Pages pages{block_table ? block_table + (long long)b * max_pages : nullptr, b, page_rows,
                num_pages, sPage, 0};
    int staged_end = key_a / page_rows;          // pages [base, staged_end) are in sPage
    pages.base = staged_end;

    // Pages of keys [c0, c1) into sPage, keeping the ones already there. Called by every
    // thread with the same arguments (a uniform branch around its barriers).
    auto stage_pages = [&](int c0, int c1) {
        if (!pages.table) return;
        const int need = (c1 - 1) / page_rows;
        if (need < staged_end) return;
        const int base = c0 / page_rows;          // the tile's first page starts the chunk
        const int x = base + tid;
        int id = 0;
        if (x < staged_end) id = sPage[x - pages.base];                  // staged already
        else if (x <= (key_z - 1) / page_rows) id = pages.table[x];     // HBM→SRAM: table
        __syncthreads();
        sPage[tid] = id;
        pages.base = base;
        staged_end = min(base + PAGE_CHUNK, (key_z - 1) / page_rows + 1);
        __syncthreads();
    };

    // pages of a multiple of Bc rows (and a contiguous cache whose capacity is one) hold
    // whole K/V tiles, as tiles start at multiples of Bc
    const bool one_page = page_rows % Bc == 0;
    // K_j, V_j rows [j·Bc, …) of the sequence into stage `st`; rows past Lk are zeros
    auto load_kv = [&](int j, int st) {
        const int c0 = j * Bc;
        stage_pages(c0, min(Lk, c0 + Bc));
        T* k = sK + st * Bc * D;
        T* v = sV + st * Bc * D;
        const int c = tid % CH, r0 = tid / CH;
        if (one_page) {
            // the tile's rows are rows c0 … of one page: its offset found once (one
            // division and one staged id per tile, not one per row), the rows at fixed
            // steps from it. The loads wait on these addresses at every tile: found per
            // row, they made GQA's 64-row tiles take 1.11–1.38× as long (NOTES.md v29)
            const long long first = c0 < Lk ? pages.row_offset(c0, (int)row_stride) : -1;
#pragma unroll
            for (int it = 0; it < Bc / RPI; ++it) {
                const int r = r0 + it * RPI;
                const bool ok = first >= 0 && c0 + r < Lk;
                const long long off = ok ? first + (long long)r * row_stride + (long long)kvh * D + c * 8 : 0;
                cp_async16(k + swz<D>(r, c), Kc + off, ok);
                cp_async16(v + swz<D>(r, c), Vc + off, ok);
            }
            return;
        }
#pragma unroll
        for (int it = 0; it < Bc / RPI; ++it) {
            const int r = r0 + it * RPI, key = c0 + r;
            long long off = key < Lk ? pages.row_offset(key, (int)row_stride) : -1;
            const bool ok = off >= 0;
            off = ok ? off + (long long)kvh * D + c * 8 : 0;
            cp_async16(k + swz<D>(r, c), Kc + off, ok);
            cp_async16(v + swz<D>(r, c), Vc + off, ok);
        }
    };

    // Q_i: packed rows gathered from q, zeros past the last row (none for a cluster's
    // empty part, which runs no tile)
    for (int x = CL > 1 && empty ? Br * CH : tid; x < Br * CH; x += THREADS) {
        const int r = x / CH, c = x % CH;
        const bool ok = r < rows;
        cp_async16(sQ + swz<D>(r, c), Q + (ok ? q_offset(i0 + r) + c * 8 : 0), ok);
    }
    cp_async_commit();
    const int ntiles = part.jz - part.ja;
#pragma unroll
    for (int t = 0; t < STAGES - 1; ++t) {
        if (t < ntiles) load_kv(part.ja + t, t);
        cp_async_commit();
    }
    cp_async_wait<STAGES - 1>();
    __syncthreads();

    // Q_i's A fragments, in registers for the whole loop
    unsigned qf[D / 16][4];
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
        const int q = lane >> 3;
        const int r = wm * 16 + (q & 1) * 8 + (lane & 7);
        ldmatrix_x4(qf[ks], sQ + swz<D>(r, ks * 2 + (q >> 1)));
    }

    float o[D / 8][4];
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;
    float m[2] = {neg_inf<float>(), neg_inf<float>()}, l[2] = {0.0f, 0.0f};
    // the lowest row of the tile sees the fewest keys: tiles wholly below its last
    // visible key need no mask
    const int all_see = causal ? min(Lk - 1, i0 / G + Lk - Nq) : Lk - 1;
    const int row_a = i0 + wm * 16 + grp;          // packed rows of c[0..1] and c[2..3]

    for (int t = 0; t < ntiles; ++t) {
        const int j = part.ja + t, st = t % STAGES;
        cp_async_wait<STAGES - 2>();     // tile j has landed (this thread's copies) …
        __syncthreads();                 // … everyone's, and tile j − 1's stage is free
        if (t + STAGES - 1 < ntiles) load_kv(j + STAGES - 1, (t + STAGES - 1) % STAGES);
        cp_async_commit();

        const T* k = sK + st * Bc * D;
        const T* v = sV + st * Bc * D;
        // S = Q_i K_jᵀ for this warp's 16 rows and KW keys
        float sc[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
#pragma unroll
            for (int np = 0; np < NT / 2; ++np) {
                const int q = lane >> 3;
                const int r = wn * KW + np * 16 + (q >> 1) * 8 + (lane & 7);
                unsigned kf[4];
                ldmatrix_x4(kf, k + swz<D>(r, ks * 2 + (q & 1)));
                mma16816<T>(sc[2 * np], qf[ks], kf);
                mma16816<T>(sc[2 * np + 1], qf[ks], kf + 2);
            }
        }
        // the mask, in the tiles that cross the sequence's end or the causal edge
        if ((j + 1) * Bc - 1 > all_see) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = j * Bc + wn * KW + nt * 8 + 2 * tig + (e & 1);
                    const int r = row_a + 8 * (e >> 1);
                    const bool sees = key < Lk && (!causal || key <= r / G + Lk - Nq);
                    if (!sees) sc[nt][e] = neg_inf<float>();
                }
        }
        // online softmax over this warp's keys (rows grp and grp + 8)
        float mx[2] = {m[0], m[1]};
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            mx[0] = fmaxf(mx[0], fmaxf(sc[nt][0], sc[nt][1]));
            mx[1] = fmaxf(mx[1], fmaxf(sc[nt][2], sc[nt][3]));
        }
        quad_max(mx[0], mx[1]);
        float alpha[2], base[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            // a row with no visible key yet keeps m = −∞: exponents against 0, P = 0
            base[h] = is_neg_inf(mx[h]) ? 0.0f : mx[h] * scale_log2;
            alpha[h] = ex2(m[h] * scale_log2 - base[h]);
            m[h] = mx[h];
            l[h] *= alpha[h];
        }
#pragma unroll
        for (int nt = 0; nt < D / 8; ++nt) {
            o[nt][0] *= alpha[0]; o[nt][1] *= alpha[0];
            o[nt][2] *= alpha[1]; o[nt][3] *= alpha[1];
        }
        // P (rounded to T) straight into the A fragments of O += P V_j
#pragma unroll
        for (int kk = 0; kk < KW / 16; ++kk) {
            float pv[2][4];
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    pv[h][e] = ex2(sc[2 * kk + h][e] * scale_log2 - base[e >> 1]);
                    l[e >> 1] += pv[h][e];
                }
            const unsigned pa[4] = {pack<T>(pv[0][0], pv[0][1]), pack<T>(pv[0][2], pv[0][3]),
                                    pack<T>(pv[1][0], pv[1][1]), pack<T>(pv[1][2], pv[1][3])};
#pragma unroll
            for (int dp = 0; dp < D / 16; ++dp) {
                const int q = lane >> 3;
                const int r = wn * KW + kk * 16 + (q & 1) * 8 + (lane & 7);
                unsigned vf[4];
                ldmatrix_x4_trans(vf, v + swz<D>(r, dp * 2 + (q >> 1)));
                mma16816<T>(o[2 * dp], pa, vf);
                mma16816<T>(o[2 * dp + 1], pa, vf + 2);
            }
        }
    }
    cp_async_wait<0>();
    __syncthreads();                     // the K/V stages are free for the merge

    // merge the WN key groups of each row: m, ℓ and the unnormalised O through smem
    quad_sum(l[0], l[1]);
    const int lr = wm * 16 + grp;        // local rows lr and lr + 8
    if (tig == 0) {
        sM[wn * Br + lr] = m[0];
        sM[wn * Br + lr + 8] = m[1];
        sL[wn * Br + lr] = l[0];
        sL[wn * Br + lr + 8] = l[1];
    }
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) {
        const int col = nt * 8 + 2 * tig;
        float* o0 = sO + (wn * Br + lr) * D + col;
        o0[0] = o[nt][0];
        o0[1] = o[nt][1];
        o0[8 * D] = o[nt][2];
        o0[8 * D + 1] = o[nt][3];
    }
    __syncthreads();

    // row r's total: m* = max of the groups' m, ℓ* = Σ_w ℓ_w·2^((m_w − m*)·scale·log2 e);
    // each group's O weighs 2^((m_w − m*)·scale·log2 e) / ℓ* (0 for a row with no key)
    const long long slot = ((long long)p * gridDim.z + z) * M;   // this part's partials
    for (int r = tid; r < rows; r += THREADS) {
        float mstar = neg_inf<float>();
#pragma unroll
        for (int u = 0; u < WN; ++u) mstar = fmaxf(mstar, sM[u * Br + r]);
        float lsum = 0.0f;
#pragma unroll
        for (int u = 0; u < WN; ++u) {
            const float w = is_neg_inf(mstar) ? 0.0f : ex2((sM[u * Br + r] - mstar) * scale_log2);
            sW[u * Br + r] = w;
            lsum += w * sL[u * Br + r];
        }
#pragma unroll
        for (int u = 0; u < WN; ++u) sW[u * Br + r] = lsum > 0.0f ? sW[u * Br + r] / lsum : 0.0f;
        const float lse = lsum > 0.0f ? mstar * scale + logf(lsum) : neg_inf<float>();
        if (CL > 1) sPL[r] = lse;
        else if (s == 1) L[((long long)b * heads + kvh * G + (i0 + r) % G) * Nq + (i0 + r) / G] = lse;
        else Lsplit[slot + i0 + r] = lse;
    }
    __syncthreads();
    for (int x = tid; x < rows * D; x += THREADS) {
        const int r = x / D, col = x % D;
        float val = 0.0f;
#pragma unroll
        for (int u = 0; u < WN; ++u) val += sW[u * Br + r] * sO[(u * Br + r) * D + col];
        if (CL > 1) sPO[x] = val;
        else if (s == 1) O[q_offset(i0 + r) + col] = from_acc<T>(val);
        else Osplit[(slot + i0 + r) * D + col] = val;
    }
    if constexpr (CL > 1) {
        // every part's partial is in its CTA's shared memory once the cluster has met;
        // then each part merges its share of the tile, reading the others' (NOTES.md v35)
        cluster_arrive();
        cluster_wait();
        combine_cluster<T, D, CL>(sPO, sPL, O, L, i0, rows, b, kvh, G, Nq, heads, p, tid, io);
        return;
    }
    if (s == 1) {
        COUNT_IO(io, IO_O_W, (long long)rows * D * sizeof(T));       // SRAM→HBM: O_i (Br·d)
        COUNT_IO(io, IO_L_W, (long long)rows * 4);                   // SRAM→HBM: L_i (Br)
        return;
    }
    COUNT_IO(io, IO_Osplit_W, (long long)rows * D * 4);              // SRAM→HBM: Osplit_ip (fp32)
    COUNT_IO(io, IO_Lsplit_W, (long long)rows * 4);                  // SRAM→HBM: Lsplit_ip (fp32)

    // The combine, by whichever part of this Q tile finishes last: its partials and the
    // others' are all in memory then (each CTA fences its writes before it counts itself
    // in). No second launch, and the merge overlaps the other tiles' parts. It reads the
    // partials back from memory like a separate combine kernel would, so it moves what
    // flashsim.splitkv's combine moves.
    __shared__ int last;
    __threadfence();
    __syncthreads();
    int* done = sem + (long long)i * gridDim.z + z;
    const int parts = min(s, part.n);
    if (tid == 0) last = atomicAdd(done, 1) == parts - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    COUNT_IO(io, IO_Osplit_R, (long long)parts * rows * D * 4);      // HBM→SRAM: Osplit_ip
    COUNT_IO(io, IO_Lsplit_R, (long long)parts * rows * 4);          // HBM→SRAM: Lsplit_ip
    COUNT_IO(io, IO_O_W, (long long)rows * D * sizeof(T));           // SRAM→HBM: O_i
    COUNT_IO(io, IO_L_W, (long long)rows * 4);                       // SRAM→HBM: L_i
    if (WM == 1 && rows * (D / 4) <= THREADS)   // (the 16-row kernel's: the others keep theirs)
        combine_few<T, D>(Osplit, Lsplit, O, L, (long long)z * M + i0, (long long)gridDim.z * M,
                          i0, rows, b, kvh, G, Nq, heads, part.n, s, tid);
    else
        combine_tile<T, D>(Osplit, Lsplit, O, L, sM, (long long)z * M + i0, (long long)gridDim.z * M,
                           i0, rows, b, kvh, G, Nq, heads, part.n, s, tid);
    if (tid == 0) *done = 0;        // ready for the next launch
}

// two CTAs per SM (their K/V stages fit beside each other): the bound lets ptxas use up
// to 255 registers, where left to itself it capped the 32-row tile at 168 and spilled
template <typename T, int D, int WM>
__global__ void __launch_bounds__(skv::THREADS, 2)
splitkv_fwd_tc(SKV_PARAMS) {
    splitkv_body<T, D, WM, 1>(SKV_ARGS);
}

// A Q tile's s = CL parts as one thread block cluster (compute capability 9.0): the
// grid's x axis is the cluster, and the parts merge through distributed shared memory;
// Osplit, Lsplit and sem are not used.
template <typename T, int D, int WM, int CL>
__global__ void SKV_CLUSTER(CL) __launch_bounds__(skv::THREADS, 2)
splitkv_fwd_tc_cl(SKV_PARAMS) {
    splitkv_body<T, D, WM, CL>(SKV_ARGS);
}
