// Writing LoRA files and merging them into model folders: every format written by write_lora()
// reads back (read_lora) to the same updates, and merges (merge_lora) into the same weights, as
// the LoRA in memory; the Diffusers fixture's three files re-written in each format agree; a model
// folder merged by merge_lora_into_folder loads to the in-memory merge; bad input gives one-line
// errors naming the path.

#include "difftrain/core/error.h"
#include "difftrain/io/lora_format.h"
#include "difftrain/io/safetensors.h"
#include "difftrain/models/lora/lora.h"
#include "difftrain/models/lora/lora_folder.h"
#include "difftrain/models/pretrained.h"

#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

namespace {

using difftrain::test::error_of;
using difftrain::test::max_abs;
using difftrain::test::temp_dir;

namespace fs = std::filesystem;
namespace io = difftrain::io;
namespace models = difftrain::models;
using io::LoraFormat;
using io::LoraTarget;
using io::LoraWeights;

using difftrain::test::kDiffusersGolden;
const std::vector<LoraFormat> kFormats = {LoraFormat::kDiffusers, LoraFormat::kPeft,
                                          LoraFormat::kKohya};

// A target for `module` whose weight is `weight_shape`: Linear [out, in] or Conv2d
// [out, in, kh, kw], rank r, entries ~0.1 so a merged weight stays of order one.
LoraTarget random_target(const std::string& module, at::IntArrayRef weight_shape, int64_t r,
                         std::optional<double> alpha, at::Generator& gen) {
  LoraTarget t;
  t.module = module;
  t.key = module;
  std::vector<int64_t> down{r, weight_shape[1]}, up{weight_shape[0], r};
  if (weight_shape.size() == 4) {
    down.insert(down.end(), {weight_shape[2], weight_shape[3]});
    up.insert(up.end(), {1, 1});
  }
  t.down = at::randn(down, gen) * 0.1;
  t.up = at::randn(up, gen) * 0.1;
  t.alpha = alpha;
  return t;
}

// Linear, 1x1 and 3x3 Conv2d targets of the class-conditional UNet fixture, ranks 1..8 with no
// alpha, alpha 0 (= r), alpha = r, alpha < r and alpha > r; plus one text encoder target.
LoraWeights random_lora(models::UNetImpl& unet, uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  const auto params = unet.named_parameters();
  struct Spec {
    const char* module;
    int64_t r;
    std::optional<double> alpha;
  };
  const std::vector<Spec> specs = {
      {"conv_in", 2, 3.0},                                 // 3x3 conv, scale 1.5
      {"down_blocks.0.resnets.0.conv1", 4, std::nullopt},  // 3x3 conv, scale 1
      {"down_blocks.1.resnets.0.conv_shortcut", 3, 1.0},   // 1x1 conv, scale 1/3
      {"down_blocks.1.attentions.0.to_q", 4, 0.0},         // Linear, alpha 0 = r
      {"down_blocks.1.attentions.0.to_v", 8, 16.0},        // Linear, scale 2
      {"mid_block.attentions.0.to_out.0", 1, 1.0},         // Linear, rank 1
      {"time_embedding.linear_1", 2, 0.5},                 // Linear, scale 0.25
      {"up_blocks.0.resnets.0.conv_shortcut", 4, 4.0},     // 1x1 conv, scale 1
  };
  LoraWeights lora;
  lora.path = "in-memory";
  for (const auto& s : specs) {
    const torch::Tensor* w = params.find(std::string(s.module) + ".weight");
    EXPECT_NE(w, nullptr) << s.module << " is not a module of the fixture UNet";
    if (w == nullptr) continue;
    lora.components["unet"].push_back(random_target(s.module, w->sizes(), s.r, s.alpha, gen));
  }
  lora.components["text_encoder"].push_back(
      random_target("text_model.encoder.layers.0.self_attn.q_proj", {16, 16}, 2, 8.0, gen));
  return lora;
}

// max |lora_delta(a) - lora_delta(b)| over every target, matched by component and module.
double max_delta_diff(const LoraWeights& a, const LoraWeights& b) {
  double worst = 0;
  EXPECT_EQ(a.components.size(), b.components.size());
  for (const auto& [component, targets] : a.components) {
    const auto& other = b.targets(component);
    EXPECT_EQ(targets.size(), other.size()) << component;
    for (const auto& t : targets) {
      const auto it = std::find_if(other.begin(), other.end(),
                                   [&](const LoraTarget& o) { return o.module == t.module; });
      if (it == other.end()) {
        ADD_FAILURE() << component << " module " << t.module << " lost in the round trip";
        continue;
      }
      worst = std::max(worst, max_abs(models::lora_delta(*it), models::lora_delta(t)));
    }
  }
  return worst;
}

double max_weight_diff(const torch::nn::Module& a, const torch::nn::Module& b) {
  double worst = 0;
  const auto pb = b.named_parameters();
  for (const auto& p : a.named_parameters())
    worst = std::max(worst, max_abs(p.value(), pb[p.key()]));
  return worst;
}

// ---------------------------------------------------------------- write, read back, compare

TEST(LoraWriter, EveryFormatReadsBackToTheSameUpdatesAndMerge) {
  const auto dir = temp_dir("lora_write");
  auto base = models::load_unet(kDiffusersGolden + "unet2d");
  const auto names = models::lora_module_names(*base);
  const LoraWeights lora = random_lora(*base, 21);
  auto expected = models::load_unet(kDiffusersGolden + "unet2d");
  models::merge_lora(*expected, lora, 0.7);

  for (const LoraFormat format : kFormats) {
    SCOPED_TRACE(io::to_string(format));
    const std::string path = dir + "/" + io::to_string(format) + ".safetensors";
    io::write_lora(path, lora, format, {{"ss_network_dim", "4"}});
    const auto file = io::load_safetensors(path);
    EXPECT_EQ(file.metadata.at("format"), "pt");
    EXPECT_EQ(file.metadata.at("ss_network_dim"), "4");
    for (const auto& [key, t] : file.tensors) {
      EXPECT_EQ(t.scalar_type(), torch::kFloat32) << key;
    }
    auto back = io::read_lora(path);
    EXPECT_EQ(back.format, format);
    EXPECT_EQ(back.count("unet"), lora.count("unet"));
    EXPECT_EQ(back.count("text_encoder"), 1u);
    if (format == LoraFormat::kKohya) {
      // The alpha makes the scale exact: alpha 3 at rank 2 is 1.5, no alpha or 0 is r.
      EXPECT_TRUE(file.tensors.count("lora_unet_conv_in.alpha"));
      EXPECT_EQ(file.tensors.at("lora_unet_conv_in.alpha").dim(), 0);
      EXPECT_EQ(file.tensors.at("lora_unet_conv_in.alpha").item<float>(), 3.0f);
      EXPECT_EQ(file.tensors.at("lora_unet_down_blocks_0_resnets_0_conv1.alpha").item<float>(),
                4.0f);
      EXPECT_TRUE(file.tensors.count("lora_te_text_model_encoder_layers_0_self_attn_q_proj.alpha"));
      for (const auto& t : back.targets("unet")) EXPECT_FALSE(t.resolved);
      io::resolve_kohya_names(back, "unet", names);
      io::resolve_kohya_names(back, "text_encoder",
                              {"text_model.encoder.layers.0.self_attn.q_proj"});
      for (const auto& t : back.targets("unet")) EXPECT_TRUE(t.resolved) << t.module;
    } else {
      const std::string down =
          format == LoraFormat::kDiffusers ? ".lora.down.weight" : ".lora_A.weight";
      EXPECT_TRUE(file.tensors.count("unet.conv_in" + down));
      EXPECT_TRUE(file.tensors.count("unet.down_blocks.1.resnets.0.conv_shortcut" + down));
      const std::string te =
          format == LoraFormat::kDiffusers ? ".lora_linear_layer.down.weight" : ".lora_A.weight";
      EXPECT_TRUE(
          file.tensors.count("text_encoder.text_model.encoder.layers.0.self_attn.q_proj" + te));
      // r and alpha are kept in lora_adapter_metadata, not folded into up.
      EXPECT_TRUE(file.metadata.count("lora_adapter_metadata"));
      EXPECT_EQ(fs::exists(dir + "/adapter_config.json"), format == LoraFormat::kPeft);
      for (const auto& t : back.targets("unet")) {
        const auto it = std::find_if(lora.targets("unet").begin(), lora.targets("unet").end(),
                                     [&](const LoraTarget& o) { return o.module == t.module; });
        ASSERT_NE(it, lora.targets("unet").end()) << t.module;
        EXPECT_DOUBLE_EQ(t.scale(), it->scale()) << t.module;
        EXPECT_TRUE(torch::equal(t.up, it->up.to(torch::kFloat32))) << t.module;
      }
    }
    const double delta = max_delta_diff(lora, back);
    auto merged = models::load_unet(kDiffusersGolden + "unet2d");
    const auto summary = models::merge_lora(*merged, back, 0.7);
    EXPECT_EQ(summary.modules_merged, static_cast<int64_t>(lora.count("unet")));
    EXPECT_EQ(summary.other_component_targets, 1);
    const double weights = max_weight_diff(*merged, *expected);
    std::printf(
        "%s: max |delta - original| %.3g, max |merged W - in-memory merge| %.3g (tol 1e-6)\n",
        io::to_string(format).c_str(), delta, weights);
    EXPECT_LE(delta, 1e-6);
    EXPECT_LE(weights, 1e-6);
  }
  fs::remove_all(dir);
}

TEST(LoraWriter, FixtureFilesRewrittenInEveryFormatAgree) {
  const auto dir = temp_dir("lora_rewrite");
  auto unet = models::load_unet(kDiffusersGolden + "unet_cond");
  const auto names = models::lora_module_names(*unet);
  const auto reference = io::read_lora(kDiffusersGolden + "lora/pytorch_lora_weights.safetensors");
  for (const char* fixture : {"pytorch_lora_weights", "peft_format", "kohya_format"}) {
    auto source = io::read_lora(kDiffusersGolden + "lora/" + fixture + ".safetensors");
    if (source.format == LoraFormat::kKohya) {
      // Raw kohya names can be written back as kohya, but not in a dotted format.
      const auto path = dir + "/raw_kohya.safetensors";
      io::write_lora(path, source, LoraFormat::kKohya);
      auto raw = io::read_lora(path);
      io::resolve_kohya_names(raw, "unet", names);
      EXPECT_LE(max_delta_diff(reference, raw), 1e-6);
      const auto msg = error_of([&] { io::write_lora(path, source, LoraFormat::kPeft); });
      EXPECT_HAS(msg, "unresolved kohya name");
      EXPECT_HAS(msg, "resolve_kohya_names");
      io::resolve_kohya_names(source, "unet", names);
    }
    for (const LoraFormat format : kFormats) {
      SCOPED_TRACE(std::string(fixture) + " -> " + io::to_string(format));
      const std::string path =
          dir + "/" + fixture + "_as_" + io::to_string(format) + ".safetensors";
      io::write_lora(path, source, format);
      auto back = io::read_lora(path);
      io::resolve_kohya_names(back, "unet", names);
      const double diff = max_delta_diff(reference, back);
      std::printf("%s -> %s: max |delta diff| %.3g over %zu modules (tol 1e-6)\n", fixture,
                  io::to_string(format).c_str(), diff, back.count("unet"));
      EXPECT_LE(diff, 1e-6);
    }
  }
  fs::remove_all(dir);
}

TEST(LoraWriter, KeepsDtypesAndFoldsTheScaleOnce) {
  auto gen = at::detail::createCPUGenerator(5);
  LoraWeights lora;
  auto t = random_target("mid_block.attentions.0.to_q", {64, 64}, 4, 2.0, gen);
  t.down = t.down.to(torch::kFloat16);
  t.up = t.up.to(torch::kFloat16).t().contiguous().t();  // not contiguous: written contiguous
  lora.components["unet"].push_back(t);
  const auto diffusers = io::lora_to_tensors(lora, LoraFormat::kDiffusers);
  const auto& up = diffusers.at("unet.mid_block.attentions.0.to_q.lora.up.weight");
  EXPECT_EQ(up.scalar_type(), torch::kFloat16);
  EXPECT_TRUE(up.is_contiguous());
  EXPECT_TRUE(torch::equal(up, (t.up.to(torch::kFloat64) * 0.5).to(torch::kFloat16)));
  EXPECT_TRUE(
      torch::equal(diffusers.at("unet.mid_block.attentions.0.to_q.lora.down.weight"), t.down));
  const auto kohya = io::lora_to_tensors(lora, LoraFormat::kKohya);
  EXPECT_EQ(kohya.at("lora_unet_mid_block_attentions_0_to_q.lora_up.weight").scalar_type(),
            torch::kFloat16);
  EXPECT_EQ(kohya.at("lora_unet_mid_block_attentions_0_to_q.alpha").scalar_type(), torch::kFloat32);
  // A second text encoder switches kohya's text encoder prefixes to lora_te1_ / lora_te2_.
  lora.components["text_encoder"].push_back(
      random_target("text_model.encoder.layers.0.mlp.fc1", {32, 16}, 2, std::nullopt, gen));
  lora.components["text_encoder_2"].push_back(
      random_target("text_model.encoder.layers.0.mlp.fc1", {32, 16}, 2, std::nullopt, gen));
  const auto sdxl = io::lora_to_tensors(lora, LoraFormat::kKohya);
  EXPECT_TRUE(sdxl.count("lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight"));
  EXPECT_TRUE(sdxl.count("lora_te2_text_model_encoder_layers_0_mlp_fc1.lora_down.weight"));
  const auto back = io::parse_lora(sdxl, "sdxl.safetensors");
  EXPECT_EQ(back.count("text_encoder"), 1u);
  EXPECT_EQ(back.count("text_encoder_2"), 1u);
}

TEST(LoraWriter, ErrorsNameTheTargetAndTheFix) {
  const auto dir = temp_dir("lora_write_bad");
  auto gen = at::detail::createCPUGenerator(6);
  const std::string path = dir + "/out.safetensors";
  auto one_line = [](const std::string& msg) { EXPECT_EQ(msg.find('\n'), std::string::npos); };

  const auto empty = error_of([&] { io::write_lora(path, LoraWeights{}, LoraFormat::kPeft); });
  EXPECT_HAS(empty, "cannot write LoRA file '" + path + "'");
  EXPECT_HAS(empty, "no targets");
  one_line(empty);

  LoraWeights vae;
  vae.components["vae"].push_back(random_target("decoder.conv_in", {8, 4, 3, 3}, 2, {}, gen));
  const auto component = error_of([&] { io::lora_to_tensors(vae, LoraFormat::kDiffusers); });
  EXPECT_HAS(component, "lora_to_tensors: component 'vae'");
  one_line(component);

  LoraWeights clash;
  clash.components["unet"].push_back(random_target("a.b_c", {8, 8}, 2, {}, gen));
  clash.components["unet"].push_back(random_target("a_b.c", {8, 8}, 2, {}, gen));
  EXPECT_NO_THROW(io::lora_to_tensors(clash, LoraFormat::kPeft));
  const auto same_key = error_of([&] { io::write_lora(path, clash, LoraFormat::kKohya); });
  EXPECT_HAS(same_key, "lora_unet_a_b_c.lora_down.weight");
  EXPECT_HAS(same_key, "write a Diffusers or PEFT file");
  one_line(same_key);

  LoraWeights bad;
  auto t = random_target("conv_in", {32, 3, 3, 3}, 2, {}, gen);
  t.up = at::randn({32, 2, 3, 3}, gen);
  bad.components["unet"].push_back(t);
  const auto pair = error_of([&] { io::write_lora(path, bad, LoraFormat::kDiffusers); });
  EXPECT_HAS(pair, "unet target 'conv_in'");
  EXPECT_HAS(pair, "[32, 2, 3, 3]");
  EXPECT_HAS(pair, "[out, r, 1, 1]");
  one_line(pair);

  bad.components["unet"][0] = random_target("conv_in", {32, 3, 3, 3}, 2, 1e-60, gen);
  EXPECT_NO_THROW(io::lora_to_tensors(bad, LoraFormat::kPeft));  // folded into up there
  EXPECT_HAS(error_of([&] { io::lora_to_tensors(bad, LoraFormat::kKohya); }),
             "float32 kohya alpha cannot hold");
  EXPECT_FALSE(fs::exists(path));  // nothing was written by any failed call
  fs::remove_all(dir);
}

// ---------------------------------------------------------------- merge_lora_into_folder

TEST(LoraFolderMerge, Fp16VariantFolderKeepsItsLayoutAndDtype) {
  const auto dir = temp_dir("lora_folder");
  const std::string in = dir + "/model", out = dir + "/merged";
  // A UNet folder with float32 weights, an fp16 variant of them, a scheduler config and a README.
  fs::create_directories(in + "/extra");
  for (const char* f : {"config.json", "diffusion_pytorch_model.safetensors"}) {
    fs::copy_file(kDiffusersGolden + "unet2d/" + f, in + "/" + f);
  }
  auto unet = models::load_unet(kDiffusersGolden + "unet2d");
  unet->to(torch::kFloat16);
  models::save_unet(*unet, in, "fp16");
  std::ofstream(in + "/scheduler_config.json") << R"({"_class_name": "DDPMScheduler"})";
  // A symlink, as in the Hugging Face cache: the output gets a copy of its target.
  std::ofstream(dir + "/notes.txt") << "notes\n";
  fs::create_symlink(dir + "/notes.txt", in + "/extra/README.md");

  auto base = models::load_unet(kDiffusersGolden + "unet2d");
  const LoraWeights lora = random_lora(*base, 22);
  const std::string lora_path = dir + "/lora.safetensors";
  io::write_lora(lora_path, lora, LoraFormat::kKohya);

  models::LoraFolderMergeOptions options;
  options.variant = "fp16";
  options.lora_scale = 0.5;
  const auto summary = models::merge_lora_into_folder(in, lora_path, out, options);
  EXPECT_EQ(summary.modules_merged, static_cast<int64_t>(lora.count("unet")));
  EXPECT_EQ(summary.skipped_components.at("text_encoder"), 1);
  EXPECT_EQ(summary.skipped_files, std::vector<std::string>{"diffusion_pytorch_model.safetensors"});
  EXPECT_EQ(summary.files_copied, 2);
  EXPECT_EQ(summary.weights_written,
            std::vector<std::string>{
                (fs::absolute(out) / "diffusion_pytorch_model.fp16.safetensors").string()});
  EXPECT_FALSE(fs::exists(out + "/diffusion_pytorch_model.safetensors"));
  EXPECT_TRUE(fs::is_regular_file(fs::symlink_status(out + "/extra/README.md")));
  EXPECT_EQ(fs::file_size(out + "/extra/README.md"), 6u);
  EXPECT_TRUE(fs::exists(out + "/scheduler_config.json"));
  const auto file = io::load_safetensors(out + "/diffusion_pytorch_model.fp16.safetensors");
  for (const auto& [key, t] : file.tensors) {
    if (t.is_floating_point()) {
      EXPECT_EQ(t.scalar_type(), torch::kFloat16) << key;
    }
  }
  // In memory: the fp16 weights in float32, merged, rounded once back to fp16.
  auto expected = models::load_unet(in, "fp16");
  models::merge_lora(*expected, lora, 0.5);
  expected->to(torch::kFloat16);
  expected->to(torch::kFloat32);
  auto merged = models::load_unet(out, "fp16");
  const double diff = max_weight_diff(*merged, *expected);
  std::printf("fp16 folder merge vs in-memory merge: max |diff| %.3g (tol 0)\n", diff);
  EXPECT_EQ(diff, 0.0);
  fs::remove_all(dir);
}

// A PEFT adapter folder (adapter_model.safetensors + adapter_config.json, lora_alpha 8 at r 4)
// merges with scale 2, as PEFT applies it.
TEST(LoraFolderMerge, PeftAdapterFolderMergesWithItsAlpha) {
  const auto dir = temp_dir("lora_folder_peft");
  fs::create_directories(dir + "/adapter");
  fs::copy_file(kDiffusersGolden + "lora/peft_format.safetensors",
                dir + "/adapter/adapter_model.safetensors");
  difftrain::test::write_text(dir + "/adapter/adapter_config.json",
                              R"({"peft_type": "LORA", "r": 4, "lora_alpha": 8})");
  const auto summary = models::merge_lora_into_folder(kDiffusersGolden + "unet_cond",
                                                      dir + "/adapter", dir + "/merged");
  EXPECT_EQ(summary.format, LoraFormat::kPeft);
  auto expected = models::load_unet(kDiffusersGolden + "unet_cond");
  models::merge_lora(
      *expected, io::read_lora(kDiffusersGolden + "lora/pytorch_lora_weights.safetensors"), 2.0);
  const double diff = max_weight_diff(*models::load_unet(dir + "/merged"), *expected);
  std::printf("PEFT folder merge (alpha 8, r 4) vs merge at scale 2: max |diff| %.3g (tol 1e-6)\n",
              diff);
  EXPECT_LE(diff, 1e-6);
  fs::remove_all(dir);
}

TEST(LoraFolderMerge, RefusesBadFoldersWithOneLineErrors) {
  const auto dir = temp_dir("lora_folder_bad");
  const std::string model = kDiffusersGolden + "unet_cond";
  const std::string lora = kDiffusersGolden + "lora/peft_format.safetensors";
  fs::create_directories(dir + "/full");
  std::ofstream(dir + "/full/x") << "x";
  fs::create_directories(dir + "/empty");
  struct Case {
    std::string model, lora, output;
    std::vector<std::string> expect;
  };
  const std::vector<Case> cases = {
      {dir + "/none", lora, dir + "/o1", {dir + "/none: no such folder"}},
      {dir + "/full", lora, dir + "/o2", {dir + "/full: neither model_index.json"}},
      {model, dir + "/none.safetensors", dir + "/o3", {dir + "/none.safetensors: no such LoRA"}},
      {model, lora, dir + "/full", {dir + "/full: exists and is not empty"}},
      {model, lora, model, {"is the input folder"}},
      {model, lora, model + "/sub", {"inside the input folder"}},
      {kDiffusersGolden + "unet2d", lora, dir + "/o4", {"is not in the model", "peft_format"}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.output);
    const auto msg = error_of([&] { models::merge_lora_into_folder(c.model, c.lora, c.output); });
    for (const auto& part : c.expect) EXPECT_HAS(msg, part);
    EXPECT_EQ(msg.find('\n'), std::string::npos);
  }
  // No output and no staging folder is left by the failures; an empty output folder is fine.
  for (const auto& entry : fs::directory_iterator(dir)) {
    EXPECT_TRUE(entry.path().filename() == "full" || entry.path().filename() == "empty")
        << entry.path();
  }
  models::merge_lora_into_folder(model, lora, dir + "/empty");
  EXPECT_TRUE(fs::exists(dir + "/empty/diffusion_pytorch_model.safetensors"));
  EXPECT_TRUE(fs::exists(dir + "/empty/config.json"));
  EXPECT_FALSE(fs::exists(dir + "/empty.partial-" + std::to_string(::getpid())));
  fs::remove_all(dir);
}

}  // namespace
