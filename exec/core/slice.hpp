// Which part of a full [rows, cols] tensor a rank holds (header-only): a range of rows and,
// within them, a list of column ranges (Megatron-LM's column- and row-parallel splits; QKV takes
// a range of the q, k and v columns each). The runner places its tensors with it, and a
// checkpoint's shards say with it where their pieces go.
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "sim/common/error.hpp"

namespace dtsim::exec {

struct Slice {
  std::int64_t rows = 1, cols = 1;
  std::int64_t row_begin = 0, row_count = 1;
  std::vector<std::pair<std::int64_t, std::int64_t>> col_ranges;  // (begin, count)

  std::int64_t local_cols() const {
    std::int64_t n = 0;
    for (const auto& r : col_ranges) n += r.second;
    return n;
  }
  std::int64_t local_size() const { return row_count * local_cols(); }
  // The full tensor's flat index of local flat index i.
  std::int64_t full_index(std::int64_t i) const {
    const std::int64_t lc = local_cols();
    const std::int64_t row = row_begin + i / lc;
    std::int64_t col = i % lc;
    for (const auto& [begin, count] : col_ranges) {
      if (col < count) return row * cols + begin + col;
      col -= count;
    }
    DTSIM_ASSERT(false, "slice index out of range");
    return 0;
  }
  // Calls run(local, full, length) for the runs of consecutive full-tensor elements that local
  // elements [begin, begin + count) make (`local` counts from begin): a copy between a rank's
  // slice and the full tensor a run at a time.
  template <typename Run>
  void for_runs(std::int64_t begin, std::int64_t count, Run&& run) const {
    const std::int64_t lc = local_cols();
    const std::int64_t end = begin + count;
    std::int64_t i = begin;
    while (i < end) {
      const std::int64_t row = row_begin + i / lc;
      std::int64_t col = i % lc;
      for (const auto& [first, n] : col_ranges) {
        if (col >= n) {
          col -= n;
          continue;
        }
        const std::int64_t length = std::min(n - col, end - i);
        run(i - begin, row * cols + first + col, length);
        i += length;
        break;
      }
    }
  }
  bool whole() const { return row_count == rows && local_cols() == cols; }
  bool operator==(const Slice&) const = default;
};

inline Slice whole(std::int64_t rows, std::int64_t cols) {
  return {rows, cols, 0, rows, {{0, cols}}};
}

}  // namespace dtsim::exec
