// Flow-matching training (flow_match_objective.h): Diffusers' density sampling over the
// scheduler's training tables, kohya's continuous samplings, and the SD3 loss weights.
#include "difftrain/diffusion/flow_match_objective.h"

#include "difftrain/core/error.h"
#include "difftrain/core/sample_rng.h"
#include "difftrain/diffusion/sampler.h"
#include "huber_thresholds.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <optional>

namespace difftrain::diffusion {
namespace {

constexpr double kPi = 3.14159265358979323846;

bool one_of(const std::string& value, const std::vector<std::string>& known) {
  return std::find(known.begin(), known.end(), value) != known.end();
}

struct RegisteredSamplings {
  std::mutex mutex;
  std::vector<FlowTimestepSampling> samplings;
};

RegisteredSamplings& registered_samplings() {
  static RegisteredSamplings r;
  return r;
}

// The registered sampling named `name`, if any (a copy: the registry may grow meanwhile).
std::optional<FlowTimestepSampling> registered_sampling(const std::string& name) {
  auto& r = registered_samplings();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (const auto& s : r.samplings) {
    if (s.name == name) return s;
  }
  return std::nullopt;
}

const std::vector<std::string> kBuiltInSamplings = {"sigma", "uniform", "sigmoid", "shift"};

}  // namespace

void register_flow_timestep_sampling(FlowTimestepSampling sampling) {
  if (sampling.name.empty() || !sampling.shift) {
    throw Error("register_flow_timestep_sampling: a sampling needs a name and a shift");
  }
  if (one_of(sampling.name, flow_timestep_samplings())) {
    throw Error("--timestep_sampling " + sampling.name + " is registered already");
  }
  auto& r = registered_samplings();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.samplings.push_back(std::move(sampling));
}

std::vector<std::string> flow_weighting_schemes() {
  return {"none", "logit_normal", "mode", "cosmap", "sigma_sqrt"};
}

std::vector<std::string> flow_timestep_samplings() {
  std::vector<std::string> out = kBuiltInSamplings;
  auto& r = registered_samplings();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (const auto& s : r.samplings) out.push_back(s.name);
  return out;
}

FlowMatchObjective::FlowMatchObjective(const nlohmann::json& scheduler_config,
                                       const std::string& source, FlowMatchOptions options)
    : options_(std::move(options)) {
  set_loss_options(options_.loss);
  const auto& o = options_;
  if (!one_of(o.weighting_scheme, flow_weighting_schemes())) {
    throw Error(fmt::format("--weighting_scheme {}: unknown; use one of {}", o.weighting_scheme,
                            fmt::join(flow_weighting_schemes(), ", ")));
  }
  if (!one_of(o.timestep_sampling, flow_timestep_samplings())) {
    throw Error(fmt::format("--timestep_sampling {}: unknown for flow matching; use one of {}",
                            o.timestep_sampling, fmt::join(flow_timestep_samplings(), ", ")));
  }
  if (!(o.logit_std > 0) || !std::isfinite(o.logit_mean)) {
    throw Error(fmt::format("--logit_std {} must be > 0 (and --logit_mean {} finite)", o.logit_std,
                            o.logit_mean));
  }
  if (!(o.sigmoid_scale > 0)) {
    throw Error(fmt::format("--sigmoid_scale {} must be > 0", o.sigmoid_scale));
  }
  if (!(o.min_timestep >= 0 && o.min_timestep < o.max_timestep && o.max_timestep <= 1000)) {
    throw Error(fmt::format(
        "--min_timestep {} / --max_timestep {}: need 0 <= min < max <= 1000 (musubi-tuner's range)",
        o.min_timestep, o.max_timestep));
  }
  if (o.timestep_sampling == "sigma" && (o.min_timestep != 0 || o.max_timestep != 1000)) {
    throw Error(
        "--min_timestep / --max_timestep apply to the continuous samplings (uniform, sigmoid, "
        "shift, ...); with --timestep_sampling sigma leave them out");
  }
  if (!(o.discrete_flow_shift > 0) || !std::isfinite(o.discrete_flow_shift)) {
    throw Error(fmt::format("--discrete_flow_shift {} must be a finite number > 0 (1: no shift)",
                            o.discrete_flow_shift));
  }
  if (!std::isfinite(o.mode_scale)) throw Error("--mode_scale must be finite");
  // The scheduler as the training script builds it: its __init__ tables, never set_timesteps.
  auto sampler = make_sampler(scheduler_config, "", source);
  if (sampler->class_name() != "FlowMatchEulerDiscreteScheduler") {
    throw Error(source + ": a " + sampler->class_name() +
                " config; flow-matching training needs a FlowMatchEulerDiscreteScheduler (the "
                "scheduler/ folder of a flow-matching pipeline)");
  }
  timesteps_ = sampler->timesteps().to(torch::kFloat32).clone();
  sigmas_ = sampler->sigmas().to(torch::kFloat32).clone();
  num_train_timesteps_ = timesteps_.size(0);
}

std::string FlowMatchObjective::name() const {
  return options_.timestep_sampling == "sigma"
             ? "flow matching (" + options_.weighting_scheme + ")"
             : "flow matching (" + options_.timestep_sampling + ", weighting " +
                   options_.weighting_scheme + ")";
}

torch::Tensor FlowMatchObjective::draw(at::Generator& gen) const {
  const auto& o = options_;
  const auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
  if (o.timestep_sampling == "sigma") {
    if (o.weighting_scheme == "logit_normal") {
      return torch::sigmoid(torch::randn({1}, gen, f32) * o.logit_std + o.logit_mean);
    }
    auto u = torch::rand({1}, gen, f32);
    if (o.weighting_scheme == "mode") {
      u = 1 - u - o.mode_scale * (torch::cos(kPi * u / 2).pow(2) - 1 + u);
    }
    return u;
  }
  if (o.timestep_sampling == "uniform") return torch::rand({1}, gen, f32);
  auto t = torch::sigmoid(torch::randn({1}, gen, f32) * o.sigmoid_scale);
  if (o.timestep_sampling == "shift") {
    const double s = o.discrete_flow_shift;
    t = (t * s) / (1 + (s - 1) * t);
  }
  return t;  // sigmoid; a registered sampling shifts it in sigmas_for (it needs the latent size)
}

FlowMatchObjective::Draws FlowMatchObjective::sigmas_for(const torch::Tensor& u_in,
                                                         torch::IntArrayRef x0_shape) const {
  const auto u = u_in.to(torch::kCPU, torch::kFloat32).reshape({-1});
  Draws d;
  const auto& o = options_;
  if (o.timestep_sampling == "sigma") {
    // Diffusers: indices = (u * N).long(). u = 0 exactly under "mode" would give N; clamped.
    d.indices = (u * num_train_timesteps_).to(torch::kLong).clamp(0, num_train_timesteps_ - 1);
    d.sigmas = sigmas_.index_select(0, d.indices);
    return d;
  }
  d.sigmas = u;
  if (!one_of(o.timestep_sampling, kBuiltInSamplings)) {
    const auto sampling = registered_sampling(o.timestep_sampling);
    if (!sampling) {
      throw Error("--timestep_sampling " + o.timestep_sampling + " is no longer registered");
    }
    d.sigmas = sampling->shift(u, x0_shape).to(torch::kCPU, torch::kFloat32).reshape({-1});
  }
  // musubi-tuner's / kohya's timestep range: t * (t_max - t_min) + t_min (in [0, 1]).
  if (o.min_timestep != 0.0 || o.max_timestep != 1000.0) {
    const float lo = static_cast<float>(o.min_timestep / 1000.0);
    const float hi = static_cast<float>(o.max_timestep / 1000.0);
    d.sigmas = d.sigmas * (hi - lo) + lo;
  }
  return d;
}

NoisedBatch FlowMatchObjective::from_draws(const torch::Tensor& x0, const torch::Tensor& noise,
                                           const torch::Tensor& u) const {
  if (x0.dim() < 2 || noise.sizes() != x0.sizes() || u.numel() != x0.size(0)) {
    throw Error(fmt::format(
        "FlowMatchObjective: x0 [{}] needs a batch [B, ...], noise of its shape (got [{}]) and "
        "one draw per sample (got {})",
        fmt::join(x0.sizes(), ", "), fmt::join(noise.sizes(), ", "), u.numel()));
  }
  const Draws d = sigmas_for(u, x0.sizes());
  std::vector<int64_t> view(static_cast<size_t>(x0.dim()), 1);
  view[0] = x0.size(0);
  const auto sigma = d.sigmas.to(x0.device(), x0.scalar_type()).view(view);
  NoisedBatch out;
  out.model_input = (1.0 - sigma) * x0 + sigma * noise.to(x0.scalar_type());
  out.target = (noise.to(torch::kFloat32) - x0.to(torch::kFloat32));
  out.timesteps = (d.indices.defined() ? timesteps_.index_select(0, d.indices)
                                       : d.sigmas * static_cast<float>(num_train_timesteps_))
                      .to(x0.device());
  const auto s = d.sigmas.to(torch::kFloat32);
  if (loss_.huber()) {  // t = 1000 sigma; set_loss_options() refuses snr
    out.huber_c =
        huber_thresholds(loss_, s.to(torch::kFloat64) * static_cast<double>(num_train_timesteps_),
                         num_train_timesteps_, {}, x0.device());
  }
  if (options_.weighting_scheme == "cosmap") {
    out.weights = (2 / (kPi * (1 - 2 * s + 2 * s.pow(2)))).to(x0.device());
  } else if (options_.weighting_scheme == "sigma_sqrt") {
    out.weights = s.pow(-2.0).to(x0.device());
  }
  return out;
}

void FlowMatchObjective::set_loss_options(LossOptions options) {
  if (options.huber() && options.huber_schedule == "snr") {
    throw Error(
        "--huber_schedule snr needs a DDPM scheduler's alphas_cumprod, which flow "
        "matching has not (kohya refuses it too): use exponential or constant");
  }
  TrainingObjective::set_loss_options(std::move(options));
}

NoisedBatch FlowMatchObjective::noise(const torch::Tensor& x0, const std::vector<int64_t>& keys,
                                      int64_t epoch, torch::Device device) const {
  if (x0.dim() < 2 || x0.size(0) != static_cast<int64_t>(keys.size())) {
    throw Error(fmt::format(
        "FlowMatchObjective: x0 [{}] needs a batch [B, ...] and one key per sample, got {} keys",
        fmt::join(x0.sizes(), ", "), keys.size()));
  }
  const auto shape = x0.sizes().slice(1).vec();
  std::vector<torch::Tensor> noises, draws;
  for (int64_t key : keys) {
    auto gn = core::sample_generator(options_.seed, epoch, key, core::SampleStream::kNoise);
    noises.push_back(torch::randn(shape, gn, torch::kFloat32));
    auto gt = core::sample_generator(options_.seed, epoch, key, core::SampleStream::kTimestep);
    draws.push_back(draw(gt));
  }
  return from_draws(x0.to(device), torch::stack(noises).to(device), torch::cat(draws));
}

}  // namespace difftrain::diffusion
