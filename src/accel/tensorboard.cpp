// TensorBoard event files by hand: CRC-32C, TFRecord framing and the few protobuf messages of
// tensorflow/core/util/event.proto and tensorflow/core/framework/summary.proto we need.

#include "difftrain/accel/trackers.h"

#include "difftrain/core/error.h"
#include "difftrain/core/log.h"
#include "difftrain/io/image.h"

#include <fmt/format.h>

#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>

namespace difftrain::accel {

namespace {

// ------------------------------------------------------------------ CRC-32C

constexpr uint32_t kCrc32cPoly = 0x82F63B78u;  // Castagnoli, bit-reversed

constexpr std::array<uint32_t, 256> make_crc32c_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1u) ? (c >> 1) ^ kCrc32cPoly : c >> 1;
    table[i] = c;
  }
  return table;
}

constexpr std::array<uint32_t, 256> kCrc32cTable = make_crc32c_table();

// ------------------------------------------------------------------ protobuf wire format
// Wire types: 0 varint, 1 fixed64, 2 length-delimited, 5 fixed32. Little-endian bytes are built
// with shifts so the output does not depend on the host's byte order.

enum WireType : uint32_t { kVarint = 0, kFixed64 = 1, kBytes = 2, kFixed32 = 5 };

void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

void put_le(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}

void put_key(std::string& out, uint32_t field, WireType type) {
  put_varint(out, (static_cast<uint64_t>(field) << 3) | type);
}

// int32 / int64 / enum: negative values are sign-extended to 64 bits (10-byte varint).
void put_int(std::string& out, uint32_t field, int64_t v) {
  put_key(out, field, kVarint);
  put_varint(out, static_cast<uint64_t>(v));
}

void put_double(std::string& out, uint32_t field, double v) {
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof bits);
  put_key(out, field, kFixed64);
  put_le(out, bits, 8);
}

void put_float(std::string& out, uint32_t field, float v) {
  uint32_t bits = 0;
  std::memcpy(&bits, &v, sizeof bits);
  put_key(out, field, kFixed32);
  put_le(out, bits, 4);
}

void put_bytes(std::string& out, uint32_t field, std::string_view bytes) {
  put_key(out, field, kBytes);
  put_varint(out, bytes.size());
  out.append(bytes.data(), bytes.size());
}

// Field numbers (event.proto / summary.proto).
namespace event_field {
constexpr uint32_t kWallTime = 1, kStep = 2, kFileVersion = 3, kSummary = 5, kSessionLog = 7;
}
namespace value_field {
constexpr uint32_t kTag = 1, kSimpleValue = 2, kImage = 4;
}
namespace image_field {
constexpr uint32_t kHeight = 1, kWidth = 2, kColorspace = 3, kEncoded = 4;
}
constexpr uint32_t kSummaryValue = 1;      // Summary.value (repeated Value)
constexpr uint32_t kSessionLogStatus = 1;  // SessionLog.status
constexpr int64_t kSessionStart = 1;       // SessionLog.SessionStatus.START

double wall_time_now() {
  using namespace std::chrono;
  return duration<double>(system_clock::now().time_since_epoch()).count();
}

// Event header: wall_time, step. The caller appends the `what` field.
std::string event_header(int64_t step) {
  std::string event;
  put_double(event, event_field::kWallTime, wall_time_now());
  put_int(event, event_field::kStep, step);
  return event;
}

void check_tag(const std::string& tag, const char* what) {
  if (tag.empty()) {
    throw Error(
        fmt::format("TensorBoardTracker::{}: empty tag; give the value a name such as "
                    "\"loss\" or \"samples\"",
                    what));
  }
}

std::string host_name() {
  char buffer[256] = {};
  if (::gethostname(buffer, sizeof buffer - 1) != 0 || buffer[0] == '\0') return "localhost";
  return buffer;
}

std::atomic<int> event_file_counter{0};

}  // namespace

uint32_t crc32c(std::string_view bytes) {
  uint32_t crc = 0xFFFFFFFFu;
  for (unsigned char byte : bytes) crc = kCrc32cTable[(crc ^ byte) & 0xFFu] ^ (crc >> 8);
  return crc ^ 0xFFFFFFFFu;
}

uint32_t masked_crc32c(std::string_view bytes) {
  const uint32_t c = crc32c(bytes);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

// ------------------------------------------------------------------ TensorBoardTracker

TensorBoardTracker::TensorBoardTracker(const std::string& logdir, const std::string& run_name,
                                       const std::string& filename_suffix,
                                       std::optional<int64_t> purge_step) {
  namespace fs = std::filesystem;
  fs::path dir = run_name.empty() ? fs::path(logdir) : fs::path(logdir) / run_name;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) {
    throw Error(
        fmt::format("{}: cannot create the TensorBoard log folder ({}); choose a writable "
                    "--logging_dir",
                    dir.string(), ec.message()));
  }
  const auto seconds = static_cast<int64_t>(wall_time_now());
  path_ =
      (dir / fmt::format("events.out.tfevents.{}.{}.{}.{}{}", seconds, host_name(),
                         static_cast<int64_t>(::getpid()), event_file_counter++, filename_suffix))
          .string();
  file_ = std::fopen(path_.c_str(), "wb");
  if (file_ == nullptr) {
    throw Error(
        fmt::format("{}: cannot create the TensorBoard event file ({}); choose a writable "
                    "--logging_dir",
                    path_, std::strerror(errno)));
  }
  try {
    std::string version = event_header(0);
    put_bytes(version, event_field::kFileVersion, "brain.Event:2");
    write_event(version);
    if (purge_step) {
      std::string session_log;
      put_int(session_log, kSessionLogStatus, kSessionStart);
      std::string event = event_header(*purge_step);
      put_bytes(event, event_field::kSessionLog, session_log);
      write_event(event);
    }
  } catch (...) {
    std::fclose(file_);  // the destructor does not run when the constructor throws
    throw;
  }
}

TensorBoardTracker::~TensorBoardTracker() {
  if (file_ != nullptr && std::fclose(file_) != 0) {
    log::warn("{}: closing the TensorBoard event file failed ({}); its last events may be lost",
              path_, std::strerror(errno));
  }
}

void TensorBoardTracker::write_event(const std::string& event) {
  std::string record;
  record.reserve(event.size() + 16);
  put_le(record, event.size(), 8);
  put_le(record, masked_crc32c(record), 4);
  record += event;
  put_le(record, masked_crc32c(event), 4);
  if (std::fwrite(record.data(), 1, record.size(), file_) != record.size() ||
      std::fflush(file_) != 0) {
    throw Error(
        fmt::format("{}: writing a TensorBoard event failed ({}); check free space and "
                    "permissions of the logging folder",
                    path_, std::strerror(errno)));
  }
}

void TensorBoardTracker::log_scalars(const std::map<std::string, double>& values, int64_t step) {
  if (values.empty()) return;
  std::string summary;
  for (const auto& [tag, value] : values) {
    check_tag(tag, "log_scalars");
    std::string v;
    put_bytes(v, value_field::kTag, tag);
    put_float(v, value_field::kSimpleValue, static_cast<float>(value));
    put_bytes(summary, kSummaryValue, v);
  }
  std::string event = event_header(step);
  put_bytes(event, event_field::kSummary, summary);
  std::lock_guard<std::mutex> lock(mutex_);
  write_event(event);
}

void TensorBoardTracker::log_image(const std::string& tag, const torch::Tensor& image,
                                   int64_t step) {
  check_tag(tag, "log_image");
  const auto pixels = to_tracker_image(tag, image);  // uint8 [H, W, C]
  std::string img;
  put_int(img, image_field::kHeight, pixels.size(0));
  put_int(img, image_field::kWidth, pixels.size(1));
  put_int(img, image_field::kColorspace, pixels.size(2));  // 1 grey, 2 grey+alpha, 3 RGB, 4 RGBA
  put_bytes(img, image_field::kEncoded, io::encode_png(pixels));
  std::string v;
  put_bytes(v, value_field::kTag, tag);
  put_bytes(v, value_field::kImage, img);
  std::string summary;
  put_bytes(summary, kSummaryValue, v);
  std::string event = event_header(step);
  put_bytes(event, event_field::kSummary, summary);
  std::lock_guard<std::mutex> lock(mutex_);
  write_event(event);
}

void TensorBoardTracker::flush() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (std::fflush(file_) != 0) {
    throw Error(fmt::format("{}: flushing TensorBoard events failed ({}); check free space", path_,
                            std::strerror(errno)));
  }
}

}  // namespace difftrain::accel
