#pragma once

#include "difftrain/core/torch_compat.h"
#include "difftrain/distributed/rendezvous.h"

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

namespace difftrain::distributed {

class ShmAllReduce;

/// Options of a process group. Environment overrides: DIFFTRAIN_JOIN_TIMEOUT and
/// DIFFTRAIN_COLLECTIVE_TIMEOUT (seconds), DIFFTRAIN_BACKEND (gloo | nccl).
struct ProcessGroupOptions {
  /// How long every rank may take to reach the rendezvous (torch: `init_process_group(timeout=)`
  /// covers both; we split them). Default 60 s.
  std::chrono::milliseconds join_timeout{std::chrono::seconds(60)};
  /// How long one collective may wait for its peers before it fails. Default 30 min.
  std::chrono::milliseconds collective_timeout{std::chrono::minutes(30)};
  /// "gloo" (CPU tensors), "nccl" (CUDA tensors; only in DIFFTRAIN_CUDA builds) or "auto"
  /// (nccl when built with it and CUDA is available, else gloo).
  std::string backend = "auto";

  /// Applies the DIFFTRAIN_* environment overrides to these options.
  ProcessGroupOptions with_env_overrides() const;
};

/// A rendezvous store plus a c10d process group over every rank of the job.
/// A world of one has neither: collectives on it are local no-ops and nothing touches the network.
/// torch: `torch.distributed.init_process_group("gloo", init_method="env://")`.
class ProcessGroup {
 public:
  /// Joins the group described by `info`: opens the store (FileStore when `info.store_file` is
  /// set, else TCPStore at MASTER_ADDR:MASTER_PORT, hosted by rank 0 unless the launcher hosts it),
  /// waits for every rank (naming the missing ones on timeout) and connects the backend.
  /// Throws difftrain::Error with rank, world size, address and what to check.
  ProcessGroup(RendezvousInfo info, ProcessGroupOptions options = {});
  /// Joins through a store the caller made (e.g. a c10d HashStore shared by ranks that are
  /// threads of one process, in tests). Backend sockets bind to 127.0.0.1.
  ProcessGroup(RendezvousInfo info, ProcessGroupOptions options,
               c10::intrusive_ptr<c10d::Store> store);
  ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int rank() const { return info_.rank; }
  int size() const { return info_.world_size; }
  const RendezvousInfo& info() const { return info_; }
  const ProcessGroupOptions& options() const { return options_; }
  /// "gloo", "nccl", or "local" for a world of one.
  std::string backend_name() const;
  /// The address this rank's backend sockets are bound to ("127.0.0.1" on one machine).
  const std::string& bind_address() const { return bind_address_; }
  /// Host (bind address) of every rank, gathered at join.
  const std::vector<std::string>& peer_hosts() const { return peer_hosts_; }

  /// The c10d group; only for size() > 1.
  compat::C10dBackend& backend();
  /// The rendezvous store (keys under this group's prefix); only for size() > 1.
  c10d::Store& store();

  /// Waits for `work` of collective `op`. On failure throws difftrain::Error that names this rank,
  /// the operation, how long it waited and which peers no longer answer.
  void wait(const c10::intrusive_ptr<c10d::Work>& work, const std::string& op);

  /// "rank 1/4".
  std::string describe() const;
  /// The shared-memory all-reduce when every rank runs on this machine (Gloo groups only;
  /// DIFFTRAIN_SHM_ALLREDUCE=0 turns it off), else nullptr. Float sums and means of contiguous
  /// CPU tensors go through it; everything else through backend().
  ShmAllReduce* shm() const { return shm_.get(); }

 private:
  void open_store();
  void wrap_store(c10::intrusive_ptr<c10d::Store> base);
  void join();
  void connect_backend();
  std::string probe_lost_ranks();
  /// Posts this rank's phase (core/phase.h) to the store whenever it changes.
  void post_phases();
  /// "rank 0 is saving checkpoint-7 (for 3.2 s)" for every other rank with a phase, or
  /// "gave_up:rank 1 stopped waiting for this rank (...)" when one timed out waiting on it.
  std::string peers_at_work();

  RendezvousInfo info_;
  ProcessGroupOptions options_;
  std::string bind_address_;
  std::vector<std::string> peer_hosts_;
  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<compat::C10dBackend> backend_;
  int failures_ = 0;
  int phase_listener_ = 0;
  std::unique_ptr<ShmAllReduce> shm_;
};

/// Joins the job this process belongs to (detect_rendezvous() + ProcessGroup) once, makes it the
/// default group for the collectives, sets the logger's rank and the intra-op thread count
/// (DIFFTRAIN_NUM_THREADS, set by `difftrain launch`). Later calls return the same group.
/// The default group lives until the process exits (never destroyed, so a broken peer cannot
/// make exit hang).
ProcessGroup& init_process_group(const ProcessGroupOptions& options = {});

/// The default group; throws difftrain::Error when init_process_group() was not called.
ProcessGroup& default_group();

/// True once init_process_group() succeeded.
bool is_initialized();

/// at::set_num_threads(threads) unless LibTorch already runs that many. Each call of
/// at::set_num_threads also re-creates LibTorch's pthreadpool (kept for QNNPACK/XNNPACK, which
/// training never uses), whose new threads spin for about 30 ms before they sleep; and once it has
/// been called, the first parallel region of every new thread calls it again. A rank set up with
/// three calls lost 100+ ms of CPU to those spinning threads during its first micro-batch.
void set_intra_op_threads(int threads);

/// Sets LibTorch's intra-op thread count: DIFFTRAIN_NUM_THREADS (set by `difftrain launch`), else
/// OMP_NUM_THREADS, else cores / `local_processes`. Returns the thread count in force.
int configure_threads(int local_processes = 1);

/// Tunes glibc's allocator for tensor workloads (called by configure_threads()): blocks up to
/// 32 MiB come from the heap rather than a fresh mmap per allocation, and freed memory up to
/// 1 GiB stays mapped, so repeated steps stop paying a page fault per page of every activation
/// (4x faster sampling at 16 images per batch here). DIFFTRAIN_MALLOC_TUNING=0 keeps glibc's
/// defaults. Returns whether the settings were applied.
bool configure_allocator();

}  // namespace difftrain::distributed
