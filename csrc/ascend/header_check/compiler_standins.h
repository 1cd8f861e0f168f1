// What the AscendC compiler provides to asc-devkit's headers in their device mode, for the header check
// (scripts/check_ascend_headers.py compiles the kernels with g++ against those headers; their CPU-debug mode needs
// CANN's tikicpulib instead): the address-space and kernel qualifiers (empty), the 16-bit float types (conversions
// only; nothing is computed), the compiler's enums, and its intrinsics (copy_gm_to_ubuf, mad, set_flag, ...), each
// accepting any arguments. The script declares the intrinsics from the compiler's errors, only for names that
// asc-devkit's own headers call, so a misnamed or mistyped API call in a kernel still fails the check.
#pragma once
#include <cstdint>
#ifdef LORA_OPS_ASCEND_STUB_SOURCE
// The spellings the AscendC compiler's preprocessor leaves for CANN's launch-stub generator to find a kernel and its
// global-memory parameters by (the script's launch check preprocesses with these, and compiles without them).
#define __gm__ __attribute__((cce_global))
#define __global__ __attribute__((cce_kernel))
#define __aicore__ [aicore]
#else
#define __gm__
#define __global__
#define __aicore__
#endif
#define __ubuf__
#define __cbuf__
#define __ca__
#define __cb__
#define __cc__
#define __fbuf__
#define __ssbuf__
#define __host__
#define __host_aicore__
#define __inout_pipe__(pipe)
#define __in_pipe__(pipe)
#define __out_pipe__(pipe)
#define __sync_alias__
#define __sync_in__
#define __sync_out__
#define __no_alias__
#define __disable_kernel_type_autoinfer__
// A 16-bit float type: storage and conversions only (nothing is computed).
#define LORA_OPS_STANDIN_FLOAT16(name) \
  struct name {                        \
    uint16_t bits;                     \
    name() = default;                  \
    name(float) {}                     \
    name(double) {}                    \
    name(int) {}                       \
    operator float() const { return 0; } \
  };
LORA_OPS_STANDIN_FLOAT16(half)
LORA_OPS_STANDIN_FLOAT16(bfloat16_t)
struct hifloat8_t {
  uint8_t bits;
};
#include <cassert>
#include <csignal>
#include <cstddef>
#include <iostream>
#include <vector>

// What a value-returning intrinsic gives: converts to anything, compares and combines with any number.
struct AnyValue {
  template <class T>
  operator T() const { return T(); }
};
#define LORA_OPS_ANY_ARITHMETIC(op)                                \
  template <class T> inline T operator op(AnyValue, T t) { return t; } \
  template <class T> inline T operator op(T t, AnyValue) { return t; }
#define LORA_OPS_ANY_COMPARISON(op)                                     \
  template <class T> inline bool operator op(AnyValue, T) { return false; } \
  template <class T> inline bool operator op(T, AnyValue) { return false; }
LORA_OPS_ANY_ARITHMETIC(+)
LORA_OPS_ANY_ARITHMETIC(-)
LORA_OPS_ANY_ARITHMETIC(*)
LORA_OPS_ANY_ARITHMETIC(/)
LORA_OPS_ANY_ARITHMETIC(&)
LORA_OPS_ANY_ARITHMETIC(|)
LORA_OPS_ANY_ARITHMETIC(<<)
LORA_OPS_ANY_ARITHMETIC(>>)
LORA_OPS_ANY_COMPARISON(<)
LORA_OPS_ANY_COMPARISON(>)
LORA_OPS_ANY_COMPARISON(<=)
LORA_OPS_ANY_COMPARISON(>=)
LORA_OPS_ANY_COMPARISON(==)
LORA_OPS_ANY_COMPARISON(!=)

#define LORA_OPS_INTRINSIC(name) \
  template <class... A>          \
  inline AnyValue name(A&&...) { return {}; }
#define LORA_OPS_INTRINSIC_VOID(name) \
  template <class... A>               \
  inline void name(A&&...) {}
#include "intrinsics.h"  // written by the script

// The compiler's enums the headers name (values are irrelevant to a type check).
enum pipe_t { PIPE_S, PIPE_V, PIPE_M, PIPE_MTE1, PIPE_MTE2, PIPE_MTE3, PIPE_ALL, PIPE_MTE4, PIPE_MTE5, PIPE_V2,
              PIPE_FIX, PIPE_NUM, PIPE_MTE };
enum event_t { EVENT_ID0, EVENT_ID1, EVENT_ID2, EVENT_ID3, EVENT_ID4, EVENT_ID5, EVENT_ID6, EVENT_ID7 };
enum class QuantMode_t { NoQuant, F322F16, F322BF16, DEQF16, DEQS16, VDEQF16, VDEQS16, REQ4, REQ8, VREQ4, VREQ8,
                         QF322B8_PRE, VQF322B8_PRE, QF322F16_PRE, VQF322F16_PRE, QF322BF16_PRE, VQF322BF16_PRE,
                         QF322F32_PRE, VQF322F32_PRE, QF162B8_PRE, VQF162B8_PRE, QF162S16_PRE, VQF162S16_PRE,
                         QF162S4_PRE, VQF162S4_PRE, QS322BF16_PRE, VQS322BF16_PRE, QF322FP8_PRE, VQF322FP8_PRE,
                         QF322HIF8_PRE, VQF322HIF8_PRE, QF322HIF8_PRE_HYBRID, VQF322HIF8_PRE_HYBRID };
enum class pad_t { PAD_NONE };
enum class cache_line_t { SINGLE_CACHE_LINE, ENTIRE_DATA_CACHE };
enum class dcci_dst_t { CACHELINE_ALL, CACHELINE_UB, CACHELINE_OUT, CACHELINE_ATOMIC };
enum addr_cal_mode_t { inc };
enum class Order_t { VALUE_INDEX, INDEX_VALUE, ONLY_VALUE, ONLY_INDEX };
enum mem_t { L1, L0A, L0B, L0C, UB, BT };
enum class bm_t {};
enum class atomic_type_t {};
enum class atomic_op_t {};
enum class vpart_t {};
enum class mem_dsb_t {};
