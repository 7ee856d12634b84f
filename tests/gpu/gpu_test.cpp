// The `gpu` label: difftrain on a CUDA device. The UNets' forward on cuda against the CPU and the
// Diffusers fixtures; one training step under bf16 autocast and one under fp16 with the dynamic
// loss scaler (a real fp16 overflow skips the step); DDP with two ranks sharing one GPU over Gloo
// and a world-of-one NCCL group; `difftrain train` and `difftrain sample` on cuda; checkpoints
// moved between cuda and cpu. Each test skips only when this machine has no CUDA device at all
// (no GPU known to the NVIDIA driver and none seen by LibTorch), saying so; a GPU that LibTorch
// cannot use is a failure.

#include "../dist/train_util.h"
#include "../unit/test_util.h"
#include "../unit/thread_ranks.h"
#include "cuda_required.h"

#include "difftrain/accel/accelerator.h"
#include "difftrain/io/safetensors.h"
#include "difftrain/models/pretrained.h"
#include "difftrain/models/unets/unet.h"
#include "source_dir.h"

#include <ATen/Context.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <map>

namespace difftrain {
namespace {

namespace fs = std::filesystem;
using gpu_test::NoTf32;
using test::max_abs;
using testing::kDifftrain;
using testing::run;

const std::string kGolden = std::string(difftrain_test::source_dir()) + "/tests/golden/diffusers/";

// ---------------------------------------------------------------------------- forward

void check_forward_on_cuda(const std::string& name, bool text_conditioned) {
  models::UNet unet = models::load_unet(kGolden + name);
  unet->eval();
  auto io = io::load_safetensors(kGolden + name + "/io.safetensors").tensors;
  torch::NoGradGuard no_grad;
  NoTf32 strict;
  models::UNetConditioning cond, cond_cuda;
  if (text_conditioned) {
    cond.encoder_hidden_states = io.at("encoder_hidden_states");
    cond_cuda.encoder_hidden_states = cond.encoder_hidden_states.to(torch::kCUDA);
  } else {
    cond.class_labels = io.at("class_labels");
    cond_cuda.class_labels = cond.class_labels.to(torch::kCUDA);
  }
  const auto cpu = unet->forward(io.at("sample"), io.at("timestep"), cond);
  unet->to(torch::kCUDA);
  const auto cuda = unet->forward(io.at("sample").to(torch::kCUDA),
                                  io.at("timestep").to(torch::kCUDA), cond_cuda);
  ASSERT_TRUE(cuda.is_cuda());
  const double vs_cpu = max_abs(cuda.cpu(), cpu);
  const double vs_diffusers = max_abs(cuda.cpu(), io.at("out"));
  std::printf("%s on cuda: max |cuda - cpu| = %.3g, max |cuda - diffusers| = %.3g (tol 1e-4)\n",
              name.c_str(), vs_cpu, vs_diffusers);
  EXPECT_LT(vs_cpu, 1e-4);
  EXPECT_LT(vs_diffusers, 1e-4);
}

TEST(GpuUNet, UNet2DForwardOnCudaMatchesCpu) {
  REQUIRE_CUDA();
  check_forward_on_cuda("unet2d", false);
}

TEST(GpuUNet, UNet2DConditionForwardOnCudaMatchesCpu) {
  REQUIRE_CUDA();
  check_forward_on_cuda("unet_cond", true);
}

// ---------------------------------------------------------------------------- mixed precision

// One epsilon-prediction step of the fixture UNet2DModel through a single-rank Accelerator.
struct StepResult {
  double loss = 0;
  bool skipped = false;
  double scale_before = 0, scale_after = 0;
  torch::Tensor weight_before, weight_after;  // one conv weight, fp32, on the CPU
};

StepResult one_step(const std::string& mixed_precision, double loss_multiplier,
                    double init_scale = 65536.0) {
  StepResult r;
  distributed::on_ranks(1, [&](distributed::ProcessGroup& g) {
    accel::AcceleratorOptions o;
    o.mixed_precision = mixed_precision;
    o.gradient_accumulation_steps = 1;
    o.scaler.init_scale = init_scale;
    accel::Accelerator acc(o, g);
    ASSERT_TRUE(acc.device().is_cuda()) << acc.device();
    models::UNet unet = models::load_unet(kGolden + "unet2d");
    auto io = io::load_safetensors(kGolden + "unet2d/io.safetensors").tensors;
    auto opt = std::make_shared<torch::optim::SGD>(unet->parameters(), 1e-2);
    auto [m, optimizer] = acc.prepare(unet, opt);
    auto& weight = m->named_parameters()["conv_in.weight"];
    r.weight_before = weight.detach().cpu().clone();
    r.scale_before = acc.loss_scale();
    const auto device = acc.device();
    models::UNetConditioning cond;
    cond.class_labels = io.at("class_labels").to(device);
    torch::Tensor loss;
    {
      auto autocast = acc.autocast();
      auto out = m->forward(io.at("sample").to(device), io.at("timestep").to(device), cond);
      EXPECT_EQ(out.scalar_type(), mixed_precision == "bf16"   ? torch::kBFloat16
                                   : mixed_precision == "fp16" ? torch::kHalf
                                                               : torch::kFloat)
          << "autocast did not compute the UNet in " << mixed_precision;
      loss = (out.to(torch::kFloat) - io.at("sample").to(device)).pow(2).mean() * loss_multiplier;
    }
    acc.backward(loss);
    optimizer->step();
    optimizer->zero_grad();
    r.loss = loss.item<double>();
    r.skipped = acc.optimizer_step_was_skipped();
    r.scale_after = acc.loss_scale();
    r.weight_after = weight.detach().cpu().clone();
    EXPECT_EQ(weight.scalar_type(), torch::kFloat) << "master weights must stay fp32";
  });
  return r;
}

TEST(GpuPrecision, Bf16AutocastStepTracksTheFp32Step) {
  REQUIRE_CUDA();
  NoTf32 strict;
  const auto fp32 = one_step("no", 1.0);
  const auto bf16 = one_step("bf16", 1.0);
  const double loss_diff = std::abs(bf16.loss - fp32.loss) / std::max(1e-12, fp32.loss);
  const auto update32 = fp32.weight_after - fp32.weight_before;
  const auto update16 = bf16.weight_after - bf16.weight_before;
  const double update_diff =
      max_abs(update16, update32) / std::max(1e-12, update32.abs().max().item<double>());
  std::printf(
      "bf16 vs fp32 step on cuda: loss %.6f vs %.6f (rel %.3g, tol 2e-2); update rel "
      "diff %.3g (tol 1e-1)\n",
      bf16.loss, fp32.loss, loss_diff, update_diff);
  EXPECT_FALSE(bf16.skipped);
  EXPECT_LT(loss_diff, 2e-2);
  EXPECT_LT(update_diff, 1e-1);
  EXPECT_GT(update16.abs().max().item<double>(), 0.0) << "the bf16 step did not move the weights";
}

TEST(GpuPrecision, Fp16ScalerStepsThenSkipsARealOverflow) {
  REQUIRE_CUDA();
  // A normal step: fp16 compute, scaled loss, finite gradients, weights move, scale stays.
  const auto ok = one_step("fp16", 1.0);
  std::printf("fp16 step: loss %.6f, skipped %d, scale %g -> %g\n", ok.loss, ok.skipped,
              ok.scale_before, ok.scale_after);
  EXPECT_FALSE(ok.skipped);
  EXPECT_EQ(ok.scale_after, ok.scale_before);
  EXPECT_GT((ok.weight_after - ok.weight_before).abs().max().item<double>(), 0.0);
  // The scale times a large loss overflows fp16 (max 65504) in the backward pass: the gradients
  // hold infs, the step is skipped, the weights stay, and the scale backs off by half.
  const auto overflow = one_step("fp16", 1e4, 65536.0 * 65536.0);
  std::printf("fp16 overflow step: loss %.6g, skipped %d, scale %g -> %g\n", overflow.loss,
              overflow.skipped, overflow.scale_before, overflow.scale_after);
  EXPECT_TRUE(overflow.skipped);
  EXPECT_EQ(overflow.scale_after, overflow.scale_before * 0.5);
  EXPECT_EQ(max_abs(overflow.weight_after, overflow.weight_before), 0.0);
}

// ---------------------------------------------------------------------------- collectives

struct TinyNetImpl : torch::nn::Module {
  TinyNetImpl() {
    fc = register_module("fc", torch::nn::Linear(torch::nn::LinearOptions(3, 2).bias(false)));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc->forward(x); }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(TinyNet);

TEST(GpuDdp, TwoRanksShareOneGpuOverGloo) {
  REQUIRE_CUDA();
  // Reference: one SGD step on the mean of both ranks' gradients, in float64 on the CPU.
  auto x_of = [](int rank) {
    auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(70 + rank));
    return torch::randn({4, 3}, gen);
  };
  const auto w0 = torch::full({2, 3}, 0.25);
  auto mean_grad = torch::zeros({2, 3}, torch::kDouble);
  for (int r = 0; r < 2; ++r) {
    auto w = w0.to(torch::kDouble).requires_grad_();
    torch::mm(x_of(r).to(torch::kDouble), w.t()).pow(2).mean().backward();
    mean_grad += w.grad() / 2;
  }
  const auto want = w0.to(torch::kDouble) - 0.1 * mean_grad;
  std::vector<torch::Tensor> got(2);
  std::vector<std::string> devices(2), backends(2);
  distributed::on_ranks(2, [&](distributed::ProcessGroup& g) {
    accel::AcceleratorOptions o;
    o.mixed_precision = "no";
    o.gradient_accumulation_steps = 1;
    accel::Accelerator acc(o, g);
    TinyNet net;
    {
      torch::NoGradGuard no_grad;
      net->fc->weight.copy_(w0);
    }
    auto opt = std::make_shared<torch::optim::SGD>(net->parameters(), 0.1);
    auto [m, optimizer] = acc.prepare(net, opt);
    acc.backward(m->forward(x_of(g.rank()).to(acc.device())).pow(2).mean());
    optimizer->step();
    const auto r = static_cast<size_t>(g.rank());
    devices[r] = m->fc->weight.device().str();
    backends[r] = g.backend_name();
    got[r] = m->fc->weight.detach().cpu();
  });
  for (int r = 0; r < 2; ++r) {
    const auto i = static_cast<size_t>(r);
    ASSERT_TRUE(got[i].defined());
    const double diff = max_abs(got[i], want);
    std::printf("rank %d on %s over %s: max |w - float64 reference| = %.3g (tol 1e-6)\n", r,
                devices[i].c_str(), backends[i].c_str(), diff);
    EXPECT_EQ(devices[i].rfind("cuda", 0), 0u);
    EXPECT_EQ(backends[i], "gloo");
    EXPECT_LT(diff, 1e-6);
  }
}

#ifdef DIFFTRAIN_WITH_NCCL
TEST(GpuDdp, WorldOfOneNcclGroupRunsTheCollectives) {
  REQUIRE_CUDA();
  distributed::RendezvousInfo info;
  info.rank = 0;
  info.world_size = 1;
  info.local_rank = 0;
  info.local_world_size = 1;
  distributed::ProcessGroupOptions options;
  options.backend = "nccl";
  options.join_timeout = std::chrono::seconds(30);
  options.collective_timeout = std::chrono::seconds(30);
  distributed::ProcessGroup group(info, options, c10::make_intrusive<c10d::HashStore>());
  ASSERT_EQ(group.backend_name(), "nccl");
  auto t = torch::arange(6, torch::TensorOptions().dtype(torch::kFloat).device(torch::kCUDA));
  std::vector<torch::Tensor> tensors{t};
  group.wait(group.backend().allreduce(tensors), "allreduce");
  group.wait(group.backend().broadcast(tensors), "broadcast");
  auto gathered = torch::empty_like(t);
  group.wait(group.backend()._allgather_base(gathered, t), "all_gather");
  group.wait(group.backend().barrier(), "barrier");
  torch::cuda::synchronize();
  EXPECT_EQ(max_abs(t.cpu(), torch::arange(6, torch::kFloat)), 0.0);
  EXPECT_EQ(max_abs(gathered.cpu(), torch::arange(6, torch::kFloat)), 0.0);
}
#endif

// ---------------------------------------------------------------------------- checkpoints

// save_state on one device, load_state on the other: the weights and the AdamW state arrive
// exactly, on the loading Accelerator's device.
void check_checkpoint_move(bool save_on_cuda) {
  const auto dir = test::temp_dir(save_on_cuda ? "gpu_ckpt_c2c" : "gpu_ckpt_c2g");
  torch::Tensor saved;
  auto make = [](bool on_cpu, distributed::ProcessGroup& g) {
    accel::AcceleratorOptions o;
    o.mixed_precision = "no";
    o.gradient_accumulation_steps = 1;
    o.cpu = on_cpu;
    return std::make_unique<accel::Accelerator>(o, g);
  };
  distributed::on_ranks(1, [&](distributed::ProcessGroup& g) {
    auto acc = make(!save_on_cuda, g);
    torch::manual_seed(5);
    TinyNet net;
    auto opt = std::make_shared<torch::optim::SGD>(net->parameters(), 0.1);
    auto [m, optimizer] = acc->prepare(net, opt);
    acc->backward(m->forward(torch::randn({4, 3}).to(acc->device())).pow(2).mean());
    optimizer->step();
    saved = m->fc->weight.detach().cpu().clone();
    acc->save_state(dir + "/state");
  });
  distributed::on_ranks(1, [&](distributed::ProcessGroup& g) {
    auto acc = make(save_on_cuda, g);
    torch::manual_seed(6);
    TinyNet net;
    auto opt = std::make_shared<torch::optim::SGD>(net->parameters(), 0.1);
    auto [m, optimizer] = acc->prepare(net, opt);
    ASSERT_GT(max_abs(m->fc->weight.detach().cpu(), saved), 0.0);
    acc->load_state(dir + "/state");
    EXPECT_EQ(m->fc->weight.device().type(), save_on_cuda ? torch::kCPU : torch::kCUDA);
    const double diff = max_abs(m->fc->weight.detach().cpu(), saved);
    std::printf("checkpoint %s: max |loaded - saved| = %.3g (must be 0)\n",
                save_on_cuda ? "cuda -> cpu" : "cpu -> cuda", diff);
    EXPECT_EQ(diff, 0.0);
  });
}

TEST(GpuCheckpoint, SavedOnCudaResumesOnCpu) {
  REQUIRE_CUDA();
  check_checkpoint_move(true);
}

TEST(GpuCheckpoint, SavedOnCpuResumesOnCuda) {
  REQUIRE_CUDA();
  check_checkpoint_move(false);
}

// ---------------------------------------------------------------------------- the CLI

// `difftrain train` on the built-in default (Fashion-MNIST, the default class-conditional UNet)
// for a few steps on cuda, then `difftrain sample --device cuda` of its pipeline folder.
TEST(GpuCli, TrainTheDefaultThenSampleOnCuda) {
  REQUIRE_CUDA();
  const auto dir = testing::make_temp_dir("gpu_cli");
  std::vector<std::string> argv = {kDifftrain,
                                   "train",
                                   "--max_train_steps",
                                   "5",
                                   "--checkpointing_steps",
                                   "0",
                                   "--num_validation_images",
                                   "0",
                                   "--logging_steps",
                                   "1",
                                   "--output_dir",
                                   dir + "/run"};
  // scripts/gpu_build unpacks Debian's Fashion-MNIST where a GPU machine has no package.
  if (const char* data = std::getenv("DIFFTRAIN_FASHION_MNIST_DIR"); data && *data) {
    argv.insert(argv.end(), {"--train_data_dir", data});
  }
  const auto t = run(argv, {}, 600);
  ASSERT_EQ(t.exit_code, 0) << t.log();
  EXPECT_NE((t.out + t.err).find("processes 1 on cuda:0"), std::string::npos)
      << "the trainer did not say it ran on cuda\n"
      << t.log();
  const auto s =
      run({kDifftrain, "sample", "--model", dir + "/run", "--device", "cuda",
           "--num_inference_steps", "5", "--num_images", "2", "--output", dir + "/grid.png"},
          {}, 300);
  ASSERT_EQ(s.exit_code, 0) << s.log();
  EXPECT_NE(s.err.find("on cuda:0"), std::string::npos) << s.log();
  EXPECT_TRUE(fs::exists(dir + "/grid.png"));
}

// Two ranks sharing one GPU under `difftrain launch` (the automatic backend picks Gloo when the
// ranks outnumber the GPUs) train the same weights as one rank with the global batch.
TEST(GpuCli, TwoRanksOnOneGpuEqualOneRank) {
  REQUIRE_CUDA();
  const auto dir = testing::make_temp_dir("gpu_ws");
  const std::vector<std::string> common = {"--max_train_steps",     "4", "--use_ema", "false",
                                           "--checkpointing_steps", "0"};
  // CUDA_VISIBLE_DEVICES=0: exactly one GPU, shared by both ranks, on a machine with any number.
  const std::map<std::string, std::string> one_gpu = {{"CUDA_VISIBLE_DEVICES", "0"}};
  std::vector<std::string> one = {kDifftrain};
  const auto one_cmd = testing::train_cmd(dir, dir + "/one", common);
  one.insert(one.end(), one_cmd.begin(), one_cmd.end());
  one.insert(one.end(), {"--train_batch_size", "8"});
  std::vector<std::string> two = {kDifftrain, "launch", "--num_processes", "2", kDifftrain};
  const auto two_cmd = testing::train_cmd(dir, dir + "/two", common);
  two.insert(two.end(), two_cmd.begin(), two_cmd.end());
  two.insert(two.end(), {"--train_batch_size", "4"});
  const auto r1 = run(one, one_gpu, 300);
  ASSERT_EQ(r1.exit_code, 0) << r1.log();
  const auto r2 = run(two, one_gpu, 300);
  ASSERT_EQ(r2.exit_code, 0) << r2.log();
  EXPECT_NE(r2.err.find("local ranks share 1 GPU(s)"), std::string::npos)
      << "the automatic backend did not fall back to gloo\n"
      << r2.log();
  const double ws = testing::max_abs_diff(testing::unet_weights(dir + "/one"),
                                          testing::unet_weights(dir + "/two"));
  std::printf("cuda: 2 ranks x 4 (one GPU, gloo) vs 1 rank x 8: max abs diff %.3g (tol 1e-3)\n",
              ws);
  EXPECT_LT(ws, 1e-3);
}

}  // namespace
}  // namespace difftrain
