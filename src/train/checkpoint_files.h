#pragma once
// The checkpoint-<step> folders of a run's output_dir: finding the newest complete one, removing
// unfinished ones, rotating old ones (checkpoints_total_limit).
#include <cstdint>
#include <string>

namespace difftrain::train {

/// Keeps the newest `limit` checkpoint-<step> folders under `output_dir`, removing the rest.
void rotate_checkpoints(const std::string& output_dir, int64_t limit);

}  // namespace difftrain::train
