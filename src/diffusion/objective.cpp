// The training objectives: the shared loss reduction and Diffusers' DDPM objective.
#include "difftrain/diffusion/objective.h"

#include "difftrain/core/error.h"
#include "difftrain/core/sample_rng.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

namespace difftrain::diffusion {

torch::Tensor TrainingObjective::losses(const torch::Tensor& prediction,
                                        const NoisedBatch& batch) const {
  if (prediction.sizes() != batch.target.sizes() || prediction.dim() < 2) {
    throw Error(fmt::format(
        "{}: the prediction's shape [{}] differs from the target's [{}] (both must be a batch "
        "[B, ...] of 2 or more dimensions): the denoiser's output does not match its input",
        name(), fmt::join(prediction.sizes(), ", "), fmt::join(batch.target.sizes(), ", ")));
  }
  std::vector<int64_t> dims;
  for (int64_t d = 1; d < prediction.dim(); ++d) dims.push_back(d);
  auto per_sample = (prediction.to(torch::kFloat32) - batch.target).pow(2).mean(dims);
  if (!batch.weights.defined()) return per_sample;
  return per_sample * batch.weights.to(per_sample.dtype());
}

DdpmObjective::DdpmObjective(std::shared_ptr<NoiseScheduler> scheduler,
                             DdpmObjectiveOptions options)
    : scheduler_(std::move(scheduler)), options_(options) {
  TORCH_CHECK(scheduler_ != nullptr, "DdpmObjective needs a noise scheduler");
}

std::string DdpmObjective::name() const {
  return "ddpm " + to_string(scheduler_->config().prediction_type);
}

NoisedBatch DdpmObjective::noise(const torch::Tensor& x0, const std::vector<int64_t>& keys,
                                 int64_t epoch, torch::Device device) const {
  const auto& n = options_;
  if (x0.dim() < 2 || x0.size(0) != static_cast<int64_t>(keys.size())) {
    throw Error(
        fmt::format("DdpmObjective: x0 [{}] needs a batch [B, ...] and one key per sample, "
                    "got {} keys",
                    fmt::join(x0.sizes(), ", "), keys.size()));
  }
  const int64_t T = scheduler_->num_train_timesteps();
  const auto shape = x0.sizes().slice(1).vec();  // one sample: [C, ...]
  // The offset noise is one value per channel: [C, 1, ...].
  std::vector<int64_t> offset_shape(shape.size(), 1);
  offset_shape[0] = shape[0];
  std::vector<torch::Tensor> noises, timesteps, perturb;
  for (int64_t key : keys) {
    auto gn = core::sample_generator(n.seed, epoch, key, core::SampleStream::kNoise);
    auto noise = torch::randn(shape, gn, torch::kFloat32);
    if (n.noise_offset > 0) {
      noise = noise + n.noise_offset * torch::randn(offset_shape, gn, torch::kFloat32);
    }
    noises.push_back(noise);
    auto gt = core::sample_generator(n.seed, epoch, key, core::SampleStream::kTimestep);
    timesteps.push_back(torch::randint(0, T, {1}, gt, torch::kInt64));
    if (n.input_perturbation > 0) {
      auto gp = core::sample_generator(n.seed, epoch, key, core::SampleStream::kPerturbation);
      perturb.push_back(torch::randn(shape, gp, torch::kFloat32));
    }
  }
  auto noise = torch::stack(noises).to(device);
  NoisedBatch out;
  out.timesteps = torch::cat(timesteps).to(device);
  // Diffusers: input perturbation noises the input with a perturbed noise, but the target keeps
  // the original noise.
  out.model_input = scheduler_->add_noise(
      x0,
      n.input_perturbation > 0 ? noise + n.input_perturbation * torch::stack(perturb).to(device)
                               : noise,
      out.timesteps);
  out.target = scheduler_->training_target(x0, noise, out.timesteps).to(torch::kFloat32);
  if (n.snr_gamma) {
    out.weights = min_snr_weights(scheduler_->snr(out.timesteps), *n.snr_gamma,
                                  scheduler_->config().prediction_type)
                      .to(torch::kFloat32);
  }
  return out;
}

}  // namespace difftrain::diffusion
