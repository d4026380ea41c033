// Wrong values for every field of a JSON input, one at a time: the mutation tests of dtsim's
// inputs (tests/cli/input_mutation_test.cpp) and of dtexec's checkpoint index
// (tests/exec/core/checkpoint_test.cpp).
#pragma once

#include <fmt/format.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace dtsim::test {

// One changed input: its description, the JSON, and the name of the field changed (the last
// object member on its path: an array element's array; a figure's value, the figure).
struct Mutant {
  std::string change;
  nlohmann::json value;
  std::string field;
};

namespace detail {

// Every node of `j` below the root, by its pointer.
inline void nodes(const nlohmann::json& j, const nlohmann::json::json_pointer& at,
                  std::vector<nlohmann::json::json_pointer>& out) {
  if (j.is_object()) {
    for (const auto& [key, value] : j.items()) {
      out.push_back(at / key);
      nodes(value, at / key, out);
    }
  } else if (j.is_array()) {
    for (std::size_t i = 0; i < j.size(); ++i) {
      out.push_back(at / i);
      nodes(j[i], at / i, out);
    }
  }
}

inline std::string field_of(const nlohmann::json::json_pointer& at) {
  for (nlohmann::json::json_pointer p = at; !p.empty(); p = p.parent_pointer()) {
    const std::string& token = p.back();
    if (token.find_first_not_of("0123456789") != std::string::npos && token != "value") {
      return token;
    }
  }
  return "";
}

}  // namespace detail

// The wrong values tried in place of each node: of each other kind, negative, zero, a
// fraction, beyond any range (and past a 64-bit integer), and empty containers.
inline const std::vector<nlohmann::json>& wrong_values() {
  using nlohmann::json;
  static const std::vector<json> values = {
      json(nullptr), json(-1),      json(0),     json(0.5),     json(1e300),
      json(1e19),    json("x"),     json(true),  json::array(), json::object(),
      json(-1e300),  json(1 << 30), json(1e-300)};
  return values;
}

// `base` with each node replaced by each wrong value (and each of `more`), and each object
// member removed.
inline std::vector<Mutant> mutants(const nlohmann::json& base,
                                   const std::vector<nlohmann::json>& more = {}) {
  std::vector<nlohmann::json::json_pointer> all;
  detail::nodes(base, nlohmann::json::json_pointer(), all);
  std::vector<nlohmann::json> values = wrong_values();
  values.insert(values.end(), more.begin(), more.end());
  std::vector<Mutant> out;
  for (const auto& at : all) {
    const std::string field = detail::field_of(at);
    for (const nlohmann::json& v : values) {
      nlohmann::json m = base;
      m[at] = v;
      out.push_back({fmt::format("{} = {}", at.to_string(), v.dump()), std::move(m), field});
    }
    if (base[at.parent_pointer()].is_object()) {
      nlohmann::json m = base;
      m[at.parent_pointer()].erase(at.back());
      out.push_back({fmt::format("{} removed", at.to_string()), std::move(m), field});
    }
  }
  return out;
}

}  // namespace dtsim::test
