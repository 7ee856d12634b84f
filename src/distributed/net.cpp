#include "difftrain/distributed/net.h"

#include "difftrain/core/error.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>

namespace difftrain::distributed {

namespace {

struct AddrInfoDeleter {
  void operator()(addrinfo* info) const { freeaddrinfo(info); }
};
using AddrInfoPtr = std::unique_ptr<addrinfo, AddrInfoDeleter>;

AddrInfoPtr lookup(const std::string& host, int port, int socktype) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = socktype;
  addrinfo* result = nullptr;
  const std::string service = std::to_string(port);
  const int rc = getaddrinfo(host.c_str(), service.c_str(), &hints, &result);
  if (rc != 0) {
    throw Error("cannot resolve host '" + host + "': " + gai_strerror(rc) +
                ": check the address (MASTER_ADDR / --main_process_ip)");
  }
  return AddrInfoPtr(result);
}

std::string numeric(const sockaddr* addr, socklen_t len) {
  char buffer[NI_MAXHOST];
  if (getnameinfo(addr, len, buffer, sizeof(buffer), nullptr, 0, NI_NUMERICHOST) != 0) return "";
  return buffer;
}

}  // namespace

bool is_loopback_host(const std::string& host) {
  return host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0;
}

std::string resolve_host(const std::string& host) {
  auto info = lookup(host, 0, SOCK_STREAM);
  return numeric(info->ai_addr, info->ai_addrlen);
}

std::string local_address_towards(const std::string& host, int port) {
  if (is_loopback_host(host)) return host == "::1" ? "::1" : "127.0.0.1";
  auto info = lookup(host, port == 0 ? 9 : port, SOCK_DGRAM);
  const int fd = socket(info->ai_family, SOCK_DGRAM, 0);
  if (fd < 0) throw Error(std::string("cannot open a UDP socket: ") + std::strerror(errno));
  std::string result;
  if (connect(fd, info->ai_addr, info->ai_addrlen) == 0) {
    sockaddr_storage local{};
    socklen_t len = sizeof(local);
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0) {
      result = numeric(reinterpret_cast<sockaddr*>(&local), len);
    }
  }
  const int saved = errno;
  close(fd);
  if (result.empty()) {
    throw Error("no network route from this machine to " + host + ": " + std::strerror(saved) +
                ": check the address and this machine's interfaces");
  }
  return result;
}

int find_free_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw Error(std::string("cannot open a TCP socket: ") + std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    const int saved = errno;
    close(fd);
    throw Error(std::string("cannot find a free TCP port on 127.0.0.1: ") + std::strerror(saved));
  }
  close(fd);
  return ntohs(addr.sin_port);
}

std::string host_name() {
  char buffer[256] = {0};
  if (gethostname(buffer, sizeof(buffer) - 1) != 0) return "unknown-host";
  return buffer;
}

}  // namespace difftrain::distributed
