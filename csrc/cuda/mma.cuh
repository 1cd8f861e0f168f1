// Warp-level tensor-core primitives (mma.sync, sm_80+) shared by the tensor-core kernels. Torch-free.
#pragma once
#include "common.cuh"

namespace lora_ops::cuda {

__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], const void* smem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}

template <class T>
__device__ __forceinline__ void mma16816(float d[4], const uint32_t a[4], const uint32_t b[2]) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}

// Two floats -> packed pair of T (hi), and the rounding remainders -> packed pair (lo); an infinite hi has no
// remainder (inf - inf would make the pair's product NaN where the float's is infinite).
template <class T>
__device__ __forceinline__ void split_pack(float2 v, uint32_t* hi, uint32_t* lo) {
  const T h0 = from_f32<T>(v.x), h1 = from_f32<T>(v.y);
  const float r0 = isinf(to_f32(h0)) ? 0.f : v.x - to_f32(h0), r1 = isinf(to_f32(h1)) ? 0.f : v.y - to_f32(h1);
  const T l0 = from_f32<T>(r0), l1 = from_f32<T>(r1);
  *hi = (uint32_t)__builtin_bit_cast(uint16_t, h0) | ((uint32_t)__builtin_bit_cast(uint16_t, h1) << 16);
  *lo = (uint32_t)__builtin_bit_cast(uint16_t, l0) | ((uint32_t)__builtin_bit_cast(uint16_t, l1) << 16);
}

}  // namespace lora_ops::cuda
