// FLUX.1 sampling against Diffusers 0.31 (tests/golden/flux: FlowMatchEulerDiscreteScheduler with
// dynamic shifting, the 16-channel AutoencoderKL with shift_factor, FluxPipeline.__call__ seed 42
// with and without each fixture LoRA file) and the FLUX family's folder recognition.

#include "difftrain/core/error.h"
#include "difftrain/diffusion/sampler.h"
#include "difftrain/diffusion/text_encoders.h"
#include "difftrain/families/family.h"
#include "difftrain/io/atomic_file.h"
#include "difftrain/io/safetensors.h"
#include "difftrain/models/autoencoders/autoencoder_kl.h"
#include "difftrain/models/kernels/quantized_weight.h"
#include "difftrain/models/lora/lora_training.h"
#include "difftrain/models/text_encoders/clip_text_model.h"
#include "difftrain/models/text_encoders/t5_encoder.h"
#include "difftrain/models/transformers/flux_transformer.h"
#include "source_dir.h"
#include "test_util.h"

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>

namespace difftrain {
namespace {

namespace fs = std::filesystem;
using test::error_of;
using test::max_abs;

const std::string kFluxDir =
    std::string(difftrain_test::source_dir()) + "/tests/golden/flux/tiny_flux";
const std::string kFluxLoraDir =
    std::string(difftrain_test::source_dir()) + "/tests/golden/flux/tiny_flux_lora";

io::TensorMap flux_golden(const std::string& file) { return io::load_safetensors(file).tensors; }

nlohmann::json flux_scheduler_config() {
  return test::read_json(kFluxDir + "/scheduler/scheduler_config.json");
}

TEST(FluxSampling, DynamicShiftingGivesFluxPipelinesSigmasAndTimesteps) {
  const auto ref = flux_golden(kFluxDir + "/txt2img_seed42.safetensors");
  const auto config = flux_scheduler_config();
  // calculate_shift of the packed sequence length (24 x 32 latent -> 192 tokens).
  const double mu = diffusion::flow_match_mu(192, config);
  std::printf("mu %.17g vs %.17g\n", mu, ref.at("mu").item<double>());
  EXPECT_LE(std::abs(mu - ref.at("mu").item<double>()), 1e-12);

  auto sampler = diffusion::make_sampler(config, "", "flux scheduler");
  diffusion::TimestepOptions o;
  for (int i = 0; i < 6; ++i) o.sigmas.push_back(1.0 + i * ((1.0 / 6 - 1.0) / 5));
  o.sigmas.back() = 1.0 / 6;
  o.mu = mu;
  sampler->set_timesteps_with(6, o);
  const double rel_sigmas =
      ((sampler->sigmas() - ref.at("sigmas")).abs() / (ref.at("sigmas").abs() + 1e-30))
          .max()
          .item<double>();
  const double rel_t = ((sampler->timesteps() - ref.at("timesteps")).abs() / ref.at("timesteps"))
                           .max()
                           .item<double>();
  std::printf("relative sigma diff %.3g, timestep diff %.3g\n", rel_sigmas, rel_t);
  EXPECT_LE(rel_sigmas, 1e-6);
  EXPECT_LE(rel_t, 1e-6);
  // The model gets t / 1000 in float32.
  EXPECT_LE(max_abs(sampler->timesteps() / 1000, ref.at("timestep_model_input")), 1e-7);
}

TEST(FluxSampling, TrainingTablesStayUnshiftedUnderDynamicShifting) {
  const auto ref = flux_golden(kFluxDir + "/train_step.safetensors");
  auto sampler = diffusion::make_sampler(flux_scheduler_config(), "", "flux scheduler");
  // Diffusers' __init__ tables, before any set_timesteps: not integral at some indices.
  EXPECT_EQ(max_abs(sampler->timesteps(), ref.at("train_schedule_timesteps")), 0.0);
  EXPECT_EQ(max_abs(sampler->sigmas(), ref.at("train_schedule_sigmas")), 0.0);
}

TEST(FluxSampling, StaticShiftingOfSchnellKeepsOrShiftsTheGivenSigmas) {
  nlohmann::json schnell = flux_scheduler_config();
  schnell["use_dynamic_shifting"] = false;
  schnell["shift"] = 1.0;
  auto sampler = diffusion::make_sampler(schnell, "", "schnell scheduler");
  diffusion::TimestepOptions o;
  o.sigmas = {1.0, 0.75, 0.5, 0.25};
  o.mu = 0.7;  // FluxPipeline always passes mu; without dynamic shifting it is ignored
  sampler->set_timesteps_with(4, o);
  EXPECT_TRUE(torch::equal(sampler->sigmas(), torch::tensor({1.0F, 0.75F, 0.5F, 0.25F, 0.0F})));
  schnell["shift"] = 3.0;
  auto shifted = diffusion::make_sampler(schnell, "", "shifted scheduler");
  shifted->set_timesteps_with(4, o);
  // 3s / (1 + 2s) computed in float64, then float32.
  EXPECT_FLOAT_EQ(shifted->sigmas()[2].item<float>(), static_cast<float>(1.5 / 2.0));
  EXPECT_FLOAT_EQ(shifted->sigmas()[3].item<float>(), static_cast<float>(0.75 / 1.5));
}

TEST(FluxVae, SixteenChannelsWithShiftFactorMatchDiffusers) {
  const auto ref = flux_golden(kFluxDir + "/vae/io.safetensors");
  auto vae = models::load_autoencoder_kl(kFluxDir + "/vae");
  vae->eval();
  torch::NoGradGuard no_grad;
  EXPECT_EQ(vae->config().latent_channels, 16);
  const double decoded = max_abs(vae->decode(ref.at("latent")), ref.at("decoded"));
  const auto posterior = vae->encode(ref.at("image"));
  const double mean = max_abs(posterior.mean, ref.at("latent_dist_mean"));
  const double logvar = max_abs(posterior.logvar, ref.at("latent_dist_logvar"));
  const double input = max_abs(vae->scale_latents(posterior.mean), ref.at("model_input"));
  std::printf("decoded %.3g mean %.3g logvar %.3g model_input %.3g (limit 1e-4)\n", decoded, mean,
              logvar, input);
  EXPECT_LE(decoded, 1e-4);
  EXPECT_LE(mean, 1e-4);
  EXPECT_LE(logvar, 1e-4);
  EXPECT_LE(input, 1e-4);
  EXPECT_LE(max_abs(vae->unscale_latents(ref.at("model_input")), ref.at("latent_dist_mean")), 1e-5);
}

// FluxPipeline.__call__ on the fixture request, through the family as `difftrain sample` runs it.
diffusion::GenerateResult flux_txt2img(const diffusion::PipelineLoadOptions& load) {
  const auto& family = families::family_of(kFluxDir);
  EXPECT_EQ(family.name(), "flux");
  auto pipe = family.load_pipeline(kFluxDir, load);
  EXPECT_EQ(pipe->class_name(), "FluxPipeline");
  diffusion::GenerateRequest r;
  r.prompts = {"a photo of a cat", "An astronaut riding a horse on Mars, highly detailed, 8k"};
  r.height = 48;
  r.width = 64;
  r.num_inference_steps = 6;
  r.guidance_scale = 3.5;
  r.max_sequence_length = 32;
  r.seed = 42;
  return pipe->generate(r);
}

void expect_flux_txt2img(const diffusion::GenerateResult& out, const io::TensorMap& ref) {
  const double embeds = max_abs(out.prompt_embeds, ref.at("prompt_embeds"));
  const double pooled = max_abs(out.pooled_prompt_embeds, ref.at("pooled_prompt_embeds"));
  const double latents = max_abs(out.latents, ref.at("latents_final_unpacked"));
  const double images = max_abs(out.images, ref.at("images"));
  std::printf("prompt_embeds %.3g pooled %.3g latents %.3g images %.3g (limit 1e-4)\n", embeds,
              pooled, latents, images);
  EXPECT_LE(embeds, 1e-4);
  EXPECT_LE(pooled, 1e-4);
  EXPECT_LE(latents, 1e-4);
  EXPECT_LE(images, 1e-4);
}

TEST(FluxPipeline, Txt2ImgSeed42MatchesDiffusers) {
  const auto ref = flux_golden(kFluxDir + "/txt2img_seed42.safetensors");
  // The only random draw: torch.randn on a CPU generator seeded 42.
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(42);
  EXPECT_EQ(max_abs(at::randn({2, 16, 24, 32}, gen, torch::kFloat32), ref.at("latents_init")), 0.0);
  expect_flux_txt2img(flux_txt2img({}), ref);
}

TEST(FluxPipeline, EachFixtureLoraFileReproducesTheLoraTxt2Img) {
  const auto ref = flux_golden(kFluxLoraDir + "/txt2img_lora_seed42.safetensors");
  for (const char* file : {"pytorch_lora_weights.safetensors", "diffusers_alpha_lora.safetensors",
                           "kohya_flux_lora.safetensors"}) {
    SCOPED_TRACE(file);
    diffusion::PipelineLoadOptions load;
    load.lora = kFluxLoraDir + "/" + file;
    expect_flux_txt2img(flux_txt2img(load), ref);
  }
}

TEST(FluxPipeline, Bf16LoadsEveryModelInBf16AndStaysCloseToFloat32) {
  const auto ref = flux_golden(kFluxDir + "/txt2img_seed42.safetensors");
  diffusion::PipelineLoadOptions load;
  load.dtype = torch::kBFloat16;
  const auto out = flux_txt2img(load);
  const double rel =
      ((out.images - ref.at("images")).norm() / ref.at("images").norm()).item<double>();
  // Not a parity check: as in Diffusers, the timestep reaches the model in the latents' dtype
  // (0.9375 -> 0.93359375 in bf16), which moves every step's velocity by a few percent on this
  // random model; the images must still be the same images.
  std::printf("bf16 images vs float32 Diffusers: relative L2 %.3g (limit 0.25)\n", rel);
  EXPECT_TRUE(torch::isfinite(out.images).all().item<bool>());
  EXPECT_LE(rel, 0.25);
}

TEST(FluxPipeline, BadRequestsAndFoldersGiveOneLineErrors) {
  const auto& family = families::family_of(kFluxDir);
  auto pipe = family.load_pipeline(kFluxDir, {});
  diffusion::GenerateRequest r;
  r.prompts = {"a cat"};
  r.num_inference_steps = 1;
  r.height = 44;  // not a multiple of 8
  r.width = 64;
  std::string msg = error_of([&] { pipe->generate(r); });
  EXPECT_NE(msg.find("multiples of 8"), std::string::npos) << msg;
  r.height = 48;
  r.negative_prompts = {"blurry"};
  msg = error_of([&] { pipe->generate(r); });
  EXPECT_NE(msg.find("no negative prompt"), std::string::npos) << msg;
  r.negative_prompts.clear();
  r.max_sequence_length = 513;
  msg = error_of([&] { pipe->generate(r); });
  EXPECT_NE(msg.find("512"), std::string::npos) << msg;
  // A DDPM-family sampler cannot run a flow-matching model.
  diffusion::PipelineLoadOptions ddim;
  ddim.scheduler = "ddim";
  msg = error_of([&] { family.load_pipeline(kFluxDir, ddim); });
  EXPECT_NE(msg.find("flow-matching"), std::string::npos) << msg;
  // A folder without its T5 encoder names the missing part.
  const std::string broken = test::temp_dir("flux_broken") + "/flux";
  fs::create_directories(broken);
  for (const char* part :
       {"transformer", "vae", "text_encoder", "tokenizer", "tokenizer_2", "scheduler"}) {
    fs::create_directory_symlink(fs::path(kFluxDir) / part, fs::path(broken) / part);
  }
  fs::copy_file(kFluxDir + "/model_index.json", broken + "/model_index.json");
  msg = error_of([&] { families::family_of(broken).load_pipeline(broken, {}); });
  EXPECT_NE(msg.find("text_encoder_2"), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
}

int64_t flux_numel(const torch::nn::Module& m) {
  int64_t n = 0;
  for (const auto& p : m.parameters()) n += p.numel();
  return n;
}

TEST(FluxFamily, EstimateMemoryCountsEveryPartFromItsConfig) {
  // The counted parameters equal the built models', block by block, and LoRA counts the adapters.
  const auto& family = families::family_of(kFluxDir);
  train::MemoryEstimateOptions o;
  o.resolution = 8;
  o.encoder_sequence_length = 4;
  const auto full = family.estimate_memory(kFluxDir, o, {accel::ShardingStrategy::kNoShard});
  ASSERT_EQ(full.size(), 1u);
  auto transformer = models::load_flux_transformer(kFluxDir + "/transformer");
  EXPECT_EQ(full[0].trainable_params, flux_numel(*transformer));
  ASSERT_EQ(full[0].units.size(), 5u);  // 2 double, 2 single blocks, the rest
  EXPECT_EQ(full[0].units[0].name, "transformer_blocks.0");
  EXPECT_EQ(full[0].units[0].numel,
            flux_numel(*transformer->named_children()["transformer_blocks"]->children()[0]));
  EXPECT_EQ(full[0].units[2].numel,
            flux_numel(*transformer->named_children()["single_transformer_blocks"]->children()[0]));
  // The trainer releases the text encoders once the captions are cached: the VAE stays.
  const int64_t vae = flux_numel(*models::load_autoencoder_kl(kFluxDir + "/vae"));
  const int64_t encoders = flux_numel(*models::load_clip_text_model(kFluxDir + "/text_encoder")) +
                           flux_numel(*models::load_t5_encoder(kFluxDir + "/text_encoder_2"));
  EXPECT_EQ(full[0].frozen_params, vae);
  const int64_t frozen = vae + encoders;  // with --train_text_encoder
  EXPECT_GT(full[0].activation_bytes, 0);
  o.lora = true;
  o.lora_rank = 4;
  o.num_processes = 2;
  // Default targets: Diffusers' train_dreambooth_lora_flux.py list, matched by suffix as PEFT
  // does; the adapters models::LoraLayers attaches for that list are what is counted.
  const auto lora = family.estimate_memory(kFluxDir, o, {accel::ShardingStrategy::kFullShard});
  models::LoraConfig lc;
  lc.rank = 4;
  lc.target_modules = {"attn.to_k",
                       "attn.to_q",
                       "attn.to_v",
                       "attn.to_out.0",
                       "attn.add_k_proj",
                       "attn.add_q_proj",
                       "attn.add_v_proj",
                       "attn.to_add_out",
                       "ff.net.0.proj",
                       "ff.net.2",
                       "ff_context.net.0.proj",
                       "ff_context.net.2"};
  auto with_adapters = models::load_flux_transformer(kFluxDir + "/transformer");
  models::LoraLayers adapters(*with_adapters, lc);
  EXPECT_EQ(adapters->module_names().size(), 2u * 12 + 2u * 3);
  EXPECT_EQ(lora[0].trainable_params, flux_numel(*adapters));
  EXPECT_EQ(lora[0].frozen_params, vae + flux_numel(*transformer));
  o.train_text_encoder = true;
  const auto held = family.estimate_memory(kFluxDir, o, {accel::ShardingStrategy::kFullShard});
  EXPECT_EQ(held[0].frozen_params, frozen + flux_numel(*transformer));
  EXPECT_EQ(held[0].frozen_param_bytes, 4 * (frozen + flux_numel(*transformer)));
  // An int8 base: the transformer's and the encoders' Linear weights at 1 byte plus their scales,
  // as the trainer's pass stores them (the VAE and everything else at 4 bytes).
  o.base_weights_dtype = "int8";
  const auto q8 = family.estimate_memory(kFluxDir, o, {accel::ShardingStrategy::kFullShard});
  int64_t expected = 4 * vae;
  auto clip = models::load_clip_text_model(kFluxDir + "/text_encoder");
  auto t5 = models::load_t5_encoder(kFluxDir + "/text_encoder_2");
  for (torch::nn::Module* m :
       std::vector<torch::nn::Module*>{transformer.get(), clip.get(), t5.get()}) {
    for (auto& p : m->parameters()) p.set_requires_grad(false);
    models::quantize_frozen_weights(*m, models::WeightStorage::kInt8);
    expected += train::frozen_parameter_bytes(*m);
  }
  EXPECT_EQ(q8[0].frozen_param_bytes, expected);
  EXPECT_LT(q8[0].frozen_param_bytes, held[0].frozen_param_bytes);
  o.train_text_encoder = false;
  o.base_weights_dtype = "none";
  EXPECT_LT(lora[0].optimizer_bytes, full[0].optimizer_bytes);
  // Attention only: 2 double blocks x 4 targets + 2 single x 3, each A [4, 32] + B [32, 4].
  o.lora_target_modules = {"to_q", "to_k", "to_v", "to_out.0"};
  const auto attention = family.estimate_memory(kFluxDir, o, {accel::ShardingStrategy::kNoShard});
  EXPECT_EQ(attention[0].trainable_params, (2 * 4 + 2 * 3) * 2 * 4 * 32);
}

TEST(FluxFamily, RecognisesPipelineAndTransformerFoldersAndMakesItsTrainingTask) {
  EXPECT_EQ(families::family_of(kFluxDir).name(), "flux");
  EXPECT_EQ(families::family_of(kFluxDir + "/transformer").name(), "flux");
  train::TaskOptions options;
  options.model.pretrained_model_name_or_path = kFluxDir;
  EXPECT_EQ(families::make_training_task(options)->name(), "FLUX.1 text-to-image");
}

// What a training run does with released encoders: the tokenizers-only copy tokenizes as before
// and refuses to encode in one line; the pipeline renders from embeddings given in the request
// (those of other prompts here) exactly as from the prompts they were made from.
TEST(FluxPipeline, PromptEmbeddingsGivenReplaceTheEncodersAndReleasedOnesRefuse) {
  using Stack = diffusion::TextEncoderStack;
  const Stack text(
      diffusion::pooled_and_sequence(0, 1),
      {diffusion::ClipTextEncoder::load(
           {"text_encoder", "tokenizer", kFluxDir + "/text_encoder", kFluxDir + "/tokenizer"},
           false, ""),
       diffusion::T5TextEncoder::load({"text_encoder_2", "tokenizer_2",
                                       kFluxDir + "/text_encoder_2", kFluxDir + "/tokenizer_2"},
                                      "")});
  const std::vector<std::string> prompts = {"a photo of a cat", "a red picture"};
  const Stack tokens_only = text.tokenizers_only();
  EXPECT_TRUE(text.has_models());
  EXPECT_FALSE(tokens_only.has_models());
  EXPECT_TRUE(tokens_only.modules().empty());
  const auto ids = text.tokenize(prompts), again = tokens_only.tokenize(prompts);
  ASSERT_EQ(again.size(), ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    EXPECT_TRUE(again[i].input_ids.equal(ids[i].input_ids));
  }
  const std::string msg = error_of([&] { tokens_only.encode(prompts); });
  EXPECT_NE(msg.find("released"), std::string::npos) << msg;

  auto pipe = families::family_of(kFluxDir).load_pipeline(kFluxDir, {});
  diffusion::GenerateRequest r;
  r.prompts = prompts;
  r.height = r.width = 32;
  r.num_inference_steps = 3;
  r.max_sequence_length = 16;
  r.num_images = 2;
  r.seeding = diffusion::Seeding::kPerImage;
  const auto encoded = pipe->generate(r);
  // One row per prompt: the per-image rows of that run, every second one.
  const auto rows = torch::arange(0, 4, 2);
  r.prompts = {"something else", "and another"};
  r.prompt_embeds = encoded.prompt_embeds.index_select(0, rows);
  r.pooled_prompt_embeds = encoded.pooled_prompt_embeds.index_select(0, rows);
  EXPECT_TRUE(pipe->generate(r).images.equal(encoded.images));
  r.pooled_prompt_embeds = torch::Tensor();
  EXPECT_NE(error_of([&] { pipe->generate(r); }).find("go together"), std::string::npos);
}

}  // namespace
}  // namespace difftrain
