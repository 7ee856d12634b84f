#pragma once
// Reading a process's TCP sockets from /proc, shared by the loopback checks (the dist worker's
// `sockets` mode, from inside a rank, and the security test, from outside a running job).

#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace difftrain::testing {

/// Socket inodes a process holds open: the "socket:[N]" links in `fd_dir` (/proc/<pid>/fd).
inline std::set<std::string> socket_inodes(const std::string& fd_dir) {
  std::set<std::string> inodes;
  std::error_code ec;
  for (const auto& fd : std::filesystem::directory_iterator(fd_dir, ec)) {
    const std::string target = std::filesystem::read_symlink(fd.path(), ec).string();
    if (!ec && target.rfind("socket:[", 0) == 0) inodes.insert(target.substr(8, target.size() - 9));
  }
  return inodes;
}

/// One row of /proc/net/tcp or tcp6.
struct TcpRow {
  std::string local;  ///< hex "address:port" as the kernel prints it (address little-endian)
  std::string state;  ///< hex TCP state: "0A" is LISTEN
  std::string inode;
};

/// The rows of a /proc/net/tcp-style table.
inline std::vector<TcpRow> read_tcp_table(const std::string& path) {
  std::vector<TcpRow> rows;
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);  // header
  while (std::getline(in, line)) {
    std::istringstream f(line);
    std::string slot, local, remote, state, queues, timer, retransmits, uid, timeout, inode;
    f >> slot >> local >> remote >> state >> queues >> timer >> retransmits >> uid >> timeout >>
        inode;
    rows.push_back({local, state, inode});
  }
  return rows;
}

}  // namespace difftrain::testing
