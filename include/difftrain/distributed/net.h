#pragma once

#include <string>

namespace difftrain::distributed {

/// True for "localhost", 127.0.0.0/8 and ::1.
bool is_loopback_host(const std::string& host);

/// Resolves `host` to a numeric IPv4/IPv6 address string. Throws difftrain::Error naming the host
/// when it cannot be resolved.
std::string resolve_host(const std::string& host);

/// The local address this machine uses to reach `host:port` (the interface the kernel's routing
/// table picks). Sends no packet: it connects a UDP socket and reads its name.
std::string local_address_towards(const std::string& host, int port);

/// A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0, read it, close).
int find_free_port();

/// This machine's host name.
std::string host_name();

}  // namespace difftrain::distributed
