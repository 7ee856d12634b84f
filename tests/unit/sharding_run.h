#pragma once
// The sharded-training harness of sharding_test.cpp and offload_test.cpp: one small UNet (or its
// LoRA adapters) trained for a few updates by ranks as threads on real Gloo groups, under any
// strategy, optimizer and offload setting, from the same start and the same global batches.

#include "test_util.h"
#include "thread_ranks.h"

#include "difftrain/accel/accelerator.h"
#include "difftrain/models/lora/lora_training.h"
#include "difftrain/models/unets/unet.h"
#include "difftrain/optim/adamw.h"
#include "difftrain/optim/adamw8bit.h"
#include "difftrain/optim/prodigy.h"

#include <torch/torch.h>

#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace difftrain::test::sharding_run {

using difftrain::accel::Accelerator;
using difftrain::accel::AcceleratorOptions;
using difftrain::accel::ShardingOptions;
using difftrain::accel::ShardingStats;
using difftrain::accel::ShardingStrategy;
using difftrain::accel::StateMemory;
using difftrain::distributed::ProcessGroup;
using difftrain::models::UNet;
using difftrain::models::UNetConfig;

using difftrain::test::kDiffusersGolden;
inline constexpr int64_t kPerRank = 2;
inline constexpr int kSteps = 3;

struct RunSpec {
  std::string model = "unet2d_uncond";
  ShardingStrategy strategy = ShardingStrategy::kNoShard;
  int world = 2;
  int64_t per_rank = kPerRank;  // batch rows per rank and micro-step
  int64_t accumulation = 1;
  bool sync_each_batch = false;
  bool checkpointing = false;
  bool use_8bit = false;
  bool lora = false;
  std::string precision = "no";
  uint64_t data_seed = 7;
  std::string wrap = "TRANSFORMER_BASED_WRAP";
  bool prodigy = false;  // optim::Prodigy instead of AdamW (use_8bit: AdamW8bit)
  bool offload = false;  // ZeRO-Offload of the optimizer side
  bool offload_params = false;
  int steps = kSteps;
  // Checkpoints: save_state() into save_dir after update save_after; with resume_dir, load it
  // first and run updates save_after..steps-1.
  std::string save_dir, resume_dir;
  int save_after = 1;
};

struct RunResult {
  std::map<std::string, torch::Tensor> params;  // rank 0's final trainable parameters
  std::map<std::string, torch::Tensor> start;   // and their starting values
  StateMemory memory;
  ShardingStats stats;
  std::vector<double> norms;
  std::vector<double> losses;  // rank 0's, every micro-step
};

// The starting weights every run uses (rank 0's are broadcast; the reference copies them).
inline std::map<std::string, torch::Tensor> initial_state(const std::string& model) {
  static std::mutex mutex;
  static std::map<std::string, std::map<std::string, torch::Tensor>> cache;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(model);
  if (it != cache.end()) return it->second;
  torch::manual_seed(1234);
  UNet unet(UNetConfig::load(kDiffusersGolden + model + "/config.json"));
  std::map<std::string, torch::Tensor> out;
  for (const auto& p : unet->named_parameters()) out[p.key()] = p.value().detach().clone();
  // Diffusers zero-initialises nothing here; perturb so LoRA's B=0 start still moves things.
  return cache[model] = out;
}

// Global micro-batch `step` of the data: rows [rank * per_rank, (rank + 1) * per_rank).
struct Batch {
  torch::Tensor x, t, target, context;
};
inline Batch batch_for(const UNetConfig& c, int64_t global, int64_t step, uint64_t seed,
                       int64_t begin, int64_t count) {
  auto gen = at::detail::createCPUGenerator(seed * 1000 + static_cast<uint64_t>(step));
  const int64_t ch = c.in_channels;
  Batch b;
  b.x = at::randn({global, ch, 8, 8}, gen, torch::kFloat).narrow(0, begin, count);
  b.t = at::randint(0, 1000, {global}, gen, torch::kLong).narrow(0, begin, count);
  b.target = at::randn({global, c.out_channels, 8, 8}, gen, torch::kFloat).narrow(0, begin, count);
  if (c.kind == difftrain::models::UNetKind::kUNet2DCondition) {
    b.context = at::randn({global, 3, c.cross_attention_dim[0]}, gen, torch::kFloat)
                    .narrow(0, begin, count);
  }
  return b;
}

inline RunResult train(const RunSpec& spec) {
  RunResult result;
  std::mutex result_mutex;
  const auto init = initial_state(spec.model);
  difftrain::distributed::on_ranks(spec.world, [&](ProcessGroup& group) {
    UNet unet(UNetConfig::load(kDiffusersGolden + spec.model + "/config.json"));
    {
      torch::NoGradGuard no_grad;
      for (auto& p : unet->named_parameters()) p.value().copy_(init.at(p.key()));
    }
    unet->set_gradient_checkpointing(spec.checkpointing);
    unet->train();
    std::shared_ptr<torch::nn::Module> trainable = unet.ptr();
    difftrain::models::LoraLayers lora{nullptr};
    if (spec.lora) {
      for (auto& p : unet->parameters()) p.requires_grad_(false);
      difftrain::models::LoraConfig lc;
      lc.rank = 4;
      lc.target_modules = {"to_q", "to_k", "to_v", "to_out.0", "conv1", "conv2"};
      lora = difftrain::models::LoraLayers(*unet, lc);
      // The same adapters in every run (ranks are threads: the global generator is shared), with
      // B != 0 so the adapters matter from the first step.
      auto gen = at::detail::createCPUGenerator(99);
      torch::NoGradGuard no_grad;
      for (auto& p : lora->parameters()) p.copy_(at::randn(p.sizes(), gen, torch::kFloat) * 0.02);
      trainable = lora.ptr();
    }
    AcceleratorOptions ao;
    ao.gradient_accumulation_steps = spec.accumulation;
    ao.mixed_precision = spec.precision;
    ShardingOptions so;
    so.strategy = spec.strategy;
    so.sync_each_batch = spec.sync_each_batch;
    so.auto_wrap.policy = spec.wrap;
    so.offload_optimizer = spec.offload;
    so.offload_params = spec.offload_params;
    ao.sharding = so;
    Accelerator acc(ao, group);
    std::vector<torch::Tensor> params;
    for (auto& p : trainable->parameters())
      if (p.requires_grad()) params.push_back(p);
    auto adam = torch::optim::AdamWOptions(1e-3).weight_decay(0.01);
    std::shared_ptr<difftrain::optim::FlatOptimizer> opt;
    if (spec.prodigy) {
      opt = std::make_shared<difftrain::optim::Prodigy>(params, adam.lr(1.0));
    } else if (spec.use_8bit) {
      opt = std::make_shared<difftrain::optim::AdamW8bit>(params, adam, 64);
    } else {
      opt = std::make_shared<difftrain::optim::AdamW>(params, adam);
    }
    // Rank 0's starting values: prepare() gives them to every rank.
    std::map<std::string, torch::Tensor> start;
    for (const auto& p : trainable->named_parameters())
      if (p.value().requires_grad()) start[p.key()] = p.value().detach().clone();
    acc.prepare_module(*trainable);
    auto prepared = acc.prepare_optimizer(opt);
    const auto& c = unet->config();
    const int64_t global = spec.per_rank * spec.world;
    std::vector<double> norms, losses;
    int64_t first = 0;
    if (!spec.resume_dir.empty()) {
      acc.load_state(spec.resume_dir);
      first = spec.save_after;
    }
    for (int64_t step = first; step < spec.steps; ++step) {
      for (int64_t micro = 0; micro < spec.accumulation; ++micro) {
        auto guard = acc.accumulate();
        auto b = batch_for(c, global, step * spec.accumulation + micro, spec.data_seed,
                           group.rank() * spec.per_rank, spec.per_rank);
        // On the Accelerator's device (a GPU in the gpu label's runs; a no-op on the CPU).
        for (auto* t : {&b.x, &b.t, &b.target, &b.context}) {
          if (t->defined()) *t = t->to(acc.device());
        }
        difftrain::models::UNetConditioning cond;
        cond.encoder_hidden_states = b.context;
        torch::Tensor out;
        {
          auto autocast = acc.autocast();
          out = unet->forward(b.x, b.t, cond);
        }
        auto loss = torch::mse_loss(out.to(torch::kFloat), b.target);
        losses.push_back(loss.item<double>());
        acc.backward(loss);
        if (acc.sync_gradients()) norms.push_back(acc.clip_grad_norm_(params, 0.5));
        prepared->step();
        prepared->zero_grad();
      }
      if (!spec.save_dir.empty() && step + 1 == spec.save_after) acc.save_state(spec.save_dir);
    }
    const auto memory = acc.memory();  // before the gather below
    std::map<std::string, torch::Tensor> final_params;
    {
      auto full = acc.summon_full_params();
      for (const auto& p : trainable->named_parameters())
        if (p.value().requires_grad()) final_params[p.key()] = p.value().detach().clone();
    }
    if (group.rank() == 0) {
      std::lock_guard<std::mutex> lock(result_mutex);
      result.params = final_params;
      result.start = start;
      result.memory = memory;
      if (!acc.sharded_models().empty()) result.stats = acc.sharded_models()[0]->stats();
      result.norms = norms;
      result.losses = losses;
    }
  });
  return result;
}

// How far apart two runs ended, relative to how far training moved: ||a - b|| / ||b - start||
// over every trainable parameter (float64 sums).
inline double max_diff(const RunResult& a, const RunResult& b) {
  EXPECT_EQ(a.params.size(), b.params.size());
  double diff = 0, moved = 0;
  for (const auto& [name, t] : a.params) {
    auto it = b.params.find(name);
    if (it == b.params.end()) {
      ADD_FAILURE() << "missing " << name;
      continue;
    }
    diff += (t.to(torch::kDouble) - it->second.to(torch::kDouble)).pow(2).sum().item<double>();
    moved += (it->second.to(torch::kDouble) - b.start.at(name).to(torch::kDouble))
                 .pow(2)
                 .sum()
                 .item<double>();
  }
  return std::sqrt(diff / moved);
}

}  // namespace difftrain::test::sharding_run
