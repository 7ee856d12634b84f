// Video files (io/video.h): every written format read back close to what was written, frame
// rates and timestamps, resampling to a target rate by time (musubi-tuner's frame dropping on a
// constant rate; evenly spaced from a variable one), windows, and bad files refused in one line.
#include "difftrain/io/video.h"
#include "difftrain/core/error.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>

namespace {
namespace fs = std::filesystem;
using difftrain::Error;
using namespace difftrain::io;

// F frames of H x W whose colour says the frame index: a flat frame (codecs keep flat areas
// nearly exact) with red = 8 * i, green = 255 - 8 * i, a blue ramp down the rows.
torch::Tensor counter_clip(int64_t F, int64_t H, int64_t W) {
  auto clip = torch::empty({F, H, W, 3}, torch::kUInt8);
  for (int64_t i = 0; i < F; ++i) {
    clip[i].select(2, 0).fill_(8 * i);
    clip[i].select(2, 1).fill_(255 - 8 * i);
    clip[i].select(2, 2).copy_(
        torch::linspace(0, 255, H).round().to(torch::kUInt8).view({H, 1}).expand({H, W}));
  }
  return clip;
}

// Which frame of counter_clip a decoded frame is (by its mean red).
int64_t frame_index(const torch::Tensor& frame) {
  return std::llround(frame.select(2, 0).to(torch::kFloat).mean().item<double>() / 8.0);
}

class VideoFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(video_supported()) << "built without FFmpeg: run scripts/setup (libavformat-dev, "
                                      "libavcodec-dev, libswscale-dev) and rebuild";
    dir_ = difftrain::test::temp_dir("video");
  }
  void TearDown() override {
    std::error_code ec;
    if (!dir_.empty()) fs::remove_all(dir_, ec);
  }
  std::string path(const std::string& name) const { return (fs::path(dir_) / name).string(); }
  std::string dir_;
};

TEST_F(VideoFiles, EveryFormatReadsBackCloseWithItsFrameCountAndRate) {
  const auto clip = counter_clip(9, 48, 64);
  for (const std::string ext : {".mp4", ".mkv", ".mov", ".webm", ".webp", ".gif"}) {
    SCOPED_TRACE(ext);
    const std::string file = path("clip" + ext);
    VideoWriteOptions w;
    w.fps = 16;
    write_video(file, clip, w);
    ASSERT_TRUE(fs::exists(file));
    EXPECT_FALSE(fs::exists(file + ".partial"));
    if (ext == ".webp") {
      // FFmpeg cannot decode animated WebP: the file is checked by its chunks (one ANMF each).
      std::ifstream in(file, std::ios::binary);
      const std::string bytes((std::istreambuf_iterator<char>(in)), {});
      EXPECT_EQ(bytes.substr(0, 4), "RIFF");
      EXPECT_NE(bytes.find("ANIM"), std::string::npos);
      int64_t frames = 0;
      for (size_t at = bytes.find("ANMF"); at != std::string::npos;
           at = bytes.find("ANMF", at + 4)) {
        ++frames;
      }
      EXPECT_EQ(frames, 9);
      continue;
    }
    const VideoFrames back = read_video(file);
    EXPECT_EQ(back.frames.sizes(), clip.sizes());
    if (back.frames.sizes() != clip.sizes()) continue;
    ASSERT_EQ(back.timestamps.size(), 9u);
    for (int64_t i = 0; i < 9; ++i) {
      EXPECT_EQ(frame_index(back.frames[i]), i) << "frame " << i;
      EXPECT_NEAR(back.timestamps[i], i / 16.0, 0.011) << "frame " << i;
    }
    // Lossy codecs: the mean error stays small; GIF's 3-3-2 palette is the coarsest.
    const double err =
        (back.frames.to(torch::kFloat) - clip.to(torch::kFloat)).abs().mean().item<double>();
    EXPECT_LT(err, ext == ".gif" ? 24.0 : 4.0);
    if (ext != ".gif") {
      const VideoInfo info = probe_video(file);
      EXPECT_EQ(info.width, 64);
      EXPECT_EQ(info.height, 48);
      EXPECT_NEAR(info.fps, 16.0, 0.2);  // Matroska's average comes from its duration
      EXPECT_NEAR(static_cast<double>(info.num_frames), 9.0, 1.0);
    }
  }
}

TEST_F(VideoFiles, FloatFramesAreRoundedAsDiffusersDoes) {
  const auto clip = counter_clip(3, 32, 32);
  const std::string file = path("f.mkv");
  VideoWriteOptions w;
  w.crf = 0;
  write_video(file, clip.to(torch::kFloat) / 255.0, w);
  const auto back = read_video(file).frames;
  const auto direct = path("u.mkv");
  write_video(direct, clip, w);
  // The float clip is the uint8 one after x * 255 rounded: the same file's frames.
  EXPECT_TRUE(torch::equal(back, read_video(direct).frames));
  EXPECT_LT((back.to(torch::kFloat) - clip.to(torch::kFloat)).abs().mean().item<double>(), 2.0);
}

TEST_F(VideoFiles, ResamplingToATargetRateKeepsTheFirstFrameAtOrAfterEachTime) {
  const auto clip = counter_clip(30, 32, 32);
  const std::string file = path("30fps.mkv");
  VideoWriteOptions w;
  w.fps = 30;
  w.crf = 0;
  write_video(file, clip, w);
  VideoReadOptions r;
  r.target_fps = 16;
  const VideoFrames v = read_video(file, r);
  // musubi-tuner's frame dropping: frame i kept when int(i * 16 / 30) is new, i.e. output k is
  // frame ceil(k * 30 / 16).
  // (In exact arithmetic: musubi's accumulated float can tip an exact tie to the next frame.)
  std::vector<int64_t> want;
  for (int64_t k = 0; (k * 30 + 15) / 16 < 30; ++k) want.push_back((k * 30 + 15) / 16);
  ASSERT_EQ(v.frames.size(0), static_cast<int64_t>(want.size()));
  for (size_t k = 0; k < want.size(); ++k) EXPECT_EQ(frame_index(v.frames[k]), want[k]) << k;
  // A window of the resampled sequence.
  r.start_frame = 2;
  r.end_frame = 6;
  const VideoFrames part = read_video(file, r);
  ASSERT_EQ(part.frames.size(0), 4);
  for (int64_t k = 0; k < 4; ++k) EXPECT_EQ(frame_index(part.frames[k]), want[2 + k]);
}

TEST_F(VideoFiles, AVariableFrameRateFileComesOutEvenlySpaced) {
  // 12 frames at uneven times: bursts and gaps.
  const std::vector<double> times = {0.0,   0.010, 0.020, 0.030, 0.200, 0.210,
                                     0.400, 0.410, 0.420, 0.600, 0.800, 1.000};
  const auto clip = counter_clip(12, 32, 32);
  const std::string file = path("vfr.mkv");
  VideoWriteOptions w;
  w.fps = 10;
  w.crf = 0;
  w.timestamps = times;
  write_video(file, clip, w);
  const VideoFrames all = read_video(file);
  ASSERT_EQ(all.frames.size(0), 12);
  for (int64_t i = 0; i < 12; ++i) EXPECT_NEAR(all.timestamps[i], times[i], 1.5e-3);
  VideoReadOptions r;
  r.target_fps = 5;  // outputs at 0, 0.2, 0.4, 0.6, 0.8, 1.0 s
  const VideoFrames even = read_video(file, r);
  const std::vector<int64_t> want = {0, 4, 6, 9, 10, 11};
  ASSERT_EQ(even.frames.size(0), 6);
  for (int64_t k = 0; k < 6; ++k) EXPECT_EQ(frame_index(even.frames[k]), want[k]) << k;
}

TEST_F(VideoFiles, BadFilesAndArgumentsAreRefusedInOneLineNamingThem) {
  auto expect_error = [](const std::function<void()>& f, const std::string& part) {
    try {
      f();
      ADD_FAILURE() << "no error; expected one containing " << part;
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(part), std::string::npos) << what;
      EXPECT_EQ(what.find('\n'), std::string::npos) << what;
    }
  };
  const std::string missing = path("missing.mp4");
  expect_error([&] { read_video(missing); }, "missing.mp4: no such video file");
  const std::string garbage = path("garbage.mp4");
  std::ofstream(garbage) << std::string(4096, 'x');
  expect_error([&] { read_video(garbage); }, "garbage.mp4");
  expect_error([&] { probe_video(garbage); }, "garbage.mp4");
  // A truncated file: the first third of a real one.
  const std::string good = path("good.mp4");
  write_video(good, counter_clip(9, 32, 32));
  std::string bytes;
  {
    std::ifstream in(good, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  const std::string cut = path("cut.mp4");
  std::ofstream(cut, std::ios::binary) << bytes.substr(0, bytes.size() / 3);
  expect_error([&] { read_video(cut); }, "cut.mp4");
  // An audio-free, video-free container is not a video: a PNG renamed.
  expect_error([&] { write_video(path("x.avi2"), counter_clip(2, 8, 8)); },
               "cannot write a video with extension \".avi2\"");
  expect_error([&] { write_video(path("odd.mp4"), counter_clip(2, 9, 8)); }, "even sides");
  expect_error([&] { write_video(path("bad.mp4"), torch::zeros({2, 8, 8})); }, "[F, H, W, 3]");
  expect_error([&] { write_video(path("nodir/x.mp4"), counter_clip(2, 8, 8)); },
               "cannot create the file");
  VideoWriteOptions w;
  w.timestamps = {0.0, 0.0};
  expect_error([&] { write_video(path("t.mkv"), counter_clip(2, 8, 8), w); }, "must increase");
  EXPECT_FALSE(fs::exists(path("odd.mp4")));
}

}  // namespace
