// The output folder's guards (issue 38): never an input, never another run's folder, one run at a
// time (a kernel lock, tested with real processes).
#include "difftrain/train/output_folder.h"
#include "difftrain/core/env.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <string>

namespace difftrain::train {
namespace {

namespace fs = std::filesystem;

// The relation check_output_dir_against_inputs reports for `out` against the input folder `in`
// ("" when it accepts the pair).
std::string relation(const std::string& out, const std::string& in) {
  try {
    check_output_dir_against_inputs(out, {{"pretrained_model_name_or_path", in}});
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(OutputFolder, AnInputFolderItsParentAndItsInsideAreRefused) {
  const std::string root = test::temp_dir("outdir_inputs");
  const std::string model = root + "/model";
  fs::create_directories(model + "/unet");
  fs::create_directories(root + "/other");
  fs::create_symlink(model, root + "/link");

  for (const std::string& same : {model, model + "/", model + "/../model", root + "/link"}) {
    const auto e = relation(same, model);
    EXPECT_NE(e.find("is the same folder as --pretrained_model_name_or_path"), std::string::npos)
        << same << ": " << e;
    EXPECT_NE(e.find("pass an --output_dir outside every input folder"), std::string::npos) << e;
  }
  EXPECT_NE(relation(root, model).find("contains --pretrained"), std::string::npos);
  EXPECT_NE(relation(model + "/unet", model).find("lies inside --pretrained"), std::string::npos);
  EXPECT_NE(relation(model + "/run/new", model).find("lies inside"), std::string::npos);
  // Not related: a sibling, a folder whose name only starts like the input's, a missing input.
  EXPECT_EQ(relation(root + "/other", model), "");
  EXPECT_EQ(relation(root + "/model2", model), "");
  EXPECT_EQ(relation(root + "/other", root + "/missing"), "");
  // Every input is checked, by its own option name; empty ones are skipped.
  EXPECT_EQ(relation(root + "/data/run", root + "/data"), "");  // not there yet: skipped
  fs::create_directories(root + "/data");
  const auto e = test::error_of([&] {
    check_output_dir_against_inputs(root + "/data/run", {{"pretrained_model_name_or_path", ""},
                                                         {"train_data_dir", root + "/data"}});
  });
  EXPECT_NE(e.find("--output_dir '" + root + "/data/run' lies inside --train_data_dir '" + root +
                   "/data'"),
            std::string::npos)
      << e;
  fs::remove_all(root);
}

TEST(OutputFolder, EntriesLeaveOutTheLockAndClearingKeepsIt) {
  const std::string dir = test::temp_dir("outdir_entries");
  EXPECT_TRUE(output_dir_entries(dir + "/missing").empty());
  auto lock = OutputDirLock::acquire(dir);
  EXPECT_TRUE(output_dir_entries(dir).empty());
  fs::create_directories(dir + "/checkpoint-4/model");
  test::write_text(dir + "/metrics.jsonl", "{}\n");
  EXPECT_EQ(output_dir_entries(dir), (std::vector<std::string>{"checkpoint-4", "metrics.jsonl"}));
  clear_output_dir(dir);
  EXPECT_TRUE(output_dir_entries(dir).empty());
  EXPECT_TRUE(fs::exists(fs::path(dir) / kOutputLockName));
  lock.reset();
  fs::remove_all(dir);
}

// A second process cannot take the lock while the first holds it, is told who holds it, and gets
// it once the holder is killed with SIGKILL (the kernel releases a flock with the process).
TEST(OutputFolder, TheLockExcludesAnotherProcessUntilTheHolderDies) {
  const std::string dir = test::temp_dir("outdir_lock");
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t holder = ::fork();
  ASSERT_GE(holder, 0);
  if (holder == 0) {
    ::close(ready[0]);
    int status = 0;
    try {
      auto lock = OutputDirLock::acquire(dir);
      (void)!::write(ready[1], "1", 1);
      ::pause();  // until SIGKILL
    } catch (...) {
      status = 3;
    }
    ::_exit(status);
  }
  ::close(ready[1]);
  char c = 0;
  ASSERT_EQ(::read(ready[0], &c, 1), 1) << "the holder did not take the lock";
  ::close(ready[0]);

  const auto e = test::error_of([&] { OutputDirLock::acquire(dir); });
  EXPECT_NE(
      e.find("is in use by another difftrain run (pid " + std::to_string(holder) + " on host"),
      std::string::npos)
      << e;
  EXPECT_NE(e.find("wait for it to end, or pass another --output_dir"), std::string::npos) << e;

  ::kill(holder, SIGKILL);
  int status = 0;
  ::waitpid(holder, &status, 0);
  auto lock = OutputDirLock::acquire(dir);
  EXPECT_NE(lock, nullptr);
  lock.reset();
  fs::remove_all(dir);
}

TEST(OutputFolder, ShellCommandQuotesWhatTheShellWouldSplit) {
  EXPECT_EQ(shell_command({"difftrain", "train", "--output_dir", "runs/a-1"}),
            "difftrain train --output_dir runs/a-1");
  EXPECT_EQ(shell_command({"--validation_prompt", "a cat's hat", ""}),
            "--validation_prompt 'a cat'\\''s hat' ''");
}

}  // namespace
}  // namespace difftrain::train
