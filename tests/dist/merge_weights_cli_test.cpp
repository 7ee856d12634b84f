// `difftrain merge-weights` end to end: a UNet checkpoint sharded over 2 ranks merges into a
// Diffusers UNet folder with the same tensors that `difftrain sample` loads and samples like the
// original; an unsharded model and a second model (--model_index) keep names and dtypes; LoRA
// state goes to its own file; bad input exits 1 with a one-line message naming the path.

#include "subprocess.h"

#include "difftrain/io/safetensors.h"
#include "difftrain/io/sharded_tensors.h"
#include "program_paths.h"
#include "source_dir.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <sstream>

namespace difftrain::testing {
namespace {

namespace fs = std::filesystem;
const std::string kDifftrain = difftrain_test::difftrain_bin();
const std::string kGolden = std::string(difftrain_test::source_dir()) + "/tests/golden/diffusers/";

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

// Writes `tensors` into `dir` as `world` ranks of a sharded run would (FSDP's even split of each
// flattened tensor, the last ranks' ranges clipped at numel), then the index.
void write_sharded(const std::string& dir, const std::string& stem, const io::TensorMap& tensors,
                   int world, const nlohmann::json& metadata = {}) {
  std::map<std::string, io::ShardedTensorInfo> infos;
  std::vector<std::vector<io::TensorPiece>> pieces(world);
  for (const auto& [name, t] : tensors) {
    auto& info = infos[name];
    info.shape = t.sizes().vec();
    info.dtype = t.scalar_type();
    const int64_t n = t.numel(), chunk = (n + world - 1) / world;
    for (int r = 0; r < world; ++r) {
      const int64_t b = std::min(r * chunk, n), e = std::min((r + 1) * chunk, n);
      if (b == e) continue;
      pieces[r].push_back({name, b, e, t.reshape({-1}).slice(0, b, e).clone()});
      info.pieces.push_back({io::shard_file_name(stem, r, world), b, e});
    }
  }
  for (int r = 0; r < world; ++r) io::write_tensor_shard(dir, stem, r, world, pieces[r]);
  io::write_shard_index(dir, stem, world, infos, metadata);
}

void expect_same_tensors(const io::TensorMap& got, const io::TensorMap& want) {
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [name, t] : want) {
    ASSERT_TRUE(got.count(name)) << name;
    EXPECT_EQ(got.at(name).scalar_type(), t.scalar_type()) << name;
    EXPECT_EQ(got.at(name).sizes(), t.sizes()) << name;
    EXPECT_TRUE(torch::equal(got.at(name), t)) << name;
  }
}

TEST(MergeWeightsCommand, ShardedUNetCheckpointBecomesASampleableUNetFolder) {
  const auto dir = make_temp_dir("merge_weights_unet");
  const std::string unet = kGolden + "unet2d_uncond/";
  const std::string ckpt = dir + "/checkpoint-10";
  const auto weights = io::load_safetensors(unet + "diffusion_pytorch_model.safetensors").tensors;
  write_sharded(ckpt, "model", weights, 2);
  for (const char* f : {"config.json", "scheduler_config.json"}) {
    fs::copy_file(unet + f, ckpt + "/" + f);
  }
  ASSERT_TRUE(fs::exists(ckpt + "/model-00002-of-00002.safetensors"));

  auto r = run({kDifftrain, "merge-weights", ckpt, dir + "/merged"}, {}, 60);
  ASSERT_EQ(r.exit_code, 0) << r.log();
  const std::string file = dir + "/merged/diffusion_pytorch_model.safetensors";
  EXPECT_NE(r.out.find("merged " + std::to_string(weights.size()) + " tensors ("),
            std::string::npos)
      << r.log();
  EXPECT_NE(r.out.find("from " + ckpt + " into " + file), std::string::npos) << r.log();
  expect_same_tensors(io::load_safetensors(file).tensors, weights);
  EXPECT_EQ(slurp(dir + "/merged/config.json"), slurp(unet + "config.json"));
  EXPECT_EQ(slurp(dir + "/merged/scheduler_config.json"), slurp(unet + "scheduler_config.json"));

  // The merged folder samples exactly like the folder the weights came from.
  auto sample = [&](const std::string& model, const std::string& name) {
    const auto s = run({kDifftrain, "sample", "--model", model, "--num_inference_steps", "3",
                        "--num_images", "1", "--seed", "5", "--output", dir + "/" + name + ".png",
                        "--save_tensors", dir + "/" + name + ".safetensors"},
                       {}, 120);
    EXPECT_EQ(s.exit_code, 0) << s.log();
    return io::load_safetensors(dir + "/" + name + ".safetensors").tensors.at("images");
  };
  EXPECT_TRUE(torch::equal(sample(dir + "/merged", "merged"), sample(unet, "original")));

  // Merging again into the same (now non-empty) folder replaces the weights file.
  r = run({kDifftrain, "merge-weights", ckpt, dir + "/merged"}, {}, 60);
  EXPECT_EQ(r.exit_code, 0) << r.log();
  fs::remove_all(dir);
}

TEST(MergeWeightsCommand, UnshardedModelAndSecondModelKeepNamesAndDtypes) {
  const auto dir = make_temp_dir("merge_weights_two");
  const std::string ckpt = dir + "/checkpoint-3";
  torch::manual_seed(1);
  const io::TensorMap first = {{"w", torch::randn({3, 4}).to(torch::kBFloat16)},
                               {"step", torch::tensor(std::vector<int64_t>{7, 1LL << 50})}};
  const io::TensorMap second = {{"a.weight", torch::randn({5, 3})},
                                {"a.bias", torch::randn({2}).to(torch::kFloat16)},
                                {"ids", torch::arange(10, torch::kInt64).view({2, 5})}};
  io::save_safetensors(ckpt + "/model.safetensors", first, {{"format", "pt"}});
  write_sharded(ckpt, "model_1", second, 3);

  auto r = run({kDifftrain, "merge-weights", ckpt, dir + "/out0"}, {}, 60);
  ASSERT_EQ(r.exit_code, 0) << r.log();
  EXPECT_NE(r.out.find("merged 2 tensors ("), std::string::npos) << r.log();
  expect_same_tensors(
      io::load_safetensors(dir + "/out0/diffusion_pytorch_model.safetensors").tensors, first);
  EXPECT_FALSE(fs::exists(dir + "/out0/config.json"));  // the checkpoint has none

  r = run({kDifftrain, "merge-weights", ckpt, dir + "/out1", "--model_index", "1", "--output_name",
           "model.safetensors"},
          {}, 60);
  ASSERT_EQ(r.exit_code, 0) << r.log();
  EXPECT_NE(r.out.find("merged 3 tensors ("), std::string::npos) << r.log();
  expect_same_tensors(io::load_safetensors(dir + "/out1/model.safetensors").tensors, second);
  fs::remove_all(dir);
}

TEST(MergeWeightsCommand, LoraStateGoesToAdapterTensors) {
  const auto dir = make_temp_dir("merge_weights_lora");
  const std::string ckpt = dir + "/checkpoint-1";
  torch::manual_seed(2);
  const io::TensorMap lora = {
      {"down_blocks.0.attentions.0.to_q.lora_A.weight", torch::randn({4, 8})},
      {"down_blocks.0.attentions.0.to_q.lora_B.weight", torch::randn({8, 4})}};
  write_sharded(ckpt, "model", lora, 2, {{"lora", true}});
  const auto r = run({kDifftrain, "merge-weights", ckpt, dir + "/out"}, {}, 60);
  ASSERT_EQ(r.exit_code, 0) << r.log();
  EXPECT_NE(r.out.find("adapter_tensors.safetensors (LoRA adapter state"), std::string::npos)
      << r.log();
  expect_same_tensors(io::load_safetensors(dir + "/out/adapter_tensors.safetensors").tensors, lora);
  EXPECT_FALSE(fs::exists(dir + "/out/diffusion_pytorch_model.safetensors"));
  fs::remove_all(dir);
}

TEST(MergeWeightsCommand, BadInputExitsWithOneLineErrors) {
  const auto dir = make_temp_dir("merge_weights_bad");
  const io::TensorMap tensors = {{"w", torch::arange(12, torch::kFloat32).view({3, 4})}};
  write_sharded(dir + "/missing", "model", tensors, 2);
  fs::remove(dir + "/missing/model-00002-of-00002.safetensors");
  write_sharded(dir + "/truncated", "model", tensors, 2);
  fs::resize_file(dir + "/truncated/model-00001-of-00002.safetensors",
                  fs::file_size(dir + "/truncated/model-00001-of-00002.safetensors") - 4);
  write_sharded(dir + "/good", "model", tensors, 2);
  fs::create_directories(dir + "/empty");
  std::ofstream(dir + "/file.txt") << "x";
  struct Case {
    std::vector<std::string> args;
    std::string expect;
    std::string output;  // must not exist afterwards
  };
  const std::vector<Case> cases = {
      {{dir + "/nope", dir + "/o1"}, dir + "/nope: no such folder", dir + "/o1"},
      {{dir + "/empty", dir + "/o2"},
       dir + "/empty: no model 0 in this folder (neither model.index.json nor model.safetensors)",
       dir + "/o2"},
      {{dir + "/good", dir + "/o3", "--model_index", "2"},
       "it has model.index.json; pick one with --model_index",
       dir + "/o3"},
      {{dir + "/missing", dir + "/o4"},
       dir + "/missing/model-00002-of-00002.safetensors: shard file is missing",
       dir + "/o4"},
      {{dir + "/truncated", dir + "/o5"},
       "shard file '" + dir + "/truncated/model-00001-of-00002.safetensors' (holding tensor 'w') " +
           "cannot be read",
       dir + "/o5"},
      {{dir + "/good", dir + "/good"}, "the output is the checkpoint folder", ""},
      {{dir + "/good", dir + "/file.txt/out"}, dir + "/file.txt/out: cannot create", ""},
  };
  for (const auto& c : cases) {
    std::vector<std::string> argv{kDifftrain, "merge-weights"};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    const auto r = run(argv, {}, 60);
    EXPECT_EQ(r.exit_code, 1) << r.log();
    const auto at = r.err.find("difftrain: error: ");
    ASSERT_NE(at, std::string::npos) << r.log();
    const std::string line = r.err.substr(at);
    EXPECT_NE(line.find(c.expect), std::string::npos) << c.expect << "\n" << r.log();
    EXPECT_EQ(line.find('\n'), line.size() - 1) << "not one line:\n" << r.log();
    if (!c.output.empty()) {
      EXPECT_FALSE(fs::exists(c.output)) << r.log();
    }
  }
  EXPECT_FALSE(fs::exists(dir + "/good/diffusion_pytorch_model.safetensors"));
  // Both folders are required (a CLI11 usage error).
  const auto usage = run({kDifftrain, "merge-weights", dir + "/good"}, {}, 30);
  EXPECT_NE(usage.exit_code, 0) << usage.log();
  EXPECT_NE(usage.exit_code, 1) << usage.log();
  fs::remove_all(dir);
}

}  // namespace
}  // namespace difftrain::testing
