// Wan training end to end through `difftrain train` on the tiny fixture folders
// (tests/golden/wan): a folder of MP4 / MKV clips, stills and a folder of frames cut into clips
// and buckets; a LoRA run whose adapters change `difftrain sample`'s frames the same through
// every exported layout, with MP4 validation clips and a model card; 2 ranks equal 1 rank at the
// same global batch; exact resume; image to video; one Wan 2.2 A14B expert fully fine-tuned and
// sampled from its export; bad input refused in one line.
#include "train_util.h"

#include "difftrain/io/atomic_file.h"
#include "difftrain/io/image.h"
#include "difftrain/io/safetensors.h"
#include "difftrain/io/video.h"
#include "source_dir.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <tuple>

namespace difftrain::testing {
namespace {

namespace fs = std::filesystem;

const std::string kWanG = std::string(difftrain_test::source_dir()) + "/tests/golden/wan";

double wt_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kFloat64) - b.to(torch::kFloat64)).abs().max().item<double>();
}

// A square of `colour` moving right across grey, F frames of H x W.
torch::Tensor moving_square(int64_t F, int64_t H, int64_t W, std::array<uint8_t, 3> colour) {
  auto clip = torch::full({F, H, W, 3}, 128, torch::kUInt8);
  const int64_t side = std::min(H, W) / 2;
  for (int64_t f = 0; f < F; ++f) {
    const int64_t left = (W - side) * f / std::max<int64_t>(1, F - 1);
    auto box = clip[f].narrow(0, (H - side) / 2, side).narrow(1, left, side);
    for (int c = 0; c < 3; ++c) box.select(2, c).fill_(colour[c]);
  }
  return clip;
}

// Two MP4 clips and an MKV of another shape, two stills and a folder of frames, captioned.
std::string make_clip_folder(const std::string& dir) {
  fs::create_directories(dir + "/frames/walk");
  io::VideoWriteOptions w;
  w.crf = 0;
  io::write_video(dir + "/red.mp4", moving_square(13, 48, 64, {255, 0, 0}), w);
  std::ofstream(dir + "/red.txt") << "a red square slides right\n";
  io::write_video(dir + "/blue.mp4", moving_square(9, 48, 64, {0, 0, 255}), w);
  std::ofstream(dir + "/blue.txt") << "a blue square slides right";
  io::write_video(dir + "/tall.mkv", moving_square(9, 64, 32, {0, 255, 0}), w);
  std::ofstream(dir + "/tall.txt") << "a green square slides right";
  io::save_png(dir + "/still_a.png", moving_square(1, 40, 40, {255, 255, 0})[0]);
  std::ofstream(dir + "/still_a.txt") << "a yellow square";
  io::save_png(dir + "/still_b.png", moving_square(1, 40, 40, {255, 0, 255})[0]);
  std::ofstream(dir + "/still_b.txt") << "a magenta square";
  const auto walk = moving_square(5, 32, 32, {0, 255, 255});
  for (int64_t f = 0; f < 5; ++f) {
    io::save_png(dir + "/frames/walk/" + std::to_string(f) + ".png", walk[f]);
  }
  std::ofstream(dir + "/frames/walk.txt") << "a cyan square slides right";
  return dir;
}

std::vector<std::string> wan_train_cmd(const std::string& model, const std::string& data,
                                       const std::string& out, std::vector<std::string> extra) {
  std::vector<std::string> cmd = {"train",
                                  "--pretrained_model_name_or_path",
                                  model,
                                  "--dataset",
                                  "imagefolder",
                                  "--train_data_dir",
                                  data,
                                  "--output_dir",
                                  out,
                                  "--resolution",
                                  "32",
                                  "--target_frames",
                                  "1,5,9",
                                  "--max_sequence_length",
                                  "64",
                                  "--learning_rate",
                                  "1e-2",
                                  "--lr_scheduler",
                                  "constant",
                                  "--lr_warmup_steps",
                                  "0",
                                  "--seed",
                                  "3",
                                  "--dataloader_num_workers",
                                  "0"};
  cmd.insert(cmd.end(), extra.begin(), extra.end());
  return cmd;
}

// `difftrain sample` frames of the tiny T2V model, with a LoRA file or a merged folder.
torch::Tensor wan_frames(const std::string& dir, const std::string& name, const std::string& lora,
                         const std::string& model = kWanG + "/tiny_wan") {
  std::vector<std::string> argv = {kDifftrain,
                                   "sample",
                                   "--model",
                                   model,
                                   "--prompt",
                                   "a red square slides right",
                                   "--height",
                                   "32",
                                   "--width",
                                   "32",
                                   "--num_frames",
                                   "5",
                                   "--num_inference_steps",
                                   "2",
                                   "--seed",
                                   "1",
                                   "--output",
                                   dir + "/" + name + ".png",
                                   "--save_tensors",
                                   dir + "/" + name + ".safetensors"};
  if (!lora.empty()) argv.insert(argv.end(), {"--lora", lora});
  auto r = run(argv, {}, 300);
  EXPECT_EQ(r.exit_code, 0) << r.log();
  if (r.exit_code != 0) return torch::zeros({1});
  return io::load_safetensors(dir + "/" + name + ".safetensors").tensors.at("frames");
}

TEST(WanTrain, LoraOnClipsAndStillsSamplesTheSameThroughEveryLayout) {
  ASSERT_TRUE(io::video_supported()) << "built without FFmpeg: run scripts/setup and rebuild";
  const std::string dir = make_temp_dir("wan_train");
  const std::string data = make_clip_folder(dir + "/data");
  auto r = train(
      wan_train_cmd(
          kWanG + "/tiny_wan", data, dir + "/run",
          {"--lora", "--rank", "4", "--max_train_steps", "6", "--resolution_buckets",
           "--bucket_step", "16", "--gradient_checkpointing", "--validation_prompt",
           "a red square slides right", "--validation_steps", "6", "--validation_inference_steps",
           "2", "--num_validation_images", "1", "--validation_num_frames", "5"}),
      1, 600);
  ASSERT_EQ(r.exit_code, 0) << r.log();
  // 3 videos x (1, 5, 9 frames where long enough) + 2 stills + the 5-frame folder (1 and 5).
  EXPECT_NE(r.err.find("video data: 6 file(s), 13 clip(s)"), std::string::npos) << r.log();
  EXPECT_NE(r.err.find("defaults: musubi-tuner wan_train_network.py"), std::string::npos);
  EXPECT_NE(r.err.find("LoRA rank 4 alpha 4 on 20 transformer module(s)"), std::string::npos);
  // Validation: the frame strip and the clip as an MP4.
  EXPECT_TRUE(fs::exists(dir + "/run/samples/step-000006.png"));
  const auto clip = io::read_video(dir + "/run/samples/step-000006-0.mp4");
  EXPECT_EQ(clip.frames.size(0), 5);
  const std::string card = io::read_file(dir + "/run/README.md");
  EXPECT_NE(card.find("text-to-video"), std::string::npos);
  EXPECT_NE(card.find("WanPipeline"), std::string::npos);

  // The adapters change the frames; every layout of the file gives the same frames.
  const std::string lora = dir + "/run/pytorch_lora_weights.safetensors";
  const auto base = wan_frames(dir, "base", "");
  const auto tuned = wan_frames(dir, "tuned", lora);
  EXPECT_GT(wt_diff(base, tuned), 1e-3);
  for (const std::string format : {"kohya", "comfyui", "peft"}) {
    SCOPED_TRACE(format);
    const std::string file = dir + "/lora_" + format + ".safetensors";
    auto c = run({kDifftrain, "lora", "convert", "--model", kWanG + "/tiny_wan", "--input", lora,
                  "--to", format, "--output", file},
                 {}, 120);
    ASSERT_EQ(c.exit_code, 0) << c.log();
    EXPECT_LE(wt_diff(wan_frames(dir, format, file), tuned), 1e-5);
  }
  // The original / ComfyUI names (diffusion_model.blocks.N.self_attn.q).
  const auto comfy = io::load_safetensors(dir + "/lora_comfyui.safetensors").tensors;
  EXPECT_TRUE(comfy.count("diffusion_model.blocks.0.self_attn.q.lora_down.weight"));
  EXPECT_TRUE(comfy.count("diffusion_model.blocks.1.ffn.2.lora_up.weight"));
}

TEST(WanTrain, TwoRanksEqualOneRankAndResumeIsExact) {
  ASSERT_TRUE(io::video_supported()) << "built without FFmpeg: run scripts/setup and rebuild";
  const std::string dir = make_temp_dir("wan_ranks");
  const std::string data = make_clip_folder(dir + "/data");
  auto cmd = [&](const std::string& out, const std::string& steps, const std::string& batch) {
    return wan_train_cmd(kWanG + "/tiny_wan", data, out,
                         {"--lora", "--rank", "4", "--max_train_steps", steps,
                          "--checkpointing_steps", "2", "--train_batch_size", batch, "--cache_dir",
                          dir + "/cache", "--timestep_sampling", "sigmoid"});
  };
  auto one = train(cmd(dir + "/one", "4", "2"), 1, 600);
  ASSERT_EQ(one.exit_code, 0) << one.log();
  auto two = train(cmd(dir + "/two", "4", "1"), 2, 600);
  ASSERT_EQ(two.exit_code, 0) << two.log();
  const std::string file = "/pytorch_lora_weights.safetensors";
  const auto a = io::load_safetensors(dir + "/one" + file).tensors;
  const auto b = io::load_safetensors(dir + "/two" + file).tensors;
  const double ranks = max_abs_diff(a, b);
  double moved = 0;
  for (const auto& [key, t] : a) moved = std::max(moved, t.abs().max().item<double>());
  std::cout << "Wan 2 ranks vs 1 rank: " << ranks << " (weights up to " << moved << ")\n";
  EXPECT_LE(ranks, 1e-4 * std::max(1.0, moved));
  const auto la = losses(dir + "/one"), lb = losses(dir + "/two");
  ASSERT_EQ(la.size(), lb.size());
  for (size_t i = 0; i < la.size(); ++i) EXPECT_NEAR(la[i], lb[i], 1e-4 * std::abs(la[i]));
  // The shared cache was reused by the second run.
  EXPECT_NE(two.err.find("video data: reusing"), std::string::npos) << two.log();

  auto first = train(cmd(dir + "/resumed", "2", "1"), 2, 600);
  ASSERT_EQ(first.exit_code, 0) << first.log();
  auto c = cmd(dir + "/resumed", "4", "1");
  c.insert(c.end(), {"--resume_from_checkpoint", "latest"});
  auto second = train(c, 2, 600);
  ASSERT_EQ(second.exit_code, 0) << second.log();
  EXPECT_NE(second.err.find("resumed from"), std::string::npos) << second.log();
  EXPECT_EQ(max_abs_diff(b, io::load_safetensors(dir + "/resumed" + file).tensors), 0.0);
  EXPECT_EQ(losses(dir + "/two"), losses(dir + "/resumed"));
}

TEST(WanTrain, ImageToVideoAndOneA14bExpertFullFineTune) {
  ASSERT_TRUE(io::video_supported()) << "built without FFmpeg: run scripts/setup and rebuild";
  const std::string dir = make_temp_dir("wan_i2v");
  const std::string data = make_clip_folder(dir + "/data");
  // Image to video: each clip's first frame conditions it; validation from the first clip's.
  auto i2v =
      train(wan_train_cmd(kWanG + "/tiny_wan_i2v", data, dir + "/i2v",
                          {"--lora", "--rank", "4", "--max_train_steps", "2", "--target_frames",
                           "5", "--validation_prompt", "a square", "--validation_steps", "2",
                           "--validation_inference_steps", "1", "--num_validation_images", "1"}),
            1, 600);
  ASSERT_EQ(i2v.exit_code, 0) << i2v.log();
  EXPECT_NE(i2v.err.find("Wan image-to-video"), std::string::npos) << i2v.log();
  EXPECT_TRUE(fs::exists(dir + "/i2v/samples/step-000002-0.mp4"));

  // Wan 2.1 image to video: each clip's first frame also through CLIP (its penultimate hidden
  // states cached per clip, the image context of every step); the adapters reach add_k_proj /
  // add_v_proj too.
  auto c21 = wan_train_cmd(kWanG + "/tiny_wan_i2v21", data, dir + "/i2v21",
                           {"--lora", "--rank", "4", "--max_train_steps", "2", "--target_frames",
                            "5", "--validation_prompt", "a square", "--validation_steps", "2",
                            "--validation_inference_steps", "1", "--num_validation_images", "1"});
  // The image context is split off 512 text tokens: the full length.
  *(std::find(c21.begin(), c21.end(), "--max_sequence_length") + 1) = "512";
  auto i2v21 = train(c21, 1, 600);
  ASSERT_EQ(i2v21.exit_code, 0) << i2v21.log();
  EXPECT_NE(i2v21.err.find("LoRA rank 4 alpha 4 on 24 transformer module(s)"), std::string::npos)
      << i2v21.log();
  EXPECT_TRUE(fs::exists(dir + "/i2v21/samples/step-000002-0.mp4"));
  const auto l21 = io::load_safetensors(dir + "/i2v21/pytorch_lora_weights.safetensors").tensors;
  EXPECT_TRUE(l21.count("transformer.blocks.0.attn2.add_k_proj.lora_A.weight"));

  // A14B: the low-noise expert, t in [0, boundary): the export replaces transformer_2 only.
  const std::string a14b = kWanG + "/tiny_wan_a14b";
  auto low = train(wan_train_cmd(a14b, data, dir + "/low",
                                 {"--train_expert", "low", "--max_train_steps", "2",
                                  "--target_frames", "5", "--learning_rate", "1e-3"}),
                   1, 600);
  ASSERT_EQ(low.exit_code, 0) << low.log();
  EXPECT_NE(low.err.find("training the low-noise expert (transformer_2), timesteps 0..875"),
            std::string::npos)
      << low.log();
  const auto before =
      io::load_safetensors(a14b + "/transformer/diffusion_pytorch_model.safetensors");
  const auto after =
      io::load_safetensors(dir + "/low/transformer/diffusion_pytorch_model.safetensors");
  EXPECT_EQ(max_abs_diff(before.tensors, after.tensors), 0.0);  // the high-noise expert, copied
  const auto low_before =
      io::load_safetensors(a14b + "/transformer_2/diffusion_pytorch_model.safetensors");
  const auto low_after =
      io::load_safetensors(dir + "/low/transformer_2/diffusion_pytorch_model.safetensors");
  EXPECT_GT(max_abs_diff(low_before.tensors, low_after.tensors), 1e-6);
  // Both experts in one run: one LoRA, the bases swapped by each micro-batch's timestep
  // (validation through both), on one rank and on two.
  auto both_cmd = [&](const std::string& out) {
    return wan_train_cmd(
        a14b, data, out,
        {"--train_expert", "both", "--lora", "--rank", "4", "--max_train_steps", "4",
         "--target_frames", "1,5", "--train_batch_size", "2", "--timestep_sampling", "shift",
         "--discrete_flow_shift", "5", "--cache_dir", dir + "/cache"});
  };
  for (const int ranks : {1, 2}) {
    SCOPED_TRACE(ranks);
    const std::string out = dir + "/both" + std::to_string(ranks);
    auto both = train(both_cmd(out), ranks, 600);
    ASSERT_EQ(both.exit_code, 0) << both.log();
    EXPECT_NE(both.err.find("one LoRA on both experts"), std::string::npos) << both.log();
    EXPECT_NE(both.err.find("the low-noise expert's base swapped in"), std::string::npos)
        << both.log();
    const auto lora = io::load_safetensors(out + "/pytorch_lora_weights.safetensors").tensors;
    double up = 0;
    for (const auto& [key, t] : lora) {
      if (key.find("lora_B") != std::string::npos) up = std::max(up, t.abs().max().item<double>());
    }
    EXPECT_GT(up, 0);  // B starts at zero: it moved
    for (const double l : losses(out)) EXPECT_TRUE(std::isfinite(l));
  }
  auto vboth =
      train(wan_train_cmd(a14b, data, dir + "/vboth",
                          {"--train_expert", "both", "--lora", "--rank", "4", "--max_train_steps",
                           "1", "--target_frames", "5", "--cache_dir", dir + "/cache",
                           "--validation_prompt", "a", "--validation_steps", "1",
                           "--validation_inference_steps", "4", "--num_validation_images", "1"}),
            1, 600);
  ASSERT_EQ(vboth.exit_code, 0) << vboth.log();
  EXPECT_TRUE(fs::exists(dir + "/vboth/samples/step-000001-0.mp4"));
  auto full_both = train(wan_train_cmd(a14b, data, dir + "/fboth",
                                       {"--train_expert", "both", "--max_train_steps", "1"}),
                         1, 300);
  EXPECT_NE(full_both.exit_code, 0);
  EXPECT_NE(full_both.err.find("one expert per run"), std::string::npos) << full_both.log();

  auto sample = run(
      {kDifftrain, "sample", "--model", dir + "/low", "--prompt", "a", "--height", "32", "--width",
       "32", "--num_frames", "5", "--num_inference_steps", "2", "--output", dir + "/low.mp4"},
      {}, 300);
  ASSERT_EQ(sample.exit_code, 0) << sample.log();
  EXPECT_NE(sample.err.find("two experts"), std::string::npos) << sample.log();
}

// A full fine-tune under ZeRO-3 on 2 ranks equals the unsharded one (up to the reduction order),
// in bf16 with CPU optimizer offload too, and an 8-bit base under LoRA trains.
TEST(WanTrain, FullFineTuneUnderZero3EqualsUnshardedAndAnInt8BaseTrains) {
  ASSERT_TRUE(io::video_supported()) << "built without FFmpeg: run scripts/setup and rebuild";
  const std::string dir = make_temp_dir("wan_zero3");
  const std::string data = make_clip_folder(dir + "/data");
  auto cmd = [&](const std::string& out, std::vector<std::string> extra) {
    std::vector<std::string> e = {"--max_train_steps",  "3",           "--learning_rate", "1e-4",
                                  "--train_batch_size", "1",           "--target_frames", "1,5",
                                  "--cache_dir",        dir + "/cache"};
    e.insert(e.end(), extra.begin(), extra.end());
    return wan_train_cmd(kWanG + "/tiny_wan", data, out, e);
  };
  auto plain = train(cmd(dir + "/plain", {"--sharding_strategy", "NO_SHARD"}), 2, 600);
  ASSERT_EQ(plain.exit_code, 0) << plain.log();
  auto sharded = train(cmd(dir + "/sharded", {"--sharding_strategy", "FULL_SHARD"}), 2, 600);
  ASSERT_EQ(sharded.exit_code, 0) << sharded.log();
  const std::string weights = "/transformer/diffusion_pytorch_model.safetensors";
  const auto a = io::load_safetensors(dir + "/sharded" + weights).tensors;
  const auto b = io::load_safetensors(dir + "/plain" + weights).tensors;
  const auto start = io::load_safetensors(kWanG + "/tiny_wan" + weights).tensors;
  ASSERT_EQ(a.size(), start.size());
  double apart = 0, moved = 0;
  for (const auto& [key, t] : b) {
    apart += (a.at(key).to(torch::kFloat64) - t.to(torch::kFloat64)).pow(2).sum().item<double>();
    moved +=
        (t.to(torch::kFloat64) - start.at(key).to(torch::kFloat64)).pow(2).sum().item<double>();
  }
  const double rel = std::sqrt(apart / moved);
  std::cout << "Wan FULL_SHARD vs NO_SHARD: relative " << rel << "\n";
  EXPECT_GT(moved, 0);
  EXPECT_LE(rel, 5e-3);
  for (const char* part : {"vae", "text_encoder", "tokenizer", "scheduler", "model_index.json"}) {
    EXPECT_TRUE(fs::exists(dir + "/sharded/" + part)) << part;
  }
  auto offload = train(
      cmd(dir + "/offload", {"--sharding_strategy", "SHARD_GRAD_OP", "--offload_optimizer_device",
                             "cpu", "--mixed_precision", "bf16"}),
      2, 600);
  ASSERT_EQ(offload.exit_code, 0) << offload.log();
  auto int8 = train(cmd(dir + "/int8", {"--lora", "--rank", "4", "--base_weights_dtype", "int8",
                                        "--mixed_precision", "bf16", "--learning_rate", "1e-2"}),
                    1, 600);
  ASSERT_EQ(int8.exit_code, 0) << int8.log();
  EXPECT_NE(int8.err.find("int8"), std::string::npos) << int8.log();
  EXPECT_TRUE(fs::exists(dir + "/int8/pytorch_lora_weights.safetensors"));
}

TEST(WanTrain, BadInputIsRefusedInOneLine) {
  ASSERT_TRUE(io::video_supported()) << "built without FFmpeg: run scripts/setup and rebuild";
  const std::string dir = make_temp_dir("wan_bad");
  const std::string data = make_clip_folder(dir + "/data");
  int runs = 0;
  auto refused = [&](const std::string& model, const std::string& folder,
                     std::vector<std::string> extra, const std::string& part) {
    const std::string out = dir + "/out" + std::to_string(runs++);
    auto r = train(wan_train_cmd(model, folder, out, std::move(extra)), 1, 300);
    EXPECT_NE(r.exit_code, 0) << r.log();
    EXPECT_NE(r.err.find(part), std::string::npos) << r.log();
    EXPECT_EQ(r.err.find("terminate called"), std::string::npos) << r.log();
  };
  refused(kWanG + "/tiny_wan_a14b", data, {}, "pass --train_expert high");
  refused(kWanG + "/tiny_wan", data, {"--train_expert", "low"}, "has one transformer");
  refused(kWanG + "/tiny_wan", data, {"--resolution", "40"}, "must be a multiple of 16");
  refused(kWanG + "/tiny_wan", data, {"--frame_extraction", "zigzag"}, "zigzag");
  // A corrupt video names the file.
  const std::string bad = dir + "/bad";
  fs::create_directories(bad);
  std::ofstream(bad + "/broken.mp4") << std::string(2000, 'x');
  std::ofstream(bad + "/broken.txt") << "a caption";
  refused(kWanG + "/tiny_wan", bad, {}, "broken.mp4");
  // A clip without a caption.
  const std::string nocap = dir + "/nocap";
  fs::create_directories(nocap);
  fs::copy_file(data + "/red.mp4", nocap + "/red.mp4");
  refused(kWanG + "/tiny_wan", nocap, {}, "red.mp4: no caption");
}

// Caption dropout on cached UMT5 embeddings: with every caption dropped in every epoch
// (--caption_dropout_every_n_epochs 1) the captions' text cannot matter, so two folders that
// differ only in their captions train the same LoRA; without it they differ.
TEST(WanTrain, CaptionDropoutServesTheEmptyCaptionsCachedEmbeddings) {
  ASSERT_TRUE(io::video_supported()) << "built without FFmpeg: run scripts/setup and rebuild";
  const std::string dir = make_temp_dir("wan_dropout");
  const std::string a = make_clip_folder(dir + "/a");
  const std::string b = make_clip_folder(dir + "/b");
  for (const auto& f : fs::recursive_directory_iterator(b)) {
    if (f.path().extension() == ".txt") std::ofstream(f.path()) << "something else entirely";
  }
  auto cmd = [&](const std::string& data, const std::string& out, bool drop) {
    std::vector<std::string> extra = {
        "--lora", "--rank",      "4",        "--max_train_steps", "3", "--train_batch_size",
        "2",      "--loss_type", "smooth_l1"};
    if (drop) {
      extra.insert(extra.end(),
                   {"--caption_dropout_every_n_epochs", "1", "--caption_prefix", "a clip:"});
    }
    return wan_train_cmd(kWanG + "/tiny_wan", data, out, extra);
  };
  for (const auto& [data, out, drop] :
       std::vector<std::tuple<std::string, std::string, bool>>{{a, dir + "/a_drop", true},
                                                               {b, dir + "/b_drop", true},
                                                               {a, dir + "/a_plain", false},
                                                               {b, dir + "/b_plain", false}}) {
    auto r = train(cmd(data, out, drop), 1, 600);
    ASSERT_EQ(r.exit_code, 0) << r.log();
  }
  const std::string file = "/pytorch_lora_weights.safetensors";
  const auto load = [&](const std::string& run) {
    return io::load_safetensors(dir + "/" + run + file).tensors;
  };
  // Not bit for bit: the empty caption is encoded in a batch with the folder's other captions,
  // and UMT5's padded batch shapes move its embedding in the last float bits.
  const double dropped = max_abs_diff(load("a_drop"), load("b_drop"));
  const double captions = max_abs_diff(load("a_plain"), load("b_plain"));
  std::cout << "Wan: captions change the LoRA by " << captions << " without dropout, by " << dropped
            << " with every caption dropped\n";
  EXPECT_LE(dropped, 1e-4);
  EXPECT_GT(captions, 1e-2);
}

}  // namespace
}  // namespace difftrain::testing
