// The toy-dit family (toy_family.h): its models, its training task and its family object, written
// against difftrain's installed public headers only.
#include "toy_family.h"

#include "difftrain/accel/accelerator.h"
#include "difftrain/core/error.h"
#include "difftrain/core/log.h"
#include "difftrain/data/dataset.h"
#include "difftrain/diffusion/flow_match_objective.h"
#include "difftrain/diffusion/text_encoders.h"
#include "difftrain/io/atomic_file.h"
#include "difftrain/io/safetensors.h"
#include "difftrain/models/attention.h"
#include "difftrain/models/layers.h"
#include "difftrain/models/linear.h"
#include "difftrain/models/lora/lora.h"
#include "difftrain/models/lora/lora_training.h"
#include "difftrain/train/flow_matching_options.h"
#include "difftrain/train/memory_estimate.h"

#include <fmt/format.h>
#include <torch/torch.h>

#include <filesystem>

namespace toy {
namespace fs = std::filesystem;
using difftrain::Error;
namespace models = difftrain::models;
namespace train = difftrain::train;
namespace io = difftrain::io;

nlohmann::json ToyConfig::to_json() const {
  return {{"_class_name", "ToyDiT"}, {"size", size},   {"patch", patch},      {"width", width},
          {"depth", depth},          {"heads", heads}, {"text_len", text_len}};
}

ToyConfig ToyConfig::from_json(const nlohmann::json& j, const std::string& where) {
  ToyConfig c;
  const std::vector<std::pair<const char*, int64_t*>> fields = {
      {"size", &c.size},   {"patch", &c.patch}, {"width", &c.width},
      {"depth", &c.depth}, {"heads", &c.heads}, {"text_len", &c.text_len}};
  for (const auto& [name, field] : fields) {
    if (!j.contains(name) || !j[name].is_number_integer() || j[name].get<int64_t>() < 1) {
      throw Error(fmt::format("{}: \"{}\" must be a positive integer", where, name));
    }
    *field = j[name].get<int64_t>();
  }
  if (c.size % c.patch != 0 || c.width % c.heads != 0) {
    throw Error(where + ": size must be a multiple of patch, and width of heads");
  }
  return c;
}

namespace {

// The toy's own text encoder model: byte ids [B, L] -> embeddings [B, L, width] (frozen).
class ToyTextEncoderImpl : public torch::nn::Module {
 public:
  explicit ToyTextEncoderImpl(const ToyConfig& c) : len(c.text_len), width(c.width) {
    token_embedding = register_module("token_embedding", torch::nn::Embedding(256, c.width));
    position_embedding = register_parameter("position_embedding", torch::randn({len, c.width}));
  }
  // ids: [B, L] -> [B, L, width]
  torch::Tensor forward(const torch::Tensor& ids) {
    return token_embedding(ids) + position_embedding.unsqueeze(0);
  }
  torch::nn::Embedding token_embedding{nullptr};
  torch::Tensor position_embedding;
  int64_t len, width;
};
TORCH_MODULE(ToyTextEncoder);

// The same encoder as a pipeline component (diffusion::TextEncoder): its byte tokenizer (0-padded,
// cut at text_len) and its model, composed into a TextEncoderStack as the built-in families
// compose CLIP or T5 (here one encoder, its last hidden state: diffusion::last_hidden_state()).
class ToyTextComponent final : public difftrain::diffusion::TextEncoder {
 public:
  explicit ToyTextComponent(ToyTextEncoder model)
      : TextEncoder({"text_encoder", "tokenizer", "", ""}),
        model_(std::move(model)),
        len_(model_->len),
        width_(model_->width) {}
  std::string class_name() const override { return "ToyTextEncoder"; }
  torch::nn::Module* module() const override {
    return model_.is_empty() ? nullptr : model_.ptr().get();
  }
  std::shared_ptr<TextEncoder> clone() const override {
    return std::make_shared<ToyTextComponent>(*this);
  }
  std::shared_ptr<TextEncoder> tokenizer_only() const override {
    auto out = std::make_shared<ToyTextComponent>(*this);
    out->model_ = ToyTextEncoder(nullptr);
    return out;
  }
  int64_t hidden_size() const override { return width_; }
  int64_t num_layers() const override { return 1; }
  difftrain::diffusion::Tokens tokenize(const std::vector<std::string>& prompts) const override {
    auto ids = torch::zeros({static_cast<int64_t>(prompts.size()), len_}, torch::kInt64);
    for (size_t i = 0; i < prompts.size(); ++i) {
      for (int64_t k = 0; k < len_ && k < static_cast<int64_t>(prompts[i].size()); ++k) {
        ids[static_cast<int64_t>(i)][k] = static_cast<unsigned char>(prompts[i][k]);
      }
    }
    return {ids, {}};
  }
  using TextEncoder::tokenize;
  int64_t kept_tokens() const override { return len_; }
  int64_t prompt_tokens(const std::string& prompt) const override {
    return static_cast<int64_t>(prompt.size());
  }
  std::string length_rule() const override { return "text_len " + std::to_string(len_) + " bytes"; }
  difftrain::diffusion::TextEncoding encode(
      const difftrain::diffusion::Tokens& tokens,
      const difftrain::diffusion::EncodeRequest& request) const override {
    check_loaded();
    if (request.skip_layers != 0)
      throw Error("toy-dit's text encoder has one layer to skip none of");
    auto& model = *model_.ptr();
    difftrain::diffusion::TextEncoding out;
    out.last_hidden_state = model.forward(tokens.input_ids.to(model.position_embedding.device()));
    return out;
  }

 private:
  ToyTextEncoder model_;
  int64_t len_, width_;
};

// The denoiser: patches -> tokens, BasicTransformerBlocks conditioned on the caption (cross
// attention) with the time embedding added to every token, tokens -> patches.
class ToyDiTImpl : public torch::nn::Module {
 public:
  explicit ToyDiTImpl(const ToyConfig& c) : c_(c) {
    const int64_t pp = c.patch * c.patch, n = (c.size / c.patch) * (c.size / c.patch);
    patch_embed = register_module("patch_embed", models::Linear(pp, c.width));
    pos_embed = register_parameter("pos_embed", torch::randn({n, c.width}) * 0.02);
    time_embed = register_module("time_embed", models::TimestepEmbedding(c.width, c.width));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int64_t i = 0; i < c.depth; ++i) {
      blocks->push_back(models::BasicTransformerBlock(c.width, c.heads, c.width / c.heads, c.width,
                                                      false, false));
    }
    norm_out = register_module("norm_out", torch::nn::LayerNorm(std::vector<int64_t>{c.width}));
    proj_out = register_module("proj_out", models::Linear(c.width, pp));
  }
  // x: [B, 1, S, S], t: [B] (0..1000), context: [B, L, width] -> [B, 1, S, S]
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& t,
                        const torch::Tensor& context) {
    const int64_t b = x.size(0), p = c_.patch, g = c_.size / p;
    auto h = x.reshape({b, g, p, g, p}).permute({0, 1, 3, 2, 4}).reshape({b, g * g, p * p});
    h = patch_embed(h) + pos_embed.unsqueeze(0);
    const auto temb = time_embed(models::timestep_embedding(t, c_.width, true, 0.0));
    h = h + temb.to(h.scalar_type()).unsqueeze(1);
    for (const auto& block : *blocks)
      h = block->as<models::BasicTransformerBlock>()->forward(h, context);
    h = proj_out(norm_out(h));
    return h.reshape({b, g, g, p, p}).permute({0, 1, 3, 2, 4}).reshape({b, 1, c_.size, c_.size});
  }
  models::Linear patch_embed{nullptr}, proj_out{nullptr};
  torch::Tensor pos_embed;
  models::TimestepEmbedding time_embed{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::LayerNorm norm_out{nullptr};

 private:
  ToyConfig c_;
};
TORCH_MODULE(ToyDiT);

// The whole model as one module: its state-dict keys are the folder's weight names.
class ToyModelImpl : public torch::nn::Module {
 public:
  explicit ToyModelImpl(const ToyConfig& c) : config(c) {
    text_encoder = register_module("text_encoder", ToyTextEncoder(c));
    denoiser = register_module("denoiser", ToyDiT(c));
  }
  ToyConfig config;
  ToyTextEncoder text_encoder{nullptr};
  ToyDiT denoiser{nullptr};
};
TORCH_MODULE(ToyModel);

// The model's text side as a stack: tokenize captions, encode prompts or cached ids.
difftrain::diffusion::TextEncoderStack text_stack(const ToyModel& model) {
  return difftrain::diffusion::TextEncoderStack(
      difftrain::diffusion::last_hidden_state(),
      {std::make_shared<ToyTextComponent>(model->text_encoder)});
}

io::TensorMap weights_of(const torch::nn::Module& m) {
  io::TensorMap out;
  for (const auto& p : m.named_parameters()) out[p.key()] = p.value().detach().cpu().contiguous();
  return out;
}

ToyConfig read_config(const std::string& dir) {
  const auto path = (fs::path(dir) / "config.json").string();
  if (!fs::is_regular_file(path)) {
    throw Error(dir +
                ": no config.json; a toy-dit folder has model_index.json, config.json and "
                "model.safetensors (custom_family toy-init DIR makes one)");
  }
  return ToyConfig::from_json(nlohmann::json::parse(io::read_file(path)), path);
}

// The folder's model (float32, CPU), weights checked by name and shape.
ToyModel load_model(const std::string& dir) {
  ToyModel model(read_config(dir));
  const auto path = (fs::path(dir) / "model.safetensors").string();
  if (!fs::is_regular_file(path)) throw Error(path + ": missing; the folder has no weights");
  const auto file = io::load_safetensors(path);
  torch::NoGradGuard no_grad;
  for (auto& p : model->named_parameters()) {
    const auto it = file.tensors.find(p.key());
    if (it == file.tensors.end()) throw Error(path + ": no weight " + p.key());
    if (it->second.sizes() != p.value().sizes()) {
      throw Error(fmt::format("{}: {} has shape {}, the config says {}", path, p.key(),
                              c10::str(it->second.sizes()), c10::str(p.value().sizes())));
    }
    p.value().copy_(it->second);
  }
  return model;
}

void save_model(const fs::path& dir, ToyModel& model) {
  fs::create_directories(dir);
  const nlohmann::json index = {{"_class_name", "ToyDiTPipeline"}, {"denoiser", {"toy", "ToyDiT"}}};
  io::write_file_atomic((dir / "model_index.json").string(), index.dump(2));
  io::write_file_atomic((dir / "config.json").string(), model->config.to_json().dump(2));
  io::save_safetensors((dir / "model.safetensors").string(), weights_of(*model));
}

// The toy's own LoRA layout: "toy::<module>::down" / "::up" / "::alpha", component denoiser.
constexpr const char* kOwnPrefix = "toy::";

io::LoraKeyLayout own_layout() {
  io::LoraKeyLayout layout;
  layout.name = "toy-dit's own";
  layout.matches = [](const std::map<std::string, torch::Tensor>& t) {
    return !t.empty() && t.begin()->first.rfind(kOwnPrefix, 0) == 0;
  };
  layout.normalize = [](const std::map<std::string, torch::Tensor>& t) {
    std::map<std::string, torch::Tensor> out;
    for (const auto& [key, value] : t) {
      const auto sep = key.rfind("::");
      const std::string module = key.substr(5, sep - 5), role = key.substr(sep + 2);
      out[role == "alpha" ? "denoiser." + module + ".alpha"
                          : "denoiser." + module + ".lora." + role + ".weight"] = value;
    }
    return out;
  };
  return layout;
}

void write_own_layout(const std::string& path, const io::LoraWeights& lora) {
  io::TensorMap t;
  for (const auto& target : lora.components.at("denoiser")) {
    t[kOwnPrefix + target.module + "::down"] = target.down.contiguous();
    t[kOwnPrefix + target.module + "::up"] = target.up.contiguous();
    if (target.alpha) t[kOwnPrefix + target.module + "::alpha"] = torch::tensor(*target.alpha);
  }
  io::save_safetensors(path, t);
}

// 8x8 stripes: "horizontal" and "vertical", each at a few phases, in [-1, 1].
std::pair<torch::Tensor, std::vector<std::string>> toy_images(int64_t n, int64_t size) {
  auto x = torch::empty({n, 1, size, size});
  std::vector<std::string> captions;
  const auto r = torch::arange(size).to(torch::kFloat32);
  for (int64_t i = 0; i < n; ++i) {
    const bool horizontal = i % 2 == 0;
    const auto wave = torch::sin((r + static_cast<double>((i / 2) % 4)) * 1.5708);
    x[i][0] = horizontal ? wave.unsqueeze(1).expand({size, size})
                         : wave.unsqueeze(0).expand({size, size});
    captions.push_back(horizontal ? "horizontal" : "vertical");
  }
  return {x, captions};
}

nlohmann::json flow_scheduler() {
  return {{"_class_name", "FlowMatchEulerDiscreteScheduler"},
          {"num_train_timesteps", 1000},
          {"shift", 1.0}};
}

// Euler steps of the flow from sigma 1 to 0: x <- x + (sigma_next - sigma) v.
// `shift` > 1 spends more steps at high noise (sigma -> shift s / (1 + (shift - 1) s)), the
// family's own `difftrain sample --toy_shift`.
torch::Tensor generate(ToyModel& model, const std::vector<std::string>& prompts, int64_t steps,
                       uint64_t seed, const std::function<void(int64_t, int64_t)>& on_step,
                       double shift = 1.0) {
  torch::NoGradGuard no_grad;
  model->eval();
  const auto& c = model->config;
  const auto context = text_stack(model).encode(prompts).embeds;
  auto gen = at::detail::createCPUGenerator(seed);
  auto x = torch::randn({static_cast<int64_t>(prompts.size()), 1, c.size, c.size}, gen);
  for (int64_t i = 0; i < steps; ++i) {
    double s = 1.0 - static_cast<double>(i) / steps;
    double next = 1.0 - static_cast<double>(i + 1) / steps;
    if (shift != 1.0) {
      s = shift * s / (1 + (shift - 1) * s);
      next = shift * next / (1 + (shift - 1) * next);
    }
    const auto t = torch::full({x.size(0)}, s * 1000.0);
    x = x + (next - s) * model->denoiser(x, t, context);
    if (on_step) on_step(i + 1, steps);
  }
  model->train();
  return (x / 2 + 0.5).clamp(0, 1).permute({0, 2, 3, 1}).contiguous();  // [K, H, W, 1]
}

class ToyTask : public train::TrainingTask {
 public:
  explicit ToyTask(train::TaskOptions o) : o_(std::move(o)) {}
  std::string name() const override { return "toy-dit"; }

  void build(difftrain::accel::Accelerator& acc, const std::string&) override {
    model_ = load_model(o_.model.pretrained_model_name_or_path);
    const int64_t n = o_.family.integer("toy_samples");
    auto [images, captions] = toy_images(n, model_->config.size);
    captions_ = captions;
    data_ = std::make_shared<difftrain::data::TensorDataset>(
        difftrain::data::Example{{"x0", images},
                                 {"ids", text_stack(model_).tokenize(captions)[0].input_ids},
                                 {"index", torch::arange(n)}});
    for (auto& p : model_->text_encoder->parameters()) p.set_requires_grad(false);
    if (o_.lora.enabled) {
      for (auto& p : model_->denoiser->parameters()) p.set_requires_grad(false);
      models::LoraConfig lc;
      lc.rank = o_.lora.rank;
      lc.alpha = o_.lora.alpha;
      lc.target_modules = o_.lora.target_modules;
      lora_ = models::LoraLayers(*model_->denoiser, lc);
      trainable_ = lora_.ptr();
    } else {
      trainable_ = model_->denoiser.ptr();
    }
    model_->to(acc.device());
    if (lora_) lora_->to(acc.device());
    objective_ = std::make_unique<difftrain::diffusion::FlowMatchObjective>(
        flow_scheduler(), "toy-dit's scheduler",
        train::flow_matching_options(o_.family, o_.noise.seed));
    acc.print("toy-dit: {} images of {}x{}, objective {}", n, model_->config.size,
              model_->config.size, objective_->name());
  }
  std::shared_ptr<difftrain::data::Dataset> dataset() const override { return data_; }
  void set_epoch(int64_t) override {}
  std::shared_ptr<torch::nn::Module> trainable() const override { return trainable_; }
  std::string parameter_summary() const override {
    return train::parameter_summary(*model_, *trainable_, o_.lora.enabled);
  }
  int64_t frozen_bytes() const override { return train::frozen_parameter_bytes(*model_); }

  torch::Tensor loss(const difftrain::data::Batch& batch, int64_t epoch,
                     torch::Device device) override {
    const auto x0 = batch.at("x0").to(device);
    const auto idx = batch.at("index");
    std::vector<int64_t> keys(idx.data_ptr<int64_t>(), idx.data_ptr<int64_t>() + idx.numel());
    torch::Tensor context;
    {
      torch::NoGradGuard no_grad;
      context = text_stack(model_).encode_ids({batch.at("ids")}).embeds;
    }
    const auto noised = objective_->noise(x0, keys, epoch, device);
    const auto prediction =
        model_->denoiser(noised.model_input, noised.timesteps.to(torch::kFloat32), context);
    return objective_->losses(prediction, noised).mean();
  }

  train::ValidationImages render_validation(const std::vector<int64_t>& mine, int64_t,
                                            const SamplerStepCallback& on_step) override {
    std::vector<std::string> prompts;
    for (const int64_t i : mine) prompts.push_back(i % 2 == 0 ? "horizontal" : "vertical");
    train::ValidationImages out;
    if (prompts.empty()) {
      out.images = torch::zeros({0, model_->config.size, model_->config.size, 1});
      return out;
    }
    out.images =
        generate(model_, prompts, o_.validation.inference_steps, o_.validation.seed, on_step).cpu();
    return out;
  }
  std::vector<std::string> validation_labels(int64_t k) const override {
    std::vector<std::string> labels;
    for (int64_t i = 0; i < k; ++i) labels.push_back(i % 2 == 0 ? "horizontal" : "vertical");
    return labels;
  }
  void write_to_checkpoint(const fs::path& dir) const override {
    io::write_file_atomic((dir / "toy_config.json").string(), model_->config.to_json().dump(2));
  }
  void export_to(const fs::path& out) override {
    if (!lora_) {
      save_model(out, model_);
      return;
    }
    fs::create_directories(out);
    const auto weights = lora_->to_lora_weights("denoiser");
    io::write_lora((out / "pytorch_lora_weights.safetensors").string(), weights,
                   o_.lora.format == "peft"    ? io::LoraFormat::kPeft
                   : o_.lora.format == "kohya" ? io::LoraFormat::kKohya
                                               : io::LoraFormat::kDiffusers);
    write_own_layout((out / "toy_lora.safetensors").string(), weights);
  }

 private:
  train::TaskOptions o_;
  ToyModel model_{nullptr};
  models::LoraLayers lora_{nullptr};
  std::shared_ptr<torch::nn::Module> trainable_;
  std::shared_ptr<difftrain::data::TensorDataset> data_;
  std::unique_ptr<difftrain::diffusion::FlowMatchObjective> objective_;
  std::vector<std::string> captions_;
};

class ToyFamily : public difftrain::families::ModelFamily {
 public:
  std::string name() const override { return "toy-dit"; }
  std::vector<std::string> pipeline_classes() const override { return {"ToyDiTPipeline"}; }
  bool matches_components(const nlohmann::json&) const override { return false; }
  std::vector<std::string> lora_components() const override { return {"denoiser"}; }
  std::vector<io::LoraKeyLayout> lora_key_layouts() const override { return {own_layout()}; }
  std::vector<train::OptionSpec> options() const override {
    auto specs = train::flow_matching_option_specs();
    train::OptionSpec samples{"toy_samples", "int", 32, "synthetic training images (stripes)",
                              [](const nlohmann::json& v, const std::string& where) {
                                if (v.get<int64_t>() < 2) throw Error(where + " must be >= 2");
                              }};
    samples.structural = true;
    specs.push_back(std::move(samples));
    return specs;
  }
  std::vector<train::OptionSpec> sample_options() const override {
    return {{"toy_shift", "float", 1.0, "shift of the sampling sigmas (1: none)",
             [](const nlohmann::json& v, const std::string& where) {
               if (!(v.get<double>() > 0)) throw Error(where + " must be positive");
             }}};
  }
  std::optional<train::ScriptDefaults> training_defaults(
      const train::TrainConfig& config) const override {
    train::ScriptDefaults d;
    d.script = "this example's recipe";
    d.resolution = 8;
    d.train_batch_size = 8;
    d.learning_rate = config.lora ? 1e-2 : 2e-3;
    d.lr_warmup_steps = 0;
    d.adam_weight_decay = 0.0;
    d.checkpointing_steps = 0;
    d.num_validation_images = 2;
    d.lora_target_modules = {"to_q", "to_k", "to_v", "to_out.0"};
    d.not_applicable = {"validation_scheduler", "clip_skip"};
    return d;
  }
  void adapt_lora(io::LoraWeights& lora, const std::string& dir, io::LoraFormat) const override {
    // kohya names (underscored) resolve against the denoiser's module names.
    ToyModel model(read_config(dir));
    io::resolve_kohya_names(lora, "denoiser", models::lora_module_names(*model->denoiser));
  }
  models::LoraFolderMergeSummary merge_lora(const std::string& dir, const std::string& lora,
                                            const std::string& output_dir,
                                            const models::LoraFolderMergeOptions&) const override {
    ToyModel model = load_model(dir);
    const auto merged = models::merge_lora(*model->denoiser, io::read_lora(lora), 1.0, "denoiser");
    save_model(output_dir, model);
    models::LoraFolderMergeSummary s;
    s.modules_merged = merged.modules_merged;
    s.weights_written = {(fs::path(output_dir) / "model.safetensors").string()};
    return s;
  }
  torch::Tensor forward(const std::string& dir, const std::map<std::string, torch::Tensor>& in,
                        const std::string& source, const std::string& lora,
                        double lora_scale) const override {
    ToyModel model = load_model(dir);
    if (!lora.empty()) {
      models::merge_lora(*model->denoiser, io::read_lora(lora), lora_scale, "denoiser");
    }
    for (const char* name : {"hidden_states", "timestep", "encoder_hidden_states"}) {
      if (in.count(name) == 0) throw Error(source + ": no tensor \"" + std::string(name) + "\"");
    }
    torch::NoGradGuard no_grad;
    return model->denoiser(in.at("hidden_states"), in.at("timestep"),
                           in.at("encoder_hidden_states"));
  }
  std::vector<train::MemoryEstimate> estimate_memory(
      const std::string& model_path, const train::MemoryEstimateOptions& options,
      const std::vector<difftrain::accel::ShardingStrategy>& strategies) const override {
    ToyModel model(read_config(model_path));
    std::shared_ptr<torch::nn::Module> trainable = model->denoiser.ptr();
    for (auto& p : model->text_encoder->parameters()) p.set_requires_grad(false);
    models::LoraLayers lora{nullptr};
    if (options.lora) {
      for (auto& p : model->denoiser->parameters()) p.set_requires_grad(false);
      models::LoraConfig lc;
      lc.rank = options.lora_rank;
      lc.alpha = static_cast<double>(options.lora_rank);
      lora = models::LoraLayers(*model->denoiser, lc);
      trainable = lora.ptr();
    }
    std::vector<train::MemoryEstimate> out;
    for (const auto strategy : strategies) {
      auto o = options;
      o.strategy = strategy;
      out.push_back(train::estimate_state_memory(*trainable, o, model.get()));
    }
    return out;
  }
  std::unique_ptr<difftrain::diffusion::Pipeline> load_pipeline(
      const std::string& dir, const difftrain::diffusion::PipelineLoadOptions&) const override {
    throw Error(dir + ": toy-dit has no diffusion::Pipeline; difftrain sample draws it directly");
  }
  std::unique_ptr<train::TrainingTask> make_training_task(
      const train::TaskOptions& options) const override {
    return std::make_unique<ToyTask>(options);
  }
  difftrain::diffusion::GenerateResult sample(
      const difftrain::families::SampleOptions& a) const override {
    const auto prompts = difftrain::families::sample_prompts(a, "toy-dit");
    ToyModel model = load_model(a.model);
    if (!a.lora.empty()) {
      models::merge_lora(*model->denoiser, io::read_lora(a.lora), a.lora_scale, "denoiser");
    }
    const int64_t steps = a.num_inference_steps > 0 ? a.num_inference_steps : 16;
    difftrain::log::info("difftrain sample: {} (toy-dit), {} steps, {} prompt(s), seed {}", a.model,
                         steps, prompts.size(), a.seed);
    if (a.on_start) a.on_start();
    difftrain::diffusion::GenerateResult r;
    r.images = generate(model, prompts, steps, a.seed, a.on_step, a.family.number("toy_shift"));
    for (const auto& p : prompts) r.labels.push_back(p);
    return r;
  }
};

}  // namespace

void write_initial_model(const std::string& dir, const ToyConfig& config, uint64_t seed) {
  torch::manual_seed(seed);
  ToyModel model(config);
  save_model(dir, model);
}

void register_toy_family() { difftrain::families::register_family(std::make_unique<ToyFamily>()); }

}  // namespace toy
