#include "difftrain/distributed/rendezvous.h"

#include "difftrain/core/error.h"

#include <cstdlib>

namespace difftrain::distributed {

namespace {

int parse_int(const EnvLookup& env, const std::string& name, int fallback) {
  auto value = env(name);
  if (!value || value->empty()) return fallback;
  try {
    size_t used = 0;
    const long parsed = std::stol(*value, &used);
    if (used != value->size() || parsed < 0 || parsed > 1 << 24) throw std::invalid_argument(name);
    return static_cast<int>(parsed);
  } catch (const std::exception&) {
    throw Error("environment variable " + name + "='" + *value +
                "' is not a non-negative integer: fix or unset it");
  }
}

// SLURM_TASKS_PER_NODE looks like "4(x2),3": the count for the first node is what we need when
// every node runs the same number of tasks.
int parse_slurm_tasks_per_node(const std::string& value) {
  size_t i = 0;
  while (i < value.size() && std::isdigit(static_cast<unsigned char>(value[i]))) ++i;
  if (i == 0) throw Error("SLURM_TASKS_PER_NODE='" + value + "' is not understood");
  return std::stoi(value.substr(0, i));
}

}  // namespace

std::optional<std::string> process_env(const std::string& name) {
  const char* value = std::getenv(name.c_str());
  if (value == nullptr) return std::nullopt;
  return std::string(value);
}

const char* to_string(RendezvousSource source) {
  switch (source) {
    case RendezvousSource::kNone: return "none";
    case RendezvousSource::kTorchrun: return "torchrun";
    case RendezvousSource::kOpenMpi: return "openmpi";
    case RendezvousSource::kSlurm: return "slurm";
  }
  return "?";
}

std::string RendezvousInfo::store_description() const {
  if (!store_file.empty()) return "file " + store_file;
  return master_addr + ":" + std::to_string(master_port);
}

std::string first_slurm_host(const std::string& nodelist) {
  // The first entry ends at the first comma outside brackets.
  std::string first;
  int depth = 0;
  for (char c : nodelist) {
    if (c == '[') ++depth;
    if (c == ']') --depth;
    if (c == ',' && depth == 0) break;
    first += c;
  }
  const auto open = first.find('[');
  if (open == std::string::npos) return first;
  const std::string prefix = first.substr(0, open);
  std::string range = first.substr(open + 1);
  range = range.substr(0, range.find_first_of(",]"));
  return prefix + range.substr(0, range.find('-'));
}

RendezvousInfo detect_rendezvous(const EnvLookup& env) {
  RendezvousInfo info;
  const auto default_port = 29500;
  if (env("WORLD_SIZE") || env("RANK")) {
    info.source = RendezvousSource::kTorchrun;
    info.world_size = parse_int(env, "WORLD_SIZE", 1);
    info.rank = parse_int(env, "RANK", 0);
    info.local_rank = parse_int(env, "LOCAL_RANK", info.rank);
    info.local_world_size = parse_int(env, "LOCAL_WORLD_SIZE", info.world_size);
    info.node_rank = parse_int(env, "GROUP_RANK", parse_int(env, "NODE_RANK", 0));
  } else if (env("OMPI_COMM_WORLD_SIZE")) {
    info.source = RendezvousSource::kOpenMpi;
    info.world_size = parse_int(env, "OMPI_COMM_WORLD_SIZE", 1);
    info.rank = parse_int(env, "OMPI_COMM_WORLD_RANK", 0);
    info.local_rank = parse_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0);
    info.local_world_size = parse_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", 1);
    info.node_rank = info.local_world_size > 0 ? info.rank / info.local_world_size : 0;
  } else if (env("SLURM_NTASKS") && env("SLURM_PROCID")) {
    info.source = RendezvousSource::kSlurm;
    info.world_size = parse_int(env, "SLURM_NTASKS", 1);
    info.rank = parse_int(env, "SLURM_PROCID", 0);
    info.local_rank = parse_int(env, "SLURM_LOCALID", 0);
    if (auto per_node = env("SLURM_NTASKS_PER_NODE")) {
      info.local_world_size = parse_slurm_tasks_per_node(*per_node);
    } else if (auto tasks = env("SLURM_TASKS_PER_NODE")) {
      info.local_world_size = parse_slurm_tasks_per_node(*tasks);
    } else {
      info.local_world_size = info.world_size;
    }
    info.node_rank = parse_int(env, "SLURM_NODEID", 0);
    if (!env("MASTER_ADDR")) {
      if (auto nodes =
              env("SLURM_JOB_NODELIST") ? env("SLURM_JOB_NODELIST") : env("SLURM_NODELIST")) {
        info.master_addr = first_slurm_host(*nodes);
      }
    }
  }
  if (auto addr = env("MASTER_ADDR")) info.master_addr = *addr;
  info.master_port = parse_int(env, "MASTER_PORT", default_port);
  if (auto file = env("DIFFTRAIN_STORE_FILE")) info.store_file = *file;
  // Under torchrun (static rendezvous) its agent already serves the store on MASTER_PORT.
  const std::string agent_store = env("TORCHELASTIC_USE_AGENT_STORE").value_or("");
  info.store_hosted = env("DIFFTRAIN_STORE_HOSTED").value_or("0") == "1" || agent_store == "True" ||
                      agent_store == "true" || agent_store == "1";
  info.restart_count =
      parse_int(env, "DIFFTRAIN_RESTART_COUNT", parse_int(env, "TORCHELASTIC_RESTART_COUNT", 0));

  const std::string where = std::string(" (read from ") + to_string(info.source) + " variables)";
  if (info.world_size < 1) throw Error("WORLD_SIZE must be at least 1" + where);
  if (info.rank >= info.world_size) {
    throw Error("rank " + std::to_string(info.rank) + " is not below the world size " +
                std::to_string(info.world_size) + where + ": check RANK and WORLD_SIZE");
  }
  if (info.local_world_size < 1 || info.local_rank >= info.local_world_size) {
    throw Error("local rank " + std::to_string(info.local_rank) +
                " is not below the local world size " + std::to_string(info.local_world_size) +
                where + ": check LOCAL_RANK and LOCAL_WORLD_SIZE");
  }
  if (info.master_port > 65535) {
    throw Error("MASTER_PORT=" + std::to_string(info.master_port) + " is not a TCP port (0-65535)");
  }
  if (info.world_size > 1 && info.store_file.empty() && info.master_addr.empty()) {
    throw Error(
        "a world of " + std::to_string(info.world_size) + " ranks" + where +
        " needs MASTER_ADDR: set it to the host of rank 0 (and MASTER_PORT, default 29500)");
  }
  return info;
}

}  // namespace difftrain::distributed
