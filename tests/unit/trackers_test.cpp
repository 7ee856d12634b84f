// Trackers: TensorBoard event files checked by an independent reader written here (a bitwise
// CRC-32C, its own TFRecord and protobuf decoding), the JSON-lines log and its resume
// truncation, the multiplexer, and make_trackers()'s choices and errors.

#include "difftrain/accel/trackers.h"
#include "difftrain/accel/tensorboard_events.h"
#include "difftrain/core/error.h"
#include "difftrain/io/atomic_file.h"
#include "difftrain/io/image.h"

#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <regex>
#include <sstream>
#include <tuple>

namespace {

using difftrain::accel::JsonlTracker;
using difftrain::accel::make_trackers;
using difftrain::accel::TensorBoardTracker;
using difftrain::accel::Tracker;
using difftrain::accel::Trackers;
using difftrain::test::error_of;
using difftrain::test::temp_dir;
namespace fs = std::filesystem;

// ------------------------------------------------------------------ reading event files
// The event files are read back with accel::read_tensorboard_events (src/accel/
// tensorboard_events.cpp, no code shared with the writer but the CRC); the CRC itself is checked
// against this bit-by-bit one (no table).

uint32_t crc32c_bitwise(const std::string& bytes) {
  uint32_t crc = ~0u;
  for (unsigned char byte : bytes) {
    crc ^= byte;
    for (int bit = 0; bit < 8; ++bit) {
      const uint32_t mask = 0u - (crc & 1u);  // all ones when the low bit is set
      crc = (crc >> 1) ^ (0x82F63B78u & mask);
    }
  }
  return ~crc;
}

uint32_t mask_crc(uint32_t crc) {
  const uint32_t rotated = (crc >> 15) | (crc << 17);
  return rotated + 0xa282ead8u;
}

// The records of a TFRecord file: the library's reader (its CRC is checked against the bitwise
// one above in Crc32c).
std::vector<std::string> read_records(const std::string& file) {
  return difftrain::accel::parse_tfrecords(file, "events");
}

using Event = difftrain::accel::TensorBoardEvent;

std::vector<std::string> event_files(const std::string& dir) {
  std::vector<std::string> files;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().filename().string().rfind("events.out.tfevents.", 0) == 0) {
      files.push_back(entry.path().string());
    }
  }
  return files;
}

std::vector<Event> read_events(const std::string& path) {
  return difftrain::accel::read_tensorboard_events(path);
}

std::vector<std::string> lines_of(const std::string& path) {
  std::vector<std::string> lines;
  std::istringstream in(difftrain::io::read_file(path));
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

torch::Tensor random_image(int64_t h, int64_t w, int64_t c, uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  return at::randint(0, 256, {h, w, c}, gen, torch::kInt64).to(torch::kUInt8);
}

// ------------------------------------------------------------------ CRC

TEST(TrackersCrc32c, StandardCheckValueAndTableMatchesBitwise) {
  EXPECT_EQ(difftrain::accel::crc32c("123456789"), 0xE3069283u);
  EXPECT_EQ(crc32c_bitwise("123456789"), 0xE3069283u);
  EXPECT_EQ(difftrain::accel::crc32c(""), 0u);
  std::string bytes;
  for (int i = 0; i < 1000; ++i) {
    bytes.push_back(static_cast<char>((i * 131 + 7) & 0xFF));
    ASSERT_EQ(difftrain::accel::crc32c(bytes), crc32c_bitwise(bytes)) << "length " << i + 1;
  }
  EXPECT_EQ(difftrain::accel::masked_crc32c(bytes), mask_crc(crc32c_bitwise(bytes)));
}

// ------------------------------------------------------------------ TensorBoard

TEST(TrackersTensorBoard, ScalarsAndImagesDecodeWithAnIndependentReader) {
  const auto dir = temp_dir("tb_scalars");
  const auto rgb = random_image(5, 7, 3, 1);
  const auto rgba = random_image(4, 3, 4, 2);
  // Float grey in [0, 1] on the 1/255 grid, plus values outside [0, 1] that are clamped.
  auto grey_u8 = random_image(6, 2, 1, 3);
  auto grey_f = grey_u8.to(torch::kFloat32) / 255.0;
  grey_f[0][0][0] = -0.5;
  grey_u8[0][0][0] = 0;
  grey_f[0][1][0] = 2.0;
  grey_u8[0][1][0] = 255;
  const double before =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  {
    TensorBoardTracker tb(dir);
    EXPECT_EQ(tb.name(), "tensorboard");
    tb.log_scalars({{"loss", 0.25}, {"lr", 1e-4}}, 1);
    tb.log_scalars({{"loss", 0.125}, {"nan", std::nan("")}}, 2);
    tb.log_scalars({}, 3);  // nothing
    tb.log_image("samples/rgb", rgb, 10);
    tb.log_image("rgba", rgba, 11);
    tb.log_image("grey", grey_f, -4);
  }
  const auto files = event_files(dir);
  ASSERT_EQ(files.size(), 1u);
  const auto events = read_events(files[0]);
  ASSERT_EQ(events.size(), 6u);

  EXPECT_EQ(events[0].file_version, "brain.Event:2");
  EXPECT_TRUE(events[0].scalars.empty() && events[0].images.empty());
  for (const auto& e : events) {
    EXPECT_GE(e.wall_time, std::floor(before));
    EXPECT_LT(e.wall_time, before + 600);
  }
  EXPECT_EQ(events[1].step, 1);
  ASSERT_EQ(events[1].scalars.size(), 2u);
  EXPECT_EQ(events[1].scalars[0].first, "loss");
  EXPECT_EQ(events[1].scalars[0].second, 0.25f);
  EXPECT_EQ(events[1].scalars[1].first, "lr");
  EXPECT_EQ(events[1].scalars[1].second, 1e-4f);
  EXPECT_EQ(events[2].step, 2);
  ASSERT_EQ(events[2].scalars.size(), 2u);
  EXPECT_EQ(events[2].scalars[0].second, 0.125f);
  EXPECT_TRUE(std::isnan(events[2].scalars[1].second));

  const std::vector<std::tuple<std::string, int64_t, torch::Tensor>> expected = {
      {"samples/rgb", 10, rgb}, {"rgba", 11, rgba}, {"grey", -4, grey_u8}};
  for (size_t i = 0; i < expected.size(); ++i) {
    const auto& [tag, step, pixels] = expected[i];
    SCOPED_TRACE(tag);
    const auto& e = events[3 + i];
    EXPECT_EQ(e.step, step);
    EXPECT_TRUE(e.scalars.empty());
    ASSERT_EQ(e.images.size(), 1u);
    const auto& img = e.images[0];
    EXPECT_EQ(img.tag, tag);
    EXPECT_EQ(img.height, pixels.size(0));
    EXPECT_EQ(img.width, pixels.size(1));
    EXPECT_EQ(img.colorspace, pixels.size(2));
    const auto back = difftrain::io::decode_image(img.png, tag, 0);
    ASSERT_EQ(back.sizes(), pixels.sizes());
    EXPECT_TRUE(torch::equal(back, pixels));
  }
}

TEST(TrackersTensorBoard, FileNameRunFolderAndSuffix) {
  const auto dir = temp_dir("tb_name");
  std::string first, second;
  {
    TensorBoardTracker a(dir, "run1", ".v2");
    TensorBoardTracker b(dir, "run1");
    first = a.path();
    second = b.path();
  }
  EXPECT_EQ(fs::path(first).parent_path(), fs::path(dir) / "run1");
  char host[256] = {};
  ASSERT_EQ(::gethostname(host, sizeof host - 1), 0);
  const std::regex pattern(R"(events\.out\.tfevents\.(\d+)\.(.+)\.(\d+)\.(\d+)(.*))");
  std::smatch m;
  const std::string name1 = fs::path(first).filename().string();
  const std::string name2 = fs::path(second).filename().string();
  ASSERT_TRUE(std::regex_match(name1, m, pattern)) << name1;
  const auto now = std::chrono::duration_cast<std::chrono::seconds>(
                       std::chrono::system_clock::now().time_since_epoch())
                       .count();
  EXPECT_LE(std::abs(std::stoll(m[1]) - now), 600);
  EXPECT_EQ(m[2], std::string(host));
  EXPECT_EQ(std::stoll(m[3]), ::getpid());
  EXPECT_EQ(m[5], ".v2");
  const auto counter1 = std::stoll(m[4]);
  ASSERT_TRUE(std::regex_match(name2, m, pattern)) << name2;
  EXPECT_EQ(std::stoll(m[4]), counter1 + 1);  // two writers in one second never share a file
  EXPECT_EQ(m[5], "");
  EXPECT_EQ(read_events(first).size(), 1u);
  EXPECT_EQ(read_events(second).size(), 1u);
}

TEST(TrackersTensorBoard, EventsAreOnDiskAfterEachCallWithoutClosing) {
  const auto dir = temp_dir("tb_flush");
  TensorBoardTracker tb(dir);
  tb.log_scalars({{"loss", 1.5}}, 7);
  // The tracker is still open: what a killed run leaves behind.
  const auto events = read_events(tb.path());
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[1].step, 7);
  ASSERT_EQ(events[1].scalars.size(), 1u);
  EXPECT_EQ(events[1].scalars[0].second, 1.5f);
}

TEST(TrackersTensorBoard, PurgeStepWritesSessionLogStart) {
  const auto dir = temp_dir("tb_purge");
  std::string path;
  {
    TensorBoardTracker tb(dir, "", "", 101);
    path = tb.path();
    tb.log_scalars({{"loss", 2.0}}, 101);
  }
  const auto events = read_events(path);
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events[0].file_version, "brain.Event:2");
  EXPECT_EQ(events[1].step, 101);
  EXPECT_EQ(events[1].session_status, std::optional<int64_t>(1));  // SessionLog.START
  EXPECT_FALSE(events[2].session_status.has_value());
}

TEST(TrackersTensorBoard, ReaderDetectsACorruptedByte) {
  const auto dir = temp_dir("tb_corrupt");
  std::string path;
  {
    TensorBoardTracker tb(dir);
    path = tb.path();
    tb.log_scalars({{"loss", 0.5}}, 1);
  }
  const std::string good = difftrain::io::read_file(path);
  ASSERT_EQ(read_records(good).size(), 2u);
  // Flip one bit in every byte position in turn: each must be caught (in a length, a data byte
  // or a stored CRC) or make the file unreadable; none may decode as the same records.
  const auto records = read_records(good);
  for (size_t i = 0; i < good.size(); ++i) {
    std::string bad = good;
    bad[i] = static_cast<char>(bad[i] ^ 0x10);
    bool caught = false;
    try {
      read_records(bad);
    } catch (const std::runtime_error&) {
      caught = true;
    }
    EXPECT_TRUE(caught) << "flipped byte " << i << " of " << good.size() << " went unnoticed";
  }
  // The message names the record: a byte inside the second record's data.
  std::string bad = good;
  const size_t second_data = 12 + records[0].size() + 4 + 12 + 3;
  bad[second_data] = static_cast<char>(bad[second_data] ^ 0x01);
  try {
    read_records(bad);
    ADD_FAILURE() << "corruption not detected";
  } catch (const std::runtime_error& e) {
    EXPECT_HAS(e.what(), "events: record 1: data CRC mismatch;");
  }
}

TEST(TrackersTensorBoard, ErrorsNameTheTagOrPath) {
  const auto dir = temp_dir("tb_errors");
  TensorBoardTracker tb(dir);
  EXPECT_HAS(error_of([&] { tb.log_image("chw", torch::zeros({3, 8, 8}), 0); }), "chw");
  EXPECT_HAS(error_of([&] {
               tb.log_image("chw", torch::zeros({3, 8, 8}), 0);
             }),
             "expected uint8 [H, W, C]");
  EXPECT_HAS(error_of([&] {
               tb.log_image("c5", torch::zeros({4, 4, 5}, torch::kUInt8), 0);
             }),
             "Byte [4, 4, 5]");
  EXPECT_HAS(error_of([&] {
               tb.log_image("int", torch::zeros({4, 4, 3}, torch::kInt32), 0);
             }),
             "Int [4, 4, 3]");
  EXPECT_HAS(error_of([&] { tb.log_image("undef", torch::Tensor(), 0); }), "undefined");
  EXPECT_HAS(error_of([&] { tb.log_scalars({{"", 1.0}}, 0); }), "empty tag");
  // A folder that cannot be created: a regular file sits where it should be.
  const std::string blocker = dir + "/blocker";
  std::ofstream(blocker) << "x";
  const auto message = error_of([&] { TensorBoardTracker bad(blocker + "/logs"); });
  EXPECT_HAS(message, blocker + "/logs");
  EXPECT_HAS(message, "--logging_dir");
}

// ------------------------------------------------------------------ JSONL

TEST(TrackersJsonl, OneLinePerCallWithStepFirstAndNullForNonFinite) {
  const auto dir = temp_dir("jsonl_lines");
  const std::string path = dir + "/sub/log.jsonl";  // folders are created
  {
    JsonlTracker log(path);
    EXPECT_EQ(log.name(), "jsonl");
    log.log_scalars({{"loss", 0.5}, {"lr", 1e-4}}, 1);
    log.log_scalars({{"loss", std::nan("")}, {"inf", std::numeric_limits<double>::infinity()}}, 2);
    log.log_scalars({}, 3);                                 // nothing
    log.log_image("samples", random_image(2, 2, 3, 1), 4);  // nothing
    // Flushed per line: readable before the tracker closes.
    EXPECT_EQ(lines_of(path).size(), 2u);
  }
  const auto lines = lines_of(path);
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0].rfind("{\"step\": 1,", 0), 0u) << lines[0];
  const auto a = nlohmann::json::parse(lines[0]);
  EXPECT_EQ(a["step"], 1);
  EXPECT_EQ(a["loss"].get<double>(), 0.5);
  EXPECT_EQ(a["lr"].get<double>(), 1e-4);
  const auto b = nlohmann::json::parse(lines[1]);
  EXPECT_EQ(b["step"], 2);
  EXPECT_TRUE(b["loss"].is_null());
  EXPECT_TRUE(b["inf"].is_null());
}

TEST(TrackersJsonl, ErrorsForReservedNamesAndBadImages) {
  const auto dir = temp_dir("jsonl_errors");
  JsonlTracker log(dir + "/log.jsonl");
  EXPECT_HAS(error_of([&] { log.log_scalars({{"step", 1.0}}, 0); }), "reserved");
  EXPECT_HAS(error_of([&] { log.log_scalars({{"", 1.0}}, 0); }), "empty");
  EXPECT_HAS(error_of([&] { log.log_image("x", torch::zeros({8, 8}), 0); }), "log_image(\"x\")");
  EXPECT_HAS(error_of([] { JsonlTracker bad(""); }), "log path is empty");
}

TEST(TrackersJsonl, NewRunReplacesTheOldLog) {
  const auto dir = temp_dir("jsonl_new");
  const std::string path = dir + "/log.jsonl";
  difftrain::io::write_file_atomic(path, "{\"step\": 1, \"loss\": 9}\n");
  {
    JsonlTracker log(path);
    log.log_scalars({{"loss", 1.0}}, 5);
  }
  const auto lines = lines_of(path);
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_EQ(nlohmann::json::parse(lines[0])["step"], 5);
}

TEST(TrackersJsonl, ResumeKeepsStepsUpToResumeAndDropsAHalfWrittenLine) {
  const auto dir = temp_dir("jsonl_resume");
  const std::string path = dir + "/log.jsonl";
  {
    JsonlTracker log(path);
    for (int64_t step = 1; step <= 6; ++step) log.log_scalars({{"loss", 1.0 / step}}, step);
  }
  // The crash: a line cut in the middle, as a killed process leaves it.
  {
    std::ofstream out(path, std::ios::app);
    out << "{\"step\": 7, \"lo";
  }
  {
    JsonlTracker log(path, 4);  // resumed from the checkpoint of step 4
    const auto kept = lines_of(path);
    ASSERT_EQ(kept.size(), 4u);
    log.log_scalars({{"loss", 0.01}}, 5);
  }
  const auto lines = lines_of(path);
  ASSERT_EQ(lines.size(), 5u);
  for (size_t i = 0; i < lines.size(); ++i) {
    const auto j = nlohmann::json::parse(lines[i]);
    EXPECT_EQ(j["step"], static_cast<int64_t>(i + 1));
  }
  EXPECT_EQ(nlohmann::json::parse(lines[4])["loss"].get<double>(), 0.01);

  // A resume beyond every logged step keeps all complete lines; a half-written line in the
  // middle (from an older crash) and garbage are dropped too; the last line may lack '\n'.
  difftrain::io::write_file_atomic(
      path, "{\"step\": 1, \"a\": 1}\n{\"st\n[1, 2]\n{\"step\": \"2\"}\n\n{\"step\": 3, \"a\": 3}");
  {
    JsonlTracker log(path, 100);
    log.log_scalars({{"a", 4.0}}, 4);
  }
  const auto again = lines_of(path);
  ASSERT_EQ(again.size(), 3u);
  EXPECT_EQ(nlohmann::json::parse(again[0])["step"], 1);
  EXPECT_EQ(nlohmann::json::parse(again[1])["step"], 3);
  EXPECT_EQ(nlohmann::json::parse(again[2])["step"], 4);

  // Resume without an existing file: a fresh log.
  const std::string fresh = dir + "/fresh.jsonl";
  {
    JsonlTracker log(fresh, 10);
    log.log_scalars({{"a", 1.0}}, 11);
  }
  EXPECT_EQ(lines_of(fresh).size(), 1u);
}

// ------------------------------------------------------------------ Trackers, make_trackers

// Records what it was asked, and throws when told to.
class FakeTracker : public Tracker {
 public:
  FakeTracker(std::string name, bool fail, std::vector<std::string>* calls)
      : name_(std::move(name)), fail_(fail), calls_(calls) {}
  void log_scalars(const std::map<std::string, double>&, int64_t step) override {
    calls_->push_back(name_ + " scalars " + std::to_string(step));
    if (fail_) throw difftrain::Error(name_ + " failed");
  }
  void log_image(const std::string& tag, const torch::Tensor&, int64_t) override {
    calls_->push_back(name_ + " image " + tag);
  }
  void flush() override { calls_->push_back(name_ + " flush"); }
  std::string name() const override { return name_; }

 private:
  std::string name_;
  bool fail_;
  std::vector<std::string>* calls_;
};

TEST(TrackersMultiplexer, CallsEveryTrackerAndRethrowsTheFirstError) {
  std::vector<std::string> calls;
  Trackers all;
  EXPECT_TRUE(all.empty());
  EXPECT_EQ(all.name(), "none");
  all.log_scalars({{"loss", 1.0}}, 1);  // no trackers: nothing happens
  all.add(std::make_unique<FakeTracker>("a", true, &calls));
  all.add(std::make_unique<FakeTracker>("b", false, &calls));
  EXPECT_EQ(all.size(), 2u);
  EXPECT_EQ(all.name(), "a,b");
  EXPECT_EQ(all.get("b")->name(), "b");
  EXPECT_EQ(all.get("c"), nullptr);
  EXPECT_EQ(error_of([&] { all.log_scalars({{"loss", 1.0}}, 3); }), "a failed");
  all.log_image("img", torch::Tensor(), 4);
  all.flush();
  EXPECT_EQ(calls, (std::vector<std::string>{"a scalars 3", "b scalars 3", "a image img",
                                             "b image img", "a flush", "b flush"}));
  EXPECT_HAS(error_of([&] { all.add(nullptr); }), "null");
}

TEST(TrackersMake, ReportToChoosesTrackers) {
  const auto dir = temp_dir("make_trackers");
  const std::string logs = dir + "/logs", jsonl = dir + "/log.jsonl";
  EXPECT_EQ(make_trackers("none", logs, jsonl)->name(), "none");
  EXPECT_FALSE(fs::exists(logs));
  EXPECT_EQ(make_trackers("tensorboard", logs, jsonl)->name(), "tensorboard");
  EXPECT_EQ(make_trackers("jsonl", logs, jsonl)->name(), "jsonl");
  EXPECT_EQ(make_trackers("all", logs, jsonl)->name(), "tensorboard,jsonl");
  EXPECT_EQ(make_trackers(" JSONL , TensorBoard,jsonl", logs, jsonl)->name(), "tensorboard,jsonl");
  EXPECT_EQ(event_files(logs).size(), 3u);  // tensorboard, all, the list

  // A resumed run: TensorBoard purges from resume + 1, the JSONL log is truncated.
  difftrain::io::write_file_atomic(jsonl, "{\"step\": 1}\n{\"step\": 2}\n{\"step\": 3}\n");
  const std::string resumed_logs = dir + "/resumed";
  {
    auto trackers = make_trackers("all", resumed_logs, jsonl, 2);
    trackers->log_scalars({{"loss", 0.5}}, 3);
    trackers->log_image("img", random_image(3, 3, 3, 9), 3);
  }
  EXPECT_EQ(lines_of(jsonl).size(), 3u);
  const auto files = event_files(resumed_logs);
  ASSERT_EQ(files.size(), 1u);
  const auto events = read_events(files[0]);
  ASSERT_EQ(events.size(), 4u);
  EXPECT_EQ(events[1].step, 3);
  EXPECT_EQ(events[1].session_status, std::optional<int64_t>(1));
  EXPECT_EQ(events[3].images.size(), 1u);
}

TEST(TrackersMake, ErrorsListTheValidValues) {
  const auto dir = temp_dir("make_trackers_errors");
  for (const std::string bad : {"wandb", "", "tensorboard,", "tensorboard,mlflow"}) {
    SCOPED_TRACE(bad);
    const auto message = error_of([&] { make_trackers(bad, dir, dir + "/log.jsonl"); });
    EXPECT_HAS(message, "report_to \"" + bad + "\"");
    EXPECT_HAS(message, "valid values: tensorboard, jsonl, all, none");
  }
  EXPECT_HAS(error_of([&] { make_trackers("wandb", dir, ""); }), "unknown tracker \"wandb\"");
  EXPECT_HAS(error_of([&] { make_trackers("none,jsonl", dir, dir + "/log.jsonl"); }),
             "\"none\" cannot be combined");
  EXPECT_HAS(error_of([&] { make_trackers("tensorboard", "", ""); }), "--logging_dir");
  EXPECT_HAS(error_of([&] { make_trackers("jsonl", dir, ""); }), "log path is empty");
}

}  // namespace
