// Qwen-Image-Edit against its references (tests/golden/qwen_image/make_edit.py): PIL's resize
// (lanczos, bicubic) value for value; Qwen2-VL's image processor (smart_resize, normalisation,
// patch order) and Qwen2.5-VL's vision tower (window / full attention, 2-D rotary, merger) against
// a plain-torch transcription of Transformers' code (itself checked against a float64 loop
// formulation); the multimodal positions and hidden states of prompts with images; and
// QwenImageEditPipeline / QwenImageEditPlusPipeline.__call__ from strings and PIL images, seed for
// seed (one reference image, true CFG, two reference images); refusals.
#include "../../src/families/qwen_image/edit.h"
#include "../../src/families/qwen_image/qwen_image_pipeline.h"

#include "difftrain/io/image.h"
#include "difftrain/io/safetensors.h"
#include "difftrain/models/text_encoders/qwen2_5_vl_vision.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <iostream>

namespace qwen_image_edit_test {

using difftrain::test::error_of;
using difftrain::test::kGoldenDir;
using difftrain::test::max_abs;
namespace qi = difftrain::families::qwen_image;
namespace models = difftrain::models;

const std::string kQwenDir = kGoldenDir + "qwen_image";
const std::string kEditDir = kQwenDir + "/edit";
const std::string kTiny = kQwenDir + "/tiny_qwen_image";

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

difftrain::io::TensorMap tensors(const std::string& path) {
  static std::map<std::string, difftrain::io::TensorMap> cache;
  auto it = cache.find(path);
  if (it == cache.end()) {
    it = cache.emplace(path, difftrain::io::load_safetensors(path).tensors).first;
  }
  return it->second;
}

TEST(PilResize, LanczosAndBicubicEqualPillow) {
  const auto f = tensors(kEditDir + "/resize_cases.safetensors");
  const auto cases = read_json(kEditDir + "/resize_cases.json");
  int64_t checked = 0;
  for (const auto& c : cases.at("cases")) {
    const std::string name = c.at("name").get<std::string>();
    SCOPED_TRACE(name);
    const auto filter = c.at("filter").get<std::string>() == "LANCZOS"
                            ? difftrain::io::Resample::kLanczos
                            : difftrain::io::Resample::kBicubic;
    const auto& src = f.at(name + ".src");
    const auto& want = f.at(name + ".out");
    const auto got = difftrain::io::resize_image(src, want.size(0), want.size(1), filter);
    ASSERT_EQ(got.sizes(), want.sizes());
    EXPECT_TRUE(torch::equal(got, want))
        << "max diff " << (got.to(torch::kInt32) - want.to(torch::kInt32)).abs().max().item<int>();
    ++checked;
  }
  EXPECT_EQ(checked, 22);
  EXPECT_NE(error_of([] {
              difftrain::io::resize_image(torch::zeros({4, 4, 3}), 2, 2,
                                          difftrain::io::Resample::kBicubic);
            }).find("uint8"),
            std::string::npos);
}

TEST(Qwen2VLImageProcessor, SmartResizeRoundsHalfToEvenAndFitsThePixelBounds) {
  // 70 / 28 = 2.5 rounds to 2 (Python's round), so 45 x 70 becomes 56 x 56.
  EXPECT_EQ(models::qwen2_vl_smart_resize(45, 70, 28, 3136, 12845056),
            (std::array<int64_t, 2>{56, 56}));
  // Below min_pixels: scaled up with ceil.
  EXPECT_EQ(models::qwen2_vl_smart_resize(30, 40, 28, 3136, 12845056),
            (std::array<int64_t, 2>{56, 84}));
  // Above max_pixels: scaled down with floor.
  const auto big = models::qwen2_vl_smart_resize(4000, 3000, 28, 3136, 1003520);
  EXPECT_LE(big[0] * big[1], 1003520);
  EXPECT_EQ(big[0] % 28, 0);
  EXPECT_NE(error_of([] {
              models::qwen2_vl_smart_resize(1, 300, 28, 3136, 1003520);
            }).find("aspect ratio"),
            std::string::npos);
}

struct Vision {
  models::Qwen3Model lm{nullptr};
  models::Qwen2_5VisionTransformer visual{nullptr};
};

Vision& vision() {
  static Vision v = [] {
    Vision out;
    difftrain::io::TensorMap w;
    out.lm = models::load_qwen3_model(kQwenDir + "/text_encoder", torch::kFloat32, "", &w);
    out.visual = models::make_qwen2_5_vl_vision(kQwenDir + "/text_encoder/config.json", w,
                                                kQwenDir + "/text_encoder");
    out.lm->eval();
    out.visual->eval();
    return out;
  }();
  return v;
}

TEST(Qwen2_5VisionTower, ProcessorAndTowerMatchTransformers) {
  torch::NoGradGuard no_grad;
  const auto f = tensors(kEditDir + "/vision_expected.safetensors");
  const auto cases = read_json(kEditDir + "/vision_cases.json").at("vision_cases");
  ASSERT_GE(cases.size(), 6u);
  for (const auto& [name, c] : cases.items()) {
    SCOPED_TRACE(name);
    std::vector<torch::Tensor> images;
    for (const auto& image : c.at("images")) {
      images.push_back(f.at("images." + image.get<std::string>()));
    }
    const auto patches = models::qwen2_vl_image_patches(images);
    EXPECT_TRUE(torch::equal(patches.image_grid_thw, f.at(name + ".image_grid_thw")));
    EXPECT_LT(max_abs(patches.pixel_values, f.at(name + ".pixel_values")), 1e-6);
    const auto embeds =
        vision().visual->forward(f.at(name + ".pixel_values"), f.at(name + ".image_grid_thw"));
    EXPECT_LT(max_abs(embeds, f.at(name + ".image_embeds")), 1e-5);
  }
}

TEST(Qwen2_5VisionTower, PromptsWithImagesGiveTransformersPositionsAndHiddenStates) {
  torch::NoGradGuard no_grad;
  const auto f = tensors(kEditDir + "/vision_expected.safetensors");
  const auto cases = read_json(kEditDir + "/vision_cases.json").at("encoder_cases");
  ASSERT_EQ(cases.size(), 3u);
  for (const auto& [name, c] : cases.items()) {
    SCOPED_TRACE(name);
    const auto& ids = f.at(name + ".input_ids");
    const auto& mask = f.at(name + ".attention_mask");
    const auto& grid = f.at(name + ".image_grid_thw");
    const auto& pixels = f.at(c.at("pixel_values_from").get<std::string>() + ".pixel_values");
    const auto positions =
        models::qwen2_5_vl_rope_index(ids, mask, grid, vision().visual->options());
    EXPECT_TRUE(torch::equal(positions, f.at(name + ".position_ids")));
    const auto out =
        models::qwen2_5_vl_forward(vision().lm, vision().visual, ids, mask, pixels, grid);
    const auto real = mask.to(torch::kBool).unsqueeze(-1);
    EXPECT_LT(max_abs(out.hidden_states.back() * real, f.at(name + ".hidden_states_last") * real),
              2e-5);
  }
  // A prompt whose <|image_pad|> run does not fit the images is refused in one line.
  const auto& c = cases.at("edit");
  const auto ids = f.at("edit.input_ids").narrow(1, 0, 240);
  EXPECT_NE(error_of([&] {
              models::qwen2_5_vl_forward(
                  vision().lm, vision().visual, ids, torch::ones_like(ids),
                  f.at(c.at("pixel_values_from").get<std::string>() + ".pixel_values"),
                  f.at("edit.image_grid_thw"));
            }).find("<|image_pad|>"),
            std::string::npos);
}

TEST(QwenImageEditPipeline, EditAndEditPlusFromStringsAndImagesMatchDiffusers) {
  torch::NoGradGuard no_grad;
  const auto f = tensors(kTiny + "/edit_e2e.safetensors");
  const auto cases = read_json(kTiny + "/edit_e2e.json").at("cases");
  for (const auto& item : cases.items()) {
    // Plain variables: a lambda may not capture structured bindings in C++17 (clang refuses).
    const std::string name = item.key();
    const nlohmann::json& c = item.value();
    SCOPED_TRACE(name);
    const auto& a = c.at("arguments");
    const auto key = [&](const std::string& k) -> const torch::Tensor& {
      const auto& dedup = c.value("deduplicated_keys", nlohmann::json::object());
      return f.at(dedup.contains(k) ? dedup.at(k).get<std::string>() : name + "." + k);
    };
    qi::QwenImagePipeline p =
        qi::load_qwen_image_pipeline(kTiny, {}, a.at("pipeline").get<std::string>());
    for (size_t i = 0; i < a.at("image").size(); ++i) {
      p.images.push_back(key("source." + std::to_string(i)));
    }
    difftrain::diffusion::GenerateRequest r;
    r.prompts = {a.at("prompt").get<std::string>()};
    if (!a.at("negative_prompt").is_null()) {
      r.negative_prompts = {a.at("negative_prompt").get<std::string>()};
    }
    r.options["true_cfg_scale"] = a.at("true_cfg_scale").get<double>();
    r.height = a.at("height").get<int64_t>();
    r.width = a.at("width").get<int64_t>();
    r.num_inference_steps = a.at("num_inference_steps").get<int64_t>();
    r.seed = a.at("seed").get<uint64_t>();
    const auto out = p.generate(r);
    const auto& want_embeds = key("prompt_embeds");
    EXPECT_EQ(out.prompt_embeds.sizes(), want_embeds.sizes());
    if (out.prompt_embeds.sizes() != want_embeds.sizes()) continue;
    const double de = max_abs(out.prompt_embeds, want_embeds);
    const double dl = max_abs(out.latents, key("latents"));
    const double di = max_abs(out.images, key("image"));
    std::cout << name << ": prompt_embeds " << de << ", latents " << dl << ", image " << di << "\n";
    EXPECT_LT(de, 2e-5);
    // CFG moves these latents by 3.5e-4 (the fixture's edit_cfg vs edit_one): far above this.
    EXPECT_LT(dl, 2e-5);
    EXPECT_LT(di, 1e-4);
  }
}

TEST(QwenImageEditPipeline, ReferenceSizesAndRefusals) {
  // calculate_dimensions at 1024 x 1024 and 384 x 384 pixels (the fixture's sources).
  EXPECT_EQ(qi::qwen_calculate_dimensions(1024.0 * 1024.0, 300.0 / 200.0),
            (std::array<int64_t, 2>{1248, 832}));
  EXPECT_EQ(qi::qwen_calculate_dimensions(384.0 * 384.0, 160.0 / 240.0),
            (std::array<int64_t, 2>{320, 480}));
  const auto image = torch::zeros({20, 30, 3}, torch::kUInt8);
  EXPECT_NE(error_of([&] {
              qi::prepare_edit_images({image, image}, qi::EditKind::kEdit);
            }).find("QwenImageEditPlusPipeline"),
            std::string::npos);
  EXPECT_NE(error_of([&] { qi::prepare_edit_images({}, qi::EditKind::kEditPlus); }).find("--image"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              qi::edit_kind_of("QwenImageEditPlusPipelin", "--pipeline");
            }).find("QwenImageEditPipeline"),
            std::string::npos);
  const auto plus = qi::prepare_edit_images({image, torch::zeros({40, 20, 3}, torch::kUInt8)},
                                            qi::EditKind::kEditPlus);
  ASSERT_EQ(plus.condition.size(), 2u);
  EXPECT_EQ(plus.vae_pixels[0].sizes(), (std::vector<int64_t>{1, 3, 1, 832, 1248}));
  // The default output size is the last image's.
  EXPECT_EQ(plus.height, 1440);
  EXPECT_EQ(plus.width, 736);
}

TEST(QwenImageEditPipeline, OneStepWithShiftTerminalIsRefusedNotNaN) {
  // The Qwen-Image scheduler's shift_terminal stretch divides by 1 - the last sigma: with one
  // step that is 0 and Diffusers samples NaN; difftrain says so.
  qi::QwenImagePipeline p = qi::load_qwen_image_pipeline(kTiny);
  difftrain::diffusion::GenerateRequest r;
  r.prompts = {"a"};
  r.height = 32;
  r.width = 32;
  r.num_inference_steps = 1;
  EXPECT_NE(error_of([&] { p.generate(r); }).find("shift_terminal"), std::string::npos);
}

}  // namespace qwen_image_edit_test
