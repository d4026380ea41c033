// Reading the validation tables (validation/*.csv): a header row, then rows of comma-separated
// fields; a field in double quotes may hold commas. No escaped quotes inside fields.
#pragma once

#include <filesystem>
#include <map>
#include <string>
#include <vector>

namespace dtsim {

using CsvRow = std::map<std::string, std::string>;  // column name -> field

// Throws InputError naming the file when it cannot be read or a row has more fields than the
// header.
std::vector<CsvRow> read_csv(const std::filesystem::path& path);

// A field to write (RFC 4180): as it is, or in double quotes with its own doubled where it holds
// a comma, a double quote or a line break (a varied cluster's file name may).
std::string csv_field(const std::string& text);

}  // namespace dtsim
