// What a run writes: checkpoints (and resuming from them), run_info, validation grids, and the
// final pipeline folder or LoRA file.
#include "difftrain/accel/checkpoint_manifest.h"
#include "difftrain/core/error.h"
#include "difftrain/diffusion/pipeline.h"
#include "difftrain/distributed/process_group.h"
#include "difftrain/io/atomic_file.h"
#include "difftrain/io/image.h"
#include "difftrain/io/lora_format.h"
#include "difftrain/io/safetensors.h"
#include "difftrain/models/pretrained.h"
#include "train_parts.h"

#include <torch/torch.h>

#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <regex>

namespace difftrain::train {
namespace fs = std::filesystem;
namespace {

// Options whose change makes a checkpoint a different run: refused at resume.
const std::vector<std::string> kStructural = {"model_config_name_or_path",
                                              "pretrained_model_name_or_path",
                                              "dataset",
                                              "resolution",
                                              "class_conditional",
                                              "lora",
                                              "rank",
                                              "lora_alpha",
                                              "lora_target_modules",
                                              "use_ema",
                                              "use_8bit_adam",
                                              "prediction_type",
                                              "ddpm_num_steps",
                                              "ddpm_beta_schedule",
                                              "only_class",
                                              "max_train_samples",
                                              "class_dropout_prob",
                                              "caption_column",
                                              "instance_prompt",
                                              "with_prior_preservation",
                                              "class_prompt",
                                              "train_text_encoder",
                                              "text_encoder_lora_target_modules",
                                              "clip_skip"};
// Options whose change breaks bit-exact continuation: a warning.
const std::vector<std::string> kExactness = {"train_batch_size",
                                             "gradient_accumulation_steps",
                                             "seed",
                                             "learning_rate",
                                             "lr_scheduler",
                                             "lr_warmup_steps",
                                             "max_train_steps",
                                             "noise_offset",
                                             "snr_gamma",
                                             "mixed_precision",
                                             "random_flip"};

void rotate_checkpoints(const TrainConfig& c) {
  if (!c.checkpoints_total_limit) return;
  static const std::regex kName(R"(checkpoint-(\d+))");
  std::vector<std::pair<int64_t, fs::path>> found;
  for (const auto& entry : fs::directory_iterator(c.output_dir)) {
    std::smatch m;
    const std::string name = entry.path().filename().string();
    if (entry.is_directory() && std::regex_match(name, m, kName)) {
      found.emplace_back(std::stoll(m[1].str()), entry.path());
    }
  }
  std::sort(found.begin(), found.end());
  const auto limit = static_cast<size_t>(*c.checkpoints_total_limit);
  for (size_t i = 0; i + limit < found.size(); ++i) {
    spdlog::info("checkpoints_total_limit {}: removing {}", limit, found[i].second.string());
    std::error_code ec;
    fs::remove_all(found[i].second, ec);
  }
}

}  // namespace

void save_checkpoint(const TrainConfig& c, accel::Accelerator& acc, TrainParts& parts,
                     int64_t global_step) {
  const std::string dir =
      (fs::path(c.output_dir) / ("checkpoint-" + std::to_string(global_step))).string();
  acc.save_state(dir, [&](const std::string& temp) {
    if (!acc.is_main_process()) return;
    if (!c.lora) {
      // With the weights (consolidated by `difftrain merge-weights`), a Diffusers UNet folder.
      io::write_file_atomic((fs::path(temp) / "config.json").string(),
                            parts.unet->config().to_json().dump(2) + "\n");
      io::write_file_atomic(
          (fs::path(temp) / "scheduler_config.json").string(),
          diffusion::dump_python_json(parts.noise_scheduler->config().to_json(), 2) + "\n");
    }
    if (parts.ema) {
      io::save_safetensors((fs::path(temp) / "ema.safetensors").string(),
                           parts.ema->state_tensors(), {{"format", "pt"}});
      io::write_file_atomic((fs::path(temp) / "ema.json").string(),
                            parts.ema->state_meta().dump(2) + "\n");
    }
    // Fault injection for the tests: die in the middle of this save.
    if (const char* kill_at = std::getenv("DIFFTRAIN_FAULT_KILL_IN_SAVE");
        kill_at != nullptr && std::to_string(global_step) == kill_at) {
      std::raise(SIGKILL);
    }
    nlohmann::json state = {{"global_step", global_step},
                            {"num_processes", acc.num_processes()},
                            {"config", c.to_json()}};
    // Written last: its presence marks a complete checkpoint.
    io::write_file_atomic((fs::path(temp) / "trainer_state.json").string(), state.dump(2) + "\n");
  });
  acc.print("saved checkpoint {}", dir);
  if (acc.is_main_process()) rotate_checkpoints(c);
  acc.wait_for_everyone();
}

int64_t load_checkpoint(const std::string& dir, const TrainConfig& c, accel::Accelerator& acc,
                        TrainParts& parts) {
  const fs::path root(dir);
  // Every file (trainer_state.json and EMA included) against checksums.json, once, up front.
  accel::verify_checkpoint(dir);
  nlohmann::json state;
  const std::string state_path = (root / "trainer_state.json").string();
  try {
    state = nlohmann::json::parse(io::read_file(state_path));
  } catch (const nlohmann::json::exception& e) {
    throw Error("'" + state_path + "' is not valid JSON (" + e.what() + ")");
  }
  const auto now = c.to_json();
  const auto& saved = state.at("config");
  for (const auto& key : kStructural) {
    if (saved.contains(key) && saved[key] != now[key]) {
      throw Error("cannot resume from " + dir + ": it was trained with --" + key + " " +
                  saved[key].dump() + " but this run has " + now[key].dump() +
                  "; use the same value or start a new --output_dir");
    }
  }
  for (const auto& key : kExactness) {
    if (saved.contains(key) && saved[key] != now[key]) {
      acc.print(
          "warning: resuming with --{} {} (checkpoint: {}); the run will not match an "
          "uninterrupted one exactly",
          key, now[key].dump(), saved[key].dump());
    }
  }
  acc.load_state(dir, /*verify=*/false);
  if (parts.ema) {
    const auto meta_path = (root / "ema.json").string();
    if (!fs::exists(meta_path)) throw Error("cannot resume EMA: " + meta_path + " is missing");
    parts.ema->load_state(nlohmann::json::parse(io::read_file(meta_path)),
                          io::load_safetensors((root / "ema.safetensors").string()).tensors,
                          (root / "ema.safetensors").string());
  }
  return state.at("global_step").get<int64_t>();
}

void write_run_info(const TrainConfig& c, accel::Accelerator& acc, const TrainParts& parts,
                    const fs::path& log_dir) {
  // Measured by the Accelerator: what this rank holds (shards under sharding), plus the frozen
  // base of a LoRA run, which is not prepared.
  const auto mem = acc.memory();
  int64_t frozen = mem.frozen_param_bytes;
  auto frozen_bytes = [](const torch::nn::Module& m) {
    int64_t n = 0;
    for (const auto& p : m.parameters())
      n += p.requires_grad() ? 0 : p.numel() * static_cast<int64_t>(p.element_size());
    return n;
  };
  if (c.lora) frozen += frozen_bytes(*parts.unet);
  if (parts.t2i) frozen += frozen_bytes(*parts.t2i->vae) + frozen_bytes(*parts.t2i->text_encoder);
  nlohmann::json info = {
      {"config", c.to_json()},
      {"rank", acc.process_index()},
      {"world_size", acc.num_processes()},
      {"threads", at::get_num_threads()},
      {"device", acc.device().str()},
      {"versions", {{"difftrain", DIFFTRAIN_VERSION}, {"libtorch", TORCH_VERSION}}},
      {"examples", parts.dataset->size()},
      {"total_steps", parts.total_steps},
      {"state_bytes",
       {{"param_bytes", mem.param_bytes},
        {"param_peak_bytes", mem.param_peak_bytes},
        {"grad_bytes", mem.grad_bytes},
        {"grad_peak_bytes", mem.grad_peak_bytes},
        {"optimizer_bytes", mem.optimizer_bytes},
        {"frozen_param_bytes", frozen}}},
      {"sharding", accel::to_string(acc.sharding().strategy)}};
  std::error_code ec;
  fs::create_directories(log_dir, ec);
  io::write_file_atomic(
      (log_dir / ("run_info.rank" + std::to_string(acc.process_index()) + ".json")).string(),
      info.dump(2) + "\n");
}

namespace {

// Rank 0 keeps each rank's real images of `gathered` (every rank's block padded to `per_rank`)
// in order and writes them as samples/step-<step>.png and a TensorBoard image. Returns the path.
std::string write_validation_grid(const TrainConfig& c, accel::Accelerator& acc,
                                  const torch::Tensor& gathered, int64_t per_rank, int64_t K,
                                  const std::vector<std::string>& labels, int64_t columns,
                                  int64_t global_step, accel::Trackers* trackers) {
  std::vector<torch::Tensor> keep;
  for (int r = 0; r < acc.num_processes(); ++r) {
    const int64_t count = K / acc.num_processes() + (r < K % acc.num_processes() ? 1 : 0);
    if (count > 0) keep.push_back(gathered.narrow(0, r * per_rank, count));
  }
  auto grid =
      io::make_grid(io::to_uint8_images(torch::cat(keep).permute({0, 3, 1, 2})), labels, columns);
  const fs::path dir = fs::path(c.output_dir) / "samples";
  fs::create_directories(dir);
  char name[64];
  std::snprintf(name, sizeof name, "step-%06lld.png", static_cast<long long>(global_step));
  io::save_png((dir / name).string(), grid);
  if (trackers) trackers->log_image("validation", grid, global_step);
  return (dir / name).string();
}

// --validation_prompt rendered num_validation_images times (image i from seed + i), the images
// split across ranks and gathered into one grid on the main rank.
void run_text_to_image_validation(const TrainConfig& c, accel::Accelerator& acc, TrainParts& parts,
                                  int64_t global_step, accel::Trackers* trackers) {
  if (c.validation_prompt.empty()) {
    acc.print("validation skipped: give --validation_prompt to render images during training");
    return;
  }
  const int64_t K = c.num_validation_images;
  std::vector<int64_t> all(K);
  for (int64_t i = 0; i < K; ++i) all[i] = i;
  const auto mine = acc.split_between_processes(all, /*apply_padding=*/true);
  auto full = acc.summon_full_params();
  if (parts.ema) parts.ema->store(*parts.trainable), parts.ema->copy_to(*parts.trainable);
  torch::Tensor images;
  {
    auto autocast = acc.autocast();
    images = render_validation(c, *parts.t2i, parts.unet, parts.noise_scheduler->config(), mine);
  }
  if (parts.ema) parts.ema->restore(*parts.trainable);
  parts.trainable->train();
  auto gathered = acc.gather(images.contiguous());
  if (!acc.is_main_process()) return;
  std::vector<std::string> labels;
  for (int64_t i = 0; i < K; ++i) labels.push_back("seed " + std::to_string(c.seed + i));
  const std::string path = write_validation_grid(
      c, acc, gathered, static_cast<int64_t>(mine.size()), K, labels, 0, global_step, trackers);
  spdlog::info("validation samples (\"{}\"): {}", c.validation_prompt, path);
}

}  // namespace

void run_validation(const TrainConfig& c, accel::Accelerator& acc, TrainParts& parts,
                    int64_t global_step, accel::Trackers* trackers) {
  const int64_t K = c.num_validation_images;
  if (K == 0) return;
  if (parts.t2i) {
    run_text_to_image_validation(c, acc, parts, global_step, trackers);
    return;
  }
  if (parts.unet->needs_encoder_hidden_states()) {
    acc.print("validation skipped: sampling a UNet2DConditionModel needs a text encoder");
    return;
  }
  // Work split across ranks, so no rank waits idle in a collective while rank 0 samples.
  std::vector<int64_t> all(K);
  for (int64_t i = 0; i < K; ++i) all[i] = i;
  const auto mine = acc.split_between_processes(all, /*apply_padding=*/true);
  const auto [begin, end] = acc.split_range(K);
  auto full = acc.summon_full_params();  // sampling and the EMA swap read every parameter
  if (parts.ema) parts.ema->store(*parts.trainable), parts.ema->copy_to(*parts.trainable);
  auto sampler = diffusion::make_sampler(parts.noise_scheduler->config().to_json(),
                                         c.validation_scheduler, "the training scheduler");
  diffusion::SampleOptions so;
  so.num_images = static_cast<int64_t>(mine.size());
  so.num_inference_steps = c.validation_inference_steps;
  so.seed = c.seed + 1000003ULL * static_cast<uint64_t>(begin + 1);
  so.guidance_scale = c.guidance_scale;
  std::vector<std::string> labels;
  if (parts.class_conditional) {
    const int64_t classes = parts.num_classes > 0 ? parts.num_classes : 1;
    for (int64_t i : mine) so.class_labels.push_back(i % classes);
    for (int64_t i = 0; i < K; ++i) {
      const int64_t label = i % classes;
      labels.push_back(label < static_cast<int64_t>(parts.class_names.size())
                           ? parts.class_names[label]
                           : std::to_string(label));
    }
  }
  torch::Tensor images;  // [k, H, W, C]
  {
    // Under bf16 the frozen LoRA base is bf16 and the adapters fp32: autocast joins them.
    auto autocast = acc.autocast();
    images = diffusion::sample_images(*parts.unet, *sampler, so);
  }
  if (parts.ema) parts.ema->restore(*parts.trainable);
  auto gathered = acc.gather(images.contiguous());
  if (!acc.is_main_process()) return;
  // Each rank's block is its range padded to the same length; keep the real images in order.
  const std::string path = write_validation_grid(
      c, acc, gathered, static_cast<int64_t>(mine.size()), K, labels,
      parts.class_conditional ? std::max<int64_t>(parts.num_classes, 1) : 0, global_step, trackers);
  spdlog::info("validation samples: {}", path);
}

void export_final(const TrainConfig& c, accel::Accelerator& acc, TrainParts& parts) {
  auto full = acc.summon_full_params();
  if (acc.is_main_process()) {
    if (parts.ema) parts.ema->copy_to(*parts.trainable);  // the export uses EMA weights
    const fs::path out(c.output_dir);
    if (c.lora) {
      const auto format = c.lora_format == "kohya"  ? io::LoraFormat::kKohya
                          : c.lora_format == "peft" ? io::LoraFormat::kPeft
                                                    : io::LoraFormat::kDiffusers;
      const auto path = out / "pytorch_lora_weights.safetensors";
      io::LoraWeights weights = parts.lora->to_lora_weights("unet");
      if (parts.t2i && parts.t2i->text_lora) {
        auto te = parts.t2i->text_lora->to_lora_weights("text_encoder");
        weights.components["text_encoder"] = te.components["text_encoder"];
      }
      io::write_lora(path.string(), weights, format,
                     {{"difftrain_rank", std::to_string(c.rank)},
                      {"difftrain_lora_alpha",
                       std::to_string(c.lora_alpha.value_or(static_cast<double>(c.rank)))}});
      spdlog::info("LoRA weights ({} format): {}", c.lora_format, path.string());
    } else if (parts.t2i) {
      models::save_unet(*parts.unet, (out / "unet").string());
      export_text_to_image_pipeline(*parts.t2i, out.string());
      spdlog::info("pipeline folder ({}): {}", parts.t2i->folder.pipeline_class, out.string());
    } else {
      models::save_unet(*parts.unet, (out / "unet").string());
      diffusion::SchedulerConfig sc = parts.noise_scheduler->config();
      sc.class_name = "DDPMScheduler";
      fs::create_directories(out / "scheduler");
      sc.save((out / "scheduler" / "scheduler_config.json").string());
      const std::string unet_class = parts.unet->config().kind == models::UNetKind::kUNet2D
                                         ? "UNet2DModel"
                                         : "UNet2DConditionModel";
      nlohmann::json index = {{"_class_name", "DDPMPipeline"},
                              {"_diffusers_version", "0.31.0"},
                              {"scheduler", {"diffusers", "DDPMScheduler"}},
                              {"unet", {"diffusers", unet_class}}};
      io::write_file_atomic((out / "model_index.json").string(), index.dump(2) + "\n");
      spdlog::info("pipeline folder (DDPMPipeline): {}", out.string());
    }
  }
  acc.wait_for_everyone();
}

}  // namespace difftrain::train
