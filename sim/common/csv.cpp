#include "sim/common/csv.hpp"

#include <fmt/format.h>

#include <fstream>

#include "sim/common/error.hpp"

namespace dtsim {

namespace {
std::vector<std::string> split(const std::string& line) {
  std::vector<std::string> out;
  std::string cell;
  bool quoted = false;
  for (char c : line) {
    if (c == '"') {
      quoted = !quoted;
    } else if (c == ',' && !quoted) {
      out.push_back(cell);
      cell.clear();
    } else if (c != '\r') {
      cell += c;
    }
  }
  out.push_back(cell);
  return out;
}
}  // namespace

std::vector<CsvRow> read_csv(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in) throw InputError(fmt::format("{}: cannot open file", path.string()));
  std::string line;
  if (!std::getline(in, line)) throw InputError(fmt::format("{}: empty file", path.string()));
  const auto header = split(line);
  std::vector<CsvRow> rows;
  int number = 1;
  while (std::getline(in, line)) {
    ++number;
    if (line.empty()) continue;
    const auto cells = split(line);
    if (cells.size() > header.size()) {
      throw InputError(fmt::format("{}: line {}: {} fields, the header has {}", path.string(),
                                   number, cells.size(), header.size()));
    }
    CsvRow row;
    for (std::size_t i = 0; i < cells.size(); ++i) row[header[i]] = cells[i];
    rows.push_back(std::move(row));
  }
  return rows;
}

std::string csv_field(const std::string& text) {
  if (text.find_first_of(",\"\r\n") == std::string::npos) return text;
  std::string out = "\"";
  for (const char c : text) {
    if (c == '"') out += '"';
    out += c;
  }
  return out + '"';
}

}  // namespace dtsim
