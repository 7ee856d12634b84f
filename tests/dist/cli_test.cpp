// The other commands end to end: config written and read back by launch, Accelerate configs,
// bad input, env and test.

#include "program_paths.h"
#include "subprocess.h"

#include <gtest/gtest.h>
#include <torch/version.h>

#include <fstream>

namespace difftrain::testing {
namespace {

const std::string kDifftrain = difftrain_test::difftrain_bin();
const std::string kWorker = difftrain_test::dist_worker_bin();

// Keeps the launcher away from the user's default config.
std::map<std::string, std::string> isolated() { return {{"XDG_CACHE_HOME", make_temp_dir("xdg")}}; }

TEST(ConfigCommand, WrittenConfigIsWhatLaunchUses) {
  const auto cache = make_temp_dir("xdg");
  const std::map<std::string, std::string> env{{"XDG_CACHE_HOME", cache}};
  const auto w = run({kDifftrain, "config", "--num_processes", "3", "--mixed_precision", "fp16",
                      "--num_cpu_threads_per_process", "1"},
                     env, 30);
  ASSERT_EQ(w.exit_code, 0) << w.log();
  EXPECT_NE(w.out.find("wrote " + cache + "/difftrain/default_config.yaml"), std::string::npos)
      << w.log();
  const auto r = run({kDifftrain, "launch", kWorker, "env"}, env, 60);
  ASSERT_EQ(r.exit_code, 0) << r.log();
  EXPECT_NE(r.out.find("[rank 2] WORLD_SIZE=3"), std::string::npos) << r.log();
  EXPECT_NE(r.out.find("[rank 0] DIFFTRAIN_MIXED_PRECISION=fp16"), std::string::npos) << r.log();
  // A flag beats the config file.
  const auto f = run(
      {kDifftrain, "launch", "--num_processes", "2", "--mixed_precision", "bf16", kWorker, "env"},
      env, 60);
  EXPECT_NE(f.out.find("[rank 1] WORLD_SIZE=2"), std::string::npos) << f.log();
  EXPECT_EQ(f.out.find("[rank 2]"), std::string::npos) << f.log();
  EXPECT_NE(f.out.find("DIFFTRAIN_MIXED_PRECISION=bf16"), std::string::npos) << f.log();
  // `config show` prints it back.
  const auto s = run({kDifftrain, "config", "show"}, env, 30);
  EXPECT_NE(s.out.find("num_processes: 3"), std::string::npos) << s.log();
}

TEST(ConfigCommand, AccelerateConfigDrivesLaunchAndUnhonouredKeysAreReported) {
  const auto dir = make_temp_dir("acc");
  const std::string path = dir + "/accelerate.yaml";
  std::ofstream(path)
      << "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nnum_processes: 2\n"
         "mixed_precision: bf16\nnum_machines: 1\nmachine_rank: 0\nuse_cpu: true\n"
         "fsdp_config:\n  fsdp_sharding_strategy: FULL_SHARD\ndynamo_config:\n  dynamo_backend: "
         "INDUCTOR\n";
  const auto r = run({kDifftrain, "launch", "--config_file", path, kWorker, "env"},
                     {{"XDG_CACHE_HOME", dir}}, 60);
  ASSERT_EQ(r.exit_code, 0) << r.log();
  EXPECT_NE(r.out.find("[rank 1] WORLD_SIZE=2"), std::string::npos) << r.log();
  EXPECT_NE(r.out.find("DIFFTRAIN_MIXED_PRECISION=bf16"), std::string::npos) << r.log();
  // Accelerate too reads fsdp_config only under distributed_type FSDP: said, not applied.
  EXPECT_NE(r.err.find("fsdp_config is ignored because distributed_type is MULTI_CPU"),
            std::string::npos)
      << r.log();
  EXPECT_EQ(r.out.find("DIFFTRAIN_SHARDING_STRATEGY"), std::string::npos) << r.log();
  EXPECT_NE(r.err.find("ignored dynamo_config"), std::string::npos) << r.log();

  // distributed_type FSDP: the ranks get the sharding, and fsdp_offload_params the offload.
  std::ofstream(path) << "distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n"
                         "  fsdp_sharding_strategy: SHARD_GRAD_OP\n  fsdp_offload_params: true\n";
  const auto f =
      run({kDifftrain, "launch", "--config_file", path, "env"}, {{"XDG_CACHE_HOME", dir}}, 60);
  ASSERT_EQ(f.exit_code, 0) << f.log();
  EXPECT_NE(f.out.find("[rank 1] DIFFTRAIN_SHARDING_STRATEGY=SHARD_GRAD_OP"), std::string::npos)
      << f.log();
  EXPECT_NE(f.out.find("[rank 1] DIFFTRAIN_OFFLOAD_OPTIMIZER_DEVICE=cpu"), std::string::npos)
      << f.log();
  EXPECT_EQ(f.err.find("fsdp_offload_params"), std::string::npos) << f.log();
}

TEST(ConfigCommand, BadYamlIsAOneLineErrorWithThePath) {
  const auto dir = make_temp_dir("bad");
  const std::string path = dir + "/broken.yaml";
  std::ofstream(path) << "num_processes: 2\n  mixed_precision: : [\n";
  const auto r = run({kDifftrain, "launch", "--config_file", path, kWorker, "env"},
                     {{"XDG_CACHE_HOME", dir}}, 30);
  EXPECT_EQ(r.exit_code, 1) << r.log();
  EXPECT_EQ(r.out, "");
  EXPECT_NE(r.err.find("difftrain: error: config file " + path + ": line "), std::string::npos)
      << r.log();
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.log();
  const auto missing = run(
      {kDifftrain, "launch", "--config_file", dir + "/nope.yaml", kWorker, "env"}, isolated(), 30);
  EXPECT_EQ(missing.exit_code, 1);
  EXPECT_NE(missing.err.find(dir + "/nope.yaml cannot be read: no such file"), std::string::npos)
      << missing.log();
}

TEST(LaunchCommand, BadOptionsAndProgramsAreClearErrors) {
  const auto dir = make_temp_dir("opts");
  const std::map<std::string, std::string> env{{"XDG_CACHE_HOME", dir}};
  auto err_of = [&](std::vector<std::string> argv) {
    argv.insert(argv.begin(), {kDifftrain, "launch"});
    const auto r = run(argv, env, 30);
    EXPECT_NE(r.exit_code, 0) << r.log();
    return r.err;
  };
  EXPECT_NE(
      err_of({"no-such-program-xyz"}).find("program 'no-such-program-xyz' was not found on PATH"),
      std::string::npos);
  EXPECT_NE(err_of({"/nonexistent/prog"}).find("cannot run '/nonexistent/prog': no such file"),
            std::string::npos);
  EXPECT_NE(err_of({"--num_processes", "3", "--num_machines", "2", "--main_process_ip", "127.0.0.1",
                    "--main_process_port", "1234", kWorker})
                .find("--num_processes 3 is not a multiple of --num_machines 2"),
            std::string::npos);
  EXPECT_NE(err_of({"--num_processes", "2", "--num_machines", "2", kWorker})
                .find("--main_process_ip is required"),
            std::string::npos);
  EXPECT_NE(err_of({"--num_processes", "0", kWorker}).find("--num_processes must be at least 1"),
            std::string::npos);
  EXPECT_NE(err_of({}).find("no program given"), std::string::npos);
}

TEST(LaunchCommand, ProgramArgumentsAndDoubleDashPassThrough) {
  const auto r = run({kDifftrain, "launch", "--num_processes", "1", "--", kWorker, "sleep", "0"},
                     isolated(), 30);
  EXPECT_EQ(r.exit_code, 0) << r.log();
  // A `--` among the program's own arguments stays the program's.
  const auto d =
      run({kDifftrain, "launch", "--cpu", kWorker, "sleep", "0", "--", "x"}, isolated(), 30);
  EXPECT_EQ(d.exit_code, 0) << d.log();
  // Options after PROGRAM belong to the program, not to the launcher.
  const auto s = run({kDifftrain, "launch", kWorker, "exit-mode-unknown", "--num_processes", "5"},
                     isolated(), 30);
  EXPECT_EQ(s.exit_code, 2) << s.log();
  EXPECT_NE(s.err.find("[rank 0] dist_worker: unknown mode exit-mode-unknown"), std::string::npos)
      << s.log();
}

TEST(EnvCommand, ReportsVersionsBlasThreadsAndConfig) {
  const auto dir = make_temp_dir("env");
  const auto r = run({kDifftrain, "env", "--probe_seconds", "0.2"}, {{"XDG_CACHE_HOME", dir}}, 60);
  ASSERT_EQ(r.exit_code, 0) << r.log();
  for (const char* field : {"- difftrain version:", "- LibTorch version: " TORCH_VERSION,
                            "- BLAS:", "- matmul probe:", "GFLOP/s", "- threads: intra-op",
                            "- CPU:", "- LibTorch build: ", "- CUDA devices: ",
                            "- collectives backend: ", "- default config ("}) {
    EXPECT_NE(r.out.find(field), std::string::npos) << field << "\n" << r.log();
  }
#ifdef DIFFTRAIN_WITH_CUDA
  // A CUDA build reports the toolkit LibTorch was built with and the NCCL it links.
  EXPECT_NE(r.out.find("- LibTorch build: CUDA 1"), std::string::npos) << r.log();
  EXPECT_NE(r.out.find("compiled (DIFFTRAIN_CUDA=ON), NCCL 2."), std::string::npos) << r.log();
#else
  EXPECT_NE(r.out.find("- difftrain CUDA/NCCL path: not compiled"), std::string::npos) << r.log();
#endif
  // scripts/setup installs OpenBLAS: a reference BLAS here would be a setup bug.
  EXPECT_NE(r.out.find("- BLAS: openblas"), std::string::npos) << r.log();
  EXPECT_EQ(r.out.find("WARNING"), std::string::npos) << r.log();
}

TEST(TestCommand, SelfTestRunsUnderTheLauncher) {
  const auto r =
      run({kDifftrain, "launch", "--num_processes", "2", kDifftrain, "test"}, isolated(), 60);
  ASSERT_EQ(r.exit_code, 0) << r.log();
  EXPECT_EQ(r.out.find("[FAIL]"), std::string::npos);
  EXPECT_NE(r.out.find("[rank 0] [PASS] gradient all-reduce vs. one-process float64 reference"),
            std::string::npos)
      << r.log();
}

}  // namespace
}  // namespace difftrain::testing
