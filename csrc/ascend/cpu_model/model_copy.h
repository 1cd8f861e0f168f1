// Data movement between global memory and the local buffers: DataCopy with ND->NZ (GM -> L1, for the cube) and
// DataCopyPad (GM <-> UB, any length), with the alignment, range and padding rules of their asc-devkit docs.
#pragma once
#include <cstring>
#include <string>

#include "model_pipe.h"

namespace AscendC {

struct Nd2NzParams {
  Nd2NzParams() {}
  Nd2NzParams(const uint16_t ndNumIn, const uint16_t nValueIn, const uint16_t dValueIn,
              const uint16_t srcNdMatrixStrideIn, const uint16_t srcDValueIn, const uint16_t dstNzC0StrideIn,
              const uint16_t dstNzNStrideIn, const uint16_t dstNzMatrixStrideIn)
      : ndNum(ndNumIn), nValue(nValueIn), dValue(dValueIn), srcNdMatrixStride(srcNdMatrixStrideIn),
        srcDValue(srcDValueIn), dstNzC0Stride(dstNzC0StrideIn), dstNzNStride(dstNzNStrideIn),
        dstNzMatrixStride(dstNzMatrixStrideIn) {}
  uint16_t ndNum = 0;
  uint16_t nValue = 0;
  uint16_t dValue = 0;
  uint16_t srcNdMatrixStride = 0;
  uint16_t srcDValue = 0;
  uint16_t dstNzC0Stride = 0;
  uint16_t dstNzNStride = 0;
  uint16_t dstNzMatrixStride = 0;
};

struct DataCopyExtParams {
  DataCopyExtParams() {}
  DataCopyExtParams(const uint16_t count, const uint32_t len, const uint32_t srcStrideIn, const uint32_t dstStrideIn,
                    const uint32_t rsvIn)
      : blockCount(count), blockLen(len), srcStride(srcStrideIn), dstStride(dstStrideIn), rsv(rsvIn) {}
  uint16_t blockCount = 1;
  uint32_t blockLen = 0;
  uint32_t srcStride = 0;
  uint32_t dstStride = 0;
  uint32_t rsv = 0;
};

template <typename T>
struct DataCopyPadExtParams {
  DataCopyPadExtParams() {}
  DataCopyPadExtParams(const bool isPadValue, const uint8_t leftPadValue, const uint8_t rightPadValue, T padValue)
      : isPad(isPadValue), leftPadding(leftPadValue), rightPadding(rightPadValue), paddingValue(padValue) {}
  bool isPad = false;
  uint8_t leftPadding = 0;
  uint8_t rightPadding = 0;
  T paddingValue = 0;
};

// GM -> L1 (A1/B1) with ND -> NZ: row r, column c of ND matrix n lands at
// n * dstNzMatrixStride + (c / C0) * dstNzC0Stride * C0 + r * dstNzNStride * C0 + c % C0, C0 = 32 B / sizeof(T);
// a row's last C0 group is zero-padded.
template <typename T>
inline void DataCopy(const LocalTensor<T>& dst, const GlobalTensor<T>& src, const Nd2NzParams& p) {
  using namespace cpu_model;
  constexpr const char* api = "DataCopy(GM->L1, Nd2NzParams)";
  Core& core = Current();
  if (dst.ref.mem() != Mem::L1) Fail(std::string(api) + ": dst must be in L1 (A1/B1)");
  if (p.ndNum == 0 || p.nValue == 0 || p.dValue == 0) return;
  if (p.ndNum > 4095 || p.nValue > 16384 || p.srcDValue == 0 || p.dstNzC0Stride == 0 ||
      p.dstNzC0Stride > 16384 || p.dstNzNStride == 0 || p.dstNzNStride > 16384 || p.dstNzMatrixStride > 16384) {
    Fail(std::string(api) + ": a parameter is outside its documented range");
  }
  constexpr uint32_t c0 = 32 / sizeof(T);
  const uint32_t groups = (p.dValue + c0 - 1) / c0;
  if (groups > 1 && uint32_t(p.nValue - 1) * p.dstNzNStride >= p.dstNzC0Stride) {
    Fail(std::string(api) + ": rows overlap the next C0 column group (nValue " + std::to_string(p.nValue) +
         " > dstNzC0Stride " + std::to_string(p.dstNzC0Stride) + " / dstNzNStride)");
  }
  CheckAligned(dst.ref.addr, 32, api, "dst");
  const uint32_t t = core.Issue(kPipeMte2);
  for (uint32_t n = 0; n < p.ndNum; ++n) {
    for (uint32_t r = 0; r < p.nValue; ++r) {
      const T* row = src.Span(uint64_t(n) * p.srcNdMatrixStride + uint64_t(r) * p.srcDValue, p.dValue, api);
      AccessGm(kPipeMte2, t, row, p.dValue * sizeof(T), false);
      for (uint32_t g = 0; g < groups; ++g) {
        const uint64_t first =
            uint64_t(n) * p.dstNzMatrixStride + (uint64_t(g) * p.dstNzC0Stride + r * p.dstNzNStride) * c0;
        const uint32_t addr = dst.ref.At(first, c0, sizeof(T), api);
        core.Write(kPipeMte2, t, Mem::L1, addr, 32);
        T* out = reinterpret_cast<T*>(core.Bytes(Mem::L1, addr, 32));
        for (uint32_t c = 0; c < c0; ++c) {
          const uint32_t col = g * c0 + c;
          out[c] = col < p.dValue ? row[col] : T(0);
        }
      }
    }
  }
}

// GM -> UB (VECIN/VECOUT): blockCount blocks of blockLen bytes, srcStride bytes apart in GM; each block is padded
// to 32 bytes in UB and followed by dstStride 32-byte blocks. Padding: paddingValue when isPad, else (no side
// padding asked) copies of the block's first element, else undefined (the model writes 0xFF).
template <typename T>
inline void DataCopyPad(const LocalTensor<T>& dst, const GlobalTensor<T>& src, const DataCopyExtParams& p,
                        const DataCopyPadExtParams<T>& pad) {
  using namespace cpu_model;
  constexpr const char* api = "DataCopyPad(GM->UB)";
  Core& core = Current();
  if (dst.ref.pos != TPosition::VECIN && dst.ref.pos != TPosition::VECOUT) {
    Fail(std::string(api) + ": dst must be at VECIN or VECOUT");
  }
  if (p.blockCount == 0 || p.blockLen == 0) return;
  if (p.blockCount > 4095 || p.blockLen > 2097151 || p.blockLen % sizeof(T) != 0) {
    Fail(std::string(api) + ": blockCount/blockLen outside their range or blockLen not a multiple of sizeof(T)");
  }
  if (pad.leftPadding * sizeof(T) > 32 || pad.rightPadding * sizeof(T) > 32) {
    Fail(std::string(api) + ": left/right padding exceeds 32 bytes");
  }
  CheckAligned(dst.ref.addr, 32, api, "dst");
  const uint32_t elems = p.blockLen / sizeof(T);
  const uint32_t padded = (pad.leftPadding + elems + pad.rightPadding) * sizeof(T);
  const uint32_t pitch = (padded + 31) / 32 * 32 + p.dstStride * 32;
  const uint32_t t = core.Issue(kPipeMte2);
  const uint8_t* gm = reinterpret_cast<const uint8_t*>(src.Span(0, 0, api));
  for (uint32_t b = 0; b < p.blockCount; ++b) {
    const uint8_t* block = gm + uint64_t(b) * (p.blockLen + p.srcStride);
    src.Span(uint64_t(block - gm) / sizeof(T), elems, api);
    AccessGm(kPipeMte2, t, block, p.blockLen, false);
    const uint32_t span = (padded + 31) / 32 * 32;
    const uint32_t addr = dst.ref.At(uint64_t(b) * pitch / sizeof(T), span / sizeof(T), sizeof(T), api);
    core.Write(kPipeMte2, t, Mem::UB, addr, span);
    T* out = reinterpret_cast<T*>(core.Bytes(Mem::UB, addr, span));
    const bool sides = pad.leftPadding != 0 || pad.rightPadding != 0;
    T filler;
    if (pad.isPad) {
      filler = pad.paddingValue;
    } else if (!sides) {
      std::memcpy(&filler, block, sizeof(T));
    } else {
      std::memset(static_cast<void*>(&filler), 0xFF, sizeof(T));
    }
    for (uint32_t i = 0; i < span / sizeof(T); ++i) out[i] = filler;
    std::memcpy(out + pad.leftPadding, block, p.blockLen);
  }
}

// UB -> GM: blockCount blocks of blockLen bytes; in UB each starts on a 32-byte boundary after the previous one's
// padded end plus srcStride 32-byte blocks, in GM they are dstStride bytes apart. Only blockLen bytes are written.
template <typename T>
inline void DataCopyPad(const GlobalTensor<T>& dst, const LocalTensor<T>& src, const DataCopyExtParams& p) {
  using namespace cpu_model;
  constexpr const char* api = "DataCopyPad(UB->GM)";
  Core& core = Current();
  if (src.ref.mem() != Mem::UB) Fail(std::string(api) + ": src must be in UB");
  if (p.blockCount == 0 || p.blockLen == 0) return;
  if (p.blockCount > 4095 || p.blockLen > 2097151 || p.blockLen % sizeof(T) != 0) {
    Fail(std::string(api) + ": blockCount/blockLen outside their range or blockLen not a multiple of sizeof(T)");
  }
  CheckAligned(src.ref.addr, 32, api, "src");
  const uint32_t elems = p.blockLen / sizeof(T);
  const uint32_t pitch = (p.blockLen + 31) / 32 * 32 + p.srcStride * 32;
  const uint32_t t = core.Issue(kPipeMte3);
  uint8_t* gm = reinterpret_cast<uint8_t*>(dst.Span(0, 0, api));
  for (uint32_t b = 0; b < p.blockCount; ++b) {
    const uint32_t addr = src.ref.At(uint64_t(b) * pitch / sizeof(T), elems, sizeof(T), api);
    core.Read(kPipeMte3, t, Mem::UB, addr, p.blockLen);
    uint8_t* block = gm + uint64_t(b) * (p.blockLen + p.dstStride);
    dst.Span(uint64_t(block - gm) / sizeof(T), elems, api);
    AccessGm(kPipeMte3, t, block, p.blockLen, true);
    std::memcpy(block, core.Bytes(Mem::UB, addr, p.blockLen), p.blockLen);
  }
}

}  // namespace AscendC
