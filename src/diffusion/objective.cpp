// The training objectives: the shared loss reduction and Diffusers' DDPM objective.
#include "difftrain/diffusion/objective.h"

#include "difftrain/core/error.h"
#include "difftrain/core/sample_rng.h"
#include "huber_thresholds.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>

namespace difftrain::diffusion {

const std::vector<std::string>& loss_types() {
  static const std::vector<std::string> types = {"l2", "l1", "huber", "smooth_l1"};
  return types;
}

const std::vector<std::string>& huber_schedules() {
  static const std::vector<std::string> schedules = {"constant", "exponential", "snr"};
  return schedules;
}

torch::Tensor elementwise_loss(const torch::Tensor& prediction, const torch::Tensor& target,
                               const LossOptions& options, const torch::Tensor& huber_c) {
  const auto d = prediction.to(torch::kFloat32) - target.to(torch::kFloat32);
  if (options.loss_type == "l2") return d.pow(2);
  if (options.loss_type == "l1") return d.abs();
  if (!huber_c.defined() || huber_c.numel() != d.size(0)) {
    throw Error("--loss_type " + options.loss_type +
                " needs one Huber threshold per sample (the objective's noise() gives them)");
  }
  std::vector<int64_t> view(static_cast<size_t>(d.dim()), 1);
  view[0] = d.size(0);
  const auto c = huber_c.to(d.device(), torch::kFloat32).view(view);
  const auto smooth = torch::sqrt(d.pow(2) + c.pow(2)) - c;
  if (options.loss_type == "huber") return 2 * c * smooth;
  if (options.loss_type == "smooth_l1") return 2 * smooth;
  throw Error(fmt::format("--loss_type {}: expected one of {}", options.loss_type,
                          fmt::join(loss_types(), " | ")));
}

torch::Tensor apply_loss_mask(const torch::Tensor& loss, const torch::Tensor& mask) {
  if (mask.dim() != 4 || mask.size(1) != 1 || mask.size(0) != loss.size(0) ||
      (loss.dim() != 4 && loss.dim() != 5)) {
    throw Error(fmt::format(
        "the loss mask [{}] must be [B, 1, H, W] for a loss of [B, C, h, w] or [B, C, F, h, w], "
        "got a loss of [{}]",
        fmt::join(mask.sizes(), ", "), fmt::join(loss.sizes(), ", ")));
  }
  const int64_t h = loss.size(-2), w = loss.size(-1);
  // kohya: F.interpolate(mask, size=loss.shape[2:], mode="area").
  auto m = torch::adaptive_avg_pool2d(mask.to(loss.device(), torch::kFloat32), {h, w});
  if (loss.dim() == 5) m = m.unsqueeze(2);  // every frame of a clip
  return loss * m;
}

void TrainingObjective::set_loss_options(LossOptions options) {
  const auto known = [](const std::vector<std::string>& list, const std::string& v) {
    return std::find(list.begin(), list.end(), v) != list.end();
  };
  if (!known(loss_types(), options.loss_type)) {
    throw Error(fmt::format("--loss_type {}: expected one of {}", options.loss_type,
                            fmt::join(loss_types(), " | ")));
  }
  if (!known(huber_schedules(), options.huber_schedule)) {
    throw Error(fmt::format("--huber_schedule {}: expected one of {}", options.huber_schedule,
                            fmt::join(huber_schedules(), " | ")));
  }
  if (options.huber() && !(options.huber_c > 0 && options.huber_c <= 1)) {
    throw Error(
        fmt::format("--huber_c {} must be in (0, 1] (kohya's default is 0.1)", options.huber_c));
  }
  loss_ = std::move(options);
}

torch::Tensor huber_thresholds(const LossOptions& o, const torch::Tensor& t_in, int64_t T,
                               const torch::Tensor& snr_sigmas, torch::Device device) {
  const auto t = t_in.to(torch::kCPU, torch::kFloat64);
  torch::Tensor c;
  if (o.huber_schedule == "constant") {
    c = torch::full({t.size(0)}, o.huber_c * o.huber_scale, torch::kFloat64);
  } else if (o.huber_schedule == "exponential") {
    const double alpha = -std::log(o.huber_c) / static_cast<double>(T);
    c = torch::exp(-alpha * t) * o.huber_scale;
  } else {
    c = (1 - o.huber_c) / (1 + snr_sigmas).pow(2) + o.huber_c;
  }
  return c.to(device, torch::kFloat32);
}

torch::Tensor TrainingObjective::losses(const torch::Tensor& prediction, const NoisedBatch& batch,
                                        const torch::Tensor& mask) const {
  if (prediction.sizes() != batch.target.sizes() || prediction.dim() < 2) {
    throw Error(fmt::format(
        "{}: the prediction's shape [{}] differs from the target's [{}] (both must be a batch "
        "[B, ...] of 2 or more dimensions): the denoiser's output does not match its input",
        name(), fmt::join(prediction.sizes(), ", "), fmt::join(batch.target.sizes(), ", ")));
  }
  std::vector<int64_t> dims;
  for (int64_t d = 1; d < prediction.dim(); ++d) dims.push_back(d);
  auto loss = elementwise_loss(prediction, batch.target, loss_, batch.huber_c);
  if (mask.defined()) loss = apply_loss_mask(loss, mask);
  auto per_sample = loss.mean(dims);
  if (!batch.weights.defined()) return per_sample;
  return per_sample * batch.weights.to(per_sample.dtype());
}

torch::Tensor pyramid_noise(const torch::Tensor& noise, at::Generator& generator,
                            int64_t iterations, double discount) {
  if (noise.dim() != 3 && noise.dim() != 4) {
    throw Error(
        fmt::format("multires noise needs one sample [C, H, W] or a clip [C, F, H, W], got [{}]",
                    fmt::join(noise.sizes(), ", ")));
  }
  const int64_t H = noise.size(-2), W = noise.size(-1);
  // A clip's frames are channels of one image: each gets its own pyramid.
  auto x = noise.reshape({1, -1, H, W}).to(torch::kFloat32).clone();
  const int64_t C = x.size(1);
  for (int64_t i = 0; i < iterations; ++i) {
    const double r = torch::rand({1}, generator, torch::kFloat64).item<double>() * 2 + 2;
    const double scale = std::pow(r, static_cast<double>(i));
    const int64_t h = std::max<int64_t>(1, static_cast<int64_t>(H / scale));
    const int64_t w = std::max<int64_t>(1, static_cast<int64_t>(W / scale));
    auto level = torch::randn({1, C, h, w}, generator, torch::kFloat32).to(x.device());
    x = x + torch::upsample_bilinear2d(level, {H, W}, /*align_corners=*/false) *
                std::pow(discount, static_cast<double>(i));
    if (h == 1 || w == 1) break;
  }
  return (x / x.std()).reshape(noise.sizes()).to(noise.scalar_type());
}

DdpmObjective::DdpmObjective(std::shared_ptr<NoiseScheduler> scheduler,
                             DdpmObjectiveOptions options)
    : scheduler_(std::move(scheduler)), options_(options) {
  TORCH_CHECK(scheduler_ != nullptr, "DdpmObjective needs a noise scheduler");
  set_loss_options(options_.loss);
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
    // kohya's order: the offset, then the pyramid (from the noise stream, after the offset's
    // draws, so runs without it keep their numbers).
    if (n.multires_noise_iterations > 0) {
      noise = pyramid_noise(noise, gn, n.multires_noise_iterations, n.multires_noise_discount);
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
  if (loss_.huber()) {
    // snr: sigma = sqrt((1 - alpha_bar) / alpha_bar) = 1 / sqrt(SNR)
    const auto sigmas =
        loss_.huber_schedule == "snr"
            ? scheduler_->snr(out.timesteps).to(torch::kCPU, torch::kFloat64).rsqrt()
            : torch::Tensor();
    out.huber_c = huber_thresholds(loss_, out.timesteps, T, sigmas, device);
  }
  if (n.snr_gamma) {
    out.weights = min_snr_weights(scheduler_->snr(out.timesteps), *n.snr_gamma,
                                  scheduler_->config().prediction_type)
                      .to(torch::kFloat32);
  }
  return out;
}

}  // namespace difftrain::diffusion
