// The cube path of the CPU model: Fill (L1 init), LoadData (L1 -> L0A/L0B, 512-byte fractals), Mmad (L0A x L0B
// -> L0C, fp32 accumulation) and Fixpipe (L0C -> GM as ND, or -> L1 as NZ), in the fractal formats of arch 2201:
// L0A Zz, L0B Zn, L0C Nz (see asc-devkit 矩阵计算分形介绍).
#pragma once
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>

#include "model_copy.h"

// Fixpipe's conversion modes, a compiler built-in on the device (the subset the model knows).
enum QuantMode_t : uint8_t { NoQuant, F322F16, F322BF16 };

namespace AscendC {

template <typename T>
struct InitConstValueParams {
  InitConstValueParams() {}
  InitConstValueParams(const uint16_t repeatTimesIn, const uint16_t blockNumIn, const uint16_t dstGapIn,
                       const T initValueIn)
      : repeatTimes(repeatTimesIn), blockNum(blockNumIn), dstGap(dstGapIn), initValue(initValueIn) {}
  uint16_t repeatTimes = 0;
  uint16_t blockNum = 0;
  uint16_t dstGap = 0;
  T initValue = 0;
};

struct LoadData2DParams {
  LoadData2DParams() {}
  LoadData2DParams(const uint16_t startIndexIn, const uint8_t repeatTimesIn, const uint16_t srcStrideIn,
                   const uint8_t sidIn, const uint16_t dstGapIn, const bool ifTransposeIn, const uint8_t addrModeIn)
      : startIndex(startIndexIn), repeatTimes(repeatTimesIn), srcStride(srcStrideIn), sid(sidIn), dstGap(dstGapIn),
        ifTranspose(ifTransposeIn), addrMode(addrModeIn) {}
  uint16_t startIndex = 0;
  uint8_t repeatTimes = 0;
  uint16_t srcStride = 0;
  uint8_t sid = 0;
  uint16_t dstGap = 0;
  bool ifTranspose = false;
  uint8_t addrMode = 0;
};

struct MmadParams {
  MmadParams() {}
  MmadParams(const uint16_t mIn, const uint16_t nIn, const uint16_t kIn, const uint8_t unitFlagIn,
             const bool cmatrixSourceIn, const bool cmatrixInitValIn)
      : m(mIn), n(nIn), k(kIn), unitFlag(unitFlagIn), cmatrixSource(cmatrixSourceIn),
        cmatrixInitVal(cmatrixInitValIn) {}
  uint16_t m = 0;
  uint16_t n = 0;
  uint16_t k = 0;
  bool isBias = false;
  int32_t fmOffset = 0;
  bool enSsparse = false;
  bool enWinogradA = false;
  bool enWinogradB = false;
  uint8_t unitFlag = 0;
  bool kDirectionAlign = false;
  bool cmatrixSource = false;
  bool cmatrixInitVal = true;
};

enum class CO2Layout : uint8_t { NZ = 0, ROW_MAJOR, COLUMN_MAJOR };
struct FixpipeConfig {
  CO2Layout format;
};
constexpr FixpipeConfig CFG_NZ = {CO2Layout::NZ};
constexpr FixpipeConfig CFG_ROW_MAJOR = {CO2Layout::ROW_MAJOR};

struct FixpipeParamsV220 {
  FixpipeParamsV220() {}
  FixpipeParamsV220(const uint16_t nSizeIn, const uint16_t mSizeIn, const uint16_t srcStrideIn,
                    const uint32_t dstStrideIn, const bool reluEnIn, const QuantMode_t quantPreIn,
                    const int64_t deqScalarIn, const uint16_t ndNumIn, const uint16_t srcNdStrideIn,
                    const uint16_t dstNdStrideIn, const uint8_t unitFlagIn)
      : nSize(nSizeIn), mSize(mSizeIn), srcStride(srcStrideIn), dstStride(dstStrideIn), quantPre(quantPreIn),
        deqScalar(deqScalarIn), ndNum(ndNumIn), srcNdStride(srcNdStrideIn), dstNdStride(dstNdStrideIn),
        reluEn(reluEnIn), unitFlag(unitFlagIn) {}
  uint16_t nSize = 0;
  uint16_t mSize = 0;
  uint16_t srcStride = 0;
  uint32_t dstStride = 0;
  QuantMode_t quantPre = QuantMode_t::NoQuant;
  uint64_t deqScalar = 0;
  uint16_t ndNum = 1;
  uint16_t srcNdStride = 0;
  uint16_t dstNdStride = 0;
  bool reluEn = false;
  uint8_t unitFlag = 0;
  bool isChannelSplit = false;
};

namespace cpu_model {

// Fractal geometry of a b16/b32 operand: C0 = 32 B / sizeof(T) elements per fractal row, 16 rows.
template <typename T>
constexpr uint32_t C0() {
  static_assert(sizeof(T) == 2 || sizeof(T) == 4, "the model's cube path covers b16 and b32 operands");
  return 32 / sizeof(T);
}

template <typename T>
float Widen(T v) {
  return static_cast<float>(v);
}

// Fixpipe's float -> T conversion for a quantPre mode.
template <typename T>
T Narrow(float v, QuantMode_t mode, const char* api) {
  constexpr QuantMode_t expected =
      std::is_same_v<T, float> ? NoQuant : (std::is_same_v<T, half> ? F322F16 : F322BF16);
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, half> || std::is_same_v<T, bfloat16_t>,
                "Fixpipe destination type");
  if (mode != expected) Fail(std::string(api) + ": quantPre does not match the destination type");
  return T(v);
}

inline void CheckFixpipeParams(const FixpipeParamsV220& p, const char* api) {
  if (p.reluEn || p.unitFlag != 0 || p.ndNum != 1) {
    Fail(std::string(api) + ": reluEn, unitFlag and ndNum != 1 are not modelled");
  }
  if (p.nSize > 4095) Fail(std::string(api) + ": nSize > 4095");
  if (p.srcStride < (p.mSize + 15) / 16 * 16) {
    Fail(std::string(api) + ": srcStride " + std::to_string(p.srcStride) + " is below mSize rounded up to 16");
  }
}

}  // namespace cpu_model

// Fill (a.k.a. InitConstValue) of L1: repeatTimes x (blockNum 32-byte blocks, then dstGap blocks skipped).
template <typename T, typename U = T>
inline void Fill(const LocalTensor<T>& dst, const InitConstValueParams<U>& p) {
  using namespace cpu_model;
  constexpr const char* api = "Fill";
  Core& core = Current();
  if (dst.ref.mem() != Mem::L1) Fail(std::string(api) + ": only L1 destinations are modelled");
  if (p.repeatTimes == 0 || p.blockNum == 0) return;
  if (p.repeatTimes > 32767 || p.blockNum > 32767 || p.dstGap > 32767) Fail(std::string(api) + ": parameter range");
  CheckAligned(dst.ref.addr, 32, api, "dst");
  const uint32_t t = core.Issue(kPipeMte2);
  for (uint32_t r = 0; r < p.repeatTimes; ++r) {
    const uint64_t first = uint64_t(r) * (p.blockNum + p.dstGap) * 32 / sizeof(T);
    const uint32_t addr = dst.ref.At(first, uint64_t(p.blockNum) * 32 / sizeof(T), sizeof(T), api);
    core.Write(kPipeMte2, t, Mem::L1, addr, uint64_t(p.blockNum) * 32);
    T* out = reinterpret_cast<T*>(core.Bytes(Mem::L1, addr, uint64_t(p.blockNum) * 32));
    for (uint64_t i = 0; i < uint64_t(p.blockNum) * 32 / sizeof(T); ++i) out[i] = T(p.initValue);
  }
}

// L1 -> L0A/L0B: repeatTimes fractals of 512 bytes, source fractal startIndex + i * srcStride, destination
// fractal i * (dstGap + 1). The fractal transpose (ifTranspose) is not modelled: the kernels never need it.
template <typename T>
inline void LoadData(const LocalTensor<T>& dst, const LocalTensor<T>& src, const LoadData2DParams& p) {
  using namespace cpu_model;
  constexpr const char* api = "LoadData(L1->L0, LoadData2DParams)";
  Core& core = Current();
  if (src.ref.mem() != Mem::L1) Fail(std::string(api) + ": src must be in L1");
  if (dst.ref.mem() != Mem::L0A && dst.ref.mem() != Mem::L0B) Fail(std::string(api) + ": dst must be L0A or L0B");
  if (p.ifTranspose || p.addrMode != 0) Fail(std::string(api) + ": ifTranspose/addrMode are not modelled");
  if (p.repeatTimes == 0) return;
  CheckAligned(dst.ref.addr, 512, api, "dst");
  CheckAligned(src.ref.addr, 32, api, "src");
  constexpr uint32_t frac = 512 / sizeof(T);
  const uint32_t t = core.Issue(kPipeMte1);
  for (uint32_t i = 0; i < p.repeatTimes; ++i) {
    const uint32_t s = src.ref.At((uint64_t(p.startIndex) + uint64_t(i) * p.srcStride) * frac, frac, sizeof(T), api);
    const uint32_t d = dst.ref.At(uint64_t(i) * (p.dstGap + 1) * frac, frac, sizeof(T), api);
    core.Read(kPipeMte1, t, Mem::L1, s, 512);
    core.Write(kPipeMte1, t, dst.ref.mem(), d, 512);
    std::memcpy(core.Bytes(dst.ref.mem(), d, 512), core.Bytes(Mem::L1, s, 512), 512);
  }
}

// C[m x n] (+)= A[m x k] * B[k x n]: A in L0A as Zz (fractal (i/16, kk/C0) at index (i/16) * K1 + kk/C0), B in L0B
// as Zn (fractal (kk/C0, j/16) at (kk/C0) * N1 + j/16, column-major inside), C in L0C as Nz of 16 x 16 floats
// (fractal (j/16) * M1 + i/16). Products are exact in fp32 for half/bf16; each fractal's k-slice is summed in fp32
// in k order and added to C. Data beyond m, n, k is ignored, as documented; the written fractals' cells beyond m
// and n are set to NaN, so nothing may depend on them. m = 1 selects GEMV: A is then read as one ND row.
template <typename T>
inline void Mmad(const LocalTensor<float>& dst, const LocalTensor<T>& fm, const LocalTensor<T>& filter,
                 const MmadParams& p) {
  using namespace cpu_model;
  constexpr const char* api = "Mmad";
  Core& core = Current();
  if (dst.ref.mem() != Mem::L0C || fm.ref.mem() != Mem::L0A || filter.ref.mem() != Mem::L0B) {
    Fail(std::string(api) + ": operands must be in L0C, L0A and L0B");
  }
  if (p.cmatrixSource || p.unitFlag != 0 || p.isBias) Fail(std::string(api) + ": bias and unitFlag are not modelled");
  if (p.m > 4095 || p.n > 4095 || p.k > 4095) Fail(std::string(api) + ": m, n, k must be <= 4095");
  if (p.m == 0 || p.n == 0 || p.k == 0) return;
  CheckAligned(dst.ref.addr, 1024, api, "dst");
  CheckAligned(fm.ref.addr, 512, api, "fm");
  CheckAligned(filter.ref.addr, 512, api, "filter");
  constexpr uint32_t c0 = C0<T>();
  const uint32_t m1 = (p.m + 15) / 16, n1 = (p.n + 15) / 16, k1 = (p.k + c0 - 1) / c0;
  const uint32_t a_elems = p.m == 1 ? p.k : m1 * k1 * 16 * c0;
  const uint32_t a = fm.ref.At(0, a_elems, sizeof(T), api);
  const uint32_t b = filter.ref.At(0, uint64_t(k1) * n1 * 16 * c0, sizeof(T), api);
  const uint32_t c = dst.ref.At(0, uint64_t(m1) * n1 * 256, sizeof(float), api);
  const uint32_t t = core.Issue(kPipeM);
  core.Read(kPipeM, t, Mem::L0A, a, uint64_t(a_elems) * sizeof(T));
  core.Read(kPipeM, t, Mem::L0B, b, uint64_t(k1) * n1 * 512);
  if (!p.cmatrixInitVal) core.ReadAccumulator(t, c, uint64_t(m1) * n1 * 1024, (p.m / 16) * (p.n / 16) >= 10);
  const T* A = reinterpret_cast<const T*>(core.Bytes(Mem::L0A, a, uint64_t(a_elems) * sizeof(T)));
  const T* B = reinterpret_cast<const T*>(core.Bytes(Mem::L0B, b, uint64_t(k1) * n1 * 512));
  float* C = reinterpret_cast<float*>(core.Bytes(Mem::L0C, c, uint64_t(m1) * n1 * 1024));
  auto a_at = [&](uint32_t i, uint32_t kk) {
    return p.m == 1 ? Widen(A[kk]) : Widen(A[((i / 16) * k1 + kk / c0) * 16 * c0 + (i % 16) * c0 + kk % c0]);
  };
  auto b_at = [&](uint32_t kk, uint32_t j) {
    return Widen(B[((kk / c0) * n1 + j / 16) * 16 * c0 + (j % 16) * c0 + kk % c0]);
  };
  for (uint32_t i = 0; i < m1 * 16; ++i) {
    for (uint32_t j = 0; j < n1 * 16; ++j) {
      float& out = C[((j / 16) * m1 + i / 16) * 256 + (i % 16) * 16 + j % 16];
      if (i >= p.m || j >= p.n) {
        out = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      float acc = p.cmatrixInitVal ? 0.f : out;
      for (uint32_t kb = 0; kb < k1; ++kb) {
        float part = 0.f;
        const uint32_t end = std::min<uint32_t>((kb + 1) * c0, p.k);
        for (uint32_t kk = kb * c0; kk < end; ++kk) part += a_at(i, kk) * b_at(kk, j);
        acc += part;
      }
      out = acc;
    }
  }
  core.Write(kPipeM, t, Mem::L0C, c, uint64_t(m1) * n1 * 1024);
}

namespace cpu_model {

// The L0C source of a Fixpipe: mSize rows of nSize columns, column groups of 16 srcStride rows apart.
inline const float* FixpipeSource(Core& core, const LocalTensor<float>& src, const FixpipeParamsV220& p,
                                  uint32_t t, const char* api) {
  if (src.ref.mem() != Mem::L0C) Fail(std::string(api) + ": src must be in L0C");
  CheckAligned(src.ref.addr, 64, api, "src");
  const uint32_t groups = (p.nSize + 15) / 16;
  const uint64_t rows = uint64_t(groups - 1) * p.srcStride + p.mSize;  // 16-float rows spanned
  const uint32_t base = src.ref.At(0, rows * 16, sizeof(float), api);
  for (uint32_t g = 0; g < groups; ++g) core.Read(kPipeFix, t, Mem::L0C, base + g * p.srcStride * 64u, p.mSize * 64u);
  return reinterpret_cast<const float*>(core.Bytes(Mem::L0C, base, rows * 64));
}

}  // namespace cpu_model

// L0C -> GM with NZ -> ND (CFG_ROW_MAJOR): element (i, j) lands at dst[i * dstStride + j].
template <typename T, typename U, const FixpipeConfig& config = CFG_ROW_MAJOR>
inline void Fixpipe(const GlobalTensor<T>& dst, const LocalTensor<U>& src, const FixpipeParamsV220& p) {
  using namespace cpu_model;
  static_assert(std::is_same_v<U, float>, "the model's Fixpipe reads float L0C");
  constexpr const char* api = "Fixpipe(L0C->GM)";
  Core& core = Current();
  if (config.format != CO2Layout::ROW_MAJOR) Fail(std::string(api) + ": only NZ2ND (CFG_ROW_MAJOR) is modelled");
  CheckFixpipeParams(p, api);
  if (p.mSize > 8192) Fail(std::string(api) + ": mSize > 8192 with NZ2ND");
  if (p.nSize == 0 || p.mSize == 0) return;
  if (p.dstStride < p.nSize) Fail(std::string(api) + ": dstStride < nSize makes destination rows overlap");
  if (p.isChannelSplit) Fail(std::string(api) + ": channel split cannot be combined with NZ2ND");
  const uint32_t t = core.Issue(kPipeFix);
  const float* in = FixpipeSource(core, src, p, t, api);
  for (uint32_t i = 0; i < p.mSize; ++i) {
    T* row = dst.Span(uint64_t(i) * p.dstStride, p.nSize, api);
    AccessGm(kPipeFix, t, row, uint64_t(p.nSize) * sizeof(T), true);
    for (uint32_t j = 0; j < p.nSize; ++j) {
      row[j] = Narrow<T>(in[(j / 16) * p.srcStride * 16 + i * 16 + j % 16], p.quantPre, api);
    }
  }
}

// L0C -> L1, always NZ on arch 2201 (the config's NZ2ND does not apply on this path): element (i, j) lands at
// (j / C0) * dstStride * C0 + i * C0 + j % C0 elements of dst (dstStride in 32-byte units). Channel split (fp32
// 16x8 fractals) is only available towards GM on this arch, so the destination must be half or bfloat16_t.
template <typename T, typename U, const FixpipeConfig& config = CFG_ROW_MAJOR>
inline void Fixpipe(const LocalTensor<T>& dst, const LocalTensor<U>& src, const FixpipeParamsV220& p) {
  using namespace cpu_model;
  static_assert(std::is_same_v<U, float>, "the model's Fixpipe reads float L0C");
  constexpr const char* api = "Fixpipe(L0C->L1)";
  Core& core = Current();
  if (dst.ref.mem() != Mem::L1) Fail(std::string(api) + ": dst must be in L1");
  if (sizeof(T) != 2 || p.isChannelSplit) Fail(std::string(api) + ": arch 2201 has no fp32 channel split towards L1");
  CheckFixpipeParams(p, api);
  if (p.nSize == 0 || p.mSize == 0) return;
  if (p.nSize % 16 != 0) Fail(std::string(api) + ": nSize must be a multiple of 16 for NZ output");
  if (p.dstStride == 0 || p.dstStride < p.mSize) Fail(std::string(api) + ": dstStride below mSize overlaps groups");
  CheckAligned(dst.ref.addr, 32, api, "dst");
  const uint32_t t = core.Issue(kPipeFix);
  const float* in = FixpipeSource(core, src, p, t, api);
  constexpr uint32_t c0 = C0<T>();
  for (uint32_t g = 0; g < p.nSize / c0; ++g) {
    const uint32_t addr = dst.ref.At(uint64_t(g) * p.dstStride * c0, uint64_t(p.mSize) * c0, sizeof(T), api);
    core.Write(kPipeFix, t, Mem::L1, addr, uint64_t(p.mSize) * 32);
    T* out = reinterpret_cast<T*>(core.Bytes(Mem::L1, addr, uint64_t(p.mSize) * 32));
    for (uint32_t i = 0; i < p.mSize; ++i) {
      for (uint32_t c = 0; c < c0; ++c) {
        const uint32_t j = g * c0 + c;
        out[i * c0 + c] = Narrow<T>(in[(j / 16) * p.srcStride * 16 + i * 16 + j % 16], p.quantPre, api);
      }
    }
  }
}

}  // namespace AscendC
