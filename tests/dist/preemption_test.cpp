// Preemption (issue 38): SIGTERM / Ctrl-C to `difftrain launch` while a rank saves a checkpoint
// that takes longer than --term_timeout, while it validates, and while a save stalls; and a rank
// that waits for a slow save names what the slow rank was doing. Real ranks under the launcher.

#include "subprocess.h"
#include "train_util.h"

#include "difftrain/accel/checkpoint_manifest.h"
#include "difftrain/io/atomic_file.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <regex>
#include <thread>

namespace difftrain::testing {
namespace {

namespace fs = std::filesystem;

// A rank's log as far as it is written ("" before it exists).
std::string read_text(const std::string& path) {
  return fs::exists(path) ? io::read_file(path) : std::string();
}

// Waits (up to `seconds`) until rank 0's log (launch --log_dir) holds `text`.
bool wait_for_log(const std::string& logs, const std::string& text, double seconds) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < end) {
    if (read_text(logs + "/rank0.log").find(text) != std::string::npos) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return false;
}

std::vector<std::string> launch(const std::string& logs, std::vector<std::string> launcher_flags,
                                const std::vector<std::string>& cmd) {
  std::vector<std::string> argv = {kDifftrain, "launch", "--num_processes", "2", "--log_dir", logs};
  argv.insert(argv.end(), launcher_flags.begin(), launcher_flags.end());
  argv.push_back(kDifftrain);
  argv.insert(argv.end(), cmd.begin(), cmd.end());
  return argv;
}

// The tiny UNet on 2 ranks, a checkpoint every 2 updates, the launcher flag `flag` at 1 s.
std::vector<std::string> checkpointing_run(const std::string& dir, const std::string& flag,
                                           const std::string& steps) {
  return launch(dir + "/logs", {flag, "1"},
                train_cmd(dir, dir + "/out",
                          {"--max_train_steps", steps, "--checkpointing_steps", "2",
                           "--train_batch_size", "2"}));
}

std::vector<std::string> checkpoints(const std::string& out) {
  std::vector<std::string> names;
  if (!fs::exists(out)) return names;
  for (const auto& e : fs::directory_iterator(out)) {
    const auto name = e.path().filename().string();
    if (name.rfind("checkpoint-", 0) == 0) names.push_back(name);
  }
  std::sort(names.begin(), names.end());
  return names;
}

// A 57.5 M-parameter UNet (the issue's): its checkpoint (weights, EMA, two Adam moments, about
// 0.9 GB) takes seconds to write, far longer than --term_timeout 1. Before the fix the launcher
// killed both ranks 1 s after the signal and only checkpoint-N.tmp was left.
TEST(Preemption, SigtermDuringALongSaveOfALargeModelFinishesTheCheckpoint) {
  const auto dir = make_temp_dir("preempt_save");
  const std::string config = dir + "/unet.json";
  std::ofstream(config) << R"({"_class_name": "UNet2DModel", "sample_size": 16, "in_channels": 1,
    "out_channels": 1, "layers_per_block": 2, "block_out_channels": [128, 256, 512],
    "down_block_types": ["DownBlock2D", "DownBlock2D", "DownBlock2D"],
    "up_block_types": ["UpBlock2D", "UpBlock2D", "UpBlock2D"]})";
  const std::string out = dir + "/out", logs = dir + "/logs";
  Process p(launch(
      logs, {"--term_timeout", "1"},
      {"train", "--model_config_name_or_path", config, "--resolution", "16", "--max_train_samples",
       "64", "--train_batch_size", "2", "--max_train_steps", "1000", "--checkpointing_steps", "0",
       "--num_validation_images", "0", "--logging_steps", "1", "--output_dir", out}));
  ASSERT_TRUE(wait_for_log(logs, "step 1/1000", 240)) << read_text(logs + "/rank0.log");
  p.signal(SIGTERM);
  const auto r = p.wait(240);
  ASSERT_FALSE(r.timed_out) << r.log();
  EXPECT_EQ(r.exit_code, 128 + SIGTERM) << r.log();
  EXPECT_NE(r.err.find("parameters 57"), std::string::npos) << r.log();
  // Said at the first signal, since a second one ends the run before it can say more (issue 56).
  EXPECT_NE(r.err.find("with no checkpoint saved yet); continue with --resume_from_checkpoint "
                       "latest --output_dir " +
                       out),
            std::string::npos)
      << r.log();
  // The launcher waited for the ranks that made progress, and said so.
  EXPECT_NE(r.err.find("it may finish while it makes progress"), std::string::npos) << r.log();
  EXPECT_EQ(r.err.find("is killed while"), std::string::npos) << r.log();
  // The save took longer than the grace period the launcher used to give.
  const std::regex saved("saved checkpoint \\S+/checkpoint-(\\d+) \\(([0-9.]+) s\\)");
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.err, m, saved)) << r.log();
  EXPECT_GT(std::stod(m[2]), 1.0) << "the save was faster than --term_timeout: nothing tested";
  const std::string checkpoint = "checkpoint-" + m[1].str();
  EXPECT_EQ(checkpoints(out), std::vector<std::string>{checkpoint});
  EXPECT_TRUE(accel::verify_checkpoint(out + "/" + checkpoint));
  EXPECT_NE(r.err.find("training interrupted by a signal at step " + m[1].str()), std::string::npos)
      << r.log();
  fs::remove_all(dir);
}

// Ctrl-C during a long validation: the render is abandoned (no grid written), the checkpoint of
// that step is saved, and resuming from it continues at that step. The validation prints its
// progress while it runs (it must not look like a hang).
TEST(Preemption, SigintDuringValidationAbandonsItAndSavesTheCheckpoint) {
  const auto dir = make_temp_dir("preempt_validation");
  const std::string out = dir + "/out", logs = dir + "/logs";
  auto cmd =
      train_cmd(dir, out,
                {"--max_train_steps", "8", "--checkpointing_steps", "0", "--train_batch_size", "2",
                 "--validation_steps", "2", "--validation_inference_steps", "1000"});
  // train_cmd has --num_validation_images 0: this test renders 512 (256 per rank).
  const auto images = std::find(cmd.begin(), cmd.end(), "--num_validation_images");
  ASSERT_NE(images, cmd.end());
  *(images + 1) = "512";
  Process p(launch(logs, {}, cmd));
  ASSERT_TRUE(wait_for_log(logs, "validation: sampling step", 240))
      << read_text(logs + "/rank0.log");
  p.signal(SIGINT);
  const auto r = p.wait(120);
  ASSERT_FALSE(r.timed_out) << r.log();
  EXPECT_EQ(r.exit_code, 128 + SIGINT) << r.log();
  EXPECT_NE(r.err.find("validation at step 2 abandoned after"), std::string::npos) << r.log();
  EXPECT_NE(r.err.find("(validation abandoned); checkpoint saved in " + out + "/checkpoint-2"),
            std::string::npos)
      << r.log();
  EXPECT_FALSE(fs::exists(out + "/samples/step-000002.png"));
  EXPECT_EQ(checkpoints(out), std::vector<std::string>{"checkpoint-2"});
  EXPECT_TRUE(accel::verify_checkpoint(out + "/checkpoint-2"));
  auto resume =
      train_cmd(dir, out,
                {"--max_train_steps", "3", "--checkpointing_steps", "0", "--train_batch_size", "2",
                 "--validation_steps", "2", "--validation_inference_steps", "1000",
                 "--resume_from_checkpoint", "latest"});
  const auto again = train(resume, 2, 120);
  EXPECT_EQ(again.exit_code, 0) << again.log();
  EXPECT_NE(again.err.find("at step 2"), std::string::npos) << again.log();
  EXPECT_NE(again.err.find("done: 3 updates"), std::string::npos) << again.log();
  fs::remove_all(dir);
}

// A save that stops making progress (a stalled disk: the injected fault sleeps inside it) is
// killed --term_timeout after the signal and reported as an unfinished checkpoint.
TEST(Preemption, ASaveThatStopsProgressingIsKilledAndReportedUnfinished) {
  const auto dir = make_temp_dir("preempt_stall");
  const std::string out = dir + "/out", logs = dir + "/logs";
  Process p(checkpointing_run(dir, "--term_timeout", "100"),
            {{"DIFFTRAIN_FAULT_SLEEP_IN_SAVE", "2:600"}});
  ASSERT_TRUE(wait_for_log(logs, "step 2/100", 120)) << read_text(logs + "/rank0.log");
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  p.signal(SIGTERM);
  const auto r = p.wait(60);
  ASSERT_FALSE(r.timed_out) << r.log();
  EXPECT_EQ(r.exit_code, 128 + SIGTERM) << r.log();
  EXPECT_NE(r.err.find("rank 0 is killed while saving checkpoint-2 (1 s of --term_timeout without "
                       "progress): that checkpoint is not finished"),
            std::string::npos)
      << r.log();
  EXPECT_NE(r.err.find("KillWait"), std::string::npos) << r.log();
  EXPECT_TRUE(checkpoints(out) == std::vector<std::string>{"checkpoint-2.tmp"}) << r.log();
  fs::remove_all(dir);
}

// Rank 0 is slow in a save (a 3 s stall) and the collective timeout is 1 s: rank 1 gives up and
// says what rank 0 was doing and which setting to raise; rank 0 then fails too and says rank 1
// gave up on it, instead of "every rank still answers the store".
TEST(Preemption, ARankThatGivesUpOnASlowSaveNamesItAndTheSaverAgrees) {
  const auto dir = make_temp_dir("slow_save");
  const std::string out = dir + "/out", logs = dir + "/logs";
  const auto r = run(checkpointing_run(dir, "--collective_timeout", "4"),
                     {{"DIFFTRAIN_FAULT_SLEEP_IN_SAVE", "2:3"}}, 120);
  ASSERT_FALSE(r.timed_out) << r.log();
  EXPECT_NE(r.exit_code, 0) << r.log();
  const std::string rank1 = read_text(logs + "/rank1.log");
  const std::string rank0 = read_text(logs + "/rank0.log");
  EXPECT_NE(rank1.find("timed out after"), std::string::npos) << r.log();
  EXPECT_NE(rank1.find("rank 0 is saving checkpoint-2 (for "), std::string::npos) << r.log();
  EXPECT_NE(rank1.find("raise the collective timeout (1 s now: difftrain launch "
                       "--collective_timeout S, or DIFFTRAIN_COLLECTIVE_TIMEOUT)"),
            std::string::npos)
      << r.log();
  EXPECT_NE(rank0.find("rank 1 stopped waiting for this rank (after "), std::string::npos)
      << r.log();
  EXPECT_NE(rank0.find("while this rank was saving checkpoint-2"), std::string::npos) << r.log();
  EXPECT_EQ(rank0.find("every rank still answers"), std::string::npos) << r.log();
  fs::remove_all(dir);
}

}  // namespace
}  // namespace difftrain::testing
