// Accelerator::save_state / load_state with difftrain's optimizers on two ranks: a run saved
// midway and resumed in fresh objects ends bit-identical to an uninterrupted run.

#include "difftrain/accel/accelerator.h"
#include "difftrain/accel/checkpoint_manifest.h"
#include "difftrain/accel/grad_sync.h"
#include "difftrain/core/error.h"
#include "difftrain/optim/adamw.h"
#include "difftrain/optim/adamw8bit.h"
#include "difftrain/optim/lr_schedule.h"
#include "thread_ranks.h"

#include <torch/torch.h>

#include <gtest/gtest.h>

#include <unistd.h>
#include <filesystem>
#include <fstream>

namespace difftrain::accel {
namespace {
namespace fs = std::filesystem;

struct NetImpl : torch::nn::Module {
  NetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(3, 80));
    fc2 = register_module("fc2", torch::nn::Linear(80, 60));  // 4800 weights: 8-bit state
    fc3 = register_module("fc3", torch::nn::Linear(60, 2));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return fc3->forward(torch::tanh(fc2->forward(torch::tanh(fc1->forward(x)))));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};
TORCH_MODULE(Net);

std::shared_ptr<data::DataLoader> make_loader() {
  auto gen = at::detail::createCPUGenerator(3);
  auto ds = std::make_shared<data::TensorDataset>(
      data::Example{{"x", torch::randn({96, 3}, gen)}, {"y", torch::randn({96, 2}, gen)}});
  data::DataLoaderOptions o;
  o.batch_size = 4;
  return std::make_shared<data::DataLoader>(ds, o);
}

Net make_net(uint64_t seed) {
  Net net;
  auto gen = at::detail::createCPUGenerator(seed);
  torch::NoGradGuard no_grad;
  for (auto& p : net->parameters()) p.copy_(torch::randn(p.sizes(), gen) * 0.3);
  return net;
}

// Trains `steps` batches (stopping early to save at `save_at`), returns the final parameters.
template <typename Opt>
std::vector<torch::Tensor> run(distributed::ProcessGroup& g, const std::string& dir, int save_at,
                               bool resume) {
  AcceleratorOptions options;
  options.mixed_precision = "no";
  options.gradient_accumulation_steps = 2;
  Accelerator acc(options, g);
  Net net = make_net(resume ? 77 : 7);  // a resumed run starts from other weights: load fixes them
  auto opt = std::make_shared<Opt>(net->parameters(), torch::optim::AdamWOptions(0.05));
  optim::LRScheduleOptions schedule;
  schedule.name = "cosine";
  schedule.num_warmup_steps = 1;
  schedule.num_training_steps = 6;
  auto sched = std::make_shared<optim::LRScheduler>(*opt, schedule);
  auto [m, o, dl, s] = acc.prepare(net, opt, make_loader(), sched);
  if (resume) acc.load_state(dir);
  int seen = resume ? save_at : 0;
  for (const auto& b : *dl) {
    auto scope = acc.accumulate(m);
    acc.backward(torch::mse_loss(m->forward(b.at("x")), b.at("y")));
    o->step();
    s->step();
    o->zero_grad();
    if (!resume && ++seen == save_at) {
      acc.save_state(dir);
      if (save_at > 0) break;
    }
  }
  std::vector<torch::Tensor> out;
  for (auto& p : net->parameters()) out.push_back(p.detach().clone());
  return out;
}

template <typename Opt>
void check_resume() {
  const std::string dir =
      (fs::temp_directory_path() / ("difftrain_ckpt_" + std::to_string(::getpid()))).string();
  distributed::on_ranks(2, [&](distributed::ProcessGroup& g) {
    auto full =
        run<Opt>(g, dir + "_unused", -1, false);  // uninterrupted: 12 batches per rank, 6 updates
    // Saved at a window boundary (4 micro-steps, accumulation 2): as in Accelerate, gradients
    // accumulated inside an unfinished window are not part of the state.
    auto first = run<Opt>(g, dir, 4, false);
    auto resumed = run<Opt>(g, dir, 4, true);
    for (size_t i = 0; i < full.size(); ++i) {
      EXPECT_TRUE(torch::equal(full[i], resumed[i]))
          << "rank " << g.rank() << " parameter " << i << " max diff "
          << (full[i] - resumed[i]).abs().max();
    }
    EXPECT_FALSE(torch::equal(full[0], first[0]));  // the resumed half did real work
  });
  EXPECT_TRUE(fs::exists(dir + "/model.safetensors"));
  EXPECT_TRUE(fs::exists(dir + "/optimizer.safetensors"));
  EXPECT_TRUE(fs::exists(dir + "/optimizer.json"));
  EXPECT_TRUE(fs::exists(dir + "/scheduler.json"));
  EXPECT_TRUE(fs::exists(dir + "/random_states_1.safetensors"));
  EXPECT_FALSE(fs::exists(dir + ".tmp"));
  fs::remove_all(dir);
}

TEST(AccelCheckpoint, AdamWResumeEqualsUninterrupted) { check_resume<optim::AdamW>(); }
TEST(AccelCheckpoint, AdamW8bitResumeEqualsUninterrupted) { check_resume<optim::AdamW8bit>(); }

TEST(AccelCheckpoint, RefusesAnotherModelsCheckpointNamingTheTensor) {
  const std::string dir =
      (fs::temp_directory_path() / ("difftrain_ckpt_bad_" + std::to_string(::getpid()))).string();
  distributed::on_ranks(1, [&](distributed::ProcessGroup& g) {
    AcceleratorOptions options;
    options.mixed_precision = "no";
    {
      Accelerator acc(options, g);
      auto net = torch::nn::Linear(3, 2);
      auto opt = std::make_shared<optim::AdamW>(net->parameters());
      auto [m, o] = acc.prepare(net, opt);
      acc.save_state(dir);
      acc.save_state(dir);  // replacing an existing checkpoint works
    }
    Accelerator acc(options, g);
    auto net = torch::nn::Linear(4, 2);
    auto opt = std::make_shared<optim::AdamW>(net->parameters());
    auto [m, o] = acc.prepare(net, opt);
    try {
      acc.load_state(dir);
      ADD_FAILURE() << "a checkpoint of another shape was loaded";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("'weight'"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("model.safetensors"), std::string::npos) << e.what();
    }
    EXPECT_THROW(acc.load_state(dir + "_missing"), Error);
    // A LibTorch optimizer has no safetensors state: a clear error, not a half checkpoint.
    Accelerator acc2(options, g);
    auto net2 = torch::nn::Linear(3, 2);
    auto sgd = std::make_shared<torch::optim::SGD>(net2->parameters(), 0.1);
    auto [m2, o2] = acc2.prepare(net2, sgd);
    EXPECT_THROW(acc2.save_state(dir + "_sgd"), Error);
    EXPECT_FALSE(fs::exists(dir + "_sgd"));
    EXPECT_FALSE(fs::exists(dir + "_sgd.tmp"));  // a failed save leaves no temporary folder
  });
  fs::remove_all(dir);
  fs::remove_all(dir + "_sgd.tmp");
}

// checksums.json: a truncated, a byte-flipped and a missing file are each an error naming the
// file; the same folder without its manifest (a checkpoint from before manifests) still loads.
TEST(AccelCheckpoint, ChecksumsCatchTruncatedFlippedAndMissingFiles) {
  const std::string dir =
      (fs::temp_directory_path() / ("difftrain_ckpt_sum_" + std::to_string(::getpid()))).string();
  distributed::on_ranks(1, [&](distributed::ProcessGroup& g) {
    AcceleratorOptions options;
    options.mixed_precision = "no";
    Accelerator acc(options, g);
    auto net = torch::nn::Linear(3, 2);
    auto opt = std::make_shared<optim::AdamW>(net->parameters());
    auto [m, o] = acc.prepare(net, opt);
    acc.save_state(dir);
    ASSERT_TRUE(fs::exists(dir + "/checksums.json"));
    EXPECT_TRUE(verify_checkpoint(dir));
    acc.load_state(dir);
    auto expect_error = [&](const std::string& file, const std::string& why) {
      try {
        acc.load_state(dir);
        ADD_FAILURE() << "damaged " << file << " (" << why << ") was loaded";
      } catch (const Error& e) {
        std::printf("%s: %s\n", why.c_str(), e.what());
        EXPECT_NE(std::string(e.what()).find(dir + "/" + file), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("--resume_from_checkpoint"), std::string::npos);
      }
    };
    const std::string model = dir + "/model.safetensors";
    const std::string original = [&] {
      std::ifstream in(model, std::ios::binary);
      return std::string(std::istreambuf_iterator<char>(in), {});
    }();
    fs::resize_file(model, original.size() - 5);  // truncated
    expect_error("model.safetensors", "size");
    std::string flipped = original;
    flipped[flipped.size() - 3] ^= 0x10;  // same size, one bit of a weight
    std::ofstream(model, std::ios::binary | std::ios::trunc) << flipped;
    expect_error("model.safetensors", "crc32");
    std::ofstream(model, std::ios::binary | std::ios::trunc) << original;
    acc.load_state(dir);  // repaired: loads again
    const std::string optimizer_json = dir + "/optimizer.json";
    fs::rename(optimizer_json, optimizer_json + ".away");
    expect_error("optimizer.json", "missing");
    fs::rename(optimizer_json + ".away", optimizer_json);
    std::ofstream(dir + "/checksums.json", std::ios::trunc) << "{\"files\": [{\"path\": 3}]}";
    expect_error("checksums.json", "unreadable");
    fs::remove(dir + "/checksums.json");  // as saved before manifests: loads unchecked
    EXPECT_FALSE(verify_checkpoint(dir));
    std::ofstream(model, std::ios::binary | std::ios::trunc) << flipped;
    acc.load_state(dir);
  });
  fs::remove_all(dir);
}

}  // namespace
}  // namespace difftrain::accel

namespace difftrain::accel {
namespace {

// The CheckpointState of engines that hold whole parameters (DDP, one process): rank 0 writes
// the model and optimizer files, other ranks write nothing, every rank reads them back; sharded
// optimizer state is refused with what to do.
TEST(AccelCheckpoint, ReplicatedCheckpointStateWritesOnRankZeroAndReadsEverywhere) {
  const fs::path dir = fs::temp_directory_path() / ("dt_replicated_" + std::to_string(getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir / "rank1");
  torch::manual_seed(0);
  Net a;
  optim::AdamW opt(a->parameters(), torch::optim::AdamWOptions(1e-2));
  a->forward(torch::randn({4, 3})).sum().backward();
  opt.step();
  auto rank0 = replicated_checkpoint_state(0);
  auto rank1 = replicated_checkpoint_state(1);
  rank0->save_model(*a, dir.string(), "model");
  rank0->save_optimizer(opt, dir.string(), "optimizer");
  rank1->save_model(*a, (dir / "rank1").string(), "model");
  rank1->save_optimizer(opt, (dir / "rank1").string(), "optimizer");
  EXPECT_TRUE(fs::is_empty(dir / "rank1"));
  EXPECT_TRUE(fs::exists(dir / "model.safetensors"));

  Net b;
  optim::AdamW opt_b(b->parameters(), torch::optim::AdamWOptions(1e-2));
  rank1->load_model(*b, dir.string(), "model");
  rank1->load_optimizer(opt_b, dir.string(), "optimizer");
  const auto pa = a->named_parameters(), pb = b->named_parameters();
  for (const auto& item : pa) EXPECT_TRUE(torch::equal(item.value(), pb[item.key()])) << item.key();
  EXPECT_EQ(opt_b.state_dict().tensors.size(), opt.state_dict().tensors.size());
  for (const auto& [key, t] : opt.state_dict().tensors) {
    EXPECT_TRUE(torch::equal(t, opt_b.state_dict().tensors.at(key))) << key;
  }
  // A sharded optimizer index in the folder: refused, naming the way out.
  { std::ofstream(dir / "optimizer_9.index.json") << "{}"; }
  try {
    rank0->load_optimizer(opt_b, dir.string(), "optimizer_9");
    ADD_FAILURE() << "sharded optimizer state loaded into a replicated run";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--sharding_strategy"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace difftrain::accel
