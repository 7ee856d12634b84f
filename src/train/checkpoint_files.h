#pragma once
// The checkpoint-<step> folders of a run's output_dir: finding the newest complete one, removing
// unfinished ones, rotating old ones (checkpoints_total_limit); and the epoch saves beside them
// (epoch-<epoch:06d>/, --save_every_n_epochs), pruned by --save_last_n_epochs.
#include <cstdint>
#include <filesystem>
#include <functional>
#include <set>
#include <string>

namespace difftrain::train {

/// Keeps the newest `limit` checkpoint-<step> folders under `output_dir`, removing the rest.
/// The checkpoints an epoch save made (epoch_owned_checkpoints) are not counted: they go with
/// their epoch save (prune_epoch_saves).
void rotate_checkpoints(const std::string& output_dir, int64_t limit);

/// "epoch-000002": the folder of epoch 2's save (1-based, six digits, as kohya names its files).
std::string epoch_save_name(int64_t epoch);

/// Writes `<output_dir>/epoch-<epoch>/`: `write` fills `epoch-<epoch>.tmp/` (the task's export),
/// then epoch.json ({"epoch", "global_step", "checkpoint": "checkpoint-<step>",
/// "owns_checkpoint"}: whether the epoch cadence made that checkpoint) is written last and the
/// folder renamed into place, replacing an earlier one of the same epoch (a resumed run).
void write_epoch_save(const std::string& output_dir, int64_t epoch, int64_t global_step,
                      bool owns_checkpoint,
                      const std::function<void(const std::filesystem::path&)>& write);

/// --save_last_n_epochs `keep` after epoch `epoch`'s save with --save_every_n_epochs `every`:
/// removes every epoch-<k>/ with k <= epoch - every x keep (kohya's rule, applied to every older
/// save on disk, an earlier run's too) and the checkpoint each one made.
void prune_epoch_saves(const std::string& output_dir, int64_t epoch, int64_t every, int64_t keep);

/// The checkpoint-<step> names the epoch saves under `output_dir` made (their epoch.json).
std::set<std::string> epoch_owned_checkpoints(const std::string& output_dir);

}  // namespace difftrain::train
