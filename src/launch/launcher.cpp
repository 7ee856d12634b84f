#include "difftrain/launch/launcher.h"

#include "coordinator.h"
#include "difftrain/core/env.h"
#include "difftrain/core/error.h"
#include "difftrain/core/exit.h"
#include "difftrain/core/phase.h"
#include "difftrain/distributed/net.h"
#include "difftrain/distributed/process_group.h"
#include "rank_streams.h"

#include <dirent.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <memory>
#include <thread>

extern char** environ;

namespace difftrain::launch {

namespace fs = std::filesystem;

namespace {

using Clock = std::chrono::steady_clock;

// ------------------------------------------------------------------ signals (self-pipe)

int g_signal_pipe[2] = {-1, -1};

void on_signal(int signo) {
  const int saved = errno;
  const unsigned char byte = static_cast<unsigned char>(signo);
  [[maybe_unused]] auto written = write(g_signal_pipe[1], &byte, 1);
  errno = saved;
}

class SignalScope {
 public:
  SignalScope() {
    if (pipe2(g_signal_pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
      throw Error(std::string("difftrain launch: cannot create a pipe: ") + std::strerror(errno));
    }
    struct sigaction action {};
    action.sa_handler = on_signal;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART;
    for (int signo : {SIGCHLD, SIGINT, SIGTERM, SIGHUP}) sigaction(signo, &action, &saved_[signo]);
    struct sigaction ignore {};
    ignore.sa_handler = SIG_IGN;
    sigaction(SIGPIPE, &ignore, &saved_[SIGPIPE]);
  }
  ~SignalScope() {
    for (int signo : {SIGCHLD, SIGINT, SIGTERM, SIGHUP, SIGPIPE})
      sigaction(signo, &saved_[signo], nullptr);
    close(g_signal_pipe[0]);
    close(g_signal_pipe[1]);
    g_signal_pipe[0] = g_signal_pipe[1] = -1;
  }

 private:
  struct sigaction saved_[NSIG] {};
};

std::string signal_name(int signo) {
  const char* abbrev = sigabbrev_np(signo);
  return abbrev ? std::string("SIG") + abbrev : "signal " + std::to_string(signo);
}

// ------------------------------------------------------------------ program lookup

std::string resolve_program(const std::string& name) {
  auto executable = [](const std::string& path) {
    struct stat st {};
    return stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && access(path.c_str(), X_OK) == 0;
  };
  if (name.find('/') != std::string::npos) {
    if (executable(name)) return name;
    throw Error("difftrain launch: cannot run '" + name +
                "': " + (fs::exists(name) ? "it is not an executable file" : "no such file") +
                ": check the path");
  }
  const char* path = std::getenv("PATH");
  std::string dirs = path ? path : "/usr/local/bin:/usr/bin:/bin";
  size_t start = 0;
  while (start <= dirs.size()) {
    const auto colon = dirs.find(':', start);
    std::string dir =
        dirs.substr(start, colon == std::string::npos ? std::string::npos : colon - start);
    if (dir.empty()) dir = ".";
    if (executable(dir + "/" + name)) return dir + "/" + name;
    if (colon == std::string::npos) break;
    start = colon + 1;
  }
  // `difftrain launch difftrain test` works even when difftrain is not installed on PATH.
  if (name == "difftrain") return fs::read_symlink("/proc/self/exe").string();
  throw Error("difftrain launch: program '" + name + "' was not found on PATH: give its path (./" +
              name + ") or install it");
}

// ------------------------------------------------------------------ ranks without exec

bool same_file(const std::string& a, const std::string& b) {
  struct stat sa {
  }, sb{};
  return stat(a.c_str(), &sa) == 0 && stat(b.c_str(), &sb) == 0 && sa.st_dev == sb.st_dev &&
         sa.st_ino == sb.st_ino;
}

// Threads of this process: fork() copies only the calling one, so a rank may run on in the
// forked copy only when there is no other (no lock held by a thread that will not exist there).
int thread_count() {
  DIR* dir = opendir("/proc/self/task");
  if (dir == nullptr) return -1;
  int n = 0;
  while (const dirent* e = readdir(dir)) {
    if (e->d_name[0] != '.') ++n;
  }
  closedir(dir);
  return n;
}

// In a forked rank that will not exec: close what exec would have closed (the launcher's
// close-on-exec pipes of other ranks, its signal pipe), keep what exec keeps.
void close_cloexec_descriptors() {
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return;
  std::vector<int> doomed;
  const int own = dirfd(dir);
  while (const dirent* e = readdir(dir)) {
    if (e->d_name[0] == '.') continue;
    const int fd = std::atoi(e->d_name);
    if (fd <= STDERR_FILENO || fd == own) continue;
    const int flags = fcntl(fd, F_GETFD);
    if (flags >= 0 && (flags & FD_CLOEXEC) != 0) doomed.push_back(fd);
  }
  closedir(dir);
  for (int fd : doomed) close(fd);
}

// ------------------------------------------------------------------ the group

struct Failure {
  int global_rank = -1;
  int exit_code = 0;
  std::string message;
};

class Supervisor {
 public:
  Supervisor(const LaunchOptions& options, std::string program, Coordinator* coordinator)
      : o_(options), program_(std::move(program)), coordinator_(coordinator) {
    local_processes_ = o_.num_processes / o_.num_machines;
    self_program_ = o_.self_main && !env_switch("DIFFTRAIN_LAUNCH_EXEC", false) &&
                    same_file(program_, "/proc/self/exe") && thread_count() == 1;
    threads_ = o_.num_cpu_threads_per_process > 0 ? o_.num_cpu_threads_per_process
                                                  : default_threads_per_process(local_processes_);
    if (o_.num_machines == 1) {
      const char* tmp = std::getenv("TMPDIR");
      const std::string pattern =
          std::string(tmp && *tmp ? tmp : "/tmp") + "/difftrain-rdzv-XXXXXX";
      std::vector<char> buffer(pattern.begin(), pattern.end());
      buffer.push_back('\0');
      // mkdtemp creates the folder with mode 0700: only this user can reach the store.
      if (mkdtemp(buffer.data()) == nullptr) {
        throw Error("difftrain launch: cannot create a private rendezvous folder like " + pattern +
                    ": " + std::strerror(errno) + ": check TMPDIR");
      }
      store_dir_ = buffer.data();
      master_addr_ = "127.0.0.1";
      master_port_ =
          o_.main_process_port > 0 ? o_.main_process_port : distributed::find_free_port();
    } else {
      master_addr_ = o_.main_process_ip;
      master_port_ = o_.main_process_port;
    }
    if (!o_.log_dir.empty()) {
      std::error_code ec;
      fs::create_directories(o_.log_dir, ec);
      if (ec)
        throw Error("difftrain launch: cannot create --log_dir " + o_.log_dir + ": " +
                    ec.message());
    }
    ranks_.resize(static_cast<size_t>(local_processes_));
    for (int i = 0; i < local_processes_; ++i) {
      Rank& r = ranks_[static_cast<size_t>(i)];
      r.local_rank = i;
      r.global_rank = o_.machine_rank * local_processes_ + i;
      r.prefix = "[rank " + std::to_string(r.global_rank) + "] ";
      if (!o_.log_dir.empty()) {
        const std::string path = log_path(r.global_rank);
        r.log_fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_APPEND, 0644);
        if (r.log_fd < 0) {
          throw Error("difftrain launch: cannot write log file " + path + ": " +
                      std::strerror(errno));
        }
      }
    }
  }

  ~Supervisor() {
    for (Rank& r : ranks_) {
      if (r.log_fd >= 0) close(r.log_fd);
    }
    if (!store_dir_.empty()) {
      std::error_code ec;
      fs::remove_all(store_dir_, ec);
    }
  }

  std::string log_path(int global_rank) const {
    return (fs::path(o_.log_dir) / ("rank" + std::to_string(global_rank) + ".log")).string();
  }

  void print_settings() const {
    std::string text = fmt::format(
        "difftrain launch: {} process(es) = {} machine(s) x {}, this is machine {}; {} thread(s) "
        "per process; mixed_precision={}, gradient_accumulation_steps={}, max_restarts={}\n",
        o_.num_processes, o_.num_machines, local_processes_, o_.machine_rank, threads_,
        o_.mixed_precision, o_.gradient_accumulation_steps, o_.max_restarts);
    text += fmt::format(
        "difftrain launch: rendezvous {}; program: {}{}{}\n",
        store_dir_.empty() ? fmt::format("tcp {}:{}", master_addr_, master_port_)
                           : "private file store in " + store_dir_,
        program_, self_program_ ? " (ranks start as forks of this launcher, without exec)" : "",
        o_.log_dir.empty() ? "" : "; logs in " + o_.log_dir);
    write_all(STDERR_FILENO, text);
  }

  int run() {
    print_settings();
    SignalScope signals;
    for (int generation = 0;; ++generation) {
      if (coordinator_) coordinator_->watch(generation);
      Failure failure;
      std::optional<RemoteAbort> remote;
      run_generation(generation, failure, remote);
      if (interrupted_ != 0) {
        say(fmt::format("interrupted by {}: stopped {} rank(s)", signal_name(interrupted_),
                        local_processes_));
        if (coordinator_) {
          coordinator_->post_abort(
              generation, RemoteAbort{false, 128 + interrupted_,
                                      fmt::format("machine {} was interrupted by {}",
                                                  o_.machine_rank, signal_name(interrupted_))});
        }
        return 128 + interrupted_;
      }
      const bool failed = failure.global_rank >= 0 || remote.has_value();
      if (!failed) {
        if (coordinator_) {
          auto late = coordinator_->finish(generation, [this]() { return drain_signals(); });
          if (interrupted_ != 0) return 128 + interrupted_;
          if (late && late->restart && generation < o_.max_restarts) {
            say(fmt::format("another machine asked for a restart ({}): restarting ({}/{})",
                            late->message, generation + 1, o_.max_restarts));
            continue;
          }
          if (late) {
            say("stopping: " + late->message);
            return late->exit_code;
          }
        }
        return 0;
      }
      const bool restart_allowed = generation < o_.max_restarts;
      if (remote && failure.global_rank < 0) {
        if (remote->restart && restart_allowed) {
          say(fmt::format("another machine failed ({}): restarting the group ({}/{})",
                          remote->message, generation + 1, o_.max_restarts));
          continue;
        }
        say("stopped this machine's ranks: " + remote->message);
        return remote->exit_code == 0 ? 1 : remote->exit_code;
      }
      if (restart_allowed) {
        say(fmt::format("{}; restarting the group ({}/{})", failure.message, generation + 1,
                        o_.max_restarts));
        continue;
      }
      say(failure.message);
      return failure.exit_code;
    }
  }

 private:
  void say(const std::string& message) const {
    write_all(STDERR_FILENO, "difftrain launch: " + message + "\n");
  }

  std::vector<std::string> environment(const Rank& r, int generation, int status_fd) const {
    std::map<std::string, std::string> vars;
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string entry = *e;
      const auto eq = entry.find('=');
      if (eq != std::string::npos) vars[entry.substr(0, eq)] = entry.substr(eq + 1);
    }
    auto set = [&](const std::string& k, const std::string& v) { vars[k] = v; };
    const int world = o_.num_processes;
    set("RANK", std::to_string(r.global_rank));
    set("WORLD_SIZE", std::to_string(world));
    set("LOCAL_RANK", std::to_string(r.local_rank));
    set("LOCAL_WORLD_SIZE", std::to_string(local_processes_));
    set("GROUP_RANK", std::to_string(o_.machine_rank));
    set("NODE_RANK", std::to_string(o_.machine_rank));
    set("ROLE_RANK", std::to_string(r.global_rank));
    set("ROLE_WORLD_SIZE", std::to_string(world));
    set("GROUP_WORLD_SIZE", std::to_string(o_.num_machines));
    set("MASTER_ADDR", master_addr_);
    set("MASTER_PORT", std::to_string(master_port_));
    set("TORCHELASTIC_RESTART_COUNT", std::to_string(generation));
    set("TORCHELASTIC_MAX_RESTARTS", std::to_string(o_.max_restarts));
    set("DIFFTRAIN_RESTART_COUNT", std::to_string(generation));
    set("DIFFTRAIN_LAUNCHED", "1");
    set("DIFFTRAIN_NUM_THREADS", std::to_string(threads_));
    set("OMP_NUM_THREADS", std::to_string(threads_));
    set("DIFFTRAIN_MIXED_PRECISION", o_.mixed_precision);
    set("ACCELERATE_MIXED_PRECISION", o_.mixed_precision);
    set("DIFFTRAIN_GRADIENT_ACCUMULATION_STEPS", std::to_string(o_.gradient_accumulation_steps));
    set("PYTHONUNBUFFERED", "1");
    set(core::kStatusFdEnv, std::to_string(status_fd));
    if (!store_dir_.empty()) {
      set("DIFFTRAIN_STORE_FILE", store_dir_ + "/store.gen" + std::to_string(generation));
      vars.erase("DIFFTRAIN_STORE_HOSTED");
    } else {
      set("DIFFTRAIN_STORE_HOSTED", "1");
      vars.erase("DIFFTRAIN_STORE_FILE");
    }
    if (o_.join_timeout_s > 0)
      set("DIFFTRAIN_JOIN_TIMEOUT", fmt::format("{:g}", o_.join_timeout_s));
    if (o_.collective_timeout_s > 0)
      set("DIFFTRAIN_COLLECTIVE_TIMEOUT", fmt::format("{:g}", o_.collective_timeout_s));
    for (const auto& [k, v] : o_.extra_env) set(k, v);
    std::vector<std::string> out;
    out.reserve(vars.size());
    for (const auto& [k, v] : vars) out.push_back(k + "=" + v);
    return out;
  }

  void spawn(Rank& r, int generation) {
    int out_pipe[2], err_pipe[2], report_pipe[2];
    if (pipe2(out_pipe, O_CLOEXEC) != 0 || pipe2(err_pipe, O_CLOEXEC) != 0 ||
        pipe2(report_pipe, O_CLOEXEC) != 0) {
      throw Error(std::string("difftrain launch: cannot create pipes: ") + std::strerror(errno));
    }
    // Everything the child needs is built before fork(): after it, only async-signal-safe calls.
    const std::vector<std::string> env_strings = environment(r, generation, report_pipe[1]);
    std::vector<char*> envp;
    for (const auto& s : env_strings) envp.push_back(const_cast<char*>(s.c_str()));
    envp.push_back(nullptr);
    std::vector<char*> argv;
    argv.push_back(const_cast<char*>(program_.c_str()));
    for (size_t i = 1; i < o_.command.size(); ++i)
      argv.push_back(const_cast<char*>(o_.command[i].c_str()));
    argv.push_back(nullptr);
    const pid_t parent = getpid();
    const bool in_process = self_program_ && thread_count() == 1;
    // Buffered output would otherwise be written twice, by the launcher and by the forked rank.
    std::cout.flush();
    std::cerr.flush();
    std::fflush(nullptr);
    // Until the child has dropped the launcher's handlers, a signal sent to it (e.g. the SIGTERM
    // of a group being stopped) would run our handler there and land in the launcher's
    // self-pipe, looking like a signal to the launcher. Signals stay blocked across fork().
    sigset_t all, saved;
    sigfillset(&all);
    sigprocmask(SIG_SETMASK, &all, &saved);
    const pid_t pid = fork();
    if (pid < 0) {
      const int error = errno;
      sigprocmask(SIG_SETMASK, &saved, nullptr);
      throw Error(std::string("difftrain launch: fork failed: ") + std::strerror(error));
    }
    if (pid == 0) {
      for (int signo : {SIGCHLD, SIGINT, SIGTERM, SIGHUP, SIGPIPE}) signal(signo, SIG_DFL);
      sigset_t none;
      sigemptyset(&none);
      sigprocmask(SIG_SETMASK, &none, nullptr);
      // Its own process group: the whole rank (and its children) is signalled at once.
      setpgid(0, 0);
      prctl(PR_SET_PDEATHSIG, SIGKILL);  // a killed launcher leaves no rank behind
      if (getppid() != parent) _exit(125);
      dup2(out_pipe[1], STDOUT_FILENO);
      dup2(err_pipe[1], STDERR_FILENO);
      fcntl(report_pipe[1], F_SETFD, 0);  // the status pipe stays open in the rank
      if (in_process) {
        // The launcher is this program and has no other thread: run its main() here with the
        // rank's environment and argv, as exec would, minus the program's start-up.
        close_cloexec_descriptors();
        environ = envp.data();
        // /proc/<pid>/environ and cmdline still show the launcher's (the kernel keeps the
        // original image's); the name names the rank for ps, top and tests.
        const std::string name = "difftrain-r" + std::to_string(r.global_rank);
        prctl(PR_SET_NAME, name.substr(0, 15).c_str());
        // What OMP_NUM_THREADS does at an exec'd program's start: the OpenMP runtime read the
        // launcher's environment when it was loaded.
        distributed::set_intra_op_threads(threads_);
        int rc = 1;
        try {
          rc = o_.self_main(static_cast<int>(argv.size() - 1), argv.data());
        } catch (const std::exception& e) {
          std::cerr << "difftrain: error: " << e.what() << std::endl;
        }
        // The launcher's static objects are not this rank's to destroy (as after exec).
        exit_process(rc);
      }
      execve(argv[0], argv.data(), envp.data());
      const char* reason = std::strerror(errno);
      const char prefix[] = "difftrain launch: exec failed: ";
      [[maybe_unused]] auto a = write(STDERR_FILENO, prefix, sizeof(prefix) - 1);
      [[maybe_unused]] auto b = write(STDERR_FILENO, reason, std::strlen(reason));
      [[maybe_unused]] auto c = write(STDERR_FILENO, "\n", 1);
      _exit(127);
    }
    setpgid(pid, pid);  // also from the parent, so a signal sent right away reaches the group
    sigprocmask(SIG_SETMASK, &saved, nullptr);
    close(out_pipe[1]);
    close(err_pipe[1]);
    close(report_pipe[1]);
    fcntl(out_pipe[0], F_SETFL, O_NONBLOCK);
    fcntl(err_pipe[0], F_SETFL, O_NONBLOCK);
    fcntl(report_pipe[0], F_SETFL, O_NONBLOCK);
    r.pid = pid;
    r.running = true;
    r.status = 0;
    r.out = Stream{out_pipe[0], STDOUT_FILENO, {}};
    r.err = Stream{err_pipe[0], STDERR_FILENO, {}};
    if (r.report.fd >= 0) close(r.report.fd);
    r.report = Stream{report_pipe[0], -1, {}};
    r.phase.clear();
    r.last_progress = Clock::time_point{};
    r.cpu_seen = -1;
    if (r.log_fd >= 0 && generation > 0) {
      write_all(r.log_fd, fmt::format("--- difftrain launch: restart {} ---\n", generation));
    }
  }

  void signal_all(int signo) {
    for (Rank& r : ranks_) {
      if (r.running) kill(-r.pid, signo);
    }
  }

  // Reads pending signals; returns true when the launcher was asked to stop.
  bool drain_signals() {
    unsigned char buffer[64];
    while (true) {
      const ssize_t n = read(g_signal_pipe[0], buffer, sizeof(buffer));
      if (n <= 0) break;
      for (ssize_t i = 0; i < n; ++i) {
        const int signo = buffer[i];
        if (signo == SIGCHLD) continue;
        if (interrupted_ != 0) {
          if (!killed_) report_unfinished();
          signal_all(SIGKILL);  // a second signal: no more grace
          killed_ = true;
        } else {
          interrupted_ = signo;
          signal_all(signo);
          mark_stop_began();
        }
      }
    }
    return interrupted_ != 0;
  }

  std::chrono::milliseconds grace() const {
    return std::chrono::milliseconds(static_cast<long>(o_.term_timeout_s * 1000));
  }

  std::string describe_exit(const Rank& r) const {
    if (WIFSIGNALED(r.status)) {
      return fmt::format("rank {} (pid {}) was killed by {}", r.global_rank, r.pid,
                         signal_name(WTERMSIG(r.status)));
    }
    return fmt::format("rank {} (pid {}) exited with status {}", r.global_rank, r.pid,
                       WEXITSTATUS(r.status));
  }

  void reap(Failure& failure, int generation) {
    while (true) {
      int status = 0;
      const pid_t pid = waitpid(-1, &status, WNOHANG);
      if (pid <= 0) return;
      for (Rank& r : ranks_) {
        if (r.pid != pid || !r.running) continue;
        r.running = false;
        r.status = status;
        kill(-r.pid, SIGKILL);  // whatever the rank left running in its group goes with it
        const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
        if (ok || failure.global_rank >= 0 || interrupted_ != 0 || stopping_) continue;
        failure.global_rank = r.global_rank;
        failure.exit_code = WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
        const int others = static_cast<int>(
            std::count_if(ranks_.begin(), ranks_.end(), [](const Rank& x) { return x.running; }));
        failure.message =
            describe_exit(r) +
            (o_.num_machines > 1 ? fmt::format(" on machine {}", o_.machine_rank) : "") +
            fmt::format("; stopped {} other local rank(s); ", others) +
            (o_.log_dir.empty()
                 ? fmt::format("its output is above, prefixed [rank {}]", r.global_rank)
                 : "log: " + log_path(r.global_rank));
        begin_stop();
        if (coordinator_) {
          RemoteAbort abort;
          abort.restart = generation < o_.max_restarts;
          abort.exit_code = failure.exit_code;
          abort.message = describe_exit(r) + fmt::format(" on machine {}", o_.machine_rank);
          coordinator_->post_abort(generation, abort);
        }
      }
    }
  }

  void begin_stop() {
    if (stopping_) return;
    stopping_ = true;
    signal_all(SIGTERM);
    mark_stop_began();
  }

  void run_generation(int generation, Failure& failure, std::optional<RemoteAbort>& remote) {
    stopping_ = false;
    killed_ = false;
    extended_ = false;
    for (Rank& r : ranks_) spawn(r, generation);
    while (true) {
      std::vector<pollfd> fds;
      std::vector<std::pair<Rank*, Stream*>> owners;
      fds.push_back({g_signal_pipe[0], POLLIN, 0});
      owners.emplace_back(nullptr, nullptr);
      for (Rank& r : ranks_) {
        for (Stream* s : {&r.out, &r.err}) {
          if (s->fd < 0) continue;
          fds.push_back({s->fd, POLLIN, 0});
          owners.emplace_back(&r, s);
        }
      }
      // The status pipes are read too but do not keep the loop alive (they are not output).
      const size_t outputs = fds.size();
      for (Rank& r : ranks_) {
        if (r.report.fd < 0) continue;
        fds.push_back({r.report.fd, POLLIN, 0});
        owners.emplace_back(&r, &r.report);
      }
      const bool any_running =
          std::any_of(ranks_.begin(), ranks_.end(), [](const Rank& r) { return r.running; });
      if (!any_running && outputs == 1) break;
      if (!any_running) {
        // Ranks are gone but a pipe is still open (a grandchild escaped its group): give it a
        // moment, then stop listening.
        if (!pipes_deadline_) pipes_deadline_ = Clock::now() + std::chrono::seconds(2);
        if (Clock::now() > *pipes_deadline_) {
          for (Rank& r : ranks_) {
            for (Stream* s : {&r.out, &r.err}) {
              if (s->fd >= 0) {
                emit(r, *s, true);
                close(s->fd);
                s->fd = -1;
              }
            }
          }
          break;
        }
      }
      poll(fds.data(), fds.size(), 100);
      for (size_t i = 1; i < fds.size(); ++i) {
        if ((fds[i].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
        if (owners[i].second == &owners[i].first->report) {
          pump_report(*owners[i].first);
        } else {
          pump(*owners[i].first, *owners[i].second);
        }
      }
      drain_signals();
      reap(failure, generation);
      if (coordinator_ && !remote && failure.global_rank < 0 && interrupted_ == 0) {
        if (auto abort = coordinator_->remote_abort()) {
          remote = abort;
          begin_stop();
        }
      }
      if ((stopping_ || interrupted_ != 0) && !killed_) sample_cpu();
      if ((stopping_ || interrupted_ != 0) && !killed_ && Clock::now() > stop_deadline_ &&
          !still_progressing()) {
        report_unfinished();
        signal_all(SIGKILL);
        killed_ = true;
      }
    }
    pipes_deadline_.reset();
    for (Rank& r : ranks_) {
      if (r.report.fd >= 0) close(r.report.fd);
      r.report.fd = -1;
    }
  }

  // After the stop signal a rank that still reports progress (saving a checkpoint: each piece
  // written) is given --term_timeout more seconds from its last report, for as long as it goes
  // on; only a rank that goes quiet that long is killed. Returns true while one goes on.
  bool still_progressing() {
    sample_cpu();
    const Rank* busiest = nullptr;
    for (const Rank& r : ranks_) {
      if (!r.running || r.last_progress <= stop_began_) continue;
      if (busiest == nullptr || r.last_progress > busiest->last_progress) busiest = &r;
    }
    if (busiest == nullptr || busiest->last_progress + grace() <= Clock::now()) return false;
    stop_deadline_ = busiest->last_progress + grace();
    if (!extended_) {
      extended_ = true;
      say(fmt::format(
          "rank {} is {} after {:.1f} s: it may finish while it makes progress (each "
          "--term_timeout {:g} s without progress ends it; a second signal ends it now)",
          busiest->global_rank,
          busiest->phase.empty() ? "finishing its update" : "still " + busiest->phase,
          std::chrono::duration<double>(Clock::now() - stop_began_).count(), o_.term_timeout_s));
    }
    return true;
  }

  void mark_stop_began() {
    stop_began_ = Clock::now();
    stop_deadline_ = stop_began_ + grace();
    cpu_sampled_ = Clock::time_point{};
    for (Rank& r : ranks_) r.cpu_seen = -1;
  }

  // A rank that used a tenth of a core or more since the last look is working (finishing its
  // update, writing): progress, like its own reports. One waiting in a collective or stopped
  // uses next to nothing.
  void sample_cpu() {
    const auto now = Clock::now();
    if (now - cpu_sampled_ < std::chrono::seconds(1)) return;
    const double wall = std::chrono::duration<double>(now - cpu_sampled_).count();
    cpu_sampled_ = now;
    for (Rank& r : ranks_) {
      if (!r.running) continue;
      const double cpu = cpu_seconds(r.pid);
      if (cpu >= 0 && r.cpu_seen >= 0 && cpu - r.cpu_seen >= 0.1 * std::min(wall, 5.0)) {
        r.last_progress = now;
      }
      r.cpu_seen = cpu;
    }
  }

  // Says which ranks are killed in the middle of a phase (an unfinished checkpoint is named).
  void report_unfinished() const {
    for (const Rank& r : ranks_) {
      if (!r.running || r.phase.empty()) continue;
      std::string what =
          fmt::format("rank {} is killed while {} ({:g} s of --term_timeout without progress)",
                      r.global_rank, r.phase, o_.term_timeout_s);
      if (r.phase.rfind("saving ", 0) == 0) {
        what +=
            ": that checkpoint is not finished (its .tmp folder is deleted by the next resume, "
            "which starts from the last complete one); give the job a longer grace period "
            "(--term_timeout, SLURM's KillWait, Kubernetes' terminationGracePeriodSeconds)";
      }
      say(what);
    }
  }

  const LaunchOptions& o_;
  std::string program_;
  bool self_program_ = false;  // ranks are forked copies running o_.self_main (no exec)
  Coordinator* coordinator_;
  int local_processes_ = 1;
  int threads_ = 1;
  std::string store_dir_;
  std::string master_addr_;
  int master_port_ = 0;
  std::vector<Rank> ranks_;
  int interrupted_ = 0;
  bool stopping_ = false;
  bool killed_ = false;
  bool extended_ = false;  // the grace period was extended for a rank that makes progress
  Clock::time_point stop_began_{};
  Clock::time_point cpu_sampled_{};
  Clock::time_point stop_deadline_{};
  std::optional<Clock::time_point> pipes_deadline_;
};

}  // namespace

double join_timeout_seconds(const LaunchOptions& options) {
  if (options.join_timeout_s > 0) return options.join_timeout_s;
  if (const char* env = std::getenv("DIFFTRAIN_JOIN_TIMEOUT"); env && *env) {
    char* end = nullptr;
    const double value = std::strtod(env, &end);
    if (end != env && *end == '\0' && value > 0) return value;
    throw Error(std::string("difftrain launch: DIFFTRAIN_JOIN_TIMEOUT='") + env +
                "' is not a positive number of seconds");
  }
  return 60.0;
}

int default_threads_per_process(int local_processes) {
  const unsigned cores = std::thread::hardware_concurrency();
  const int available = cores == 0 ? 1 : static_cast<int>(cores);
  return std::max(1, available / std::max(1, local_processes));
}

void validate(const LaunchOptions& o) {
  auto fail = [](const std::string& what) { throw Error("difftrain launch: " + what); };
  if (o.command.empty()) fail("no program given: difftrain launch [options] PROGRAM [ARGS...]");
  if (o.num_processes < 1) fail("--num_processes must be at least 1");
  if (o.num_machines < 1) fail("--num_machines must be at least 1");
  if (o.machine_rank < 0 || o.machine_rank >= o.num_machines) {
    fail(fmt::format("--machine_rank {} is not in 0..{} (--num_machines {})", o.machine_rank,
                     o.num_machines - 1, o.num_machines));
  }
  if (o.num_processes % o.num_machines != 0) {
    fail(
        fmt::format("--num_processes {} is not a multiple of --num_machines {}: every machine runs "
                    "the same number of ranks",
                    o.num_processes, o.num_machines));
  }
  if (o.main_process_port < 0 || o.main_process_port > 65535)
    fail("--main_process_port must be 0-65535");
  if (o.num_machines > 1) {
    if (o.main_process_ip.empty())
      fail("--main_process_ip is required with --num_machines > 1: the address of machine 0");
    if (o.main_process_port == 0)
      fail("--main_process_port must be a fixed port with --num_machines > 1");
    // Resolved here so a typo fails at once, not after --join_timeout of connection attempts.
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    const int rc = getaddrinfo(o.main_process_ip.c_str(), nullptr, &hints, &found);
    if (rc != 0) {
      fail(fmt::format(
          "--main_process_ip '{}' cannot be resolved ({}): give machine 0's IP address, or a "
          "host name that every machine resolves",
          o.main_process_ip, gai_strerror(rc)));
    }
    freeaddrinfo(found);
  }
  if (o.num_cpu_threads_per_process < 0)
    fail("--num_cpu_threads_per_process must be 0 (auto) or more");
  if (o.mixed_precision != "no" && o.mixed_precision != "fp16" && o.mixed_precision != "bf16") {
    fail("--mixed_precision must be no, fp16 or bf16, got '" + o.mixed_precision + "'");
  }
  if (o.gradient_accumulation_steps < 1) fail("--gradient_accumulation_steps must be at least 1");
  if (o.max_restarts < 0) fail("--max_restarts must be 0 or more");
  if (o.term_timeout_s < 0) fail("--term_timeout must be 0 or more seconds");
  if (o.join_timeout_s < 0) fail("--join_timeout must be 0 (the default, 60 s) or more seconds");
  if (o.collective_timeout_s < 0)
    fail("--collective_timeout must be 0 (the default, 30 min) or more seconds");
}

int run(const LaunchOptions& options) {
  validate(options);
  const std::string program = resolve_program(options.command[0]);
  std::unique_ptr<Coordinator> coordinator;
  if (options.num_machines > 1) {
    coordinator = std::make_unique<Coordinator>(
        options.main_process_ip, options.main_process_port, options.num_machines,
        options.machine_rank,
        std::chrono::milliseconds(static_cast<long>(join_timeout_seconds(options) * 1000)));
  }
  Supervisor supervisor(options, program, coordinator.get());
  return supervisor.run();
}

}  // namespace difftrain::launch
