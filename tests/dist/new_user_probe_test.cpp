// Issue 56, a demanding new user's FLUX.1 and LoRA probe, end to end through the CLI on the tiny
// fixtures: a run starts from its family's Diffusers script defaults and says so; kohya datasets
// (repeat folders, WebP, caption files) and what is skipped or cut is said once; a finished run
// survives --overwrite_output_dir with bad inputs; a LoRA for another family is refused; the
// labels of sample, lora merge and lora convert say what the files are.

#include "train_util.h"

#include "difftrain/io/atomic_file.h"
#include "source_dir.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace difftrain::testing {
namespace {

namespace fs = std::filesystem;

const std::string kGolden = std::string(difftrain_test::source_dir()) + "/tests/golden";
const std::string kFlux = kGolden + "/flux/tiny_flux";
const std::string kFluxLora = kGolden + "/flux/tiny_flux_lora/pytorch_lora_weights.safetensors";
const std::string kSdxlLora = kGolden + "/sdxl/tiny_sdxl_lora/pytorch_lora_weights.safetensors";

#define EXPECT_LOG_HAS(result, part)                                                    \
  EXPECT_NE((result).err.find(part), std::string::npos) << "lacks '" << (part) << "'\n" \
                                                        << (result).log()

// A solid-colour 32 x 32 PNG (r, g, b in [-1, 1]) at `path`.
void save_colour(const std::string& path, float r, float g, float b) {
  auto img = torch::empty({1, 3, 32, 32});
  img[0][0].fill_(r), img[0][1].fill_(g), img[0][2].fill_(b);
  io::save_png(path, io::to_uint8_images((img + 1) / 2)[0]);
}

void write_caption(const std::string& path, const std::string& text) {
  std::ofstream(path) << text << "\n";
}

// kohya's layout: 2_sks/ (a.webp with a 300-word caption, b.png without a caption: "sks"),
// 1_other/ (c.png, captioned), and what is not trained on: stray.png outside the repeat folders
// and orphan.txt with no image. 2 x 2 + 1 = 5 examples per epoch.
std::string kohya_folder(const std::string& dir) {
  fs::create_directories(dir + "/2_sks");
  fs::create_directories(dir + "/1_other");
  save_colour(dir + "/2_sks/a.png", 1, -1, -1);  // then as WebP
  io::write_file_atomic(dir + "/2_sks/a.webp",
                        io::encode_webp_lossless(io::load_image(dir + "/2_sks/a.png")));
  fs::remove(dir + "/2_sks/a.png");
  std::string long_caption = "sks";
  for (int i = 0; i < 300; ++i) long_caption += " word" + std::to_string(i);
  write_caption(dir + "/2_sks/a.txt", long_caption);
  save_colour(dir + "/2_sks/b.png", -1, 1, -1);
  save_colour(dir + "/1_other/c.png", -1, -1, 1);
  write_caption(dir + "/1_other/c.txt", "a blue square");
  save_colour(dir + "/stray.png", 1, 1, -1);
  write_caption(dir + "/orphan.txt", "a caption whose image is missing");
  return dir;
}

std::vector<std::string> flux_lora_cmd(const std::string& data, const std::string& out,
                                       std::vector<std::string> extra) {
  std::vector<std::string> flags = {
      "--lora", "--resolution",      "32", "--center_crop",   "--max_sequence_length",
      "16",     "--max_train_steps", "2",  "--logging_steps", "1"};
  flags.insert(flags.end(), extra.begin(), extra.end());
  return folder_train_cmd(kFlux, data, out, flags);
}

// The configuration a run saved with its checkpoint `step`.
nlohmann::json run_config(const std::string& out, int step) {
  return nlohmann::json::parse(
             io::read_file(out + "/checkpoint-" + std::to_string(step) + "/trainer_state.json"))
      .at("config");
}

// Points 2, 5, 6, 7, 8 and 1: one FLUX.1 LoRA run on a kohya folder, then an overwrite that
// fails on its inputs and leaves the run as it was.
TEST(NewUserProbe, FluxLoraRunStartsFromDiffusersDefaultsOnAKohyaFolder) {
  const std::string dir = make_temp_dir("probe_flux");
  const std::string data = kohya_folder(dir + "/data");
  const std::string out = dir + "/run";
  auto r = train(flux_lora_cmd(data, out, {"--train_batch_size", "8"}));
  ASSERT_EQ(r.exit_code, 0) << r.log();
  EXPECT_LOG_HAS(r, "defaults: Diffusers' train_dreambooth_lora_flux.py");
  // kohya's repeats, the examples counted after them, and what was skipped, each said once.
  EXPECT_LOG_HAS(r,
                 "3 image(s) in kohya repeat folders 1_other (1 x 1), 2_sks (2 x 2): 5 "
                 "examples per epoch");
  EXPECT_LOG_HAS(r, "examples 5 |");
  EXPECT_LOG_HAS(r,
                 "skipped 1 image(s) outside the kohya <repeats>_<name> folders (first: "
                 "stray.png)");
  EXPECT_LOG_HAS(r,
                 "skipped 1 file(s): 1 .txt file(s) with no image of the same name (first: "
                 "orphan.txt)");
  // The 300-word caption is cut by both encoders: said once, with the tokens cut.
  EXPECT_LOG_HAS(r, "1 of 3 caption(s) are longer than text_encoder's 75 tokens");
  EXPECT_LOG_HAS(r, "1 of 3 caption(s) are longer than text_encoder_2's 15 tokens");
  // A global batch of 8 from 5 examples: warned, and samples/s counts 5 per update.
  EXPECT_LOG_HAS(r, "the dataset has 5 example(s), fewer than one global batch of 8");
  EXPECT_NE(r.err.find("LoRA weights (diffusers format)"), std::string::npos) << r.log();

  // What ran: train_dreambooth_lora_flux.py's defaults where nothing was given, no EMA.
  const auto c = run_config(out, 2);
  EXPECT_DOUBLE_EQ(c.at("learning_rate").get<double>(), 1e-4);
  EXPECT_EQ(c.at("lr_scheduler"), "constant");
  EXPECT_EQ(c.at("lr_warmup_steps"), 500);
  EXPECT_DOUBLE_EQ(c.at("adam_beta1").get<double>(), 0.9);
  EXPECT_DOUBLE_EQ(c.at("adam_weight_decay").get<double>(), 1e-4);
  EXPECT_EQ(c.at("use_ema"), false);
  EXPECT_EQ(c.at("train_batch_size"), 8);  // given
  EXPECT_EQ(c.at("lora_target_modules").size(), 12u);
  EXPECT_FALSE(fs::exists(out + "/checkpoint-2/ema")) << "no EMA weights without --use_ema";
  // The card's resolved configuration shows what trained: the 12 targets, no DDPM objective.
  const std::string card = io::read_file(out + "/README.md");
  EXPECT_NE(card.find("\"attn.add_k_proj\""), std::string::npos);
  EXPECT_NE(card.find("\"weighting_scheme\""), std::string::npos);
  for (const char* gone :
       {"\"prediction_type\"", "\"validation_scheduler\"", "\"ema_max_decay\""}) {
    EXPECT_EQ(card.find(gone), std::string::npos) << gone;
  }

  // Point 1: --overwrite_output_dir with a folder whose image has no caption: refused before the
  // finished run is touched.
  const std::string bare = dir + "/bare";
  fs::create_directories(bare);
  save_colour(bare + "/x.png", 1, 1, 1);
  auto again = train(flux_lora_cmd(bare, out, {"--overwrite_output_dir"}));
  EXPECT_NE(again.exit_code, 0) << again.log();
  EXPECT_LOG_HAS(again, "x.png");
  EXPECT_EQ(again.err.find("clearing"), std::string::npos) << again.log();
  EXPECT_TRUE(fs::exists(out + "/pytorch_lora_weights.safetensors")) << again.log();
  EXPECT_TRUE(fs::exists(out + "/README.md")) << again.log();
  EXPECT_TRUE(fs::exists(out + "/checkpoint-2/trainer_state.json")) << again.log();

  // Point 10: the export is named as it was written.
  auto s = run(
      {kDifftrain, "sample", "--model", kFlux, "--lora", out + "/pytorch_lora_weights.safetensors",
       "--prompt", "sks", "--height", "32", "--width", "32", "--num_inference_steps", "2",
       "--max_sequence_length", "16", "--output", dir + "/s.png"},
      {}, 120);
  ASSERT_EQ(s.exit_code, 0) << s.log();
  EXPECT_LOG_HAS(s, "(diffusers format): merged into");
}

// Points 4 and 10: a LoRA for another family is refused by sample and lora merge (no output
// written); lora convert refuses to overwrite its input and counts targets by what they adapt;
// estimate-memory feeds FLUX.1 train's 512 T5 tokens; a long prompt's cut is said.
TEST(NewUserProbe, WrongFamilyLorasAndMisleadingLabels) {
  const std::string dir = make_temp_dir("probe_lora");
  auto sample =
      run({kDifftrain, "sample", "--model", kFlux, "--lora", kSdxlLora, "--prompt", "a", "--height",
           "32", "--width", "32", "--num_inference_steps", "1", "--output", dir + "/s.png"},
          {}, 120);
  EXPECT_NE(sample.exit_code, 0) << sample.log();
  EXPECT_LOG_HAS(sample, "has no transformer targets");
  EXPECT_LOG_HAS(sample, "it is a sdxl LoRA, not one for");
  EXPECT_FALSE(fs::exists(dir + "/s.png"));
  auto merge = run({kDifftrain, "lora", "merge", "--model", kFlux, "--lora", kSdxlLora, "--output",
                    dir + "/merged"},
                   {}, 120);
  EXPECT_NE(merge.exit_code, 0) << merge.log();
  EXPECT_LOG_HAS(merge, "it is a sdxl LoRA");
  EXPECT_FALSE(fs::exists(dir + "/merged"));
  // The FLUX LoRA merged into FLUX.1: every weight file written is named.
  auto ok = run({kDifftrain, "lora", "merge", "--model", kFlux, "--lora", kFluxLora, "--output",
                 dir + "/merged"},
                {}, 120);
  ASSERT_EQ(ok.exit_code, 0) << ok.log();
  EXPECT_LOG_HAS(ok, "(diffusers format)");
  EXPECT_LOG_HAS(ok, "wrote 2 merged weight file(s): " + dir +
                         "/merged/transformer/diffusion_pytorch_model.safetensors, ");

  // A sharded transformer: every shard the merge rewrites is named (the first only, before).
  const std::string sharded = dir + "/sharded";
  fs::copy(kFlux, sharded, fs::copy_options::recursive);
  const std::string tdir = sharded + "/transformer";
  const auto all = io::load_safetensors(tdir + "/diffusion_pytorch_model.safetensors").tensors;
  fs::remove(tdir + "/diffusion_pytorch_model.safetensors");
  std::vector<io::TensorMap> shards(2);
  nlohmann::json weight_map = nlohmann::json::object();
  for (const auto& [name, t] : all) {
    // The double blocks in the second shard, the rest (single blocks too) in the first: the
    // LoRA adapts modules of both.
    const size_t s = name.rfind("transformer_blocks.", 0) == 0 ? 1 : 0;
    shards[s][name] = t;
    weight_map[name] =
        "diffusion_pytorch_model-0000" + std::to_string(s + 1) + "-of-00002.safetensors";
  }
  for (size_t s = 0; s < 2; ++s) {
    io::save_safetensors(
        tdir + "/diffusion_pytorch_model-0000" + std::to_string(s + 1) + "-of-00002.safetensors",
        shards[s]);
  }
  io::write_file_atomic(
      tdir + "/diffusion_pytorch_model.safetensors.index.json",
      nlohmann::json{{"metadata", {{"total_size", 0}}}, {"weight_map", weight_map}}.dump());
  auto shard_merge = run({kDifftrain, "lora", "merge", "--model", sharded, "--lora", kFluxLora,
                          "--output", dir + "/sharded-merged"},
                         {}, 120);
  ASSERT_EQ(shard_merge.exit_code, 0) << shard_merge.log();
  EXPECT_LOG_HAS(shard_merge, "wrote 3 merged weight file(s): " + dir +
                                  "/sharded-merged/transformer/"
                                  "diffusion_pytorch_model-00001-of-00002.safetensors, " +
                                  dir +
                                  "/sharded-merged/transformer/"
                                  "diffusion_pytorch_model-00002-of-00002.safetensors, " +
                                  dir + "/sharded-merged/text_encoder/model.safetensors");

  const std::string copy = dir + "/copy.safetensors";
  fs::copy_file(kFluxLora, copy);
  auto same = run(
      {kDifftrain, "lora", "convert", "--input", copy, "--output", copy, "--to", "kohya"}, {}, 60);
  EXPECT_NE(same.exit_code, 0) << same.log();
  EXPECT_LOG_HAS(same, "is the --input file");
  auto conv = run({kDifftrain, "lora", "convert", "--input", copy, "--output",
                   dir + "/kohya.safetensors", "--to", "kohya", "--model", kFlux},
                  {}, 60);
  ASSERT_EQ(conv.exit_code, 0) << conv.log();
  EXPECT_LOG_HAS(conv, "(diffusers) -> ");
  EXPECT_LOG_HAS(conv, "transformer targets");
  EXPECT_EQ(conv.err.find(" unet"), std::string::npos) << conv.log();

  auto est = run({kDifftrain, "estimate-memory", "--model", kFlux}, {}, 120);
  ASSERT_EQ(est.exit_code, 0) << est.log();
  EXPECT_LOG_HAS(est, "latents and 512 text tokens");

  std::string prompt = "a photo";
  for (int i = 0; i < 300; ++i) prompt += " of a cat";
  auto cut = run({kDifftrain, "sample", "--model", kFlux, "--prompt", prompt, "--height", "32",
                  "--width", "32", "--num_inference_steps", "1", "--max_sequence_length", "8",
                  "--output", dir + "/cut.png"},
                 {}, 120);
  ASSERT_EQ(cut.exit_code, 0) << cut.log();
  EXPECT_LOG_HAS(cut, "1 of 1 prompt(s) are longer than text_encoder's 75 tokens");
  EXPECT_LOG_HAS(cut, "1 of 1 prompt(s) are longer than text_encoder_2's 7 tokens");
}

// Point 9: other tools' flags name difftrain's, and kohya's --resolution W,H is read.
TEST(NewUserProbe, OtherToolsFlagsAreNamedAndKohyaResolutionIsRead) {
  const std::string dir = make_temp_dir("probe_flags");
  auto dim = train({"train", "--pretrained_model_name_or_path", kFlux, "--network_dim", "16"});
  EXPECT_NE(dim.exit_code, 0);
  EXPECT_LOG_HAS(dim,
                 "\"network_dim\" is another tool's option (kohya sd-scripts, SimpleTuner); "
                 "difftrain's is --rank");
  const std::string data = kohya_folder(dir + "/data");
  auto wide = train(
      flux_lora_cmd(data, dir + "/wide", {"--resolution", "48,32", "--max_train_steps", "1"}));
  ASSERT_EQ(wide.exit_code, 0) << wide.log();
  EXPECT_EQ(run_config(dir + "/wide", 1).at("resolution"), "48,32");
  EXPECT_NE(io::read_file(dir + "/wide/README.md").find("48 x 32 (width x height)"),
            std::string::npos);
}

}  // namespace
}  // namespace difftrain::testing
