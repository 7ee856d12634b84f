#include "difftrain/models/checkpointing.h"

#include "difftrain/core/nested_backward.h"
#include "difftrain/core/torch_compat.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/ivalue.h>
#include <torch/autograd.h>

namespace difftrain::models {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// What backward needs besides the saved tensors: the function, which inputs were undefined, and
// the random and autocast state at forward time.
struct CheckpointState : torch::CustomClassHolder {
  CheckpointedFn fn;
  std::vector<bool> defined;  // per original input
  at::Tensor rng_state;
  compat::AutocastState cpu_autocast, cuda_autocast;
};

thread_local int t_checkpoint_depth = 0;

// Marks this thread as running a checkpointed function (see in_checkpointed_function()).
struct CheckpointedScope {
  CheckpointedScope() { ++t_checkpoint_depth; }
  ~CheckpointedScope() { --t_checkpoint_depth; }
  CheckpointedScope(const CheckpointedScope&) = delete;
  CheckpointedScope& operator=(const CheckpointedScope&) = delete;
};

std::vector<torch::Tensor> expand(const CheckpointState& state, const variable_list& compact) {
  std::vector<torch::Tensor> full;
  size_t next = 0;
  for (bool d : state.defined) full.push_back(d ? compact[next++] : torch::Tensor());
  return full;
}

class CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
 public:
  // `anchor` is an empty tensor that requires grad: it keeps the node in the graph even when no
  // real input requires grad, so parameters inside fn still get gradients.
  static variable_list forward(AutogradContext* ctx, at::TensorList inputs_ref,
                               torch::Tensor anchor, c10::intrusive_ptr<CheckpointState> state) {
    (void)anchor;
    variable_list inputs = inputs_ref.vec();
    ctx->save_for_backward(inputs);
    ctx->saved_data["state"] = c10::IValue::make_capsule(state);
    CheckpointedScope scope;
    return {state->fn(expand(*state, inputs))};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto state =
        c10::static_intrusive_pointer_cast<CheckpointState>(ctx->saved_data["state"].toCapsule());
    variable_list saved = ctx->get_saved_variables();
    variable_list detached;
    for (const auto& t : saved) detached.push_back(t.detach().requires_grad_(t.requires_grad()));

    auto gen = at::detail::getDefaultCPUGenerator();
    torch::Tensor outer_rng;
    torch::Tensor out;
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      outer_rng = gen.get_state();
      gen.set_state(state->rng_state);
    }
    {
      torch::AutoGradMode enable(true);
      compat::AutocastRestore cpu(c10::DeviceType::CPU, state->cpu_autocast);
      compat::AutocastRestore cuda(c10::DeviceType::CUDA, state->cuda_autocast);
      CheckpointedScope scope;
      out = state->fn(expand(*state, detached));
    }
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(outer_rng);
    }
    if (out.requires_grad() && grad_outputs[0].defined()) {
      core::NestedBackwardScope nested;
      torch::autograd::backward({out}, {grad_outputs[0]});
    }
    variable_list grads;
    for (const auto& t : detached) grads.push_back(t.requires_grad() ? t.grad() : torch::Tensor());
    grads.push_back(torch::Tensor());  // anchor
    grads.push_back(torch::Tensor());  // state
    return grads;
  }
};

}  // namespace

bool in_checkpointed_function() { return t_checkpoint_depth > 0; }

torch::Tensor checkpoint(const CheckpointedFn& fn, const std::vector<torch::Tensor>& inputs) {
  if (!torch::GradMode::is_enabled()) return fn(inputs);
  auto state = c10::make_intrusive<CheckpointState>();
  state->fn = fn;
  state->cpu_autocast = compat::autocast_state(c10::DeviceType::CPU);
  state->cuda_autocast = compat::autocast_state(c10::DeviceType::CUDA);
  variable_list compact;
  for (const auto& t : inputs) {
    state->defined.push_back(t.defined());
    if (t.defined()) compact.push_back(t);
  }
  {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    state->rng_state = gen.get_state();
  }
  torch::Tensor anchor = torch::empty({0}, torch::requires_grad());
  return CheckpointFunction::apply(at::TensorList(compact), anchor, state)[0];
}

}  // namespace difftrain::models
