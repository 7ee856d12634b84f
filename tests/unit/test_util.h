#pragma once
// Helpers the unit tests share: tensor differences, scratch folders, expected errors.

#include "difftrain/core/error.h"
#include "source_dir.h"

#include <gtest/gtest.h>
#include <torch/types.h>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

/// EXPECT that `text` contains `part`, printing both when it does not.
#define EXPECT_HAS(text, part)                               \
  EXPECT_NE(std::string(text).find(part), std::string::npos) \
      << "'" << (text) << "' lacks '" << (part) << "'"

namespace difftrain::test {

/// The reference files made with the Python Diffusers stack (tests/golden/README.md).
inline const std::string kGoldenDir = std::string(difftrain_test::source_dir()) + "/tests/golden/";
inline const std::string kDiffusersGolden = kGoldenDir + "diffusers/";
inline const std::string kTinySdGolden = kGoldenDir + "sd/tiny_sd/";

/// max |a - b|, computed in float64.
inline double max_abs(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kFloat64) - b.to(torch::kFloat64)).abs().max().item<double>();
}

/// A fresh, empty folder under the system temp dir, unique to `stem` and this process.
inline std::string temp_dir(const std::string& stem) {
  auto dir = std::filesystem::temp_directory_path() /
             ("difftrain_" + stem + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

/// The message of the difftrain::Error `f` throws ("" and a test failure if it throws none).
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const difftrain::Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a difftrain::Error";
  return "";
}

/// Writes `text` to `path` (replacing it).
inline void write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
}

/// Parses the JSON file at `path`.
inline nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

}  // namespace difftrain::test
