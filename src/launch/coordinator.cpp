#include "coordinator.h"

#include "difftrain/core/error.h"
#include "difftrain/core/torch_compat.h"
#include "difftrain/distributed/net.h"
#include "difftrain/distributed/store_util.h"

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <fmt/format.h>

#include <future>
#include <iostream>

namespace difftrain::launch {

namespace {

using Clock = std::chrono::steady_clock;

using distributed::first_line;

// Runs `fn` on its own thread and waits at most `limit`: a store behind a dead link must not
// freeze the launcher. Returns false on timeout or error.
bool bounded(std::function<void()> fn, std::chrono::milliseconds limit) {
  auto done = std::make_shared<std::promise<bool>>();
  auto future = done->get_future();
  std::thread([fn = std::move(fn), done]() {
    try {
      fn();
      done->set_value(true);
    } catch (...) {
      done->set_value(false);
    }
  }).detach();
  return future.wait_for(limit) == std::future_status::ready && future.get();
}

std::string encode(const RemoteAbort& a) {
  return std::string(a.restart ? "restart" : "final") + ":" + std::to_string(a.exit_code) + ":" +
         a.message;
}

RemoteAbort decode(const std::string& s) {
  RemoteAbort a;
  const auto first = s.find(':');
  const auto second = s.find(':', first + 1);
  a.restart = s.substr(0, first) == "restart";
  try {
    a.exit_code = std::stoi(s.substr(first + 1, second - first - 1));
  } catch (...) {
    a.exit_code = 1;
  }
  a.message = second == std::string::npos ? s : s.substr(second + 1);
  return a;
}

c10::intrusive_ptr<c10d::Store> connect(const std::string& host, int port, bool server,
                                        std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<std::uint16_t>(port);
  opts.isServer = server;
  opts.waitWorkers = false;
  opts.timeout = timeout;
  compat::use_classic_tcpstore(opts, 0);
  return c10::make_intrusive<c10d::TCPStore>(host, opts);
}

}  // namespace

Coordinator::Coordinator(const std::string& host, int port, int num_machines, int machine_rank,
                         std::chrono::milliseconds join_timeout)
    : num_machines_(num_machines), machine_rank_(machine_rank) {
  if (machine_rank == 0) {
    try {
      server_ = connect(host, port, true, join_timeout);
    } catch (const std::exception& e) {
      if (std::string(e.what()).find("Address already in use") != std::string::npos) {
        throw Error(fmt::format(
            "machine 0 could not host the rendezvous: port {} is already in use on this "
            "machine; choose another --main_process_port (the same on every machine)",
            port));
      }
      throw Error(
          fmt::format("machine 0 could not host the rendezvous on port {}: {}: is the port "
                      "in use? choose another --main_process_port",
                      port, first_line(e)));
    }
  }
  try {
    main_ = machine_rank == 0 ? server_ : connect(host, port, false, join_timeout);
    watch_ = std::make_shared<Watch>();
    watch_->machine_rank = machine_rank;
    watch_->store = connect(host, port, false, join_timeout);
  } catch (const std::exception& e) {
    throw Error(
        fmt::format("machine {} could not reach the rendezvous at {}:{} within {:g} s: is "
                    "the launcher of machine 0 started, is the port open? ({})",
                    machine_rank, host, port, join_timeout.count() / 1000.0, first_line(e)));
  }
  main_->set("launch/machine/" + std::to_string(machine_rank),
             distributed::to_bytes(distributed::host_name()));
  const auto deadline = Clock::now() + join_timeout;
  while (true) {
    std::string missing;
    for (int m = 0; m < num_machines; ++m) {
      if (!main_->check({"launch/machine/" + std::to_string(m)})) {
        missing += (missing.empty() ? "" : ", ") + std::to_string(m);
      }
    }
    if (missing.empty()) break;
    if (Clock::now() > deadline) {
      throw Error(fmt::format(
          "machine {}: timed out after {:g} s waiting for machine(s) {} to join "
          "the rendezvous at {}:{}: start their launchers with the same "
          "--main_process_ip, --main_process_port and --num_machines {}",
          machine_rank, join_timeout.count() / 1000.0, missing, host, port, num_machines));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  // Later store calls are polls: keep their waits short so a lost link is noticed.
  watch_->store->setTimeout(std::chrono::seconds(5));
  thread_ = std::thread([watch = watch_]() { watch_loop(watch); });
}

Coordinator::~Coordinator() {
  if (!thread_.joinable()) return;
  std::unique_lock<std::mutex> lock(watch_->mutex);
  watch_->stop = true;
  watch_->wake.notify_all();
  // A watcher inside a store call behind a dead link may take its whole store timeout: wait a
  // little, then leave it (it owns what it touches); the process may end under it.
  const bool exited =
      watch_->wake.wait_for(lock, std::chrono::seconds(2), [this]() { return watch_->exited; });
  lock.unlock();
  if (exited) {
    thread_.join();
  } else {
    thread_.detach();
  }
}

void Coordinator::watch(int generation) {
  std::lock_guard<std::mutex> lock(watch_->mutex);
  watch_->abort.reset();
  watch_->generation = generation;
}

std::optional<RemoteAbort> Coordinator::remote_abort() {
  std::lock_guard<std::mutex> lock(watch_->mutex);
  return watch_->abort;
}

void Coordinator::watch_loop(const std::shared_ptr<Watch>& watch) {
  std::unique_lock<std::mutex> lock(watch->mutex);
  while (!watch->stop) {
    const int generation = watch->generation;
    if (generation >= 0 && !watch->store_lost) {
      lock.unlock();
      std::optional<RemoteAbort> value;
      try {
        const std::string key = "launch/gen" + std::to_string(generation) + "/abort";
        if (watch->store->check({key})) {
          value = decode(distributed::from_bytes(watch->store->get(key)));
        }
      } catch (const std::exception& e) {
        watch->store_lost = true;
        lock.lock();
        if (!watch->stop) {
          std::cerr << "difftrain launch: machine " << watch->machine_rank
                    << " lost contact with the rendezvous store (" << first_line(e)
                    << "); the ranks will notice on their next collective\n";
        }
        lock.unlock();
      }
      lock.lock();
      if (value && watch->generation == generation && !watch->abort) watch->abort = value;
    }
    watch->wake.wait_for(lock, std::chrono::milliseconds(200), [&]() { return watch->stop; });
  }
  watch->exited = true;
  watch->wake.notify_all();
}

void Coordinator::post_abort(int generation, const RemoteAbort& abort) {
  auto store = main_;
  const std::string key = "launch/gen" + std::to_string(generation) + "/abort";
  const std::string value = encode(abort);
  bounded([store, key, value]() { store->compareSet(key, {}, distributed::to_bytes(value)); },
          std::chrono::seconds(3));
}

std::optional<RemoteAbort> Coordinator::finish(int generation,
                                               const std::function<bool()>& interrupted) {
  auto store = main_;
  const std::string prefix = "launch/gen" + std::to_string(generation) + "/";
  // Reads a counter without blocking for long; nullopt when the store does not answer.
  auto count = [store, prefix](const std::string& name,
                               int64_t increment) -> std::optional<int64_t> {
    auto value = std::make_shared<std::atomic<int64_t>>(0);
    if (!bounded([store, prefix, name, increment,
                  value]() { *value = store->add(prefix + name, increment); },
                 std::chrono::seconds(5))) {
      return std::nullopt;
    }
    return value->load();
  };
  if (!count("done", 1)) return std::nullopt;
  while (!interrupted()) {
    if (auto abort = remote_abort()) return abort;
    const auto done = count("done", 0);
    if (!done || watch_->store_lost)
      return std::nullopt;  // machine 0 has gone: it saw everyone finish
    if (*done >= num_machines_) {
      count("seen", 1);
      if (machine_rank_ != 0) return std::nullopt;
      // Machine 0 hosts the store: stay up until every launcher has seen the count.
      const auto deadline = Clock::now() + std::chrono::seconds(10);
      while (Clock::now() < deadline) {
        const auto seen = count("seen", 0);
        if (!seen || *seen >= num_machines_) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
      return std::nullopt;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return std::nullopt;
}

}  // namespace difftrain::launch
