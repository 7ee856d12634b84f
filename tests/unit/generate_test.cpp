// Pipeline::generate() (through the diffusion::Pipeline interface) against the functions it runs
// (sample_images, text_to_image), bit for bit, in both seeding modes; its defaults, labels and
// errors; to(device, dtype); load_pipeline_sampler's DDIMPipeline rule; the prompt-file reader;
// the PNG-grid writer.

#include "difftrain/diffusion/generate.h"
#include "difftrain/families/stable_diffusion/pipeline.h"
#include "difftrain/families/unet/pipeline.h"
#include "difftrain/io/image.h"
#include "difftrain/io/prompt_file.h"
#include "difftrain/models/pretrained.h"
#include "source_dir.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>

namespace difftrain {
namespace {

namespace fs = std::filesystem;
using test::error_of;
using test::max_abs;

using difftrain::test::kDiffusersGolden;
const std::string kSd = std::string(difftrain_test::source_dir()) + "/tests/golden/sd/tiny_sd";

// The class-conditional fixture UNet (10 classes) with a DDIM sampler.
families::unet::UNetPipeline class_conditional_pipeline() {
  return families::unet::UNetPipeline(
      models::load_unet(kDiffusersGolden + "unet2d"),
      diffusion::load_sampler(kDiffusersGolden + "unet2d_uncond/scheduler_config.json", "ddim"));
}

TEST(GeneratePipeline, UNetBatchEqualsSampleImages) {
  auto p = class_conditional_pipeline();
  diffusion::Pipeline& pipe = p;
  EXPECT_EQ(pipe.class_name(), "DDIMPipeline");
  diffusion::GenerateRequest r;
  r.class_labels = {1, 7, 3};
  r.num_inference_steps = 3;
  r.guidance_scale = 2.0;
  r.seed = 5;
  int64_t calls = 0;
  r.on_step = [&](int64_t, int64_t) { ++calls; };
  const auto out = pipe.generate(r);

  families::unet::SampleOptions o;
  o.num_images = 3;
  o.class_labels = {1, 7, 3};
  o.num_inference_steps = 3;
  o.guidance_scale = 2.0;
  o.seed = 5;
  const auto want = families::unet::sample_images(*p.unet, *p.sampler, o);
  EXPECT_TRUE(torch::equal(out.images, want)) << "max abs diff " << max_abs(out.images, want);
  EXPECT_EQ(calls, 3);
  EXPECT_FALSE(out.latents.defined());
  EXPECT_EQ(out.tensors().size(), 1u);
  EXPECT_EQ(out.labels, (std::vector<std::string>{"class 1", "class 7", "class 3"}));
}

TEST(GeneratePipeline, UNetPerImageSeedsEachImage) {
  families::unet::UNetPipeline p;
  p.unet = models::load_unet(kDiffusersGolden + "unet2d_uncond");
  p.sampler =
      diffusion::load_sampler(kDiffusersGolden + "unet2d_uncond/scheduler_config.json", "ddim");
  models::UNet unet = p.unet;
  diffusion::Sampler& sampler = *p.sampler;
  diffusion::Pipeline& pipe = p;
  diffusion::GenerateRequest r;
  r.num_images = 3;
  r.num_inference_steps = 2;
  r.seed = 11;
  r.seeding = diffusion::Seeding::kPerImage;
  const auto out = pipe.generate(r);
  ASSERT_EQ(out.images.size(0), 3);
  for (int64_t i = 0; i < 3; ++i) {
    families::unet::SampleOptions o;
    o.num_inference_steps = 2;
    o.seed = 11 + static_cast<uint64_t>(i);
    const auto want = families::unet::sample_images(*unet, sampler, o);
    EXPECT_TRUE(torch::equal(out.images.narrow(0, i, 1), want))
        << "image " << i << " max abs diff " << max_abs(out.images.narrow(0, i, 1), want);
  }
  EXPECT_EQ(out.labels, (std::vector<std::string>{"seed 11", "seed 12", "seed 13"}));
  r.seeding = diffusion::Seeding::kBatch;
  r.num_images = 2;
  EXPECT_EQ(pipe.generate(r).labels, (std::vector<std::string>{"seed 11 #0", "seed 11 #1"}));
}

TEST(GeneratePipeline, UNetDefaultsAndErrors) {
  auto p = class_conditional_pipeline();
  diffusion::Pipeline& pipe = p;
  diffusion::GenerateRequest r;
  r.class_labels = {2, 4};
  auto resolved = pipe.resolve(r);
  EXPECT_EQ(resolved.num_images, 2);
  EXPECT_EQ(resolved.num_inference_steps, 50);  // DDIM
  EXPECT_EQ(*resolved.guidance_scale, 1.0);
  families::unet::UNetPipeline ddpm;
  ddpm.sampler =
      diffusion::load_sampler(kDiffusersGolden + "unet2d_uncond/scheduler_config.json", "ddpm");
  EXPECT_EQ(ddpm.class_name(), "DDPMPipeline");
  resolved = ddpm.resolve({});
  EXPECT_EQ(resolved.num_images, 1);
  EXPECT_EQ(resolved.num_inference_steps, 1000);
  EXPECT_NE(error_of([&] { ddpm.to(torch::kCPU); }).find("no UNet"), std::string::npos);

  r.prompts = {"a cat"};
  EXPECT_NE(error_of([&] { pipe.generate(r); }).find("UNet pipeline"), std::string::npos);
  r.prompts.clear();
  r.num_images = 3;
  r.seeding = diffusion::Seeding::kPerImage;
  EXPECT_NE(error_of([&] { pipe.generate(r); }).find("give one label per image"),
            std::string::npos);
}

// to(device, dtype) casts every model of the pipeline; the images of a bfloat16 UNet stay close to
// the float32 ones (the noise is drawn in float32 either way) but are not the same numbers.
TEST(GeneratePipeline, ToDtypeCastsEveryModel) {
  auto full = class_conditional_pipeline();
  auto half = class_conditional_pipeline();
  diffusion::Pipeline& pipe = half;
  pipe.to(torch::kCPU, torch::kBFloat16);
  for (const auto& p : half.unet->parameters()) ASSERT_EQ(p.scalar_type(), torch::kBFloat16);
  diffusion::GenerateRequest r;
  r.class_labels = {1, 7};
  r.num_inference_steps = 2;
  r.seed = 3;
  const auto want = full.generate(r).images;
  const auto got = pipe.generate(r).images;
  EXPECT_EQ(got.scalar_type(), torch::kFloat32);
  EXPECT_FALSE(torch::equal(got, want));
  EXPECT_LT(max_abs(got, want), 0.1);

  auto sd = families::stable_diffusion::load_stable_diffusion(kSd);
  sd.to(torch::kCPU, torch::kBFloat16);
  for (auto* m : std::vector<torch::nn::Module*>{sd.text_encoders.modules()[0], sd.vae.get(),
                                                 sd.unet.get()}) {
    for (const auto& p : m->parameters()) ASSERT_EQ(p.scalar_type(), torch::kBFloat16);
  }
  diffusion::GenerateRequest t;
  t.prompts = {"a photo of a cat"};
  t.num_inference_steps = 2;
  t.height = t.width = 32;
  EXPECT_EQ(sd.generate(t).images.sizes(), (c10::IntArrayRef{1, 32, 32, 3}));
}

TEST(GeneratePipeline, DdimPipelineFolderRunsDdim) {
  const std::string dir = test::temp_dir("generate_ddim_pipeline");
  fs::create_directory_symlink(kDiffusersGolden + "unet2d_uncond", dir + "/unet");
  fs::create_directories(dir + "/scheduler");
  fs::copy_file(kDiffusersGolden + "unet2d_uncond/scheduler_config.json",
                dir + "/scheduler/scheduler_config.json");
  test::write_text(dir + "/model_index.json", R"({"_class_name": "DDIMPipeline"})");
  auto folder = families::unet::resolve_pipeline_folder(dir);
  EXPECT_EQ(families::unet::load_pipeline_sampler(folder)->class_name(), "DDIMScheduler");
  EXPECT_EQ(families::unet::load_pipeline_sampler(folder, "euler")->class_name(),
            "EulerDiscreteScheduler");
  test::write_text(dir + "/model_index.json", R"({"_class_name": "DDPMPipeline"})");
  folder = families::unet::resolve_pipeline_folder(dir);
  EXPECT_EQ(families::unet::load_pipeline_sampler(folder)->class_name(),
            diffusion::load_sampler(folder.scheduler_config, "")->class_name());
}

TEST(GeneratePipeline, TextToImageBatchEqualsTextToImage) {
  auto sd = families::stable_diffusion::load_stable_diffusion(kSd);
  diffusion::Pipeline& pipe = sd;
  EXPECT_EQ(pipe.class_name(), "StableDiffusionPipeline");
  diffusion::GenerateRequest r;
  r.prompts = {"a photo of a cat", "an astronaut riding a horse on mars, highly detailed"};
  r.negative_prompts = {"blurry"};
  r.num_images = 2;
  r.num_inference_steps = 3;
  r.seed = 42;
  const auto resolved = pipe.resolve(r);
  EXPECT_EQ(*resolved.guidance_scale, 7.5);
  const auto out = pipe.generate(r);

  families::stable_diffusion::TextToImageOptions o;
  o.prompts = r.prompts;
  o.negative_prompts = r.negative_prompts;
  o.num_images_per_prompt = 2;
  o.num_inference_steps = 3;
  o.guidance_scale = 7.5;
  o.seed = 42;
  const auto want = families::stable_diffusion::text_to_image(sd, o);
  EXPECT_TRUE(torch::equal(out.images, want.images))
      << "max abs diff " << max_abs(out.images, want.images);
  EXPECT_TRUE(torch::equal(out.latents, want.latents));
  EXPECT_TRUE(torch::equal(out.prompt_embeds, want.prompt_embeds));
  EXPECT_EQ(out.tensors().size(), 3u);
  // The first 28 characters of a prompt, "..." when cut, " #k" with several images per prompt.
  EXPECT_EQ(out.labels, (std::vector<std::string>{"a photo of a cat #0", "a photo of a cat #1",
                                                  "an astronaut riding a horse ... #0",
                                                  "an astronaut riding a horse ... #1"}));

  r.class_labels = {1};
  EXPECT_NE(error_of([&] { pipe.generate(r); }).find("--class_labels"), std::string::npos);
}

TEST(GeneratePipeline, TextToImagePerImageSeedsEachImage) {
  auto sd = families::stable_diffusion::load_stable_diffusion(kSd);
  diffusion::Pipeline& pipe = sd;
  diffusion::GenerateRequest r;
  r.prompts = {"a photo of a cat", "a red square"};
  r.negative_prompts = {"blurry", "dark"};
  r.num_images = 2;
  r.num_inference_steps = 2;
  r.guidance_scale = 3.0;
  r.height = r.width = 32;
  r.clip_skip = 1;
  r.seed = 7;
  r.seeding = diffusion::Seeding::kPerImage;
  const auto out = pipe.generate(r);
  ASSERT_EQ(out.images.size(0), 4);
  for (int64_t i = 0; i < 4; ++i) {
    families::stable_diffusion::TextToImageOptions
        o;  // what render_validation / class images ran per image
    o.prompts = {r.prompts[static_cast<size_t>(i / 2)]};
    o.negative_prompts = {r.negative_prompts[static_cast<size_t>(i / 2)]};
    o.num_inference_steps = 2;
    o.guidance_scale = 3.0;
    o.height = o.width = 32;
    o.clip_skip = 1;
    o.seed = 7 + static_cast<uint64_t>(i);
    const auto want = families::stable_diffusion::text_to_image(sd, o);
    EXPECT_TRUE(torch::equal(out.images.narrow(0, i, 1), want.images))
        << "image " << i << " max abs diff " << max_abs(out.images.narrow(0, i, 1), want.images);
    EXPECT_TRUE(torch::equal(out.latents.narrow(0, i, 1), want.latents));
  }
  EXPECT_EQ(out.prompt_embeds.size(0), 8);  // each run's [negative, prompt]
  EXPECT_EQ(out.labels, (std::vector<std::string>{"a photo of a cat #0", "a photo of a cat #1",
                                                  "a red square #0", "a red square #1"}));
  r.negative_prompts = {"a", "b", "c"};
  EXPECT_NE(error_of([&] { pipe.generate(r); }).find("negative prompts"), std::string::npos);
}

TEST(PromptFile, OneRuleSet) {
  const std::string dir = test::temp_dir("prompt_file");
  auto read = [&](const std::string& text) {
    test::write_text(dir + "/p.txt", text);
    return io::read_prompt_file(dir + "/p.txt");
  };
  using V = std::vector<std::string>;
  EXPECT_EQ(read("a\nb\n"), (V{"a", "b"}));
  EXPECT_EQ(read("a\nb"), (V{"a", "b"}));
  EXPECT_EQ(read("a\r\n\nb\r\n"), (V{"a", "", "b"}));
  EXPECT_EQ(read(" a \n\n\n"), (V{" a ", "", ""}));
  EXPECT_EQ(read("\n"), (V{""}));
  EXPECT_EQ(read(""), V{});
  EXPECT_NE(error_of([&] {
              io::read_prompt_file(dir + "/nope.txt");
            }).find("cannot read --prompt_file '" + dir + "/nope.txt'"),
            std::string::npos);
  EXPECT_NE(error_of([&] { io::read_prompt_file(dir); }).find("cannot read --prompt_file '"),
            std::string::npos);
}

TEST(ImageGrid, SaveImageGridWritesMakeGridOfTheUint8Images) {
  const std::string dir = test::temp_dir("image_grid");
  const auto images = torch::rand({3, 8, 6, 3});
  const std::vector<std::string> labels = {"a", "b", "c"};
  const auto grid = io::save_image_grid(dir + "/g.png", images, labels, 2);
  const auto want = io::make_grid(io::to_uint8_images(images.permute({0, 3, 1, 2})), labels, 2);
  EXPECT_TRUE(torch::equal(grid, want));
  EXPECT_TRUE(torch::equal(io::load_image(dir + "/g.png"), want));
  EXPECT_NE(error_of([&] {
              io::save_image_grid(dir + "/h.png", torch::rand({8, 6, 3}));
            }).find("expected float [K, H, W, C]"),
            std::string::npos);
}

// Media carry a frame axis (issue 57): an image is one frame, a clip [K, F, H, W, C] is written
// as one row of its frames, its label under the first and "frame f" under the rest.
TEST(ImageGrid, ClipsAreRowsOfTheirFramesAndImagesOneFrame) {
  const std::string dir = test::temp_dir("clip_grid");
  const auto clips = torch::rand({2, 3, 8, 6, 3});
  const auto grid = io::save_image_grid(dir + "/c.png", clips, {"cat", "dog"}, 5);
  const auto flat = io::to_uint8_images(clips.flatten(0, 1).permute({0, 3, 1, 2}));
  EXPECT_TRUE(torch::equal(
      grid, io::make_grid(flat, {"cat", "frame 1", "frame 2", "dog", "frame 1", "frame 2"}, 3)));
  EXPECT_TRUE(torch::equal(io::load_image(dir + "/c.png"), grid));
  diffusion::GenerateResult images;
  images.images = torch::rand({4, 8, 6, 3});
  EXPECT_EQ(images.num_frames(), 1);
  EXPECT_TRUE(torch::equal(images.frames(), images.images.unsqueeze(1)));
  diffusion::GenerateResult video;
  video.images = clips;
  EXPECT_EQ(video.num_frames(), 3);
  EXPECT_EQ(video.frames().sizes(), clips.sizes());
  EXPECT_NE(error_of([] {
              diffusion::GenerateResult flat_result;
              flat_result.images = torch::rand({8, 6, 3});
              (void)flat_result.frames();
            }).find("expected images [K, H, W, C] or clips [K, F, H, W, C]"),
            std::string::npos);
}

}  // namespace
}  // namespace difftrain
