#include "difftrain/optim/adamw.h"

#include "difftrain/core/error.h"
#include "kernels.h"

#include <torch/torch.h>

#include <cmath>

namespace difftrain::optim {
namespace {

torch::Dtype math_dtype(torch::Dtype param) {
  return param == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
}

}  // namespace

AdamW::AdamW(std::vector<torch::optim::OptimizerParamGroup> groups,
             torch::optim::AdamWOptions defaults)
    : FlatOptimizer(std::move(groups), defaults, "AdamW") {
  state_.resize(buckets_.size());
}

AdamW::AdamW(std::vector<torch::Tensor> params, torch::optim::AdamWOptions defaults)
    : AdamW(std::vector<torch::optim::OptimizerParamGroup>{torch::optim::OptimizerParamGroup(
                std::move(params))},
            defaults) {}

void AdamW::allocate_state(size_t b) {
  const auto& bucket = buckets_[b];
  auto options = torch::TensorOptions().dtype(math_dtype(bucket.dtype)).device(bucket.device);
  auto& st = state_[b];
  if (!st.exp_avg.defined()) {
    st.exp_avg = torch::zeros({bucket.numel()}, options);
    st.exp_avg_sq = torch::zeros({bucket.numel()}, options);
  }
  if (group_options(bucket.group).amsgrad() && !st.max_exp_avg_sq.defined()) {
    st.max_exp_avg_sq = torch::zeros({bucket.numel()}, options);
  }
}

torch::Tensor AdamW::step(LossClosure closure) {
  torch::Tensor loss = begin_step(closure);
  torch::NoGradGuard no_grad;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const auto& bucket = buckets_[b];
    const auto& opts = group_options(bucket.group);
    const double beta1 = std::get<0>(opts.betas()), beta2 = std::get<1>(opts.betas());
    const auto slots = take_gradients(b);  // holds the gradients alive for the kernel
    std::vector<detail::Segment> segments;
    for (const auto& slot : slots) {
      segments.push_back(detail::make_segment(bucket.offsets, slot.member, slot.grad.data_ptr(),
                                              opts.lr(), opts.weight_decay(), beta1, beta2,
                                              slot.step));
    }
    if (segments.empty()) continue;
    allocate_state(b);
    const auto& st = state_[b];
    const detail::Betas betas{beta1, beta2, opts.eps()};
    const torch::Tensor vmax = opts.amsgrad() ? st.max_exp_avg_sq : torch::Tensor();
    if (bucket.device.is_cpu() && !reference_path_) {
      detail::adamw_cpu(bucket.params, st.exp_avg, st.exp_avg_sq, vmax, segments, betas);
    } else {
      detail::adamw_reference(bucket.params, st.exp_avg, st.exp_avg_sq, vmax, segments, betas);
    }
  }
  return loss;
}

int64_t AdamW::state_bytes() const {
  int64_t bytes = 0;
  for (const auto& st : state_) {
    for (const auto* t : {&st.exp_avg, &st.exp_avg_sq, &st.max_exp_avg_sq}) {
      if (t->defined()) bytes += static_cast<int64_t>(t->nbytes());
    }
  }
  return bytes;
}

torch::Tensor AdamW::state_view(size_t group, size_t index, int which) const {
  return member_state(group, index, [&](size_t b) {
    const auto& st = state_[b];
    return which == 0 ? st.exp_avg : which == 1 ? st.exp_avg_sq : st.max_exp_avg_sq;
  });
}

torch::Tensor AdamW::exp_avg(size_t group, size_t index) const {
  return state_view(group, index, 0);
}
torch::Tensor AdamW::exp_avg_sq(size_t group, size_t index) const {
  return state_view(group, index, 1);
}

OptimizerState AdamW::state_dict() const {
  OptimizerState out;
  out.meta = meta_json();
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    for (size_t i = 0; i < param_groups_[g].params().size(); ++i) {
      if (steps_[g][i] == 0) continue;  // no state yet, as torch
      const auto& name = names_[g][i];
      out.tensors[name + ".exp_avg"] = state_view(g, i, 0).clone();
      out.tensors[name + ".exp_avg_sq"] = state_view(g, i, 1).clone();
      auto vmax = state_view(g, i, 2);
      if (vmax.defined()) out.tensors[name + ".max_exp_avg_sq"] = vmax.clone();
    }
  }
  return out;
}

void AdamW::load_state_dict(const OptimizerState& state) {
  refresh_layout();
  // Check everything before changing anything: a refused state leaves the optimizer as it was.
  load_meta_checked(state.meta, [&] {
    for (size_t b = 0; b < buckets_.size(); ++b) {
      const auto& bucket = buckets_[b];
      const auto dtype = math_dtype(bucket.dtype);
      for (size_t j = 0; j < bucket.members.size(); ++j) {
        const size_t i = bucket.members[j];
        if (steps_[bucket.group][i] == 0) continue;
        const auto& name = names_[bucket.group][i];
        const auto shape = param_groups_[bucket.group].params()[i].sizes();
        expect_tensor(state, name + ".exp_avg", shape, dtype);
        expect_tensor(state, name + ".exp_avg_sq", shape, dtype);
        if (group_options(bucket.group).amsgrad())
          expect_tensor(state, name + ".max_exp_avg_sq", shape, dtype);
      }
    }
  });
  torch::NoGradGuard no_grad;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    state_[b] = BucketState{};
    const auto& bucket = buckets_[b];
    if (!bucket_has_state(b)) continue;
    allocate_state(b);
    for (size_t j = 0; j < bucket.members.size(); ++j) {
      const size_t i = bucket.members[j];
      if (steps_[bucket.group][i] == 0) continue;
      const auto& name = names_[bucket.group][i];
      const int64_t off = bucket.offsets[j], n = bucket.offsets[j + 1] - off;
      state_[b].exp_avg.narrow(0, off, n).copy_(state.tensors.at(name + ".exp_avg").reshape({n}));
      state_[b].exp_avg_sq.narrow(0, off, n).copy_(
          state.tensors.at(name + ".exp_avg_sq").reshape({n}));
      if (state_[b].max_exp_avg_sq.defined()) {
        state_[b].max_exp_avg_sq.narrow(0, off, n).copy_(
            state.tensors.at(name + ".max_exp_avg_sq").reshape({n}));
      }
    }
  }
}

std::shared_ptr<FlatOptimizer> AdamW::make_like(
    std::vector<torch::optim::OptimizerParamGroup> groups) const {
  return std::make_shared<AdamW>(std::move(groups), group_options(0));
}

}  // namespace difftrain::optim
