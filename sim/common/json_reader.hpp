// Typed, validated access to one JSON object of one input file. Every failure throws InputError
// naming the file, the field path and the expectation:
//   "topologies/x.json: inter_node.nodes_per_leaf: expected a positive integer, got -1"
#pragma once

#include <cstdint>
#include <filesystem>
#include <initializer_list>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace dtsim {

// What a figure of this domain can be (seconds, bytes, FLOP/s, fractions, prices): values
// outside turn into inf, NaN or a flow solver's failure downstream, never into a prediction.
inline constexpr double kSmallestFigure = 1e-12;
inline constexpr double kLargestFigure = 1e21;
// Within those (false for NaN).
constexpr bool is_figure(double v) {
  return v >= kSmallestFigure && v <= kLargestFigure;
}

// A number with the place it comes from (datasheet, paper, calibration run).
struct Figure {
  double value = 0.0;
  std::string source;
};

class JsonReader {
 public:
  JsonReader(const nlohmann::json& object, std::string file, std::string path = {});

  // Reads and parses a whole file; malformed JSON names the file, line and column.
  static nlohmann::json parse_file(const std::filesystem::path& file);

  const std::string& file() const { return file_; }
  const nlohmann::json& raw() const { return *json_; }
  // "file: path.key" for messages.
  std::string where(std::string_view key) const;
  bool has(std::string_view key) const;

  std::string string(std::string_view key) const;
  std::string string_or(std::string_view key, std::string_view fallback) const;
  // A name that tables and messages print: a non-empty string without control characters
  // (a newline split a table's header, a NUL ended it).
  std::string name(std::string_view key) const;
  bool boolean(std::string_view key) const;
  bool boolean_or(std::string_view key, bool fallback) const;
  std::int64_t positive_int(std::string_view key) const;
  std::int64_t positive_int_or(std::string_view key, std::int64_t fallback) const;
  // A positive integer no larger than `max` (a sanity bound that keeps products in 64 bits).
  std::int64_t positive_int_up_to(std::string_view key, std::int64_t max) const;
  std::int64_t positive_int_up_to_or(std::string_view key, std::int64_t max,
                                     std::int64_t fallback) const;
  // A whole number from 0 to `max`.
  std::int64_t non_negative_int_up_to(std::string_view key, std::int64_t max) const;
  double positive_number(std::string_view key) const;
  double non_negative_number(std::string_view key) const;
  // One of `allowed` (exact spelling); the message lists them.
  std::string choice(std::string_view key, std::initializer_list<std::string_view> allowed) const;
  // {"value": number > 0 (or >= 0 with allow_zero), "source": non-empty string}
  Figure figure(std::string_view key, bool allow_zero = false) const;
  std::optional<Figure> optional_figure(std::string_view key, bool allow_zero = false) const;
  // A figure whose value lies in [least, most] (or is 0 where allow_zero): bounds that only a
  // unit mistake leaves (Gbit/s typed for bytes/s, microseconds for seconds), not a model's
  // limits. `unit` names the unit the message asks for ("bytes/s").
  Figure figure_within(std::string_view key, double least, double most, std::string_view unit,
                       bool allow_zero = false) const;
  // The same bounds on a plain number (a calibration profile's fields).
  double number_within(std::string_view key, double least, double most, std::string_view unit,
                       bool allow_zero = false) const;
  JsonReader object(std::string_view key) const;
  // A required field of any type, and one that must be an array.
  const nlohmann::json& at(std::string_view key) const;
  const nlohmann::json& array(std::string_view key) const;
  std::vector<std::int64_t> positive_int_array(std::string_view key) const;
  // Every element in 1..max.
  std::vector<std::int64_t> positive_int_array_up_to(std::string_view key, std::int64_t max) const;
  std::vector<std::string> string_array(std::string_view key) const;
  // An array (empty too) of whole numbers from 0 to `max`, as given.
  std::vector<std::int64_t> non_negative_int_array_up_to(std::string_view key,
                                                         std::int64_t max) const;

  // Rejects fields not in `known` (a typo must not be silently ignored).
  void expect_only(std::initializer_list<std::string_view> known) const;
  // Rejects fields whose value is null, in a file that one tool writes and that never holds
  // one (a calibration profile): has() takes a null as absent, as a Hugging Face config means
  // it, which would drop such a field silently.
  void refuse_nulls() const;
  [[noreturn]] void fail(std::string_view key, std::string_view message) const;

 private:
  std::int64_t as_positive_int(const nlohmann::json& v, std::string_view key) const;
  // A whole number (1e9 too) >= `least` (0 or 1), else nullopt.
  static std::optional<std::int64_t> as_whole(const nlohmann::json& v, std::int64_t least);

  const nlohmann::json* json_;
  std::string file_;
  std::string path_;
};

// A short rendering of a JSON value for error messages ("-1", "\"abc\"", "an object").
// Throws InputError where `j` is plainly another kind of dtsim file than `expected` ("model",
// "cluster", "device", "calibration profile", "plan"): a field only that kind has, and none of
// the expected kind's. Its message says which kind and which flag takes it, where the list of
// unknown fields would leave a reader to guess.
void refuse_other_kind(const nlohmann::json& j, const std::string& file, std::string_view expected);

std::string describe_json_value(const nlohmann::json& value);
// A JSON value as text, cut at 60 characters ("[4, 4, 4, ...]"): arrays shown, not named.
std::string brief_json(const nlohmann::json& value);
// A JSON value as the text the tools write (indent as nlohmann's dump; -1: one line), any
// string that is not UTF-8 (a file name of other bytes, copied into a note) written with U+FFFD
// in place of its bad bytes, where nlohmann's dump would throw.
std::string json_text(const nlohmann::json& value, int indent = -1);
// The deepest nesting JsonReader::parse_file reads (objects and arrays).
inline constexpr std::size_t kMaxJsonDepth = 512;

}  // namespace dtsim
