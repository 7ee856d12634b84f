#include "difftrain/train/memory_estimate.h"

#include "difftrain/models/autoencoder_kl.h"
#include "difftrain/models/clip_text_model.h"

#include "difftrain/accel/precision.h"
#include "difftrain/core/error.h"
#include "difftrain/core/log.h"
#include "difftrain/models/lora_training.h"
#include "difftrain/models/unet_config.h"
#include "difftrain/optim/quantize.h"

#include <fmt/format.h>
#include <malloc.h>

#if defined(__SANITIZE_ADDRESS__)
#define DIFFTRAIN_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define DIFFTRAIN_ASAN 1
#endif
#endif
#if DIFFTRAIN_ASAN
#include <sanitizer/allocator_interface.h>
#endif
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <unordered_set>

namespace difftrain::train {
namespace fs = std::filesystem;
namespace {

// optim::AdamW8bit's default min_8bit_size (the trainer builds it with the default): smaller
// parameters keep fp32 moments.
constexpr int64_t kMin8bitSize = 4096;

// What optim::AdamW / optim::AdamW8bit hold for one fp32 parameter of `n` elements: two fp32
// moments, or two uint8 code tensors and one fp32 absmax per block for each moment.
int64_t adam_state_bytes(int64_t n, bool eight_bit) {
  if (!eight_bit || n < kMin8bitSize) return 8 * n;
  const int64_t blocks = (n + optim::kQuantBlockSize - 1) / optim::kQuantBlockSize;
  return 2 * n + 2 * 4 * blocks;
}

// Bytes of heap in use right now, all arenas (glibc): small chunks plus mmapped ones. Under
// AddressSanitizer malloc is ASan's (mallinfo2 reports zeros), so ask its allocator instead.
int64_t live_heap_bytes() {
#if DIFFTRAIN_ASAN
  return static_cast<int64_t>(__sanitizer_get_current_allocated_bytes());
#else
  const struct mallinfo2 m = mallinfo2();
  return static_cast<int64_t>(m.uordblks + m.hblkhd);
#endif
}

models::UNetConditioning make_conditioning(const models::UNetImpl& unet, int64_t batch,
                                           int64_t sequence_length) {
  const auto& c = unet.config();
  models::UNetConditioning cond;
  const std::string type = c.class_embed_type.value_or("");
  if (c.num_class_embeds) {
    cond.class_labels = torch::zeros({batch}, torch::kInt64);
  } else if (type == "timestep") {
    cond.class_labels = torch::randint(0, 1000, {batch}, torch::kInt64);
  } else if (type == "projection" || type == "simple_projection") {
    cond.class_labels = torch::zeros({batch, c.projection_class_embeddings_input_dim.value_or(1)});
  } else if (type == "identity") {
    cond.class_labels =
        torch::zeros({batch, c.time_embedding_dim.value_or(c.block_out_channels.at(0) * 4)});
  }
  if (c.time_cond_proj_dim) cond.timestep_cond = torch::zeros({batch, *c.time_cond_proj_dim});
  if (unet.needs_encoder_hidden_states()) {
    const int64_t dim = c.cross_attention_dim.empty() ? 1 : c.cross_attention_dim[0];
    cond.encoder_hidden_states = torch::zeros({batch, sequence_length, dim});
  }
  if (unet.needs_added_conditioning()) {
    // SDXL: 6 time ids, the pooled text embedding fills the rest of add_embedding's input.
    const int64_t ids = 6 * c.addition_time_embed_dim.value_or(0);
    cond.text_embeds =
        torch::zeros({batch, c.projection_class_embeddings_input_dim.value_or(ids) - ids});
    cond.time_ids = torch::full({batch, 6}, 1024.0);
  }
  return cond;
}

// One training forward of `unet` on sample [B, C, H, W], timesteps [B]; returns the output
// [B, out_channels, H, W] with its graph alive (the autocast scope ends, as in a training step).
torch::Tensor training_forward(models::UNetImpl& unet, accel::MixedPrecision mp,
                               const torch::Tensor& sample, const torch::Tensor& timesteps,
                               const models::UNetConditioning& cond) {
  accel::AutocastGuard autocast(mp, torch::kCPU);
  return unet.forward(sample, timesteps, cond);
}

void check_options(const MemoryEstimateOptions& o) {
  if (o.num_processes < 1) {
    throw Error(fmt::format("num_processes must be at least 1, got {}", o.num_processes));
  }
  if (o.batch_size < 1) throw Error(fmt::format("batch_size must be >= 1, got {}", o.batch_size));
  if (o.resolution < 0) {
    throw Error(
        fmt::format("resolution must be >= 0 (0: the config's sample_size), got {}", o.resolution));
  }
  if (o.lora && o.lora_rank < 1) {
    throw Error(fmt::format("LoRA rank must be at least 1, got {}", o.lora_rank));
  }
}

}  // namespace

int64_t MemoryEstimate::total_peak_bytes() const {
  return param_peak_bytes + grad_peak_bytes + optimizer_bytes + frozen_param_bytes +
         activation_bytes;
}

MemoryEstimate estimate_state_memory(const torch::nn::Module& trainable,
                                     const MemoryEstimateOptions& options,
                                     const torch::nn::Module* frozen_model) {
  check_options(options);
  // Frozen parameters, each tensor once (a model and its adapters' container may share none, but
  // a module may register one tensor twice); trainable ones as the optimizer sees them.
  std::unordered_set<const void*> seen;
  int64_t frozen_params = 0, frozen_bytes = 0;
  std::vector<int64_t> numels;
  auto add = [&](const torch::nn::Module& m, bool trainable_too) {
    for (const auto& p : m.parameters(true)) {
      if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;
      if (p.requires_grad()) {
        if (trainable_too) numels.push_back(p.numel());
        continue;
      }
      frozen_params += p.numel();
      frozen_bytes += static_cast<int64_t>(p.nbytes());
    }
  };
  add(trainable, true);
  if (frozen_model != nullptr) add(*frozen_model, false);
  return estimate_state_memory_from_counts(accel::plan_units(trainable, options.auto_wrap), numels,
                                           frozen_params, frozen_bytes, options);
}

MemoryEstimate estimate_state_memory_from_counts(std::vector<accel::UnitPlan> units,
                                                 const std::vector<int64_t>& param_numels,
                                                 int64_t frozen_params, int64_t frozen_bytes,
                                                 const MemoryEstimateOptions& options) {
  check_options(options);
  MemoryEstimate e;
  const int64_t N = options.num_processes;
  e.num_processes = options.num_processes;
  e.strategy = N == 1 ? accel::ShardingStrategy::kNoShard : options.strategy;
  e.units = std::move(units);
  e.frozen_params = frozen_params;
  e.frozen_param_bytes = frozen_bytes;

  int64_t P = 0, Sh = 0, Umax = 0, Uroot = 0;
  for (const auto& u : e.units) {
    const int64_t s = (u.numel + N - 1) / N;
    P += u.numel;
    Sh += s;
    if (u.name.empty()) Uroot = N * s;
    Umax = std::max(Umax, N * s);
  }
  const int64_t Ppad = N * Sh;
  e.trainable_params = P;

  if (e.strategy == accel::ShardingStrategy::kNoShard) {
    e.shard_params = e.padded_params = P;
    e.param_bytes = e.param_peak_bytes = e.grad_bytes = e.grad_peak_bytes = 4 * P;
    // The optimizer sees the model's parameter tensors one by one.
    for (const int64_t n : param_numels)
      e.optimizer_bytes += adam_state_bytes(n, options.use_8bit_adam);
    return e;
  }

  e.shard_params = Sh;
  e.padded_params = Ppad;
  // The sharded optimizer updates one fp32 master shard of S_u elements per unit.
  for (const auto& u : e.units) {
    e.optimizer_bytes += adam_state_bytes((u.numel + N - 1) / N, options.use_8bit_adam);
  }
  switch (e.strategy) {
    case accel::ShardingStrategy::kShardOptimizer:
      e.param_bytes = e.param_peak_bytes = 4 * Ppad + 4 * Sh;
      e.grad_bytes = e.grad_peak_bytes = 4 * Ppad + 4 * Sh;
      break;
    case accel::ShardingStrategy::kShardGradOp:
      e.param_bytes = e.param_peak_bytes = 4 * Ppad + 4 * Sh;
      e.grad_bytes = 4 * Sh;
      e.grad_peak_bytes = 4 * Sh + 4 * Ppad;
      break;
    case accel::ShardingStrategy::kFullShard:
      e.param_bytes = 4 * Sh;
      // The root unit stays gathered; one unit runs while the next is prefetched.
      e.param_peak_bytes = 4 * Sh + 4 * (Uroot + 2 * Umax);
      e.grad_bytes = 4 * Sh;
      e.grad_peak_bytes = 4 * Sh + 4 * Ppad;
      break;
    case accel::ShardingStrategy::kNoShard: break;
  }
  return e;
}

int64_t measure_forward_bytes(const std::function<torch::Tensor()>& forward) {
  forward();  // warm-up: caches and pools that stay are not activations
  const int64_t before = live_heap_bytes();
  torch::Tensor out = forward();
  const int64_t after = live_heap_bytes();
  out = torch::Tensor();
  return std::max<int64_t>(0, after - before);
}

int64_t measure_activation_bytes(models::UNetImpl& unet, const MemoryEstimateOptions& options,
                                 int64_t batch_size) {
  check_options(options);
  if (batch_size < 1) throw Error(fmt::format("batch_size must be >= 1, got {}", batch_size));
  const auto& c = unet.config();
  int64_t h = options.resolution, w = options.resolution;
  if (h == 0) {
    if (c.sample_size.empty()) {
      throw Error(
          "the UNet config has no sample_size (null); pass the input size with --resolution");
    }
    h = c.sample_size[0];
    w = c.sample_size.size() > 1 ? c.sample_size[1] : h;
  }
  // Every down block but the last halves the size.
  const int64_t factor = int64_t{1} << std::max<int64_t>(0, c.down_block_types.size() - 1);
  if (h % factor != 0 || w % factor != 0) {
    throw Error(fmt::format(
        "resolution {}x{} is not divisible by {}, the UNet's downsampling factor; use a multiple "
        "of {}",
        h, w, factor, factor));
  }
  const auto mp = accel::parse_mixed_precision(options.mixed_precision);
  if (mp == accel::MixedPrecision::kBf16) accel::install_autocast_fixes();
  const bool was_training = unet.is_training();
  const bool was_checkpointing = unet.gradient_checkpointing();
  unet.train();
  unet.set_gradient_checkpointing(options.gradient_checkpointing);
  torch::AutoGradMode grad_on(true);

  auto cond = make_conditioning(unet, batch_size, options.encoder_sequence_length);
  auto x = torch::randn({batch_size, c.in_channels, h, w});
  auto t = torch::randint(0, 1000, {batch_size}, torch::kInt64);
  // Warm-up on the same shapes, its graph dropped: thread pools, oneDNN's primitive caches (keyed
  // by shape; the Winograd convolutions only build theirs while recording a graph) and autocast
  // state allocate once and stay, which is not activation memory.
  training_forward(unet, mp, x, t, cond);
  const auto started = std::chrono::steady_clock::now();
  const int64_t before = live_heap_bytes();
  auto out = training_forward(unet, mp, x, t, cond);
  const int64_t after = live_heap_bytes();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  out = torch::Tensor();
  unet.train(was_training);
  unet.set_gradient_checkpointing(was_checkpointing);
  const int64_t bytes = std::max<int64_t>(0, after - before);
  log::info("activations: one forward at batch {}, {}x{}, mixed precision {}{} keeps {} ({:.1f} s)",
            batch_size, h, w, options.mixed_precision,
            options.gradient_checkpointing ? ", gradient checkpointing" : "", format_bytes(bytes),
            seconds);
  return bytes;
}

std::vector<std::pair<std::string, int64_t>> pipeline_frozen_params(const std::string& model_path) {
  std::vector<std::pair<std::string, int64_t>> out;
  const fs::path root(model_path);
  if (!fs::is_directory(root) || !fs::exists(root / "model_index.json")) return out;
  auto count = [](const torch::nn::Module& m) {
    int64_t n = 0;
    for (const auto& p : m.parameters()) n += p.numel();
    return n;
  };
  // Built from the configs alone (random weights), as the UNet is.
  torch::NoGradGuard no_grad;
  for (const char* te : {"text_encoder", "text_encoder_2"}) {
    const fs::path config = root / te / "config.json";
    if (!fs::is_regular_file(config)) continue;
    auto c = models::read_clip_text_config(config.string());
    if (std::string(te) == "text_encoder_2") c.with_projection = true;
    out.emplace_back(te, count(*models::ClipTextModel(c)));
  }
  const fs::path vae = root / "vae" / "config.json";
  if (fs::is_regular_file(vae)) {
    out.emplace_back(
        "vae", count(*models::AutoencoderKL(models::read_autoencoder_kl_config(vae.string()))));
  }
  return out;
}

std::string resolve_unet_config_path(const std::string& model_path) {
  const fs::path p(model_path);
  if (fs::is_directory(p)) {
    const fs::path config =
        fs::exists(p / "model_index.json") ? p / "unet" / "config.json" : p / "config.json";
    if (!fs::is_regular_file(config)) {
      throw Error("'" + model_path + "' has no " + config.lexically_relative(p).string() +
                  "; pass a UNet folder (config.json), a pipeline folder (model_index.json + "
                  "unet/config.json) or a config.json path");
    }
    return config.string();
  }
  if (!fs::is_regular_file(p)) {
    throw Error("'" + model_path +
                "' does not exist; pass a UNet folder (config.json), a pipeline folder "
                "(model_index.json + unet/config.json) or a config.json path");
  }
  return model_path;
}

std::vector<MemoryEstimate> estimate_memory(
    const std::string& model_path, const MemoryEstimateOptions& options,
    const std::vector<accel::ShardingStrategy>& strategies) {
  check_options(options);
  const auto config = models::UNetConfig::load(resolve_unet_config_path(model_path));
  models::UNet unet(config);
  models::LoraLayers lora{nullptr};
  torch::nn::Module* trainable = unet.get();
  if (options.lora) {
    // As the trainer's build_parts: the base frozen, adapters with alpha = rank.
    for (auto& p : unet->parameters()) p.set_requires_grad(false);
    models::LoraConfig lc;
    lc.rank = options.lora_rank;
    lc.alpha = static_cast<double>(options.lora_rank);
    if (!options.lora_target_modules.empty()) lc.target_modules = options.lora_target_modules;
    lora = models::LoraLayers(*unet, lc);
    trainable = lora.get();
    // As the trainer: under bf16 the frozen base is held in bf16, the adapters stay fp32.
    if (options.mixed_precision == "bf16") unet->to(torch::kBFloat16);
  }
  // Plan first: a bad auto-wrap policy fails before the (slow) forward.
  std::vector<MemoryEstimate> out;
  for (const auto s : strategies) {
    MemoryEstimateOptions o = options;
    o.strategy = s;
    out.push_back(estimate_state_memory(*trainable, o, options.lora ? unet.get() : nullptr));
  }
  // A text-to-image pipeline also holds its frozen text encoder(s) and VAE on every rank, in
  // bf16 under bf16 as the trainer keeps them.
  const auto frozen = pipeline_frozen_params(model_path);
  for (const auto& [name, n] : frozen) {
    log::info("frozen {}: {} parameters", name, n);
    for (auto& e : out) {
      e.frozen_params += n;
      e.frozen_param_bytes += n * (options.mixed_precision == "bf16" ? 2 : 4);
    }
  }
  const int64_t activations = measure_activation_bytes(*unet, options, 1) * options.batch_size;
  for (auto& e : out) e.activation_bytes = activations;
  return out;
}

MemoryEstimate estimate_memory(const std::string& model_path,
                               const MemoryEstimateOptions& options) {
  return estimate_memory(model_path, options, {options.strategy}).at(0);
}

nlohmann::json to_json(const MemoryEstimate& e) {
  nlohmann::json units = nlohmann::json::array();
  const accel::UnitPlan* largest = nullptr;
  for (const auto& u : e.units) {
    units.push_back({{"name", u.name}, {"module_class", u.module_class}, {"numel", u.numel}});
    if (largest == nullptr || u.numel > largest->numel) largest = &u;
  }
  return {
      {"num_processes", e.num_processes},
      {"strategy", accel::to_string(e.strategy)},
      {"param_bytes", e.param_bytes},
      {"param_peak_bytes", e.param_peak_bytes},
      {"grad_bytes", e.grad_bytes},
      {"grad_peak_bytes", e.grad_peak_bytes},
      {"optimizer_bytes", e.optimizer_bytes},
      {"frozen_param_bytes", e.frozen_param_bytes},
      {"activation_bytes", e.activation_bytes},
      {"total_peak_bytes", e.total_peak_bytes()},
      {"trainable_params", e.trainable_params},
      {"frozen_params", e.frozen_params},
      {"shard_params", e.shard_params},
      {"padded_params", e.padded_params},
      {"num_units", e.units.size()},
      {"largest_unit", largest == nullptr ? nlohmann::json(nullptr)
                                          : nlohmann::json{{"name", largest->name},
                                                           {"module_class", largest->module_class},
                                                           {"numel", largest->numel}}},
      {"units", units}};
}

std::string format_bytes(int64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (bytes >= (int64_t{1} << 30)) return fmt::format("{:.2f} GiB", b / (1 << 30));
  if (bytes >= (int64_t{1} << 20)) return fmt::format("{:.1f} MiB", b / (1 << 20));
  if (bytes >= (int64_t{1} << 10)) return fmt::format("{:.1f} KiB", b / (1 << 10));
  return fmt::format("{} B", bytes);
}

std::string format_memory_table(const MemoryEstimate& e, int64_t batch_size) {
  std::string s = fmt::format(
      "{} on {} process{}: {} trainable parameters ({} per rank after padding and sharding), {} "
      "frozen\n",
      accel::to_string(e.strategy), e.num_processes, e.num_processes == 1 ? "" : "es",
      e.trainable_params, e.shard_params, e.frozen_params);
  s += fmt::format("  {:<26}{:>16}  {:>12}\n", "per rank", "bytes", "size");
  auto row = [&](const std::string& name, int64_t bytes) {
    s += fmt::format("  {:<26}{:>16}  {:>12}\n", name, bytes, format_bytes(bytes));
  };
  row("parameters", e.param_bytes);
  row("parameter peak", e.param_peak_bytes);
  row("gradients", e.grad_bytes);
  row("gradient peak", e.grad_peak_bytes);
  row("optimizer state", e.optimizer_bytes);
  row("frozen weights", e.frozen_param_bytes);
  row(fmt::format("activations (batch {})", batch_size), e.activation_bytes);
  row("total peak", e.total_peak_bytes());
  const accel::UnitPlan* largest = nullptr;
  for (const auto& u : e.units) {
    if (largest == nullptr || u.numel > largest->numel) largest = &u;
  }
  s += fmt::format("  units: {}", e.units.size());
  if (largest != nullptr) {
    s += fmt::format("; largest {} ({}, {} parameters)",
                     largest->name.empty() ? "<root>" : largest->name, largest->module_class,
                     largest->numel);
  }
  return s + "\n";
}

std::string format_strategy_comparison(const std::vector<MemoryEstimate>& estimates) {
  std::string s = fmt::format("  {:<16}{:>12}{:>12}{:>12}{:>12}{:>12}{:>12}{:>12}{:>12}\n",
                              "per rank", "params", "param peak", "grads", "grad peak", "optimizer",
                              "frozen", "activations", "total peak");
  for (const auto& e : estimates) {
    s += fmt::format("  {:<16}{:>12}{:>12}{:>12}{:>12}{:>12}{:>12}{:>12}{:>12}\n",
                     accel::to_string(e.strategy), format_bytes(e.param_bytes),
                     format_bytes(e.param_peak_bytes), format_bytes(e.grad_bytes),
                     format_bytes(e.grad_peak_bytes), format_bytes(e.optimizer_bytes),
                     format_bytes(e.frozen_param_bytes), format_bytes(e.activation_bytes),
                     format_bytes(e.total_peak_bytes()));
  }
  return s;
}

}  // namespace difftrain::train
