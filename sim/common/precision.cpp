#include "sim/common/precision.hpp"

namespace dtsim {

std::string_view to_string(Precision p) {
  switch (p) {
    case Precision::Fp32:
      return "fp32";
    case Precision::Tf32:
      return "tf32";
    case Precision::Bf16:
      return "bf16";
    case Precision::Fp16:
      return "fp16";
    case Precision::Fp8:
      return "fp8";
  }
  return "?";
}

std::optional<Precision> parse_precision(std::string_view text) {
  for (Precision p : kAllPrecisions) {
    if (to_string(p) == text) return p;
  }
  return std::nullopt;
}

}  // namespace dtsim
