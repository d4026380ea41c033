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

}  // namespace dtsim
