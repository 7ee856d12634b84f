#include "difftrain/launch/config.h"
#include "difftrain/core/error.h"
#include "difftrain/launch/cuda_info.h"

#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace difftrain::launch {
namespace {

namespace fs = std::filesystem;

fs::path temp_dir() {
  const auto dir =
      fs::temp_directory_path() / ("difftrain-config-test-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  return dir;
}

TEST(Config, RoundTripKeepsEveryField) {
  LaunchConfig c;
  c.compute_environment = "LOCAL_MACHINE";
  c.distributed_type = "MULTI_CPU";
  c.mixed_precision = "bf16";
  c.num_processes = 8;
  c.num_machines = 2;
  c.machine_rank = 1;
  c.main_process_ip = "10.0.0.1";
  c.main_process_port = 29501;
  c.num_cpu_threads_per_process = 3;
  c.gradient_accumulation_steps = 4;
  c.max_restarts = 2;
  c.log_dir = "/tmp/logs dir";
  const auto path = (temp_dir() / "nested" / "config.yaml").string();
  save_config(path, c);
  const LaunchConfig back = load_config(path);
  EXPECT_EQ(back.compute_environment, c.compute_environment);
  EXPECT_EQ(back.distributed_type, c.distributed_type);
  EXPECT_EQ(back.mixed_precision, c.mixed_precision);
  EXPECT_EQ(back.num_processes, c.num_processes);
  EXPECT_EQ(back.num_machines, c.num_machines);
  EXPECT_EQ(back.machine_rank, c.machine_rank);
  EXPECT_EQ(back.main_process_ip, c.main_process_ip);
  EXPECT_EQ(back.main_process_port, c.main_process_port);
  EXPECT_EQ(back.num_cpu_threads_per_process, c.num_cpu_threads_per_process);
  EXPECT_EQ(back.gradient_accumulation_steps, c.gradient_accumulation_steps);
  EXPECT_EQ(back.max_restarts, c.max_restarts);
  EXPECT_EQ(back.log_dir, c.log_dir);
  EXPECT_TRUE(back.notes.empty());
  // Written atomically: no temporary file is left behind.
  for (const auto& entry : fs::directory_iterator(fs::path(path).parent_path())) {
    EXPECT_EQ(entry.path().filename(), "config.yaml");
  }
}

TEST(Config, ReadsAccelerateDefaultConfig) {
  // What `accelerate config` writes for a 2-machine CPU job.
  const std::string yaml = R"(compute_environment: LOCAL_MACHINE
debug: false
distributed_type: MULTI_CPU
downcast_bf16: 'no'
enable_cpu_affinity: false
ipex_config:
  ipex: false
machine_rank: 1
main_process_ip: 192.168.1.10
main_process_port: 29555
main_training_function: main
mixed_precision: bf16
mpirun_config:
  mpirun_ccl: '1'
num_machines: 2
num_processes: 4
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: true
)";
  const LaunchConfig c = parse_config(yaml, "accelerate.yaml");
  EXPECT_EQ(c.distributed_type, "MULTI_CPU");
  EXPECT_EQ(c.mixed_precision, "bf16");
  EXPECT_EQ(c.num_processes, 4);
  EXPECT_EQ(c.num_machines, 2);
  EXPECT_EQ(c.machine_rank, 1);
  EXPECT_EQ(c.main_process_ip, "192.168.1.10");
  EXPECT_EQ(c.main_process_port, 29555);
  // Neutral values pass quietly; the two that ask for something are reported.
  ASSERT_EQ(c.notes.size(), 2u) << ::testing::PrintToString(c.notes);
  EXPECT_NE(c.notes[0].find("ipex_config"), std::string::npos);
  EXPECT_NE(c.notes[1].find("mpirun_config"), std::string::npos);
}

TEST(Config, UnhonouredKeysAreReportedNeverDropped) {
  const LaunchConfig c = parse_config(
      "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: FULL_SHARD\n"
      "num_procesess: 3\ngpu_ids: '0,1'\ndebug: true\nrdzv_backend: c10d\n"
      "compute_environment: AMAZON_SAGEMAKER\nmixed_precision: fp8\n",
      "x.yaml");
  std::string all;
  for (const auto& n : c.notes) all += n + "\n";
  for (const char* key : {"distributed_type: FSDP", "fsdp_config", "unknown key num_procesess",
                          "gpu_ids", "debug", "rdzv_backend", "AMAZON_SAGEMAKER", "fp8"}) {
    EXPECT_NE(all.find(key), std::string::npos) << key << " not reported in:\n" << all;
  }
  EXPECT_FALSE(c.distributed_type.has_value());
  EXPECT_EQ(c.mixed_precision, "no");
}

TEST(Config, BadYamlIsOneLineWithPathAndLine) {
  const auto path = (temp_dir() / "bad.yaml").string();
  std::ofstream(path) << "num_processes: 2\nmixed_precision: [bf16\n";
  try {
    load_config(path);
    FAIL() << "bad YAML accepted";
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find(path), std::string::npos) << message;
    EXPECT_NE(message.find("line "), std::string::npos) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  }
}

TEST(Config, BadValuesNameTheKey) {
  auto message = [](const std::string& yaml) {
    try {
      parse_config(yaml, "c.yaml");
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_NE(message("num_processes: two\n").find("num_processes must be a whole number"),
            std::string::npos);
  EXPECT_NE(message("num_processes: 0\n").find("num_processes must be at least 1"),
            std::string::npos);
  EXPECT_NE(message("mixed_precision: fp32\n").find("mixed_precision must be no, fp16 or bf16"),
            std::string::npos);
  EXPECT_NE(message("num_machines: 2\nmachine_rank: 2\n").find("machine_rank 2"),
            std::string::npos);
  EXPECT_NE(message("- a\n- b\n").find("expected a mapping"), std::string::npos);
  EXPECT_NE(message("main_process_port: 70000\n").find("main_process_port"), std::string::npos);
}

TEST(Config, MissingFileSaysSo) {
  try {
    load_config("/nonexistent/dir/config.yaml");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(
        std::string(e.what()).find("/nonexistent/dir/config.yaml cannot be read: no such file"),
        std::string::npos)
        << e.what();
  }
}

TEST(Config, DefaultPathFollowsXdgCacheHome) {
  const char* saved = std::getenv("XDG_CACHE_HOME");
  const std::string keep = saved ? saved : "";
  setenv("XDG_CACHE_HOME", "/some/cache", 1);
  EXPECT_EQ(default_config_path(), "/some/cache/difftrain/default_config.yaml");
  if (saved)
    setenv("XDG_CACHE_HOME", keep.c_str(), 1);
  else
    unsetenv("XDG_CACHE_HOME");
}

TEST(Config, InteractiveQuestionsTakeDefaultsAndReaskOnBadAnswers) {
  // machines: 2; rank: 5 (invalid) then 1; ip; port: default; processes: x (invalid) then 4;
  // threads: default; precision: fp16; accumulation: default; restarts: 1
  std::istringstream in("2\n5\n1\n10.0.0.7\n\nx\n4\n\nfp16\n\n1\n");
  std::ostringstream out;
  const LaunchConfig c = ask_config(in, out, LaunchConfig{});
  EXPECT_EQ(c.num_machines, 2);
  EXPECT_EQ(c.machine_rank, 1);
  EXPECT_EQ(c.main_process_ip, "10.0.0.7");
  EXPECT_EQ(c.main_process_port, 29500);
  EXPECT_EQ(c.num_processes, 4);
  EXPECT_EQ(c.num_cpu_threads_per_process, 0);
  EXPECT_EQ(c.mixed_precision, "fp16");
  EXPECT_EQ(c.gradient_accumulation_steps, 1);
  EXPECT_EQ(c.max_restarts, 1);
  EXPECT_EQ(c.distributed_type, "MULTI_CPU");
  EXPECT_NE(out.str().find("please answer 0 to 1"), std::string::npos) << out.str();
  EXPECT_NE(out.str().find("please answer with a whole number"), std::string::npos) << out.str();
}

// `difftrain env`'s CUDA lines: CUDA's and cuDNN's integer versions, and what this build is.
TEST(CudaInfo, FormatsToolkitVersions) {
  EXPECT_EQ(format_cuda_version(12040), "12.4");
  EXPECT_EQ(format_cuda_version(11080), "11.8");
  EXPECT_EQ(format_cuda_version(0), "");
  EXPECT_EQ(format_cudnn_version(90100), "9.1.0");
  EXPECT_EQ(format_cudnn_version(90501), "9.5.1");
  EXPECT_EQ(format_cudnn_version(8902), "8.9.2");
  EXPECT_EQ(format_cudnn_version(0), "");
}

TEST(CudaInfo, DescribesThisBuild) {
  const CudaInfo info = detect_cuda();
#ifdef DIFFTRAIN_WITH_CUDA
  EXPECT_TRUE(info.cuda_build);
  EXPECT_TRUE(info.difftrain_cuda);
  EXPECT_EQ(info.nccl.rfind("2.", 0), 0u) << info.nccl;
  EXPECT_EQ(info.cuda_runtime.rfind("1", 0), 0u) << info.cuda_runtime;
#else
  EXPECT_FALSE(info.difftrain_cuda);
  EXPECT_TRUE(info.nccl.empty());
#endif
  // Devices are listed only where CUDA sees them.
  if (info.devices.empty()) {
    EXPECT_FALSE(torch::cuda::is_available());
  }
}

}  // namespace
}  // namespace difftrain::launch
