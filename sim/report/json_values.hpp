// Small JSON helpers for the CLIs' outputs.
#pragma once

#include <cmath>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>

namespace dtsim::report {

// A value that may be unknown: the value, or null (nlohmann 3.11 has no std::optional support).
template <typename T>
nlohmann::json value_or_null(const std::optional<T>& v) {
  return v ? nlohmann::json(*v) : nlohmann::json(nullptr);
}

// A byte count that the models hold as a double: a JSON integer where it is a whole number
// (85899345920, not 85899345920.0: what a reader of bytes expects), which counts of whole
// tensors are; the double where it is not (a model's fraction of a byte is said as it is).
// Other counts held as doubles (parameters, checkpoints) are written through it alike.
inline nlohmann::json byte_count(double bytes) {
  // (Up to 2^53, below which a double holds every whole number exactly.)
  if (std::isfinite(bytes) && bytes == std::floor(bytes) && std::fabs(bytes) <= 0x1p53) {
    return static_cast<std::int64_t>(bytes);
  }
  return bytes;
}

}  // namespace dtsim::report
