// `difftrain estimate-memory`'s numbers: state bytes against an independent count (parameters
// summed, units from plan_units with ceil division, real AdamW / AdamW8bit state after one step),
// LoRA splitting trainable from frozen, one process equal to NO_SHARD, and the measured
// activations growing linearly with the batch and with the resolution.

#include "difftrain/train/memory_estimate.h"
#include "difftrain/accel/sharding.h"
#include "difftrain/core/error.h"
#include "difftrain/families/unet/memory.h"
#include "difftrain/models/autoencoders/autoencoder_kl.h"
#include "difftrain/models/lora/lora_training.h"
#include "difftrain/models/pretrained.h"
#include "difftrain/models/text_encoders/clip_text_model.h"
#include "difftrain/models/unets/unet.h"
#include "difftrain/models/unets/unet_config.h"
#include "difftrain/optim/adamw.h"
#include "difftrain/optim/adamw8bit.h"
#include "difftrain/optim/prodigy.h"

#include "source_dir.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>

namespace {

namespace fs = std::filesystem;
using difftrain::accel::ShardingStrategy;
using difftrain::models::UNet;
using difftrain::train::estimate_state_memory;
using difftrain::train::MemoryEstimate;
using difftrain::train::MemoryEstimateOptions;

using difftrain::test::kDiffusersGolden;
const ShardingStrategy kSharded[] = {ShardingStrategy::kShardOptimizer,
                                     ShardingStrategy::kShardGradOp, ShardingStrategy::kFullShard};

UNet tiny_unet(const std::string& name = "unet_cond") {
  return UNet(difftrain::models::UNetConfig::load(kDiffusersGolden + name + "/config.json"));
}

int64_t trainable_numel(const torch::nn::Module& m) {
  int64_t n = 0;
  for (const auto& p : m.parameters()) n += p.requires_grad() ? p.numel() : 0;
  return n;
}

// The real optimizer's state after one step with every gradient set.
template <typename Opt>
int64_t state_after_one_step(std::vector<torch::Tensor> params) {
  for (auto& p : params) p.mutable_grad() = torch::full_like(p, 0.01);
  Opt opt(params);
  opt.step();
  return opt.state_bytes();
}

std::vector<torch::Tensor> fresh_copies(const torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (const auto& p : m.parameters()) {
    if (p.requires_grad()) out.push_back(p.detach().clone().set_requires_grad(true));
  }
  return out;
}

void expect_same_state(const MemoryEstimate& a, const MemoryEstimate& b) {
  EXPECT_EQ(a.param_bytes, b.param_bytes);
  EXPECT_EQ(a.param_peak_bytes, b.param_peak_bytes);
  EXPECT_EQ(a.grad_bytes, b.grad_bytes);
  EXPECT_EQ(a.grad_peak_bytes, b.grad_peak_bytes);
  EXPECT_EQ(a.optimizer_bytes, b.optimizer_bytes);
  EXPECT_EQ(a.frozen_param_bytes, b.frozen_param_bytes);
  EXPECT_EQ(a.strategy, b.strategy);
}

TEST(MemoryEstimate, NoShardCountsEveryParameterAndTheRealOptimizerState) {
  UNet unet = tiny_unet();
  const int64_t P = trainable_numel(*unet);
  for (bool eight_bit : {false, true}) {
    MemoryEstimateOptions o;
    o.num_processes = 2;
    o.use_8bit_adam = eight_bit;
    const auto e = estimate_state_memory(*unet, o);
    EXPECT_EQ(e.strategy, ShardingStrategy::kNoShard);
    EXPECT_EQ(e.trainable_params, P);
    EXPECT_EQ(e.param_bytes, 4 * P);
    EXPECT_EQ(e.param_peak_bytes, 4 * P);
    EXPECT_EQ(e.grad_bytes, 4 * P);
    EXPECT_EQ(e.grad_peak_bytes, 4 * P);
    EXPECT_EQ(e.frozen_param_bytes, 0);
    EXPECT_EQ(e.activation_bytes, 0);
    const int64_t real =
        eight_bit ? state_after_one_step<difftrain::optim::AdamW8bit>(fresh_copies(*unet))
                  : state_after_one_step<difftrain::optim::AdamW>(fresh_copies(*unet));
    EXPECT_EQ(e.optimizer_bytes, real) << (eight_bit ? "AdamW8bit" : "AdamW");
    if (eight_bit) {
      EXPECT_LT(e.optimizer_bytes, 8 * P);
    } else {
      EXPECT_EQ(e.optimizer_bytes, 8 * P);
    }
    EXPECT_EQ(e.total_peak_bytes(), 8 * P + e.optimizer_bytes);
  }
}

TEST(MemoryEstimate, ProdigyStateIsFourTensorsPerParameterAsTheRealOptimizer) {
  UNet unet = tiny_unet();
  MemoryEstimateOptions o;
  o.optimizer = "prodigy";
  const auto e = estimate_state_memory(*unet, o);
  EXPECT_EQ(e.optimizer_bytes, 16 * trainable_numel(*unet));
  EXPECT_EQ(e.optimizer_bytes,
            state_after_one_step<difftrain::optim::Prodigy>(fresh_copies(*unet)));
  o.use_8bit_adam = true;
  EXPECT_NE(
      difftrain::test::error_of([&] { estimate_state_memory(*unet, o); }).find("no 8-bit form"),
      std::string::npos);
}

TEST(MemoryEstimate, ShardedFormulasFollowThePlannedUnits) {
  UNet unet = tiny_unet();
  const int64_t P = trainable_numel(*unet);
  for (int N : {2, 3, 4}) {
    for (const auto strategy : kSharded) {
      for (const std::string policy : {"TRANSFORMER_BASED_WRAP", "NO_WRAP"}) {
        MemoryEstimateOptions o;
        o.num_processes = N;
        o.strategy = strategy;
        o.auto_wrap.policy = policy;
        const auto units = difftrain::accel::plan_units(*unet, o.auto_wrap);
        int64_t Sh = 0, Umax = 0, Uroot = 0, sum = 0;
        for (const auto& u : units) {
          const int64_t s = (u.numel + N - 1) / N;
          sum += u.numel;
          Sh += s;
          Umax = std::max(Umax, N * s);
          if (u.module_class == "root") Uroot = N * s;
        }
        const int64_t Ppad = N * Sh;
        ASSERT_EQ(sum, P);
        const auto e = estimate_state_memory(*unet, o);
        SCOPED_TRACE(std::string(difftrain::accel::to_string(strategy)) +
                     " N=" + std::to_string(N) + " " + policy);
        EXPECT_EQ(e.strategy, strategy);
        EXPECT_EQ(e.units.size(), units.size());
        EXPECT_EQ(e.trainable_params, P);
        EXPECT_EQ(e.shard_params, Sh);
        EXPECT_EQ(e.padded_params, Ppad);
        EXPECT_GE(Ppad, P);
        EXPECT_LT(Ppad, P + N * static_cast<int64_t>(units.size()));
        EXPECT_EQ(e.optimizer_bytes, 8 * Sh);  // AdamW: two fp32 moments per shard element
        if (strategy == ShardingStrategy::kFullShard) {
          EXPECT_EQ(e.param_bytes, 4 * Sh);
          EXPECT_EQ(e.param_peak_bytes, 4 * Sh + 4 * (Uroot + 2 * Umax));
        } else {
          EXPECT_EQ(e.param_bytes, 4 * Ppad + 4 * Sh);
          EXPECT_EQ(e.param_peak_bytes, 4 * Ppad + 4 * Sh);
        }
        if (strategy == ShardingStrategy::kShardOptimizer) {
          EXPECT_EQ(e.grad_bytes, 4 * Ppad + 4 * Sh);
          EXPECT_EQ(e.grad_peak_bytes, 4 * Ppad + 4 * Sh);
        } else {
          EXPECT_EQ(e.grad_bytes, 4 * Sh);
          EXPECT_EQ(e.grad_peak_bytes, 4 * Sh + 4 * Ppad);
        }
      }
    }
  }
}

TEST(MemoryEstimate, ShardedEightBitStateEqualsAdamW8bitOverEachShard) {
  UNet unet = tiny_unet();
  bool saw_small = false, saw_quantized = false;
  for (int N : {2, 4, 16}) {
    MemoryEstimateOptions o;
    o.num_processes = N;
    o.strategy = ShardingStrategy::kShardGradOp;
    o.use_8bit_adam = true;
    const auto e = estimate_state_memory(*unet, o);
    int64_t real = 0;
    for (const auto& u : e.units) {
      const int64_t s = (u.numel + N - 1) / N;
      (s < 4096 ? saw_small : saw_quantized) = true;
      real += state_after_one_step<difftrain::optim::AdamW8bit>(
          {torch::zeros({s}).set_requires_grad(true)});
    }
    EXPECT_EQ(e.optimizer_bytes, real) << "N=" << N;
  }
  // Both of AdamW8bit's paths (fp32 moments below min_8bit_size, 8-bit codes above) were covered.
  EXPECT_TRUE(saw_small);
  EXPECT_TRUE(saw_quantized);
}

TEST(MemoryEstimate, OneProcessIsNoShard) {
  UNet unet = tiny_unet();
  MemoryEstimateOptions base;
  const auto plain = estimate_state_memory(*unet, base);
  for (const auto strategy : kSharded) {
    for (bool eight_bit : {false, true}) {
      MemoryEstimateOptions o;
      o.strategy = strategy;
      o.use_8bit_adam = eight_bit;
      base.use_8bit_adam = eight_bit;
      expect_same_state(estimate_state_memory(*unet, o), estimate_state_memory(*unet, base));
    }
  }
  EXPECT_EQ(plain.param_bytes, 4 * trainable_numel(*unet));
}

TEST(MemoryEstimate, OffloadMovesTheOptimizerSideToTheHost) {
  UNet unet = tiny_unet();
  for (int N : {1, 2, 3}) {
    for (const auto strategy : kSharded) {
      for (bool params : {false, true}) {
        MemoryEstimateOptions o;
        o.num_processes = N;
        o.strategy = strategy;
        const auto plain = estimate_state_memory(*unet, o);
        o.offload_optimizer = true;
        o.offload_params = params;
        const auto e = estimate_state_memory(*unet, o);
        SCOPED_TRACE(std::string(difftrain::accel::to_string(strategy)) +
                     " N=" + std::to_string(N) + (params ? " + params" : ""));
        // One process keeps the strategy: the engine runs for the offload.
        EXPECT_EQ(e.strategy, strategy);
        EXPECT_TRUE(e.offload_optimizer);
        EXPECT_EQ(e.offload_params, params && strategy == ShardingStrategy::kFullShard);
        const int64_t Sh = e.shard_params, Ppad = e.padded_params;
        EXPECT_EQ(e.optimizer_bytes, 0);
        EXPECT_EQ(e.host_bytes, 4 * Sh + 4 * Sh + 8 * Sh);  // master, its gradient, AdamW
        if (N > 1) {
          // The optimizer side that left the device is what the host holds; FULL_SHARD without
          // parameter offload keeps one more copy of the shards on the device, for its gathers.
          const bool device_copy = strategy == ShardingStrategy::kFullShard && !e.offload_params;
          EXPECT_EQ(plain.param_bytes + plain.grad_bytes + plain.optimizer_bytes +
                        (device_copy ? 4 * Sh : 0),
                    e.param_bytes + e.grad_bytes + e.host_bytes);
        }
        switch (strategy) {
          case ShardingStrategy::kShardOptimizer:
            EXPECT_EQ(e.param_bytes, 4 * Ppad);
            EXPECT_EQ(e.grad_bytes, 4 * Ppad);
            break;
          case ShardingStrategy::kShardGradOp:
            EXPECT_EQ(e.param_bytes, 4 * Ppad);
            EXPECT_EQ(e.grad_bytes, 0);
            EXPECT_EQ(e.grad_peak_bytes, 4 * Ppad);
            break;
          default:
            EXPECT_EQ(e.param_bytes, e.offload_params ? 0 : 4 * Sh);
            EXPECT_EQ(e.grad_bytes, 0);
        }
      }
    }
  }
  // NO_SHARD rows of a comparison are without offload; a parameter offload alone is refused.
  MemoryEstimateOptions o;
  o.num_processes = 2;
  o.offload_optimizer = true;
  const auto none = estimate_state_memory(*unet, o);
  EXPECT_FALSE(none.offload_optimizer);
  EXPECT_EQ(none.host_bytes, 0);
  o.offload_optimizer = false;
  o.offload_params = true;
  EXPECT_THROW(estimate_state_memory(*unet, o), difftrain::Error);
}

TEST(MemoryEstimate, LoraTrainsTheAdaptersAndCountsTheBaseAsFrozen) {
  UNet unet = tiny_unet();
  int64_t base = 0;
  for (auto& p : unet->parameters()) {
    base += p.numel();
    p.set_requires_grad(false);
  }
  difftrain::models::LoraLayers lora(*unet, difftrain::models::LoraConfig{});
  const int64_t adapters = trainable_numel(*lora);
  ASSERT_GT(adapters, 0);
  MemoryEstimateOptions o;
  o.num_processes = 2;
  o.strategy = ShardingStrategy::kFullShard;
  const auto e = estimate_state_memory(*lora, o, unet.get());
  EXPECT_EQ(e.trainable_params, adapters);
  EXPECT_EQ(e.frozen_params, base);
  EXPECT_EQ(e.frozen_param_bytes, 4 * base);
  EXPECT_EQ(e.optimizer_bytes, 8 * e.shard_params);
  // Without the model, only the adapters' container is seen: nothing frozen.
  EXPECT_EQ(estimate_state_memory(*lora, o).frozen_param_bytes, 0);

  // estimate_memory builds the same thing from the folder (rank 4, the default targets).
  MemoryEstimateOptions lo = o;
  lo.lora = true;
  const auto built = difftrain::families::unet::estimate_memory(kDiffusersGolden + "unet_cond", lo);
  EXPECT_EQ(built.trainable_params, adapters);
  EXPECT_EQ(built.frozen_params, base);
  EXPECT_EQ(built.param_bytes, e.param_bytes);
  EXPECT_GT(built.activation_bytes, 0);
  lo.lora_rank = 8;
  EXPECT_EQ(difftrain::families::unet::estimate_memory(kDiffusersGolden + "unet_cond", lo)
                .trainable_params,
            2 * adapters);
}

TEST(MemoryEstimate, ActivationsAreLinearInBatchAndGrowWithResolution) {
  UNet unet = tiny_unet("unet2d");
  MemoryEstimateOptions o;
  const int64_t b1 = difftrain::families::unet::measure_activation_bytes(*unet, o, 1);
  const int64_t b2 = difftrain::families::unet::measure_activation_bytes(*unet, o, 2);
  const int64_t b4 = difftrain::families::unet::measure_activation_bytes(*unet, o, 4);
  // Linear: a per-sample part plus a small batch-independent one (time embedding and the like,
  // ~0.4 MB here), so the step from batch 2 to 4 is twice the step from 1 to 2.
  const double per_sample = static_cast<double>(b2 - b1);
  std::printf(
      "activations of the 16x16 UNet2DModel: batch 1 %lld, 2 %lld, 4 %lld bytes (per sample "
      "%.0f; (b4 - b2) / (b2 - b1) = %.3f, 2 within 10%%; fixed part %.0f, under 40%% of b1)\n",
      static_cast<long long>(b1), static_cast<long long>(b2), static_cast<long long>(b4),
      per_sample, static_cast<double>(b4 - b2) / per_sample, b1 - per_sample);
  EXPECT_GT(b1, 0);
  EXPECT_GT(per_sample, 0);
  EXPECT_NEAR(static_cast<double>(b4 - b2) / per_sample, 2.0, 0.2);
  EXPECT_LT(std::abs(b1 - per_sample), 0.4 * b1);
  o.resolution = 32;
  const int64_t r32 = difftrain::families::unet::measure_activation_bytes(*unet, o, 1);
  std::printf("32x32: %lld bytes (%.2fx of 16x16)\n", static_cast<long long>(r32),
              static_cast<double>(r32) / b1);
  EXPECT_GT(r32, 3 * b1);
  // Gradient checkpointing keeps less.
  o.gradient_checkpointing = true;
  const int64_t ckpt = difftrain::families::unet::measure_activation_bytes(*unet, o, 1);
  std::printf("32x32 with gradient checkpointing: %lld bytes\n", static_cast<long long>(ckpt));
  EXPECT_LT(ckpt, r32);
  EXPECT_FALSE(unet->gradient_checkpointing());  // restored
  o.gradient_checkpointing = false;
  o.mixed_precision = "bf16";
  EXPECT_GT(difftrain::families::unet::measure_activation_bytes(*unet, o, 1), 0);
  o.resolution = 15;
  EXPECT_NE(difftrain::test::error_of([&] {
              difftrain::families::unet::measure_activation_bytes(*unet, o, 1);
            }).find("not divisible by 2"),
            std::string::npos);
}

TEST(MemoryEstimate, ReadsTheInputsTheTrainerReadsAndScalesActivationsByBatch) {
  const auto dir = difftrain::test::temp_dir("memory_estimate");
  fs::create_directories(dir + "/pipe/unet");
  fs::copy_file(kDiffusersGolden + "unet2d/config.json", dir + "/pipe/unet/config.json");
  std::ofstream(dir + "/pipe/model_index.json") << "{\"_class_name\": \"DDPMPipeline\"}\n";
  MemoryEstimateOptions o;
  o.num_processes = 2;
  o.strategy = ShardingStrategy::kShardOptimizer;
  const auto from_folder =
      difftrain::families::unet::estimate_memory(kDiffusersGolden + "unet2d", o);
  const auto from_json =
      difftrain::families::unet::estimate_memory(kDiffusersGolden + "unet2d/config.json", o);
  const auto from_pipeline = difftrain::families::unet::estimate_memory(dir + "/pipe", o);
  expect_same_state(from_folder, from_json);
  expect_same_state(from_folder, from_pipeline);
  EXPECT_EQ(from_folder.trainable_params, trainable_numel(*tiny_unet("unet2d")));
  // Several strategies share one model and one activation measurement.
  o.batch_size = 3;
  const auto all = difftrain::families::unet::estimate_memory(
      kDiffusersGolden + "unet2d", o, {ShardingStrategy::kNoShard, ShardingStrategy::kFullShard});
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all[0].activation_bytes, all[1].activation_bytes);
  EXPECT_EQ(all[0].activation_bytes % 3, 0);
  EXPECT_EQ(all[1].strategy, ShardingStrategy::kFullShard);
  EXPECT_LT(all[1].param_bytes, all[0].param_bytes);

  using difftrain::test::error_of;
  EXPECT_NE(error_of([&] {
              difftrain::families::unet::estimate_memory(dir + "/missing", o);
            }).find("does not exist"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              difftrain::families::unet::estimate_memory(dir, o);
            }).find("has no config.json"),
            std::string::npos);
  o.num_processes = 0;
  EXPECT_NE(error_of([&] {
              difftrain::families::unet::estimate_memory(kDiffusersGolden + "unet2d", o);
            }).find("num_processes must be at least 1, got 0"),
            std::string::npos);
  o.num_processes = 2;
  o.auto_wrap.classes = {"NoSuchBlock"};
  EXPECT_NE(error_of([&] {
              difftrain::families::unet::estimate_memory(kDiffusersGolden + "unet2d", o);
            }).find("NoSuchBlock"),
            std::string::npos);
  fs::remove_all(dir);
}

TEST(MemoryEstimate, SdxlPipelineCountsBothEncodersAndTheVaeAsFrozen) {
  const std::string xl = std::string(difftrain_test::source_dir()) + "/tests/golden/sdxl/tiny_sdxl";
  // The loaded models' parameter counts.
  auto numel = [](const torch::nn::Module& m) {
    int64_t n = 0;
    for (const auto& p : m.parameters()) n += p.numel();
    return n;
  };
  const int64_t te1 = numel(*difftrain::models::load_clip_text_model(xl + "/text_encoder"));
  const int64_t te2 = numel(*difftrain::models::load_clip_text_model(xl + "/text_encoder_2"));
  const int64_t vae = numel(*difftrain::models::load_autoencoder_kl(xl + "/vae"));
  const int64_t unet = numel(*difftrain::models::load_unet(xl + "/unet"));
  const auto frozen = difftrain::families::unet::pipeline_frozen_params(xl);
  ASSERT_EQ(frozen.size(), 3u);
  EXPECT_EQ(frozen[0].second, te1);
  EXPECT_EQ(frozen[1].second, te2);
  EXPECT_EQ(frozen[2].second, vae);

  MemoryEstimateOptions o;
  o.lora = true;
  o.resolution = 8;
  const auto fp32 = difftrain::families::unet::estimate_memory(xl, o);
  EXPECT_EQ(fp32.frozen_params, unet + te1 + te2 + vae);
  EXPECT_EQ(fp32.frozen_param_bytes, 4 * (unet + te1 + te2 + vae));
  EXPECT_GT(fp32.activation_bytes, 0);
  o.mixed_precision = "bf16";
  const auto bf16 = difftrain::families::unet::estimate_memory(xl, o);
  EXPECT_EQ(bf16.frozen_param_bytes, 2 * (unet + te1 + te2 + vae));
  EXPECT_EQ(bf16.trainable_params, fp32.trainable_params);
  // Full fine-tuning: the UNet trains, the encoders and the VAE stay frozen.
  o.lora = false;
  o.mixed_precision = "no";
  const auto full = difftrain::families::unet::estimate_memory(xl, o);
  EXPECT_EQ(full.trainable_params, unet);
  EXPECT_EQ(full.frozen_params, te1 + te2 + vae);
}

TEST(MemoryEstimate, JsonAndTablesNameEveryQuantity) {
  UNet unet = tiny_unet();
  MemoryEstimateOptions o;
  o.num_processes = 2;
  o.strategy = ShardingStrategy::kFullShard;
  auto e = estimate_state_memory(*unet, o);
  e.activation_bytes = 3 << 20;
  const auto j = difftrain::train::to_json(e);
  for (const char* key : {"param_bytes", "param_peak_bytes", "grad_bytes", "grad_peak_bytes",
                          "optimizer_bytes", "frozen_param_bytes", "activation_bytes",
                          "trainable_params", "frozen_params", "total_peak_bytes"}) {
    EXPECT_TRUE(j.contains(key)) << key;
  }
  EXPECT_EQ(j.at("total_peak_bytes").get<int64_t>(), e.total_peak_bytes());
  EXPECT_EQ(j.at("strategy"), "FULL_SHARD");
  EXPECT_EQ(j.at("num_units").get<size_t>(), e.units.size());
  const auto table = difftrain::train::format_memory_table(e, 1);
  for (const char* row : {"parameter peak", "optimizer state", "activations (batch 1)",
                          "total peak", "3.0 MiB", "units: "}) {
    EXPECT_NE(table.find(row), std::string::npos) << row << "\n" << table;
  }
  EXPECT_EQ(difftrain::train::format_bytes(1536), "1.5 KiB");
  EXPECT_EQ(difftrain::train::format_bytes(int64_t{3} << 30), "3.00 GiB");
  const auto cmp = difftrain::train::format_strategy_comparison({e, e});
  EXPECT_NE(cmp.find("FULL_SHARD"), std::string::npos);
}

}  // namespace
