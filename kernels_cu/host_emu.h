// host_emu.h: SIMT kernels of the reference rung run on the CPU, for machines with no
// GPU (flashsim.gpu.emulated()). The kernel source is compiled unchanged by a host C++
// compiler; this header stands in for what CUDA gives it.
//
// Execution model: the blocks of a launch run one after another, in blockIdx order
// (x fastest, as a GPU dispatches them); the threads of a block run as fibers on one OS
// thread, each until it reaches __syncthreads() or returns, and the barrier opens when
// every thread still running has reached it. So results are deterministic, atomics need
// no hardware, and a block that waits on an earlier block (the deterministic backward's
// turns) finds it finished, or reports the violated order instead of hanging.
//
// Warp collectives (__shfl_xor_sync, and the mma.sync/ldmatrix stand-ins of warp.cuh)
// are barriers of the warp's 32 threads: each lane leaves its operands in the warp's
// exchange slots and sleeps until every lane of the warp has arrived, then reads what
// the others left. A collective reached by only some lanes (divergence), or while other
// lanes wait at __syncthreads or have returned, is reported as an error.
//
// What it does not model: timing, the memory model's weaker orderings, the asynchrony
// of cp.async (the copy happens when issued, so a read before its wait is not caught),
// inline PTX (kernels guard theirs with FLASHSIM_HOST), and static __shared__ arrays
// beyond one per kernel instance (fine, as blocks run one at a time). Dynamic shared
// memory is filled with 0xFF bytes (NaN) before each block, so a read of shared memory
// the block never wrote shows up in the results.
#pragma once

#include <cuda_fp16.h>   // __half and __nv_bfloat16 have host implementations
#include <cuda_bf16.h>
#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#undef __global__
#undef __device__
#undef __host__
#undef __forceinline__
#undef __shared__
#undef __align__
#undef __launch_bounds__
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static    // the loader rewrites `extern __shared__` to `extern` first
#define __align__(n) __attribute__((aligned(n)))
#define __restrict__ __restrict
#define __launch_bounds__(...)

namespace emu {
struct dim3 { unsigned x = 1, y = 1, z = 1; };
}  // namespace emu

// one OS thread runs every fiber, and the scheduler sets threadIdx before resuming one
inline emu::dim3 threadIdx, blockIdx, blockDim, gridDim;

template <typename A, typename B> inline std::common_type_t<A, B> min(A a, B b) {
    return b < a ? b : a;
}
template <typename A, typename B> inline std::common_type_t<A, B> max(A a, B b) {
    return a < b ? b : a;
}

inline float __fdividef(float a, float b) { return a / b; }
inline float __fmul_rn(float a, float b) { return a * b; }   // (host floats: round to nearest, never fused)
inline float __int_as_float(int x) { float f; std::memcpy(&f, &x, 4); return f; }
inline int __float_as_int(float x) { int i; std::memcpy(&i, &x, 4); return i; }
inline double __longlong_as_double(long long x) { double f; std::memcpy(&f, &x, 8); return f; }

// one OS thread: a read-modify-write is atomic as written, every load sees every store
inline void __threadfence() {}
template <typename T> inline T __ldcg(const T* p) { return *p; }
template <typename T> inline T atomicAdd(T* p, T v) { T old = *p; *p = old + v; return old; }
template <typename T> inline T atomicExch(T* p, T v) { T old = *p; *p = v; return old; }

namespace emu {

struct Fiber {
    ucontext_t ctx;
    bool done = false, waiting = false;   // returned; waiting at __syncthreads
    bool at_warp = false;                 // waiting at a warp collective
    unsigned collectives = 0;             // warp collectives passed (picks the slot set)
};

// Each warp's exchange slots: two sets, used by alternate collectives, so that a lane
// entering the next collective cannot overwrite what a slower lane has yet to read from
// this one (a lane can be at most one collective ahead of any other of its warp).
constexpr int SLOT_BYTES = 64;
struct WarpSlots { alignas(16) unsigned char lane[2][32][SLOT_BYTES]; };

struct Block {
    ucontext_t scheduler;
    std::vector<Fiber> fibers;
    std::vector<std::vector<char>> stacks;
    std::function<void()> body;
    std::vector<WarpSlots> warps;
    int current = 0;
};

inline Block& block() { static Block b; return b; }
// the block's dynamic shared memory (shared-space addresses are offsets from it)
inline unsigned char*& smem_base() { static unsigned char* p = nullptr; return p; }
inline std::string& error() { static std::string e; return e; }

// Record the first error of a launch; the loader raises it once the launch returns.
inline void fail(const std::string& what) { if (error().empty()) error() = what; }

inline void fiber_main() {
    Block& b = block();
    b.body();
    b.fibers[b.current].done = true;   // returns to the scheduler through uc_link
}

inline void syncthreads() {
    Block& b = block();
    b.fibers[b.current].waiting = true;
    swapcontext(&b.fibers[b.current].ctx, &b.scheduler);
}

// A warp collective: leave `bytes` of `mine` in this lane's slot, wait for the warp, and
// return the warp's slots (slot l holds lane l's operands).
inline const unsigned char (*warp_exchange(const void* mine, size_t bytes))[SLOT_BYTES] {
    Block& b = block();
    Fiber& f = b.fibers[b.current];
    const int warp = b.current / 32, lane = b.current % 32, set = f.collectives++ & 1;
    std::memcpy(b.warps[warp].lane[set][lane], mine, bytes);
    f.at_warp = true;
    swapcontext(&f.ctx, &b.scheduler);
    return b.warps[warp].lane[set];
}

template <typename V> inline V lane_value(const unsigned char (*slots)[SLOT_BYTES], int l) {
    V v;
    std::memcpy(&v, slots[l], sizeof(V));
    return v;
}

constexpr size_t STACK_BYTES = 256 * 1024;

// Run one block of `threads` threads, each calling body() with its threadIdx set.
inline void run_block(unsigned threads, const std::function<void()>& body) {
    Block& b = block();
    b.body = body;
    b.fibers.assign(threads, Fiber{});
    if (b.stacks.size() < threads) b.stacks.resize(threads);
    for (unsigned t = 0; t < threads; ++t) {
        if (b.stacks[t].empty()) b.stacks[t].resize(STACK_BYTES);
        Fiber& f = b.fibers[t];
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = b.stacks[t].data();
        f.ctx.uc_stack.ss_size = STACK_BYTES;
        f.ctx.uc_link = &b.scheduler;
        makecontext(&f.ctx, fiber_main, 0);
    }
    b.warps.resize((threads + 31) / 32);
    for (;;) {
        for (unsigned t = 0; t < threads; ++t) {
            Fiber& f = b.fibers[t];
            if (f.done || f.waiting || f.at_warp) continue;
            b.current = (int)t;
            threadIdx = dim3{t % blockDim.x, (t / blockDim.x) % blockDim.y,
                             t / (blockDim.x * blockDim.y)};
            swapcontext(&b.scheduler, &f.ctx);
        }
        // every thread has returned or waits: first release the warps whose lanes all
        // reached a collective, then, when none is left, open the block's barrier
        bool released = false;
        for (unsigned w0 = 0; w0 < threads; w0 += 32) {
            const unsigned w1 = w0 + 32 < threads ? w0 + 32 : threads;
            unsigned at = 0;
            for (unsigned t = w0; t < w1; ++t) at += b.fibers[t].at_warp;
            if (at == 0) continue;
            if (at != w1 - w0)
                fail("warp " + std::to_string(w0 / 32) + ": " + std::to_string(at) +
                     " of its lanes reached a warp collective (shuffle, ldmatrix, mma) "
                     "while the others had returned or waited at __syncthreads; a warp "
                     "collective needs all its lanes");
            for (unsigned t = w0; t < w1; ++t) b.fibers[t].at_warp = false;
            released = true;
        }
        if (released) continue;
        bool live = false;
        for (Fiber& f : b.fibers) {
            if (!f.done) live = true;
            f.waiting = false;
        }
        if (!live) return;
    }
}

// -- kernels by name, called with cuLaunchKernel's argument convention ------------------
using Entry = std::function<void(void**)>;

inline std::map<std::string, Entry>& registry() { static std::map<std::string, Entry> r; return r; }

template <typename... Args, size_t... I>
inline void call(void (*k)(Args...), void** args, std::index_sequence<I...>) {
    k(*static_cast<std::remove_cv_t<std::remove_reference_t<Args>>*>(args[I])...);
}

template <typename... Args> inline Entry entry(void (*k)(Args...)) {
    return [k](void** args) { call(k, args, std::index_sequence_for<Args...>{}); };
}

struct Registered {
    Registered(const char* name, Entry e) { registry()[name] = std::move(e); }
};

}  // namespace emu

inline void __syncthreads() { emu::syncthreads(); }

// __shfl_xor_sync over the full warp (the only mask the kernels use)
template <typename V> inline V __shfl_xor_sync(unsigned mask, V v, int lane_mask) {
    if (mask != 0xffffffffu) emu::fail("__shfl_xor_sync: only the full-warp mask is emulated");
    auto slots = emu::warp_exchange(&v, sizeof(V));
    return emu::lane_value<V>(slots, (emu::block().current % 32) ^ lane_mask);
}

// __any_sync, __all_sync over the full warp (the lazy softmax's vote)
inline int emu_vote(unsigned mask, int pred, bool any) {
    if (mask != 0xffffffffu) emu::fail("warp votes: only the full-warp mask is emulated");
    const int mine = pred != 0;
    auto slots = emu::warp_exchange(&mine, sizeof(int));
    for (int l = 0; l < 32; ++l)
        if ((emu::lane_value<int>(slots, l) != 0) == any) return any;
    return !any;
}
inline int __any_sync(unsigned mask, int pred) { return emu_vote(mask, pred, true); }
inline int __all_sync(unsigned mask, int pred) { return emu_vote(mask, pred, false); }

#define FLASHSIM_EMU_CAT2(a, b) a##b
#define FLASHSIM_EMU_CAT(a, b) FLASHSIM_EMU_CAT2(a, b)
// FLASHSIM_EMU_KERNEL("flash2_fwd<__half>", flash2_fwd<__half>): make a kernel launchable
// by the name the CUDA loader gives it (its NVRTC name expression)
#define FLASHSIM_EMU_KERNEL(name, ...)                                                   \
    static emu::Registered FLASHSIM_EMU_CAT(flashsim_emu_kernel_, __COUNTER__)(          \
        name, emu::entry(&__VA_ARGS__));

// The launch entry point the Python loader calls through ctypes. `args` holds a pointer
// to each kernel argument's value, as cuLaunchKernel's kernelParams do. Returns 0, or
// nonzero with a message in err.
#define FLASHSIM_EMU_DEFINE_LAUNCH(SMEM_NAME, SMEM_BYTES)                                \
    extern "C" __attribute__((visibility("default"))) int flashsim_emu_launch(const char* name, unsigned gx, unsigned gy,       \
                                       unsigned gz, unsigned bx, unsigned by,            \
                                       unsigned bz, unsigned long long smem,             \
                                       void** args, char* err, unsigned long errlen) {   \
        auto& reg = emu::registry();                                                     \
        auto it = reg.find(name);                                                        \
        emu::error().clear();                                                            \
        if (it == reg.end())                                                             \
            emu::fail(std::string("no kernel named ") + name + " in this build");        \
        else if (smem > (SMEM_BYTES))                                                    \
            emu::fail("dynamic shared memory of " + std::to_string(smem) +               \
                      " bytes exceeds the emulated device's " +                          \
                      std::to_string((unsigned long long)(SMEM_BYTES)));                 \
        else if ((unsigned long long)bx * by * bz > 1024 || bx * by * bz == 0)           \
            emu::fail("a block must have 1 to 1024 threads, got " +                      \
                      std::to_string((unsigned long long)bx * by * bz));                 \
        if (emu::error().empty()) {                                                      \
            gridDim = emu::dim3{gx, gy, gz};                                             \
            emu::smem_base() = SMEM_NAME;                                                \
            blockDim = emu::dim3{bx, by, bz};                                            \
            const emu::Entry& k = it->second;                                            \
            for (unsigned z = 0; z < gz; ++z)                                            \
                for (unsigned y = 0; y < gy; ++y)                                        \
                    for (unsigned x = 0; x < gx; ++x) {                                  \
                        blockIdx = emu::dim3{x, y, z};                                   \
                        std::memset(SMEM_NAME, 0xFF, smem);                              \
                        emu::run_block(bx * by * bz, [&] { k(args); });                  \
                    }                                                                    \
        }                                                                                \
        std::snprintf(err, errlen, "%s", emu::error().c_str());                          \
        return emu::error().empty() ? 0 : 1;                                             \
    }
