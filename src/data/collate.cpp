#include "difftrain/data/collate.h"

#include "difftrain/core/error.h"

#include <fmt/format.h>

#include <sstream>

namespace difftrain::data {
namespace {

std::string shape_of(const torch::Tensor& t) {
  std::ostringstream out;
  out << t.sizes();
  return out.str();
}

}  // namespace

Batch default_collate(const std::vector<Example>& examples) {
  if (examples.empty()) throw Error("default_collate got no examples: a batch needs at least one");
  const Example& first = examples.front();
  for (size_t i = 1; i < examples.size(); ++i) {
    const Example& example = examples[i];
    for (const auto& [key, tensor] : first) {
      const auto found = example.find(key);
      if (found == example.end()) {
        throw Error(fmt::format(
            "default_collate: example {} of the batch has no key '{}' that example 0 has; give "
            "every example the same keys or pass a custom collate",
            i, key));
      }
      if (!found->second.sizes().equals(tensor.sizes())) {
        throw Error(fmt::format(
            "default_collate: key '{}' has shape {} in example {} but {} in example 0; resize "
            "or pad to one shape, or pass a custom collate",
            key, shape_of(found->second), i, shape_of(tensor)));
      }
    }
    if (example.size() != first.size()) {
      for (const auto& [key, tensor] : example) {
        if (first.count(key) == 0) {
          throw Error(fmt::format(
              "default_collate: example {} of the batch has key '{}' that example 0 lacks; give "
              "every example the same keys or pass a custom collate",
              i, key));
        }
      }
    }
  }
  Batch batch;
  std::vector<torch::Tensor> column(examples.size());
  for (const auto& [key, tensor] : first) {
    for (size_t i = 0; i < examples.size(); ++i) column[i] = examples[i].at(key);
    batch.emplace(key, torch::stack(column));  // [B, ...]
  }
  return batch;
}

}  // namespace difftrain::data
