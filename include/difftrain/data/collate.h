#pragma once

#include "difftrain/data/dataset.h"

#include <functional>
#include <vector>

namespace difftrain::data {

/// One collated batch: named tensors with the batch on dim 0, e.g. {"pixel_values": [B, C, H, W]}.
/// torch: the dict a `DataLoader` yields for dict examples.
using Batch = std::map<std::string, torch::Tensor>;

/// Turns the examples of one batch into a Batch (torch: a DataLoader's `collate_fn`).
using CollateFn = std::function<Batch(const std::vector<Example>&)>;

/// Stacks each key along a new dim 0: B examples of [...] give [B, ...] (torch:
/// `default_collate` for a list of dicts of tensors). Every example must have the same keys and,
/// per key, the same shape; otherwise throws difftrain::Error naming the key and example index.
Batch default_collate(const std::vector<Example>& examples);

}  // namespace difftrain::data
