// LoRA files whose key conventions differ per module, and the r / alpha kept beside the weights:
// a file mixing Diffusers, PEFT and kohya keys (built from the Diffusers fixture's weights plus
// proj_in / proj_out / ff / conv / time_emb_proj targets) runs the UNet exactly as the same LoRA
// in one convention; incomplete, doubled and misshapen modules are refused naming the module;
// PEFT's adapter_config.json and Diffusers' `lora_adapter_metadata` set each module's scale.

#include "difftrain/core/error.h"
#include "difftrain/io/atomic_file.h"
#include "difftrain/io/lora_adapter_config.h"
#include "difftrain/io/lora_format.h"
#include "difftrain/io/safetensors.h"
#include "difftrain/models/lora/lora.h"
#include "difftrain/models/pretrained.h"
#include "difftrain/models/unets/unet.h"

#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <functional>

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
using io::TensorMap;

using difftrain::test::kDiffusersGolden;

// The fixture LoRA (r 4, alpha 4, attention projections of unet_cond) plus targets on the
// modules Diffusers' convert_state_dict_to_diffusers leaves in PEFT naming.
LoraWeights fixture_plus_other_targets() {
  LoraWeights lora = io::read_lora(kDiffusersGolden + "lora/pytorch_lora_weights.safetensors");
  auto gen = at::detail::createCPUGenerator(11);
  struct Spec {
    const char* module;
    std::vector<int64_t> weight;
    int64_t r;
    std::optional<double> alpha;
  };
  const std::vector<Spec> specs = {
      {"down_blocks.0.attentions.0.proj_in", {32, 32, 1, 1}, 4, 8.0},
      {"mid_block.attentions.0.proj_out", {64, 64, 1, 1}, 2, std::nullopt},
      {"down_blocks.0.attentions.0.transformer_blocks.0.ff.net.0.proj", {256, 32}, 4, 2.0},
      {"up_blocks.1.attentions.1.transformer_blocks.0.ff.net.2", {32, 128}, 3, 6.0},
      {"down_blocks.1.resnets.0.conv1", {64, 32, 3, 3}, 2, 1.0},
      {"mid_block.resnets.1.time_emb_proj", {64, 128}, 4, 4.0},
  };
  for (const auto& s : specs) {
    LoraTarget t;
    t.module = s.module;
    t.key = s.module;
    std::vector<int64_t> down{s.r, s.weight[1]}, up{s.weight[0], s.r};
    if (s.weight.size() == 4) {
      down.insert(down.end(), {s.weight[2], s.weight[3]});
      up.insert(up.end(), {1, 1});
    }
    t.down = at::randn(down, gen) * 0.1;
    t.up = at::randn(up, gen) * 0.1;
    t.alpha = s.alpha;
    lora.components["unet"].push_back(t);
  }
  return lora;
}

// Which convention the mixed file keys `module` in: attention projections Diffusers (except
// the up blocks' attn2, kohya), proj_in / proj_out / ff PEFT (as convert_state_dict_to_diffusers
// leaves them), resnets kohya.
LoraFormat convention_of(const std::string& module) {
  auto has = [&](const char* part) { return module.find(part) != std::string::npos; };
  if (has("resnets") || (has("up_blocks") && has("attn2"))) return LoraFormat::kKohya;
  if (has("proj_in") || has("proj_out") || has(".ff.")) return LoraFormat::kPeft;
  return LoraFormat::kDiffusers;
}

TensorMap mixed_tensors(const LoraWeights& lora) {
  TensorMap out;
  for (const LoraFormat f : {LoraFormat::kDiffusers, LoraFormat::kPeft, LoraFormat::kKohya}) {
    LoraWeights part;
    for (const auto& t : lora.targets("unet"))
      if (convention_of(t.module) == f) part.components["unet"].push_back(t);
    if (part.count("unet") == 0) continue;
    for (auto& [key, tensor] : io::lora_to_tensors(part, f)) out.emplace(key, tensor);
  }
  return out;
}

torch::Tensor forward_with(const LoraWeights& lora) {
  auto unet = models::load_unet(kDiffusersGolden + "unet_cond");
  unet->eval();
  models::merge_lora(*unet, lora);
  const auto io_tensors =
      io::load_safetensors(kDiffusersGolden + "unet_cond/io.safetensors").tensors;
  models::UNetConditioning cond;
  cond.encoder_hidden_states = io_tensors.at("encoder_hidden_states");
  torch::NoGradGuard no_grad;
  return unet->forward(io_tensors.at("sample"), io_tensors.at("timestep"), cond);
}

// ---------------------------------------------------------------- mixed conventions

// Tolerance 1e-5: the single-convention file folds alpha / r into up (one float32 rounding),
// the mixed one keeps kohya alphas; a lost or mis-scaled module moves the output by > 1e-3.
TEST(LoraConventions, MixedFileRunsLikeTheSingleConventionFile) {
  const auto dir = temp_dir("lora_mixed");
  const LoraWeights lora = fixture_plus_other_targets();
  const TensorMap mixed = mixed_tensors(lora);
  io::save_safetensors(dir + "/mixed.safetensors", mixed);
  io::save_safetensors(dir + "/single.safetensors",
                       io::lora_to_tensors(lora, LoraFormat::kDiffusers));
  EXPECT_TRUE(
      mixed.count("unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.lora."
                  "down.weight"));
  EXPECT_TRUE(mixed.count("unet.down_blocks.0.attentions.0.proj_in.lora_A.weight"));
  EXPECT_TRUE(mixed.count("lora_unet_down_blocks_1_resnets_0_conv1.alpha"));
  EXPECT_TRUE(mixed.count(
      "lora_unet_up_blocks_1_attentions_0_transformer_blocks_0_attn2_to_k.lora_down.weight"));

  const auto back = io::read_lora(dir + "/mixed.safetensors");
  EXPECT_TRUE(back.mixed);
  EXPECT_EQ(back.format, LoraFormat::kDiffusers);  // most modules
  EXPECT_EQ(back.count("unet"), lora.count("unet"));
  int per[3] = {0, 0, 0};
  for (const auto& t : back.targets("unet")) ++per[static_cast<int>(t.format)];
  std::printf("mixed file: %d Diffusers, %d PEFT, %d kohya modules\n", per[0], per[1], per[2]);
  EXPECT_GT(per[0], 0);
  EXPECT_EQ(per[1], 4);
  EXPECT_GT(per[2], 2);

  const auto single = io::read_lora(dir + "/single.safetensors");
  EXPECT_FALSE(single.mixed);
  const auto expected = forward_with(single);
  const auto got = forward_with(back);
  const double diff = max_abs(got, expected);
  const double effect = max_abs(expected, forward_with(LoraWeights{}));
  std::printf(
      "mixed vs single-convention UNet forward: max |diff| %.3g (tol 1e-5); LoRA effect "
      "%.3g\n",
      diff, effect);
  EXPECT_LE(diff, 1e-5);
  EXPECT_GT(effect, 1e-3);
  fs::remove_all(dir);
}

TEST(LoraConventions, RefusesOnlyBadModulesNamingThem) {
  const auto dir = temp_dir("lora_mixed_bad");
  const std::string path = dir + "/bad.safetensors";
  const std::string m = "mid_block.attentions.0.transformer_blocks.0.attn1.to_q";
  auto gen = at::detail::createCPUGenerator(7);
  auto w = [&](std::vector<int64_t> shape) { return at::randn(shape, gen); };
  // A good module in each convention, then one bad module.
  const TensorMap good = {
      {"unet.down_blocks.0.attentions.0.proj_in.lora_A.weight", w({2, 32, 1, 1})},
      {"unet.down_blocks.0.attentions.0.proj_in.lora_B.weight", w({32, 2, 1, 1})},
      {"unet." + m + ".lora.down.weight", w({4, 64})},
      {"unet." + m + ".lora.up.weight", w({64, 4})},
      {"lora_unet_mid_block_resnets_0_time_emb_proj.alpha", torch::tensor(2.0)},
      {"lora_unet_mid_block_resnets_0_time_emb_proj.lora_down.weight", w({4, 128})},
      {"lora_unet_mid_block_resnets_0_time_emb_proj.lora_up.weight", w({64, 4})},
  };
  EXPECT_NO_THROW(io::parse_lora(good, path));
  auto read_with = [&](TensorMap extra) {
    TensorMap t = good;
    for (auto& [k, v] : extra) t[k] = v;
    io::save_safetensors(path, t);
    return error_of([&] { io::read_lora(path); });
  };
  const std::string file = "LoRA file '" + path + "': ";
  const std::string ff = "unet.down_blocks.0.attentions.0.transformer_blocks.0.ff.net.2";

  const auto incomplete = read_with({{ff + ".lora_A.weight", w({2, 128})}});
  std::printf("incomplete: %s\n", incomplete.c_str());
  EXPECT_EQ(incomplete, file + "'" + ff + ".lora_A.weight' has no matching up weight (expected '" +
                            ff +
                            ".lora_B.weight'); the file is incomplete — re-export or "
                            "re-download it");

  const auto twice = read_with(
      {{"unet." + m + ".lora_A.weight", w({4, 64})}, {"unet." + m + ".lora_B.weight", w({64, 4})}});
  std::printf("two conventions: %s\n", twice.c_str());
  EXPECT_EQ(twice, file + "'unet." + m + ".lora.down.weight' (diffusers) and 'unet." + m +
                       ".lora_A.weight' (peft) both give unet module '" + m +
                       "': a module's LoRA must be in one key convention; keep one of them");

  const auto split =
      read_with({{ff + ".lora.down.weight", w({2, 128})}, {ff + ".lora_B.weight", w({32, 2})}});
  EXPECT_HAS(split, "both give unet module '" + ff.substr(5) + "'");

  const auto misshapen =
      read_with({{ff + ".lora_A.weight", w({2, 128})}, {ff + ".lora_B.weight", w({32, 3})}});
  std::printf("misshapen: %s\n", misshapen.c_str());
  EXPECT_EQ(misshapen, file + "'" + ff + ".lora_A.weight' has rank 2 ([2, 128] Float) but '" + ff +
                           ".lora_B.weight' has rank 3 ([32, 3] Float): down is [r, ...] and up "
                           "is [out, r, ...] with the same r >= 1; the file is corrupt — "
                           "re-export it");

  // kohya names resolve against the model, so a module given in kohya and another convention
  // is found when the LoRA is applied, and nothing is changed.
  TensorMap doubled = good;
  doubled["lora_unet_mid_block_attentions_0_transformer_blocks_0_attn1_to_q.lora_down.weight"] =
      w({4, 64});
  doubled["lora_unet_mid_block_attentions_0_transformer_blocks_0_attn1_to_q.lora_up.weight"] =
      w({64, 4});
  io::save_safetensors(path, doubled);
  const auto lora = io::read_lora(path);
  auto unet = models::load_unet(kDiffusersGolden + "unet_cond");
  const auto before = unet->named_parameters()[m + ".weight"].clone();
  const auto kohya = error_of([&] { models::merge_lora(*unet, lora); });
  std::printf("kohya + diffusers: %s\n", kohya.c_str());
  EXPECT_EQ(kohya, file + "'unet." + m + ".lora' (diffusers) and 'lora_unet_" + io::kohya_name(m) +
                       "' (kohya) both give unet module '" + m +
                       "': a module's LoRA must be in one key convention; keep one of them");
  EXPECT_TRUE(torch::equal(before, unet->named_parameters()[m + ".weight"]));
  for (const auto& msg : {incomplete, twice, split, misshapen, kohya})
    EXPECT_EQ(msg.find('\n'), std::string::npos);
  fs::remove_all(dir);
}

// ---------------------------------------------------------------- r and alpha beside the weights

// max |delta(t) - factor(t) * delta(reference t)| over the targets, matched by module.
double max_scaled_diff(const LoraWeights& got, const LoraWeights& reference,
                       const std::function<double(const std::string&)>& factor) {
  double worst = 0;
  EXPECT_EQ(got.count("unet"), reference.count("unet"));
  for (const auto& t : got.targets("unet")) {
    for (const auto& r : reference.targets("unet")) {
      if (r.module != t.module) continue;
      worst =
          std::max(worst, max_abs(models::lora_delta(t), models::lora_delta(r) * factor(t.module)));
    }
  }
  return worst;
}

TEST(LoraConventions, PeftAdapterConfigSetsTheScale) {
  const auto dir = temp_dir("lora_peft_config");
  const auto reference = io::read_lora(kDiffusersGolden + "lora/pytorch_lora_weights.safetensors");
  // As PEFT's save_pretrained lays it out: adapter_model.safetensors + adapter_config.json.
  fs::copy_file(kDiffusersGolden + "lora/peft_format.safetensors",
                dir + "/adapter_model.safetensors");
  difftrain::test::write_text(dir + "/adapter_config.json", R"({
  "alpha_pattern": {"attn2.to_k": 2},
  "base_model_name_or_path": null,
  "bias": "none",
  "lora_alpha": 8,
  "lora_dropout": 0.0,
  "peft_type": "LORA",
  "r": 4,
  "rank_pattern": {},
  "target_modules": ["to_q", "to_k", "to_v", "to_out.0"],
  "task_type": null,
  "use_rslora": false
})");
  // Scale 8 / 4 = 2, and 2 / 4 = 0.5 for every attn2.to_k (PEFT's `.*\.attn2.to_k$`).
  auto factor = [](const std::string& m) { return m.find("attn2.to_k") != m.npos ? 0.5 : 2.0; };
  for (const std::string& where : {dir, dir + "/adapter_model.safetensors"}) {
    const auto lora = io::read_lora(where);
    EXPECT_EQ(lora.format, LoraFormat::kPeft);
    const double diff = max_scaled_diff(lora, reference, factor);
    std::printf("adapter_config.json (%s): max |delta - scale * fixture delta| %.3g (tol 1e-6)\n",
                where == dir ? "folder" : "file", diff);
    EXPECT_LE(diff, 1e-6);
  }
  // Explicitly none: scale 1 as the file alone says.
  io::LoraReadOptions none;
  none.adapter_config = "";
  EXPECT_LE(max_scaled_diff(io::read_lora(dir, none), reference, [](auto&) { return 1.0; }), 1e-6);
  // use_rslora: alpha / sqrt(r) = 8 / 2.
  difftrain::test::write_text(dir + "/adapter_config.json",
                              R"({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                  "use_rslora": true})");
  EXPECT_LE(max_scaled_diff(io::read_lora(dir), reference, [](auto&) { return 4.0; }), 1e-6);
  // A config whose r is not the weights' rank describes another adapter.
  difftrain::test::write_text(dir + "/adapter_config.json",
                              R"({"peft_type": "LORA", "r": 8, "lora_alpha": 8})");
  const auto msg = error_of([&] { io::read_lora(dir); });
  std::printf("rank mismatch: %s\n", msg.c_str());
  EXPECT_HAS(msg, "has rank 4 but '" + dir + "/adapter_config.json' gives it r = 8");
  difftrain::test::write_text(dir + "/adapter_config.json", R"({"r": "four"})");
  EXPECT_HAS(error_of([&] { io::read_lora(dir); }),
             "adapter config '" + dir + "/adapter_config.json': 'r' is \"four\"");
  fs::remove_all(dir);
}

TEST(LoraConventions, DiffusersMetadataSetsTheScaleAndKohyaAlphaWins) {
  const auto dir = temp_dir("lora_metadata");
  const auto reference = io::read_lora(kDiffusersGolden + "lora/pytorch_lora_weights.safetensors");
  const auto diffusers =
      io::load_safetensors(kDiffusersGolden + "lora/pytorch_lora_weights.safetensors");
  // As Diffusers >= 0.33's pipeline save_lora_weights writes it: keys prefixed by component.
  const std::string prefixed = R"({
  "unet.alpha_pattern": {"down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q": 12},
  "unet.lora_alpha": 2,
  "unet.r": 4,
  "unet.rank_pattern": {},
  "unet.target_modules": ["to_k", "to_out.0", "to_q", "to_v"],
  "unet.use_rslora": false
})";
  const std::string path = dir + "/pytorch_lora_weights.safetensors";
  io::save_safetensors(path, diffusers.tensors,
                       {{"format", "pt"}, {io::kLoraAdapterMetadataKey, prefixed}});
  auto factor = [](const std::string& m) {
    return m == "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q" ? 3.0 : 0.5;
  };
  double diff = max_scaled_diff(io::read_lora(path), reference, factor);
  std::printf("prefixed lora_adapter_metadata: max |diff| %.3g (tol 1e-6)\n", diff);
  EXPECT_LE(diff, 1e-6);
  // A model's save_lora_adapter writes the keys unprefixed; they apply to every component.
  io::save_safetensors(path, diffusers.tensors,
                       {{io::kLoraAdapterMetadataKey, R"({"r": 4, "lora_alpha": 1})"}});
  diff = max_scaled_diff(io::read_lora(path), reference, [](auto&) { return 0.25; });
  EXPECT_LE(diff, 1e-6);
  // The file's metadata wins over adapter_config.json and over the caller's alpha.
  difftrain::test::write_text(dir + "/adapter_config.json", R"({"r": 4, "lora_alpha": 16})");
  io::LoraReadOptions opts;
  opts.alpha = 40;
  EXPECT_LE(max_scaled_diff(io::read_lora(path, opts), reference, [](auto&) { return 0.25; }),
            1e-6);
  fs::remove(dir + "/adapter_config.json");

  // kohya: each module's .alpha (here 4, scale 1) wins over the metadata's lora_alpha; in a
  // mixed file the metadata still sets the Diffusers- and PEFT-keyed modules.
  LoraWeights mixed_lora = reference;
  const TensorMap mixed = mixed_tensors(mixed_lora);
  io::save_safetensors(path, mixed, {{io::kLoraAdapterMetadataKey, prefixed}});
  auto kohya_first = io::read_lora(path);
  auto unet = models::load_unet(kDiffusersGolden + "unet_cond");
  io::resolve_kohya_names(kohya_first, "unet", models::lora_module_names(*unet));
  diff = max_scaled_diff(kohya_first, reference, [&](const std::string& m) {
    return convention_of(m) == LoraFormat::kKohya ? 1.0 : factor(m);
  });
  std::printf("mixed file with metadata, kohya .alpha kept: max |diff| %.3g (tol 1e-6)\n", diff);
  EXPECT_LE(diff, 1e-6);

  io::save_safetensors(path, diffusers.tensors,
                       {{io::kLoraAdapterMetadataKey, R"({"unet.r": 4, "unet.lora_alpha": [1]})"}});
  EXPECT_HAS(error_of([&] { io::read_lora(path); }),
             "LoRA file '" + path + "': lora_adapter_metadata (unet): 'lora_alpha' is [1]");
  io::save_safetensors(path, diffusers.tensors, {{io::kLoraAdapterMetadataKey, "not json"}});
  EXPECT_HAS(error_of([&] { io::read_lora(path); }), "is not valid JSON");
  fs::remove_all(dir);
}

}  // namespace
