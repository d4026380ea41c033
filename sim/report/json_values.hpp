// Small JSON helpers for the CLIs' outputs.
#pragma once

#include <nlohmann/json.hpp>
#include <optional>

namespace dtsim::report {

// A value that may be unknown: the value, or null (nlohmann 3.11 has no std::optional support).
template <typename T>
nlohmann::json value_or_null(const std::optional<T>& v) {
  return v ? nlohmann::json(*v) : nlohmann::json(nullptr);
}

}  // namespace dtsim::report
