// Qwen-Image-Edit end to end on the tiny fixture folder (tests/golden/qwen_image): `difftrain
// sample --pipeline QwenImageEditPipeline --image ...` gives Diffusers' latents from a PNG
// (make_edit.py's edit_one case), Edit Plus with two images too, and --image on a text-to-image
// run is refused; Edit training from a control/ folder: 2 ranks equal 1 rank at the same global
// batch, exact resume, a LoRA that `difftrain sample` applies through the Edit pipeline, with
// validation renders and a model card; Edit Plus training from metadata.jsonl control_image lists
// (full fine-tune, exported as a QwenImageEditPlusPipeline folder); a missing control image is
// refused in one line.
#include "train_util.h"

#include "difftrain/io/image.h"
#include "source_dir.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>

namespace difftrain::testing {
namespace {

namespace fs = std::filesystem;

const std::string kEditTiny =
    std::string(difftrain_test::source_dir()) + "/tests/golden/qwen_image/tiny_qwen_image";

io::TensorMap edit_fixture() {
  return io::load_safetensors(kEditTiny + "/edit_e2e.safetensors").tensors;
}

std::vector<std::string> edit_sample_cmd(const std::string& dir, const std::string& name,
                                         const std::string& pipeline,
                                         const std::vector<std::string>& images,
                                         const std::string& prompt, const std::string& seed) {
  std::vector<std::string> argv = {kDifftrain,
                                   "sample",
                                   "--model",
                                   kEditTiny,
                                   "--pipeline",
                                   pipeline,
                                   "--prompt",
                                   prompt,
                                   "--height",
                                   "48",
                                   "--width",
                                   "64",
                                   "--num_inference_steps",
                                   "2",
                                   "--true_cfg_scale",
                                   "1",
                                   "--seed",
                                   seed,
                                   "--output",
                                   dir + "/" + name + ".png",
                                   "--save_tensors",
                                   dir + "/" + name + ".safetensors"};
  for (const auto& image : images) argv.insert(argv.end(), {"--image", image});
  return argv;
}

TEST(QwenImageEditCli, SampleFromPngsEqualsDiffusersAndRefusesImagesForTextToImage) {
  const std::string dir = make_temp_dir("q_edit_cli");
  const auto f = edit_fixture();
  io::save_png(dir + "/a.png", f.at("edit_one.source.0"));
  io::save_png(dir + "/b.png", f.at("plus_two.source.1"));
  auto one = run(
      edit_sample_cmd(dir, "one", "QwenImageEditPipeline", {dir + "/a.png"}, "make it red", "0"),
      {}, 300);
  ASSERT_EQ(one.exit_code, 0) << one.log();
  EXPECT_NE(one.err.find("QwenImageEditPipeline, 1 reference image(s)"), std::string::npos)
      << one.log();
  const auto got = io::load_safetensors(dir + "/one.safetensors").tensors;
  EXPECT_LT((got.at("latents") - f.at("edit_one.latents")).abs().max().item<double>(), 2e-5);
  auto plus = run(
      edit_sample_cmd(dir, "plus", "QwenImageEditPlusPipeline", {dir + "/a.png", dir + "/b.png"},
                      "put the two pictures side by side", "2"),
      {}, 300);
  ASSERT_EQ(plus.exit_code, 0) << plus.log();
  const auto p = io::load_safetensors(dir + "/plus.safetensors").tensors;
  EXPECT_LT((p.at("images") - f.at("plus_two.image")).abs().max().item<double>(), 1e-4);
  // --image on a text-to-image run, a missing image, two images for Edit: one line each.
  auto t2i = run(
      {kDifftrain, "sample", "--model", kEditTiny, "--prompt", "x", "--image", dir + "/a.png",
       "--height", "32", "--width", "32", "--num_inference_steps", "1", "--output", dir + "/t.png"},
      {}, 120);
  EXPECT_NE(t2i.exit_code, 0);
  EXPECT_NE(t2i.err.find("--image is for the Edit pipelines"), std::string::npos) << t2i.log();
  auto missing = run(
      edit_sample_cmd(dir, "m", "QwenImageEditPipeline", {dir + "/nope.png"}, "x", "0"), {}, 120);
  EXPECT_NE(missing.exit_code, 0);
  EXPECT_NE(missing.err.find("nope.png"), std::string::npos) << missing.log();
  auto two = run(edit_sample_cmd(dir, "two", "QwenImageEditPipeline",
                                 {dir + "/a.png", dir + "/b.png"}, "x", "0"),
                 {}, 120);
  EXPECT_NE(two.exit_code, 0);
  EXPECT_NE(two.err.find("takes one reference image"), std::string::npos) << two.log();
}

// Eight 32x32 targets (a coloured square on grey) with their control images (the same square,
// grey, shifted) in control/<stem>.png, captioned "make the square <colour>".
std::string make_edit_folder(const std::string& dir) {
  fs::create_directories(dir + "/control");
  std::ofstream meta(dir + "/metadata.jsonl");
  for (int i = 0; i < 8; ++i) {
    const auto& [name, rgb] = kCaptionColours[static_cast<size_t>(i % 4)];
    auto target = torch::zeros({3, 32, 32});
    auto control = torch::zeros({3, 32, 32});
    const int64_t at = 4 + 2 * i;
    for (int ch = 0; ch < 3; ++ch) {
      target[ch].narrow(0, at, 12).narrow(1, at, 12).fill_(rgb[ch]);
    }
    control.narrow(1, at, 12).narrow(2, at, 12).fill_(0.6);
    const std::string file = "img" + std::to_string(i) + ".png";
    add_captioned_image(dir, meta, file, target, "make the square " + name);
    io::save_png(dir + "/control/" + file, io::to_uint8_images(control.unsqueeze(0))[0]);
  }
  return dir;
}

std::vector<std::string> edit_train_cmd(const std::string& data, const std::string& out,
                                        std::vector<std::string> extra) {
  std::vector<std::string> cmd = {"train",
                                  "--pretrained_model_name_or_path",
                                  kEditTiny,
                                  "--pipeline",
                                  "QwenImageEditPipeline",
                                  "--dataset",
                                  "imagefolder",
                                  "--train_data_dir",
                                  data,
                                  "--resolution",
                                  "32",
                                  "--lora",
                                  "--rank",
                                  "4",
                                  "--learning_rate",
                                  "1e-2",
                                  "--lr_scheduler",
                                  "constant",
                                  "--lr_warmup_steps",
                                  "0",
                                  "--num_validation_images",
                                  "0",
                                  "--logging_steps",
                                  "1",
                                  "--weighting_scheme",
                                  "mode",
                                  "--output_dir",
                                  out};
  cmd.insert(cmd.end(), extra.begin(), extra.end());
  return cmd;
}

TEST(QwenImageEditTrain, TwoRanksEqualOneRankResumeIsExactAndTheLoraSamples) {
  const std::string dir = make_temp_dir("q_edit_train");
  const std::string data = make_edit_folder(dir + "/data");
  auto cmd = [&](const std::string& out, const std::string& steps, const std::string& batch) {
    return edit_train_cmd(
        data, out,
        {"--max_train_steps", steps, "--checkpointing_steps", "2", "--train_batch_size", batch});
  };
  auto one = train(cmd(dir + "/one", "4", "2"), 1, 600);
  ASSERT_EQ(one.exit_code, 0) << one.log();
  EXPECT_NE(one.err.find("Qwen-Image-Edit: 8 pair(s), 1 control image(s) each, 32x32"),
            std::string::npos)
      << one.log();
  EXPECT_NE(one.err.find("text encoder released"), std::string::npos) << one.log();
  auto two = train(cmd(dir + "/two", "4", "1"), 2, 600);
  ASSERT_EQ(two.exit_code, 0) << two.log();
  const std::string file = "/pytorch_lora_weights.safetensors";
  const auto a = io::load_safetensors(dir + "/one" + file).tensors;
  const auto b = io::load_safetensors(dir + "/two" + file).tensors;
  double moved = 0;
  for (const auto& [key, t] : a) moved = std::max(moved, t.abs().max().item<double>());
  const double ranks = max_abs_diff(a, b);
  std::cout << "Qwen-Image-Edit 2 ranks vs 1 rank: " << ranks << " (weights up to " << moved
            << ")\n";
  EXPECT_LE(ranks, 1e-4 * std::max(1.0, moved));
  const auto la = losses(dir + "/one"), lb = losses(dir + "/two");
  ASSERT_EQ(la.size(), 4u);
  ASSERT_EQ(la.size(), lb.size());
  for (size_t i = 0; i < la.size(); ++i) {
    EXPECT_TRUE(std::isfinite(la[i]));
    EXPECT_NEAR(la[i], lb[i], 1e-4 * std::abs(la[i]));
  }
  auto first = train(cmd(dir + "/resumed", "2", "1"), 2, 600);
  ASSERT_EQ(first.exit_code, 0) << first.log();
  auto c = cmd(dir + "/resumed", "4", "1");
  c.insert(c.end(), {"--resume_from_checkpoint", "latest"});
  auto second = train(c, 2, 600);
  ASSERT_EQ(second.exit_code, 0) << second.log();
  EXPECT_NE(second.err.find("resumed from"), std::string::npos) << second.log();
  EXPECT_EQ(max_abs_diff(b, io::load_safetensors(dir + "/resumed" + file).tensors), 0.0);
  EXPECT_EQ(losses(dir + "/two"), losses(dir + "/resumed"));

  // The LoRA through the Edit pipeline, with a control image as the reference.
  auto base = run(edit_sample_cmd(dir, "base", "QwenImageEditPipeline",
                                  {data + "/control/img1.png"}, "make the square green", "0"),
                  {}, 300);
  ASSERT_EQ(base.exit_code, 0) << base.log();
  auto tuned_cmd = edit_sample_cmd(dir, "tuned", "QwenImageEditPipeline",
                                   {data + "/control/img1.png"}, "make the square green", "0");
  tuned_cmd.insert(tuned_cmd.end(), {"--lora", dir + "/two" + file});
  auto tuned = run(tuned_cmd, {}, 300);
  ASSERT_EQ(tuned.exit_code, 0) << tuned.log();
  const double changed = (io::load_safetensors(dir + "/tuned.safetensors").tensors.at("images") -
                          io::load_safetensors(dir + "/base.safetensors").tensors.at("images"))
                             .abs()
                             .max()
                             .item<double>();
  EXPECT_GT(changed, 1e-4);
}

TEST(QwenImageEditTrain, EditPlusFromMetadataControlListsFullFineTuneWithValidation) {
  const std::string dir = make_temp_dir("q_edit_plus");
  const std::string data = dir + "/data";
  fs::create_directories(data + "/refs");
  {
    std::ofstream meta(data + "/metadata.jsonl");
    for (int i = 0; i < 2; ++i) {
      const auto& [name, rgb] = kCaptionColours[static_cast<size_t>(i)];
      auto target = torch::full({3, 32, 32}, -0.2);
      for (int ch = 0; ch < 3; ++ch) target[ch].narrow(0, 8, 16).fill_(rgb[ch]);
      const std::string file = "t" + std::to_string(i) + ".png";
      io::save_png(data + "/" + file, io::to_uint8_images(target.unsqueeze(0))[0]);
      for (int k = 0; k < 2; ++k) {
        auto ref = torch::full({3, 24, 40}, 0.3 * k - 0.1 * i);
        io::save_png(data + "/refs/" + std::to_string(i) + "_" + std::to_string(k) + ".png",
                     io::to_uint8_images(ref.unsqueeze(0))[0]);
      }
      meta << nlohmann::json({{"file_name", file},
                              {"text", "combine them in " + name},
                              {"control_image",
                               {"refs/" + std::to_string(i) + "_0.png",
                                "refs/" + std::to_string(i) + "_1.png"}}})
                  .dump()
           << "\n";
    }
  }
  auto cmd = edit_train_cmd(data, dir + "/run",
                            {"--max_train_steps", "2", "--train_batch_size", "1",
                             "--validation_prompt", "combine them", "--num_validation_images", "1",
                             "--validation_inference_steps", "2", "--validation_steps", "2"});
  *(std::find(cmd.begin(), cmd.end(), "QwenImageEditPipeline")) = "QwenImageEditPlusPipeline";
  cmd.erase(std::find(cmd.begin(), cmd.end(), "--rank"),
            std::find(cmd.begin(), cmd.end(), "--rank") + 2);
  cmd.erase(std::find(cmd.begin(), cmd.end(), "--lora"));
  auto r = train(cmd, 1, 900);
  ASSERT_EQ(r.exit_code, 0) << r.log();
  EXPECT_NE(r.err.find("2 pair(s), 2 control image(s) each"), std::string::npos) << r.log();
  const auto index = nlohmann::json::parse(std::ifstream(dir + "/run/model_index.json"));
  EXPECT_EQ(index.at("_class_name"), "QwenImageEditPlusPipeline");
  EXPECT_TRUE(fs::exists(dir + "/run/transformer/config.json"));
  // The validation render ran the Edit Plus pipeline; the card names the run's pipeline.
  EXPECT_TRUE(fs::exists(dir + "/run/image_0.png")) << r.log();
  std::ifstream card_file(dir + "/run/README.md");
  const std::string card((std::istreambuf_iterator<char>(card_file)),
                         std::istreambuf_iterator<char>());
  EXPECT_NE(card.find("QwenImageEditPlusPipeline"), std::string::npos) << card;

  // A control image that is missing: one line naming it.
  fs::remove(data + "/refs/1_1.png");
  auto bad = train(edit_train_cmd(data, dir + "/bad", {"--max_train_steps", "1"}), 1, 300);
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.err.find("1_1.png: no such control image"), std::string::npos) << bad.log();
}

TEST(QwenImageEditTrain, FullFineTuneUnderZero3EqualsUnshardedAndLoraInBf16OnAnInt8Base) {
  const std::string dir = make_temp_dir("q_edit_shard");
  const std::string data = make_edit_folder(dir + "/data");
  auto full = [&](const std::string& out, const std::string& strategy) {
    auto c = edit_train_cmd(data, out,
                            {"--max_train_steps", "3", "--sharding_strategy", strategy,
                             "--learning_rate", "1e-4", "--train_batch_size", "2"});
    c.erase(std::find(c.begin(), c.end(), "--rank"), std::find(c.begin(), c.end(), "--rank") + 2);
    c.erase(std::find(c.begin(), c.end(), "--lora"));
    return c;
  };
  auto plain = train(full(dir + "/plain", "NO_SHARD"), 2, 600);
  ASSERT_EQ(plain.exit_code, 0) << plain.log();
  auto sharded = train(full(dir + "/sharded", "FULL_SHARD"), 2, 600);
  ASSERT_EQ(sharded.exit_code, 0) << sharded.log();
  const std::string weights = "/transformer/diffusion_pytorch_model.safetensors";
  const auto a = io::load_safetensors(dir + "/sharded" + weights).tensors;
  const auto b = io::load_safetensors(dir + "/plain" + weights).tensors;
  const auto start = io::load_safetensors(kEditTiny + weights).tensors;
  double apart = 0, moved = 0;
  for (const auto& [key, t] : b) {
    apart += (a.at(key).to(torch::kFloat64) - t.to(torch::kFloat64)).pow(2).sum().item<double>();
    moved +=
        (t.to(torch::kFloat64) - start.at(key).to(torch::kFloat64)).pow(2).sum().item<double>();
  }
  const double rel = std::sqrt(apart / moved);
  std::cout << "Qwen-Image-Edit FULL_SHARD vs NO_SHARD: relative " << rel << "\n";
  EXPECT_GT(moved, 0);
  EXPECT_LE(rel, 5e-3);
  const auto index = nlohmann::json::parse(std::ifstream(dir + "/sharded/model_index.json"));
  EXPECT_EQ(index.at("_class_name"), "QwenImageEditPipeline");

  auto lora = train(edit_train_cmd(data, dir + "/int8",
                                   {"--max_train_steps", "2", "--train_batch_size", "1",
                                    "--mixed_precision", "bf16", "--base_weights_dtype", "int8",
                                    "--gradient_checkpointing", "--lora_format", "comfyui"}),
                    2, 600);
  ASSERT_EQ(lora.exit_code, 0) << lora.log();
  EXPECT_NE(lora.err.find("frozen base in int8"), std::string::npos) << lora.log();
  for (double l : losses(dir + "/int8")) EXPECT_TRUE(std::isfinite(l));
  EXPECT_TRUE(
      io::load_safetensors(dir + "/int8/pytorch_lora_weights.safetensors")
          .tensors.count("diffusion_model.transformer_blocks.0.attn.to_q.lora_down.weight"));
}

}  // namespace
}  // namespace difftrain::testing
