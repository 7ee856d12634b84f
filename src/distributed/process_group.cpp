#include "difftrain/distributed/process_group.h"

#include "difftrain/core/error.h"
#include "difftrain/core/log.h"
#include "difftrain/core/phase.h"
#include "difftrain/core/torch_compat.h"
#include "difftrain/distributed/net.h"
#include "difftrain/distributed/shm_allreduce.h"
#include "difftrain/distributed/store_util.h"

#include <ATen/Parallel.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef DIFFTRAIN_WITH_NCCL
#include <c10/cuda/CUDAFunctions.h>
#include <torch/cuda.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <fmt/format.h>

#include <malloc.h>

#include <algorithm>
#include <cstdlib>
#include <future>
#include <thread>

namespace difftrain::distributed {

namespace {

void check_backend_option(const std::string& backend) {
  if (backend != "auto" && backend != "gloo" && backend != "nccl") {
    throw Error("unknown backend '" + backend + "': use gloo, nccl or auto");
  }
#ifndef DIFFTRAIN_WITH_NCCL
  if (backend == "nccl") {
    throw Error(
        "backend nccl needs a difftrain built with -DDIFFTRAIN_CUDA=ON against a CUDA "
        "LibTorch; use gloo (the default) on this build");
  }
#endif
}

using Clock = std::chrono::steady_clock;

double seconds(std::chrono::milliseconds ms) { return ms.count() / 1000.0; }

std::string join_ranks(const std::vector<int>& ranks) {
  std::string out;
  for (size_t i = 0; i < ranks.size(); ++i) out += (i ? ", " : "") + std::to_string(ranks[i]);
  return out;
}

std::optional<long> env_seconds(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return std::nullopt;
  char* end = nullptr;
  const double parsed = std::strtod(value, &end);
  if (end == value || *end != '\0' || parsed <= 0) {
    throw Error(std::string(name) + "='" + value + "' is not a positive number of seconds");
  }
  return static_cast<long>(parsed * 1000);
}

}  // namespace

ProcessGroupOptions ProcessGroupOptions::with_env_overrides() const {
  ProcessGroupOptions out = *this;
  if (auto ms = env_seconds("DIFFTRAIN_JOIN_TIMEOUT"))
    out.join_timeout = std::chrono::milliseconds(*ms);
  if (auto ms = env_seconds("DIFFTRAIN_COLLECTIVE_TIMEOUT")) {
    out.collective_timeout = std::chrono::milliseconds(*ms);
  }
  if (const char* backend = std::getenv("DIFFTRAIN_BACKEND")) {
    if (*backend) out.backend = backend;
  }
  return out;
}

ProcessGroup::ProcessGroup(RendezvousInfo info, ProcessGroupOptions options)
    : info_(std::move(info)), options_(std::move(options)) {
  check_backend_option(options_.backend);
  if (info_.world_size == 1) {
    bind_address_ = "";
    peer_hosts_ = {"local"};
    return;
  }
  if (!info_.store_file.empty() || is_loopback_host(info_.master_addr)) {
    // One machine: every socket stays on loopback.
    bind_address_ = "127.0.0.1";
  } else if (const char* iface = std::getenv("GLOO_SOCKET_IFNAME"); iface && *iface) {
    bind_address_ = std::string("interface ") + iface;
  } else {
    try {
      bind_address_ = local_address_towards(info_.master_addr, info_.master_port);
    } catch (const Error& e) {
      throw Error(describe() + " (rendezvous " + info_.store_description() + "): " + e.what());
    }
  }
  open_store();
  join();
  connect_backend();
  post_phases();
}

ProcessGroup::ProcessGroup(RendezvousInfo info, ProcessGroupOptions options,
                           c10::intrusive_ptr<c10d::Store> store)
    : info_(std::move(info)), options_(std::move(options)) {
  check_backend_option(options_.backend);
  // A world of one needs no backend, except where NCCL is asked for by name: then a one-rank
  // NCCL communicator is made, which is how one GPU tests the NCCL path.
  if (info_.world_size == 1 && options_.backend != "nccl") {
    peer_hosts_ = {"local"};
    return;
  }
  bind_address_ = "127.0.0.1";
  wrap_store(std::move(store));
  join();
  post_phases();
  connect_backend();
}

ProcessGroup::~ProcessGroup() {
  if (phase_listener_ != 0) core::remove_phase_listener(phase_listener_);
}

namespace {
int64_t wall_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}
}  // namespace

void ProcessGroup::post_phases() {
  // What this rank does outside the training loop (core/phase.h), in the store: a peer whose
  // collective times out reads it and names the slow rank's work instead of guessing.
  auto store = store_;
  const std::string key = "phase/" + std::to_string(info_.rank);
  phase_listener_ = core::add_phase_listener([store, key](const std::string& phase) {
    store->set(key, to_bytes(std::to_string(wall_ms()) + "\t" + phase));
  });
  const std::string now = core::phase();
  if (!now.empty()) store->set(key, to_bytes(std::to_string(wall_ms()) + "\t" + now));
}

std::string ProcessGroup::peers_at_work() {
  // Read on a thread with a deadline: the store may be the thing that is gone.
  auto store = store_;
  const int rank = info_.rank;
  const int world = info_.world_size;
  auto result = std::make_shared<std::promise<std::string>>();
  auto future = result->get_future();
  std::thread([store, rank, world, result]() {
    std::string gave_up, busy;
    try {
      for (int r = 0; r < world; ++r) {
        if (r == rank) continue;
        const std::string quit = "gave_up/" + std::to_string(r);
        if (store->check({quit})) {
          gave_up += fmt::format("{}rank {} stopped waiting for this rank ({})",
                                 gave_up.empty() ? "" : "; ", r, from_bytes(store->get(quit)));
        }
        const std::string key = "phase/" + std::to_string(r);
        if (!store->check({key})) continue;
        const std::string value = from_bytes(store->get(key));
        const auto tab = value.find('\t');
        if (tab == std::string::npos || tab + 1 == value.size()) continue;
        const double since = (wall_ms() - std::stoll(value.substr(0, tab))) / 1000.0;
        busy += fmt::format("{}rank {} is {} (for {:.1f} s)", busy.empty() ? "" : "; ", r,
                            value.substr(tab + 1), since);
      }
    } catch (const std::exception&) {
      // Whatever could be read is said; the lost-rank probe reports an unreachable store.
    }
    result->set_value(!gave_up.empty() ? "gave_up:" + gave_up : busy);
  }).detach();
  if (future.wait_for(std::chrono::seconds(5)) != std::future_status::ready) return "";
  return future.get();
}

std::string ProcessGroup::describe() const {
  return fmt::format("rank {}/{}", info_.rank, info_.world_size);
}

std::string ProcessGroup::backend_name() const {
  if (!backend_) return "local";
  return backend_->getBackendName();
}

compat::C10dBackend& ProcessGroup::backend() {
  if (!backend_) throw Error("a world of one rank has no c10d process group");
  return *backend_;
}

c10d::Store& ProcessGroup::store() {
  if (!store_) throw Error("a world of one rank has no rendezvous store");
  return *store_;
}

void ProcessGroup::open_store() {
  c10::intrusive_ptr<c10d::Store> base;
  const std::string where = info_.store_description();
  if (!info_.store_file.empty()) {
    try {
      base = c10::make_intrusive<c10d::FileStore>(info_.store_file, info_.world_size);
    } catch (const std::exception& e) {
      throw Error(
          fmt::format("{} could not open the rendezvous file {}: {}: is the launcher's "
                      "directory still there?",
                      describe(), info_.store_file, first_line(e)));
    }
  } else {
    c10d::TCPStoreOptions opts;
    opts.port = static_cast<std::uint16_t>(info_.master_port);
    opts.isServer = info_.rank == 0 && !info_.store_hosted;
    opts.waitWorkers = false;
    opts.timeout = options_.join_timeout;
    compat::use_classic_tcpstore(opts, 0);
    try {
      base = c10::make_intrusive<c10d::TCPStore>(info_.master_addr, opts);
    } catch (const std::exception& e) {
      if (opts.isServer) {
        throw Error(
            fmt::format("{} could not host the rendezvous store on port {}: {}: is the "
                        "port in use? pick another MASTER_PORT / --main_process_port",
                        describe(), info_.master_port, first_line(e)));
      }
      throw Error(
          fmt::format("{} could not reach the rendezvous at {} within {:g} s: is rank 0 "
                      "(or the main machine's launcher) started, is the port open? ({})",
                      describe(), where, seconds(options_.join_timeout), first_line(e)));
    }
  }
  wrap_store(std::move(base));
}

void ProcessGroup::wrap_store(c10::intrusive_ptr<c10d::Store> base) {
  base->setTimeout(options_.join_timeout);
  // Keys of each restart live apart, so a restarted group never reads its predecessor's.
  store_ = c10::make_intrusive<c10d::PrefixStore>(
      "difftrain/gen" + std::to_string(info_.restart_count), base);
}

void ProcessGroup::join() {
  const std::string my_host = bind_address_ + " (" + host_name() + ")";
  std::vector<std::string> keys;
  for (int r = 0; r < info_.world_size; ++r) keys.push_back("joined/" + std::to_string(r));
  try {
    // Claim this rank's place first. A second job started on the same MASTER_ADDR:MASTER_PORT
    // reaches the first job's store: without the claim its rank would overwrite the first job's
    // key, find every rank "joined" and wait forever in the backend's connect to strangers.
    const auto claims = store_->add("claimed/" + std::to_string(info_.rank), 1);
    if (claims != 1) {
      throw Error(
          fmt::format("{}: rank {} of the rendezvous at {} is already taken: another job uses this "
                      "MASTER_ADDR:MASTER_PORT (give each job its own port: MASTER_PORT or "
                      "--main_process_port), or two processes were started with RANK={}",
                      describe(), info_.rank, info_.store_description(), info_.rank));
    }
    store_->set(keys[static_cast<size_t>(info_.rank)], to_bytes(my_host));
    try {
      store_->wait(keys, options_.join_timeout);
    } catch (const std::exception&) {
      // Timed out (or the store failed, which the checks below rethrow): name who is missing.
      std::vector<int> missing;
      for (int r = 0; r < info_.world_size; ++r) {
        if (!store_->check({keys[static_cast<size_t>(r)]})) missing.push_back(r);
      }
      if (missing.empty()) throw;
      throw Error(fmt::format(
          "{}: timed out after {:g} s waiting for rank(s) {} to join the rendezvous at {}: are "
          "they started, with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE={}?",
          describe(), seconds(options_.join_timeout), join_ranks(missing),
          info_.store_description(), info_.world_size));
    }
    peer_hosts_.clear();
    for (const auto& key : keys) {
      const auto value = store_->get(key);
      peer_hosts_.emplace_back(value.begin(), value.end());
    }
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw Error(fmt::format("{} lost the rendezvous at {} while joining: {}", describe(),
                            info_.store_description(), first_line(e)));
  }
}

void ProcessGroup::connect_backend() {
  std::string backend = options_.backend;
#ifdef DIFFTRAIN_WITH_NCCL
  if (backend == "auto") {
    // NCCL needs a GPU of its own per rank; ranks that share a GPU (or have none) use Gloo,
    // which reduces CUDA tensors too.
    const auto gpus = torch::cuda::is_available() ? torch::cuda::device_count() : 0;
    backend = gpus >= static_cast<size_t>(info_.local_world_size) ? "nccl" : "gloo";
    if (gpus > 0 && backend == "gloo" && info_.rank == 0) {
      log::warn(
          "{} local ranks share {} GPU(s): NCCL needs one GPU per rank, so the backend is "
          "gloo (set DIFFTRAIN_BACKEND to choose)",
          info_.local_world_size, gpus);
    }
  }
  if (backend == "nccl") {
    auto opts = c10d::ProcessGroupNCCL::Options::create();
    opts->timeout = options_.collective_timeout;
    auto pg_store = c10::make_intrusive<c10d::PrefixStore>("nccl", store_);
    backend_ =
        c10::make_intrusive<c10d::ProcessGroupNCCL>(pg_store, info_.rank, info_.world_size, opts);
    return;
  }
#else
  if (backend == "auto") backend = "gloo";
#endif
  auto opts = c10d::ProcessGroupGloo::Options::create(options_.collective_timeout);
  try {
    if (bind_address_.rfind("interface ", 0) == 0) {
      opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(
          bind_address_.substr(std::string("interface ").size())));
    } else {
      opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(bind_address_));
    }
    opts->threads = 2;
    auto pg_store = c10::make_intrusive<c10d::PrefixStore>("gloo", store_);
    backend_ =
        c10::make_intrusive<c10d::ProcessGroupGloo>(pg_store, info_.rank, info_.world_size, opts);
  } catch (const std::exception& e) {
    throw Error(
        fmt::format("{} could not connect the gloo group (bound to {}, rendezvous {}): {}: "
                    "check that every machine can reach the others' addresses",
                    describe(), bind_address_, info_.store_description(), first_line(e)));
  }
  try {
    shm_ = ShmAllReduce::create(*store_, info_.rank, info_.world_size, options_.collective_timeout);
    if (shm_) {
      log::info(
          "all {} ranks are on this machine: float all-reduces go through shared memory "
          "({:.0f} MiB segment; DIFFTRAIN_SHM_ALLREDUCE=0 keeps Gloo)",
          info_.world_size, shm_->segment_bytes() / 1048576.0);
    }
  } catch (const std::exception& e) {
    throw Error(
        fmt::format("{} could not agree on the shared-memory all-reduce through the "
                    "rendezvous {}: {}",
                    describe(), info_.store_description(), first_line(e)));
  }
}

std::string ProcessGroup::probe_lost_ranks() {
  // Every rank that sees a collective fail checks in under the same key; whoever does not check
  // in within a few seconds is the one that is gone. The store may itself be behind the lost link,
  // so the probe runs on a thread with a deadline and is abandoned if the store does not answer.
  const int index = failures_++;
  const auto budget =
      std::min<std::chrono::milliseconds>(options_.join_timeout, std::chrono::seconds(10));
  auto store = store_;
  const int rank = info_.rank;
  const int world = info_.world_size;
  auto result = std::make_shared<std::promise<std::string>>();
  auto future = result->get_future();
  std::thread([store, rank, world, index, budget, result]() {
    try {
      const std::string prefix = "alive/" + std::to_string(index) + "/";
      store->set(prefix + std::to_string(rank), to_bytes("1"));
      const auto deadline = Clock::now() + budget;
      std::vector<int> missing;
      do {
        missing.clear();
        for (int r = 0; r < world; ++r) {
          if (!store->check({prefix + std::to_string(r)})) missing.push_back(r);
        }
        if (missing.empty()) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      } while (Clock::now() < deadline);
      result->set_value(missing.empty() ? "" : "missing:" + join_ranks(missing));
    } catch (const std::exception& e) {
      result->set_value("store:" + first_line(e));
    }
  }).detach();
  std::string outcome = "store:no answer";
  if (future.wait_for(budget + std::chrono::seconds(2)) == std::future_status::ready) {
    outcome = future.get();
  }
  if (outcome.empty()) return "every rank still answers the store: a peer may be slow or stuck";
  if (outcome.rfind("missing:", 0) == 0) {
    const std::string ranks = outcome.substr(8);
    std::string hosts;
    // Name the hosts of the missing ranks when we know them.
    for (size_t pos = 0; pos < ranks.size();) {
      const auto comma = ranks.find(',', pos);
      const int r = std::stoi(ranks.substr(pos, comma - pos));
      if (r < static_cast<int>(peer_hosts_.size())) {
        hosts += (hosts.empty() ? "" : ", ") + std::to_string(r) + " on " + peer_hosts_[r];
      }
      pos = comma == std::string::npos ? ranks.size() : comma + 2;
    }
    return "lost rank(s) " + ranks + " — no answer from " + hosts +
           ": that process is stalled, stopped or dead, or its machine or link is down (see its "
           "log)";
  }
  // The store itself is unreachable: the machine that hosts it (rank 0's) is the lost one.
  std::vector<int> main_ranks;
  for (int r = 0; r < std::min(info_.local_world_size, info_.world_size); ++r)
    main_ranks.push_back(r);
  return "lost rank(s) " + join_ranks(main_ranks) + " — the rendezvous store at " +
         info_.store_description() + " no longer answers (" + outcome.substr(6) +
         "): the main machine or the link to it is down";
}

void ProcessGroup::wait(const c10::intrusive_ptr<c10d::Work>& work, const std::string& op) {
  const auto start = Clock::now();
  try {
    work->wait();
  } catch (const std::exception& e) {
    const double waited = std::chrono::duration<double>(Clock::now() - start).count();
    const std::string cause = first_line(e);
    const double timeout = seconds(options_.collective_timeout);
    const std::string advice = fmt::format(
        "if that work is expected to take this long, raise the collective timeout ({:g} s now: "
        "difftrain launch --collective_timeout S, or DIFFTRAIN_COLLECTIVE_TIMEOUT)",
        timeout);
    // Timed out here: say so in the store first, so the rank this one gave up on does not
    // report a mystery when its own next collective fails.
    const bool timed_out = waited >= 0.9 * timeout;
    if (timed_out && store_) {
      try {
        const std::string mine = core::phase();
        store_->set("gave_up/" + std::to_string(info_.rank),
                    to_bytes(fmt::format("after {:.1f} s in {}{}, its collective timeout", waited,
                                         op, mine.empty() ? "" : " while " + mine)));
      } catch (const std::exception&) {
      }
    }
    const std::string work_now = store_ ? peers_at_work() : "";
    if (work_now.rfind("gave_up:", 0) == 0) {
      const std::string mine = core::phase();
      throw Error(fmt::format("{}: {} failed after {:.1f} s ({}): {}{}: {}", describe(), op, waited,
                              cause, work_now.substr(8),
                              mine.empty() ? "" : ", while this rank was " + mine, advice));
    }
    if (timed_out && !work_now.empty()) {
      throw Error(fmt::format("{}: {} timed out after {:.1f} s ({}): {}: {}", describe(), op,
                              waited, cause, work_now, advice));
    }
    const std::string lost = probe_lost_ranks();
    throw Error(
        fmt::format("{}: {} failed after {:.1f} s ({}): {}", describe(), op, waited, cause, lost));
  }
}

// ------------------------------------------------------------------ default group

namespace {
ProcessGroup* g_default = nullptr;
std::mutex g_default_mutex;
}  // namespace

void set_intra_op_threads(int threads) {
  if (at::get_num_threads() != threads) at::set_num_threads(threads);
}

int configure_threads(int local_processes) {
  const char* value = std::getenv("DIFFTRAIN_NUM_THREADS");
  if (value == nullptr || *value == '\0') value = std::getenv("OMP_NUM_THREADS");
  if (value == nullptr || *value == '\0') {
    // Nothing said: share this machine's cores among its ranks (LibTorch would otherwise keep
    // whatever its OpenMP runtime guessed, often a single thread).
    const unsigned cores = std::thread::hardware_concurrency();
    set_intra_op_threads(
        std::max(1, static_cast<int>(cores == 0 ? 1 : cores) / std::max(1, local_processes)));
  } else {
    char* end = nullptr;
    const long threads = std::strtol(value, &end, 10);
    if (end == value || *end != '\0' || threads < 1) {
      throw Error(std::string("DIFFTRAIN_NUM_THREADS/OMP_NUM_THREADS='") + value +
                  "' is not a positive thread count");
    }
    set_intra_op_threads(static_cast<int>(threads));
  }
  configure_allocator();
  return at::get_num_threads();
}

bool configure_allocator() {
  const char* value = std::getenv("DIFFTRAIN_MALLOC_TUNING");
  if (value != nullptr && std::string(value) == "0") return false;
  // glibc serves blocks above its mmap threshold (128 KiB at start) with a fresh mmap each time,
  // and every page of it faults and is zeroed on first touch. A training or sampling step
  // allocates the same activation sizes again and again, so keep them in the heap instead: blocks
  // up to 32 MiB (glibc's maximum) come from the heap, and up to 1 GiB of freed heap stays mapped
  // for the next step.
  const bool ok =
      mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1 && mallopt(M_TRIM_THRESHOLD, 1 << 30) == 1;
  return ok;
}

ProcessGroup& init_process_group(const ProcessGroupOptions& options) {
  std::lock_guard<std::mutex> lock(g_default_mutex);
  if (g_default) return *g_default;
  const auto info = detect_rendezvous();
  log::init(info.rank, info.world_size);
  configure_threads(info.local_world_size);
#ifdef DIFFTRAIN_WITH_NCCL
  // One GPU per local rank, as torchrun users expect (cuda:LOCAL_RANK).
  if (torch::cuda::is_available()) {
    c10::cuda::set_device(
        static_cast<c10::DeviceIndex>(info.local_rank % torch::cuda::device_count()));
  }
#endif
  // Deliberately never deleted: see the header.
  g_default = new ProcessGroup(info, options.with_env_overrides());
  return *g_default;
}

ProcessGroup& default_group() {
  std::lock_guard<std::mutex> lock(g_default_mutex);
  if (!g_default) {
    throw Error("no process group yet: call difftrain::distributed::init_process_group() first");
  }
  return *g_default;
}

bool is_initialized() {
  std::lock_guard<std::mutex> lock(g_default_mutex);
  return g_default != nullptr;
}

}  // namespace difftrain::distributed
