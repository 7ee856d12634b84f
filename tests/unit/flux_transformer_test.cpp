// Diffusers' FluxTransformer2DModel (v0.31): parity with the tiny FLUX.1 fixture (io cases A and
// B, every intermediate of A, one training step's gradients), exact key names, packing, gradient
// checkpointing, bf16, a FLUX.1-schnell style config (no guidance), other sizes, save/load and
// config errors. Tolerances are the fixture README's.

#include "difftrain/models/transformers/flux_transformer.h"
#include "difftrain/core/error.h"
#include "difftrain/core/forward_hooks.h"
#include "difftrain/io/safetensors.h"
#include "difftrain/models/layers.h"
#include "difftrain/models/pretrained.h"
#include "difftrain/models/transformers/flux_packing.h"

#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <filesystem>

namespace {

using difftrain::io::TensorMap;
using difftrain::models::FluxTransformer2DModel;
using difftrain::models::FluxTransformer2DModelOptions;
using difftrain::models::FluxTransformerIntermediates;
using difftrain::test::error_of;
using difftrain::test::max_abs;
using difftrain::test::read_json;
using difftrain::test::temp_dir;
using difftrain::test::write_text;
using nlohmann::json;
namespace fs = std::filesystem;
namespace dm = difftrain::models;

const std::string kFlux = difftrain::test::kGoldenDir + "flux/tiny_flux/";
const std::string kFluxTransformer = kFlux + "transformer";

TensorMap flux_io() {
  return difftrain::io::load_safetensors(kFluxTransformer + "/io.safetensors").tensors;
}

// The model's output for io case `c` ("A" or "B") of transformer/io.safetensors.
torch::Tensor flux_run_case(FluxTransformer2DModel& model, const TensorMap& io,
                            const std::string& c, FluxTransformerIntermediates* inter = nullptr) {
  return model->forward(io.at(c + ".hidden_states"), io.at(c + ".encoder_hidden_states"),
                        io.at(c + ".pooled_projections"), io.at(c + ".timestep"),
                        io.at(c + ".guidance"), io.at(c + ".img_ids"), io.at(c + ".txt_ids"),
                        inter);
}

TEST(FluxTransformer, ParameterNamesAndShapesEqualTheFile) {
  FluxTransformer2DModel model(
      FluxTransformer2DModelOptions::load(kFluxTransformer + "/config.json"));
  const TensorMap file =
      difftrain::io::load_safetensors(kFluxTransformer + "/diffusion_pytorch_model.safetensors")
          .tensors;
  const TensorMap own = dm::named_tensors(*model);
  EXPECT_EQ(file.size(), 112u);
  EXPECT_EQ(own.size(), file.size());
  for (const auto& [name, t] : file) {
    auto it = own.find(name);
    ASSERT_NE(it, own.end()) << "model lacks " << name;
    EXPECT_EQ(it->second.sizes(), t.sizes()) << name;
  }
  for (const auto& [name, t] : own) EXPECT_TRUE(file.count(name)) << "not in the file: " << name;
  EXPECT_EQ(model->no_split_modules(),
            (std::vector<std::string>{"FluxTransformerBlock", "FluxSingleTransformerBlock"}));
}

TEST(FluxTransformer, CaseAAndEveryIntermediateMatchDiffusers) {
  FluxTransformer2DModel model = dm::load_flux_transformer(kFluxTransformer);
  model->eval();
  const TensorMap io = flux_io();
  torch::NoGradGuard no_grad;
  FluxTransformerIntermediates inter;
  const torch::Tensor out = flux_run_case(model, io, "A", &inter);
  ASSERT_EQ(out.sizes(), io.at("A.out").sizes());
  std::vector<std::pair<std::string, torch::Tensor>> checks = {{"out", out},
                                                               {"inter.temb", inter.temb},
                                                               {"inter.rope_cos", inter.rope_cos},
                                                               {"inter.rope_sin", inter.rope_sin},
                                                               {"inter.norm_out", inter.norm_out}};
  ASSERT_EQ(inter.double_img.size(), 2u);
  ASSERT_EQ(inter.single.size(), 2u);
  for (size_t i = 0; i < inter.double_img.size(); ++i) {
    checks.push_back({"inter.double_" + std::to_string(i) + "_img", inter.double_img[i]});
    checks.push_back({"inter.double_" + std::to_string(i) + "_txt", inter.double_txt[i]});
  }
  for (size_t i = 0; i < inter.single.size(); ++i) {
    checks.push_back({"inter.single_" + std::to_string(i), inter.single[i]});
  }
  for (const auto& [name, got] : checks) {
    const torch::Tensor& want = io.at("A." + name);
    ASSERT_EQ(got.sizes(), want.sizes()) << name;
    const double tol = name == "inter.temb" ? 2e-4 : 1e-4;
    const double diff = max_abs(got, want);
    std::cout << "  A." << name << " max abs diff " << diff << " (tolerance " << tol << ")\n";
    EXPECT_LE(diff, tol) << name;
  }
}

TEST(FluxTransformer, CaseBMatchesDiffusersAnd3dIdsAreAccepted) {
  FluxTransformer2DModel model = dm::load_flux_transformer(kFluxTransformer);
  model->eval();
  const TensorMap io = flux_io();
  torch::NoGradGuard no_grad;
  const torch::Tensor out = flux_run_case(model, io, "B");
  const double diff = max_abs(out, io.at("B.out"));
  std::cout << "  B.out max abs diff " << diff << " (tolerance 1e-4)\n";
  EXPECT_LE(diff, 1e-4);
  // v0.31 takes [0] of 3-D ids (with a deprecation warning).
  const torch::Tensor out3 =
      model->forward(io.at("B.hidden_states"), io.at("B.encoder_hidden_states"),
                     io.at("B.pooled_projections"), io.at("B.timestep"), io.at("B.guidance"),
                     io.at("B.img_ids").unsqueeze(0), io.at("B.txt_ids").unsqueeze(0));
  EXPECT_EQ(max_abs(out3, out), 0.0);
}

TEST(FluxTransformer, PackingAndIdsMatchThePipelineFixture) {
  const TensorMap t = difftrain::io::load_safetensors(kFlux + "txt2img_seed42.safetensors").tensors;
  const torch::Tensor z = t.at("latents_init");  // [2, 16, 24, 32]
  const torch::Tensor packed = dm::pack_latents(z);
  ASSERT_EQ(packed.sizes(), t.at("latents_init_packed").sizes());
  EXPECT_EQ(max_abs(packed, t.at("latents_init_packed")), 0.0);
  EXPECT_EQ(max_abs(dm::unpack_latents(packed, 24, 32), z), 0.0);
  const torch::Tensor unpacked = dm::unpack_latents(t.at("latents_final"), 24, 32);
  EXPECT_EQ(max_abs(unpacked, t.at("latents_final_unpacked")), 0.0);
  const torch::Tensor ids = dm::latent_image_ids(12, 16);
  ASSERT_EQ(ids.sizes(), t.at("latent_image_ids").sizes());
  EXPECT_EQ(max_abs(ids, t.at("latent_image_ids")), 0.0);
  EXPECT_NE(error_of([&] {
              dm::pack_latents(torch::zeros({1, 4, 5, 6}));
            }).find("even"),
            std::string::npos);
  EXPECT_NE(error_of([&] { dm::unpack_latents(packed, 24, 30); }).find("latent"),
            std::string::npos);
}

// One full fine-tune step of train_dreambooth_lora_flux.py (scheme logit_normal): model_pred,
// loss and every parameter's gradient.
TEST(FluxTransformer, TrainingStepGradientsMatchDiffusers) {
  FluxTransformer2DModel model = dm::load_flux_transformer(kFluxTransformer);
  model->train();
  const TensorMap t = difftrain::io::load_safetensors(kFlux + "train_step.safetensors").tensors;
  const std::string s = "logit_normal.";
  const torch::Tensor pred_packed =
      model->forward(t.at(s + "packed_noisy_model_input"), t.at("prompt_embeds"),
                     t.at("pooled_prompt_embeds"), t.at(s + "timestep_model_input"),
                     t.at("guidance"), t.at("latent_image_ids"), t.at("text_ids"));
  const torch::Tensor pred = dm::unpack_latents(pred_packed, 24, 32);
  const torch::Tensor loss = (pred - t.at("target")).square().mean();
  loss.backward();
  const double pred_diff = max_abs(pred, t.at(s + "model_pred"));
  const double loss_diff = max_abs(loss, t.at(s + "loss"));
  double grad_diff = 0;
  size_t n = 0;
  for (const auto& p : model->named_parameters()) {
    ASSERT_TRUE(p.value().grad().defined()) << p.key();
    grad_diff = std::max(grad_diff, max_abs(p.value().grad(), t.at("grad." + p.key())));
    ++n;
  }
  std::cout << "  model_pred " << pred_diff << " (2e-4), loss " << loss_diff
            << " (1e-5), gradients of " << n << " parameters " << grad_diff << " (2e-5)\n";
  EXPECT_EQ(n, 112u);
  EXPECT_LE(pred_diff, 2e-4);
  EXPECT_LE(loss_diff, 1e-5);
  EXPECT_LE(grad_diff, 2e-5);
}

TEST(FluxTransformer, GradientCheckpointingGivesTheSameGradients) {
  FluxTransformer2DModel model = dm::load_flux_transformer(kFluxTransformer);
  model->train();
  const TensorMap io = flux_io();
  auto grads_of = [&](bool checkpointing) {
    model->set_gradient_checkpointing(checkpointing);
    model->zero_grad();
    torch::Tensor x = io.at("A.hidden_states").clone().requires_grad_(true);
    torch::Tensor out = model->forward(x, io.at("A.encoder_hidden_states"),
                                       io.at("A.pooled_projections"), io.at("A.timestep"),
                                       io.at("A.guidance"), io.at("A.img_ids"), io.at("A.txt_ids"));
    (out.square().mean() + out.sum() * 1e-3).backward();
    std::vector<torch::Tensor> g{out.detach(), x.grad().clone()};
    for (const auto& p : model->parameters()) g.push_back(p.grad().clone());
    return g;
  };
  const auto plain = grads_of(false);
  const auto ckpt = grads_of(true);
  ASSERT_EQ(plain.size(), ckpt.size());
  double diff = 0;
  for (size_t i = 0; i < plain.size(); ++i) diff = std::max(diff, max_abs(plain[i], ckpt[i]));
  std::cout << "  checkpointed vs plain: outputs and gradients max abs diff " << diff
            << " (tolerance 1e-6)\n";
  EXPECT_LE(diff, 1e-6);
  EXPECT_GT(plain.back().abs().max().item<double>(), 0.0);
}

// The model drops the text rows after the last single block, so that block computes only the
// image rows (its queries, MLP and output projection); asking for the intermediates keeps every
// row. Both give the same output and gradients (float32 and bf16, plain and checkpointed), and
// the pruned block's output really is [B, L, D] (a hook on it sees the shape).
TEST(FluxTransformer, TheLastSingleBlockComputesOnlyTheImageRows) {
  struct ShapeHook : difftrain::core::ForwardHooks {
    std::vector<int64_t> rows;
    void before_forward(const torch::nn::Module&) override {}
    void after_forward(const torch::nn::Module&, std::vector<torch::Tensor>& out) override {
      rows.push_back(out.at(0).size(1));
    }
  };
  const TensorMap io = flux_io();
  const int64_t S = io.at("A.encoder_hidden_states").size(1);
  const int64_t L = io.at("A.hidden_states").size(1);
  for (const auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    FluxTransformer2DModel model = dm::load_flux_transformer(kFluxTransformer, dtype);
    model->train();
    auto modules = model->named_modules();
    const auto& last = *modules["single_transformer_blocks.1"];
    ASSERT_EQ(modules.find("single_transformer_blocks.2"), nullptr);
    auto hook = std::make_shared<ShapeHook>();
    difftrain::core::set_forward_hooks(last, hook);
    auto run = [&](bool whole_rows, bool checkpointing) {
      model->set_gradient_checkpointing(checkpointing);
      model->zero_grad();
      FluxTransformerIntermediates inter;
      torch::Tensor out = model->forward(
          io.at("A.hidden_states").to(dtype), io.at("A.encoder_hidden_states").to(dtype),
          io.at("A.pooled_projections").to(dtype), io.at("A.timestep"), io.at("A.guidance"),
          io.at("A.img_ids"), io.at("A.txt_ids"), whole_rows ? &inter : nullptr);
      out.to(torch::kFloat32).square().mean().backward();
      std::vector<torch::Tensor> g{out.detach().to(torch::kFloat32)};
      for (const auto& p : model->parameters()) g.push_back(p.grad().to(torch::kFloat32));
      return g;
    };
    const auto whole = run(true, false);
    const auto pruned = run(false, false);
    const auto pruned_ckpt = run(false, true);
    difftrain::core::set_forward_hooks(last, nullptr);
    EXPECT_EQ(hook->rows, (std::vector<int64_t>{S + L, L, L, L}));  // checkpointing: twice
    double diff = 0, diff_ckpt = 0;
    for (size_t i = 0; i < whole.size(); ++i) {
      diff = std::max(diff, max_abs(whole[i], pruned[i]));
      diff_ckpt = std::max(diff_ckpt, max_abs(pruned[i], pruned_ckpt[i]));
    }
    // The same rows computed the same way (0 on this project's VMs; a GEMM may block fewer rows
    // differently elsewhere). Checkpointing sums some bf16 gradients in another order (as it
    // does without this change), hence the bf16 tolerance; wrong rope or key rows give ~1e-2.
    const double tol = dtype == torch::kFloat32 ? 1e-6 : 1e-3;
    std::cout << "  " << c10::toString(dtype) << ": image rows only vs every row, output and "
              << whole.size() - 1 << " gradients max abs diff " << diff << ", checkpointed "
              << diff_ckpt << " (tolerance " << tol << ")\n";
    EXPECT_LE(diff, tol);
    EXPECT_LE(diff_ckpt, tol);
  }
}

// bf16 weights and inputs against the float32 model. As in Diffusers, timestep and guidance are
// cast to the model's dtype BEFORE the ·1000 (0.9375 -> 936 in bf16, not 937.5), which moves temb
// by ~24 % and the output by ~5 % against the fixture; so the reference is the float32 model fed
// the same rounded values, and the fixture's distance is only printed.
TEST(FluxTransformer, Bf16RunsCloseToFloat32) {
  FluxTransformer2DModel m16 = dm::load_flux_transformer(kFluxTransformer, torch::kBFloat16);
  FluxTransformer2DModel m32 = dm::load_flux_transformer(kFluxTransformer);
  m16->eval();
  m32->eval();
  for (const auto& p : m16->parameters()) ASSERT_EQ(p.scalar_type(), torch::kBFloat16);
  const TensorMap io = flux_io();
  torch::NoGradGuard no_grad;
  auto bf = [&](const std::string& k) { return io.at(k).to(torch::kBFloat16); };
  const torch::Tensor out = m16->forward(
      bf("A.hidden_states"), bf("A.encoder_hidden_states"), bf("A.pooled_projections"),
      io.at("A.timestep"), io.at("A.guidance"), io.at("A.img_ids"), io.at("A.txt_ids"));
  ASSERT_EQ(out.scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(torch::isfinite(out).all().item<bool>());
  auto bf16_rounded = [&](const std::string& k) {
    return (io.at(k).to(torch::kBFloat16) * 1000).to(torch::kFloat32) / 1000;
  };
  const torch::Tensor ref =
      m32->forward(io.at("A.hidden_states"), io.at("A.encoder_hidden_states"),
                   io.at("A.pooled_projections"), bf16_rounded("A.timestep"),
                   bf16_rounded("A.guidance"), io.at("A.img_ids"), io.at("A.txt_ids"))
          .to(torch::kFloat64);
  auto rel_l2 = [](const torch::Tensor& a, const torch::Tensor& b) {
    const torch::Tensor b64 = b.to(torch::kFloat64);
    return ((a.to(torch::kFloat64) - b64).norm() / b64.norm()).item<double>();
  };
  const double diff = max_abs(out, ref), rel = rel_l2(out, ref);
  std::cout << "  bf16 vs float32 (same rounded timesteps): max abs diff " << diff << " (|out| max "
            << ref.abs().max().item<double>() << ", tolerance 0.05), relative L2 error " << rel
            << " (tolerance 0.02); vs the "
            << "fixture: max abs " << max_abs(out, io.at("A.out")) << ", relative L2 "
            << rel_l2(out, io.at("A.out")) << "\n";
  EXPECT_LE(diff, 0.05);
  EXPECT_LE(rel, 0.02);
}

// A FLUX.1-schnell style model: guidance_embeds false, no guidance_embedder; temb = timestep +
// text terms only, i.e. the dev model's temb less its guidance term.
TEST(FluxTransformer, SchnellConfigHasNoGuidanceEmbedder) {
  const std::string dir = temp_dir("flux_schnell");
  json config = read_json(kFluxTransformer + "/config.json");
  config["guidance_embeds"] = false;
  write_text(dir + "/config.json", config.dump(2));
  TensorMap weights =
      difftrain::io::load_safetensors(kFluxTransformer + "/diffusion_pytorch_model.safetensors")
          .tensors;
  TensorMap kept;
  for (const auto& [k, v] : weights) {
    if (k.rfind("time_text_embed.guidance_embedder.", 0) != 0) kept[k] = v;
  }
  EXPECT_EQ(kept.size(), weights.size() - 4);
  difftrain::io::save_safetensors(dir + "/diffusion_pytorch_model.safetensors", kept);
  FluxTransformer2DModel schnell = dm::load_flux_transformer(dir);
  FluxTransformer2DModel dev = dm::load_flux_transformer(kFluxTransformer);
  schnell->eval();
  dev->eval();
  const TensorMap io = flux_io();
  torch::NoGradGuard no_grad;
  FluxTransformerIntermediates a, b;
  const torch::Tensor out = schnell->forward(
      io.at("A.hidden_states"), io.at("A.encoder_hidden_states"), io.at("A.pooled_projections"),
      io.at("A.timestep"), torch::Tensor(), io.at("A.img_ids"), io.at("A.txt_ids"), &a);
  EXPECT_EQ(out.sizes(), io.at("A.out").sizes());
  flux_run_case(dev, io, "A", &b);
  auto modules = dev->named_modules();
  const torch::Tensor g_term =
      modules["time_text_embed.guidance_embedder"]->as<dm::TimestepEmbeddingImpl>()->forward(
          dm::timestep_embedding(io.at("A.guidance") * 1000, 256, true, 0));
  const double diff = max_abs(a.temb, b.temb - g_term);
  std::cout << "  schnell temb vs dev temb - guidance term: " << diff << " (tolerance 1e-5)\n";
  EXPECT_LE(diff, 1e-5);
  EXPECT_GT(max_abs(out, io.at("A.out")), 1e-3);  // the guidance term did change the output
  // Diffusers raises for both mismatches (TypeError in the embedder's forward).
  EXPECT_NE(error_of([&] { flux_run_case(schnell, io, "A"); }).find("guidance_embeds false"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              dev->forward(io.at("A.hidden_states"), io.at("A.encoder_hidden_states"),
                           io.at("A.pooled_projections"), io.at("A.timestep"), torch::Tensor(),
                           io.at("A.img_ids"), io.at("A.txt_ids"));
            }).find("guidance_embeds true"),
            std::string::npos);
  // The dev weights do not load into the schnell config (an unexpected guidance_embedder).
  EXPECT_NE(error_of([&] {
              dm::load_weights(*schnell, weights, "dev weights");
            }).find("unexpected keys: time_text_embed.guidance_embedder"),
            std::string::npos);
  fs::remove_all(dir);
}

TEST(FluxTransformer, OtherSizesTakeEverythingFromTheConfig) {
  auto o = FluxTransformer2DModelOptions()
               .patch_size(2)
               .in_channels(12)
               .out_channels(8)
               .num_layers(1)
               .num_single_layers(3)
               .attention_head_dim(12)
               .num_attention_heads(3)
               .joint_attention_dim(20)
               .pooled_projection_dim(10)
               .guidance_embeds(true)
               .axes_dims_rope({2, 4, 4, 2});
  torch::manual_seed(0);
  FluxTransformer2DModel model(o);
  const TensorMap own = dm::named_tensors(*model);
  EXPECT_EQ(own.at("proj_out.weight").sizes(), (std::vector<int64_t>{32, 36}));
  EXPECT_EQ(own.at("single_transformer_blocks.2.proj_out.weight").sizes(),
            (std::vector<int64_t>{36, 180}));
  EXPECT_EQ(own.at("transformer_blocks.0.attn.norm_added_k.weight").sizes(),
            (std::vector<int64_t>{12}));
  EXPECT_FALSE(own.count("transformer_blocks.1.norm1.linear.weight"));
  const int64_t B = 2, L = 6, S = 3;
  torch::NoGradGuard no_grad;
  torch::Tensor out = model->forward(torch::randn({B, L, 12}), torch::randn({B, S, 20}),
                                     torch::randn({B, 10}), torch::rand({B}), torch::rand({B}),
                                     torch::randint(0, 5, {L, 4}), torch::zeros({S, 4}));
  EXPECT_EQ(out.sizes(), (std::vector<int64_t>{B, L, 32}));
  EXPECT_TRUE(torch::isfinite(out).all().item<bool>());
  // ids with the wrong number of axes are refused with the shape expected.
  EXPECT_THROW(model->forward(torch::randn({B, L, 12}), torch::randn({B, S, 20}),
                              torch::randn({B, 10}), torch::rand({B}), torch::rand({B}),
                              torch::zeros({L, 3}), torch::zeros({S, 3})),
               c10::Error);
}

TEST(FluxTransformer, SaveAndLoadRoundTrip) {
  FluxTransformer2DModel model = dm::load_flux_transformer(kFluxTransformer);
  model->eval();
  const std::string dir = temp_dir("flux_save") + "/transformer";
  dm::save_flux_transformer(*model, dir);
  const json saved = read_json(dir + "/config.json");
  const json original = read_json(kFluxTransformer + "/config.json");
  EXPECT_EQ(saved.at("_class_name"), "FluxTransformer2DModel");
  for (const auto& [k, v] : original.items()) {
    if (k != "_diffusers_version") {
      EXPECT_EQ(saved.at(k), v) << k;
    }
  }
  EXPECT_TRUE(saved.at("out_channels").is_null());
  FluxTransformer2DModel again = dm::load_flux_transformer(dir);
  again->eval();
  const TensorMap io = flux_io();
  torch::NoGradGuard no_grad;
  EXPECT_EQ(max_abs(flux_run_case(again, io, "B"), flux_run_case(model, io, "B")), 0.0);
  // The same weights re-saved as three shards + an index (save_pretrained's layout) load to a
  // bit-identical model, and in bf16 when asked.
  const std::string sharded = temp_dir("flux_sharded");
  fs::copy_file(kFluxTransformer + "/config.json", sharded + "/config.json");
  const TensorMap all =
      difftrain::io::load_safetensors(kFluxTransformer + "/diffusion_pytorch_model.safetensors")
          .tensors;
  std::vector<TensorMap> shards(3);
  json weight_map = json::object();
  int64_t k = 0;
  for (const auto& [name, t] : all) {
    const int64_t s = k++ % 3;
    shards[static_cast<size_t>(s)][name] = t;
    weight_map[name] =
        "diffusion_pytorch_model-0000" + std::to_string(s + 1) + "-of-00003.safetensors";
  }
  for (int64_t s = 0; s < 3; ++s) {
    difftrain::io::save_safetensors(
        sharded + "/diffusion_pytorch_model-0000" + std::to_string(s + 1) + "-of-00003.safetensors",
        shards[static_cast<size_t>(s)]);
  }
  write_text(sharded + "/diffusion_pytorch_model.safetensors.index.json",
             json{{"metadata", {{"total_size", 0}}}, {"weight_map", weight_map}}.dump());
  FluxTransformer2DModel from_shards = dm::load_flux_transformer(sharded);
  from_shards->eval();
  EXPECT_EQ(max_abs(flux_run_case(from_shards, io, "B"), flux_run_case(model, io, "B")), 0.0);
  FluxTransformer2DModel bf16 = dm::load_flux_transformer(sharded, torch::kBFloat16);
  for (const auto& p : bf16->parameters()) EXPECT_EQ(p.scalar_type(), torch::kBFloat16);
  // A shard the index names but the folder lacks, and a damaged index, are named.
  fs::remove(sharded + "/diffusion_pytorch_model-00002-of-00003.safetensors");
  std::string msg = error_of([&] { dm::load_flux_transformer(sharded); });
  EXPECT_NE(msg.find("diffusion_pytorch_model-00002-of-00003.safetensors"), std::string::npos)
      << msg;
  write_text(sharded + "/diffusion_pytorch_model.safetensors.index.json", "{\"weight_map\": 3}");
  msg = error_of([&] { dm::load_flux_transformer(sharded); });
  EXPECT_NE(msg.find("weight_map"), std::string::npos) << msg;
  fs::remove_all(fs::path(dir).parent_path());
  fs::remove_all(sharded);
}

TEST(FluxTransformer, ConfigErrorsNameConfigJsonAndTheField) {
  const std::string dir = temp_dir("flux_config");
  const std::string path = dir + "/config.json";
  const json good = read_json(kFluxTransformer + "/config.json");
  auto error_for = [&](const json& j) {
    write_text(path, j.dump());
    return error_of([&] { FluxTransformer2DModelOptions::load(path); });
  };
  json bad = good;
  bad["axes_dims_rope"] = {4, 6, 8};
  std::string e = error_for(bad);
  EXPECT_NE(e.find(path), std::string::npos) << e;
  EXPECT_NE(e.find("\"axes_dims_rope\" sums to 18"), std::string::npos) << e;
  EXPECT_NE(e.find("attention_head_dim is 16"), std::string::npos) << e;
  bad = good;
  bad["axes_dims_rope"] = {5, 5, 6};
  e = error_for(bad);
  EXPECT_NE(e.find("even"), std::string::npos) << e;
  // Absent fields take Diffusers' defaults (FLUX.1's), as from_pretrained fills them: the real
  // FLUX.1-dev config.json lists no axes_dims_rope.
  bad = good;
  bad.erase("num_attention_heads");
  bad.erase("attention_head_dim");
  bad.erase("axes_dims_rope");
  difftrain::test::write_text(path, bad.dump());
  const auto defaults = FluxTransformer2DModelOptions::load(path);
  EXPECT_EQ(defaults.num_attention_heads(), 24);
  EXPECT_EQ(defaults.attention_head_dim(), 128);
  EXPECT_EQ(defaults.axes_dims_rope(), (std::vector<int64_t>{16, 56, 56}));
  bad = good;
  bad["num_layers"] = -1;
  e = error_for(bad);
  EXPECT_NE(e.find("\"num_layers\" must be >= 0"), std::string::npos) << e;
  bad = good;
  bad["_class_name"] = "SD3Transformer2DModel";
  e = error_for(bad);
  EXPECT_NE(e.find("\"_class_name\""), std::string::npos) << e;
  bad = good;
  bad["guidance_embeds"] = "yes";
  e = error_for(bad);
  EXPECT_NE(e.find("\"guidance_embeds\" must be true or false"), std::string::npos) << e;
  // The good config parses, with out_channels unset (absent) = in_channels.
  const auto o = FluxTransformer2DModelOptions::load(kFluxTransformer + "/config.json");
  EXPECT_EQ(o.output_channels(), 64);
  EXPECT_EQ(o.inner_dim(), 32);
  EXPECT_NE(error_of([&] { dm::load_flux_transformer(dir + "/nothing"); }).find("no such folder"),
            std::string::npos);
  fs::remove_all(dir);
}

}  // namespace
