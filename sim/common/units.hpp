// Units. Code keeps seconds, bytes and FLOPs; these helpers turn them into what humans read.
#pragma once

#include <cstdint>
#include <string>

namespace dtsim {

inline constexpr double kMiB = 1024.0 * 1024.0;
inline constexpr double kGiB = 1024.0 * kMiB;
inline constexpr double kGB = 1e9;

// "12.34 GiB"; under a GiB "68.0 MiB"
std::string format_gib(double bytes);
// "1,234,567"
std::string format_count(std::uint64_t n);
// "6.74 B", "124.4 M", "155.97 K" (params, FLOPs)
std::string format_si(double value);
// A time difference for a sentence: "1.234 s" from 0.1 s up, "12.3 ms" or "0.412 ms" from
// 0.1 ms, else "41.2 us"; "0 s" for zero. A small model's differences do not read "0.000 s".
std::string format_duration(double seconds);
// Seconds for a column or a headline, always in s: "21.408" from 0.1 s up, else three
// significant digits ("0.000157"), so that a small model's steps do not read "0.000".
std::string format_seconds(double seconds);
// A rate for a column or a headline (tokens/s), or an amount (USD): whole from 100 up, else three
// significant digits ("0.0115"), so that a step of days does not read "0 tokens/s".
std::string format_rate(double per_second);
// A share as a percentage: "42.4%" from 0.1% up, else three significant digits ("0.00797%"),
// so that a toy model's MFU on thousands of GPUs does not read "0.0%".
std::string format_percent(double share);

}  // namespace dtsim
