// Fused AdamW: parity with torch.optim.AdamW (fixture), with LibTorch's AdamW, the flat layout,
// and exact save / load / continue.

#include "difftrain/optim/adamw.h"
#include "difftrain/core/error.h"
#include "difftrain/io/atomic_file.h"
#include "difftrain/io/safetensors.h"

#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>

namespace {

using difftrain::test::max_abs;
using difftrain::test::temp_dir;

namespace fs = std::filesystem;
using difftrain::optim::AdamW;
using torch::optim::AdamWOptions;

using difftrain::test::kGoldenDir;

// torch.optim.AdamW over p0 with six recorded gradients (the reference run's README).
void run_fixture(bool reference_path) {
  auto file = difftrain::io::load_safetensors(kGoldenDir + "adamw.safetensors").tensors;
  std::ifstream in(kGoldenDir + "adamw.json");
  auto cfg = nlohmann::json::parse(in);
  auto p = file.at("p0").clone().requires_grad_(true);
  AdamW opt({p}, AdamWOptions(cfg["lr"].get<double>())
                     .betas({cfg["betas"][0].get<double>(), cfg["betas"][1].get<double>()})
                     .eps(cfg["eps"].get<double>())
                     .weight_decay(cfg["weight_decay"].get<double>()));
  opt.set_use_reference_path(reference_path);
  const auto& grads = file.at("grads");
  const auto& expected = file.at("params");
  double worst = 0;
  for (int64_t s = 0; s < grads.size(0); ++s) {
    p.mutable_grad().copy_(grads[s]);
    opt.step();
    worst = std::max(worst, max_abs(p.detach(), expected[s]));
  }
  const double m_diff = max_abs(opt.exp_avg(0, 0), file.at("exp_avg"));
  const double v_diff = max_abs(opt.exp_avg_sq(0, 0), file.at("exp_avg_sq"));
  std::printf(
      "fixture (%s path): max |param diff| %.3g, exp_avg %.3g, exp_avg_sq %.3g (tol 1e-6)\n",
      reference_path ? "reference" : "fused", worst, m_diff, v_diff);
  EXPECT_LT(worst, 1e-6);
  EXPECT_LT(m_diff, 1e-6);
  EXPECT_LT(v_diff, 1e-6);
  EXPECT_EQ(opt.step_count(0, 0), grads.size(0));
}

TEST(AdamW, MatchesTorchFixture) { run_fixture(false); }
TEST(AdamW, ReferencePathMatchesTorchFixture) { run_fixture(true); }

// Parameters of assorted sizes (some larger than a thread task) in two groups with their own
// lr and weight decay; gradients random each step.
struct Problem {
  std::vector<torch::Tensor> a, b;
  explicit Problem(torch::Dtype dtype, uint64_t seed) {
    auto gen = at::detail::createCPUGenerator(seed);
    for (int64_t n : {7, 1000, 70000, 3})
      a.push_back(at::randn({n}, gen, torch::kFloat64).to(dtype).requires_grad_(true));
    for (int64_t n : {33, 65537})
      b.push_back(at::randn({n}, gen, torch::kFloat64)
                      .to(dtype)
                      .view({-1, 1})
                      .contiguous()
                      .requires_grad_(true));
  }
  std::vector<torch::optim::OptimizerParamGroup> groups(bool amsgrad) {
    std::vector<torch::optim::OptimizerParamGroup> g;
    g.emplace_back(
        a, std::make_unique<AdamWOptions>(AdamWOptions(2e-3).weight_decay(0.1).amsgrad(amsgrad)));
    g.emplace_back(b,
                   std::make_unique<AdamWOptions>(
                       AdamWOptions(5e-4).weight_decay(0.0).betas({0.8, 0.99}).amsgrad(amsgrad)));
    return g;
  }
  std::vector<torch::Tensor> all() const {
    auto out = a;
    out.insert(out.end(), b.begin(), b.end());
    return out;
  }
};

void set_grads(std::vector<torch::Tensor> params, uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  for (auto& p : params) {
    auto g = at::randn(p.sizes(), gen, torch::kFloat64).to(p.scalar_type());
    if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
    p.mutable_grad().copy_(g);
  }
}

void compare_with_libtorch(torch::Dtype dtype, bool amsgrad, double tol) {
  Problem ours(dtype, 1), theirs(dtype, 1);
  AdamW fused(ours.groups(amsgrad));
  torch::optim::AdamW ref(theirs.groups(amsgrad));
  double worst = 0;
  for (int step = 0; step < 25; ++step) {
    set_grads(ours.all(), 100 + step);
    set_grads(theirs.all(), 100 + step);
    fused.step();
    ref.step();
    for (size_t i = 0; i < ours.all().size(); ++i)
      worst = std::max(worst, max_abs(ours.all()[i], theirs.all()[i]));
  }
  std::printf("fused vs torch::optim::AdamW (%s, amsgrad %d): max |diff| %.3g (tol %.1g)\n",
              c10::toString(dtype), amsgrad, worst, tol);
  EXPECT_LT(worst, tol);
  EXPECT_GT(max_abs(ours.all()[2], Problem(dtype, 1).all()[2]), 1e-3);  // it did move
}

TEST(AdamW, MatchesLibTorchAdamWFloat32) {
  at::set_num_threads(2);
  compare_with_libtorch(torch::kFloat32, false, 2e-6);
  compare_with_libtorch(torch::kFloat32, true, 2e-6);
  at::set_num_threads(1);
}

TEST(AdamW, MatchesLibTorchAdamWFloat64) {
  compare_with_libtorch(torch::kFloat64, false, 1e-12);
  compare_with_libtorch(torch::kFloat64, true, 1e-12);
}

TEST(AdamW, ParametersAndGradientsAreViewsOfFlatBuffers) {
  torch::nn::Sequential net(torch::nn::Linear(4, 8), torch::nn::Linear(8, 2));
  AdamW opt(net->parameters());
  ASSERT_EQ(opt.buckets().size(), 1u);
  const auto& bucket = opt.buckets()[0];
  EXPECT_EQ(bucket.numel(), 4 * 8 + 8 + 8 * 2 + 2);
  auto params = net->parameters();
  for (size_t j = 0; j < params.size(); ++j) {
    EXPECT_EQ(params[j].data_ptr(),
              static_cast<float*>(bucket.params.data_ptr()) + bucket.offsets[j]);
    EXPECT_EQ(params[j].grad().data_ptr(),
              static_cast<float*>(bucket.grads.data_ptr()) + bucket.offsets[j]);
  }
  // Training through the module updates the flat buffer itself.
  auto before = bucket.params.clone();
  auto loss = net->forward(torch::ones({3, 4})).sum();
  loss.backward();
  opt.step();
  EXPECT_GT(max_abs(before, bucket.params), 0.0);
  EXPECT_EQ(params[0].data_ptr(), static_cast<float*>(bucket.params.data_ptr()));
}

TEST(AdamW, SkipsParametersWithoutGradient) {
  auto a = torch::ones({5}, torch::requires_grad());
  auto b = torch::ones({5}, torch::requires_grad());
  AdamW opt({a, b});
  b.mutable_grad() = torch::Tensor();  // as set_to_none
  a.mutable_grad().fill_(1.0);
  opt.step();
  EXPECT_EQ(opt.step_count(0, 0), 1);
  EXPECT_EQ(opt.step_count(0, 1), 0);
  EXPECT_TRUE(torch::equal(b.detach(), torch::ones({5})));
  EXPECT_FALSE(torch::equal(a.detach(), torch::ones({5})));
}

TEST(AdamW, RepointsReplacedParameterStorage) {
  auto a = torch::zeros({4}, torch::requires_grad());
  AdamW opt({a});
  {
    torch::NoGradGuard no_grad;
    a.set_data(torch::full({4}, 3.0f));  // e.g. a model reload that swapped storage
  }
  a.mutable_grad() = torch::zeros({4});
  opt.step();
  EXPECT_EQ(a.data_ptr(), opt.buckets()[0].params.data_ptr());
  EXPECT_NEAR(a[0].item<float>(), 3.0f * (1 - 1e-3 * 1e-2), 1e-6);
}

TEST(AdamW, SaveLoadContinueEqualsUninterrupted) {
  const std::string dir = temp_dir("adamw_resume");
  Problem full(torch::kFloat32, 3), first(torch::kFloat32, 3);
  AdamW run(full.groups(true));
  AdamW part(first.groups(true));
  for (int s = 0; s < 10; ++s) {
    set_grads(full.all(), 500 + s);
    run.step();
    if (s < 4) {
      set_grads(first.all(), 500 + s);
      part.step();
    }
  }
  difftrain::optim::save_optimizer_state(part.state_dict(), dir + "/optimizer");
  // A fresh process would rebuild model and optimizer, then load both.
  Problem resumed(torch::kFloat32, 99);
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < resumed.all().size(); ++i) resumed.all()[i].copy_(first.all()[i]);
  }
  auto groups = resumed.groups(false);  // hyperparameters come from the state
  AdamW again(std::move(groups));
  again.load_state_dict(difftrain::optim::load_optimizer_state(dir + "/optimizer"));
  EXPECT_TRUE(again.param_groups()[0].options().get_lr() == 2e-3);
  for (int s = 4; s < 10; ++s) {
    set_grads(resumed.all(), 500 + s);
    again.step();
  }
  for (size_t i = 0; i < full.all().size(); ++i) {
    EXPECT_TRUE(torch::equal(full.all()[i], resumed.all()[i])) << "parameter " << i;
  }
  fs::remove_all(dir);
}

TEST(AdamW, RefusesStateOfAnotherShape) {
  auto a = torch::zeros({4}, torch::requires_grad());
  AdamW opt({a});
  opt.set_parameter_names({"unet.conv_in.weight"});
  a.mutable_grad().fill_(1);
  opt.step();
  auto state = opt.state_dict();
  auto b = torch::zeros({5}, torch::requires_grad());
  AdamW other({b});
  other.set_parameter_names({"unet.conv_in.weight"});
  try {
    other.load_state_dict(state);
    FAIL() << "a state for another shape was accepted";
  } catch (const difftrain::Error& e) {
    EXPECT_NE(std::string(e.what()).find("unet.conv_in.weight.exp_avg"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("[4]"), std::string::npos) << e.what();
  }
  EXPECT_EQ(other.step_count(0, 0), 0);  // unchanged by the refused load
  AdamW renamed({torch::zeros({4}, torch::requires_grad())});
  renamed.set_parameter_names({"unet.conv_out.weight"});
  EXPECT_THROW(renamed.load_state_dict(state), difftrain::Error);
}

TEST(AdamW, RejectsBadConstruction) {
  auto a = torch::zeros({4}, torch::requires_grad());
  EXPECT_THROW(AdamW({a, a}), difftrain::Error);
  EXPECT_THROW(AdamW({a}, AdamWOptions(1e-3).betas({1.0, 0.999})), difftrain::Error);
  AdamW opt({torch::zeros({2}, torch::requires_grad())});
  opt.add_param_group(
      torch::optim::OptimizerParamGroup({torch::zeros({2}, torch::requires_grad())}));
  EXPECT_THROW(opt.step(), difftrain::Error);
}

TEST(Safetensors, RoundTripsDtypesShapesAndMetadata) {
  const std::string dir = temp_dir("safetensors");
  difftrain::io::TensorMap tensors{{"a", torch::arange(6, torch::kFloat32).view({2, 3})},
                                   {"b.bf16", torch::randn({3}).to(torch::kBFloat16)},
                                   {"c", torch::tensor({1, 2, 3}, torch::kInt64)},
                                   {"empty", torch::zeros({0, 4})},
                                   {"u8", torch::tensor({7, 255}, torch::kUInt8)},
                                   {"scalar", torch::tensor(2.5, torch::kFloat64)}};
  difftrain::io::save_safetensors(dir + "/x.safetensors", tensors, {{"format", "pt"}});
  auto back = difftrain::io::load_safetensors(dir + "/x.safetensors");
  EXPECT_EQ(back.metadata.at("format"), "pt");
  ASSERT_EQ(back.tensors.size(), tensors.size());
  for (const auto& [k, v] : tensors) {
    EXPECT_TRUE(torch::equal(back.tensors.at(k), v)) << k;
    EXPECT_EQ(back.tensors.at(k).scalar_type(), v.scalar_type()) << k;
  }
  fs::remove_all(dir);
}

TEST(Safetensors, TheHeaderAloneGivesNamesDtypesShapesAndTheSameChecks) {
  const std::string dir = temp_dir("safetensors_header");
  difftrain::io::save_safetensors(dir + "/x.safetensors",
                                  {{"unet.conv.weight", torch::zeros({4, 2, 3, 3})},
                                   {"unet.conv.bias", torch::zeros({4}, torch::kBFloat16)}},
                                  {{"format", "pt"}});
  const auto header = difftrain::io::read_safetensors_header(dir + "/x.safetensors");
  EXPECT_EQ(header.metadata.at("format"), "pt");
  ASSERT_EQ(header.tensors.size(), 2u);
  EXPECT_EQ(header.tensors.at("unet.conv.weight").shape, (std::vector<int64_t>{4, 2, 3, 3}));
  EXPECT_EQ(header.tensors.at("unet.conv.weight").dtype, torch::kFloat32);
  EXPECT_EQ(header.tensors.at("unet.conv.bias").dtype, torch::kBFloat16);
  // A truncated file is refused as load_safetensors refuses it.
  const std::string bytes = difftrain::io::read_file(dir + "/x.safetensors");
  difftrain::io::write_file_atomic(dir + "/cut.safetensors", bytes.substr(0, bytes.size() - 8));
  const std::string message = difftrain::test::error_of(
      [&] { difftrain::io::read_safetensors_header(dir + "/cut.safetensors"); });
  EXPECT_NE(message.find("cut.safetensors"), std::string::npos) << message;
  EXPECT_NE(message.find("past the"), std::string::npos) << message;
  fs::remove_all(dir);
}

TEST(Safetensors, RejectsCorruptFilesWithOneLineErrors) {
  std::string good = difftrain::io::serialize_safetensors({{"w", torch::ones({4})}});
  auto expect_error = [](const std::string& bytes, const std::string& needle) {
    try {
      difftrain::io::parse_safetensors(bytes, "bad.safetensors");
      ADD_FAILURE() << "accepted: " << needle;
    } catch (const difftrain::Error& e) {
      std::string msg = e.what();
      EXPECT_NE(msg.find("bad.safetensors"), std::string::npos) << msg;
      EXPECT_NE(msg.find(needle), std::string::npos) << msg;
      EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    }
  };
  expect_error(good.substr(0, 5), "shorter than");
  // A Git LFS pointer in place of the weights (a clone without git-lfs), as git-lfs writes it.
  expect_error(
      "version https://git-lfs.github.com/spec/v1\n"
      "oid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\n"
      "size 3438167534\n",
      "is a Git LFS pointer (135 bytes), not the weights: run `git lfs install && git "
      "lfs pull`");
  expect_error(good.substr(0, good.size() - 4), "past the");  // truncated data
  std::string huge = good;
  huge[7] = 0x7f;
  expect_error(huge, "header length");
  auto with_header = [](const std::string& json, size_t data) {
    std::string out(8, '\0');
    for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((json.size() >> (8 * i)) & 0xff);
    return out + json + std::string(data, '\0');
  };
  expect_error(with_header("{not json", 0), "not valid JSON");
  expect_error(with_header(R"({"w":{"dtype":"F99","shape":[1],"data_offsets":[0,4]}})", 4),
               "unsupported dtype");
  expect_error(with_header(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", 4),
               "needing 8 bytes");
  expect_error(
      with_header(
          R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[2,6]}})",
          6),
      "overlaps");
  expect_error(with_header(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 8),
               "no tensor covers");
  expect_error(with_header(R"({"w":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", 4),
               "non-negative");
  expect_error(
      with_header(R"({"w":{"dtype":"F32","shape":[4611686018427387904,8],"data_offsets":[0,4]}})",
                  4),
      "overflows");
  EXPECT_THROW(difftrain::io::load_safetensors("/nonexistent/x.safetensors"), difftrain::Error);
}

}  // namespace
