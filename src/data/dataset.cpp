#include "difftrain/data/dataset.h"

#include "difftrain/core/error.h"

#include <fmt/format.h>

#include <utility>

namespace difftrain::data {

TensorDataset::TensorDataset(Example columns) : columns_(std::move(columns)) {
  if (columns_.empty()) {
    throw Error("TensorDataset got no columns: pass at least one named tensor of shape [N, ...]");
  }
  const auto& [first_key, first] = *columns_.begin();
  for (const auto& [key, column] : columns_) {
    if (!column.defined() || column.dim() == 0) {
      throw Error(
          fmt::format("TensorDataset column '{}' is {}: every column needs a dim 0 of N examples",
                      key, column.defined() ? "0-dimensional" : "undefined"));
    }
    if (column.size(0) != first.size(0)) {
      throw Error(fmt::format(
          "TensorDataset column '{}' has {} rows but column '{}' has {}: all columns must share "
          "dim 0",
          key, column.size(0), first_key, first.size(0)));
    }
  }
  size_ = first.size(0);
}

Example TensorDataset::get(int64_t index) const {
  if (index < 0 || index >= size_) {
    throw Error(fmt::format("TensorDataset index {} is out of range: expected 0 <= index < {}",
                            index, size_));
  }
  Example example;
  for (const auto& [key, column] : columns_) example.emplace(key, column.select(0, index));
  return example;
}

}  // namespace difftrain::data
