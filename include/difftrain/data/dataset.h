#pragma once

#include <torch/types.h>

#include <cstdint>
#include <map>
#include <string>

namespace difftrain::data {

/// One example: named tensors, e.g. {"pixel_values": [C, H, W], "class_labels": []}.
/// torch: the dict a `Dataset.__getitem__` returns.
using Example = std::map<std::string, torch::Tensor>;

/// Map-style dataset (torch: `torch.utils.data.Dataset` with `__len__` and `__getitem__`).
/// get() is called from the loader's worker threads, so it must be safe to call concurrently.
class Dataset {
 public:
  virtual ~Dataset() = default;
  /// Number of examples (torch: `len(dataset)`).
  virtual int64_t size() const = 0;
  /// Example `index`, 0 <= index < size() (torch: `dataset[index]`).
  virtual Example get(int64_t index) const = 0;
};

/// Rows of named tensors that share dim 0: example i is {key: column[i]} for every column
/// (torch: `TensorDataset`, with names instead of positions). Columns: [N, ...] each.
class TensorDataset : public Dataset {
 public:
  /// Throws difftrain::Error when `columns` is empty, a column is 0-dimensional, or the dim-0
  /// sizes differ (naming the key and both sizes).
  explicit TensorDataset(Example columns);
  /// N, the shared dim-0 size.
  int64_t size() const override { return size_; }
  /// {key: column[index]} (views, no copy). Throws difftrain::Error for an index out of range.
  Example get(int64_t index) const override;
  /// The columns as given: [N, ...] each.
  const Example& columns() const { return columns_; }

 private:
  Example columns_;
  int64_t size_ = 0;
};

}  // namespace difftrain::data
