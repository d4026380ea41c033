#include "sim/common/json_reader.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <vector>

#include "sim/common/error.hpp"

namespace dtsim {

using nlohmann::json;

std::string json_text(const json& value, int indent) {
  return value.dump(indent, ' ', false, json::error_handler_t::replace);
}

namespace {

// A value's text, cut to `most` characters with "..." where longer.
std::string cut_json(const json& value, std::size_t most) {
  std::string text = json_text(value);
  if (text.size() > most) text = text.substr(0, most - 3) + "...";
  return text;
}

}  // namespace

std::string brief_json(const json& value) {
  return cut_json(value, 60);
}

std::string describe_json_value(const json& value) {
  if (value.is_object()) return "an object";
  if (value.is_array()) return "an array";
  return cut_json(value, 40);
}

JsonReader::JsonReader(const json& object, std::string file, std::string path)
    : json_(&object), file_(std::move(file)), path_(std::move(path)) {
  if (!json_->is_object()) {
    throw InputError(fmt::format("{}: {}expected a JSON object, got {}", file_,
                                 path_.empty() ? "" : path_ + ": ", describe_json_value(*json_)));
  }
}

json JsonReader::parse_file(const std::filesystem::path& file) {
  std::error_code ec;
  if (std::filesystem::is_directory(file, ec)) {
    throw InputError(fmt::format("{}: is a directory; expected a JSON file", file.string()));
  }
  std::ifstream in(file);
  if (!in) {
    throw InputError(
        fmt::format("{}: cannot open file ({})", file.string(),
                    std::filesystem::exists(file, ec) || ec ? "not readable" : "no such file"));
  }
  std::stringstream buffer;
  if (std::filesystem::is_regular_file(file, ec)) {
    buffer << in.rdbuf();
  } else {
    // A pipe or a device (--plan <(...), /dev/stdin) is read up to a bound: /dev/zero would fill
    // the memory before the parser saw its first byte.
    constexpr std::streamsize kMostPiped = std::streamsize{1} << 28;
    std::string chunk(std::size_t{1} << 16, '\0');
    std::streamsize total = 0;
    while (in.read(chunk.data(), static_cast<std::streamsize>(chunk.size())) || in.gcount() > 0) {
      total += in.gcount();
      if (total > kMostPiped) {
        throw InputError(fmt::format(
            "{}: more than 256 MiB from a pipe or device, not a regular file: expected a JSON file "
            "(a larger one as a regular file)",
            file.string()));
      }
      buffer.write(chunk.data(), in.gcount());
    }
  }
  // A field given twice in one object would otherwise keep its last value in silence
  // (nlohmann's parser overwrites it): refused, naming its path. The objects being parsed,
  // innermost last, each with the keys seen so far (few per object: a linear search).
  struct Frame {
    bool array = false;
    std::vector<std::string> keys;
  };
  std::vector<Frame> open;
  // Where the parser stands, as "line N".
  auto line_here = [&buffer] {
    const auto at =
        static_cast<std::size_t>(buffer.rdbuf()->pubseekoff(0, std::ios::cur, std::ios::in));
    const std::string text = buffer.str().substr(0, at);
    return fmt::format("line {}", std::count(text.begin(), text.end(), '\n') + 1);
  };
  const json::parser_callback_t refuse_repeats = [&](int, json::parse_event_t event, json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start:
      case json::parse_event_t::array_start:
        // No file of dtsim's or dtexec's nests a tenth as deep; far deeper, a value's printing
        // and comparison (recursive in nlohmann's json) would exhaust the stack.
        if (open.size() >= kMaxJsonDepth) {
          throw InputError(
              fmt::format("{}: nested more than {} levels deep ({}); expected a "
                          "JSON file of dtsim's or dtexec's",
                          file.string(), kMaxJsonDepth, line_here()));
        }
        open.push_back({event == json::parse_event_t::array_start, {}});
        break;
      case json::parse_event_t::object_end:
      case json::parse_event_t::array_end:
        if (!open.empty()) open.pop_back();
        break;
      case json::parse_event_t::key: {
        const auto& key = parsed.get_ref<const std::string&>();
        auto& keys = open.back().keys;
        if (std::find(keys.begin(), keys.end(), key) != keys.end()) {
          std::string path;
          for (std::size_t i = 0; i + 1 < open.size(); ++i) {
            path += open[i].array ? "[]" : (path.empty() ? "" : ".") + open[i].keys.back();
          }
          // Where the parser stands: just past the second key's closing quote.
          const auto at =
              static_cast<std::size_t>(buffer.rdbuf()->pubseekoff(0, std::ios::cur, std::ios::in));
          const std::string text = buffer.str().substr(0, at);
          std::string where =
              fmt::format("line {}", std::count(text.begin(), text.end(), '\n') + 1);
          // The key's column where it is written as read (no escapes): its opening quote.
          const std::string quoted = '"' + key + '"';
          if (text.size() >= quoted.size() &&
              text.compare(text.size() - quoted.size(), quoted.size(), quoted) == 0) {
            const auto line_start = text.rfind('\n');
            where += fmt::format(", column {}",
                                 text.size() - quoted.size() + 1 -
                                     (line_start == std::string::npos ? 0 : line_start + 1));
          }
          throw InputError(
              fmt::format("{}: {}{} ({}): the field appears twice in one object; expected it once",
                          file.string(), path.empty() ? "" : path + ".", key, where));
        }
        keys.push_back(key);
        break;
      }
      default:
        break;
    }
    return true;
  };
  try {
    return json::parse(buffer, refuse_repeats);
  } catch (const json::exception& e) {
    // A parse error, or a number too large for a double (out_of_range.406). nlohmann's message
    // carries line and column ("[json.exception.parse_error.101] parse error at line 3,
    // column 5: ..."); keep the part after the tag.
    std::string what = e.what();
    if (auto pos = what.find("] "); pos != std::string::npos) what = what.substr(pos + 2);
    throw InputError(fmt::format("{}: malformed JSON: {}", file.string(), what));
  }
}

std::string JsonReader::where(std::string_view key) const {
  if (path_.empty()) return fmt::format("{}: {}", file_, key);
  return fmt::format("{}: {}.{}", file_, path_, key);
}

bool JsonReader::has(std::string_view key) const {
  return json_->contains(key) && !(*json_)[std::string(key)].is_null();
}

void JsonReader::fail(std::string_view key, std::string_view message) const {
  throw InputError(fmt::format("{}: {}", where(key), message));
}

const json& JsonReader::at(std::string_view key) const {
  if (!has(key)) fail(key, "required field is missing");
  return json_->at(std::string(key));
}

std::string JsonReader::string(std::string_view key) const {
  const json& v = at(key);
  if (!v.is_string()) fail(key, fmt::format("expected a string, got {}", describe_json_value(v)));
  return v.get<std::string>();
}

std::string JsonReader::name(std::string_view key) const {
  const std::string s = string(key);
  if (s.empty()) fail(key, "expected a name, got an empty string");
  if (std::any_of(s.begin(), s.end(), [](char c) {
        const auto u = static_cast<unsigned char>(c);
        return u < 0x20 || u == 0x7f;
      })) {
    fail(key, "expected a name without control characters (a newline, a tab, a NUL)");
  }
  return s;
}

std::string JsonReader::string_or(std::string_view key, std::string_view fallback) const {
  return has(key) ? string(key) : std::string(fallback);
}

bool JsonReader::boolean(std::string_view key) const {
  const json& v = at(key);
  if (!v.is_boolean()) {
    fail(key, fmt::format("expected true or false, got {}", describe_json_value(v)));
  }
  return v.get<bool>();
}

bool JsonReader::boolean_or(std::string_view key, bool fallback) const {
  return has(key) ? boolean(key) : fallback;
}

std::optional<std::int64_t> JsonReader::as_whole(const json& v, std::int64_t least) {
  // Integers written as 1e9 are accepted when they are whole numbers.
  if (v.is_number_integer() && !v.is_number_unsigned() && v.get<std::int64_t>() >= least) {
    return v.get<std::int64_t>();
  }
  if (v.is_number_unsigned() && v.get<std::uint64_t>() >= static_cast<std::uint64_t>(least) &&
      v.get<std::uint64_t>() <= static_cast<std::uint64_t>(INT64_MAX)) {
    return static_cast<std::int64_t>(v.get<std::uint64_t>());
  }
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (d >= static_cast<double>(least) && d < 9.2e18 && std::floor(d) == d) {
      return static_cast<std::int64_t>(d);
    }
  }
  return std::nullopt;
}

std::int64_t JsonReader::as_positive_int(const json& v, std::string_view key) const {
  if (const auto n = as_whole(v, 1)) return *n;
  fail(key, fmt::format("expected a positive integer, got {}", describe_json_value(v)));
}

std::int64_t JsonReader::non_negative_int_up_to(std::string_view key, std::int64_t max) const {
  const json& v = at(key);
  const auto n = as_whole(v, 0);
  if (!n || *n > max) {
    fail(key,
         fmt::format("expected a whole number from 0 to {}, got {}", max, describe_json_value(v)));
  }
  return *n;
}

std::int64_t JsonReader::positive_int(std::string_view key) const {
  return as_positive_int(at(key), key);
}

std::int64_t JsonReader::positive_int_or(std::string_view key, std::int64_t fallback) const {
  return has(key) ? positive_int(key) : fallback;
}

std::int64_t JsonReader::positive_int_up_to(std::string_view key, std::int64_t max) const {
  const std::int64_t v = positive_int(key);
  if (v > max) fail(key, fmt::format("expected at most {}, got {}", max, v));
  return v;
}

std::int64_t JsonReader::positive_int_up_to_or(std::string_view key, std::int64_t max,
                                               std::int64_t fallback) const {
  return has(key) ? positive_int_up_to(key, max) : fallback;
}

double JsonReader::positive_number(std::string_view key) const {
  const json& v = at(key);
  if (!v.is_number() || !is_figure(v.get<double>())) {
    fail(key, fmt::format("expected a positive number (from {:g} to {:g}), got {}", kSmallestFigure,
                          kLargestFigure, describe_json_value(v)));
  }
  return v.get<double>();
}

double JsonReader::non_negative_number(std::string_view key) const {
  const json& v = at(key);
  if (!v.is_number() || !(v.get<double>() == 0 || is_figure(v.get<double>()))) {
    fail(key, fmt::format("expected a number >= 0 (0, or from {:g} to {:g}), got {}",
                          kSmallestFigure, kLargestFigure, describe_json_value(v)));
  }
  return v.get<double>();
}

std::string JsonReader::choice(std::string_view key,
                               std::initializer_list<std::string_view> allowed) const {
  const json& v = at(key);
  std::string known = fmt::format("{}", fmt::join(allowed, ", "));
  if (!v.is_string()) {
    fail(key, fmt::format("expected one of {}, got {}", known, describe_json_value(v)));
  }
  const std::string s = v.get<std::string>();
  for (std::string_view a : allowed) {
    if (s == a) return s;
  }
  fail(key, fmt::format("expected one of {}, got \"{}\"", known, s));
}

Figure JsonReader::figure(std::string_view key, bool allow_zero) const {
  const JsonReader f = object(key);
  f.expect_only({"value", "source", "note"});
  Figure out;
  out.value = allow_zero ? f.non_negative_number("value") : f.positive_number("value");
  out.source = f.string("source");
  if (out.source.empty()) f.fail("source", "expected a non-empty source (datasheet, paper, ...)");
  return out;
}

namespace {

// Whether `value` lies in [least, most] (or is 0 where allowed); else what was expected.
std::optional<std::string> outside(double value, double least, double most, std::string_view unit,
                                   bool allow_zero) {
  if ((allow_zero && value == 0) || (value >= least && value <= most)) return std::nullopt;
  return fmt::format("expected {} from {:g} to {:g}{}, got {:g} (a unit mistake?)", unit, least,
                     most, allow_zero ? ", or 0" : "", value);
}

}  // namespace

Figure JsonReader::figure_within(std::string_view key, double least, double most,
                                 std::string_view unit, bool allow_zero) const {
  // A finite number outside the bounds (0 and negative ones too) is said with the field's own
  // bounds, not the generic figure's (which read "from 1e-12 to 1e+21" for a bandwidth of 0).
  const JsonReader f = object(key);
  if (f.has("value") && f.raw().at("value").is_number() &&
      std::isfinite(f.raw().at("value").get<double>())) {
    if (auto why = outside(f.raw().at("value").get<double>(), least, most, unit, allow_zero)) {
      f.fail("value", *why);
    }
  }
  return figure(key, allow_zero);
}

double JsonReader::number_within(std::string_view key, double least, double most,
                                 std::string_view unit, bool allow_zero) const {
  if (has(key) && raw().at(std::string(key)).is_number() &&
      std::isfinite(raw().at(std::string(key)).get<double>())) {
    if (auto why =
            outside(raw().at(std::string(key)).get<double>(), least, most, unit, allow_zero)) {
      fail(key, *why);
    }
  }
  return allow_zero ? non_negative_number(key) : positive_number(key);
}

std::optional<Figure> JsonReader::optional_figure(std::string_view key, bool allow_zero) const {
  if (!has(key)) return std::nullopt;
  return figure(key, allow_zero);
}

const json& JsonReader::array(std::string_view key) const {
  const json& v = at(key);
  if (!v.is_array()) fail(key, fmt::format("expected an array, got {}", describe_json_value(v)));
  return v;
}

JsonReader JsonReader::object(std::string_view key) const {
  const json& v = at(key);
  if (!v.is_object()) fail(key, fmt::format("expected an object, got {}", describe_json_value(v)));
  std::string path = path_.empty() ? std::string(key) : fmt::format("{}.{}", path_, key);
  return JsonReader(v, file_, std::move(path));
}

std::vector<std::int64_t> JsonReader::positive_int_array(std::string_view key) const {
  const json& v = at(key);
  if (!v.is_array() || v.empty()) {
    fail(key, fmt::format("expected a non-empty array of positive integers, got {}",
                          describe_json_value(v)));
  }
  std::vector<std::int64_t> out;
  for (std::size_t i = 0; i < v.size(); ++i) {
    out.push_back(as_positive_int(v[i], fmt::format("{}[{}]", key, i)));
  }
  return out;
}

std::vector<std::int64_t> JsonReader::positive_int_array_up_to(std::string_view key,
                                                               std::int64_t max) const {
  std::vector<std::int64_t> out = positive_int_array(key);
  for (std::size_t i = 0; i < out.size(); ++i) {
    if (out[i] > max) {
      fail(fmt::format("{}[{}]", key, i), fmt::format("expected at most {}, got {}", max, out[i]));
    }
  }
  return out;
}

std::vector<std::int64_t> JsonReader::non_negative_int_array_up_to(std::string_view key,
                                                                   std::int64_t max) const {
  const json& v = at(key);
  if (!v.is_array()) {
    fail(key, fmt::format("expected an array of whole numbers from 0 to {}, got {}", max,
                          describe_json_value(v)));
  }
  std::vector<std::int64_t> out;
  for (std::size_t i = 0; i < v.size(); ++i) {
    const auto n = as_whole(v[i], 0);
    if (!n || *n > max) {
      fail(fmt::format("{}[{}]", key, i),
           fmt::format("expected a whole number from 0 to {}, got {}", max,
                       describe_json_value(v[i])));
    }
    out.push_back(*n);
  }
  return out;
}

std::vector<std::string> JsonReader::string_array(std::string_view key) const {
  const json& v = at(key);
  if (!v.is_array()) {
    fail(key, fmt::format("expected an array of strings, got {}", describe_json_value(v)));
  }
  std::vector<std::string> out;
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (!v[i].is_string()) {
      fail(fmt::format("{}[{}]", key, i),
           fmt::format("expected a string, got {}", describe_json_value(v[i])));
    }
    out.push_back(v[i].get<std::string>());
  }
  return out;
}

void refuse_other_kind(const nlohmann::json& j, const std::string& file,
                       std::string_view expected) {
  if (!j.is_object()) return;
  struct Kind {
    std::string_view name;
    std::vector<std::string_view> fields;  // all of them mark the kind
    std::string_view taken_by;
  };
  static const Kind kinds[] = {
      {"model", {"layers", "hidden"}, "--model takes it"},
      {"model", {"model_type"}, "--model takes it (a Hugging Face config.json)"},
      {"cluster", {"devices_per_node"}, "--cluster takes it"},
      {"device", {"peak_flops"}, "a cluster file's \"device\" names it (and --vary device=)"},
      {"calibration profile", {"gemm"}, "--profile takes it"},
      {"plan", {"dp", "tp", "pp"}, "--plan takes it"},
      {"trace", {"traceEvents"}, "dtsim validate --predicted and --measured take it"},
  };
  const auto marked = [&](const Kind& k) {
    return std::all_of(k.fields.begin(), k.fields.end(),
                       [&](std::string_view f) { return j.contains(f); });
  };
  for (const Kind& k : kinds) {
    if (k.name == expected && marked(k)) return;
  }
  for (const Kind& k : kinds) {
    if (k.name == expected || !marked(k)) continue;
    const auto a = [](std::string_view kind) {
      return fmt::format("a {}{}", kind, kind == "calibration profile" ? "" : " file");
    };
    throw InputError(fmt::format("{}: {} (it has {}), not {}: {}", file, a(k.name),
                                 fmt::join(k.fields, " and "), a(expected), k.taken_by));
  }
}

void JsonReader::refuse_nulls() const {
  if (!json_->is_object()) return;
  for (const auto& [name, value] : json_->items()) {
    if (value.is_null()) {
      fail(name, "expected a value, got null (leave the field out where there is none)");
    }
  }
}

void JsonReader::expect_only(std::initializer_list<std::string_view> known) const {
  for (const auto& [name, value] : json_->items()) {
    bool ok = false;
    for (std::string_view k : known) ok = ok || name == k;
    if (!ok) {
      fail(name, fmt::format("unknown field (known fields: {})", fmt::join(known, ", ")));
    }
  }
}

}  // namespace dtsim
