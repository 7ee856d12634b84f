// The Trainer: the loop of `difftrain train`, read top to bottom in run():
// prepare -> resume -> for each update (accumulate, step, log, checkpoint, validate) -> export.
// What a model family adds (data, models, loss, validation renders, export) comes from its
// TrainingTask.
#include "trainer_state.h"

#include "checkpoint_files.h"
#include "difftrain/accel/accelerator.h"
#include "difftrain/accel/checkpoint_manifest.h"
#include "difftrain/accel/trackers.h"
#include "difftrain/core/env.h"
#include "difftrain/core/error.h"
#include "difftrain/core/log.h"
#include "difftrain/core/phase.h"
#include "difftrain/data/data_loader.h"
#include "difftrain/diffusion/ema.h"
#include "difftrain/distributed/process_group.h"
#include "difftrain/io/atomic_file.h"
#include "difftrain/io/image.h"
#include "difftrain/io/safetensors.h"
#include "difftrain/io/video.h"
#include "difftrain/optim/adamw.h"
#include "difftrain/optim/adamw8bit.h"
#include "difftrain/optim/lr_schedule.h"
#include "difftrain/optim/prodigy.h"
#include "difftrain/train/model_card.h"
#include "difftrain/train/output_folder.h"
#include "difftrain/version.h"

#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <thread>

namespace difftrain::train {

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

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

void Trainer::State::make_accelerator() {
  accel::AcceleratorOptions ao;
  if (!o.mixed_precision.empty()) ao.mixed_precision = o.mixed_precision;
  ao.gradient_accumulation_steps = o.gradient_accumulation_steps;
  ao.seed = o.seed;
  ao.sharding = o.sharding;
  acc = std::make_unique<accel::Accelerator>(ao);
  for (const auto& w : o.warnings) acc->warn("{}", w);
}

void Trainer::State::make_output_folders() {
  if (o.output_dir.empty()) {
    auto stamp = torch::tensor({static_cast<int64_t>(std::time(nullptr))}, torch::kInt64);
    stamp = acc->broadcast(stamp, 0);
    std::time_t t = static_cast<std::time_t>(stamp.item<int64_t>());
    char buf[32];
    std::strftime(buf, sizeof buf, "%Y%m%d-%H%M%S", std::gmtime(&t));
    o.output_dir = std::string("runs/") + buf;
  }
  out_dir = fs::path(o.output_dir);
  log_dir =
      fs::path(o.logging_dir).is_absolute() ? fs::path(o.logging_dir) : out_dir / o.logging_dir;
  if (acc->is_main_process()) {
    check_output_dir_against_inputs(o.output_dir, o.inputs);
    output_lock = OutputDirLock::acquire(o.output_dir);
    const auto held = output_dir_entries(o.output_dir);
    if (!held.empty() && o.overwrite_output_dir) {
      // Cleared only once every input has been read (clear_overwritten_run(), after
      // prepare()): a typo in --train_data_dir must not cost the finished run.
      overwritten = held.size();
    } else if (!held.empty() && o.resume_from_checkpoint.empty()) {
      std::string names;
      for (size_t i = 0; i < held.size() && i < 3; ++i) names += (i ? ", " : "") + held[i];
      if (held.size() > 3) names += ", ... (" + std::to_string(held.size()) + " entries)";
      throw Error("--output_dir '" + o.output_dir + "' already holds files (" + names +
                  "); continue that run with --resume_from_checkpoint latest, pass "
                  "--overwrite_output_dir to delete them first, or pick another --output_dir");
    }
    remove_unfinished_checkpoints(o.output_dir);
  }
  acc->wait_for_everyone();
}

void Trainer::State::clear_overwritten_run() {
  acc->wait_for_everyone();
  if (!acc->is_main_process() || overwritten == 0) return;
  const size_t removed = clear_output_dir(o.output_dir, o.keep_on_overwrite);
  log::info("--overwrite_output_dir: the inputs are read; clearing {}: {} entries removed{}",
            o.output_dir, removed, removed < overwritten ? ", the caches kept" : "");
  overwritten = 0;
}

void Trainer::State::make_logs_folder() {
  if (!acc->is_main_process()) return;
  std::error_code ec;
  fs::create_directories(log_dir, ec);
  if (ec) {
    // It lies inside output_dir unless --logging_dir is absolute: name the folder the user gave.
    if (fs::path(o.logging_dir).is_absolute()) {
      throw Error("cannot create --logging_dir '" + log_dir.string() + "': " + ec.message() +
                  "; pass a writable --logging_dir");
    }
    throw Error("cannot create output_dir '" + out_dir.string() + "': " + ec.message() +
                "; pass a writable --output_dir");
  }
}

void Trainer::State::prepare() {
  task->build(*acc, o.output_dir);
  auto trainable = task->trainable();

  data::DataLoaderOptions lo;
  lo.batch_size = o.train_batch_size;
  lo.shuffle = true;
  lo.num_workers = static_cast<int>(o.dataloader_num_workers);
  lo.seed = o.seed;
  lo.sampler = task->sampler();
  loader = std::make_shared<data::DataLoader>(task->dataset(), lo);

  double lr = o.learning_rate;
  if (o.scale_lr) {
    lr *= static_cast<double>(o.gradient_accumulation_steps * o.train_batch_size *
                              acc->num_processes());
  }
  auto adam = torch::optim::AdamWOptions(lr)
                  .betas({o.adam_beta1, o.adam_beta2})
                  .weight_decay(o.adam_weight_decay)
                  .eps(o.adam_epsilon);
  std::vector<torch::Tensor> params;
  std::vector<std::string> names;
  for (const auto& p : trainable->named_parameters()) {
    if (!p.value().requires_grad()) continue;
    params.push_back(p.value());
    names.push_back(p.key());
  }
  std::string kind = o.optimizer;
  for (auto& ch : kind) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  if (kind == "prodigy") {
    optim::ProdigyOptions po;
    po.beta3 = o.prodigy_beta3;
    po.decouple = o.prodigy_decouple;
    po.use_bias_correction = o.prodigy_use_bias_correction;
    po.safeguard_warmup = o.prodigy_safeguard_warmup;
    if (lr <= 0.1) {
      log::warn(
          "--learning_rate {} with Prodigy: it estimates the step size itself and multiplies "
          "it by the learning rate, so around 1.0 is the usual choice",
          lr);
    }
    raw_optimizer = std::make_shared<optim::Prodigy>(params, adam, po);
  } else if (o.use_8bit_adam) {
    raw_optimizer = std::make_shared<optim::AdamW8bit>(params, adam);
  } else {
    raw_optimizer = std::make_shared<optim::AdamW>(params, adam);
  }
  raw_optimizer->set_parameter_names(names);

  acc->prepare_module(*trainable);
  optimizer = acc->prepare_optimizer(raw_optimizer);
  loader = acc->prepare_data_loader(loader);

  const int64_t accumulation = o.gradient_accumulation_steps;
  updates_per_epoch = (loader->size() + accumulation - 1) / accumulation;
  total_steps = o.max_train_steps > 0 ? o.max_train_steps : o.num_train_epochs * updates_per_epoch;

  optim::LRScheduleOptions so;
  so.name = o.lr_scheduler;
  so.num_warmup_steps = o.lr_warmup_steps;
  so.num_training_steps = total_steps;
  so.num_cycles = o.lr_num_cycles;
  so.power = o.lr_power;
  lr_schedule = std::make_shared<optim::LRScheduler>(*raw_optimizer, so);
  auto sched = lr_schedule;
  scheduler =
      acc->prepare_scheduler([sched] { sched->step(); }, [sched] { return sched->state_dict(); },
                             [sched](const nlohmann::json& s) { sched->load_state_dict(s); });

  if (o.use_ema) {
    diffusion::EMAOptions eo;
    eo.decay = o.ema_max_decay;
    eo.use_ema_warmup = true;
    eo.inv_gamma = o.ema_inv_gamma;
    eo.power = o.ema_power;
    auto full = acc->summon_full_params();
    ema = std::make_unique<diffusion::EMAModel>(*trainable, eo);
  }
}

std::string Trainer::State::resume_dir() const {
  if (o.resume_from_checkpoint.empty()) return "";
  const std::string dir = o.resume_from_checkpoint == "latest" ? latest_checkpoint(o.output_dir)
                                                               : o.resume_from_checkpoint;
  if (dir.empty()) {
    acc->print("resume_from_checkpoint latest: no checkpoint in {}; starting a new run",
               o.output_dir);
  } else if (!fs::exists(dir)) {
    throw Error("resume_from_checkpoint '" + dir +
                "' does not exist; pass a checkpoint-<step> folder of an earlier run, or "
                "latest (the newest one in --output_dir)");
  } else if (!fs::exists(fs::path(dir) / "trainer_state.json")) {
    throw Error("resume_from_checkpoint '" + dir +
                "' is not a complete difftrain checkpoint (no trainer_state.json); pass a "
                "checkpoint-<step> folder or latest");
  }
  return dir;
}

void Trainer::State::print_header() const {
  if (!acc->is_main_process()) return;
  const nlohmann::json& shown = o.shown_config.is_null() ? o.config : o.shown_config;
  log::info("difftrain train: resolved configuration\n{}", shown.dump(2));
  if (!o.defaults_from.empty()) {
    // A bare script name is Diffusers'; another tool's comes with its name
    // ("musubi-tuner wan_train_network.py").
    const bool named = o.defaults_from.find(' ') != std::string::npos;
    log::info("  defaults: {}{} (the options given win)", named ? "" : "Diffusers' ",
              o.defaults_from);
  }
  log::info(
      "  examples {} | classes {} | processes {} on {} ({}) | batch per process {} | "
      "accumulation {} | global batch {}",
      task->dataset()->size(), task->num_classes(), acc->num_processes(), acc->device().str(),
      acc->group().backend_name(), o.train_batch_size, o.gradient_accumulation_steps,
      o.train_batch_size * acc->num_processes() * o.gradient_accumulation_steps);
  log::info("  updates per epoch {} | total updates {} | {}", updates_per_epoch, total_steps,
            task->parameter_summary());
}

void Trainer::State::save_checkpoint() {
  core::PhaseScope phase("saving checkpoint-" + std::to_string(global_step));
  const auto started = Clock::now();
  const std::string dir = (out_dir / ("checkpoint-" + std::to_string(global_step))).string();
  acc->save_state(dir, [&](const std::string& temp) {
    if (!acc->is_main_process()) return;
    task->write_to_checkpoint(temp);
    if (ema) {
      io::save_safetensors((fs::path(temp) / "ema.safetensors").string(), ema->state_tensors(),
                           {{"format", "pt"}});
      io::write_file_atomic((fs::path(temp) / "ema.json").string(),
                            ema->state_meta().dump(2) + "\n");
    }
    // Fault injection for the tests: die in the middle of this save, or stall in it
    // ("<step>:<seconds>", without progress: a slow or stuck disk).
    if (const char* kill_at = std::getenv("DIFFTRAIN_FAULT_KILL_IN_SAVE");
        kill_at != nullptr && std::to_string(global_step) == kill_at) {
      std::raise(SIGKILL);
    }
    if (const char* sleep_at = std::getenv("DIFFTRAIN_FAULT_SLEEP_IN_SAVE")) {
      const std::string spec = sleep_at;
      const auto colon = spec.find(':');
      if (colon != std::string::npos && spec.substr(0, colon) == std::to_string(global_step)) {
        std::this_thread::sleep_for(
            std::chrono::duration<double>(std::stod(spec.substr(colon + 1))));
      }
    }
    nlohmann::json state = {
        {"global_step", global_step},
        {"num_processes", acc->num_processes()},
        {"global_batch", o.train_batch_size * acc->num_processes() * o.gradient_accumulation_steps},
        {"config", o.config}};
    // Written last: its presence marks a complete checkpoint.
    io::write_file_atomic((fs::path(temp) / "trainer_state.json").string(), state.dump(2) + "\n");
  });
  acc->print("saved checkpoint {} ({:.1f} s)", dir, seconds_since(started));
  if (acc->is_main_process() && o.checkpoints_total_limit) {
    rotate_checkpoints(o.output_dir, *o.checkpoints_total_limit);
  }
  acc->wait_for_everyone();
}

void Trainer::State::load_checkpoint(const std::string& dir) {
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
  const auto& now = o.config;
  const auto& saved = state.at("config");
  for (const auto& key : o.structural_keys) {
    if (saved.contains(key) && saved[key] != now[key]) {
      throw Error("cannot resume from " + dir + ": it was trained with --" + key + " " +
                  saved[key].dump() + " but this run has " + now[key].dump() +
                  "; use the same value or start a new --output_dir");
    }
  }
  // The same global batch on another world size (2 x 4, 1 x 8, 1 x 4 with accumulation 2)
  // continues exactly: the loader resumes at the same sample of the global order.
  const int64_t global_now =
      o.train_batch_size * acc->num_processes() * o.gradient_accumulation_steps;
  int64_t global_then = 0;
  if (state.contains("global_batch")) {
    global_then = state.at("global_batch").get<int64_t>();
  } else if (saved.contains("train_batch_size") && state.contains("num_processes")) {
    global_then = saved.at("train_batch_size").get<int64_t>() *
                  state.at("num_processes").get<int64_t>() *
                  saved.value("gradient_accumulation_steps", int64_t{1});
  }
  if (global_then > 0 && global_then != global_now) {
    acc->warn(
        "resuming with a global batch of {} (--train_batch_size {} x {} process(es) x "
        "--gradient_accumulation_steps {}; checkpoint: {}); the run will not match an "
        "uninterrupted one exactly",
        global_now, o.train_batch_size, acc->num_processes(), o.gradient_accumulation_steps,
        global_then);
  }
  for (const auto& key : o.exactness_keys) {
    if (saved.contains(key) && saved[key] != now[key]) {
      acc->warn(
          "resuming with --{} {} (checkpoint: {}); the run will not match an "
          "uninterrupted one exactly",
          key, now[key].dump(), saved[key].dump());
    }
  }
  acc->load_state(dir, /*verify=*/false);
  if (ema) {
    const auto meta_path = (root / "ema.json").string();
    if (!fs::exists(meta_path)) throw Error("cannot resume EMA: " + meta_path + " is missing");
    ema->load_state(nlohmann::json::parse(io::read_file(meta_path)),
                    io::load_safetensors((root / "ema.safetensors").string()).tensors,
                    (root / "ema.safetensors").string());
  }
  global_step = state.at("global_step").get<int64_t>();
}

void Trainer::State::write_run_info() {
  // Measured by the Accelerator: what this rank holds (shards under sharding), plus the frozen
  // weights the task keeps outside it.
  const auto mem = acc->memory();
  const int64_t frozen = mem.frozen_param_bytes + task->frozen_bytes();
  nlohmann::json info = {
      {"config", o.config},
      {"rank", acc->process_index()},
      {"world_size", acc->num_processes()},
      {"threads", at::get_num_threads()},
      {"device", acc->device().str()},
      {"versions", {{"difftrain", DIFFTRAIN_VERSION}, {"libtorch", TORCH_VERSION}}},
      {"examples", task->dataset()->size()},
      {"total_steps", total_steps},
      {"state_bytes",
       {{"param_bytes", mem.param_bytes},
        {"param_peak_bytes", mem.param_peak_bytes},
        {"grad_bytes", mem.grad_bytes},
        {"grad_peak_bytes", mem.grad_peak_bytes},
        {"optimizer_bytes", mem.optimizer_bytes},
        {"frozen_param_bytes", frozen},
        {"host_bytes", mem.host_bytes}}},
      {"sharding", accel::to_string(acc->sharding().strategy)},
      {"offload_optimizer", acc->sharding().offload_optimizer},
      {"offload_params", acc->sharding().offload_params}};
  if (const models::BlockSwap* swap = task->block_swap()) {
    // Measured: the bytes the host copies hold and the most ever staged at once on the device
    // (the first step has run: forward and backward stage every swapped block).
    const auto b = swap->bytes();
    const int64_t staged = swap->peak_staged_bytes();
    info["block_swap"] = {{"blocks", b.blocks},
                          {"host_bytes", b.host_bytes},
                          {"staging_bytes", staged},
                          {"saved_device_bytes", b.host_bytes - staged}};
  }
  std::error_code ec;
  fs::create_directories(log_dir, ec);
  io::write_file_atomic(
      (log_dir / ("run_info.rank" + std::to_string(acc->process_index()) + ".json")).string(),
      info.dump(2) + "\n");
  wrote_run_info = true;
}

bool Trainer::State::final_validation_wanted() {
  if (o.final_validation == "never" || o.num_validation_images == 0) return false;
  // An epoch cadence validates from the first epoch on: the run asked for validation.
  if (o.final_validation == "always" || o.validation_steps == 0 || o.validation_epochs > 0 ||
      task->validation_requested() || total_steps >= o.validation_steps) {
    return true;
  }
  acc->print(
      "final validation skipped: the run has {} updates, fewer than --validation_steps {} "
      "(--final_validation always renders it)",
      total_steps, o.validation_steps);
  return false;
}

bool Trainer::State::validate() {
  const int64_t K = o.num_validation_images;
  if (K == 0) return true;
  const std::string unavailable = task->validation_unavailable();
  if (!unavailable.empty()) {
    acc->print("validation skipped: {}", unavailable);
    return true;
  }
  core::PhaseScope phase("rendering validation images at step " + std::to_string(global_step));
  std::vector<int64_t> all(K);
  for (int64_t i = 0; i < K; ++i) all[i] = i;
  const auto mine = acc->split_between_processes(all, /*apply_padding=*/true);
  const auto started = Clock::now();
  acc->print("validation at step {}: sampling {} image(s), {} per rank", global_step, K,
             mine.size());
  const auto range = acc->split_range(K);
  auto trainable = task->trainable();
  auto full = acc->summon_full_params();  // sampling and the EMA swap read every parameter
  if (ema) ema->store(*trainable), ema->copy_to(*trainable);
  torch::Tensor images;  // [k, H, W, C], or clips [k, F, H, W, C]
  // A line every few seconds from the main rank (a long validation must not look like a hang),
  // and at a stop signal the render is dropped: the checkpoint matters more than the images.
  auto last_line = Clock::now();
  const auto on_step = [&](int64_t step, int64_t steps) {
    core::note_progress();
    if (stop_requested()) throw ValidationAbandoned{};
    if (acc->is_main_process() && step < steps && seconds_since(last_line) >= 5.0) {
      const double s = seconds_since(started);
      log::info("validation: sampling step {}/{} ({:.1f} s, ETA {})", step, steps, s,
                format_duration(s / static_cast<double>(step) * static_cast<double>(steps - step)));
      last_line = Clock::now();
    }
  };
  bool abandoned = false;
  try {
    // Under bf16 the frozen LoRA base is bf16 and the adapters fp32: autocast joins them.
    auto autocast = acc->autocast();
    images = task->render_validation(mine, range.first, on_step).images;
  } catch (const ValidationAbandoned&) {
    abandoned = true;
  }
  if (ema) ema->restore(*trainable);
  trainable->train();
  // Every rank learns whether any abandoned it before the gather (a rank that finished its
  // share while another stopped must not wait in the gather for images that never come).
  auto any_abandoned = acc->reduce(
      torch::tensor({static_cast<double>(abandoned || stop_requested())}, torch::kFloat64), "sum");
  if (any_abandoned.item<double>() > 0) {
    acc->print(
        "validation at step {} abandoned after {:.1f} s: a stop signal came; saving the "
        "checkpoint instead",
        global_step, seconds_since(started));
    return false;
  }
  auto gathered = acc->gather(images.contiguous());
  if (!acc->is_main_process()) return true;
  // Each rank's block is its range padded to the same length; keep the real images in order.
  const auto per_rank = static_cast<int64_t>(mine.size());
  std::vector<torch::Tensor> keep;
  for (int r = 0; r < acc->num_processes(); ++r) {
    const int64_t count = K / acc->num_processes() + (r < K % acc->num_processes() ? 1 : 0);
    if (count > 0) keep.push_back(gathered.narrow(0, r * per_rank, count));
  }
  const fs::path dir = out_dir / "samples";
  fs::create_directories(dir);
  char name[64];
  std::snprintf(name, sizeof name, "step-%06lld.png", static_cast<long long>(global_step));
  card_images = torch::cat(keep), card_labels = task->validation_labels(K);
  card_images_step = global_step;
  auto grid = io::save_image_grid((dir / name).string(), card_images, card_labels,
                                  task->validation_columns());
  if (trackers) trackers->log_image("validation", grid, global_step);
  const std::string png = (dir / name).string();
  std::string videos;
  if (card_images.dim() == 5 && io::video_supported()) {
    // Clips: each also as an MP4 (the grid above is their frame strips, one row a clip).
    for (int64_t k = 0; k < card_images.size(0); ++k) {
      std::snprintf(name, sizeof name, "step-%06lld-%lld.mp4", static_cast<long long>(global_step),
                    static_cast<long long>(k));
      io::VideoWriteOptions w;
      w.fps = task->validation_fps();
      io::write_video((dir / name).string(), card_images[k], w);
    }
    videos = fmt::format(" and {} MP4 clip(s) beside it", card_images.size(0));
  }
  log::info("validation samples{}: {}{} ({:.1f} s)", task->validation_note(), png, videos,
            seconds_since(started));
  return true;
}

void Trainer::State::export_final() {
  core::PhaseScope phase("exporting the trained model");
  auto full = acc->summon_full_params();
  if (acc->is_main_process()) {
    if (ema) ema->copy_to(*task->trainable());  // the export uses EMA weights
    task->export_to(out_dir);
    auto card = task->model_card();  // README.md, with the final render's images if any
    card.run = model_card_run(o, acc->num_processes(), accel::to_string(acc->mixed_precision()),
                              global_step);
    const bool fresh = card_images_step == global_step;
    write_model_card(out_dir, card, fresh ? card_images : torch::Tensor(), card_labels);
  }
  acc->wait_for_everyone();
}

void Trainer::State::save_epoch(int64_t epoch, bool owns_checkpoint) {
  const std::string name = epoch_save_name(epoch);
  core::PhaseScope phase("saving " + name);
  const auto started = Clock::now();
  {
    auto full = acc->summon_full_params();
    if (acc->is_main_process()) {
      auto trainable = task->trainable();
      if (ema) ema->store(*trainable), ema->copy_to(*trainable);  // the export uses EMA weights
      write_epoch_save(o.output_dir, epoch, global_step, owns_checkpoint,
                       [&](const fs::path& dir) { task->export_to(dir); });
      if (ema) ema->restore(*trainable);
      trainable->train();
    }
  }
  acc->wait_for_everyone();
  acc->print("saved {} after epoch {} at step {} ({:.1f} s)", (out_dir / name).string(), epoch,
             global_step, seconds_since(started));
}

std::string Trainer::State::resume_command() const {
  std::string cmd = user_command();
  if (cmd.empty()) cmd = "difftrain train <your options>";
  // The folder now holds this run: clearing it again would delete the checkpoint.
  for (const char* flag : {" --overwrite_output_dir true", " --overwrite_output_dir 1",
                           " --overwrite_output_dir=true", " --overwrite_output_dir"}) {
    for (auto at = cmd.find(flag); at != std::string::npos; at = cmd.find(flag)) {
      cmd.erase(at, std::string(flag).size());
    }
  }
  if (cmd.find("--output_dir") == std::string::npos) {
    cmd += " --output_dir " + shell_command({o.output_dir});
  }
  if (cmd.find("--resume_from_checkpoint") == std::string::npos) {
    cmd += " --resume_from_checkpoint latest";
  } else if (o.resume_from_checkpoint != "latest") {
    cmd += " (with --resume_from_checkpoint latest)";
  }
  return cmd;
}

void Trainer::State::announce_stop() {
  const int signo = stop ? stop->signal() : 0;
  // Said now, since a second signal ends the run before it can say anything more.
  const std::string last = acc->is_main_process() ? latest_checkpoint(o.output_dir) : "";
  acc->print(
      "{} received: saving checkpoint-{}, then stopping (a second signal to the launcher "
      "stops at once{}); continue with --resume_from_checkpoint latest --output_dir {}",
      signo == SIGINT    ? "SIGINT"
      : signo == SIGTERM ? "SIGTERM"
                         : "a stop signal (on "
                           "another rank)",
      global_step,
      last.empty() ? ", with no checkpoint saved yet"
                   : ", and the run resumes from " + fs::path(last).filename().string(),
      o.output_dir);
}

[[noreturn]] void Trainer::State::throw_interrupted() {
  if (trackers) trackers->flush();
  throw Error("training interrupted by a signal at step " + std::to_string(global_step) +
              (abandoned_validation ? " (validation abandoned)" : "") + "; checkpoint saved in " +
              (out_dir / ("checkpoint-" + std::to_string(global_step))).string() +
              "; continue with: " + resume_command());
}

Trainer::Trainer(TrainerOptions options, std::unique_ptr<TrainingTask> task)
    : s_(std::make_unique<State>()) {
  s_->o = std::move(options);
  s_->task = std::move(task);
}

Trainer::~Trainer() = default;

TrainResult Trainer::run() {
  State& s = *s_;
  distributed::configure_threads();
  s.make_accelerator();
  s.make_output_folders();
  s.prepare();
  s.clear_overwritten_run();
  const std::string resume_dir = s.resume_dir();
  s.make_logs_folder();
  s.print_header();
  if (!resume_dir.empty()) {
    s.load_checkpoint(resume_dir);
    s.acc->print("resumed from {} at step {} (epoch {}, batch {})", resume_dir, s.global_step,
                 s.loader->state().epoch, s.loader->state().batches_consumed);
  }
  if (s.acc->is_main_process()) {
    std::optional<int64_t> resume_step;
    if (!resume_dir.empty()) resume_step = s.global_step;
    s.trackers = accel::make_trackers(s.o.report_to, s.log_dir.string(),
                                      (s.out_dir / "metrics.jsonl").string(), resume_step);
  }
  return s.train();
}

}  // namespace difftrain::train
