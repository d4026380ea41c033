// Numeric precisions of training (plan --precision) and of device peaks (catalog keys).
#pragma once

#include <array>
#include <optional>
#include <string>
#include <string_view>

namespace dtsim {

enum class Precision { Fp32, Tf32, Bf16, Fp16, Fp8 };

inline constexpr std::array<Precision, 5> kAllPrecisions = {
    Precision::Fp32, Precision::Tf32, Precision::Bf16, Precision::Fp16, Precision::Fp8};

std::string_view to_string(Precision p);
std::optional<Precision> parse_precision(std::string_view text);

// Bytes of one element in this format on the wire (communication): fp8 1, bf16/fp16 2,
// fp32/tf32 4 (tf32 travels as fp32).
inline int wire_bytes(Precision p) {
  switch (p) {
    case Precision::Fp8:
      return 1;
    case Precision::Bf16:
    case Precision::Fp16:
      return 2;
    case Precision::Fp32:
    case Precision::Tf32:
      return 4;
  }
  return 4;
}

}  // namespace dtsim
