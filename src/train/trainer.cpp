#include "difftrain/train/trainer.h"

#include "difftrain/accel/accelerator.h"
#include "difftrain/accel/checkpoint_manifest.h"
#include "difftrain/accel/trackers.h"
#include "difftrain/core/error.h"
#include "difftrain/core/log.h"
#include "difftrain/data/image_folder.h"
#include "difftrain/data/mnist.h"
#include "difftrain/data/sample_rng.h"
#include "difftrain/diffusion/ema.h"
#include "difftrain/diffusion/noise_scheduler.h"
#include "difftrain/diffusion/pipeline.h"
#include "difftrain/distributed/process_group.h"
#include "difftrain/io/atomic_file.h"
#include "difftrain/io/image.h"
#include "difftrain/io/lora_format.h"
#include "difftrain/io/safetensors.h"
#include "difftrain/models/lora_training.h"
#include "difftrain/models/pretrained.h"
#include "difftrain/models/unet.h"
#include "difftrain/optim/adamw.h"
#include "difftrain/optim/adamw8bit.h"
#include "difftrain/optim/lr_schedule.h"
#include "train_parts.h"

#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <filesystem>
#include <regex>

namespace difftrain::train {
namespace fs = std::filesystem;
namespace {

std::atomic<int> g_stop_signal{0};
extern "C" void on_stop_signal(int signo) { g_stop_signal.store(signo); }

// Installs SIGINT/SIGTERM handlers for the run and puts the previous ones back afterwards.
class StopSignals {
 public:
  StopSignals() {
    g_stop_signal.store(0);
    struct sigaction action {};
    action.sa_handler = on_stop_signal;
    sigemptyset(&action.sa_mask);
    sigaction(SIGINT, &action, &old_int_);
    sigaction(SIGTERM, &action, &old_term_);
  }
  ~StopSignals() {
    sigaction(SIGINT, &old_int_, nullptr);
    sigaction(SIGTERM, &old_term_, nullptr);
  }

 private:
  struct sigaction old_int_ {};
  struct sigaction old_term_ {};
};

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const auto s = static_cast<int64_t>(seconds + 0.5);
  char buf[32];
  if (s >= 3600) {
    std::snprintf(buf, sizeof buf, "%lldh%02lldm", static_cast<long long>(s / 3600),
                  static_cast<long long>((s % 3600) / 60));
  } else {
    std::snprintf(buf, sizeof buf, "%lldm%02llds", static_cast<long long>(s / 60),
                  static_cast<long long>(s % 60));
  }
  return buf;
}

}  // namespace

std::string latest_checkpoint(const std::string& output_dir) {
  static const std::regex kName(R"(checkpoint-(\d+))");
  std::vector<std::pair<int64_t, fs::path>> found;
  std::error_code ec;
  if (!fs::is_directory(output_dir, ec)) return "";
  for (const auto& entry : fs::directory_iterator(output_dir, ec)) {
    std::smatch m;
    const std::string name = entry.path().filename().string();
    // `checkpoint-<n>.tmp` (an unfinished save) never matches: a folder only gets its final name
    // once complete (save_state renames it into place).
    if (!entry.is_directory() || !std::regex_match(name, m, kName)) continue;
    if (!fs::exists(entry.path() / "trainer_state.json")) continue;
    found.emplace_back(std::stoll(m[1].str()), entry.path());
  }
  std::sort(found.begin(), found.end(),
            [](const auto& a, const auto& b) { return a.first > b.first; });
  for (const auto& [step, path] : found) {
    try {
      accel::verify_checkpoint(path.string());
      return path.string();
    } catch (const Error& e) {
      log::warn("resume_from_checkpoint latest: skipping {}: {}", path.string(), e.what());
    }
  }
  return "";
}

void remove_unfinished_checkpoints(const std::string& output_dir) {
  static const std::regex kTemp(R"(checkpoint-\d+\.tmp)");
  std::error_code ec;
  if (!fs::is_directory(output_dir, ec)) return;
  std::vector<fs::path> stale;
  for (const auto& entry : fs::directory_iterator(output_dir, ec)) {
    if (entry.is_directory() && std::regex_match(entry.path().filename().string(), kTemp))
      stale.push_back(entry.path());
  }
  for (const auto& path : stale) {
    log::warn("removing {}: an unfinished checkpoint left by an interrupted save", path.string());
    fs::remove_all(path, ec);
  }
}

TrainResult run_training(TrainConfig config) {
  distributed::configure_threads();
  accel::AcceleratorOptions acc_options;
  if (!config.mixed_precision.empty()) acc_options.mixed_precision = config.mixed_precision;
  acc_options.gradient_accumulation_steps = config.gradient_accumulation_steps;
  acc_options.seed = config.seed;
  // Sharding from the trainer's own options or config files; otherwise from `difftrain launch`
  // (its --sharding_strategy / FSDP or DeepSpeed config reach the ranks as DIFFTRAIN_* variables).
  if (config.sharding_strategy != "NO_SHARD" || !config.deepspeed_config.empty() ||
      !config.accelerate_config_file.empty()) {
    acc_options.sharding = config.sharding_options();
  }
  accel::Accelerator acc(acc_options);
  const bool main = acc.is_main_process();
  for (const auto& w : config.warnings) acc.print("warning: {}", w);

  // ---------------------------------------------------------------- output folder
  if (config.output_dir.empty()) {
    // Every rank must agree on the folder: rank 0's clock decides.
    auto stamp = torch::tensor({static_cast<int64_t>(std::time(nullptr))}, torch::kInt64);
    stamp = acc.broadcast(stamp, 0);
    std::time_t t = static_cast<std::time_t>(stamp.item<int64_t>());
    char buf[32];
    std::strftime(buf, sizeof buf, "%Y%m%d-%H%M%S", std::gmtime(&t));
    config.output_dir = std::string("runs/") + buf;
  }
  const fs::path out_dir(config.output_dir);
  const fs::path log_dir = fs::path(config.logging_dir).is_absolute()
                               ? fs::path(config.logging_dir)
                               : out_dir / config.logging_dir;
  if (main) {
    remove_unfinished_checkpoints(config.output_dir);
    std::error_code ec;
    fs::create_directories(log_dir, ec);
    if (ec) {
      // The logs folder is created first and lies inside output_dir unless --logging_dir is
      // absolute: name the folder the user gave.
      if (fs::path(config.logging_dir).is_absolute()) {
        throw Error("cannot create --logging_dir '" + log_dir.string() + "': " + ec.message() +
                    "; pass a writable --logging_dir");
      }
      throw Error("cannot create output_dir '" + out_dir.string() + "': " + ec.message() +
                  "; pass a writable --output_dir");
    }
  }
  acc.wait_for_everyone();

  // ---------------------------------------------------------------- data, model, objective
  TrainParts parts = build_parts(config, acc);

  std::string resume_dir;
  if (!config.resume_from_checkpoint.empty()) {
    resume_dir = config.resume_from_checkpoint == "latest" ? latest_checkpoint(config.output_dir)
                                                           : config.resume_from_checkpoint;
    if (resume_dir.empty()) {
      acc.print("resume_from_checkpoint latest: no checkpoint in {}; starting a new run",
                config.output_dir);
    } else if (!fs::exists(resume_dir)) {
      throw Error("resume_from_checkpoint '" + resume_dir +
                  "' does not exist; pass a checkpoint-<step> folder of an earlier run, or "
                  "latest (the newest one in --output_dir)");
    } else if (!fs::exists(fs::path(resume_dir) / "trainer_state.json")) {
      throw Error("resume_from_checkpoint '" + resume_dir +
                  "' is not a complete difftrain checkpoint (no trainer_state.json); pass a "
                  "checkpoint-<step> folder or latest");
    }
  }

  print_run_header(config, acc, parts);

  int64_t global_step = 0;
  if (!resume_dir.empty()) {
    global_step = load_checkpoint(resume_dir, config, acc, parts);
    acc.print("resumed from {} at step {} (epoch {}, batch {})", resume_dir, global_step,
              parts.loader->state().epoch, parts.loader->state().batches_consumed);
  }

  std::unique_ptr<accel::Trackers> trackers;
  if (main) {
    std::optional<int64_t> resume_step;
    if (!resume_dir.empty()) resume_step = global_step;
    trackers = accel::make_trackers(config.report_to, log_dir.string(),
                                    (out_dir / "metrics.jsonl").string(), resume_step);
  }

  // ---------------------------------------------------------------- the loop
  StopSignals signals;
  const int64_t total = parts.total_steps;
  const int64_t world = acc.num_processes();
  const int64_t global_batch = config.train_batch_size * world * config.gradient_accumulation_steps;
  auto window_start = std::chrono::steady_clock::now();
  const auto run_start = window_start;
  const int64_t first_step = global_step;
  int64_t window_steps = 0;
  double window_loss = 0.0;
  double micro_loss = 0.0;
  int64_t micro_count = 0;
  double last_loss = 0.0;
  bool wrote_run_info = false;
  bool stopped = false;
  auto trainable = parts.trainable->parameters();

  while (global_step < total && !stopped) {
    const int64_t epoch = parts.loader->state().epoch;
    parts.set_epoch(epoch);
    parts.trainable->train();
    for (const auto& batch : *parts.loader) {
      auto micro = acc.accumulate();
      torch::Tensor loss;
      {
        auto autocast = acc.autocast();
        loss = training_loss(config, parts, batch, epoch, acc.device());
      }
      acc.backward(loss);
      micro_loss += loss.item<double>();
      ++micro_count;
      double grad_norm = std::numeric_limits<double>::quiet_NaN();
      if (acc.sync_gradients()) {
        if (config.max_grad_norm > 0) {
          grad_norm = acc.clip_grad_norm_(trainable, config.max_grad_norm);
        } else {
          grad_norm = acc.clip_grad_norm_(trainable, std::numeric_limits<double>::infinity());
        }
      }
      const double lr_used = parts.current_lr();
      parts.optimizer->step();
      parts.scheduler->step();
      parts.optimizer->zero_grad();
      if (!acc.sync_gradients()) continue;

      ++global_step;
      if (parts.ema) {
        // The EMA reads every parameter: gathered for it under FULL_SHARD.
        auto full = acc.summon_full_params();
        parts.ema->step(*parts.trainable);
      }
      // One small all-reduce per update: the loss over every rank, and whether any rank was
      // asked to stop (the launcher signals every rank, but they must stop at the same step).
      auto agreed = torch::tensor({micro_loss / std::max<int64_t>(micro_count, 1),
                                   static_cast<double>(g_stop_signal.load() != 0)},
                                  torch::kFloat64);
      agreed = acc.reduce(agreed, "sum");
      last_loss = agreed[0].item<double>() / static_cast<double>(world);
      stopped = agreed[1].item<double>() > 0;
      micro_loss = 0.0;
      micro_count = 0;
      window_loss += last_loss;
      ++window_steps;

      if (!wrote_run_info) {
        write_run_info(config, acc, parts, log_dir);
        wrote_run_info = true;
      }
      if (trackers) {
        std::map<std::string, double> scalars = {
            {"loss", last_loss}, {"lr", lr_used}, {"grad_norm", grad_norm}};
        const double elapsed =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - run_start).count();
        scalars["samples_per_second"] =
            static_cast<double>((global_step - first_step) * global_batch) /
            std::max(elapsed, 1e-9);
        if (acc.mixed_precision() == accel::MixedPrecision::kFp16) {
          scalars["loss_scale"] = acc.loss_scale();
        }
        if (parts.ema) scalars["ema_decay"] = parts.ema->cur_decay_value();
        trackers->log_scalars(scalars, global_step);
      }
      if (main && (global_step % config.logging_steps == 0 || global_step == total)) {
        const auto now = std::chrono::steady_clock::now();
        const double seconds = std::chrono::duration<double>(now - window_start).count();
        const double its = window_steps / std::max(seconds, 1e-9);
        spdlog::info(
            "step {}/{} | {:.2f} it/s | {:.1f} samples/s | loss {:.4f} | lr {:.2e} | ETA {}",
            global_step, total, its, its * global_batch, window_loss / window_steps, lr_used,
            format_duration((total - global_step) / its));
        window_start = now;
        window_steps = 0;
        window_loss = 0.0;
      }
      const bool last = global_step >= total;
      if (stopped || (config.checkpointing_steps > 0 &&
                      global_step % config.checkpointing_steps == 0 && !last)) {
        save_checkpoint(config, acc, parts, global_step);
      }
      if (!stopped && config.validation_steps > 0 && global_step % config.validation_steps == 0 &&
          !last) {
        run_validation(config, acc, parts, global_step, trackers.get());
        parts.trainable->train();
      }
      if (last || stopped) break;
    }
  }

  if (stopped) {
    if (trackers) trackers->flush();
    throw Error("training interrupted by a signal at step " + std::to_string(global_step) +
                "; checkpoint saved, continue with --resume_from_checkpoint latest");
  }
  if (!wrote_run_info) write_run_info(config, acc, parts, log_dir);
  save_checkpoint(config, acc, parts, global_step);
  run_validation(config, acc, parts, global_step, trackers.get());
  export_final(config, acc, parts);
  if (trackers) trackers->flush();
  acc.print("done: {} updates, final loss {:.4f}, output in {}", global_step, last_loss,
            config.output_dir);
  return {config.output_dir, global_step, last_loss};
}

}  // namespace difftrain::train
