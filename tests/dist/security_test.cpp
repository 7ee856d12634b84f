// Security properties of a running single-machine job, checked from the outside: every listening
// TCP socket of the launcher and its ranks is on loopback (read from /proc/net/tcp and tcp6 while
// the job runs, and every listen() call recorded by an LD_PRELOAD probe), and the rendezvous
// folder is private (0700) and removed at the end.

#include "proc_net.h"
#include "program_paths.h"
#include "subprocess.h"
#include "train_util.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <thread>

namespace difftrain::testing {
namespace {

namespace fs = std::filesystem;

// The parent pid of `pid` from /proc/<pid>/stat (0 when it is gone).
pid_t parent_of(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(in, line)) return 0;
  const auto close = line.rfind(')');  // the command name may hold spaces and parentheses
  if (close == std::string::npos) return 0;
  std::istringstream rest(line.substr(close + 2));
  char state = 0;
  pid_t ppid = 0;
  rest >> state >> ppid;
  return ppid;
}

// `root` and all its descendants now alive.
std::set<pid_t> process_tree(pid_t root) {
  std::map<pid_t, pid_t> parent;
  for (const auto& entry : fs::directory_iterator("/proc")) {
    const std::string name = entry.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    const pid_t pid = std::stoi(name);
    parent[pid] = parent_of(pid);
  }
  std::set<pid_t> tree = {root};
  for (bool grew = true; grew;) {
    grew = false;
    for (const auto& [pid, ppid] : parent) {
      if (tree.count(ppid) && tree.insert(pid).second) grew = true;
    }
  }
  return tree;
}

// Listening sockets (state 0A) of /proc/net/tcp or tcp6, by inode: their hex local address and
// whether it is on loopback.
std::map<std::string, std::pair<std::string, bool>> listeners(const std::string& table, bool v6) {
  std::map<std::string, std::pair<std::string, bool>> out;
  for (const auto& row : read_tcp_table(table)) {
    if (row.state != "0A") continue;
    const std::string addr = row.local.substr(0, row.local.find(':'));
    // 127.0.0.0/8 is stored little-endian: the last byte is 7F. ::1 and ::ffff:127.x in tcp6.
    const bool loopback =
        v6 ? (addr == "00000000000000000000000001000000" ||
              (addr.rfind("0000000000000000FFFF0000", 0) == 0 && addr.substr(30, 2) == "7F"))
           : addr.size() == 8 && addr.substr(6, 2) == "7F";
    out[row.inode] = {row.local, loopback};
  }
  return out;
}

TEST(Security, SingleMachineJobListensOnLoopbackOnlyAndKeepsItsRendezvousPrivate) {
  const std::string dir = make_temp_dir("security");
  const std::string tmpdir = dir + "/tmp";
  fs::create_directories(tmpdir);
  auto cmd = train_cmd(dir, dir + "/out",
                       {"--max_train_steps", "40", "--train_batch_size", "4",
                        "--checkpointing_steps", "20", "--logging_steps", "10"});
  std::vector<std::string> argv = {kDifftrain, "launch", "--num_processes", "2", kDifftrain};
  argv.insert(argv.end(), cmd.begin(), cmd.end());
  const std::string listen_log = dir + "/listen.log";
  Process job(argv, {{"TMPDIR", tmpdir},
                     {"LD_PRELOAD", difftrain_test::listen_probe_lib()},
                     {"DIFFTRAIN_LISTEN_LOG", listen_log}});
  ProcessResult result;
  std::thread waiter([&] { result = job.wait(240); });

  std::map<std::string, std::pair<std::string, bool>>
      seen;  // every listening socket of the job, by inode
  std::set<std::string> rendezvous_modes;
  size_t polls = 0;
  while (alive(job.pid())) {
    ++polls;
    const std::set<pid_t> tree = process_tree(job.pid());
    std::set<std::string> inodes;
    for (pid_t pid : tree) {
      const auto s = socket_inodes("/proc/" + std::to_string(pid) + "/fd");
      inodes.insert(s.begin(), s.end());
    }
    for (const auto& [table, v6] : {std::pair{"/proc/net/tcp", false}, {"/proc/net/tcp6", true}}) {
      for (const auto& [inode, l] : listeners(table, v6)) {
        if (inodes.count(inode)) seen[inode] = l;
      }
    }
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(tmpdir, ec)) {  // the rendezvous folder
      struct stat st {};
      if (entry.path().filename().string().rfind("difftrain-rdzv-", 0) == 0 &&
          ::lstat(entry.path().c_str(), &st) == 0) {
        std::ostringstream mode;
        mode << std::oct << (st.st_mode & 07777);
        rendezvous_modes.insert(mode.str());
      }
    }
    // Gloo listens only while the ranks connect: poll tightly.
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  waiter.join();
  ASSERT_EQ(result.exit_code, 0) << result.log();
  std::cout << "polled /proc " << polls << " times; listening sockets of the job:";
  for (const auto& [inode, l] : seen) std::cout << " " << l.first << (l.second ? "" : " (!)");
  std::cout << std::endl;
  // Sockets seen in /proc/net/tcp{,6} while the job ran: all on loopback. Gloo's listeners live
  // only while the ranks connect, so polling may miss them; the probe below sees every one.
  for (const auto& [inode, l] : seen) {
    EXPECT_TRUE(l.second) << "listening socket " << l.first << " (inode " << inode
                          << ") is not on loopback";
  }
  // Every listen() of the launcher and its ranks, from the LD_PRELOAD probe.
  std::ifstream log(listen_log);
  std::vector<std::string> listens;
  for (std::string line; std::getline(log, line);) listens.push_back(line);
  std::cout << "listen() calls of the job:";
  for (const auto& l : listens) std::cout << " [" << l << "]";
  std::cout << std::endl;
  ASSERT_FALSE(listens.empty()) << "the probe saw no listen(): was it preloaded?";
  for (const auto& l : listens) {
    const std::string addr = l.substr(l.find(' ') + 1);
    EXPECT_TRUE(addr.rfind("127.", 0) == 0 || addr.rfind("::1:", 0) == 0)
        << "a listening socket outside loopback: " << l;
  }
  EXPECT_EQ(rendezvous_modes, std::set<std::string>{"700"});
  EXPECT_TRUE(fs::is_empty(tmpdir)) << "the rendezvous folder was left behind in " << tmpdir;
}

}  // namespace
}  // namespace difftrain::testing
