// Warp-level matrix operations for the kernels that the CPU emulation also runs
// (splitkv_tc.cu, flash2_tc.cu): mma.sync m16n8k16 and ldmatrix, each with a host form built on the
// emulator's warp exchange (host_emu.h), so the same source runs on the GPU and, lane by
// lane, on the CPU.
//
// Fragment layouts (PTX ISA, mma.m16n8k16 with .f16/.bf16 inputs, fp32 accumulators);
// lane = 4·grp + tig:
//   A (16×16, row-major)  a[0]: (grp, 2tig..2tig+1)     a[1]: (grp+8, 2tig..)
//                         a[2]: (grp, 2tig+8..2tig+9)   a[3]: (grp+8, 2tig+8..)
//   B (16×8, k × n)       b[0]: (k = 2tig..2tig+1, n = grp)   b[1]: (k = 2tig+8.., n = grp)
//   C (16×8)              c[0..1]: (grp, 2tig..2tig+1)   c[2..3]: (grp+8, 2tig..)
// ldmatrix.x4: lanes 8q..8q+7 give the 8 row addresses (16 bytes each) of matrix q; lane
// l receives r[q] = row l/4, elements 2(l%4), 2(l%4)+1 of matrix q (.trans: elements
// (2(l%4), l/4) and (2(l%4)+1, l/4), i.e. matrix q transposed).
#pragma once

#include "tensor_core.cuh"

#ifndef FLASHSIM_HOST

template <typename T> __device__ __forceinline__ void mma16816(float* c, const unsigned* a,
                                                              const unsigned* b);
template <> __device__ __forceinline__ void mma16816<__half>(float* c, const unsigned* a,
                                                            const unsigned* b) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <> __device__ __forceinline__ void mma16816<__nv_bfloat16>(float* c, const unsigned* a,
                                                                   const unsigned* b) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// the row address as a shared-space address (flash2_tc.cu's swizzle arithmetic works on
// those), or as a pointer
__device__ __forceinline__ void ldmatrix_x4(unsigned* r, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned* r, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4(unsigned* r, const void* row) {
    ldmatrix_x4(r, smem_addr(row));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned* r, const void* row) {
    ldmatrix_x4_trans(r, smem_addr(row));
}

#else  // FLASHSIM_HOST: the same operations over the warp's exchange slots

namespace emu {
template <typename T> inline float half_of(unsigned reg, int hi) {
    T x;
    std::memcpy(&x, reinterpret_cast<const char*>(&reg) + 2 * hi, 2);
    return to_acc<float>(x);
}
inline unsigned bits16(const void* row, int e) {
    unsigned short x;
    std::memcpy(&x, static_cast<const char*>(row) + 2 * e, 2);
    return x;
}
}  // namespace emu

template <typename T> inline void mma16816(float* c, const unsigned* a, const unsigned* b) {
    struct Ops { unsigned a[4], b[2]; } mine{{a[0], a[1], a[2], a[3]}, {b[0], b[1]}};
    const auto slots = emu::warp_exchange(&mine, sizeof mine);
    const int lane = emu::block().current % 32, grp = lane >> 2, tig = lane & 3;
    auto A = [&](int row, int k) {
        const Ops o = emu::lane_value<Ops>(slots, (row % 8) * 4 + (k % 8) / 2);
        return emu::half_of<T>(o.a[(row >= 8) + 2 * (k >= 8)], k % 2);
    };
    auto B = [&](int k, int n) {
        const Ops o = emu::lane_value<Ops>(slots, n * 4 + (k % 8) / 2);
        return emu::half_of<T>(o.b[k >= 8], k % 2);
    };
    for (int e = 0; e < 4; ++e) {
        const int row = grp + 8 * (e >> 1), n = 2 * tig + (e & 1);
        float acc = 0.0f;
        for (int k = 0; k < 16; ++k) acc += A(row, k) * B(k, n);
        c[e] += acc;
    }
}

inline void ldmatrix_x4_impl(unsigned* r, const void* row, bool trans) {
    const auto slots = emu::warp_exchange(&row, sizeof row);
    const int l = emu::block().current % 32;
    for (int q = 0; q < 4; ++q) {
        if (!trans) {
            const void* p = emu::lane_value<const void*>(slots, 8 * q + l / 4);
            r[q] = emu::bits16(p, 2 * (l % 4)) | emu::bits16(p, 2 * (l % 4) + 1) << 16;
        } else {
            const void* p0 = emu::lane_value<const void*>(slots, 8 * q + 2 * (l % 4));
            const void* p1 = emu::lane_value<const void*>(slots, 8 * q + 2 * (l % 4) + 1);
            r[q] = emu::bits16(p0, l / 4) | emu::bits16(p1, l / 4) << 16;
        }
    }
}
inline void ldmatrix_x4(unsigned* r, const void* row) { ldmatrix_x4_impl(r, row, false); }
inline void ldmatrix_x4_trans(unsigned* r, const void* row) { ldmatrix_x4_impl(r, row, true); }
inline void ldmatrix_x4(unsigned* r, unsigned addr) { ldmatrix_x4_impl(r, smem_ptr(addr), false); }
inline void ldmatrix_x4_trans(unsigned* r, unsigned addr) {
    ldmatrix_x4_impl(r, smem_ptr(addr), true);
}

#endif
