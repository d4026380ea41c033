#include "sim/report/table.hpp"

#include "tests/test_util.hpp"

TEST_CASE("tables align columns under a units line", "[report]") {
  dtsim::report::Table t({"name", "value"});
  t.set_units({"", "GiB"});
  t.align_left(0);
  t.add_row({"a", "1.00"});
  t.add_row({"longer", "123.45"});
  CHECK(t.render() ==
        "name     value\n"
        "           GiB\n"
        "a         1.00\n"
        "longer  123.45\n");
}
