// EMA of weights: parity with Diffusers' EMAModel (fixture), the decay schedule, frozen
// parameters, copy_to/store/restore and an exact resume.

#include "difftrain/diffusion/ema.h"
#include "difftrain/core/error.h"
#include "difftrain/io/safetensors.h"

#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <fstream>

namespace {

using difftrain::test::max_abs;

using difftrain::diffusion::EMAModel;
using difftrain::diffusion::EMAOptions;

using difftrain::test::kDiffusersGolden;

// ema.json's EMAModel over one parameter whose value before each step is values[i]; the file
// holds the shadow after each step.
TEST(EMA, MatchesDiffusersEMAModel) {
  auto file = difftrain::io::load_safetensors(kDiffusersGolden + "ema.safetensors").tensors;
  std::ifstream in(kDiffusersGolden + "ema.json");
  auto cfg = nlohmann::json::parse(in);
  EMAOptions o;
  o.decay = cfg["decay"].get<double>();
  o.use_ema_warmup = cfg["use_ema_warmup"].get<bool>();
  o.inv_gamma = cfg["inv_gamma"].get<double>();
  o.power = cfg["power"].get<double>();
  const auto& values = file.at("values");
  const auto& expected = file.at("shadow");
  auto p = values[0].clone().requires_grad_(true);
  EMAModel ema({{"p", p}}, o);
  double worst = 0;
  for (int64_t i = 0; i < values.size(0); ++i) {
    {
      torch::NoGradGuard no_grad;
      p.copy_(values[i]);
    }
    ema.step({p});
    worst = std::max(worst, max_abs(ema.shadow()[0].second, expected[i]));
  }
  std::printf("EMAModel fixture: max |shadow - diffusers| over %lld steps = %.3g (tol 1e-6)\n",
              static_cast<long long>(values.size(0)), worst);
  EXPECT_LT(worst, 1e-6);
  EXPECT_EQ(ema.optimization_step(), values.size(0));
}

TEST(EMA, DecayScheduleIsDiffusers) {
  EMAOptions plain;
  plain.decay = 0.999;
  plain.update_after_step = 3;
  EMAModel a({{"w", torch::zeros({1})}}, plain);
  for (int64_t step = 1; step <= 4; ++step) EXPECT_EQ(a.get_decay(step), 0.0) << step;
  for (int64_t step = 5; step < 3000; step += 97) {
    const double s = static_cast<double>(step - 3 - 1);
    EXPECT_DOUBLE_EQ(a.get_decay(step), std::min((1 + s) / (10 + s), 0.999)) << step;
  }
  EMAOptions warm;
  warm.use_ema_warmup = true;
  warm.power = 0.75;
  warm.inv_gamma = 2.0;
  warm.min_decay = 0.1;
  EMAModel b({{"w", torch::zeros({1})}}, warm);
  EXPECT_DOUBLE_EQ(b.get_decay(2), std::max(0.1, 1 - std::pow(1 + 0.5, -0.75)));
  EXPECT_DOUBLE_EQ(b.get_decay(1000), 1 - std::pow(1 + 999 / 2.0, -0.75));
  EXPECT_THROW(EMAModel({{"w", torch::zeros({1})}}, EMAOptions{2.0}), difftrain::Error);
}

TEST(EMA, FrozenParametersAreCopiedAndCopyToStoreRestoreWork) {
  torch::nn::Linear model(3, 2);
  model->bias.requires_grad_(false);
  EMAModel ema(*model);
  {
    torch::NoGradGuard no_grad;
    model->weight.add_(1.0);
    model->bias.add_(1.0);
  }
  ema.step(*model);  // step 1: decay 0 copies everything
  ema.step(*model);  // step 2: decay (1+1)/(10+1)
  {
    torch::NoGradGuard no_grad;
    model->weight.add_(1.0);
    model->bias.add_(1.0);
  }
  auto before = ema.shadow()[0].second.clone();
  ema.step(*model);
  const double d = 3.0 / 12.0;  // step 3: (1+2)/(10+2)
  EXPECT_LT(max_abs(ema.shadow()[0].second, before - (1 - d) * (before - model->weight)), 1e-6);
  EXPECT_TRUE(torch::equal(ema.shadow()[1].second, model->bias));  // frozen: copied
  auto live = model->weight.detach().clone();
  ema.store(*model);
  ema.copy_to(*model);
  EXPECT_TRUE(torch::equal(model->weight, ema.shadow()[0].second));
  ema.restore(*model);
  EXPECT_TRUE(torch::equal(model->weight, live));
  EXPECT_THROW(ema.restore(*model), difftrain::Error);
}

TEST(EMA, StateResumesExactly) {
  torch::manual_seed(0);
  torch::nn::Linear model(4, 4);
  EMAOptions o;
  o.use_ema_warmup = true;
  EMAModel full(*model, o), first(*model, o);
  auto nudge = [&] {
    torch::NoGradGuard no_grad;
    for (auto& p : model->parameters()) p.add_(torch::randn_like(p) * 0.1);
  };
  for (int i = 0; i < 5; ++i) {
    nudge();
    full.step(*model);
    first.step(*model);
  }
  EMAModel resumed(*model);
  resumed.load_state(first.state_meta(), first.state_tensors(), "ema state");
  for (int i = 0; i < 5; ++i) {
    nudge();
    full.step(*model);
    resumed.step(*model);
  }
  EXPECT_EQ(resumed.optimization_step(), 10);
  for (size_t i = 0; i < full.shadow().size(); ++i) {
    EXPECT_TRUE(torch::equal(full.shadow()[i].second, resumed.shadow()[i].second));
  }
  auto tensors = first.state_tensors();
  tensors.erase("bias");
  try {
    resumed.load_state(first.state_meta(), tensors, "ema.safetensors");
    ADD_FAILURE() << "missing tensor accepted";
  } catch (const difftrain::Error& e) {
    EXPECT_NE(
        std::string(e.what()).find("ema.safetensors: EMA state has no tensor for parameter bias"),
        std::string::npos)
        << e.what();
  }
  EXPECT_EQ(resumed.optimization_step(), 10);  // a refused load changes nothing
}

}  // namespace
