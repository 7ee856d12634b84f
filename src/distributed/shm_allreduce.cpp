#include "difftrain/distributed/shm_allreduce.h"

#include "difftrain/core/error.h"
#include "difftrain/distributed/store_util.h"

#include <fmt/format.h>

#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>

namespace difftrain::distributed {

namespace {

constexpr uint64_t kMagic = 0x64667473686d3031ULL;  // "dftshm01"
constexpr int kMaxWorld = 64;
constexpr int64_t kAlign = 4096;
constexpr int64_t kSegmentAlign = 16;  // elements: rank segments start on 64-byte lines (float)

using Clock = std::chrono::steady_clock;

std::string namespace_of(const char* link) {
  char target[128] = {0};
  const ssize_t n = ::readlink(link, target, sizeof(target) - 1);
  return n > 0 ? std::string(target, static_cast<size_t>(n)) : std::string("?");
}

// One kernel (boot id) and one network and IPC namespace: ranks in other network namespaces are
// treated as other machines even on this kernel (containers, and the two-machine tests made of
// namespaces, whose link must be what carries their collectives).
std::string machine_id() {
  char host[256] = {0};
  ::gethostname(host, sizeof(host) - 1);
  std::string boot;
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::getline(in, boot);
  return std::string(host) + "/" + boot + "/" + namespace_of("/proc/self/ns/net") + "/" +
         namespace_of("/proc/self/ns/ipc");
}

std::string get_string(c10d::Store& store, const std::string& key) {
  const auto bytes = store.get(key);
  return std::string(bytes.begin(), bytes.end());
}

long futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  return ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

bool reached(uint32_t value, uint32_t target) { return static_cast<int32_t>(value - target) >= 0; }

int64_t round_up(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

// Start of rank r's segment of m elements split over w ranks.
int64_t segment_start(int64_t m, int r, int w) {
  return std::min(m, round_up(m * r / w, kSegmentAlign));
}

class ShmWork : public c10d::Work {
 public:
  void done(std::exception_ptr error) { finish(std::move(error)); }
};

}  // namespace

struct ShmAllReduce::Header {
  uint64_t magic;
  int32_t world;
  int32_t unused;
  alignas(64) std::atomic<uint32_t> arrivals;  // futex word: barriers are multiples of world
  alignas(64) int32_t pids[kMaxWorld];
};

struct ShmAllReduce::Job {
  torch::Tensor tensor;
  c10::intrusive_ptr<ShmWork> work;
};

std::unique_ptr<ShmAllReduce> ShmAllReduce::create(c10d::Store& store, int rank, int world,
                                                   std::chrono::milliseconds timeout,
                                                   int64_t chunk_bytes) {
  // 1. Agree that every rank is on this machine and willing.
  const std::string me = !enabled_by_environment() || world > kMaxWorld ? "no" : machine_id();
  store.set("shm/host/" + std::to_string(rank), to_bytes(me));
  bool usable = true;
  for (int r = 0; r < world; ++r) {
    const std::string other = get_string(store, "shm/host/" + std::to_string(r));
    usable = usable && other != "no" && other == me;
  }
  if (!usable) return nullptr;

  // Slots shrink with the world so the segment stays under ~64 MiB.
  chunk_bytes = std::max<int64_t>(
      64 << 10, std::min<int64_t>(chunk_bytes, (int64_t{64} << 20) / (world + 1)));
  chunk_bytes = chunk_bytes / kAlign * kAlign;
  const int64_t bytes = round_up(sizeof(Header), kAlign) + (world + 1) * chunk_bytes;

  // 2. Rank 0 makes the segment and names it; 3. everyone maps it and says whether it could.
  std::string name;
  int fd = -1;
  if (rank == 0) {
    std::random_device seed;
    name = fmt::format("/difftrain-{}-{:08x}", ::getpid(), seed());
    fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    // Reserve the pages now: a tmpfs smaller than the segment (a container's 64 MiB /dev/shm)
    // then fails here, and the group keeps Gloo, instead of a SIGBUS at the first touch.
    if (fd >= 0 && (::ftruncate(fd, bytes) != 0 || ::posix_fallocate(fd, 0, bytes) != 0)) {
      ::close(fd);
      ::shm_unlink(name.c_str());
      fd = -1;
    }
    store.set("shm/name", to_bytes(fd >= 0 ? name : std::string("-")));
  } else {
    name = get_string(store, "shm/name");
    if (name != "-") fd = ::shm_open(name.c_str(), O_RDWR, 0600);
  }
  void* base = MAP_FAILED;
  if (fd >= 0) {
    base = ::mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ::close(fd);
  }
  if (base != MAP_FAILED) {
    auto* header = static_cast<Header*>(base);
    if (rank == 0) {
      header->magic = kMagic;
      header->world = world;
    }
    header->pids[rank] = static_cast<int32_t>(::getpid());
  }
  store.set("shm/open/" + std::to_string(rank), to_bytes(base != MAP_FAILED ? "1" : "0"));
  bool all_open = true;
  for (int r = 0; r < world; ++r) {
    all_open = all_open && get_string(store, "shm/open/" + std::to_string(r)) == "1";
  }
  // Every rank has mapped it (or given up): the name can go, so nothing outlives the job.
  if (rank == 0 && name != "-") ::shm_unlink(name.c_str());
  if (!all_open) {
    if (base != MAP_FAILED) ::munmap(base, static_cast<size_t>(bytes));
    return nullptr;
  }
  return std::unique_ptr<ShmAllReduce>(
      new ShmAllReduce(rank, world, timeout, chunk_bytes, base, bytes));
}

ShmAllReduce::ShmAllReduce(int rank, int world, std::chrono::milliseconds timeout,
                           int64_t chunk_bytes, void* base, int64_t bytes)
    : rank_(rank),
      world_(world),
      timeout_(timeout),
      chunk_bytes_(chunk_bytes),
      base_(base),
      segment_bytes_(bytes),
      header_(static_cast<Header*>(base)) {
  worker_ = std::thread([this] { run(); });
}

ShmAllReduce::~ShmAllReduce() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;  // also ends a barrier that waits for a peer
  }
  cv_.notify_all();
  if (worker_.joinable()) worker_.join();
  ::munmap(base_, static_cast<size_t>(segment_bytes_));
}

bool ShmAllReduce::enabled_by_environment() {
  const char* v = std::getenv("DIFFTRAIN_SHM_ALLREDUCE");
  return v == nullptr ||
         (std::strcmp(v, "0") != 0 && std::strcmp(v, "false") != 0 && std::strcmp(v, "off") != 0);
}

bool ShmAllReduce::accepts(const torch::Tensor& tensor) {
  return tensor.defined() && tensor.device().is_cpu() && tensor.is_contiguous() &&
         !tensor.is_sparse() &&
         (tensor.scalar_type() == torch::kFloat32 || tensor.scalar_type() == torch::kFloat64);
}

c10::intrusive_ptr<c10d::Work> ShmAllReduce::launch(torch::Tensor tensor) {
  auto job = std::make_shared<Job>();
  job->tensor = std::move(tensor);
  job->work = c10::make_intrusive<ShmWork>();
  auto work = job->work;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(std::move(job));
  }
  cv_.notify_one();
  return work;
}

void ShmAllReduce::run() {
  for (;;) {
    std::shared_ptr<Job> job;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, nothing left
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    try {
      if (stopping_) throw Error("the process group is shutting down");
      if (!broken_.empty()) throw Error(broken_);
      reduce(job->tensor);
      job->work->done(nullptr);
    } catch (const std::exception& e) {
      if (broken_.empty()) broken_ = std::string("an earlier all-reduce failed: ") + e.what();
      job->work->done(std::current_exception());
    }
    job.reset();  // drop the tensor on this thread before waiting again
  }
}

void ShmAllReduce::reduce(torch::Tensor& tensor) {
  if (tensor.scalar_type() == torch::kFloat64) {
    reduce_typed(tensor.data_ptr<double>(), tensor.numel());
  } else {
    reduce_typed(tensor.data_ptr<float>(), tensor.numel());
  }
}

template <typename T>
void ShmAllReduce::reduce_typed(T* data, int64_t numel) {
  const int64_t per_chunk = chunk_bytes_ / static_cast<int64_t>(sizeof(T));
  char* slots = static_cast<char*>(base_) + round_up(sizeof(Header), kAlign);
  auto slot = [&](int r) { return reinterpret_cast<T*>(slots + r * chunk_bytes_); };
  T* result = slot(world_);
  for (int64_t offset = 0; offset < numel; offset += per_chunk) {
    const int64_t m = std::min(per_chunk, numel - offset);
    std::memcpy(slot(rank_), data + offset, static_cast<size_t>(m) * sizeof(T));
    barrier();  // every slot is written
    const int64_t lo = segment_start(m, rank_, world_), hi = segment_start(m, rank_ + 1, world_);
    if (lo < hi) {
      // Rank order, one element at a time: the same sum on every rank.
      const T* s0 = slot(0);
      const T* s1 = slot(1);
      for (int64_t j = lo; j < hi; ++j) result[j] = s0[j] + s1[j];
      for (int r = 2; r < world_; ++r) {
        const T* s = slot(r);
        for (int64_t j = lo; j < hi; ++j) result[j] += s[j];
      }
    }
    barrier();  // every segment of the result is written
    std::memcpy(data + offset, result, static_cast<size_t>(m) * sizeof(T));
    // No third barrier: a rank writes its slot again only after the next chunk's first barrier
    // would let anyone past, and it reaches that barrier only after its own copy-out above; the
    // result is written again only after that first barrier, which needs every rank's copy-out.
  }
}

void ShmAllReduce::barrier() {
  ++barriers_;
  const uint32_t target = barriers_ * static_cast<uint32_t>(world_);  // modulo 2^32 on purpose
  std::atomic<uint32_t>* word = &header_->arrivals;
  const uint32_t now = word->fetch_add(1, std::memory_order_acq_rel) + 1;
  if (now == target) {
    futex(word, FUTEX_WAKE, INT_MAX, nullptr);
    return;
  }
  for (int spin = 0; spin < 2000; ++spin) {
    if (reached(word->load(std::memory_order_acquire), target)) return;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }
  const auto start = Clock::now();
  auto next_check = start + std::chrono::milliseconds(100);
  for (;;) {
    const uint32_t value = word->load(std::memory_order_acquire);
    if (reached(value, target)) return;
    const timespec slice{0, 20 * 1000 * 1000};  // 20 ms, then look at the peers again
    futex(word, FUTEX_WAIT, value, &slice);
    const auto t = Clock::now();
    if (t < next_check) continue;
    next_check = t + std::chrono::milliseconds(100);
    if (reached(word->load(std::memory_order_acquire), target)) return;
    if (stopping_)
      throw Error("all-reduce through shared memory: the process group is shutting down");
    for (int r = 0; r < world_; ++r) {
      const pid_t pid = header_->pids[r];
      if (r != rank_ && pid > 0 && ::kill(pid, 0) != 0 && errno == ESRCH) {
        throw Error(fmt::format(
            "all-reduce through shared memory: rank {} (pid {}) exited while rank {} waited for "
            "it; see that rank's log for why",
            r, pid, rank_));
      }
    }
    if (t - start > timeout_) {
      throw Error(fmt::format(
          "all-reduce through shared memory: rank {} waited {:.1f} s for the other ranks "
          "(collective timeout; DIFFTRAIN_COLLECTIVE_TIMEOUT sets it): a peer is stuck or "
          "diverged (did every rank run the same collectives?)",
          rank_, std::chrono::duration<double>(t - start).count()));
    }
  }
}

}  // namespace difftrain::distributed
