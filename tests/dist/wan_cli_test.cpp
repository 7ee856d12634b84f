// Wan through the command line on the tiny fixture folders (tests/golden/wan): `difftrain sample`
// gives Diffusers' frames (the t2v case of make_pipeline.py: CFG, 5 frames) in --save_tensors'
// `frames` and a PNG strip of the frames, Wan 2.2 A14B's two experts with --guidance_scale_2;
// `difftrain forward` gives WanTransformer3DModel's output on Diffusers' argument names; what is
// not there yet (LoRA, training) is refused in one line.
#include "train_util.h"

#include "difftrain/io/image.h"
#include "difftrain/io/safetensors.h"
#include "difftrain/io/video.h"
#include "source_dir.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <string>

namespace difftrain::testing {
namespace {

namespace fs = std::filesystem;

const std::string kWanGolden = std::string(difftrain_test::source_dir()) + "/tests/golden/wan";

double wan_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kFloat64) - b.to(torch::kFloat64)).abs().max().item<double>();
}

TEST(WanCli, SampleWritesDiffusersFramesAndTwoExpertsRun) {
  const std::string dir = make_temp_dir("wan_cli");
  const auto e2e = io::load_safetensors(kWanGolden + "/tiny_wan/sample_e2e.safetensors").tensors;
  auto r = run({kDifftrain,
                "sample",
                "--model",
                kWanGolden + "/tiny_wan",
                "--prompt",
                "a red car drives in the city street",
                "--guidance_scale",
                "5",
                "--height",
                "32",
                "--width",
                "48",
                "--num_frames",
                "5",
                "--num_inference_steps",
                "3",
                "--seed",
                "0",
                "--output",
                dir + "/t2v.png",
                "--save_tensors",
                dir + "/t2v.safetensors"},
               {}, 300);
  ASSERT_EQ(r.exit_code, 0) << r.log();
  EXPECT_NE(r.err.find("WanPipeline) on cpu, 3 steps, guidance 5, 1 prompt(s) x 1 video(s), 5 "
                       "frames of 32x48"),
            std::string::npos)
      << r.log();
  const auto t = io::load_safetensors(dir + "/t2v.safetensors").tensors;
  ASSERT_TRUE(t.count("frames"));
  EXPECT_LT(wan_diff(t.at("frames"), e2e.at("t2v.frames")), 1e-4);
  // The PNG: one row of the 5 frames.
  const auto png = io::load_image(dir + "/t2v.png");
  EXPECT_GT(png.size(1), 5 * 48);

  auto a14b = run({kDifftrain,
                   "sample",
                   "--model",
                   kWanGolden + "/tiny_wan_a14b",
                   "--prompt",
                   "a red car drives in the city street",
                   "--guidance_scale",
                   "4",
                   "--guidance_scale_2",
                   "3",
                   "--height",
                   "32",
                   "--width",
                   "48",
                   "--num_frames",
                   "5",
                   "--num_inference_steps",
                   "4",
                   "--seed",
                   "0",
                   "--output",
                   dir + "/a.png",
                   "--save_tensors",
                   dir + "/a.safetensors"},
                  {}, 300);
  ASSERT_EQ(a14b.exit_code, 0) << a14b.log();
  EXPECT_NE(a14b.err.find("two experts"), std::string::npos) << a14b.log();
  EXPECT_LT(wan_diff(io::load_safetensors(dir + "/a.safetensors").tensors.at("frames"),
                     e2e.at("a14b.frames")),
            1e-4);

  // Sizes Diffusers refuses, and what is still to come, in one line.
  auto odd =
      run({kDifftrain, "sample", "--model", kWanGolden + "/tiny_wan", "--prompt", "a", "--height",
           "40", "--width", "48", "--num_inference_steps", "1", "--output", dir + "/o.png"},
          {}, 120);
  EXPECT_NE(odd.exit_code, 0);
  EXPECT_NE(odd.err.find("divisible by 16"), std::string::npos) << odd.log();
}

TEST(WanCli, SampleWritesAVideoFileAndFramePngs) {
  ASSERT_TRUE(io::video_supported()) << "built without FFmpeg: run scripts/setup and rebuild";
  const std::string dir = make_temp_dir("wan_video");
  const auto e2e = io::load_safetensors(kWanGolden + "/tiny_wan/sample_e2e.safetensors").tensors;
  const auto want = e2e.at("t2v.frames")[0];  // [F, H, W, 3] in [0, 1]
  auto r = run({kDifftrain,
                "sample",
                "--model",
                kWanGolden + "/tiny_wan",
                "--prompt",
                "a red car drives in the city street",
                "--guidance_scale",
                "5",
                "--height",
                "32",
                "--width",
                "48",
                "--num_frames",
                "5",
                "--num_inference_steps",
                "3",
                "--seed",
                "0",
                "--output",
                dir + "/t2v.mp4",
                "--save_frames",
                dir + "/frames"},
               {}, 300);
  ASSERT_EQ(r.exit_code, 0) << r.log();
  EXPECT_NE(r.err.find("t2v.mp4"), std::string::npos) << r.log();
  const io::VideoFrames v = io::read_video(dir + "/t2v.mp4");
  ASSERT_EQ(v.frames.sizes(), (std::vector<int64_t>{5, 32, 48, 3}));
  EXPECT_NEAR(v.fps, 16.0, 1e-6);  // Wan's rate
  const auto want8 = want.mul(255).round().clamp(0, 255);
  // H.264 (crf 18, 4:2:0) of Diffusers' frames (the tiny model's are noise-like, which 4:2:0
  // chroma cannot hold pixel by pixel): the same colours on 4 x 4 blocks.
  auto blocks = [](const torch::Tensor& f) {
    return torch::avg_pool2d(f.to(torch::kFloat).permute({0, 3, 1, 2}), 4);
  };
  EXPECT_LT((blocks(v.frames) - blocks(want8)).abs().mean().item<double>(), 6.0);
  // The PNGs are the frames exactly (Diffusers' numpy_to_pil rounding).
  for (int64_t i = 0; i < 5; ++i) {
    const auto png = io::load_image(dir + "/frames/0/frame_000" + std::to_string(i) + ".png");
    EXPECT_LE(wan_diff(png.to(torch::kFloat), want8[i]), 1.0) << i;
  }
  // GIF at another rate; a video path for an image family is refused.
  auto gif = run({kDifftrain,
                  "sample",
                  "--model",
                  kWanGolden + "/tiny_wan",
                  "--prompt",
                  "a",
                  "--num_videos_per_prompt",
                  "2",
                  "--height",
                  "32",
                  "--width",
                  "32",
                  "--num_frames",
                  "5",
                  "--num_inference_steps",
                  "1",
                  "--fps",
                  "8",
                  "--output",
                  dir + "/a.gif"},
                 {}, 300);
  ASSERT_EQ(gif.exit_code, 0) << gif.log();
  // Two videos: a_0.gif and a_1.gif.
  EXPECT_FALSE(fs::exists(dir + "/a.gif"));
  const io::VideoFrames g = io::read_video(dir + "/a_1.gif");
  EXPECT_EQ(g.frames.size(0), 5);
  EXPECT_NEAR(g.timestamps.back(), 4.0 / 8.0, 0.011);
}

// estimate-memory on Wan 2.1 1.3B's weightless config (configs/): musubi-tuner's LoRA targets at
// rank 32 counted exactly (per block 8 attention projections 1536 -> 1536 and the 1536 <-> 8960
// feed-forward: 32 x (8 x 3072 + 2 x 10496) = 1,458,176, x 30 blocks), the frozen transformer and
// VAE, and under checkpointing at least each block's bf16 input for the 32,760 tokens of
// 81 x 480 x 832.
TEST(WanCli, EstimateMemoryCountsTheLoraAndTheClipActivations) {
  auto json_of = [](std::vector<std::string> extra) {
    std::vector<std::string> argv = {
        kDifftrain, "estimate-memory",
        "--model",  std::string(difftrain_test::source_dir()) + "/configs/wan-2.1-t2v-1.3b",
        "--lora",   "--rank",
        "32",       "--mixed_precision",
        "bf16",     "--gradient_checkpointing",
        "--json"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    auto r = run(argv, {}, 300);
    EXPECT_EQ(r.exit_code, 0) << r.log();
    return r.exit_code == 0 ? nlohmann::json::parse(r.out) : nlohmann::json::object();
  };
  const auto bf16 = json_of({});
  ASSERT_TRUE(bf16.contains("trainable_params"));
  EXPECT_EQ(bf16["trainable_params"].get<int64_t>(), 30 * 1458176);
  EXPECT_EQ(bf16["frozen_params"].get<int64_t>(), 1418996800 + 126892531);
  EXPECT_EQ(bf16["largest_unit"]["module_class"], "WanTransformerBlock");
  const double act = bf16["activation_bytes"].get<double>();
  const double inputs = 30.0 * 32760 * 1536 * 2;
  EXPECT_GT(act, inputs);
  EXPECT_LT(act, 3 * inputs);
  const auto int8 = json_of({"--base_weights_dtype", "int8"});
  EXPECT_LT(int8["frozen_param_bytes"].get<double>(),
            0.6 * bf16["frozen_param_bytes"].get<double>());
  // Longer clips cost proportionally more; bad sizes are refused.
  const auto longer = json_of({"--num_frames", "161"});
  EXPECT_GT(longer["activation_bytes"].get<double>(), 1.8 * act);
  auto bad = run({kDifftrain, "estimate-memory", "--model",
                  std::string(difftrain_test::source_dir()) + "/configs/wan-2.1-t2v-1.3b",
                  "--num_frames", "80"},
                 {}, 120);
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.err.find("Wan takes 1 + 4k frames"), std::string::npos) << bad.log();
}

// Wan 2.2 TI2V-5B from the command line: one folder, text to video without --image and image to
// video with it (Diffusers' frames, make_ti2v.py); Wan 2.1 I2V with its CLIP image encoder.
TEST(WanCli, Ti2vAndWan21ImageToVideoFromPngs) {
  const std::string dir = make_temp_dir("wan_ti2v");
  const std::string ti2v = kWanGolden + "/tiny_wan_ti2v";
  const auto f = io::load_safetensors(ti2v + "/sample_ti2v.safetensors").tensors;
  io::save_png(dir + "/first.png", f.at("source.image_32x32"));
  for (const bool image : {false, true}) {
    SCOPED_TRACE(image ? "i2v" : "t2v");
    std::vector<std::string> argv = {kDifftrain,
                                     "sample",
                                     "--model",
                                     ti2v,
                                     "--prompt",
                                     "a red car drives in the city street",
                                     "--guidance_scale",
                                     "5",
                                     "--height",
                                     "32",
                                     "--width",
                                     "32",
                                     "--num_frames",
                                     "5",
                                     "--num_inference_steps",
                                     "3",
                                     "--seed",
                                     "0",
                                     "--output",
                                     dir + "/o.png",
                                     "--save_tensors",
                                     dir + "/o.safetensors"};
    if (image) argv.insert(argv.end(), {"--image", dir + "/first.png"});
    auto r = run(argv, {}, 300);
    ASSERT_EQ(r.exit_code, 0) << r.log();
    EXPECT_LT(wan_diff(io::load_safetensors(dir + "/o.safetensors").tensors.at("frames"),
                       f.at(std::string(image ? "i2v" : "t2v") + ".frames")),
              1e-4);
  }
  const std::string i2v21 = kWanGolden + "/tiny_wan_i2v21";
  const auto g = io::load_safetensors(i2v21 + "/sample_i2v21.safetensors").tensors;
  io::save_png(dir + "/src.png", g.at("source_image"));
  auto r = run({kDifftrain,
                "sample",
                "--model",
                i2v21,
                "--prompt",
                "the car drives away",
                "--guidance_scale",
                "5",
                "--height",
                "32",
                "--width",
                "48",
                "--num_frames",
                "5",
                "--num_inference_steps",
                "3",
                "--seed",
                "0",
                "--image",
                dir + "/src.png",
                "--output",
                dir + "/c.png",
                "--save_tensors",
                dir + "/c.safetensors"},
               {}, 300);
  ASSERT_EQ(r.exit_code, 0) << r.log();
  EXPECT_LT(
      wan_diff(io::load_safetensors(dir + "/c.safetensors").tensors.at("frames"), g.at("frames")),
      1e-4);
}

TEST(WanCli, LoraMergeAndForwardLoraGiveDiffusersFusedOutput) {
  const std::string dir = make_temp_dir("wan_lora_cli");
  const auto f = io::load_safetensors(kWanGolden + "/tiny_wan/forward.safetensors").tensors;
  const auto want = io::load_safetensors(kWanGolden + "/lora/expected.safetensors").tensors;
  io::TensorMap in;
  for (const char* k : {"hidden_states", "timestep", "encoder_hidden_states"}) {
    in[k] = f.at(std::string("t2v_f5.") + k);
  }
  io::save_safetensors(dir + "/in.safetensors", in);
  auto merge = run({kDifftrain, "lora", "merge", "--model", kWanGolden + "/tiny_wan", "--lora",
                    kWanGolden + "/lora/comfyui.safetensors", "--output", dir + "/merged"},
                   {}, 120);
  ASSERT_EQ(merge.exit_code, 0) << merge.log();
  auto merged = run({kDifftrain, "forward", "--model", dir + "/merged", "--inputs",
                     dir + "/in.safetensors", "--output", dir + "/merged_out.safetensors"},
                    {}, 120);
  ASSERT_EQ(merged.exit_code, 0) << merged.log();
  EXPECT_LT(wan_diff(io::load_safetensors(dir + "/merged_out.safetensors").tensors.at("out"),
                     want.at("comfyui.t2v_f5.out")),
            2e-5);
  auto kohya = run({kDifftrain, "forward", "--model", kWanGolden + "/tiny_wan", "--inputs",
                    dir + "/in.safetensors", "--output", dir + "/kohya_out.safetensors", "--lora",
                    kWanGolden + "/lora/kohya.safetensors"},
                   {}, 120);
  ASSERT_EQ(kohya.exit_code, 0) << kohya.log();
  EXPECT_LT(wan_diff(io::load_safetensors(dir + "/kohya_out.safetensors").tensors.at("out"),
                     want.at("kohya.t2v_f5.out")),
            2e-5);
}

TEST(WanCli, ForwardTakesDiffusersArgumentNames) {
  const std::string dir = make_temp_dir("wan_forward");
  const auto f = io::load_safetensors(kWanGolden + "/tiny_wan/forward.safetensors").tensors;
  for (const std::string c : {"t2v_f5", "i2v"}) {
    io::TensorMap in;
    for (const char* k :
         {"hidden_states", "timestep", "encoder_hidden_states", "encoder_hidden_states_image"}) {
      if (f.count(c + "." + k)) in[k] = f.at(c + "." + k);
    }
    io::save_safetensors(dir + "/" + c + ".safetensors", in);
    const std::string model =
        kWanGolden + (c == "i2v" ? "/tiny_wan/transformer_i2v" : "/tiny_wan/transformer");
    auto r = run({kDifftrain, "forward", "--model", model, "--inputs",
                  dir + "/" + c + ".safetensors", "--output", dir + "/" + c + "_out.safetensors"},
                 {}, 120);
    ASSERT_EQ(r.exit_code, 0) << r.log();
    EXPECT_LT(wan_diff(io::load_safetensors(dir + "/" + c + "_out.safetensors").tensors.at("out"),
                       f.at(c + ".out")),
              2e-5)
        << c;
  }
}

TEST(WanCli, ImageToVideoFromAPng) {
  const std::string dir = make_temp_dir("wan_i2v_cli");
  const auto f = io::load_safetensors(kWanGolden + "/tiny_wan_i2v/sample_i2v.safetensors").tensors;
  io::save_png(dir + "/first.png", f.at("source.image_60x40"));
  auto cmd = std::vector<std::string>{kDifftrain,
                                      "sample",
                                      "--model",
                                      kWanGolden + "/tiny_wan_i2v",
                                      "--image",
                                      dir + "/first.png",
                                      "--prompt",
                                      "the car drives away",
                                      "--guidance_scale",
                                      "5",
                                      "--height",
                                      "32",
                                      "--width",
                                      "48",
                                      "--num_frames",
                                      "5",
                                      "--num_inference_steps",
                                      "3",
                                      "--seed",
                                      "0",
                                      "--output",
                                      dir + "/v.png",
                                      "--save_tensors",
                                      dir + "/v.safetensors"};
  auto r = run(cmd, {}, 300);
  ASSERT_EQ(r.exit_code, 0) << r.log();
  EXPECT_NE(r.err.find("WanImageToVideoPipeline"), std::string::npos) << r.log();
  EXPECT_LT(wan_diff(io::load_safetensors(dir + "/v.safetensors").tensors.at("frames"),
                     f.at("i2v_resize.frames")),
            1e-4);
  cmd.insert(cmd.begin() + 5, {"--image", dir + "/first.png"});
  auto two = run(cmd, {}, 120);
  EXPECT_NE(two.exit_code, 0);
  EXPECT_NE(two.err.find("takes one --image"), std::string::npos) << two.log();
}

}  // namespace
}  // namespace difftrain::testing
