#pragma once
// Private to src/train: the Trainer's state (Trainer::State), shared by trainer.cpp (setup,
// checkpoints, validation, export) and trainer_loop.cpp (the training loop's named steps).
#include "difftrain/train/trainer.h"

#include "difftrain/accel/accelerator.h"
#include "difftrain/accel/trackers.h"
#include "difftrain/data/data_loader.h"
#include "difftrain/diffusion/ema.h"
#include "difftrain/optim/lr_schedule.h"
#include "difftrain/train/output_folder.h"

#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <filesystem>
#include <optional>

namespace difftrain::train {
namespace fs = std::filesystem;

// Thrown from a sampler step when this rank is asked to stop: the validation in progress is
// abandoned in favour of the checkpoint.
struct ValidationAbandoned {};

// The run's stop request: SIGINT / SIGTERM set it while the run holds its StopSignals, which
// installs the handlers and puts the previous ones back when the run ends. The handler reaches
// the active object through one atomic pointer (a signal handler takes no argument).
class StopSignals {
 public:
  StopSignals() {
    active().store(this);
    struct sigaction action {};
    action.sa_handler = on_signal;
    sigemptyset(&action.sa_mask);
    sigaction(SIGINT, &action, &old_int_);
    sigaction(SIGTERM, &action, &old_term_);
  }
  ~StopSignals() {
    sigaction(SIGINT, &old_int_, nullptr);
    sigaction(SIGTERM, &old_term_, nullptr);
    active().store(nullptr);
  }
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;
  /// The signal that asked this rank to stop (0: none).
  int signal() const { return signal_.load(); }
  bool requested() const { return signal() != 0; }

 private:
  static std::atomic<StopSignals*>& active() {
    static std::atomic<StopSignals*> current{nullptr};
    return current;
  }
  static void on_signal(int signo) {
    if (StopSignals* s = active().load()) s->signal_.store(signo);
  }
  std::atomic<int> signal_{0};
  struct sigaction old_int_ {};
  struct sigaction old_term_ {};
};

using Clock = std::chrono::steady_clock;
/// "1h02m" / "3m07s"; "?" for a negative or infinite duration.
std::string format_duration(double seconds);
double seconds_since(Clock::time_point t);

struct Trainer::State {
  TrainerOptions o;
  std::unique_ptr<TrainingTask> task;
  std::unique_ptr<accel::Accelerator> acc;
  fs::path out_dir, log_dir;

  std::shared_ptr<data::DataLoader> loader;
  std::shared_ptr<optim::FlatOptimizer> raw_optimizer;
  std::shared_ptr<accel::AcceleratedOptimizer> optimizer;
  std::shared_ptr<optim::LRScheduler> lr_schedule;
  std::shared_ptr<accel::AcceleratedScheduler> scheduler;
  std::unique_ptr<diffusion::EMAModel> ema;
  std::unique_ptr<accel::Trackers> trackers;  // main rank only

  int64_t updates_per_epoch = 0;
  int64_t total_steps = 0;
  int64_t global_step = 0;
  double last_loss = 0.0;
  bool wrote_run_info = false;
  torch::Tensor card_images;  // main rank: the last validation render, for the model card
  std::vector<std::string> card_labels;
  int64_t card_images_step = -1;
  std::unique_ptr<OutputDirLock> output_lock;  // main rank: held for the whole run
  size_t overwritten = 0;             // main rank: the entries --overwrite_output_dir will clear
  std::unique_ptr<StopSignals> stop;  // while train() runs

  // ------------------------------------------------------------------ setup
  void make_accelerator();

  // The run folder (rank 0's clock names it when not given) and its logs folder. The main rank
  // refuses a folder that is one of the inputs or holds another run (unless resumed or
  // --overwrite_output_dir), and locks it for the run before touching anything in it.
  void make_output_folders();

  // --overwrite_output_dir: the previous run's files go once every rank has built its models and
  // data (every input checked), right before the run writes its first file. The content-keyed
  // caches this run read or filled there (--cache_dir's default, <output_dir>/cache) stay.
  void clear_overwritten_run();

  // The logs folder, once the run is known to start (a refused resume leaves no empty logs/).
  void make_logs_folder();

  // The task's models and data, then the loader, optimizer, LR schedule and EMA, prepared.
  void prepare();

  // The checkpoint folder to resume from ("" = a new run).
  std::string resume_dir() const;

  void print_header() const;

  // ------------------------------------------------------------------ checkpoints
  void save_checkpoint();

  // Restores a checkpoint into global_step and every prepared object.
  void load_checkpoint(const std::string& dir);

  // ------------------------------------------------------------------ logs
  void write_run_info();

  // ------------------------------------------------------------------ validation
  // num_validation_images split across ranks (no rank waits idle in a collective while rank 0
  // samples), rendered with the EMA weights when EMA is on, gathered into one grid on the main
  // rank: samples/step-<step>.png and a TensorBoard image.
  // --final_validation auto: a run shorter than one validation period (a smoke test, a benchmark)
  // skips the images after its last update, which would cost more than the training itself.
  bool final_validation_wanted();

  // Returns false when a stop signal abandoned it (agreed by every rank; nothing written).
  bool validate();

  // ------------------------------------------------------------------ export
  void export_final();

  // --save_every_n_epochs: the task's export (EMA weights when EMA is on, the training weights
  // put back after) in epoch-<epoch>/ (checkpoint_files.h), then the older saves pruned by
  // --save_last_n_epochs. The checkpoint of the same step is save_checkpoint()'s.
  void save_epoch(int64_t epoch, bool owns_checkpoint);

  // The command that continues this run: the user's own (DIFFTRAIN_COMMAND; the launcher's when
  // launched) with the run's folder and --resume_from_checkpoint latest added where missing.
  std::string resume_command() const;

  // ------------------------------------------------------------------ the loop
  bool abandoned_validation = false;

  bool stop_requested() const { return stop && stop->requested(); }

  // The main rank says once which signal stopped the run and what happens now.
  void announce_stop();

  [[noreturn]] void throw_interrupted();

  // ------------------------------------------------------------------ the loop
  // What the loop keeps between updates: the counters of the progress line, the timing, and
  // whether every rank agreed to stop.
  struct Loop {
    int64_t world = 1;
    int64_t global_batch = 1;  // samples per update as samples/s counts them
    int64_t first_step = 0;
    Clock::time_point run_start, window_start;
    int64_t window_steps = 0;
    double window_loss = 0.0, micro_loss = 0.0;
    int64_t micro_count = 0;
    // The updates after the first kTimingSkip are the loop's own speed, as the Python peer
    // (bench/vs_peer.sh) times it (warm-up: first-touch allocations, oneDNN kernel creation).
    static constexpr int64_t kTimingSkip = 2;
    std::optional<Clock::time_point> timed_start;
    // Seconds spent saving checkpoints and validating: left out of it/s, the ETA and the timing
    // line, which measure the updates (issue 38: a validation made updates look 15x slower).
    double window_paused_s = 0.0, timed_paused_s = 0.0, run_paused_s = 0.0;
    double lr_used = 0.0, grad_norm = 0.0;  // of the last update
    bool stopped = false;
    std::shared_ptr<torch::nn::Module> trainable;
    std::vector<torch::Tensor> params;
  };

  // Runs `work` (a checkpoint, a validation) as time left out of the loop's speed.
  template <typename F>
  void paused(Loop& l, F&& work) {
    const auto begin = Clock::now();
    work();
    const double s = seconds_since(begin);
    l.window_paused_s += s;
    l.run_paused_s += s;
    if (l.timed_start) l.timed_paused_s += s;
  }

  Loop start_loop();

  // One micro-batch's forward and backward, then the optimizer's step (a no-op inside an
  // accumulation window). True when it completed an update.
  bool micro_step(Loop& l, const data::Batch& batch, int64_t epoch);

  // After an update: the EMA, then one small all-reduce of the loss over every rank and of
  // whether any rank was asked to stop (the launcher signals every rank, but they must stop at
  // the same step).
  void after_update(Loop& l);

  // The trackers' scalars of the update, and the progress line every logging_steps.
  void log_update(Loop& l);

  // The checkpoint and validation of this update (the last step's come after the loop), and a
  // stop: at a signal the run saves and stops here. True when the loop ends (last step or stop).
  // `ended_epoch`: the epoch (0-based) this update ended, for the epoch cadences; a step that is
  // due by both cadences saves (and validates) once.
  bool checkpoint_and_validate(Loop& l, std::optional<int64_t> ended_epoch);

  // One pass over the loader (from where a resumed epoch stood).
  void run_epoch(Loop& l);

  // The loop's speed line, then the last checkpoint, the final validation and the export.
  TrainResult finish(Loop& l);

  TrainResult train();
};

}  // namespace difftrain::train
