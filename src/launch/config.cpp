#include "difftrain/launch/config.h"

#include "difftrain/core/error.h"
#include "difftrain/io/atomic_file.h"

#include <yaml-cpp/yaml.h>

#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <set>
#include <sstream>

namespace difftrain::launch {

namespace fs = std::filesystem;

namespace {

// Accelerate keys difftrain reads but does not act on, with the value at which ignoring them
// changes nothing (empty: any value is worth a note) and why they are ignored.
struct IgnoredKey {
  std::string neutral;
  std::string reason;
};

const std::map<std::string, IgnoredKey>& ignored_keys() {
  static const std::map<std::string, IgnoredKey> keys = {
      {"debug", {"false", "collective debug checks are not implemented"}},
      {"downcast_bf16", {"no", "TPU-only option"}},
      {"enable_cpu_affinity", {"false", "CPU affinity is not set by difftrain"}},
      {"gpu_ids", {"all", "GPU selection is not implemented (CPU build)"}},
      {"main_training_function", {"main", "notebook launcher option"}},
      {"rdzv_backend", {"static", "difftrain uses a static rendezvous only"}},
      {"same_network", {"true", "machines are assumed to reach each other directly"}},
      {"use_cpu", {"", ""}},  // honoured: difftrain runs on the CPU unless built for CUDA
      {"tpu_env", {"[]", "TPU option"}},
      {"tpu_use_cluster", {"false", "TPU option"}},
      {"tpu_use_sudo", {"false", "TPU option"}},
      {"tpu_name", {"", "TPU option"}},
      {"tpu_zone", {"", "TPU option"}},
      {"commands", {"", "TPU pod option"}},
      {"command_file", {"", "TPU pod option"}},
      {"num_gpus", {"", "difftrain counts processes, not GPUs"}},
      {"dynamo_config", {"", "torch.compile does not exist in LibTorch"}},
      // Read by settings::parse_accelerate_sections() in `difftrain launch` (launch/resolve.cpp),
      // which reports what it cannot honour in them.
      {"fsdp_config", {"", ""}},
      {"deepspeed_config", {"", ""}},
      {"megatron_lm_config", {"", "Megatron-LM is not supported"}},
      {"ipex_config", {"", "IPEX is not supported"}},
      {"mpirun_config",
       {"", "run `mpirun difftrain ...` directly; difftrain reads OMPI variables"}},
      {"fp8_config", {"", "fp8 is not supported"}},
  };
  return keys;
}

std::string scalar_text(const YAML::Node& node) {
  if (node.IsScalar()) return node.Scalar();
  if (node.IsSequence() && node.size() == 0) return "[]";
  if (node.IsMap() && node.size() == 0) return "{}";
  if (node.IsNull()) return "";
  YAML::Emitter out;
  out << YAML::Flow << node;
  return out.c_str();
}

template <typename T>
std::optional<T> read_value(const YAML::Node& node, const std::string& key,
                            const std::string& origin);

template <>
std::optional<int> read_value<int>(const YAML::Node& node, const std::string& key,
                                   const std::string& origin) {
  if (node.IsNull()) return std::nullopt;
  try {
    return node.as<int>();
  } catch (const YAML::Exception&) {
    throw Error("config file " + origin + ": " + key + " must be a whole number, got '" +
                scalar_text(node) + "': fix it or run `difftrain config`");
  }
}

template <>
std::optional<std::string> read_value<std::string>(const YAML::Node& node, const std::string& key,
                                                   const std::string& origin) {
  if (node.IsNull()) return std::nullopt;
  if (!node.IsScalar()) {
    throw Error("config file " + origin + ": " + key + " must be a single value, got '" +
                scalar_text(node) + "'");
  }
  return node.Scalar();
}

bool is_one_of(const std::string& value, std::initializer_list<const char*> allowed) {
  for (const char* a : allowed) {
    if (value == a) return true;
  }
  return false;
}

}  // namespace

std::string default_config_path() {
  const char* xdg = std::getenv("XDG_CACHE_HOME");
  std::string base;
  if (xdg != nullptr && *xdg != '\0') {
    base = xdg;
  } else {
    const char* home = std::getenv("HOME");
    base = std::string(home != nullptr && *home != '\0' ? home : "/tmp") + "/.cache";
  }
  return base + "/difftrain/default_config.yaml";
}

LaunchConfig parse_config(const std::string& yaml_text, const std::string& origin) {
  YAML::Node root;
  try {
    root = YAML::Load(yaml_text);
  } catch (const YAML::ParserException& e) {
    throw Error("config file " + origin + ": line " + std::to_string(e.mark.line + 1) +
                ": invalid YAML (" + e.msg + "): fix it or rewrite it with `difftrain config`");
  }
  LaunchConfig config;
  if (root.IsNull()) return config;
  if (!root.IsMap()) {
    throw Error("config file " + origin +
                ": expected a mapping of keys (num_processes: 2, ...), got something else");
  }
  for (const auto& entry : root) {
    if (!entry.first.IsScalar()) {
      throw Error("config file " + origin + ": line " +
                  std::to_string(entry.first.Mark().line + 1) +
                  ": a key must be a plain name such as num_processes, not a list or mapping");
    }
    const std::string key = entry.first.Scalar();
    const YAML::Node& value = entry.second;
    if (key == "compute_environment") {
      config.compute_environment = read_value<std::string>(value, key, origin);
    } else if (key == "distributed_type") {
      config.distributed_type = read_value<std::string>(value, key, origin);
      if (config.distributed_type) {
        config.accelerate_distributed_type = *config.distributed_type;
        for (auto& c : config.accelerate_distributed_type)
          c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
      }
    } else if (key == "mixed_precision") {
      config.mixed_precision = read_value<std::string>(value, key, origin);
    } else if (key == "num_processes") {
      config.num_processes = read_value<int>(value, key, origin);
    } else if (key == "num_machines") {
      config.num_machines = read_value<int>(value, key, origin);
    } else if (key == "machine_rank") {
      config.machine_rank = read_value<int>(value, key, origin);
    } else if (key == "main_process_ip") {
      config.main_process_ip = read_value<std::string>(value, key, origin);
    } else if (key == "main_process_port") {
      config.main_process_port = read_value<int>(value, key, origin);
    } else if (key == "num_cpu_threads_per_process") {
      config.num_cpu_threads_per_process = read_value<int>(value, key, origin);
    } else if (key == "gradient_accumulation_steps") {
      config.gradient_accumulation_steps = read_value<int>(value, key, origin);
    } else if (key == "max_restarts") {
      config.max_restarts = read_value<int>(value, key, origin);
    } else if (key == "log_dir") {
      config.log_dir = read_value<std::string>(value, key, origin);
    } else if (auto it = ignored_keys().find(key); it != ignored_keys().end()) {
      const std::string text = scalar_text(value);
      const bool neutral = it->second.reason.empty() || text == it->second.neutral ||
                           (text.empty() && it->second.neutral.empty()) || text == "{}" ||
                           (it->second.neutral == "false" && text == "False") ||
                           (it->second.neutral == "true" && text == "True");
      if (!neutral) {
        config.notes.push_back("ignored " + key + ": " + text + " (" + it->second.reason + ")");
      }
    } else {
      config.notes.push_back("ignored unknown key " + key +
                             " (not an Accelerate or difftrain "
                             "launch setting: check its spelling)");
    }
  }
  // Values difftrain reads but honours only in part.
  if (config.compute_environment && *config.compute_environment != "LOCAL_MACHINE") {
    config.notes.push_back("ignored compute_environment: " + *config.compute_environment +
                           " (only LOCAL_MACHINE is supported; running locally)");
    config.compute_environment.reset();
  }
  if (config.distributed_type && is_one_of(*config.distributed_type, {"FSDP", "DEEPSPEED"})) {
    // The ranks are the same data-parallel processes; what differs is the sharding they get.
    const bool fsdp = *config.distributed_type == "FSDP";
    config.notes.push_back("distributed_type: " + *config.distributed_type +
                           " runs MULTI_CPU ranks with the sharding of " +
                           (fsdp ? "fsdp_config" : "deepspeed_config (ZeRO stage)") +
                           ", passed to them as DIFFTRAIN_SHARDING_STRATEGY and DIFFTRAIN_FSDP_*");
    config.distributed_type.reset();
  }
  if (config.distributed_type &&
      !is_one_of(*config.distributed_type, {"NO", "MULTI_CPU", "MULTI_GPU"})) {
    config.notes.push_back("ignored distributed_type: " + *config.distributed_type +
                           " (difftrain runs data-parallel ranks: NO, MULTI_CPU or MULTI_GPU)");
    config.distributed_type.reset();
  }
#ifndef DIFFTRAIN_WITH_NCCL
  if (config.distributed_type && *config.distributed_type == "MULTI_GPU") {
    config.notes.push_back(
        "distributed_type: MULTI_GPU runs on the CPU with Gloo (this difftrain "
        "is built without CUDA)");
  }
#endif
  if (config.mixed_precision && *config.mixed_precision == "fp8") {
    config.notes.push_back("ignored mixed_precision: fp8 (not supported; using no)");
    config.mixed_precision = "no";
  }
  validate_config(config, origin);
  return config;
}

void validate_config(const LaunchConfig& c, const std::string& origin) {
  auto fail = [&](const std::string& what) {
    throw Error("config file " + origin + ": " + what + ": fix it or run `difftrain config`");
  };
  if (c.mixed_precision && !is_one_of(*c.mixed_precision, {"no", "fp16", "bf16"})) {
    fail("mixed_precision must be no, fp16 or bf16, got '" + *c.mixed_precision + "'");
  }
  if (c.num_processes && *c.num_processes < 1) fail("num_processes must be at least 1");
  if (c.num_machines && *c.num_machines < 1) fail("num_machines must be at least 1");
  if (c.machine_rank && *c.machine_rank < 0) fail("machine_rank must be 0 or more");
  if (c.machine_rank && c.num_machines && *c.machine_rank >= *c.num_machines) {
    fail("machine_rank " + std::to_string(*c.machine_rank) + " is not below num_machines " +
         std::to_string(*c.num_machines));
  }
  if (c.main_process_port && (*c.main_process_port < 0 || *c.main_process_port > 65535)) {
    fail("main_process_port must be a TCP port (0-65535)");
  }
  if (c.num_cpu_threads_per_process && *c.num_cpu_threads_per_process < 0) {
    fail("num_cpu_threads_per_process must be 0 (automatic) or more");
  }
  if (c.gradient_accumulation_steps && *c.gradient_accumulation_steps < 1) {
    fail("gradient_accumulation_steps must be at least 1");
  }
  if (c.max_restarts && *c.max_restarts < 0) fail("max_restarts must be 0 or more");
}

std::string read_config_text(const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    throw Error("config file " + path +
                " cannot be read: " + (fs::exists(path) ? "permission denied" : "no such file") +
                ": check the path or create it with `difftrain config`");
  }
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

LaunchConfig load_config(const std::string& path) {
  return parse_config(read_config_text(path), path);
}

std::string config_to_yaml(const LaunchConfig& c) {
  YAML::Emitter out;
  out << YAML::BeginMap;
  auto put_s = [&](const char* key, const std::optional<std::string>& v) {
    if (v) out << YAML::Key << key << YAML::Value << YAML::DoubleQuoted << *v;
  };
  auto put_i = [&](const char* key, const std::optional<int>& v) {
    if (v) out << YAML::Key << key << YAML::Value << *v;
  };
  put_s("compute_environment", c.compute_environment);
  put_s("distributed_type", c.distributed_type);
  put_s("mixed_precision", c.mixed_precision);
  put_i("num_processes", c.num_processes);
  put_i("num_machines", c.num_machines);
  put_i("machine_rank", c.machine_rank);
  put_s("main_process_ip", c.main_process_ip);
  put_i("main_process_port", c.main_process_port);
  put_i("num_cpu_threads_per_process", c.num_cpu_threads_per_process);
  put_i("gradient_accumulation_steps", c.gradient_accumulation_steps);
  put_i("max_restarts", c.max_restarts);
  put_s("log_dir", c.log_dir);
  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

void save_config(const std::string& path, const LaunchConfig& config) {
  validate_config(config, path);
  io::write_file_atomic(
      path, "# written by `difftrain config`; read by `difftrain launch` (Accelerate key names)\n" +
                config_to_yaml(config));
}

namespace {

template <typename T>
T ask(std::istream& in, std::ostream& out, const std::string& question, const T& fallback,
      const std::function<std::optional<std::string>(const T&)>& check) {
  while (true) {
    out << question << " [" << fallback << "]: " << std::flush;
    std::string line;
    if (!std::getline(in, line)) {
      out << "\n";
      return fallback;
    }
    if (line.empty()) return fallback;
    std::istringstream parse(line);
    T value{};
    if constexpr (std::is_same_v<T, std::string>) {
      value = line;
    } else if (!(parse >> value) || !parse.eof()) {
      out << "  please answer with a whole number\n";
      continue;
    }
    if (auto problem = check(value)) {
      out << "  " << *problem << "\n";
      continue;
    }
    return value;
  }
}

}  // namespace

LaunchConfig ask_config(std::istream& in, std::ostream& out, const LaunchConfig& d) {
  using Check = std::function<std::optional<std::string>(const int&)>;
  auto at_least = [](int low) -> Check {
    return [low](const int& v) -> std::optional<std::string> {
      if (v < low) return "please answer " + std::to_string(low) + " or more";
      return std::nullopt;
    };
  };
  LaunchConfig c;
  c.compute_environment = "LOCAL_MACHINE";
  c.num_machines =
      ask<int>(in, out, "How many machines will you use?", d.num_machines.value_or(1), at_least(1));
  if (*c.num_machines > 1) {
    c.machine_rank =
        ask<int>(in, out, "What is the rank of this machine (0 = main)?",
                 d.machine_rank.value_or(0), [&](const int& v) -> std::optional<std::string> {
                   if (v < 0 || v >= *c.num_machines)
                     return "please answer 0 to " + std::to_string(*c.num_machines - 1);
                   return std::nullopt;
                 });
    c.main_process_ip = ask<std::string>(
        in, out, "What is the IP address of the main machine?",
        d.main_process_ip.value_or("127.0.0.1"),
        [](const std::string&) -> std::optional<std::string> { return std::nullopt; });
    c.main_process_port = ask<int>(in, out, "What port should the main machine listen on?",
                                   d.main_process_port.value_or(29500),
                                   [](const int& v) -> std::optional<std::string> {
                                     if (v < 1 || v > 65535)
                                       return "please answer a port from 1 to 65535";
                                     return std::nullopt;
                                   });
  }
  c.num_processes = ask<int>(in, out, "How many processes in total (over all machines)?",
                             d.num_processes.value_or(*c.num_machines), at_least(*c.num_machines));
  c.distributed_type = *c.num_processes > 1 ? "MULTI_CPU" : "NO";
  c.num_cpu_threads_per_process =
      ask<int>(in, out, "CPU threads per process (0 = cores / processes per machine)?",
               d.num_cpu_threads_per_process.value_or(0), at_least(0));
  c.mixed_precision =
      ask<std::string>(in, out, "Mixed precision (no/fp16/bf16)?", d.mixed_precision.value_or("no"),
                       [](const std::string& v) -> std::optional<std::string> {
                         if (v == "no" || v == "fp16" || v == "bf16") return std::nullopt;
                         return "please answer no, fp16 or bf16";
                       });
  c.gradient_accumulation_steps = ask<int>(in, out, "Gradient accumulation steps?",
                                           d.gradient_accumulation_steps.value_or(1), at_least(1));
  c.max_restarts = ask<int>(in, out, "How often may a failed group be restarted?",
                            d.max_restarts.value_or(0), at_least(0));
  if (d.log_dir) c.log_dir = d.log_dir;
  return c;
}

}  // namespace difftrain::launch
