#pragma once
// Learning-rate schedules: Diffusers' `diffusers.optimization.get_scheduler` (0.31) — the seven
// `--lr_scheduler` choices of its training scripts — as a torch LambdaLR over any LibTorch
// optimizer, plus the `--scale_lr` rule.

#include <torch/optim/optimizer.h>
#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace difftrain::optim {

/// The schedule shapes. Diffusers: `diffusers.optimization.SchedulerType`.
enum class ScheduleType {
  kLinear,              ///< warmup, then linear decay to 0 at num_training_steps
  kCosine,              ///< warmup, then half a cosine down to 0 at num_training_steps
  kCosineWithRestarts,  ///< warmup, then num_cycles hard-restarted cosines, 0 after the end
  kPolynomial,          ///< warmup, then (lr - lr_end) * remaining^power + lr_end
  kConstant,            ///< the optimizer's lr throughout
  kConstantWithWarmup,  ///< linear warmup from 0, then the optimizer's lr
  kPiecewiseConstant,   ///< multipliers that change at given steps (step_rules)
};

/// "linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup"
/// or "piecewise_constant", matched exactly as Diffusers' `SchedulerType(name)` does. Anything else
/// throws difftrain::Error listing the seven valid names.
ScheduleType parse_schedule_type(const std::string& name);
/// The name parse_schedule_type() reads back (Diffusers' `SchedulerType.value`).
std::string to_string(ScheduleType type);

/// The arguments of Diffusers' `get_scheduler(name, optimizer, ...)`; counts are in scheduler
/// steps, i.e. optimizer updates.
struct LRScheduleOptions {
  /// One of the names of parse_schedule_type() (`--lr_scheduler`; Diffusers default "constant").
  std::string name = "constant";
  /// Steps of linear warmup from 0 (`num_warmup_steps`, `--lr_warmup_steps`). Must be >= 0;
  /// ignored by constant and piecewise_constant, as in Diffusers.
  int64_t num_warmup_steps = 0;
  /// Total steps (`num_training_steps`, `--max_train_steps`); -1 means not given. Required by
  /// linear, cosine, cosine_with_restarts and polynomial; it may be smaller than num_warmup_steps
  /// (the run then never leaves warm-up, as in Diffusers).
  int64_t num_training_steps = -1;
  /// Cosine cycles of cosine_with_restarts (`num_cycles`, `--lr_num_cycles`, default 1); finite
  /// and >= 0. Like get_scheduler, "cosine" ignores it and always uses half a cycle.
  double num_cycles = 1;
  /// Exponent of polynomial (`power`, `--lr_power`, default 1 = linear); finite and >= 0.
  double power = 1.0;
  /// Final lr of polynomial (`lr_end`, default 1e-7; get_scheduler never passes it, so Diffusers'
  /// scripts always use 1e-7). Must be >= 0 and below the optimizer's default lr.
  double lr_end = 1e-7;
  /// Rules of piecewise_constant (`step_rules`, `--lr_step_rules`): "m1:s1,m2:s2,...,m_last" —
  /// multiplier m_i while step < s_i (first matching s_i in increasing order), m_last after, e.g.
  /// "1:10,0.1:20,0.01:30,0.005". Multipliers finite and >= 0, steps integers >= 0; a repeated
  /// step keeps its last multiplier, as Diffusers' dict does.
  std::string step_rules;
};

/// The multiplier of the optimizer's lr at scheduler step `step` (>= 0): what Diffusers' lr_lambda
/// returns, computed in double precision with the same operations in the same order.
/// `initial_lr` is the optimizer's default lr (Diffusers reads `optimizer.defaults["lr"]`); only
/// polynomial uses it. Validates `options` first and throws difftrain::Error (one line naming the
/// value and the fix) on an unknown name, a negative num_warmup_steps, a missing
/// num_training_steps where it is required, polynomial with lr_end >= initial_lr, a negative or
/// non-finite num_cycles / power / lr_end, and malformed step_rules. A warm-up longer than the
/// run or equal to it, and 0 training steps, give Diffusers' values; the one point where
/// Diffusers divides by zero (polynomial at step T when T == num_warmup_steps) gives its limit,
/// lr_end / initial_lr.
std::function<double(int64_t)> make_lr_lambda(const LRScheduleOptions& options, double initial_lr);

/// A schedule driving a LibTorch optimizer's learning rates: torch's `LambdaLR` with Diffusers'
/// lr_lambda, which is what `get_scheduler` returns.
///
///     LRScheduleOptions opts;
///     opts.name = "cosine";
///     opts.num_warmup_steps = 500;
///     opts.num_training_steps = 10000;
///     LRScheduler sched(optimizer, opts);
///     for (...) { ...; optimizer.step(); sched.step(); }
///
/// Construction records every param group's current lr as its base lr and sets
/// lr = base * lambda(0) (last_epoch() == 0, as torch's LambdaLR after `__init__`). Unlike torch,
/// there is no per-group "initial_lr" memory: build a second scheduler on the same optimizer only
/// to load_state_dict() into it, since it would otherwise take the already scheduled lrs as base.
/// The optimizer must outlive the scheduler, and its options must implement get_lr()/set_lr()
/// (torch's SGD, Adam, AdamW, Adagrad and RMSprop do). Not thread-safe.
class LRScheduler {
 public:
  /// Throws difftrain::Error on invalid options (see make_lr_lambda; polynomial's initial lr is
  /// `optimizer.defaults().get_lr()`).
  LRScheduler(torch::optim::Optimizer& optimizer, LRScheduleOptions options);

  /// Advances last_epoch() by one and sets every group's lr to base_lr * lambda(last_epoch()).
  /// torch: `scheduler.step()`. Throws difftrain::Error if the optimizer's number of param groups
  /// changed since construction.
  void step();
  /// Steps taken since construction (or since the loaded state). torch: `scheduler.last_epoch`.
  int64_t last_epoch() const { return last_epoch_; }
  /// The lr this scheduler last set, one per param group. torch: `scheduler.get_last_lr()`.
  std::vector<double> get_last_lr() const { return last_lrs_; }
  /// The base lr of each param group (torch: `scheduler.base_lrs`).
  const std::vector<double>& base_lrs() const { return base_lrs_; }
  /// The options this scheduler was built with.
  const LRScheduleOptions& options() const { return options_; }

  /// {"last_epoch": n, "base_lrs": [...], "schedule": {"name", "num_warmup_steps",
  /// "num_training_steps", "num_cycles", "power", "lr_end", "step_rules"}}.
  /// torch: `scheduler.state_dict()`.
  nlohmann::json state_dict() const;
  /// Restores last_epoch and base_lrs from a state_dict() and sets every group's lr to
  /// base_lr * lambda(last_epoch), so a resumed run continues exactly where the saved one was.
  /// The schedule keeps this scheduler's options: a saved schedule whose other options differ
  /// (e.g. a longer num_training_steps) is accepted with a warning, as torch accepts any state.
  /// Throws difftrain::Error naming the field, leaving the scheduler unchanged, on a malformed
  /// state, a different schedule name, or a base_lrs count that differs from the optimizer's
  /// param groups. torch: `scheduler.load_state_dict(state)`.
  void load_state_dict(const nlohmann::json& state);

 private:
  // Checks the group count (a mismatch changes nothing), sets every group's lr to
  // base_lrs[g] * lambda(epoch), then commits epoch and base_lrs.
  void apply(int64_t epoch, std::vector<double> base_lrs);

  torch::optim::Optimizer& optimizer_;
  LRScheduleOptions options_;
  std::function<double(int64_t)> lambda_;
  int64_t last_epoch_ = 0;
  std::vector<double> base_lrs_;
  std::vector<double> last_lrs_;
};

/// Diffusers' `--scale_lr`: lr * gradient_accumulation_steps * per_device_batch_size *
/// num_processes, multiplied in that order. The three counts must be >= 1 and lr finite and >= 0,
/// else difftrain::Error.
double scale_lr(double lr, int64_t gradient_accumulation_steps, int64_t per_device_batch_size,
                int64_t num_processes);

}  // namespace difftrain::optim
