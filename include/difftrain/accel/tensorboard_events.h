#pragma once
// Reading TensorBoard event files back (what TensorBoardTracker writes): the TFRecord framing and
// the few Event / Summary protobuf fields difftrain uses. For tests, tools and the fuzzer; a
// malformed file throws a one-line difftrain::Error, never reads out of bounds.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace difftrain::accel {

/// One decoded `tensorflow.Event`.
struct TensorBoardEvent {
  double wall_time = 0;                   ///< field 1 (double, required)
  int64_t step = 0;                       ///< field 2
  std::string file_version;               ///< field 3, e.g. "brain.Event:2"
  std::optional<int64_t> session_status;  ///< field 7 (SessionLog.status)
  /// Summary values (field 5) with a simple_value: {tag, value}.
  std::vector<std::pair<std::string, float>> scalars;
  /// Summary values with an image (Summary.Image: height, width, colorspace, PNG bytes).
  struct Image {
    std::string tag;
    int64_t height = 0, width = 0, colorspace = 0;
    std::string png;
  };
  std::vector<Image> images;
};

/// The records of TFRecord bytes: each is uint64 length (little-endian), the masked CRC-32C of
/// those 8 bytes, `length` bytes of data and the masked CRC-32C of the data. Throws
/// difftrain::Error naming `name` and the record index for a truncated record or a CRC mismatch
/// (e.g. "events.out: record 1: data CRC mismatch; ..."). Nothing is allocated beyond the input.
std::vector<std::string> parse_tfrecords(std::string_view bytes, const std::string& name);

/// Decodes one record as an Event. Throws difftrain::Error naming `name` for malformed protobuf
/// (a varint over 10 bytes, a length past the end, an unknown wire type), a missing wall_time, or
/// a field of the wrong wire type or given twice.
TensorBoardEvent parse_tensorboard_event(std::string_view record, const std::string& name);

/// Every event of the event file at `path` (parse_tfrecords + parse_tensorboard_event).
std::vector<TensorBoardEvent> read_tensorboard_events(const std::string& path);

}  // namespace difftrain::accel
