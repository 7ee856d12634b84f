// The training loop of the Trainer (Trainer::State::train), in named steps that read top to bottom:
// start_loop -> per epoch run_epoch: micro_step (forward, backward, optimizer step), after an
// update after_update (EMA, the loss and the stop request agreed by every rank), log_update,
// checkpoint_and_validate -> finish (the last checkpoint, the final validation, the export).
#include "trainer_state.h"

#include "checkpoint_files.h"
#include "difftrain/core/log.h"
#include "difftrain/core/phase.h"

#include <algorithm>
#include <limits>
#include <map>
#include <optional>

namespace difftrain::train {

Trainer::State::Loop Trainer::State::start_loop() {
  Loop l;
  l.world = acc->num_processes();
  // The global batch, or the whole dataset when it is smaller (each update then repeats
  // examples: Accelerate's even batches wrap around).
  const int64_t examples = task->dataset()->size();
  const int64_t full_batch = o.train_batch_size * l.world * o.gradient_accumulation_steps;
  l.global_batch = std::min(full_batch, examples);
  if (examples < full_batch) {
    acc->warn(
        "the dataset has {} example(s), fewer than one global batch of {} (--train_batch_size "
        "{} x {} process(es) x --gradient_accumulation_steps {}): each update repeats examples, "
        "and samples/s counts the {} distinct ones; lower --train_batch_size, or use more images "
        "(or --dataset_repeats)",
        examples, full_batch, o.train_batch_size, l.world, o.gradient_accumulation_steps, examples);
  }
  l.run_start = l.window_start = Clock::now();
  l.first_step = global_step;
  l.trainable = task->trainable();
  l.params = l.trainable->parameters();
  return l;
}

bool Trainer::State::micro_step(Loop& l, const data::Batch& batch, int64_t epoch) {
  auto micro = acc->accumulate();
  torch::Tensor loss;
  {
    auto autocast = acc->autocast();
    loss = task->loss(batch, epoch, acc->device());
  }
  acc->backward(loss);
  l.micro_loss += loss.item<double>();
  ++l.micro_count;
  core::note_progress();
  // clip (the norm is logged even without clipping), update, schedule
  l.grad_norm = std::numeric_limits<double>::quiet_NaN();
  if (acc->sync_gradients()) {
    l.grad_norm = acc->clip_grad_norm_(
        l.params, o.max_grad_norm > 0 ? o.max_grad_norm : std::numeric_limits<double>::infinity());
  }
  l.lr_used = lr_schedule->get_last_lr().at(0);
  optimizer->step();
  scheduler->step();
  optimizer->zero_grad();
  return acc->sync_gradients();
}

void Trainer::State::after_update(Loop& l) {
  ++global_step;
  if (ema) {
    auto full = acc->summon_full_params();  // the EMA reads every parameter (FULL_SHARD)
    ema->step(*l.trainable);
  }
  auto agreed = torch::tensor(
      {l.micro_loss / std::max<int64_t>(l.micro_count, 1), static_cast<double>(stop_requested())},
      torch::kFloat64);
  agreed = acc->reduce(agreed, "sum");
  last_loss = agreed[0].item<double>() / static_cast<double>(l.world);
  l.stopped = agreed[1].item<double>() > 0;
  l.micro_loss = 0.0;
  l.micro_count = 0;
  l.window_loss += last_loss;
  ++l.window_steps;
}

void Trainer::State::log_update(Loop& l) {
  if (!wrote_run_info) write_run_info();
  if (trackers) {
    std::map<std::string, double> scalars = {
        {"loss", last_loss}, {"lr", l.lr_used}, {"grad_norm", l.grad_norm}};
    scalars["samples_per_second"] =
        static_cast<double>((global_step - l.first_step) * l.global_batch) /
        std::max(seconds_since(l.run_start) - l.run_paused_s, 1e-9);
    if (acc->mixed_precision() == accel::MixedPrecision::kFp16) {
      scalars["loss_scale"] = acc->loss_scale();
    }
    if (ema) scalars["ema_decay"] = ema->cur_decay_value();
    trackers->log_scalars(scalars, global_step);
  }
  if (acc->is_main_process() &&
      (global_step % o.logging_steps == 0 || global_step == total_steps)) {
    const double its =
        l.window_steps / std::max(seconds_since(l.window_start) - l.window_paused_s, 1e-9);
    log::info("step {}/{} | {:.2f} it/s | {:.1f} samples/s | loss {:.4f} | lr {:.2e} | ETA {}",
              global_step, total_steps, its, its * l.global_batch, l.window_loss / l.window_steps,
              l.lr_used, format_duration((total_steps - global_step) / its));
    l.window_start = Clock::now();
    l.window_paused_s = 0.0;
    l.window_steps = 0;
    l.window_loss = 0.0;
  }
  if (global_step == l.first_step + Loop::kTimingSkip) l.timed_start = Clock::now();
}

bool Trainer::State::checkpoint_and_validate(Loop& l, std::optional<int64_t> ended_epoch) {
  const bool last = global_step >= total_steps;
  if (l.stopped) announce_stop();
  const bool step_save =
      o.checkpointing_steps > 0 && global_step % o.checkpointing_steps == 0 && !last;
  // kohya: epoch e (1-based) saves when e % N == 0, unless it is the last (the run's end saves).
  const bool epoch_save = ended_epoch && o.save_every_n_epochs > 0 &&
                          (*ended_epoch + 1) % o.save_every_n_epochs == 0 && !last;
  // Diffusers: after epoch e (0-based) when e % N == 0, so after the first epoch too; the last
  // epoch's is the final validation.
  const bool validation_due =
      (o.validation_steps > 0 && global_step % o.validation_steps == 0) ||
      (ended_epoch && o.validation_epochs > 0 && *ended_epoch % o.validation_epochs == 0);
  bool saved = false, paused_here = false;
  // The epoch's export before its checkpoint: a checkpoint at an epoch's end then means the
  // export is there too (a resume from it continues after the epoch-end work), and a stop
  // signal keeps the epoch save it came on.
  if (epoch_save) paused(l, [&] { save_epoch(*ended_epoch + 1, /*owns_checkpoint=*/!step_save); });
  if (l.stopped || step_save || epoch_save) {
    paused(l, [&] { save_checkpoint(); });
    saved = paused_here = true;
  }
  if (epoch_save && o.save_last_n_epochs > 0 && acc->is_main_process()) {
    prune_epoch_saves(o.output_dir, *ended_epoch + 1, o.save_every_n_epochs, o.save_last_n_epochs);
  }
  if (!l.stopped && validation_due && !last) {
    paused(l, [&] {
      if (!validate()) l.stopped = abandoned_validation = true;
    });
    l.trainable->train();
    paused_here = true;
  }
  // A signal that came during a save or a validation stops the run here, not one update
  // later (a preempted job may not have the time for another update and save).
  if (!l.stopped && paused_here) {
    l.stopped =
        acc->reduce(torch::tensor({static_cast<double>(stop_requested())}, torch::kFloat64), "sum")
            .item<double>() > 0;
    if (l.stopped) announce_stop();
  }
  if (l.stopped && !saved) paused(l, [&] { save_checkpoint(); });
  return last || l.stopped;
}

void Trainer::State::run_epoch(Loop& l) {
  const int64_t epoch = loader->state().epoch;
  task->set_epoch(epoch);
  l.trainable->train();
  for (const auto& batch : *loader) {
    if (!micro_step(l, batch, epoch)) continue;
    after_update(l);
    log_update(l);
    // The epoch ends on the update of its last batch (a partial accumulation window included:
    // the Accelerator syncs at the end of the data), the same test on every rank.
    const bool epoch_end = loader->position() >= loader->common_size();
    if (checkpoint_and_validate(l, epoch_end ? std::optional<int64_t>(epoch) : std::nullopt)) {
      break;
    }
  }
}

TrainResult Trainer::State::finish(Loop& l) {
  if (!wrote_run_info) write_run_info();
  if (l.timed_start && global_step > l.first_step + Loop::kTimingSkip) {
    const double seconds = seconds_since(*l.timed_start) - l.timed_paused_s;
    const int64_t timed = global_step - l.first_step - Loop::kTimingSkip;
    acc->print(
        "timing: training loop {:.2f} samples/s, {:.1f} ms per update (updates {}-{}, {:.3f} s; "
        "the first {} are warm-up; {:.3f} s of checkpoints and validation left out)",
        static_cast<double>(timed * l.global_batch) / seconds, 1000.0 * seconds / timed,
        l.first_step + Loop::kTimingSkip + 1, global_step, seconds, Loop::kTimingSkip,
        l.timed_paused_s);
  }
  auto phase_start = Clock::now();
  auto phase = [&phase_start] {
    const double s = seconds_since(phase_start);
    phase_start = Clock::now();
    return s;
  };
  save_checkpoint();
  const double checkpoint_s = phase();
  if (final_validation_wanted() && !validate()) {
    abandoned_validation = true;
    throw_interrupted();
  }
  const double validation_s = phase();
  export_final();
  const double export_s = phase();
  acc->print(
      "timing: end of run {:.2f} s (last checkpoint {:.2f} s, validation {:.2f} s, "
      "export {:.2f} s)",
      checkpoint_s + validation_s + export_s, checkpoint_s, validation_s, export_s);
  if (trackers) trackers->flush();
  acc->print("done: {} updates, final loss {:.4f}, output in {}", global_step, last_loss,
             o.output_dir);
  return {o.output_dir, global_step, last_loss};
}

TrainResult Trainer::State::train() {
  // The stop request lives as long as the loop: the previous signal handlers are back when
  // train() returns or throws.
  stop = std::make_unique<StopSignals>();
  struct StopScope {
    std::unique_ptr<StopSignals>& stop;
    ~StopScope() { stop.reset(); }
  } scope{stop};
  Loop l = start_loop();
  while (global_step < total_steps && !l.stopped) run_epoch(l);
  if (l.stopped) throw_interrupted();
  return finish(l);
}

}  // namespace difftrain::train
