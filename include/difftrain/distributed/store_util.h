#pragma once

#include <cstdint>
#include <exception>
#include <string>
#include <vector>

namespace difftrain::distributed {

/// The first line of an exception's message, without c10's backtrace: what a one-line error
/// built around a LibTorch/Gloo failure quotes.
std::string first_line(const std::exception& e);

/// A c10d store value from text, and back.
std::vector<uint8_t> to_bytes(const std::string& text);
std::string from_bytes(const std::vector<uint8_t>& bytes);

}  // namespace difftrain::distributed
