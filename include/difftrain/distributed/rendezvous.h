#pragma once

#include <functional>
#include <optional>
#include <string>

namespace difftrain::distributed {

/// Where a process's rank and world came from.
enum class RendezvousSource {
  kNone,      ///< no variables at all: a world of 1, no network
  kTorchrun,  ///< RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (torchrun, `difftrain launch`)
  kOpenMpi,   ///< OMPI_COMM_WORLD_* (mpirun)
  kSlurm,     ///< SLURM_PROCID / SLURM_NTASKS (srun)
};

/// One process's place in the job, read from the environment (the torchrun contract first, then
/// OpenMPI, then SLURM), so a binary runs unchanged under `difftrain launch`, torchrun, mpirun or
/// srun. Accelerate: `PartialState` (process_index, num_processes, local_process_index).
struct RendezvousInfo {
  int rank = 0;              ///< global rank (RANK)
  int world_size = 1;        ///< number of ranks in the job (WORLD_SIZE)
  int local_rank = 0;        ///< rank on this machine (LOCAL_RANK)
  int local_world_size = 1;  ///< ranks on this machine (LOCAL_WORLD_SIZE)
  int node_rank = 0;         ///< machine index (GROUP_RANK / NODE_RANK)
  std::string master_addr;   ///< host of the rendezvous store (MASTER_ADDR)
  int master_port = 0;       ///< port of the rendezvous store (MASTER_PORT)
  /// Path of a c10d FileStore set by `difftrain launch` for single-machine jobs
  /// (DIFFTRAIN_STORE_FILE): no rendezvous port at all.
  std::string store_file;
  /// True when the launcher hosts the TCP store itself (`difftrain launch`:
  /// DIFFTRAIN_STORE_HOSTED=1; torchrun: TORCHELASTIC_USE_AGENT_STORE=True), so rank 0 connects as
  /// a client instead of serving it.
  bool store_hosted = false;
  /// How often the launcher has restarted the group (DIFFTRAIN_RESTART_COUNT /
  /// TORCHELASTIC_RESTART_COUNT); part of every store key so restarts never see stale keys.
  int restart_count = 0;
  RendezvousSource source = RendezvousSource::kNone;

  bool is_main_process() const { return rank == 0; }
  bool is_local_main_process() const { return local_rank == 0; }
  /// "10.0.0.1:29500", or "file <path>" for a FileStore.
  std::string store_description() const;
};

/// Looks an environment variable up; returns nullopt when unset.
using EnvLookup = std::function<std::optional<std::string>(const std::string&)>;

/// The real process environment.
std::optional<std::string> process_env(const std::string& name);

/// Reads the rendezvous variables. Throws difftrain::Error naming the variable when a value is
/// malformed or inconsistent (RANK >= WORLD_SIZE, a world > 1 without MASTER_ADDR, ...).
RendezvousInfo detect_rendezvous(const EnvLookup& env = process_env);

/// First host of a SLURM node list: "node[03-05,9],gpu1" -> "node03".
std::string first_slurm_host(const std::string& nodelist);

const char* to_string(RendezvousSource source);

}  // namespace difftrain::distributed
