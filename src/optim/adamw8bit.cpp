#include "difftrain/optim/adamw8bit.h"

#include "difftrain/core/error.h"
#include "difftrain/optim/quantize.h"
#include "kernels.h"

#include <torch/torch.h>

#include <cmath>

namespace difftrain::optim {

AdamW8bit::AdamW8bit(std::vector<torch::optim::OptimizerParamGroup> groups,
                     torch::optim::AdamWOptions defaults, int64_t min_8bit_size)
    : FlatOptimizer(std::move(groups), defaults, "AdamW8bit"), min_8bit_size_(min_8bit_size) {
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    if (group_options(g).amsgrad()) {
      throw Error(
          "AdamW8bit does not support amsgrad (nor does bitsandbytes); use AdamW with "
          "amsgrad, or turn amsgrad off");
    }
  }
  for (const auto& bucket : buckets_) {
    if (bucket.dtype != torch::kFloat32 && bucket.dtype != torch::kBFloat16 &&
        bucket.dtype != torch::kFloat16) {
      throw Error(std::string("AdamW8bit: parameters of dtype ") + c10::toString(bucket.dtype) +
                  " are not supported; use float32, bfloat16 or float16 parameters");
    }
    if (!bucket.device.is_cpu()) {
      throw Error("AdamW8bit runs on CPU parameters only in this build; use AdamW on " +
                  bucket.device.str());
    }
    BucketState st;
    for (size_t j = 0; j < bucket.members.size(); ++j) {
      const int64_t n = bucket.offsets[j + 1] - bucket.offsets[j];
      const bool q = n >= min_8bit_size_;
      st.quantized.push_back(q);
      if (q) {
        st.state_begin.push_back(st.codes_numel);
        st.block_begin.push_back(st.blocks);
        st.codes_numel += n;
        st.blocks += (n + kQuantBlockSize - 1) / kQuantBlockSize;
      } else {
        st.state_begin.push_back(st.small_numel);
        st.block_begin.push_back(0);
        st.small_numel += n;
      }
    }
    state_.push_back(std::move(st));
  }
}

AdamW8bit::AdamW8bit(std::vector<torch::Tensor> params, torch::optim::AdamWOptions defaults,
                     int64_t min_8bit_size)
    : AdamW8bit(std::vector<torch::optim::OptimizerParamGroup>{torch::optim::OptimizerParamGroup(
                    std::move(params))},
                defaults, min_8bit_size) {}

void AdamW8bit::allocate_state(size_t b) {
  auto& st = state_[b];
  if (st.state1.defined() || st.exp_avg.defined()) return;
  // Zero absmax dequantises every code to 0, so the code filler does not matter; use 0's code.
  st.state1 = torch::full({st.codes_numel}, quantize_nearest(0.0f, true), torch::kUInt8);
  st.state2 = torch::full({st.codes_numel}, quantize_nearest(0.0f, false), torch::kUInt8);
  st.absmax1 = torch::zeros({st.blocks}, torch::kFloat32);
  st.absmax2 = torch::zeros({st.blocks}, torch::kFloat32);
  st.exp_avg = torch::zeros({st.small_numel}, torch::kFloat32);
  st.exp_avg_sq = torch::zeros({st.small_numel}, torch::kFloat32);
}

torch::Tensor AdamW8bit::step(LossClosure closure) {
  torch::Tensor loss = begin_step(closure);
  torch::NoGradGuard no_grad;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const auto& bucket = buckets_[b];
    const auto& opts = group_options(bucket.group);
    if (opts.amsgrad()) throw Error("AdamW8bit does not support amsgrad; turn it off");
    const double beta1 = std::get<0>(opts.betas()), beta2 = std::get<1>(opts.betas());
    auto& st = state_[b];
    const auto slots = take_gradients(b);  // holds the gradients alive for the kernels
    std::vector<detail::Segment> quantized, small;
    for (const auto& slot : slots) {
      auto s = detail::make_segment(bucket.offsets, slot.member, slot.grad.data_ptr(), opts.lr(),
                                    opts.weight_decay(), beta1, beta2, slot.step);
      s.state_begin = st.state_begin[slot.member];
      s.block_begin = st.block_begin[slot.member];
      (st.quantized[slot.member] ? quantized : small).push_back(s);
    }
    if (quantized.empty() && small.empty()) continue;
    allocate_state(b);
    const detail::Betas betas{beta1, beta2, opts.eps()};
    detail::adamw8bit_cpu(bucket.params, st.state1, st.absmax1, st.state2, st.absmax2, quantized,
                          betas, kQuantBlockSize);
    detail::adamw_cpu(bucket.params, st.exp_avg, st.exp_avg_sq, torch::Tensor(), small, betas);
  }
  return loss;
}

int64_t AdamW8bit::state_bytes() const {
  int64_t bytes = 0;
  for (const auto& st : state_) {
    for (const auto* t :
         {&st.state1, &st.state2, &st.absmax1, &st.absmax2, &st.exp_avg, &st.exp_avg_sq}) {
      if (t->defined()) bytes += static_cast<int64_t>(t->nbytes());
    }
  }
  return bytes;
}

std::pair<size_t, size_t> AdamW8bit::locate(size_t group, size_t index) const {
  for (size_t b = 0; b < buckets_.size(); ++b) {
    if (buckets_[b].group != group) continue;
    for (size_t j = 0; j < buckets_[b].members.size(); ++j) {
      if (buckets_[b].members[j] == index) return {b, j};
    }
  }
  throw Error("AdamW8bit: no parameter " + std::to_string(index) + " in group " +
              std::to_string(group));
}

bool AdamW8bit::is_8bit(size_t group, size_t index) const {
  auto [b, j] = locate(group, index);
  return state_[b].quantized[j];
}

torch::Tensor AdamW8bit::moment(size_t group, size_t index, int which) const {
  auto [b, j] = locate(group, index);
  const auto& st = state_[b];
  if (steps_[group][index] == 0 || !(st.state1.defined() || st.exp_avg.defined())) return {};
  const auto& bucket = buckets_[b];
  const int64_t n = bucket.offsets[j + 1] - bucket.offsets[j];
  const auto shape = param_groups_[group].params()[index].sizes();
  if (!st.quantized[j]) {
    return (which == 0 ? st.exp_avg : st.exp_avg_sq)
        .narrow(0, st.state_begin[j], n)
        .view(shape)
        .clone();
  }
  const int64_t blocks = (n + kQuantBlockSize - 1) / kQuantBlockSize;
  QuantizedBlocks q{(which == 0 ? st.state1 : st.state2).narrow(0, st.state_begin[j], n),
                    (which == 0 ? st.absmax1 : st.absmax2).narrow(0, st.block_begin[j], blocks)};
  return dequantize_blockwise(q, which == 0).view(shape);
}

torch::Tensor AdamW8bit::exp_avg(size_t group, size_t index) const {
  return moment(group, index, 0);
}
torch::Tensor AdamW8bit::exp_avg_sq(size_t group, size_t index) const {
  return moment(group, index, 1);
}

OptimizerState AdamW8bit::state_dict() const {
  OptimizerState out;
  out.meta = meta_json();
  out.meta["block_size"] = kQuantBlockSize;
  out.meta["min_8bit_size"] = min_8bit_size_;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const auto& bucket = buckets_[b];
    const auto& st = state_[b];
    for (size_t j = 0; j < bucket.members.size(); ++j) {
      const size_t i = bucket.members[j];
      if (steps_[bucket.group][i] == 0) continue;
      const auto& name = names_[bucket.group][i];
      const int64_t n = bucket.offsets[j + 1] - bucket.offsets[j];
      const auto shape = param_groups_[bucket.group].params()[i].sizes();
      if (st.quantized[j]) {
        const int64_t blocks = (n + kQuantBlockSize - 1) / kQuantBlockSize;
        out.tensors[name + ".state1"] =
            st.state1.narrow(0, st.state_begin[j], n).view(shape).clone();
        out.tensors[name + ".state2"] =
            st.state2.narrow(0, st.state_begin[j], n).view(shape).clone();
        out.tensors[name + ".absmax1"] = st.absmax1.narrow(0, st.block_begin[j], blocks).clone();
        out.tensors[name + ".absmax2"] = st.absmax2.narrow(0, st.block_begin[j], blocks).clone();
      } else {
        out.tensors[name + ".exp_avg"] =
            st.exp_avg.narrow(0, st.state_begin[j], n).view(shape).clone();
        out.tensors[name + ".exp_avg_sq"] =
            st.exp_avg_sq.narrow(0, st.state_begin[j], n).view(shape).clone();
      }
    }
  }
  return out;
}

void AdamW8bit::load_state_dict(const OptimizerState& state) {
  refresh_layout();
  const int64_t block = state.meta.value("block_size", int64_t{-1});
  const int64_t min_size = state.meta.value("min_8bit_size", int64_t{-1});
  if (block != kQuantBlockSize || min_size != min_8bit_size_) {
    throw Error("AdamW8bit state was saved with block_size " + std::to_string(block) +
                " and min_8bit_size " + std::to_string(min_size) + ", but this optimizer uses " +
                std::to_string(kQuantBlockSize) + " and " + std::to_string(min_8bit_size_) +
                "; resume with the same settings");
  }
  // Check everything before changing any state.
  load_meta_checked(state.meta, [&] {
    for (size_t b = 0; b < buckets_.size(); ++b) {
      const auto& bucket = buckets_[b];
      for (size_t j = 0; j < bucket.members.size(); ++j) {
        const size_t i = bucket.members[j];
        if (steps_[bucket.group][i] == 0) continue;
        const auto& name = names_[bucket.group][i];
        const auto shape = param_groups_[bucket.group].params()[i].sizes();
        const int64_t n = bucket.offsets[j + 1] - bucket.offsets[j];
        if (state_[b].quantized[j]) {
          const int64_t blocks = (n + kQuantBlockSize - 1) / kQuantBlockSize;
          expect_tensor(state, name + ".state1", shape, torch::kUInt8);
          expect_tensor(state, name + ".state2", shape, torch::kUInt8);
          expect_tensor(state, name + ".absmax1", {blocks}, torch::kFloat32);
          expect_tensor(state, name + ".absmax2", {blocks}, torch::kFloat32);
        } else {
          expect_tensor(state, name + ".exp_avg", shape, torch::kFloat32);
          expect_tensor(state, name + ".exp_avg_sq", shape, torch::kFloat32);
        }
      }
    }
  });
  torch::NoGradGuard no_grad;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    auto& st = state_[b];
    st.state1 = st.state2 = st.absmax1 = st.absmax2 = st.exp_avg = st.exp_avg_sq = torch::Tensor();
    const auto& bucket = buckets_[b];
    if (!bucket_has_state(b)) continue;
    allocate_state(b);
    for (size_t j = 0; j < bucket.members.size(); ++j) {
      const size_t i = bucket.members[j];
      if (steps_[bucket.group][i] == 0) continue;
      const auto& name = names_[bucket.group][i];
      const int64_t n = bucket.offsets[j + 1] - bucket.offsets[j];
      if (st.quantized[j]) {
        const int64_t blocks = (n + kQuantBlockSize - 1) / kQuantBlockSize;
        st.state1.narrow(0, st.state_begin[j], n)
            .copy_(state.tensors.at(name + ".state1").reshape({n}));
        st.state2.narrow(0, st.state_begin[j], n)
            .copy_(state.tensors.at(name + ".state2").reshape({n}));
        st.absmax1.narrow(0, st.block_begin[j], blocks).copy_(state.tensors.at(name + ".absmax1"));
        st.absmax2.narrow(0, st.block_begin[j], blocks).copy_(state.tensors.at(name + ".absmax2"));
      } else {
        st.exp_avg.narrow(0, st.state_begin[j], n)
            .copy_(state.tensors.at(name + ".exp_avg").reshape({n}));
        st.exp_avg_sq.narrow(0, st.state_begin[j], n)
            .copy_(state.tensors.at(name + ".exp_avg_sq").reshape({n}));
      }
    }
  }
}

std::shared_ptr<FlatOptimizer> AdamW8bit::make_like(
    std::vector<torch::optim::OptimizerParamGroup> groups) const {
  return std::make_shared<AdamW8bit>(std::move(groups), group_options(0), min_8bit_size_);
}

}  // namespace difftrain::optim
