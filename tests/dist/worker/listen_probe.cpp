// LD_PRELOAD probe for the security test: records the local address of every listen() a process
// makes (one line "pid address:port" appended to $DIFFTRAIN_LISTEN_LOG), then listens as asked.
// Listening sockets of a job can live for milliseconds (Gloo listens only while ranks connect),
// too briefly to be sure of catching them in /proc/net/tcp; this sees every one.

#include <arpa/inet.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

extern "C" int listen(int fd, int backlog) {
  using ListenFn = int (*)(int, int);
  static ListenFn real = reinterpret_cast<ListenFn>(dlsym(RTLD_NEXT, "listen"));
  if (const char* log = std::getenv("DIFFTRAIN_LISTEN_LOG"); log && *log) {
    sockaddr_storage addr{};
    socklen_t len = sizeof(addr);
    char host[INET6_ADDRSTRLEN] = "?";
    int port = -1;
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
      if (addr.ss_family == AF_INET) {
        const auto* a = reinterpret_cast<const sockaddr_in*>(&addr);
        inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
        port = ntohs(a->sin_port);
      } else if (addr.ss_family == AF_INET6) {
        const auto* a = reinterpret_cast<const sockaddr_in6*>(&addr);
        inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
        port = ntohs(a->sin6_port);
      } else {
        std::snprintf(host, sizeof(host), "family-%d", static_cast<int>(addr.ss_family));
      }
    }
    char line[128];
    const int n =
        std::snprintf(line, sizeof(line), "%d %s:%d\n", static_cast<int>(getpid()), host, port);
    const int out = open(log, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600);
    if (out >= 0) {
      if (write(out, line, static_cast<size_t>(n)) < 0) {
      }
      close(out);
    }
  }
  return real(fd, backlog);
}
