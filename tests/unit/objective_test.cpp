// The training objective interface (diffusion/objective.h) and the UNet behind the Denoiser
// interface (diffusion/denoiser.h), against float64 recomputations of Diffusers' formulas from the
// same per-sample random streams.
#include "difftrain/diffusion/objective.h"

#include "difftrain/core/error.h"
#include "difftrain/core/sample_rng.h"
#include "difftrain/diffusion/scheduler_config.h"
#include "difftrain/families/unet/denoiser.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>
#include <vector>

namespace difftrain::test {
namespace {

std::shared_ptr<diffusion::NoiseScheduler> ddpm(diffusion::PredictionType type) {
  diffusion::SchedulerConfig sc;
  sc.class_name = "DDPMScheduler";
  sc.num_train_timesteps = 1000;
  sc.prediction_type = type;
  return diffusion::make_scheduler(sc, "ddpm");
}

// The draws DdpmObjective makes for sample `key`, redone here: noise [shape] and t.
std::pair<torch::Tensor, int64_t> draws(uint64_t seed, int64_t epoch, int64_t key,
                                        const std::vector<int64_t>& shape) {
  auto gn = core::sample_generator(seed, epoch, key, core::SampleStream::kNoise);
  auto gt = core::sample_generator(seed, epoch, key, core::SampleStream::kTimestep);
  return {torch::randn(shape, gn, torch::kFloat32),
          torch::randint(0, 1000, {1}, gt, torch::kInt64).item<int64_t>()};
}

TEST(Objective, DdpmNoisesEachSampleFromItsOwnStreamsAsDiffusersDoes) {
  for (auto type : {diffusion::PredictionType::kEpsilon, diffusion::PredictionType::kVPrediction,
                    diffusion::PredictionType::kSample}) {
    auto scheduler = ddpm(type);
    diffusion::DdpmObjectiveOptions options;
    options.seed = 5;
    diffusion::DdpmObjective objective(scheduler, options);
    auto x0 = torch::randn({3, 4, 6, 5});
    const std::vector<int64_t> keys = {11, 3, 42};
    const auto noised = objective.noise(x0, keys, /*epoch=*/2, torch::kCPU);
    ASSERT_EQ(noised.model_input.sizes(), x0.sizes());
    ASSERT_EQ(noised.target.sizes(), x0.sizes());
    EXPECT_FALSE(noised.weights.defined());
    const auto abar = scheduler->alphas_cumprod().to(torch::kFloat64);
    double worst = 0;
    for (size_t i = 0; i < keys.size(); ++i) {
      const auto [noise, t] = draws(5, 2, keys[i], {4, 6, 5});
      EXPECT_EQ(noised.timesteps[static_cast<int64_t>(i)].item<int64_t>(), t);
      const double a = abar[t].item<double>();
      const auto x = x0[static_cast<int64_t>(i)].to(torch::kFloat64);
      const auto e = noise.to(torch::kFloat64);
      const auto noisy = std::sqrt(a) * x + std::sqrt(1 - a) * e;
      const auto target = type == diffusion::PredictionType::kEpsilon ? e
                          : type == diffusion::PredictionType::kVPrediction
                              ? std::sqrt(a) * e - std::sqrt(1 - a) * x
                              : x;
      worst = std::max({worst, max_abs(noised.model_input[static_cast<int64_t>(i)], noisy),
                        max_abs(noised.target[static_cast<int64_t>(i)], target)});
    }
    std::printf("%s: max |difference| from float64 %.3g (tolerance 1e-5)\n",
                objective.name().c_str(), worst);
    EXPECT_LT(worst, 1e-5) << objective.name();
  }
}

TEST(Objective, ASampleGetsTheSameDrawsInAnyBatch) {
  diffusion::DdpmObjective objective(ddpm(diffusion::PredictionType::kEpsilon), {});
  auto x0 = torch::randn({2, 3, 4, 4});
  const auto both = objective.noise(x0, {7, 9}, 0, torch::kCPU);
  const auto alone = objective.noise(x0.narrow(0, 1, 1), {9}, 0, torch::kCPU);
  EXPECT_TRUE(torch::equal(both.model_input[1], alone.model_input[0]));
  EXPECT_TRUE(torch::equal(both.timesteps[1], alone.timesteps[0]));
}

TEST(Objective, OffsetNoiseIsOneValuePerChannelForAnySampleRank) {
  // [B, C, H, W] images and [B, S, C]-style 3-D samples: the offset is drawn per leading sample
  // dimension after the stream's main noise.
  for (const std::vector<int64_t>& shape :
       {std::vector<int64_t>{2, 3, 4, 4}, std::vector<int64_t>{2, 5, 6}}) {
    diffusion::DdpmObjectiveOptions options;
    options.noise_offset = 0.1;
    diffusion::DdpmObjective objective(ddpm(diffusion::PredictionType::kEpsilon), options);
    auto x0 = torch::zeros(shape);
    const auto noised = objective.noise(x0, {1, 2}, 0, torch::kCPU);
    const std::vector<int64_t> one(shape.begin() + 1, shape.end());
    auto gn = core::sample_generator(0, 0, 2, core::SampleStream::kNoise);
    auto noise = torch::randn(one, gn, torch::kFloat32);
    std::vector<int64_t> offset_shape(one.size(), 1);
    offset_shape[0] = one[0];
    noise = noise + 0.1 * torch::randn(offset_shape, gn, torch::kFloat32);
    EXPECT_LT(max_abs(noised.target[1], noise), 1e-7);
  }
}

// Video latents [B, C, F, H, W] (issue 57): the DDPM objective draws a clip's noise as it draws an
// image's of [C, F x H, W] (one stream, the offset one value per channel), with every option on,
// and its losses reduce over the frames too.
TEST(Objective, DdpmTakesVideoLatentsAsImagesOfStackedFrames) {
  for (auto type : {diffusion::PredictionType::kEpsilon, diffusion::PredictionType::kVPrediction}) {
    diffusion::DdpmObjectiveOptions options;
    options.noise_offset = 0.05;
    options.input_perturbation = 0.1;
    options.snr_gamma = 5.0;
    diffusion::DdpmObjective objective(ddpm(type), options);
    torch::manual_seed(3);
    const auto clip = torch::randn({2, 4, 3, 5, 6});
    const auto video = objective.noise(clip, {4, 11}, 2, torch::kCPU);
    const auto image = objective.noise(clip.reshape({2, 4, 15, 6}), {4, 11}, 2, torch::kCPU);
    ASSERT_EQ(video.model_input.sizes(), clip.sizes());
    EXPECT_TRUE(torch::equal(video.model_input.reshape({2, 4, 15, 6}), image.model_input));
    EXPECT_TRUE(torch::equal(video.target.reshape({2, 4, 15, 6}), image.target));
    EXPECT_TRUE(torch::equal(video.timesteps, image.timesteps));
    EXPECT_TRUE(torch::equal(video.weights, image.weights));
    const auto prediction = torch::randn_like(clip);
    EXPECT_TRUE(torch::allclose(objective.losses(prediction, video),
                                objective.losses(prediction.reshape({2, 4, 15, 6}), image)));
  }
}

TEST(Objective, LossesReduceOverEveryNonBatchDimensionWithMinSnrWeights) {
  diffusion::DdpmObjectiveOptions options;
  options.snr_gamma = 5.0;
  auto scheduler = ddpm(diffusion::PredictionType::kEpsilon);
  diffusion::DdpmObjective objective(scheduler, options);
  auto x0 = torch::randn({4, 2, 3, 3});
  const auto noised = objective.noise(x0, {0, 1, 2, 3}, 0, torch::kCPU);
  ASSERT_TRUE(noised.weights.defined());
  auto prediction = torch::randn({4, 2, 3, 3});
  const auto losses = objective.losses(prediction, noised);
  ASSERT_EQ(losses.sizes(), (torch::IntArrayRef{4}));
  const auto abar = scheduler->alphas_cumprod().to(torch::kFloat64);
  for (int64_t i = 0; i < 4; ++i) {
    const double a = abar[noised.timesteps[i].item<int64_t>()].item<double>();
    const double snr = a / (1 - a);
    const double weight = std::min(snr, 5.0) / snr;  // Diffusers' min-SNR for epsilon
    const double mse = (prediction[i].to(torch::kFloat64) - noised.target[i].to(torch::kFloat64))
                           .pow(2)
                           .mean()
                           .item<double>();
    EXPECT_NEAR(losses[i].item<double>(), weight * mse, 1e-5 * weight * mse) << i;
  }
  // A 3-D batch (a transformer's [B, S, C]) reduces over S and C.
  diffusion::NoisedBatch packed;
  packed.target = torch::zeros({2, 5, 3});
  const auto packed_losses = objective.losses(torch::ones({2, 5, 3}), packed);
  EXPECT_TRUE(torch::allclose(packed_losses, torch::ones({2})));
  EXPECT_NE(error_of([&] {
              objective.losses(torch::ones({2, 5}), packed);
            }).find("shape"),
            std::string::npos);
}

TEST(Objective, TheUNetDenoiserTakesUNetConditioningByName) {
  diffusion::Conditioning cond = {{"encoder_hidden_states", torch::zeros({1, 2, 8})},
                                  {"class_labels", torch::zeros({1}, torch::kInt64)}};
  const auto c = families::unet::UNetDenoiser::unet_conditioning(cond);
  EXPECT_TRUE(c.encoder_hidden_states.defined());
  EXPECT_TRUE(c.class_labels.defined());
  EXPECT_FALSE(c.text_embeds.defined());
  const std::string message = error_of([] {
    families::unet::UNetDenoiser::unet_conditioning({{"pooled_projections", torch::zeros({1, 4})}});
  });
  EXPECT_NE(message.find("pooled_projections"), std::string::npos) << message;
  EXPECT_NE(message.find("encoder_hidden_states"), std::string::npos) << message;
}

}  // namespace
}  // namespace difftrain::test
