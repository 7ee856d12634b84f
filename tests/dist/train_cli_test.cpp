// `difftrain train` end to end, in real processes (under `difftrain launch` for several ranks):
// world-size and accumulation equivalence, bit-exact resume, atomic checkpoints under kill -9,
// checkpoint rotation, SIGTERM, LoRA fine-tuning and export, logs, and bad-input errors.
// A tiny UNet on 64 Fashion-MNIST images at 8x8 keeps each run to a few seconds.

#include "subprocess.h"
#include "train_util.h"

#include "difftrain/io/lora_format.h"
#include "difftrain/io/safetensors.h"
#include "difftrain/models/lora/lora.h"
#include "source_dir.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <thread>

namespace difftrain::testing {
namespace {

namespace fs = std::filesystem;
// Tolerance 1e-4 for world-size and accumulation equivalence: the same samples, noise and
// timesteps enter both runs; only the order of float sums differs (per-rank means averaged vs one
// mean). Adam divides each gradient by its own running RMS, so a coordinate whose gradient is
// near zero turns that 1e-7 rounding into up to ~1e-5 of weight after 6 steps. A run that differs
// in its data, noise or loss scaling moves weights by more than 1e-3: the control run with
// another seed checks that the comparison can fail.
TEST(TrainCommand, TwoRanksEqualOneRankWithTheGlobalBatch) {
  const auto dir = make_temp_dir("train_ws");
  const std::vector<std::string> common = {"--max_train_steps",     "6", "--use_ema", "false",
                                           "--checkpointing_steps", "0"};
  auto one = train_cmd(dir, dir + "/one", common);
  one.insert(one.end(), {"--train_batch_size", "8"});
  auto two = train_cmd(dir, dir + "/two", common);
  two.insert(two.end(), {"--train_batch_size", "4"});
  auto acc = train_cmd(dir, dir + "/acc", common);
  acc.insert(acc.end(), {"--train_batch_size", "4", "--gradient_accumulation_steps", "2"});
  auto control = train_cmd(dir, dir + "/control", common);
  control.insert(control.end(), {"--train_batch_size", "8", "--seed", "1"});
  const auto r1 = train(one);
  ASSERT_EQ(r1.exit_code, 0) << r1.log();
  const auto r2 = train(two, 2);
  ASSERT_EQ(r2.exit_code, 0) << r2.log();
  const auto r3 = train(acc);
  ASSERT_EQ(r3.exit_code, 0) << r3.log();
  const auto r4 = train(control);
  ASSERT_EQ(r4.exit_code, 0) << r4.log();
  const double ws = max_abs_diff(unet_weights(dir + "/one"), unet_weights(dir + "/two"));
  const double ga = max_abs_diff(unet_weights(dir + "/one"), unet_weights(dir + "/acc"));
  const double other = max_abs_diff(unet_weights(dir + "/one"), unet_weights(dir + "/control"));
  std::printf(
      "2 ranks x 4 vs 1 rank x 8: max abs diff %.3g; accumulation 2 x 4 vs 8: %.3g "
      "(tol 1e-4); another seed: %.3g (must exceed 1e-3)\n",
      ws, ga, other);
  EXPECT_LT(ws, 1e-4);
  EXPECT_LT(ga, 1e-4);
  EXPECT_GT(other, 1e-3);
}

// Gradient checkpointing under DDP recomputes each block in backward; the gradients, and so the
// weights, must be those of the plain run (same tolerance and reason as above). 8-bit AdamW runs
// through the same trainer and checkpoints its quantised state.
TEST(TrainCommand, GradientCheckpointingUnderDdpAndEightBitAdam) {
  const auto dir = make_temp_dir("train_gc");
  const std::vector<std::string> common = {"--max_train_steps",     "4", "--use_ema", "false",
                                           "--checkpointing_steps", "0"};
  auto plain = train_cmd(dir, dir + "/plain", common);
  plain.insert(plain.end(), {"--train_batch_size", "8"});
  auto gc = train_cmd(dir, dir + "/gc", common);
  gc.insert(gc.end(), {"--train_batch_size", "4", "--gradient_checkpointing"});
  const auto r1 = train(plain);
  ASSERT_EQ(r1.exit_code, 0) << r1.log();
  const auto r2 = train(gc, 2);
  ASSERT_EQ(r2.exit_code, 0) << r2.log();
  const double diff = max_abs_diff(unet_weights(dir + "/plain"), unet_weights(dir + "/gc"));
  std::printf("2 ranks x 4 with gradient checkpointing vs 1 rank x 8 plain: %.3g (tol 1e-4)\n",
              diff);
  EXPECT_LT(diff, 1e-4);

  auto eight = train_cmd(dir, dir + "/adam8",
                         {"--max_train_steps", "4", "--use_8bit_adam", "--checkpointing_steps", "2",
                          "--train_batch_size", "4"});
  const auto r3 = train(eight, 2);
  ASSERT_EQ(r3.exit_code, 0) << r3.log();
  const auto info = nlohmann::json::parse(std::ifstream(dir + "/adam8/logs/run_info.rank0.json"));
  // This tiny UNet's tensors are all below AdamW8bit's min_8bit_size (4096), so they keep fp32
  // moments: at most AdamW's 8 bytes per parameter.
  EXPECT_LE(info.at("state_bytes").at("optimizer_bytes").get<int64_t>(),
            2 * info.at("state_bytes").at("param_bytes").get<int64_t>());
  EXPECT_TRUE(fs::exists(dir + "/adam8/checkpoint-2/trainer_state.json"));
}

TEST(TrainCommand, ResumeIsBitIdentical) {
  const auto dir = make_temp_dir("train_resume");
  const std::vector<std::string> common = {
      "--max_train_steps",  "6", "--use_ema",     "--checkpointing_steps", "3",
      "--train_batch_size", "8", "--random_flip", "--snr_gamma",           "5"};
  const auto straight = train(train_cmd(dir, dir + "/straight", common));
  ASSERT_EQ(straight.exit_code, 0) << straight.log();
  ASSERT_TRUE(fs::exists(dir + "/straight/checkpoint-3/trainer_state.json"));
  // Continue from the straight run's step-3 checkpoint in another folder.
  fs::create_directories(dir + "/resumed");
  fs::copy(dir + "/straight/checkpoint-3", dir + "/resumed/checkpoint-3",
           fs::copy_options::recursive);
  auto cmd = train_cmd(dir, dir + "/resumed", common);
  cmd.insert(cmd.end(), {"--resume_from_checkpoint", "latest"});
  const auto resumed = train(cmd);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.log();
  EXPECT_NE(resumed.err.find("resumed from"), std::string::npos) << resumed.log();
  const double diff = max_abs_diff(unet_weights(dir + "/straight"), unet_weights(dir + "/resumed"));
  std::printf("6 straight vs 3 + resume + 3 (EMA export): max abs diff %.3g (must be 0)\n", diff);
  EXPECT_EQ(diff, 0.0);
  // The metrics of the resumed run continue at step 4.
  std::ifstream metrics(dir + "/resumed/metrics.jsonl");
  std::string line;
  std::vector<int64_t> steps;
  while (std::getline(metrics, line)) steps.push_back(nlohmann::json::parse(line).at("step"));
  EXPECT_EQ(steps, (std::vector<int64_t>{4, 5, 6}));
}

// The loader's position is kept in samples of the global order (issue 38): a checkpoint of 2 ranks
// x 4 resumed on 1 rank x 8, or on 1 rank x 4 with accumulation 2 (the same global batch),
// continues as the straight run, without a warning; another global batch warns.
TEST(TrainCommand, ResumeOnAnotherWorldSizeWithTheSameGlobalBatchContinuesExactly) {
  const auto dir = make_temp_dir("train_resume_world");
  const std::vector<std::string> common = {"--max_train_steps", "8", "--checkpointing_steps", "4"};
  auto with = [&](std::vector<std::string> extra) {
    extra.insert(extra.begin(), common.begin(), common.end());
    return extra;
  };
  const auto straight =
      train(train_cmd(dir, dir + "/straight", with({"--train_batch_size", "4"})), 2);
  ASSERT_EQ(straight.exit_code, 0) << straight.log();
  ASSERT_TRUE(fs::exists(dir + "/straight/checkpoint-4/trainer_state.json"));
  struct Variant {
    std::string name;
    int ranks;
    std::vector<std::string> extra;
    bool same_global_batch;
  };
  const std::vector<Variant> variants = {
      {"one_by_eight", 1, {"--train_batch_size", "8"}, true},
      {"accumulated", 1, {"--train_batch_size", "4", "--gradient_accumulation_steps", "2"}, true},
      {"smaller", 1, {"--train_batch_size", "4"}, false}};
  for (const auto& v : variants) {
    fs::create_directories(dir + "/" + v.name);
    fs::copy(dir + "/straight/checkpoint-4", dir + "/" + v.name + "/checkpoint-4",
             fs::copy_options::recursive);
    auto extra = v.extra;
    extra.insert(extra.end(), {"--resume_from_checkpoint", "latest"});
    const auto r = train(train_cmd(dir, dir + "/" + v.name, with(extra)), v.ranks);
    ASSERT_EQ(r.exit_code, 0) << r.log();
    EXPECT_NE(r.err.find("resumed from"), std::string::npos) << r.log();
    if (!v.same_global_batch) {
      EXPECT_NE(r.err.find("warning: resuming with a global batch of 4 (--train_batch_size 4 x 1 "
                           "process(es) x --gradient_accumulation_steps 1; checkpoint: 8)"),
                std::string::npos)
          << r.log();
      continue;
    }
    EXPECT_EQ(r.err.find("will not match"), std::string::npos) << v.name << "\n" << r.log();
    const double diff =
        max_abs_diff(unet_weights(dir + "/straight"), unet_weights(dir + "/" + v.name));
    std::printf("8 updates on 2 x 4 vs 4 + resume on %s + 4: max abs diff %.3g (tolerance 1e-4)\n",
                v.name.c_str(), diff);
    EXPECT_LE(diff, 1e-4) << v.name;
  }
}

TEST(TrainCommand, MetricsRunInfoEventsAndRotation) {
  const auto dir = make_temp_dir("train_logs");
  const auto r = train(train_cmd(dir, dir + "/out",
                                 {"--max_train_steps", "6", "--checkpointing_steps", "2",
                                  "--checkpoints_total_limit", "2", "--train_batch_size", "4",
                                  "--num_validation_images", "4", "--validation_steps", "3",
                                  "--validation_inference_steps", "2"}),
                       2);
  ASSERT_EQ(r.exit_code, 0) << r.log();
  const std::string out = dir + "/out";
  // Rotation keeps the newest two.
  EXPECT_FALSE(fs::exists(out + "/checkpoint-2"));
  EXPECT_TRUE(fs::exists(out + "/checkpoint-4"));
  EXPECT_TRUE(fs::exists(out + "/checkpoint-6"));
  // metrics.jsonl: one line per update with step, loss, lr (warmup: step 1 used lr 0), grad_norm.
  std::ifstream metrics(out + "/metrics.jsonl");
  std::string line;
  int64_t expected = 1;
  while (std::getline(metrics, line)) {
    const auto j = nlohmann::json::parse(line);
    EXPECT_EQ(j.at("step").get<int64_t>(), expected);
    EXPECT_TRUE(j.at("loss").is_number());
    EXPECT_TRUE(j.at("grad_norm").is_number());
    if (expected == 1) {
      EXPECT_EQ(j.at("lr").get<double>(), 0.0);
    }
    if (expected == 2) {
      EXPECT_NEAR(j.at("lr").get<double>(), 5e-4, 1e-12);
    }
    ++expected;
  }
  EXPECT_EQ(expected, 7);
  for (int rank : {0, 1}) {
    const auto info = nlohmann::json::parse(
        std::ifstream(out + "/logs/run_info.rank" + std::to_string(rank) + ".json"));
    EXPECT_EQ(info.at("world_size"), 2);
    EXPECT_GT(info.at("state_bytes").at("param_bytes").get<int64_t>(), 0);
    EXPECT_EQ(info.at("state_bytes").at("grad_bytes"), info.at("state_bytes").at("param_bytes"));
    // AdamW: two fp32 moments per parameter.
    EXPECT_EQ(info.at("state_bytes").at("optimizer_bytes").get<int64_t>(),
              2 * info.at("state_bytes").at("param_bytes").get<int64_t>());
  }
  bool events = false;
  for (const auto& e : fs::directory_iterator(out + "/logs")) {
    events = events || e.path().filename().string().rfind("events.out.tfevents.", 0) == 0;
  }
  EXPECT_TRUE(events);
  EXPECT_TRUE(fs::exists(out + "/samples/step-000003.png"));
  EXPECT_TRUE(fs::exists(out + "/samples/step-000006.png"));
  // The final folder is a DDPMPipeline that `difftrain sample` loads.
  const auto s = run({kDifftrain, "sample", "--model", out, "--num_inference_steps", "2",
                      "--num_images", "2", "--class_labels", "0,1", "--output", dir + "/s.png"});
  EXPECT_EQ(s.exit_code, 0) << s.log();
}

// --final_validation: a run shorter than one validation period skips the images after its last
// update under the default `auto` (and says so), renders them with `always`, and a run of at
// least validation_steps updates renders them under `auto`.
TEST(TrainCommand, FinalValidationFollowsTheRunLength) {
  const auto dir = make_temp_dir("train_final_validation");
  const std::vector<std::string> common = {"--max_train_steps",
                                           "2",
                                           "--use_ema",
                                           "false",
                                           "--checkpointing_steps",
                                           "0",
                                           "--num_validation_images",
                                           "2",
                                           "--validation_inference_steps",
                                           "2",
                                           "--validation_steps",
                                           "5"};
  const auto short_run = train(train_cmd(dir, dir + "/auto", common));
  ASSERT_EQ(short_run.exit_code, 0) << short_run.log();
  EXPECT_FALSE(fs::exists(dir + "/auto/samples/step-000002.png")) << short_run.log();
  // The model card of a UNet built here: no base model, licence mit, no widget without a render.
  const ExpectedCard scratch = {"", "mit", {"unconditional-image-generation", "ddpm"}, false, "",
                                0,  ""};
  expect_model_card(dir + "/auto", scratch);
  EXPECT_NE(short_run.log().find("final validation skipped: the run has 2 updates, fewer than "
                                 "--validation_steps 5"),
            std::string::npos)
      << short_run.log();
  auto forced_cmd = train_cmd(dir, dir + "/always", common);
  forced_cmd.insert(forced_cmd.end(), {"--final_validation", "always"});
  const auto forced = train(forced_cmd);
  ASSERT_EQ(forced.exit_code, 0) << forced.log();
  EXPECT_TRUE(fs::exists(dir + "/always/samples/step-000002.png")) << forced.log();
  // ... and with the final render: its 2 images beside the card, named by their class.
  auto rendered = scratch;
  rendered.widgets = 2;
  const auto card = expect_model_card(dir + "/always", rendered);
  EXPECT_NE(card.find("text: \"T-shirt/top\""), std::string::npos) << card;
  EXPECT_NE(card.find("Trained from scratch: there is no base model."), std::string::npos);
  EXPECT_NE(card.find("DDPMPipeline.from_pretrained("), std::string::npos);
  // The snippet and the command draw as the validation render did: its sampler (DDIM, the
  // default for a configured UNet) and step count.
  EXPECT_NE(card.find("scheduler = DDIMScheduler.from_config(scheduler.config)"), std::string::npos)
      << card;
  EXPECT_NE(card.find("scheduler.set_timesteps(2)"), std::string::npos) << card;
  EXPECT_NE(card.find("--num_inference_steps 2 --scheduler DDIMScheduler"), std::string::npos)
      << card;
  EXPECT_EQ(card.find("(cond - uncond)"), std::string::npos) << card;
  auto long_cmd = train_cmd(dir, dir + "/long", common);
  long_cmd.insert(long_cmd.end(), {"--validation_steps", "2", "--class_dropout_prob", "0.1",
                                   "--guidance_scale", "2", "--validation_scheduler", "ddpm"});
  const auto long_run = train(long_cmd);
  ASSERT_EQ(long_run.exit_code, 0) << long_run.log();
  EXPECT_TRUE(fs::exists(dir + "/long/samples/step-000002.png")) << long_run.log();
  EXPECT_EQ(long_run.log().find("final validation skipped"), std::string::npos);
  // A guided render: the card guides against the null class (index 10, after the 10 garments)
  // with the run's scale, on the folder's own DDPM scheduler.
  const auto guided = expect_model_card(dir + "/long", rendered);
  EXPECT_NE(guided.find("null = torch.full_like(labels, 10)"), std::string::npos) << guided;
  EXPECT_NE(guided.find("out = uncond + 2 * (cond - uncond)"), std::string::npos) << guided;
  EXPECT_EQ(guided.find("from_config"), std::string::npos) << guided;
  EXPECT_NE(guided.find("--num_inference_steps 2 --guidance_scale 2"), std::string::npos) << guided;
}

TEST(TrainCommand, KillDuringSaveKeepsThePreviousCheckpoint) {
  const auto dir = make_temp_dir("train_kill");
  const std::string out = dir + "/out";
  const std::vector<std::string> args = {"--max_train_steps",  "4", "--checkpointing_steps", "2",
                                         "--train_batch_size", "4"};
  // The fault hook SIGKILLs the process inside the second save, after some files are written.
  const auto killed = run(
      [&] {
        std::vector<std::string> argv = {kDifftrain};
        auto cmd = train_cmd(dir, out, args);
        argv.insert(argv.end(), cmd.begin(), cmd.end());
        return argv;
      }(),
      {{"DIFFTRAIN_FAULT_KILL_IN_SAVE", "4"}}, 300);
  ASSERT_EQ(killed.term_signal, SIGKILL) << killed.log();
  EXPECT_TRUE(fs::exists(out + "/checkpoint-2/trainer_state.json"));
  EXPECT_FALSE(fs::exists(out + "/checkpoint-4"));
  auto cmd = train_cmd(dir, out, args);
  cmd.insert(cmd.end(), {"--resume_from_checkpoint", "latest"});
  const auto resumed = train(cmd);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.log();
  EXPECT_NE(resumed.err.find("checkpoint-2"), std::string::npos) << resumed.log();
  EXPECT_TRUE(fs::exists(out + "/checkpoint-4/trainer_state.json"));
  EXPECT_FALSE(fs::exists(out + "/checkpoint-4.tmp"));
}

TEST(TrainCommand, SigtermWritesACheckpointAndExitsNonZero) {
  const auto dir = make_temp_dir("train_term");
  const std::string out = dir + "/out";
  std::vector<std::string> argv = {kDifftrain};
  auto cmd = train_cmd(
      dir, out,
      {"--max_train_steps", "100000", "--checkpointing_steps", "0", "--train_batch_size", "4"});
  argv.insert(argv.end(), cmd.begin(), cmd.end());
  Process p(argv);
  // Wait for the first update (metrics.jsonl appears), then ask it to stop.
  for (int i = 0; i < 600 && !fs::exists(out + "/metrics.jsonl"); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  // A second run in the same folder (even one resuming it) is refused while the first holds the
  // folder's lock, naming the holder, and leaves the first run's files alone (issue 38).
  auto second = cmd;
  second.insert(second.end(), {"--resume_from_checkpoint", "latest"});
  second.insert(second.begin(), kDifftrain);
  const auto refused = run(second, {}, 120);
  EXPECT_NE(refused.exit_code, 0) << refused.log();
  EXPECT_NE(refused.err.find("is in use by another difftrain run (pid " + std::to_string(p.pid()) +
                             " on host"),
            std::string::npos)
      << refused.log();
  p.signal(SIGTERM);
  const auto r = p.wait(120);
  EXPECT_NE(r.exit_code, 0) << r.log();
  EXPECT_NE(r.err.find("interrupted"), std::string::npos) << r.log();
  // The message gives the command that continues this run: the user's, with the folder.
  EXPECT_NE(r.err.find("; continue with: " + kDifftrain + " train --model_config_name_or_path"),
            std::string::npos)
      << r.log();
  EXPECT_NE(r.err.find("--output_dir " + out +
                       " --max_train_steps 100000 --checkpointing_steps 0 "
                       "--train_batch_size 4 --resume_from_checkpoint latest"),
            std::string::npos)
      << r.log();
  bool found = false;
  for (const auto& e : fs::directory_iterator(out)) {
    found = found || (e.path().filename().string().rfind("checkpoint-", 0) == 0 &&
                      fs::exists(e.path() / "trainer_state.json"));
  }
  EXPECT_TRUE(found) << "no checkpoint after SIGTERM";
}

// The output folder is never an input, and a folder that holds a run is refused unless resumed
// or --overwrite_output_dir, which clears it completely first (issue 38).
TEST(TrainCommand, OutputFolderIsNeitherAnInputNorAnotherRunsFolder) {
  const auto dir = make_temp_dir("train_outdir");
  const std::vector<std::string> common = {"--max_train_steps", "2", "--train_batch_size", "8"};
  // The folder that holds --model_config_name_or_path (dir/tiny_unet.json).
  const auto into_input = train(train_cmd(dir, dir, common));
  EXPECT_NE(into_input.exit_code, 0) << into_input.log();
  EXPECT_NE(
      into_input.err.find("--output_dir '" + dir + "' contains --model_config_name_or_path '" +
                          dir + "/tiny_unet.json'"),
      std::string::npos)
      << into_input.log();
  EXPECT_FALSE(fs::exists(dir + "/.difftrain.lock")) << "refused only after touching the folder";

  const std::string out = dir + "/out";
  auto first = common;
  first.insert(first.end(), {"--checkpointing_steps", "1"});
  const auto done = train(train_cmd(dir, out, first));
  ASSERT_EQ(done.exit_code, 0) << done.log();
  ASSERT_TRUE(fs::exists(out + "/checkpoint-1"));
  const auto before = unet_weights(out);
  // Fine-tuning a run's own export into its own folder: refused, the export left as it was.
  auto onto_itself = train_cmd(dir, out, common);
  const auto config =
      std::find(onto_itself.begin(), onto_itself.end(), "--model_config_name_or_path");
  ASSERT_NE(config, onto_itself.end());
  *(config + 1) = out;
  *config = "--pretrained_model_name_or_path";
  const auto itself = train(onto_itself);
  EXPECT_NE(itself.exit_code, 0) << itself.log();
  EXPECT_NE(itself.err.find("is the same folder as --pretrained_model_name_or_path"),
            std::string::npos)
      << itself.log();
  // A new run into the finished run's folder: refused, naming what is there.
  const auto again = train(train_cmd(dir, out, common));
  EXPECT_NE(again.exit_code, 0) << again.log();
  EXPECT_NE(
      again.err.find("--output_dir '" + out + "' already holds files (README.md, checkpoint-1, "),
      std::string::npos)
      << again.log();
  EXPECT_NE(again.err.find("--overwrite_output_dir"), std::string::npos) << again.log();
  EXPECT_EQ(max_abs_diff(before, unet_weights(out)), 0.0);
  // --overwrite_output_dir with an input that does not exist (issue 56): refused, and the
  // finished run is still all there (the clearing waits until every input has been read).
  auto typo = train_cmd(dir, out, common);
  typo.insert(typo.end(), {"--overwrite_output_dir", "--dataset", "imagefolder", "--train_data_dir",
                           dir + "/typo"});
  const auto refused = train(typo);
  EXPECT_NE(refused.exit_code, 0) << refused.log();
  EXPECT_NE(refused.err.find(dir + "/typo"), std::string::npos) << refused.log();
  EXPECT_EQ(refused.err.find("clearing"), std::string::npos) << refused.log();
  EXPECT_TRUE(fs::exists(out + "/checkpoint-1/trainer_state.json")) << refused.log();
  EXPECT_TRUE(fs::exists(out + "/README.md")) << refused.log();
  EXPECT_EQ(max_abs_diff(before, unet_weights(out)), 0.0);
  // --overwrite_output_dir clears it completely: none of the first run's checkpoints are left.
  auto overwrite = train_cmd(dir, out, common);
  overwrite.push_back("--overwrite_output_dir");
  const auto cleared = train(overwrite);
  ASSERT_EQ(cleared.exit_code, 0) << cleared.log();
  EXPECT_FALSE(fs::exists(out + "/checkpoint-1"));
  EXPECT_TRUE(fs::exists(out + "/checkpoint-2/trainer_state.json"));
  EXPECT_EQ(losses(out).size(), 2u) << "metrics.jsonl of the first run is gone";
  // Resuming with --overwrite_output_dir is a contradiction, refused before any work.
  overwrite.insert(overwrite.end(), {"--resume_from_checkpoint", "latest"});
  const auto both = train(overwrite);
  EXPECT_NE(both.exit_code, 0) << both.log();
  EXPECT_NE(both.err.find("--overwrite_output_dir clears the folder"), std::string::npos)
      << both.log();
  EXPECT_TRUE(fs::exists(out + "/checkpoint-2/trainer_state.json"));
}

TEST(TrainCommand, LoraFineTuningTrainsOnlyAdaptersAndExports) {
  const auto dir = make_temp_dir("train_lora");
  const auto base = train(train_cmd(dir, dir + "/base",
                                    {"--max_train_steps", "2", "--train_batch_size", "4",
                                     "--checkpointing_steps", "0", "--use_ema", "false"}));
  ASSERT_EQ(base.exit_code, 0) << base.log();
  const auto before = unet_weights(dir + "/base");
  for (const std::string format : {"diffusers", "kohya"}) {
    const std::string out = dir + "/lora_" + format;
    const auto r = train({"train",
                          "--pretrained_model_name_or_path",
                          dir + "/base",
                          "--lora",
                          "--rank",
                          "2",
                          "--lora_alpha",
                          "4",
                          "--lora_format",
                          format,
                          "--lr_warmup_steps",
                          "0",
                          "--only_class",
                          "3",
                          "--max_train_steps",
                          "3",
                          "--train_batch_size",
                          "4",
                          "--checkpointing_steps",
                          "2",
                          "--learning_rate",
                          "1e-2",
                          "--use_ema",
                          "false",
                          "--num_validation_images",
                          "0",
                          "--output_dir",
                          out},
                         2);
    ASSERT_EQ(r.exit_code, 0) << r.log();
    ExpectedCard lora_card = {
        dir + "/base", "other", {"unconditional-image-generation"}, false, "", 0, ""};
    lora_card.lora = true;
    const auto card = expect_model_card(out, lora_card);
    EXPECT_NE(card.find("| LoRA | rank 2, alpha 4, dropout 0 |"), std::string::npos) << card;
    EXPECT_NE(card.find("| LoRA format | " + format + " |"), std::string::npos) << card;
    EXPECT_NE(card.find("| ranks | 2 |"), std::string::npos) << card;
    // The base folder is untouched and the checkpoint holds only adapter weights.
    EXPECT_EQ(max_abs_diff(before, unet_weights(dir + "/base")), 0.0);
    for (const auto& [key, t] :
         io::load_safetensors(out + "/checkpoint-2/model.safetensors").tensors) {
      EXPECT_NE(key.find(".lora_"), std::string::npos) << key;
    }
    // The exported file reads back as a LoRA of the right layers, and B moved off zero.
    const auto lora = io::read_lora(out + "/pytorch_lora_weights.safetensors");
    // to_q, to_k, to_v and to_out.0 of the 4 attentions (1 down, 1 mid, 2 up).
    EXPECT_EQ(lora.count("unet"), 16u);
    double up = 0;
    for (const auto& t : lora.targets("unet")) up = std::max(up, t.up.abs().max().item<double>());
    EXPECT_GT(up, 0.0);
    const auto s = run({kDifftrain, "sample", "--model", dir + "/base", "--lora",
                        out + "/pytorch_lora_weights.safetensors", "--num_inference_steps", "2",
                        "--num_images", "1", "--class_labels", "3", "--output", out + "/s.png"});
    EXPECT_EQ(s.exit_code, 0) << s.log();
  }
}

// A smoke run of a few steps with every default (the built-in Fashion-MNIST model, cosine with
// 100 warm-up steps): the run is shorter than the warm-up and stays in it, as in Diffusers.
// Before, it stopped with "num_warmup_steps 100 is larger than num_training_steps 3".
TEST(TrainCommand, ShortRunWithEveryDefaultStaysInWarmup) {
  const auto dir = make_temp_dir("train_short");
  const auto r = run({kDifftrain, "train", "--max_train_steps", "3", "--output_dir", dir + "/o"});
  ASSERT_EQ(r.exit_code, 0) << r.log();
  const std::string all = r.out + r.err;
  EXPECT_NE(all.find("done: 3 updates"), std::string::npos) << r.log();
  // The third update runs at warm-up multiplier 2 / 100 of the default lr 1e-3.
  EXPECT_NE(all.find("step 3/3"), std::string::npos) << r.log();
  EXPECT_NE(all.find("lr 2.00e-05"), std::string::npos) << r.log();
  EXPECT_TRUE(fs::exists(dir + "/o/unet/diffusion_pytorch_model.safetensors")) << r.log();
}

// Validation renders with any sampler (--validation_scheduler), and a name that is none fails
// before training starts.
TEST(TrainCommand, ValidationSamplesWithTheChosenSampler) {
  const auto dir = make_temp_dir("train_val_sampler");
  auto cmd = [&](const std::string& sampler, const std::string& out) {
    return std::vector<std::string>{kDifftrain,
                                    "train",
                                    "--model_config_name_or_path",
                                    tiny_config(dir),
                                    "--resolution",
                                    "8",
                                    "--max_train_samples",
                                    "32",
                                    "--max_train_steps",
                                    "2",
                                    "--num_validation_images",
                                    "2",
                                    "--validation_inference_steps",
                                    "3",
                                    "--validation_scheduler",
                                    sampler,
                                    "--final_validation",
                                    "always",
                                    "--output_dir",
                                    out};
  };
  auto r = run(cmd("dpmpp_2m_karras", dir + "/o"));
  ASSERT_EQ(r.exit_code, 0) << r.log();
  EXPECT_TRUE(fs::exists(dir + "/o/samples/step-000002.png")) << r.log();
  r = run(cmd("dpmpp_9m", dir + "/o2"));
  EXPECT_EQ(r.exit_code, 1) << r.log();
  EXPECT_NE(r.err.find("--validation_scheduler: unknown scheduler 'dpmpp_9m'"), std::string::npos)
      << r.log();
  EXPECT_FALSE(fs::exists(dir + "/o2/checkpoint-1")) << r.log();
}

TEST(TrainCommand, BadInputIsAOneLineErrorBeforeTraining) {
  const auto dir = make_temp_dir("train_bad");
  auto one_line = [](const ProcessResult& r) {
    return std::count(r.err.begin(), r.err.end(), '\n') <= 1;
  };
  auto r = run({kDifftrain, "train", "--learning_rat", "1"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("did you mean learning_rate"), std::string::npos) << r.log();
  EXPECT_TRUE(one_line(r)) << r.log();
  r = run({kDifftrain, "train", "--dataset", "imagefolder", "--train_data_dir", dir + "/empty"});
  EXPECT_EQ(r.exit_code, 1) << r.log();
  fs::create_directories(dir + "/empty");
  r = run({kDifftrain, "train", "--dataset", "imagefolder", "--train_data_dir", dir + "/empty",
           "--output_dir", dir + "/o1"});
  EXPECT_EQ(r.exit_code, 1) << r.log();
  EXPECT_NE(r.err.find(dir + "/empty"), std::string::npos) << r.log();
  fs::create_directories(dir + "/bad");
  std::ofstream(dir + "/bad/a.png") << "this is not a png";
  r = run({kDifftrain, "train", "--dataset", "imagefolder", "--train_data_dir", dir + "/bad",
           "--resolution", "8", "--output_dir", dir + "/o2"});
  EXPECT_EQ(r.exit_code, 1) << r.log();
  EXPECT_NE(r.err.find("a.png"), std::string::npos) << r.log();
  r = run({kDifftrain, "train", "--lora", "--pretrained_model_name_or_path", dir + "/nope"});
  EXPECT_EQ(r.exit_code, 1) << r.log();
  EXPECT_NE(r.err.find(dir + "/nope"), std::string::npos) << r.log();
}

}  // namespace
}  // namespace difftrain::testing

namespace difftrain::testing {
namespace {

// `difftrain eval` end to end on a barely trained 32x32 model with a small classifier: the JSON
// has every field in range, the classifier is cached and reused, and a model it cannot score is
// a one-line error.
TEST(EvalCommand, ScoresAClassConditionalModelWithACachedClassifier) {
  const auto dir = make_temp_dir("eval");
  const std::string config = dir + "/unet32.json";
  std::ofstream(config) << R"({"_class_name": "UNet2DModel", "sample_size": 32, "in_channels": 1,
    "out_channels": 1, "layers_per_block": 1, "block_out_channels": [8, 16],
    "down_block_types": ["DownBlock2D", "DownBlock2D"], "up_block_types": ["UpBlock2D", "UpBlock2D"],
    "norm_num_groups": 4})";
  const auto t = run({kDifftrain, "train", "--model_config_name_or_path", config,
                      "--max_train_samples", "64", "--max_train_steps", "2", "--lr_warmup_steps",
                      "0", "--num_validation_images", "0", "--output_dir", dir + "/model"});
  ASSERT_EQ(t.exit_code, 0) << t.log();
  const std::vector<std::string> eval = {kDifftrain,
                                         "eval",
                                         "--model",
                                         dir + "/model",
                                         "--num_per_class",
                                         "2",
                                         "--num_inference_steps",
                                         "2",
                                         "--classifier_train_samples",
                                         "2000",
                                         "--classifier_epochs",
                                         "3",
                                         "--test_samples",
                                         "400",
                                         "--cache_dir",
                                         dir + "/cache",
                                         "--output",
                                         dir + "/eval.json"};
  const auto first = run(eval, {}, 300);
  ASSERT_EQ(first.exit_code, 0) << first.log();
  EXPECT_NE(first.err.find("classifier: training"), std::string::npos) << first.log();
  const auto j = nlohmann::json::parse(std::ifstream(dir + "/eval.json"));
  EXPECT_EQ(j.at("num_images"), 20);
  EXPECT_EQ(j.at("guidance_scale"), 1.0);
  EXPECT_EQ(j.at("per_class_accuracy").size(), 10u);
  EXPECT_GE(j.at("accuracy").get<double>(), 0.0);
  EXPECT_LE(j.at("accuracy").get<double>(), 1.0);
  EXPECT_GT(j.at("frechet_distance").get<double>(), j.at("reference_distance").get<double>());
  // Even 3 epochs over 2000 images make a classifier far better than chance (0.1) on the test set.
  EXPECT_GT(j.at("classifier_test_accuracy").get<double>(), 0.4);
  const auto second = run(eval, {}, 300);
  ASSERT_EQ(second.exit_code, 0) << second.log();
  EXPECT_NE(second.err.find("classifier: loaded"), std::string::npos) << second.log();
  const auto j2 = nlohmann::json::parse(std::ifstream(dir + "/eval.json"));
  EXPECT_EQ(j2.at("frechet_distance"), j.at("frechet_distance"));  // same seed, same classifier
  // By default it draws with the folder's scheduler (DDPM here), as validation does; --scheduler
  // picks another sampler from the same config (deterministic DDIM: other samples).
  EXPECT_EQ(j.at("scheduler"), "DDPMScheduler");
  auto with_ddim = eval;
  with_ddim.insert(with_ddim.end(), {"--scheduler", "ddim"});
  const auto third = run(with_ddim, {}, 300);
  ASSERT_EQ(third.exit_code, 0) << third.log();
  const auto j3 = nlohmann::json::parse(std::ifstream(dir + "/eval.json"));
  EXPECT_EQ(j3.at("scheduler"), "DDIMScheduler");
  EXPECT_NE(j3.at("frechet_distance"), j.at("frechet_distance"));
  // Guidance needs the null class a --class_dropout_prob run adds after the 10 classes.
  const auto unguided = run({kDifftrain, "eval", "--model", dir + "/model", "--guidance_scale", "2",
                             "--cache_dir", dir + "/cache"});
  EXPECT_EQ(unguided.exit_code, 1) << unguided.log();
  EXPECT_NE(unguided.err.find("needs a null class"), std::string::npos) << unguided.log();
  const auto bad =
      run({kDifftrain, "eval", "--model",
           std::string(difftrain_test::source_dir()) + "/tests/golden/diffusers/unet2d_uncond",
           "--cache_dir", dir + "/cache"});
  EXPECT_EQ(bad.exit_code, 1) << bad.log();
  EXPECT_NE(bad.err.find("is not one"), std::string::npos) << bad.log();
}

}  // namespace
}  // namespace difftrain::testing
