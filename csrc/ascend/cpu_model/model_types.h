// The AscendC scalar types the kernels use, emulated bit-exactly on the CPU: `half` (IEEE binary16) and
// `bfloat16_t`, each a 16-bit pattern with round-to-nearest-even conversion from float (what CAST_RINT, Fixpipe's
// F322F16/F322BF16 and torch's .to() do), and exact widening to float.
#pragma once
#include <cstdint>
#include <cstring>

namespace AscendC::cpu_model {

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// float -> binary16, round to nearest even; overflow to infinity; NaN -> the quiet NaN 0x7e00 with its sign
// (torch's convention; the hardware's NaN payloads are not modelled).
inline uint16_t FloatToHalfBits(float f) {
  const uint32_t u = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520: infinity
  if (abs < 0x38800000u) {                        // below the smallest normal half: subnormal or zero
    // Shift the 24-bit significand right so that one unit is 2^-24, rounding to nearest even.
    const int exp = static_cast<int>(abs >> 23);
    if (exp < 102) return sign;  // below half of the smallest subnormal
    const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const int shift = 126 - exp;  // in [14, 24]
    const uint32_t q = mant >> shift, rem = mant & ((1u << shift) - 1), halfway = 1u << (shift - 1);
    return sign | static_cast<uint16_t>(q + (rem > halfway || (rem == halfway && (q & 1u))));
  }
  const uint32_t rebased = abs - (112u << 23);  // exponent bias 127 -> 15
  const uint32_t q = rebased >> 13, rem = rebased & 0x1fffu;
  return sign | static_cast<uint16_t>(q + (rem > 0x1000u || (rem == 0x1000u && (q & 1u))));
}

inline float HalfBitsToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  if (exp == 0x1f) return BitsFloat(sign | 0x7f800000u | (mant << 13));
  if (exp == 0) {
    const float magnitude = static_cast<float>(mant) * BitsFloat(0x33800000u);  // mant * 2^-24, exact
    return sign ? -magnitude : magnitude;
  }
  return BitsFloat(sign | ((exp + 112u) << 23) | (mant << 13));
}

// float -> bfloat16, round to nearest even; NaN -> 0x7fc0 (torch's convention).
inline uint16_t FloatToBf16Bits(float f) {
  const uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline float Bf16BitsToFloat(uint16_t b) { return BitsFloat(static_cast<uint32_t>(b) << 16); }

}  // namespace AscendC::cpu_model

// Global-namespace names, as the AscendC compiler provides them.
struct half {
  uint16_t bits = 0;
  half() = default;
  half(float f) : bits(AscendC::cpu_model::FloatToHalfBits(f)) {}
  operator float() const { return AscendC::cpu_model::HalfBitsToFloat(bits); }
};

struct bfloat16_t {
  uint16_t bits = 0;
  bfloat16_t() = default;
  bfloat16_t(float f) : bits(AscendC::cpu_model::FloatToBf16Bits(f)) {}
  operator float() const { return AscendC::cpu_model::Bf16BitsToFloat(bits); }
};

static_assert(sizeof(half) == 2 && sizeof(bfloat16_t) == 2, "16-bit storage");
