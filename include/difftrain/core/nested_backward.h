#pragma once
// Backward passes run from inside another backward: gradient checkpointing recomputes a block in
// its backward and calls autograd's backward on the recomputed graph there. Work queued with
// autograd's queue_callback from inside that nested pass would run when the NESTED pass ends,
// long before the outer one; DDP's end-of-backward check must wait for the outer pass. The
// checkpoint marks its nested backward with a NestedBackwardScope, and code that queues such work
// (accel::queue_after_backward) defers it with when_back_in_outer_backward().

#include <functional>

namespace difftrain::core {

/// Marks the current thread as running a nested backward for its lifetime. When the outermost
/// scope of the thread closes (back in the outer backward), the callbacks deferred meanwhile run,
/// in order.
class NestedBackwardScope {
 public:
  NestedBackwardScope();
  ~NestedBackwardScope();
  NestedBackwardScope(const NestedBackwardScope&) = delete;
  NestedBackwardScope& operator=(const NestedBackwardScope&) = delete;
};

/// True inside a NestedBackwardScope of this thread.
bool in_nested_backward();

/// Runs `fn` when the outermost NestedBackwardScope of this thread closes; at once when there is
/// none.
void when_back_in_outer_backward(std::function<void()> fn);

}  // namespace difftrain::core
