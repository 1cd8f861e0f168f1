// LocalTensor and GlobalTensor of the CPU model: the AscendC names and signatures, with every element access
// bounds-checked against the tensor (and, for global memory, against the buffers the launch declared).
#pragma once
#include <cstdint>
#include <cstring>
#include <string>

#include "model_core.h"
#include "model_types.h"

namespace AscendC {

enum class TPosition : uint8_t {
  GM, A1, A2, B1, B2, C1, C2, CO1, CO2, VECIN, VECOUT, VECCALC,
  LCM = VECCALC, SPM, SHM = SPM, TSCM, C2PIPE2GM, C2PIPE2LOCAL, MAX,
};
using QuePosition = TPosition;

namespace cpu_model {

inline Mem MemOf(TPosition pos) {
  switch (pos) {
    case TPosition::A1: case TPosition::B1: case TPosition::C1: return Mem::L1;
    case TPosition::A2: return Mem::L0A;
    case TPosition::B2: return Mem::L0B;
    case TPosition::CO1: return Mem::L0C;
    case TPosition::VECIN: case TPosition::VECOUT: case TPosition::VECCALC: return Mem::UB;
    default: Fail("TPosition " + std::to_string(static_cast<int>(pos)) + " has no modelled local memory");
  }
}

// Where a LocalTensor lives: a byte range of one local memory of the core that allocated it.
struct LocalRef {
  TPosition pos = TPosition::MAX;
  uint32_t addr = 0, bytes = 0;
  const Core* owner = nullptr;

  Mem mem() const { return MemOf(pos); }
  // Byte address of elements [first, first + count) after checking they lie inside the tensor.
  uint32_t At(uint64_t first, uint64_t count, uint32_t elem, const char* api) const {
    if (owner == nullptr) Fail(std::string(api) + ": LocalTensor was never allocated");
    if (owner != &Current()) Fail(std::string(api) + ": LocalTensor belongs to another core");
    if ((first + count) * elem > bytes) {
      Fail(std::string(api) + ": elements [" + std::to_string(first) + ", " + std::to_string(first + count) +
           ") exceed the tensor's " + std::to_string(bytes / elem));
    }
    return addr + static_cast<uint32_t>(first * elem);
  }
};

inline void CheckAligned(uint64_t addr, uint64_t align, const char* api, const char* operand) {
  if (addr % align != 0) {
    Fail(std::string(api) + ": " + operand + " address " + std::to_string(addr) + " is not " + std::to_string(align) +
         "-byte aligned");
  }
}

}  // namespace cpu_model

template <typename T>
class LocalTensor {
 public:
  using PrimType = T;
  LocalTensor() = default;

  PrimType GetValue(const uint32_t index) const {
    cpu_model::Core& core = cpu_model::Current();
    const uint32_t addr = ref.At(index, 1, sizeof(T), "LocalTensor::GetValue");
    const uint32_t t = core.Issue(cpu_model::kPipeS);
    core.Read(cpu_model::kPipeS, t, ref.mem(), addr, sizeof(T));
    T v;
    std::memcpy(&v, core.Bytes(ref.mem(), addr, sizeof(T)), sizeof(T));
    return v;
  }

  template <typename S>
  void SetValue(const uint32_t index, const S value) const {
    cpu_model::Core& core = cpu_model::Current();
    const uint32_t addr = ref.At(index, 1, sizeof(T), "LocalTensor::SetValue");
    const uint32_t t = core.Issue(cpu_model::kPipeS);
    core.Write(cpu_model::kPipeS, t, ref.mem(), addr, sizeof(T));
    const T v = static_cast<T>(value);
    std::memcpy(core.Bytes(ref.mem(), addr, sizeof(T)), &v, sizeof(T));
  }

  LocalTensor operator[](const uint32_t offset) const {
    LocalTensor sub = *this;
    sub.ref.addr = ref.At(offset, 0, sizeof(T), "LocalTensor::operator[]");
    sub.ref.bytes = ref.bytes - offset * static_cast<uint32_t>(sizeof(T));
    return sub;
  }

  uint32_t GetSize() const { return ref.bytes / sizeof(T); }

  template <typename U>
  LocalTensor<U> ReinterpretCast() const {
    LocalTensor<U> other;
    other.ref = ref;
    return other;
  }

  cpu_model::LocalRef ref;  // model state (the device keeps the equivalent in its TBuffAddr)
};

template <typename T>
class GlobalTensor {
 public:
  using PrimType = T;
  GlobalTensor() = default;

  void SetGlobalBuffer(T* buffer, uint64_t bufferSize) {
    address_ = buffer;
    bufferSize_ = bufferSize;
    sized_ = true;
  }
  void SetGlobalBuffer(T* buffer) {
    address_ = buffer;
    sized_ = false;
  }
  const T* GetPhyAddr() const { return address_; }
  uint64_t GetSize() const { return bufferSize_; }

  GlobalTensor operator[](const uint64_t offset) const {
    CheckRange(offset, 0, "GlobalTensor::operator[]");
    GlobalTensor sub = *this;
    sub.address_ = address_ + offset;
    sub.bufferSize_ = sized_ ? bufferSize_ - offset : 0;
    return sub;
  }

  PrimType GetValue(const uint64_t offset) const {
    CheckRange(offset, 1, "GlobalTensor::GetValue");
    cpu_model::Core& core = cpu_model::Current();
    const uint32_t t = core.Issue(cpu_model::kPipeS);
    cpu_model::AccessGm(cpu_model::kPipeS, t, address_ + offset, sizeof(T), false);
    T v;
    std::memcpy(&v, address_ + offset, sizeof(T));
    return v;
  }

  // Model: elements [first, first + count) after the bounds check of a sized tensor.
  T* Span(uint64_t first, uint64_t count, const char* api) const {
    CheckRange(first, count, api);
    return address_ + first;
  }

 private:
  void CheckRange(uint64_t first, uint64_t count, const char* api) const {
    if (address_ == nullptr) cpu_model::Fail(std::string(api) + ": GlobalTensor has no buffer");
    if (sized_ && first + count > bufferSize_) {
      cpu_model::Fail(std::string(api) + ": elements [" + std::to_string(first) + ", " +
                      std::to_string(first + count) + ") exceed the buffer's " + std::to_string(bufferSize_));
    }
  }

  T* address_ = nullptr;
  uint64_t bufferSize_ = 0;
  bool sized_ = false;
};

}  // namespace AscendC
