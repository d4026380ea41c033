#include "sim/common/json_reader.hpp"

#include <nlohmann/json.hpp>

#include "sim/common/csv.hpp"
#include "sim/common/error.hpp"
#include "sim/common/units.hpp"
#include "tests/test_util.hpp"

using dtsim::InputError;
using dtsim::JsonReader;
using nlohmann::json;

TEST_CASE("malformed JSON names the file, line and column", "[common]") {
  dtsim::test::TempFile f("broken.json", "{\n  \"a\": 1,\n  \"b\": \n}");
  DTSIM_REQUIRE_THROWS_CONTAINING(JsonReader::parse_file(f.path()), InputError, "broken.json");
  DTSIM_REQUIRE_THROWS_CONTAINING(JsonReader::parse_file(f.path()), InputError, "line 4");
}

TEST_CASE("a field given twice in one object is refused, naming its path", "[common]") {
  // nlohmann's parser keeps the last of them: a model's "layers": 2, "layers": 7 read as 7.
  dtsim::test::TempFile top("twice.json", R"({"layers": 2, "hidden": 8, "layers": 7})");
  DTSIM_REQUIRE_THROWS_CONTAINING(
      JsonReader::parse_file(top.path()), InputError,
      "twice.json: layers (line 1, column 28): the field appears twice");
  dtsim::test::TempFile nested("twice_nested.json",
                               R"({"a": {"b": [{"c": 1}, {"c": 2, "d": 3, "c": 4}]}, "e": 5})");
  DTSIM_REQUIRE_THROWS_CONTAINING(JsonReader::parse_file(nested.path()), InputError,
                                  "twice_nested.json: a.b[].c (line 1, column 41): the field "
                                  "appears twice");
  // Over lines; a key written with an escape gets its line only.
  dtsim::test::TempFile lines("twice_lines.json",
                              "{\n  \"name\": \"x\",\n  \"layers\": 2,\n"
                              "    \"layers\": 7\n}\n");
  DTSIM_REQUIRE_THROWS_CONTAINING(JsonReader::parse_file(lines.path()), InputError,
                                  "twice_lines.json: layers (line 4, column 5): the field");
  dtsim::test::TempFile escaped("twice_escaped.json", R"({"ab": 1,
"a\u0062": 2})");
  DTSIM_REQUIRE_THROWS_CONTAINING(JsonReader::parse_file(escaped.path()), InputError,
                                  "twice_escaped.json: ab (line 2): the field");
  // The same key in sibling objects, or at another depth, is not a repeat.
  dtsim::test::TempFile fine("siblings.json", R"({"c": {"c": 1}, "d": [{"c": 1}, {"c": 2}]})");
  const json j = JsonReader::parse_file(fine.path());
  CHECK(j.at("d").at(1).at("c") == 2);
}

TEST_CASE("a missing file is an input error", "[common]") {
  DTSIM_REQUIRE_THROWS_CONTAINING(JsonReader::parse_file("/nonexistent/x.json"), InputError,
                                  "/nonexistent/x.json: cannot open file (no such file)");
}

TEST_CASE("typed fields report file, path and what was expected", "[common]") {
  const json j = json::parse(R"({"n": -1, "s": 3, "b": "yes", "o": {"k": 0}, "f": 1.5,
                                 "big": 1e9, "fig": {"value": 2}, "c": "x"})");
  const JsonReader r(j, "f.json");
  DTSIM_REQUIRE_THROWS_CONTAINING(r.positive_int("n"), InputError,
                                  "f.json: n: expected a positive integer, got -1");
  DTSIM_REQUIRE_THROWS_CONTAINING(r.positive_int("f"), InputError, "got 1.5");
  CHECK(r.positive_int("big") == 1000000000);
  DTSIM_REQUIRE_THROWS_CONTAINING(r.string("s"), InputError, "f.json: s: expected a string, got 3");
  DTSIM_REQUIRE_THROWS_CONTAINING(r.boolean("b"), InputError, "expected true or false");
  DTSIM_REQUIRE_THROWS_CONTAINING(r.object("o").positive_int("k"), InputError,
                                  "f.json: o.k: expected a positive integer, got 0");
  DTSIM_REQUIRE_THROWS_CONTAINING(r.positive_int("missing"), InputError,
                                  "f.json: missing: required field is missing");
  DTSIM_REQUIRE_THROWS_CONTAINING(r.figure("fig"), InputError, "fig.source: required field");
  DTSIM_REQUIRE_THROWS_CONTAINING(r.choice("c", {"gelu", "swiglu"}), InputError,
                                  "expected one of gelu, swiglu, got \"x\"");
  CHECK(r.at("f") == 1.5);
  DTSIM_REQUIRE_THROWS_CONTAINING(r.at("missing"), InputError,
                                  "f.json: missing: required field is missing");
  DTSIM_REQUIRE_THROWS_CONTAINING(r.array("o"), InputError,
                                  "f.json: o: expected an array, got an object");
}

TEST_CASE("bounded integers name the bound", "[common]") {
  const json j = json::parse(R"({"n": 5, "a": [1, 2, 9], "z": 0})");
  const JsonReader r(j, "f.json");
  CHECK(r.positive_int_up_to("n", 5) == 5);
  CHECK(r.positive_int_up_to_or("missing", 5, 3) == 3);
  DTSIM_REQUIRE_THROWS_CONTAINING(r.positive_int_up_to("n", 4), InputError,
                                  "f.json: n: expected at most 4, got 5");
  DTSIM_REQUIRE_THROWS_CONTAINING(r.positive_int_up_to("z", 4), InputError,
                                  "f.json: z: expected a positive integer, got 0");
  DTSIM_REQUIRE_THROWS_CONTAINING(r.positive_int_array_up_to("a", 8), InputError,
                                  "f.json: a[2]: expected at most 8, got 9");
  // From 0: zero and whole floats pass, a negative, a fraction or one past the bound do not.
  const json w = json::parse(R"({"zero": 0, "e": 1e3, "neg": -1, "half": 0.5, "s": "3"})");
  const JsonReader wr(w, "w.json");
  CHECK(wr.non_negative_int_up_to("zero", 4) == 0);
  CHECK(wr.non_negative_int_up_to("e", 1000) == 1000);
  DTSIM_REQUIRE_THROWS_CONTAINING(wr.non_negative_int_up_to("e", 999), InputError,
                                  "w.json: e: expected a whole number from 0 to 999, got 1000");
  for (const char* key : {"neg", "half", "s", "missing"}) {
    INFO(key);
    CHECK_THROWS_AS(wr.non_negative_int_up_to(key, 4), InputError);
  }
}

TEST_CASE("unknown fields are rejected with the known ones listed", "[common]") {
  const json j = json::parse(R"({"layers": 2, "hiden": 3})");
  const JsonReader r(j, "m.json");
  DTSIM_REQUIRE_THROWS_CONTAINING(r.expect_only({"layers", "hidden"}), InputError,
                                  "m.json: hiden: unknown field (known fields: layers, hidden)");
}

TEST_CASE("numbers are formatted for humans", "[common]") {
  CHECK(dtsim::format_count(0) == "0");
  CHECK(dtsim::format_count(999) == "999");
  CHECK(dtsim::format_count(1000) == "1,000");
  CHECK(dtsim::format_count(124439808) == "124,439,808");
  CHECK(dtsim::format_count(12345678) == "12,345,678");
  CHECK(dtsim::format_gib(1.5 * dtsim::kGiB) == "1.50 GiB");
  CHECK(dtsim::format_gib(68.0 * 1024 * 1024) == "68.0 MiB");  // under a GiB: a CPU rank's
  CHECK(dtsim::format_gib(0) == "0.00 GiB");
  CHECK(dtsim::format_si(6.738e9) == "6.74 G");
  CHECK(dtsim::format_seconds(21.40812) == "21.408");
  CHECK(dtsim::format_seconds(0.1) == "0.100");
  CHECK(dtsim::format_seconds(0.000157) == "0.000157");
  CHECK(dtsim::format_seconds(0) == "0.000");
  CHECK(dtsim::format_rate(47111.4) == "47111");
  CHECK(dtsim::format_rate(99.96) == "100");
  CHECK(dtsim::format_rate(12.345) == "12.3");
  CHECK(dtsim::format_rate(0.011548) == "0.0115");  // a step of days: not "0 tokens/s"
  CHECK(dtsim::format_rate(0) == "0");
  CHECK(dtsim::format_duration(0) == "0 s");
  CHECK(dtsim::format_duration(1.23456) == "1.235 s");
  CHECK(dtsim::format_duration(0.1) == "0.100 s");
  CHECK(dtsim::format_duration(0.0123) == "12.3 ms");
  CHECK(dtsim::format_duration(0.000412) == "0.412 ms");
  CHECK(dtsim::format_duration(4.12e-6) == "4.12 us");
  CHECK(dtsim::format_duration(-0.002) == "-2.00 ms");  // three digits, its zeros kept
  CHECK(dtsim::format_duration(0.09996) == "0.100 s");  // rounded up into the next unit
  CHECK(dtsim::format_duration(9.996e-5) == "0.100 ms");
  CHECK(dtsim::format_duration(3e-11) == "0.0300 ns");
  CHECK(dtsim::format_seconds(0.0023) == "0.00230");  // so that a column lines up
}

TEST_CASE("a CSV field is quoted where it must be, its quotes doubled", "[common]") {
  CHECK(dtsim::csv_field("selene") == "selene");
  CHECK(dtsim::csv_field("") == "");
  CHECK(dtsim::csv_field("a,b") == "\"a,b\"");
  CHECK(dtsim::csv_field("\"odd,selene") == "\"\"\"odd,selene\"");
  CHECK(dtsim::csv_field("we\"ird.json") == "\"we\"\"ird.json\"");
  CHECK(dtsim::csv_field("two\nlines") == "\"two\nlines\"");
}
