// Prodigy on flat buffers (prodigy.h): the estimate's two sums over every parameter with a
// gradient (added across ZeRO shards), then Adam's update with step size d·lr.
#include "difftrain/optim/prodigy.h"

#include "difftrain/core/error.h"

#include <fmt/format.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>

namespace difftrain::optim {
namespace {

torch::Dtype prodigy_math_dtype(torch::Dtype param) {
  return param == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
}

// JSON has no infinity: growth_rate inf is written as null.
nlohmann::json finite_or_null(double v) { return std::isfinite(v) ? nlohmann::json(v) : nullptr; }

}  // namespace

torch::optim::AdamWOptions Prodigy::default_group_options() {
  return torch::optim::AdamWOptions(1.0).betas({0.9, 0.999}).eps(1e-8).weight_decay(0.0);
}

Prodigy::Prodigy(std::vector<torch::optim::OptimizerParamGroup> groups,
                 torch::optim::AdamWOptions defaults, ProdigyOptions options)
    : FlatOptimizer(std::move(groups), defaults, "Prodigy"), options_(options) {
  const auto& o = options_;
  if (!(o.d0 > 0)) throw Error(fmt::format("Prodigy: d0 must be > 0, got {}", o.d0));
  if (o.beta3 && !(*o.beta3 >= 0 && *o.beta3 < 1)) {
    throw Error(fmt::format("--prodigy_beta3 must be in [0, 1), got {}", *o.beta3));
  }
  if (!(o.growth_rate >= 1)) {
    throw Error(
        fmt::format("Prodigy: growth_rate must be >= 1 (inf: unlimited), got {}", o.growth_rate));
  }
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    const auto& go = group_options(g);
    if (!(go.lr() > 0) || !(go.eps() > 0)) {
      throw Error(
          fmt::format("Prodigy: group {} needs lr > 0 and eps > 0 (lr 1.0 is Prodigy's "
                      "advice; d is estimated), got lr {} eps {}",
                      g, go.lr(), go.eps()));
    }
  }
  d_ = d_max_ = o.d0;
  state_.resize(buckets_.size());
}

Prodigy::Prodigy(std::vector<torch::Tensor> params, torch::optim::AdamWOptions defaults,
                 ProdigyOptions options)
    : Prodigy(std::vector<torch::optim::OptimizerParamGroup>{torch::optim::OptimizerParamGroup(
                  std::move(params))},
              defaults, options) {}

void Prodigy::allocate_state(size_t b) {
  auto& st = state_[b];
  if (st.exp_avg_sq.defined()) return;
  const auto& bucket = buckets_[b];
  const auto options =
      torch::TensorOptions().dtype(prodigy_math_dtype(bucket.dtype)).device(bucket.device);
  const double beta1 = std::get<0>(group_options(bucket.group).betas());
  if (beta1 > 0) st.exp_avg = torch::zeros({bucket.numel()}, options);
  st.exp_avg_sq = torch::zeros({bucket.numel()}, options);
  st.s = torch::zeros({bucket.numel()}, options);
  st.p0 = torch::zeros({bucket.numel()}, options);
}

torch::Tensor Prodigy::step(LossClosure closure) {
  torch::Tensor loss = begin_step(closure);
  torch::NoGradGuard no_grad;
  const auto& first = group_options(0);
  const double beta1 = std::get<0>(first.betas()), beta2 = std::get<1>(first.betas());
  const double beta3 = options_.beta3.value_or(std::sqrt(beta2));
  double lr = 0;
  for (size_t g = 0; g < param_groups_.size(); ++g) lr = std::max(lr, group_options(g).lr());
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    const double glr = group_options(g).lr();
    if (glr != lr && glr != 0.0) {
      throw Error(
          fmt::format("Prodigy: group {} has lr {} but another has {}; groups may only "
                      "differ by an lr of 0",
                      g, glr, lr));
    }
  }
  const double kk = static_cast<double>(k_);
  const double bias_correction =
      options_.use_bias_correction
          ? std::sqrt(1 - std::pow(beta2, kk + 1)) / (1 - std::pow(beta1, kk + 1))
          : 1.0;
  const double d = d_, d0 = options_.d0;
  const double dlr = d * lr * bias_correction;
  const double d_numerator = d_numerator_ * beta3;
  double delta_numerator = 0, d_denom = 0;

  struct Update {
    size_t bucket;
    int64_t offset, numel;
    torch::Tensor grad;  // flat, the state's dtype, weight decay added when coupled
  };
  std::vector<Update> updates;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const auto& bucket = buckets_[b];
    const auto& go = group_options(bucket.group);
    const double decay = go.weight_decay();
    const auto slots = take_gradients(b);
    if (slots.empty()) continue;
    allocate_state(b);
    auto& st = state_[b];
    const auto dtype = prodigy_math_dtype(bucket.dtype);
    for (const auto& slot : slots) {
      const int64_t off = bucket.offsets[slot.member];
      const int64_t n = bucket.offsets[slot.member + 1] - off;
      const auto p = bucket.params.narrow(0, off, n).to(dtype);
      auto grad = slot.grad.reshape({-1}).to(dtype);
      if (decay != 0 && !options_.decouple) grad = grad + decay * p;
      if (slot.step == 1) st.p0.narrow(0, off, n).copy_(p);  // the parameter's first update
      if (go.lr() > 0) {
        delta_numerator +=
            (d / d0) * dlr * torch::dot(grad, st.p0.narrow(0, off, n) - p).item<double>();
        if (beta1 > 0) st.exp_avg.narrow(0, off, n).mul_(beta1).add_(grad, d * (1 - beta1));
        st.exp_avg_sq.narrow(0, off, n).mul_(beta2).addcmul_(grad, grad, d * d * (1 - beta2));
        auto s = st.s.narrow(0, off, n);
        s.mul_(beta3).add_(grad, (d / d0) * (options_.safeguard_warmup ? d : dlr));
        d_denom += s.abs().sum().item<double>();
      }
      updates.push_back({b, off, n, grad});
    }
  }
  if (cross_shard_sum_) {
    // Every rank joins, also one whose shard saw no gradient.
    auto sums = torch::tensor({delta_numerator, d_denom}, torch::kFloat64);
    cross_shard_sum_(sums);
    delta_numerator = sums[0].item<double>();
    d_denom = sums[1].item<double>();
  }
  if (d_denom == 0) return loss;  // no progress to estimate from: prodigyopt returns here
  double new_d = d;
  double d_hat = d;
  double numerator = d_numerator;
  if (lr > 0) {
    numerator = d_numerator + delta_numerator;
    d_hat = options_.d_coef * numerator / d_denom;
    if (d == d0) new_d = std::max(d, d_hat);
    d_max_ = std::max(d_max_, d_hat);
    new_d = std::min(d_max_, new_d * options_.growth_rate);
  }
  d_numerator_ = numerator;
  d_hat_ = d_hat;
  d_ = new_d;
  for (const auto& u : updates) {
    const auto& bucket = buckets_[u.bucket];
    const auto& go = group_options(bucket.group);
    auto& st = state_[u.bucket];
    auto p_out = bucket.params.narrow(0, u.offset, u.numel);
    auto p = p_out.to(prodigy_math_dtype(bucket.dtype));
    const auto denom = st.exp_avg_sq.narrow(0, u.offset, u.numel).sqrt().add_(new_d * go.eps());
    if (go.weight_decay() != 0 && options_.decouple) p.add_(p, -go.weight_decay() * dlr);
    if (beta1 > 0) {
      p.addcdiv_(st.exp_avg.narrow(0, u.offset, u.numel), denom, -dlr);
    } else {
      p.addcdiv_(u.grad, denom, -dlr * new_d);
    }
    if (!p.is_same(p_out)) p_out.copy_(p);
  }
  ++k_;
  return loss;
}

int64_t Prodigy::state_bytes() const {
  int64_t bytes = 0;
  for (const auto& st : state_) {
    for (const auto* t : {&st.exp_avg, &st.exp_avg_sq, &st.s, &st.p0}) {
      if (t->defined()) bytes += static_cast<int64_t>(t->nbytes());
    }
  }
  return bytes;
}

std::shared_ptr<FlatOptimizer> Prodigy::make_like(
    std::vector<torch::optim::OptimizerParamGroup> groups) const {
  auto out = std::make_shared<Prodigy>(std::move(groups), group_options(0), options_);
  out->d_ = d_;
  out->d_max_ = d_max_;
  out->d_numerator_ = d_numerator_;
  out->k_ = k_;
  return out;
}

torch::Tensor Prodigy::state_view(size_t group, size_t index, int which) const {
  return member_state(group, index, [&](size_t b) {
    const auto& st = state_[b];
    return which == 0 ? st.exp_avg : which == 1 ? st.exp_avg_sq : which == 2 ? st.s : st.p0;
  });
}

namespace {
const char* const kProdigyKeys[] = {".exp_avg", ".exp_avg_sq", ".s", ".p0"};
}  // namespace

OptimizerState Prodigy::state_dict() const {
  OptimizerState out;
  out.meta = meta_json();
  const auto& o = options_;
  out.meta["prodigy"] = {{"d", d_},
                         {"d_max", d_max_},
                         {"d_numerator", d_numerator_},
                         {"d_hat", d_hat_},
                         {"k", k_},
                         {"beta3", o.beta3 ? nlohmann::json(*o.beta3) : nullptr},
                         {"d0", o.d0},
                         {"d_coef", o.d_coef},
                         {"growth_rate", finite_or_null(o.growth_rate)},
                         {"decouple", o.decouple},
                         {"use_bias_correction", o.use_bias_correction},
                         {"safeguard_warmup", o.safeguard_warmup}};
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    for (size_t i = 0; i < param_groups_[g].params().size(); ++i) {
      if (steps_[g][i] == 0) continue;
      for (int w = 0; w < 4; ++w) {
        auto v = state_view(g, i, w);
        if (v.defined()) out.tensors[names_[g][i] + kProdigyKeys[w]] = v.clone();
      }
    }
  }
  return out;
}

void Prodigy::load_state_dict(const OptimizerState& state) {
  refresh_layout();
  if (!state.meta.contains("prodigy") || !state.meta["prodigy"].is_object()) {
    // The type check in load_meta_checked names the writer; without "prodigy" it is malformed.
    if (state.meta.value("type", std::string()) == "Prodigy") {
      throw Error("Prodigy state has no \"prodigy\" entry (d, d_max, k); the file is damaged");
    }
  }
  load_meta_checked(state.meta, [&] {
    for (size_t b = 0; b < buckets_.size(); ++b) {
      const auto& bucket = buckets_[b];
      const auto dtype = prodigy_math_dtype(bucket.dtype);
      const double beta1 = std::get<0>(group_options(bucket.group).betas());
      for (size_t j = 0; j < bucket.members.size(); ++j) {
        const size_t i = bucket.members[j];
        if (steps_[bucket.group][i] == 0) continue;
        const auto& name = names_[bucket.group][i];
        const auto shape = param_groups_[bucket.group].params()[i].sizes();
        for (int w = beta1 > 0 ? 0 : 1; w < 4; ++w) {
          expect_tensor(state, name + kProdigyKeys[w], shape, dtype);
        }
      }
    }
  });
  const auto& p = state.meta.at("prodigy");
  try {
    d_ = p.at("d").get<double>();
    d_max_ = p.at("d_max").get<double>();
    d_numerator_ = p.at("d_numerator").get<double>();
    d_hat_ = p.value("d_hat", d_);
    k_ = p.at("k").get<int64_t>();
  } catch (const nlohmann::json::exception& e) {
    throw Error(std::string("Prodigy state: bad \"prodigy\" entry (") + e.what() + ")");
  }
  torch::NoGradGuard no_grad;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    state_[b] = BucketState{};
    if (!bucket_has_state(b)) continue;
    allocate_state(b);
    const auto& bucket = buckets_[b];
    auto& st = state_[b];
    for (size_t j = 0; j < bucket.members.size(); ++j) {
      const size_t i = bucket.members[j];
      if (steps_[bucket.group][i] == 0) continue;
      const auto& name = names_[bucket.group][i];
      const int64_t off = bucket.offsets[j], n = bucket.offsets[j + 1] - off;
      torch::Tensor* bufs[] = {&st.exp_avg, &st.exp_avg_sq, &st.s, &st.p0};
      for (int w = 0; w < 4; ++w) {
        if (!bufs[w]->defined()) continue;
        bufs[w]->narrow(0, off, n).copy_(state.tensors.at(name + kProdigyKeys[w]).reshape({n}));
      }
    }
  }
}

}  // namespace difftrain::optim
