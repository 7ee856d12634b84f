#include "difftrain/accel/tensorboard_events.h"

#include "difftrain/accel/trackers.h"
#include "difftrain/core/error.h"
#include "difftrain/io/atomic_file.h"

#include <cstring>
#include <map>

namespace difftrain::accel {
namespace {

constexpr const char* kFix = "the event file is corrupt or not a TensorBoard event file";

uint64_t read_le(std::string_view bytes, size_t at, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(bytes[at + i]);
  return v;
}

// One protobuf field: wire type 0 -> number, 1 / 5 -> fixed (raw bits), 2 -> bytes.
struct Field {
  int wire = -1;
  uint64_t number = 0;
  std::string_view bytes;
};

// Fields of one message by field number; views into `msg`.
std::multimap<uint64_t, Field> decode_message(std::string_view msg, const std::string& where) {
  auto bad = [&](const std::string& what) { throw Error(where + ": " + what + "; " + kFix); };
  std::multimap<uint64_t, Field> fields;
  size_t at = 0;
  auto varint = [&]() {
    uint64_t v = 0;
    for (int shift = 0;; shift += 7) {
      if (at >= msg.size()) bad("a varint runs past the end of the message");
      if (shift > 63) bad("a varint is longer than 10 bytes");
      const auto b = static_cast<unsigned char>(msg[at++]);
      v |= static_cast<uint64_t>(b & 0x7F) << shift;
      if ((b & 0x80) == 0) return v;
    }
  };
  while (at < msg.size()) {
    const uint64_t key = varint();
    Field f;
    f.wire = static_cast<int>(key & 7);
    switch (f.wire) {
      case 0: f.number = varint(); break;
      case 1:
      case 5: {
        const size_t n = f.wire == 1 ? 8 : 4;
        if (msg.size() - at < n) bad("a fixed-size field runs past the end of the message");
        f.number = read_le(msg, at, static_cast<int>(n));
        at += n;
        break;
      }
      case 2: {
        const uint64_t n = varint();
        if (msg.size() - at < n) {
          bad("a field of " + std::to_string(n) + " bytes runs past the end of the message");
        }
        f.bytes = msg.substr(at, n);
        at += n;
        break;
      }
      default: bad("unexpected protobuf wire type " + std::to_string(f.wire));
    }
    fields.emplace(key >> 3, f);
  }
  return fields;
}

// The one field `number` of wire type `wire`, or nullptr when absent.
const Field* one(const std::multimap<uint64_t, Field>& fields, uint64_t number, int wire,
                 const std::string& where, bool required = false) {
  const size_t count = fields.count(number);
  if (count == 0) {
    if (required) {
      throw Error(where + ": field " + std::to_string(number) + " is missing; " + kFix);
    }
    return nullptr;
  }
  if (count > 1) {
    throw Error(where + ": field " + std::to_string(number) + " appears " + std::to_string(count) +
                " times; " + kFix);
  }
  const Field& f = fields.find(number)->second;
  if (f.wire != wire) {
    throw Error(where + ": field " + std::to_string(number) + " has wire type " +
                std::to_string(f.wire) + ", expected " + std::to_string(wire) + "; " + kFix);
  }
  return &f;
}

}  // namespace

std::vector<std::string> parse_tfrecords(std::string_view bytes, const std::string& name) {
  std::vector<std::string> records;
  size_t at = 0;
  while (at < bytes.size()) {
    const std::string where = name + ": record " + std::to_string(records.size());
    if (bytes.size() - at < 12) {
      throw Error(where + ": truncated header (" + std::to_string(bytes.size() - at) +
                  " bytes, expected 12); " + kFix);
    }
    const uint64_t length = read_le(bytes, at, 8);
    if (read_le(bytes, at + 8, 4) != masked_crc32c(bytes.substr(at, 8))) {
      throw Error(where + ": length CRC mismatch; " + kFix);
    }
    at += 12;
    // Checked against the bytes present before anything is allocated.
    if (bytes.size() - at < 4 || length > bytes.size() - at - 4) {
      throw Error(where + ": truncated data (" + std::to_string(length) + " bytes declared, " +
                  std::to_string(bytes.size() - at) + " follow); " + kFix);
    }
    const std::string_view data = bytes.substr(at, length);
    if (read_le(bytes, at + length, 4) != masked_crc32c(data)) {
      throw Error(where + ": data CRC mismatch; " + kFix);
    }
    at += length + 4;
    records.emplace_back(data);
  }
  return records;
}

TensorBoardEvent parse_tensorboard_event(std::string_view record, const std::string& name) {
  const std::string where = name + ": Event";
  const auto f = decode_message(record, where);
  TensorBoardEvent e;
  const uint64_t wall_bits = one(f, 1, 1, where, /*required=*/true)->number;
  std::memcpy(&e.wall_time, &wall_bits, 8);
  if (const Field* step = one(f, 2, 0, where)) e.step = static_cast<int64_t>(step->number);
  if (const Field* version = one(f, 3, 2, where)) e.file_version = std::string(version->bytes);
  if (const Field* log = one(f, 7, 2, where)) {
    const std::string log_where = where + ".session_log";
    const auto fields = decode_message(log->bytes, log_where);
    if (const Field* status = one(fields, 1, 0, log_where)) {
      e.session_status = static_cast<int64_t>(status->number);
    }
  }
  if (const Field* summary_field = one(f, 5, 2, where)) {
    const std::string summary_where = where + ".summary";
    const auto summary = decode_message(summary_field->bytes, summary_where);
    for (auto [it, end] = summary.equal_range(1); it != end; ++it) {
      if (it->second.wire != 2) {
        throw Error(summary_where + ": a value is not a message (wire type " +
                    std::to_string(it->second.wire) + "); " + kFix);
      }
      const std::string value_where = summary_where + ".value";
      const auto value = decode_message(it->second.bytes, value_where);
      const std::string tag(one(value, 1, 2, value_where, /*required=*/true)->bytes);
      if (const Field* simple = one(value, 2, 5, value_where)) {
        const auto bits = static_cast<uint32_t>(simple->number);
        float v;
        std::memcpy(&v, &bits, 4);
        e.scalars.emplace_back(tag, v);
      }
      if (const Field* image = one(value, 4, 2, value_where)) {
        const std::string image_where = value_where + ".image";
        const auto img = decode_message(image->bytes, image_where);
        TensorBoardEvent::Image out;
        out.tag = tag;
        out.height = static_cast<int64_t>(one(img, 1, 0, image_where, true)->number);
        out.width = static_cast<int64_t>(one(img, 2, 0, image_where, true)->number);
        out.colorspace = static_cast<int64_t>(one(img, 3, 0, image_where, true)->number);
        out.png = std::string(one(img, 4, 2, image_where, true)->bytes);
        e.images.push_back(std::move(out));
      }
    }
  }
  return e;
}

std::vector<TensorBoardEvent> read_tensorboard_events(const std::string& path) {
  std::vector<TensorBoardEvent> events;
  const std::string bytes = io::read_file(path);
  const auto records = parse_tfrecords(bytes, path);
  for (size_t i = 0; i < records.size(); ++i) {
    events.push_back(parse_tensorboard_event(records[i], path + ": record " + std::to_string(i)));
  }
  return events;
}

}  // namespace difftrain::accel
