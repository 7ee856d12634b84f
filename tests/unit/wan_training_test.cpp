// Wan training against one step of musubi-tuner's Wan trainer restated with Diffusers' modules
// (tests/golden/wan/train_step, make_train_step.py): the VAE posterior's mode normalised by
// latents_mean / latents_std, the image-to-video condition from each clip's first frame, the
// noisy input and the timestep the model is given (1000 t + 1), musubi-tuner's --min_timestep /
// --max_timestep range, the prediction, the loss and the LoRA (musubi-tuner's targets) and full
// fine-tuning gradients; and the video data's clip extraction as musubi-tuner's dataset cuts it.
#include "../../src/families/video_data.h"
#include "../../src/families/wan/wan_pipeline.h"
#include "../../src/families/wan/wan_task.h"

#include "difftrain/core/error.h"
#include "difftrain/diffusion/flow_match_objective.h"
#include "difftrain/io/image.h"
#include "difftrain/io/safetensors.h"
#include "difftrain/io/video.h"
#include "difftrain/models/lora/lora_training.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>

namespace wan_training_test {

using difftrain::diffusion::FlowMatchObjective;
using difftrain::diffusion::FlowMatchOptions;
using difftrain::diffusion::NoisedBatch;
using difftrain::test::max_abs;
using difftrain::test::read_json;
namespace dm = difftrain::models;
namespace fam = difftrain::families;
namespace fs = std::filesystem;

const std::string kWanDir = difftrain::test::kGoldenDir + "wan/";
const std::string kStep = kWanDir + "train_step/";

const difftrain::io::TensorMap& w_step() {
  static const auto t = difftrain::io::load_safetensors(kStep + "step.safetensors").tensors;
  return t;
}

// The task's objective: FlowMatchDiscreteScheduler tables of the shift (unused by the continuous
// samplings), here "uniform" so the fixture's t can be fed as the draw.
FlowMatchObjective w_objective(double min_t = 0, double max_t = 1000) {
  FlowMatchOptions o;
  o.timestep_sampling = "uniform";
  o.min_timestep = min_t;
  o.max_timestep = max_t;
  const nlohmann::json tables = {{"_class_name", "FlowMatchEulerDiscreteScheduler"},
                                 {"num_train_timesteps", 1000},
                                 {"shift", 3.0}};
  return FlowMatchObjective(tables, "tables", o);
}

// Our "<module with slashes>.lora_A.weight" is PEFT's "<module>.lora_A.default.weight".
std::string peft_name(std::string key) {
  for (auto& ch : key) ch = ch == '/' ? '.' : ch;
  return key.substr(0, key.size() - std::string(".weight").size()) + ".default.weight";
}

TEST(WanTraining, LatentsConditionNoisyInputAndTimestepsMatchMusubiTuner) {
  const auto& t = w_step();
  const auto cases = read_json(kStep + "cases.json").at("cases");
  auto vae = dm::load_autoencoder_kl_qwen_image(kWanDir + "tiny_wan/vae");
  torch::NoGradGuard no_grad;
  for (const std::string c : {"lora_clip", "lora_images", "lora_range", "i2v_lora"}) {
    SCOPED_TRACE(c);
    const auto px = t.at(c + ".pixel_values");
    const auto mode = vae->encode(px).mode();
    EXPECT_LE(max_abs(mode, t.at(c + ".latents_mean_posterior")), 2e-5);
    const auto latents = vae->normalize_latents(mode);
    EXPECT_LE(max_abs(latents, t.at(c + ".latents")), 5e-5);
    const auto& args = cases.at(c).at("arguments");
    const double lo = args.value("min_timestep", 0.0), hi = args.value("max_timestep", 1000.0);
    const auto obj = w_objective(lo, hi);
    // The draw before the range: t = u * (hi - lo) / 1000 + lo / 1000.
    const auto u = (t.at(c + ".t") - lo / 1000.0) / ((hi - lo) / 1000.0);
    const NoisedBatch b = obj.from_draws(t.at(c + ".latents"), t.at(c + ".noise"), u);
    EXPECT_LE(max_abs(b.model_input, t.at(c + ".noisy_model_input")), 2e-6);
    EXPECT_LE(max_abs(b.timesteps + 1, t.at(c + ".timesteps")), 2e-4);  // musubi's 1000 t + 1
    EXPECT_LE(max_abs(b.target, t.at(c + ".target")), 1e-6);
    if (c == "i2v_lora") {
      const auto y =
          fam::wan::wan_image_condition(vae, px.narrow(2, 0, 1), torch::Tensor(), px.size(2));
      EXPECT_LE(max_abs(y, t.at(c + ".y")), 5e-5);
    }
  }
}

TEST(WanTraining, LoraAndFullFineTuningGradientsMatchTheReferenceStep) {
  const auto& t = w_step();
  const auto cases = read_json(kStep + "cases.json").at("cases");
  for (const std::string c : {"lora_clip", "lora_images", "lora_range", "i2v_lora"}) {
    SCOPED_TRACE(c);
    const auto& args = cases.at(c).at("arguments");
    const bool i2v = args.at("i2v").get<bool>();
    auto model =
        dm::load_wan_transformer(kWanDir + (i2v ? "tiny_wan_i2v" : "tiny_wan") + "/transformer");
    for (auto& p : model->parameters()) p.set_requires_grad(false);
    dm::LoraConfig lc;
    lc.rank = 4;
    lc.alpha = 4;
    lc.target_modules = fam::wan::default_wan_lora_targets(false);
    dm::LoraLayers lora(*model, lc);
    EXPECT_EQ(lora->module_names().size(), 20u);  // 2 blocks x 10 Linears, musubi-tuner's set
    {
      torch::NoGradGuard no_grad;
      for (auto& p : lora->named_parameters()) {
        p.value().copy_(t.at(c + ".lora." + peft_name(p.key())));
      }
    }
    model->train();
    const auto pred =
        model->forward(t.at(c + ".model_input"), t.at(c + ".timesteps"), t.at(c + ".context"));
    const auto loss = (pred - t.at(c + ".target")).pow(2).mean();
    loss.backward();
    const double pred_diff = max_abs(pred, t.at(c + ".model_pred"));
    double grad_diff = 0, grad_max = 0;
    for (const auto& p : lora->named_parameters()) {
      ASSERT_TRUE(p.value().grad().defined()) << p.key();
      const auto& ref = t.at(c + ".grad." + peft_name(p.key()));
      grad_diff = std::max(grad_diff, max_abs(p.value().grad(), ref));
      grad_max = std::max(grad_max, ref.abs().max().item<double>());
    }
    std::printf("%s: model_pred %.3g, loss %.3g, LoRA gradients %.3g (of %.3g)\n", c.c_str(),
                pred_diff, max_abs(loss, t.at(c + ".loss")), grad_diff, grad_max);
    EXPECT_LE(pred_diff, 1e-5);
    EXPECT_LE(max_abs(loss, t.at(c + ".loss")), 1e-5);
    EXPECT_LE(grad_diff, 1e-4 * std::max(grad_max, 1e-3));
  }
  // Full fine-tuning: every parameter's gradient.
  auto model = dm::load_wan_transformer(kWanDir + "tiny_wan/transformer");
  model->train();
  const auto pred =
      model->forward(t.at("full.model_input"), t.at("full.timesteps"), t.at("full.context"));
  (pred - t.at("full.target")).pow(2).mean().backward();
  double diff = 0, biggest = 0;
  size_t checked = 0;
  for (const auto& p : model->named_parameters()) {
    const auto it = t.find("full.grad." + p.key());
    ASSERT_NE(it, t.end()) << p.key();
    ASSERT_TRUE(p.value().grad().defined()) << p.key();
    diff = std::max(diff, max_abs(p.value().grad(), it->second));
    biggest = std::max(biggest, it->second.abs().max().item<double>());
    ++checked;
  }
  std::printf("full fine-tune: %zu gradients, max abs diff %.3g (of %.3g)\n", checked, diff,
              biggest);
  EXPECT_EQ(checked, 69u);
  EXPECT_LE(diff, 1e-5 * std::max(1.0, biggest));
}

TEST(WanTraining, TimestepRangeIsRefusedWithTheTablesAndOutOfOrder) {
  FlowMatchOptions o;
  o.timestep_sampling = "sigma";
  o.min_timestep = 100;
  const nlohmann::json tables = {{"_class_name", "FlowMatchEulerDiscreteScheduler"},
                                 {"num_train_timesteps", 1000}};
  EXPECT_THROW(FlowMatchObjective(tables, "t", o), difftrain::Error);
  o.timestep_sampling = "shift";
  o.min_timestep = 900;
  o.max_timestep = 100;
  EXPECT_THROW(FlowMatchObjective(tables, "t", o), difftrain::Error);
}

// musubi-tuner's frame extraction (image_video_dataset.py), by hand.
TEST(WanVideoData, ClipsAreCutAsMusubiTunerCutsThem) {
  using Clips = std::vector<std::pair<int64_t, int64_t>>;
  fam::VideoDataOptions v;
  v.target_frames = {1, 7, 9};  // 7 → 5 (1 + 4k, rounded down)
  v.frame_extraction = "head";
  EXPECT_EQ(fam::extract_clips(20, v), (Clips{{0, 1}, {0, 5}, {0, 9}}));
  EXPECT_EQ(fam::extract_clips(6, v), (Clips{{0, 1}, {0, 5}}));
  v.target_frames = {5};
  v.frame_extraction = "chunk";
  EXPECT_EQ(fam::extract_clips(17, v), (Clips{{0, 5}, {5, 5}, {10, 5}}));
  v.frame_extraction = "slide";
  v.frame_stride = 4;
  EXPECT_EQ(fam::extract_clips(14, v), (Clips{{0, 5}, {4, 5}, {8, 5}}));
  v.frame_extraction = "uniform";
  v.frame_sample = 4;
  // np.linspace(0, 20 - 5, 4, dtype=int) = [0, 5, 10, 15]; (0, 13, 3) → [0, 6, 13]
  EXPECT_EQ(fam::extract_clips(20, v), (Clips{{0, 5}, {5, 5}, {10, 5}, {15, 5}}));
  v.frame_sample = 3;
  EXPECT_EQ(fam::extract_clips(18, v), (Clips{{0, 5}, {6, 5}, {13, 5}}));
  v.frame_sample = 1;  // uniform with one sample is head
  EXPECT_EQ(fam::extract_clips(18, v), (Clips{{0, 5}}));
  v.frame_extraction = "full";
  v.max_frames = 129;
  EXPECT_EQ(fam::extract_clips(40, v), (Clips{{0, 37}}));
  v.max_frames = 10;
  EXPECT_EQ(fam::extract_clips(40, v), (Clips{{0, 9}}));
  v.frame_extraction = "zigzag";
  EXPECT_THROW(fam::extract_clips(40, v), difftrain::Error);
}

TEST(WanVideoData, ClipPixelsCoverThenCropTheCentre) {
  // A 20 x 40 clip to 16 x 16: scale max(16/40, 16/20) = 0.8 → 16 x 32 (int(x + 0.5)), crop
  // columns 8..24.
  auto frames = torch::zeros({2, 20, 40, 3}, torch::kUInt8);
  frames.narrow(2, 0, 20).fill_(255);  // the left half white
  const auto px = fam::clip_pixels(frames, 16, 16);
  ASSERT_EQ(px.sizes(), (std::vector<int64_t>{3, 2, 16, 16}));
  EXPECT_NEAR(px.min().item<double>(), -1.0, 1e-6);
  EXPECT_NEAR(px.max().item<double>(), 1.0, 1e-6);
  // The centre crop straddles the edge: white on the left half, black on the right.
  EXPECT_GT(px.select(3, 2).mean().item<double>(), 0.9);
  EXPECT_LT(px.select(3, 13).mean().item<double>(), -0.9);
}

TEST(WanVideoData, MediaListingCaptionsAndRefusals) {
  const std::string dir = difftrain::test::temp_dir("wan_media");
  auto write = [&](const std::string& name, const std::string& text) {
    fs::create_directories(fs::path(dir + "/" + name).parent_path());
    std::ofstream(dir + "/" + name) << text;
  };
  difftrain::io::save_png(dir + "/b.png", torch::zeros({8, 8, 3}, torch::kUInt8));
  write("b.txt", "  a still\n  with two lines \n");
  fs::create_directories(dir + "/frames/clip1");
  for (int i = 0; i < 3; ++i) {
    difftrain::io::save_png(dir + "/frames/clip1/" + std::to_string(i) + ".png",
                            torch::zeros({8, 8, 3}, torch::kUInt8));
  }
  write("frames/clip1.txt", "frames caption");
  difftrain::train::DataOptions d;
  d.train_data_dir = dir;
  auto media = fam::list_media_files(d, "");
  ASSERT_EQ(media.size(), 2u);
  EXPECT_EQ(media[0].caption, "a still\n  with two lines");  // whole file, stripped
  EXPECT_EQ(media[0].kind, fam::MediaFile::Kind::kImage);
  EXPECT_EQ(media[1].kind, fam::MediaFile::Kind::kFrames);
  EXPECT_EQ(media[1].caption, "frames caption");
  EXPECT_EQ(fam::list_media_files(d, "sks")[1].caption, "sks");
  // metadata.jsonl's video column wins over the scan.
  write("metadata.jsonl",
        "{\"video\": \"frames/clip1\", \"text\": \"from metadata\"}\n\n"
        "{\"file_name\": \"b.png\"}\n");
  media = fam::list_media_files(d, "");
  ASSERT_EQ(media.size(), 2u);
  EXPECT_EQ(media[0].caption, "from metadata");
  EXPECT_EQ(media[1].caption, "a still\n  with two lines");
  auto refuses = [&](const std::string& metadata, const std::string& part) {
    write("metadata.jsonl", metadata);
    try {
      fam::list_media_files(d, "");
      ADD_FAILURE() << "no error for " << metadata;
    } catch (const difftrain::Error& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  refuses("{\"video\": \"../x.mp4\"}\n", "lies outside the folder");
  refuses("{\"video\": \"missing.mp4\"}\n", "does not exist");
  refuses("not json\n", "line 1: not a JSON object");
  write("c.txt.bak", "");
  refuses("{\"video\": \"c.txt.bak\"}\n", "is not an image, a video");
  fs::remove(dir + "/metadata.jsonl");
  fs::remove(dir + "/b.txt");
  try {
    fam::list_media_files(d, "");
    ADD_FAILURE() << "no error for a file without a caption";
  } catch (const difftrain::Error& e) {
    EXPECT_NE(std::string(e.what()).find("b.png: no caption"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

}  // namespace wan_training_test
