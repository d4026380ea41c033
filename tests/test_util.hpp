// Helpers shared by the tests: temporary input files and the path of the repository's data.
#pragma once

#include <unistd.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <string>

#include "sim/common/error.hpp"
#include "sim/model/model_spec.hpp"

namespace dtsim::test {

// A mixture of experts in every block, as a test builds one.
inline model::MoeSpec mixture(std::int64_t experts, std::int64_t top_k,
                              std::int64_t expert_ffn_hidden, std::int64_t shared_ffn_hidden = 0,
                              bool normalize_top_k = true) {
  model::MoeSpec moe;
  moe.experts = experts;
  moe.top_k = top_k;
  moe.expert_ffn_hidden = expert_ffn_hidden;
  moe.shared_ffn_hidden = shared_ffn_hidden;
  moe.normalize_top_k = normalize_top_k;
  return moe;
}

// A file under the system temp folder holding `text`, removed when the object goes away.
class TempFile {
 public:
  TempFile(const std::string& name, const std::string& text) {
    static int counter = 0;
    dir_ = std::filesystem::temp_directory_path() /
           ("dtsim_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::create_directories(dir_);
    path_ = dir_ / name;
    std::ofstream(path_) << text;
  }
  ~TempFile() {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;
  std::string path() const { return path_.string(); }

 private:
  std::filesystem::path dir_;
  std::filesystem::path path_;
};

inline std::filesystem::path repo_dir() {
  return std::filesystem::path(DTSIM_TEST_REPO_DIR);
}

}  // namespace dtsim::test

namespace dtsim::test {
// Matches an exception whose what() contains `text`.
class MessageContains : public Catch::MatcherBase<std::exception> {
 public:
  explicit MessageContains(std::string text) : text_(std::move(text)) {}
  bool match(const std::exception& e) const override {
    return std::string(e.what()).find(text_) != std::string::npos;
  }
  std::string describe() const override { return "message contains \"" + text_ + "\""; }

 private:
  std::string text_;
};
}  // namespace dtsim::test

// Expects `expr` to throw an exception of type `type` whose message contains `text`.
#define DTSIM_REQUIRE_THROWS_CONTAINING(expr, type, text) \
  REQUIRE_THROWS_MATCHES(expr, type, ::dtsim::test::MessageContains(text))
