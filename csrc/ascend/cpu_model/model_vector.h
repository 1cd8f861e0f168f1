// The vector unit of the CPU model. Every vector instruction is `repeatTime` repeats over 8 data blocks of 32
// bytes of its widest operand (256 bytes per repeat); lane e of repeat r of an operand sits at
// (r * repStride + (e / per_block) * blkStride) * 32 bytes + (e % per_block) * sizeof(T). A mask picks lanes per
// repeat: a count of leading lanes, or a 128-bit pattern. The "first count elements" prototypes run the same
// engine in counter mode (contiguous strides, as many repeats as needed).
#pragma once
#include <algorithm>
#include <string>
#include <type_traits>
#include <vector>

#include "model_cube.h"

namespace AscendC {

enum class RoundMode { CAST_NONE = 0, CAST_RINT, CAST_FLOOR, CAST_CEIL, CAST_ROUND, CAST_TRUNC, CAST_ODD, CAST_HYBRID };

struct UnaryRepeatParams {
  UnaryRepeatParams() {}
  UnaryRepeatParams(const uint16_t dstBlkStrideIn, const uint16_t srcBlkStrideIn, const uint8_t dstRepStrideIn,
                    const uint8_t srcRepStrideIn)
      : dstBlkStride(dstBlkStrideIn), srcBlkStride(srcBlkStrideIn), dstRepStride(dstRepStrideIn),
        srcRepStride(srcRepStrideIn) {}
  uint32_t blockNumber = 8;
  uint16_t dstBlkStride = 1;
  uint16_t srcBlkStride = 1;
  uint8_t dstRepStride = 8;
  uint8_t srcRepStride = 8;
};

struct BinaryRepeatParams {
  BinaryRepeatParams() {}
  BinaryRepeatParams(const uint8_t dstBlkStrideIn, const uint8_t src0BlkStrideIn, const uint8_t src1BlkStrideIn,
                     const uint8_t dstRepStrideIn, const uint8_t src0RepStrideIn, const uint8_t src1RepStrideIn)
      : dstBlkStride(dstBlkStrideIn), src0BlkStride(src0BlkStrideIn), src1BlkStride(src1BlkStrideIn),
        dstRepStride(dstRepStrideIn), src0RepStride(src0RepStrideIn), src1RepStride(src1RepStrideIn) {}
  uint32_t blockNumber = 8;
  uint8_t dstBlkStride = 1;
  uint8_t src0BlkStride = 1;
  uint8_t src1BlkStride = 1;
  uint8_t dstRepStride = 8;
  uint8_t src0RepStride = 8;
  uint8_t src1RepStride = 8;
};

namespace cpu_model {

// One operand of a vector instruction: its tensor and strides in 32-byte blocks.
struct VecOperand {
  const LocalRef* ref = nullptr;
  uint32_t elem = 0, blk = 1, rep = 8;
};

// Which lanes run: Normal mode (`bits`: a 128-bit pattern, else the first `count` lanes of each repeat) or counter
// mode (the first `count` lanes of the whole instruction).
struct LaneMask {
  bool counter = false, bits = false;
  uint64_t pattern[2] = {0, 0};
  uint64_t count = 0;
  bool Active(uint64_t repeat, uint32_t lane, uint32_t lanes) const {
    if (counter) return repeat * lanes + lane < count;
    if (bits) return (pattern[lane / 64] >> (lane % 64)) & 1;
    return lane < count;
  }
};

// Runs f(lane values...) -> dst value on every active lane; sources are all read before dst is written.
template <typename D, typename F, typename... S>
void VectorInstr(const char* api, VecOperand dst, uint64_t repeats, const LaneMask& mask, F f,
                 std::pair<VecOperand, const S*>... srcs) {
  Core& core = Current();
  const uint32_t widest = std::max({uint32_t(sizeof(D)), uint32_t(sizeof(S))...});
  const uint32_t lanes = 256 / widest;
  if (dst.blk == 0) Fail(std::string(api) + ": dstBlkStride 0 is undefined behaviour");
  for (const VecOperand* op : {&dst, &srcs.first...}) {
    if (op->ref->mem() != Mem::UB) Fail(std::string(api) + ": vector operands must be in UB");
    CheckAligned(op->ref->addr, 32, api, "operand");
  }
  const uint32_t t = core.Issue(kPipeV);
  auto lane_addr = [&](const VecOperand& op, uint64_t r, uint32_t e) {
    const uint32_t per_block = 32 / op.elem;
    const uint64_t byte = (r * op.rep + uint64_t(e / per_block) * op.blk) * 32 + (e % per_block) * op.elem;
    return op.ref->At(byte / op.elem, 1, op.elem, api);
  };
  // Hazards per touched 32-byte block (sources first: an instruction may work in place).
  auto touch = [&](const VecOperand& op, bool write) {
    for (uint64_t r = 0; r < repeats; ++r) {
      for (uint32_t e = 0; e < lanes; ++e) {
        if (!mask.Active(r, e, lanes)) continue;
        const uint32_t a = lane_addr(op, r, e) / 32 * 32;
        write ? core.Write(kPipeV, t, Mem::UB, a, 32) : core.Read(kPipeV, t, Mem::UB, a, 32);
      }
    }
  };
  (touch(srcs.first, false), ...);
  touch(dst, true);
  std::vector<std::pair<uint32_t, D>> out;
  for (uint64_t r = 0; r < repeats; ++r) {
    for (uint32_t e = 0; e < lanes; ++e) {
      if (!mask.Active(r, e, lanes)) continue;
      out.emplace_back(lane_addr(dst, r, e),
                       f(*reinterpret_cast<const S*>(core.Bytes(Mem::UB, lane_addr(srcs.first, r, e), sizeof(S)))...));
    }
  }
  for (const auto& [addr, v] : out) std::memcpy(core.Bytes(Mem::UB, addr, sizeof(D)), &v, sizeof(D));
}

// Operands of a vector instruction: strided (blocks, repeats) or, for the "first count elements" prototypes,
// contiguous in counter mode.
template <typename T>
VecOperand Dest(const LocalTensor<T>& t, uint32_t blk, uint32_t rep) {
  return VecOperand{&t.ref, uint32_t(sizeof(T)), blk, rep};
}
template <typename T>
VecOperand Dest(const LocalTensor<T>& t, uint32_t lanes) {
  return Dest(t, 1, uint32_t(lanes * sizeof(T) / 32));
}
template <typename T>
std::pair<VecOperand, const T*> Src(const LocalTensor<T>& t, uint32_t blk, uint32_t rep) {
  return {Dest(t, blk, rep), nullptr};
}
template <typename T>
std::pair<VecOperand, const T*> Src(const LocalTensor<T>& t, uint32_t lanes) {
  return {Dest(t, lanes), nullptr};
}

template <typename... T>
uint32_t LanesOf() {
  return 256 / std::max({uint32_t(sizeof(T))...});
}

inline LaneMask CountMask(uint64_t count) {
  LaneMask m;
  m.counter = true;
  m.count = count;
  return m;
}

inline LaneMask NormalMask(uint64_t count, uint32_t lanes) {
  LaneMask m;
  m.count = std::min<uint64_t>(count, lanes);
  return m;
}

inline LaneMask BitsMask(const uint64_t mask[]) {
  LaneMask m;
  m.bits = true;
  m.pattern[0] = mask[0];
  m.pattern[1] = mask[1];
  return m;
}

template <typename T, typename U>
T Convert(U v, RoundMode mode, const char* api) {
  constexpr bool widen = std::is_same_v<T, float> && (std::is_same_v<U, half> || std::is_same_v<U, bfloat16_t>);
  constexpr bool narrow = std::is_same_v<U, float> && (std::is_same_v<T, half> || std::is_same_v<T, bfloat16_t>);
  static_assert(widen || narrow, "the model's Cast covers half/bfloat16_t <-> float");
  if constexpr (widen) {
    if (mode != RoundMode::CAST_NONE) Fail(std::string(api) + ": widening casts take CAST_NONE");
    return static_cast<float>(v);
  } else {
    // float -> half accepts CAST_NONE (= rint); float -> bfloat16_t lists only explicit modes on arch 2201.
    const bool ok = mode == RoundMode::CAST_RINT || (std::is_same_v<T, half> && mode == RoundMode::CAST_NONE);
    if (!ok) Fail(std::string(api) + ": only round-to-nearest-even narrowing (CAST_RINT) is modelled");
    return T(v);
  }
}

// Muls, Add and Sub are modelled for float, the type the kernels compute in.
template <typename T>
constexpr void FloatArithmetic() {
  static_assert(std::is_same_v<T, float>, "the model's Muls/Add/Sub cover float");
}

}  // namespace cpu_model

// ------------------------------------------------------------------------------------------------ Cast

template <typename T, typename U, bool isSetMask = true>
inline void Cast(const LocalTensor<T>& dst, const LocalTensor<U>& src, const RoundMode& roundMode,
                 const uint64_t mask[], const uint8_t repeatTime, const UnaryRepeatParams& p) {
  using namespace cpu_model;
  VectorInstr<T>("Cast", Dest(dst, p.dstBlkStride, p.dstRepStride), repeatTime, BitsMask(mask),
                 [&](U v) { return Convert<T>(v, roundMode, "Cast"); }, Src(src, p.srcBlkStride, p.srcRepStride));
}

template <typename T, typename U, bool isSetMask = true>
inline void Cast(const LocalTensor<T>& dst, const LocalTensor<U>& src, const RoundMode& roundMode,
                 const uint64_t mask, const uint8_t repeatTime, const UnaryRepeatParams& p) {
  using namespace cpu_model;
  VectorInstr<T>("Cast", Dest(dst, p.dstBlkStride, p.dstRepStride), repeatTime, NormalMask(mask, LanesOf<T, U>()),
                 [&](U v) { return Convert<T>(v, roundMode, "Cast"); }, Src(src, p.srcBlkStride, p.srcRepStride));
}

template <typename T, typename U>
inline void Cast(const LocalTensor<T>& dst, const LocalTensor<U>& src, const RoundMode& roundMode,
                 const uint32_t count) {
  using namespace cpu_model;
  const uint32_t lanes = LanesOf<T, U>();
  VectorInstr<T>("Cast", Dest(dst, lanes), (count + lanes - 1) / lanes, CountMask(count),
                 [&](U v) { return Convert<T>(v, roundMode, "Cast"); }, Src(src, lanes));
}

// ------------------------------------------------------------------------------------------------ Muls

template <typename T, bool isSetMask = true>
inline void Muls(const LocalTensor<T>& dst, const LocalTensor<T>& src, const T& scalarValue, uint64_t mask[],
                 const uint8_t repeatTime, const UnaryRepeatParams& p) {
  using namespace cpu_model;
  FloatArithmetic<T>();
  VectorInstr<T>("Muls", Dest(dst, p.dstBlkStride, p.dstRepStride), repeatTime, BitsMask(mask),
                 [&](T v) { return T(v * scalarValue); }, Src(src, p.srcBlkStride, p.srcRepStride));
}

template <typename T, bool isSetMask = true>
inline void Muls(const LocalTensor<T>& dst, const LocalTensor<T>& src, const T& scalarValue, uint64_t mask,
                 const uint8_t repeatTime, const UnaryRepeatParams& p) {
  using namespace cpu_model;
  FloatArithmetic<T>();
  VectorInstr<T>("Muls", Dest(dst, p.dstBlkStride, p.dstRepStride), repeatTime, NormalMask(mask, LanesOf<T>()),
                 [&](T v) { return T(v * scalarValue); }, Src(src, p.srcBlkStride, p.srcRepStride));
}

template <typename T>
inline void Muls(const LocalTensor<T>& dst, const LocalTensor<T>& src, const T& scalarValue, const int32_t& count) {
  using namespace cpu_model;
  FloatArithmetic<T>();
  const uint32_t lanes = LanesOf<T>();
  VectorInstr<T>("Muls", Dest(dst, lanes), (uint32_t(count) + lanes - 1) / lanes, CountMask(count),
                 [&](T v) { return T(v * scalarValue); }, Src(src, lanes));
}

// ------------------------------------------------------------------------------------------------ Add

template <typename T, bool isSetMask = true>
inline void Add(const LocalTensor<T>& dst, const LocalTensor<T>& src0, const LocalTensor<T>& src1, uint64_t mask[],
                const uint8_t repeatTime, const BinaryRepeatParams& p) {
  using namespace cpu_model;
  FloatArithmetic<T>();
  VectorInstr<T>("Add", Dest(dst, p.dstBlkStride, p.dstRepStride), repeatTime, BitsMask(mask),
                 [](T a, T b) { return T(a + b); }, Src(src0, p.src0BlkStride, p.src0RepStride),
                 Src(src1, p.src1BlkStride, p.src1RepStride));
}

template <typename T, bool isSetMask = true>
inline void Add(const LocalTensor<T>& dst, const LocalTensor<T>& src0, const LocalTensor<T>& src1, uint64_t mask,
                const uint8_t repeatTime, const BinaryRepeatParams& p) {
  using namespace cpu_model;
  FloatArithmetic<T>();
  VectorInstr<T>("Add", Dest(dst, p.dstBlkStride, p.dstRepStride), repeatTime, NormalMask(mask, LanesOf<T>()),
                 [](T a, T b) { return T(a + b); }, Src(src0, p.src0BlkStride, p.src0RepStride),
                 Src(src1, p.src1BlkStride, p.src1RepStride));
}

template <typename T>
inline void Add(const LocalTensor<T>& dst, const LocalTensor<T>& src0, const LocalTensor<T>& src1,
                const int32_t& count) {
  using namespace cpu_model;
  FloatArithmetic<T>();
  const uint32_t lanes = LanesOf<T>();
  VectorInstr<T>("Add", Dest(dst, lanes), (uint32_t(count) + lanes - 1) / lanes, CountMask(count),
                 [](T a, T b) { return T(a + b); }, Src(src0, lanes), Src(src1, lanes));
}

// ------------------------------------------------------------------------------------------------ Sub

template <typename T>
inline void Sub(const LocalTensor<T>& dst, const LocalTensor<T>& src0, const LocalTensor<T>& src1,
                const int32_t& count) {
  using namespace cpu_model;
  FloatArithmetic<T>();
  const uint32_t lanes = LanesOf<T>();
  VectorInstr<T>("Sub", Dest(dst, lanes), (uint32_t(count) + lanes - 1) / lanes, CountMask(count),
                 [](T a, T b) { return T(a - b); }, Src(src0, lanes), Src(src1, lanes));
}

// ------------------------------------------------------------------------------------------------ Duplicate

template <typename T, bool isSetMask = true>
inline void Duplicate(const LocalTensor<T>& dst, const T& scalarValue, uint64_t mask, const uint8_t repeatTime,
                      const uint16_t dstBlockStride, const uint8_t dstRepeatStride) {
  using namespace cpu_model;
  VectorInstr<T>("Duplicate", Dest(dst, dstBlockStride, dstRepeatStride), repeatTime, NormalMask(mask, LanesOf<T>()),
                 [&] { return scalarValue; });
}

template <typename T>
inline void Duplicate(const LocalTensor<T>& dst, const T& scalarValue, const int32_t& count) {
  using namespace cpu_model;
  const uint32_t lanes = LanesOf<T>();
  VectorInstr<T>("Duplicate", Dest(dst, lanes), (uint32_t(count) + lanes - 1) / lanes, CountMask(count),
                 [&] { return scalarValue; });
}

}  // namespace AscendC
