// Plain-text tables for humans: a header line, a units line, aligned columns.
#pragma once

#include <string>
#include <vector>

namespace dtsim::report {

class Table {
 public:
  explicit Table(std::vector<std::string> headers);
  // The line under the headers that names each column's unit ("GiB", "ms", "").
  void set_units(std::vector<std::string> units);
  // Columns are right-aligned (numbers) except those marked here.
  void align_left(std::size_t column);
  void add_row(std::vector<std::string> cells);
  std::string render() const;

 private:
  std::vector<std::string> headers_;
  std::vector<std::string> units_;
  std::vector<bool> left_;
  std::vector<std::vector<std::string>> rows_;
};

// A note as a line of text output: "note: X", or "warning: X" for a note that is a warning
// (one that starts so), not "note: warning: X".
std::string note_line(const std::string& note);

}  // namespace dtsim::report
