// ZeRO-Offload through `difftrain train` in real processes under `difftrain launch`: a DeepSpeed
// JSON with offload_optimizer / offload_param, the flags, and an Accelerate FSDP YAML with
// fsdp_offload_params give the run without offload bit for bit on this CPU-only build (the
// "device" is the CPU), resume exactly, report host bytes in run_info that estimate-memory
// predicts, and refuse impossible combinations in one line.

#include "train_util.h"

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>

namespace difftrain::testing {
namespace {

namespace fs = std::filesystem;

nlohmann::json run_info(const std::string& out, int rank) {
  std::ifstream in(out + "/logs/run_info.rank" + std::to_string(rank) + ".json");
  return nlohmann::json::parse(in);
}

const std::vector<std::string> kCommon = {"--max_train_steps",     "4", "--use_ema",       "false",
                                          "--checkpointing_steps", "2", "--max_grad_norm", "0.5",
                                          "--train_batch_size",    "6"};

TEST(OffloadTraining, DeepSpeedOffloadEqualsNoOffloadBitForBitAndResumes) {
  const auto dir = make_temp_dir("offload_train");
  auto plain = train_cmd(dir, dir + "/plain", kCommon);
  plain.insert(plain.end(), {"--sharding_strategy", "FULL_SHARD"});
  const auto r1 = train(plain, 2);
  ASSERT_EQ(r1.exit_code, 0) << r1.log();

  const std::string ds = dir + "/ds_zero3_offload.json";
  std::ofstream(ds) << R"({"zero_optimization": {"stage": 3,
      "offload_optimizer": {"device": "cpu", "pin_memory": true},
      "offload_param": {"device": "cpu", "pin_memory": true}},
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"})";
  auto off = train_cmd(dir, dir + "/offload", kCommon);
  off.insert(off.end(), {"--deepspeed_config", ds});
  const auto r2 = train(off, 2);
  ASSERT_EQ(r2.exit_code, 0) << r2.log();
  EXPECT_NE(r2.log().find("optimizer and parameters offloaded to the CPU"), std::string::npos)
      << r2.log();
  EXPECT_EQ(r2.log().find("offload is not supported"), std::string::npos) << r2.log();

  EXPECT_EQ(max_abs_diff(unet_weights(dir + "/plain"), unet_weights(dir + "/offload")), 0.0);
  EXPECT_EQ(losses(dir + "/plain"), losses(dir + "/offload"));
  ASSERT_EQ(losses(dir + "/offload").size(), 4u);

  // Host bytes: the optimizer side left the device's counts.
  for (int r = 0; r < 2; ++r) {
    const auto info = run_info(dir + "/offload", r);
    const auto b = info.at("state_bytes");
    const auto p = run_info(dir + "/plain", r).at("state_bytes");
    std::printf(
        "rank %d: device params %lld grads %lld optimizer %lld, host %lld | no offload: "
        "%lld %lld %lld\n",
        r, static_cast<long long>(b["param_bytes"].get<int64_t>()),
        static_cast<long long>(b["grad_bytes"].get<int64_t>()),
        static_cast<long long>(b["optimizer_bytes"].get<int64_t>()),
        static_cast<long long>(b["host_bytes"].get<int64_t>()),
        static_cast<long long>(p["param_bytes"].get<int64_t>()),
        static_cast<long long>(p["grad_bytes"].get<int64_t>()),
        static_cast<long long>(p["optimizer_bytes"].get<int64_t>()));
    EXPECT_TRUE(info.at("offload_optimizer").get<bool>());
    EXPECT_TRUE(info.at("offload_params").get<bool>());
    EXPECT_EQ(b["optimizer_bytes"].get<int64_t>(), 0);
    EXPECT_EQ(b["param_bytes"].get<int64_t>(), 0);
    EXPECT_EQ(b["grad_bytes"].get<int64_t>(), 0);
    // Master shards + their gradients (4 + 4 bytes) and AdamW's moments (8) per shard element.
    EXPECT_EQ(b["host_bytes"].get<int64_t>(), p["param_bytes"].get<int64_t>() +
                                                  p["grad_bytes"].get<int64_t>() +
                                                  p["optimizer_bytes"].get<int64_t>());
  }
  // estimate-memory says the same before the run.
  const auto est =
      run({kDifftrain, "estimate-memory", "--model", dir + "/offload/unet", "--num_processes", "2",
           "--sharding_strategy", "FULL_SHARD", "--offload_optimizer_device", "cpu",
           "--offload_param_device", "cpu", "--json"},
          {}, 120);
  ASSERT_EQ(est.exit_code, 0) << est.log();
  const auto e = nlohmann::json::parse(est.out);
  const auto measured = run_info(dir + "/offload", 0).at("state_bytes");
  for (const char* key : {"param_bytes", "grad_bytes", "optimizer_bytes", "host_bytes"}) {
    EXPECT_EQ(e.at(key).get<int64_t>(), measured.at(key).get<int64_t>()) << key;
  }

  // Interrupted at 2 and resumed, with the flags this time (and without offload: the same files).
  for (bool offload : {true, false}) {
    const std::string out = dir + (offload ? "/resumed_offload" : "/resumed_plain");
    fs::create_directories(out);
    fs::copy(dir + "/offload/checkpoint-2", out + "/checkpoint-2", fs::copy_options::recursive);
    auto resumed = train_cmd(dir, out, kCommon);
    resumed.insert(resumed.end(),
                   {"--sharding_strategy", "FULL_SHARD", "--resume_from_checkpoint", "latest"});
    if (offload) {
      resumed.insert(resumed.end(),
                     {"--offload_optimizer_device", "cpu", "--offload_param_device", "cpu"});
    }
    const auto r3 = train(resumed, 2);
    ASSERT_EQ(r3.exit_code, 0) << r3.log();
    EXPECT_EQ(max_abs_diff(unet_weights(dir + "/offload"), unet_weights(out)), 0.0)
        << (offload ? "resumed with offload" : "resumed without offload");
  }
}

TEST(OffloadTraining, LauncherFlagsAndAccelerateFsdpOffloadParams) {
  const auto dir = make_temp_dir("offload_launch");
  // `difftrain launch --offload_optimizer_device cpu` passes it to the ranks (ZeRO-2 here).
  const auto r1 = run({kDifftrain,
                       "launch",
                       "--num_processes",
                       "2",
                       "--sharding_strategy",
                       "SHARD_GRAD_OP",
                       "--offload_optimizer_device",
                       "cpu",
                       kDifftrain,
                       "train",
                       "--model_config_name_or_path",
                       tiny_config(dir),
                       "--resolution",
                       "8",
                       "--max_train_samples",
                       "24",
                       "--max_train_steps",
                       "2",
                       "--use_ema",
                       "false",
                       "--num_validation_images",
                       "0",
                       "--output_dir",
                       dir + "/zero2"},
                      {}, 300);
  ASSERT_EQ(r1.exit_code, 0) << r1.log();
  auto info = run_info(dir + "/zero2", 1);
  EXPECT_EQ(info.at("sharding").get<std::string>(), "SHARD_GRAD_OP");
  EXPECT_TRUE(info.at("offload_optimizer").get<bool>());
  EXPECT_FALSE(info.at("offload_params").get<bool>());
  EXPECT_GT(info.at("state_bytes").at("host_bytes").get<int64_t>(), 0);

  // Accelerate's FSDP config: fsdp_offload_params offloads both under FULL_SHARD.
  const std::string yaml = dir + "/fsdp.yaml";
  std::ofstream(yaml) << "distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n"
                         "  fsdp_sharding_strategy: FULL_SHARD\n  fsdp_offload_params: true\n";
  auto cmd = train_cmd(dir, dir + "/fsdp", {"--max_train_steps", "2", "--use_ema", "false"});
  cmd.insert(cmd.end(), {"--accelerate_config_file", yaml});
  const auto r2 = train(cmd, 2);
  ASSERT_EQ(r2.exit_code, 0) << r2.log();
  EXPECT_EQ(r2.log().find("offload is not supported"), std::string::npos) << r2.log();
  info = run_info(dir + "/fsdp", 0);
  EXPECT_EQ(info.at("sharding").get<std::string>(), "FULL_SHARD");
  EXPECT_TRUE(info.at("offload_optimizer").get<bool>());
  EXPECT_TRUE(info.at("offload_params").get<bool>());
}

TEST(OffloadTraining, ImpossibleCombinationsFailInOneLine) {
  const auto dir = make_temp_dir("offload_errors");
  struct Case {
    std::vector<std::string> flags;
    std::string says;
  };
  for (const auto& c : std::vector<Case>{
           {{"--offload_optimizer_device", "cpu"}, "needs a sharding strategy"},
           {{"--offload_optimizer_device", "nvme", "--sharding_strategy", "FULL_SHARD"},
            "NVMe offload is not supported"},
           {{"--offload_optimizer_device", "disk"}, "is not an offload device"},
           {{"--sharding_strategy", "SHARD_GRAD_OP", "--offload_optimizer_device", "cpu",
             "--offload_param_device", "cpu"},
            "needs FULL_SHARD"},
           {{"--sharding_strategy", "FULL_SHARD", "--offload_param_device", "cpu"},
            "needs offload_optimizer_device cpu too"}}) {
    auto cmd = train_cmd(dir, dir + "/out", {"--max_train_steps", "1"});
    cmd.insert(cmd.end(), c.flags.begin(), c.flags.end());
    const auto r = train(cmd, 1, 120);
    EXPECT_NE(r.exit_code, 0) << r.log();
    EXPECT_NE(r.err.find(c.says), std::string::npos) << r.log();
    EXPECT_EQ(r.err.find("terminate called"), std::string::npos) << r.log();
  }
}

}  // namespace
}  // namespace difftrain::testing
