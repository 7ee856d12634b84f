#pragma once
// Experiment trackers (Accelerate's `Accelerator(log_with="tensorboard" | "all")` +
// `accelerator.log(values, step)`): TensorBoard event files written by hand (TFRecord framing,
// CRC-32C, protobuf wire format; no protobuf or TensorFlow dependency), a JSON-lines log that
// survives a resume, and a multiplexer over several of them.
//
// Only the main rank should create trackers: the caller decides (e.g.
// `if (acc.is_main_process()) trackers = make_trackers(...)`); nothing here talks to other ranks.
// Every tracker serialises its own calls with a mutex, so one may be shared between threads.

#include <torch/types.h>

#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace difftrain::accel {

/// One experiment tracker. Accelerate: `accelerate.tracking.GeneralTracker`.
class Tracker {
 public:
  /// Concrete trackers flush and close their files in their own destructors (errors there are
  /// logged, never thrown).
  virtual ~Tracker() = default;

  /// Records scalars (loss, lr, ...) under their names at training step `step`. Accelerate:
  /// `tracker.log(values, step)`. An empty map records nothing; an empty name is an error.
  virtual void log_scalars(const std::map<std::string, double>& values, int64_t step) = 0;

  /// Records one image under `tag` at `step`. `image` is uint8 [H, W, C] or floating point
  /// [H, W, C] in [0, 1] (converted as Diffusers does, see to_tracker_image()), C = 1 (grey),
  /// 2 (grey + alpha), 3 (RGB) or 4 (RGBA), any device. Trackers that cannot show images
  /// validate it and record nothing.
  virtual void log_image(const std::string& tag, const torch::Tensor& image, int64_t step) = 0;

  /// Pushes buffered records to the operating system (the trackers here already do so after every
  /// log call, so this is cheap).
  virtual void flush() = 0;

  /// Short name: "tensorboard", "jsonl", or for Trackers the names of its trackers joined by ','
  /// ("none" when it holds none). Accelerate: `GeneralTracker.name`.
  virtual std::string name() const = 0;
};

/// The uint8 [H, W, C] CPU contiguous image a tracker stores for `image`: uint8 input as is;
/// floating input [H, W, C] in [0, 1] clamped and mapped with (x * 255).round() (NaN → 0), as
/// io::to_uint8_images. Throws difftrain::Error naming `tag` for another dtype, rank, an empty
/// image or C outside 1..4.
torch::Tensor to_tracker_image(const std::string& tag, const torch::Tensor& image);

/// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78, init and final xor 0xFFFFFFFF) of
/// `bytes`; crc32c("123456789") == 0xE3069283. Table-driven.
uint32_t crc32c(std::string_view bytes);

/// TFRecord's masked CRC: ((c >> 15) | (c << 17)) + 0xa282ead8 with c = crc32c(bytes).
uint32_t masked_crc32c(std::string_view bytes);

/// Writes TensorBoard event files, readable by `tensorboard --logdir <logdir>`. Accelerate:
/// `TensorBoardTracker(run_name, logging_dir)`; torch: `SummaryWriter`.
///
/// The file is `<logdir>[/<run_name>]/events.out.tfevents.<unix seconds>.<hostname>.<pid>.
/// <counter><filename_suffix>` (counter: 0, 1, ... per process); folders are created. It is a
/// sequence of TFRecords (uint64 LE length, uint32 LE masked CRC-32C of those 8 bytes, the data,
/// uint32 LE masked CRC-32C of the data), each holding one tensorflow.Event: the first with
/// file_version "brain.Event:2", then one Event per log call (wall_time, step, and a Summary
/// with one Value per scalar as `simple_value` (float32), or one Value with an `image`: PNG,
/// height, width, colorspace = C). Every log call is flushed to the operating system, so a killed
/// run keeps its events. A failed write throws difftrain::Error naming the file.
class TensorBoardTracker : public Tracker {
 public:
  /// Opens a new event file in `logdir` (or `logdir/run_name` when run_name is not empty) and
  /// writes the file_version record. With `purge_step` S (e.g. resume step + 1), a
  /// SessionLog START event at step S follows it, asking TensorBoard to drop the events of
  /// earlier files of this folder at steps >= S (torch's `SummaryWriter(purge_step=S)`).
  explicit TensorBoardTracker(const std::string& logdir, const std::string& run_name = "",
                              const std::string& filename_suffix = "",
                              std::optional<int64_t> purge_step = std::nullopt);
  /// Flushes and closes the file.
  ~TensorBoardTracker() override;
  TensorBoardTracker(const TensorBoardTracker&) = delete;
  TensorBoardTracker& operator=(const TensorBoardTracker&) = delete;

  /// One Event at `step` whose Summary has one simple_value per entry, in the map's order.
  void log_scalars(const std::map<std::string, double>& values, int64_t step) override;
  /// One Event at `step` with the PNG of `image` (see to_tracker_image()).
  void log_image(const std::string& tag, const torch::Tensor& image, int64_t step) override;
  /// fflush of the event file (every log call already does it).
  void flush() override;
  /// "tensorboard".
  std::string name() const override { return "tensorboard"; }

  /// Path of the event file being written.
  const std::string& path() const { return path_; }

 private:
  void write_event(const std::string& event);

  std::string path_;
  std::FILE* file_ = nullptr;
  std::mutex mutex_;
};

/// A JSON-lines log of scalars: one object `{"step": s, "<name>": value, ...}` per log_scalars
/// call, one line each, flushed per line. Non-finite values are written as null. Handy for
/// scripts and plots without TensorBoard. Images are not recorded (log_image validates the
/// image and writes nothing).
class JsonlTracker : public Tracker {
 public:
  /// Opens `path` (folders created). Without `resume_step` an existing file is replaced: this is
  /// a new run. With `resume_step` R an existing file keeps only its lines whose "step" is <= R
  /// (rewritten atomically with io::write_file_atomic before appending), so a run resumed from
  /// the checkpoint of step R after a crash does not log steps R+1... twice; lines that do not
  /// parse as a JSON object with an integer "step" (such as a half-written last line) are
  /// dropped.
  explicit JsonlTracker(const std::string& path, std::optional<int64_t> resume_step = std::nullopt);
  /// Flushes and closes the file.
  ~JsonlTracker() override;
  JsonlTracker(const JsonlTracker&) = delete;
  JsonlTracker& operator=(const JsonlTracker&) = delete;

  /// Appends `{"step": step, ...values}` (names in the map's order). The name "step" is reserved.
  void log_scalars(const std::map<std::string, double>& values, int64_t step) override;
  /// Validates `image` (to_tracker_image()) and writes nothing.
  void log_image(const std::string& tag, const torch::Tensor& image, int64_t step) override;
  /// fflush of the log (every log call already does it).
  void flush() override;
  /// "jsonl".
  std::string name() const override { return "jsonl"; }

  /// Path of the log.
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::FILE* file_ = nullptr;
  std::mutex mutex_;
};

/// Several trackers behind one: every call goes to each of them in the order they were added.
/// If one throws, the others are still called and the first error is rethrown after.
/// Accelerate: the list `accelerator.trackers` that `accelerator.log()` walks.
class Trackers : public Tracker {
 public:
  /// No trackers: every call does nothing until add().
  Trackers() = default;

  /// Adds a tracker (not null).
  void add(std::unique_ptr<Tracker> tracker);
  /// Number of trackers held.
  size_t size() const { return trackers_.size(); }
  /// True when no tracker is held (`report_to="none"`): the log calls then do nothing.
  bool empty() const { return trackers_.empty(); }
  /// The tracker called `name` ("tensorboard", "jsonl"), or nullptr. Accelerate:
  /// `accelerator.get_tracker(name)`.
  Tracker* get(const std::string& name) const;

  /// log_scalars() on every tracker. Accelerate: `accelerator.log(values, step=step)`.
  void log_scalars(const std::map<std::string, double>& values, int64_t step) override;
  /// log_image() on every tracker.
  void log_image(const std::string& tag, const torch::Tensor& image, int64_t step) override;
  /// flush() on every tracker.
  void flush() override;
  /// The names of the trackers joined by ',' ("tensorboard,jsonl"), or "none".
  std::string name() const override;

 private:
  std::vector<std::unique_ptr<Tracker>> trackers_;
};

/// Trackers for `report_to` (Accelerate's `log_with` / Diffusers' `--report_to`):
/// "tensorboard" → TensorBoardTracker(logging_dir, "", "", resume_step + 1 if given);
/// "jsonl" → JsonlTracker(jsonl_path, resume_step); "all" → both; "none" → no tracker.
/// A comma list such as "tensorboard,jsonl" is accepted (case-insensitive, spaces ignored,
/// repeats once). Anything else, or "none" in a list, throws difftrain::Error listing the valid
/// values. Call it on the main rank only.
std::unique_ptr<Trackers> make_trackers(const std::string& report_to,
                                        const std::string& logging_dir,
                                        const std::string& jsonl_path,
                                        std::optional<int64_t> resume_step = std::nullopt);

}  // namespace difftrain::accel
