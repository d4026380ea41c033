#include "sim/report/table.hpp"

#include <fmt/format.h>

#include <algorithm>

#include "sim/common/error.hpp"

namespace dtsim::report {

namespace {
// Display width of UTF-8 text: count code points, not bytes.
std::size_t width(const std::string& s) {
  return static_cast<std::size_t>(std::count_if(
      s.begin(), s.end(), [](char c) { return (static_cast<unsigned char>(c) & 0xC0) != 0x80; }));
}
}  // namespace

Table::Table(std::vector<std::string> headers)
    : headers_(std::move(headers)), left_(headers_.size(), false) {}

void Table::set_units(std::vector<std::string> units) {
  DTSIM_ASSERT(units.size() == headers_.size(), "one unit per column");
  units_ = std::move(units);
}

void Table::align_left(std::size_t column) {
  left_.at(column) = true;
}

void Table::add_row(std::vector<std::string> cells) {
  DTSIM_ASSERT(cells.size() == headers_.size(), "one cell per column");
  rows_.push_back(std::move(cells));
}

std::string Table::render() const {
  std::vector<std::size_t> w(headers_.size());
  auto widen = [&](const std::vector<std::string>& cells) {
    for (std::size_t i = 0; i < cells.size(); ++i) w[i] = std::max(w[i], width(cells[i]));
  };
  widen(headers_);
  if (!units_.empty()) widen(units_);
  for (const auto& r : rows_) widen(r);

  std::string out;
  auto line = [&](const std::vector<std::string>& cells) {
    std::string l;
    for (std::size_t i = 0; i < cells.size(); ++i) {
      const std::string pad(w[i] - width(cells[i]), ' ');
      if (i > 0) l += "  ";
      l += left_[i] ? cells[i] + pad : pad + cells[i];
    }
    while (!l.empty() && l.back() == ' ') l.pop_back();
    out += l + "\n";
  };
  line(headers_);
  if (!units_.empty()) line(units_);
  for (const auto& r : rows_) line(r);
  return out;
}

std::string note_line(const std::string& note) {
  return note.rfind("warning: ", 0) == 0 ? note : "note: " + note;
}

}  // namespace dtsim::report
