#pragma once
// The run's output folder, guarded: never one of the run's inputs, never another run's folder
// unless resumed or --overwrite_output_dir, never two runs at once (docs/RELIABILITY.md).

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

namespace difftrain::train {

/// A path the run reads, by the option that named it ("pretrained_model_name_or_path").
struct RunInput {
  std::string option;
  std::string path;  ///< "" = not given (skipped)
};

/// Throws a difftrain::Error when `output_dir` is, contains, or lies inside one of `inputs`
/// (compared after resolving symlinks and `..`): the export would overwrite or delete the input,
/// or the run's own files would become its input. Inputs that do not exist are skipped (their
/// own checks name them).
void check_output_dir_against_inputs(const std::string& output_dir,
                                     const std::vector<RunInput>& inputs);

/// The name of the lock file a run holds in its output folder.
inline constexpr const char* kOutputLockName = ".difftrain.lock";

/// What `output_dir` already holds, sorted (its lock file aside); empty when it is missing or
/// empty. Transformers' training scripts refuse such a folder without --overwrite_output_dir.
std::vector<std::string> output_dir_entries(const std::string& output_dir);

/// Removes everything in `output_dir` but its lock file and the entries named in `keep`
/// (--overwrite_output_dir). Returns how many entries it removed.
size_t clear_output_dir(const std::string& output_dir, const std::vector<std::string>& keep = {});

/// An exclusive kernel lock (flock) on `<output_dir>/.difftrain.lock` for the life of the object:
/// released on any exit of the process, SIGKILL included. The file records the holder's pid, host
/// and start time, which a second run's error names.
class OutputDirLock {
 public:
  /// Creates `output_dir` if needed and takes the lock, or throws a difftrain::Error naming the
  /// run that holds it.
  static std::unique_ptr<OutputDirLock> acquire(const std::string& output_dir);
  ~OutputDirLock();
  OutputDirLock(const OutputDirLock&) = delete;
  OutputDirLock& operator=(const OutputDirLock&) = delete;

 private:
  explicit OutputDirLock(int fd) : fd_(fd) {}
  int fd_;
};

}  // namespace difftrain::train
