#include "difftrain/core/nested_backward.h"

#include <utility>
#include <vector>

namespace difftrain::core {

namespace {
thread_local int t_depth = 0;
thread_local std::vector<std::function<void()>> t_deferred;
}  // namespace

NestedBackwardScope::NestedBackwardScope() { ++t_depth; }

NestedBackwardScope::~NestedBackwardScope() {
  if (--t_depth > 0) return;
  // Callbacks may defer more (they run outside any scope now, so they run at once).
  auto deferred = std::move(t_deferred);
  t_deferred.clear();
  for (auto& fn : deferred) fn();
}

bool in_nested_backward() { return t_depth > 0; }

void when_back_in_outer_backward(std::function<void()> fn) {
  if (t_depth > 0) {
    t_deferred.push_back(std::move(fn));
    return;
  }
  fn();
}

}  // namespace difftrain::core
