#pragma once
// Video files through Debian's FFmpeg libraries (libavformat, libavcodec, libswscale): decoding
// clips for training data and writing sampled clips (MP4 / WebM / MKV / MOV, animated WebP, GIF),
// as Diffusers' export_to_video and musubi-tuner's PyAV reading do. Pixels are uint8 [F, H, W, 3]
// (RGB, frame-major, as numpy holds a clip). A build without the FFmpeg headers keeps the API and
// refuses every call in one line naming the Debian packages (video_supported() says which).
#include <torch/types.h>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace difftrain::io {

/// Whether this build reads and writes videos (it was built with libavformat-dev,
/// libavcodec-dev and libswscale-dev).
bool video_supported();

/// A file's video stream, from its header (no frame decoded).
struct VideoInfo {
  int64_t height = 0, width = 0;
  /// The stream's frame count where the container records it, else an estimate from its
  /// duration and frame rate (0 when neither is known).
  int64_t num_frames = 0;
  /// The stream's average frame rate (avg_frame_rate, else r_frame_rate; 0 when unknown).
  double fps = 0;
};

/// The first video stream of `path` described. Throws a one-line difftrain::Error naming the path
/// for a missing, unreadable or corrupt file, or one without a video stream.
VideoInfo probe_video(const std::string& path);

/// Which frames read_video keeps.
struct VideoReadOptions {
  /// Decoded frames [start_frame, end_frame) of the output sequence; end_frame < 0 reads to the
  /// end (read_video stops decoding there).
  int64_t start_frame = 0, end_frame = -1;
  /// > 0: resample to this constant rate by presentation time: output frame k is the first decoded
  /// frame whose timestamp (from the first frame's) is >= k / target_fps, each decoded frame used
  /// at most once (musubi-tuner's source_fps → target_fps frame dropping, which counts frames and
  /// so assumes a constant rate; timestamps make variable-frame-rate files come out evenly spaced
  /// too; where a frame falls exactly on an output time, musubi's accumulated float may take the
  /// next frame instead). 0 keeps every frame.
  double target_fps = 0;
};

/// A decoded clip: uint8 [F, H, W, 3] RGB, each frame's presentation time in seconds from the
/// first frame's, and the stream's frame rate (VideoInfo::fps).
struct VideoFrames {
  torch::Tensor frames;
  std::vector<double> timestamps;
  double fps = 0;
};

/// Decodes the first video stream of `path` (any container and codec FFmpeg has: MP4, WebM, MOV,
/// MKV, AVI, GIF; not animated WebP, which FFmpeg 5-7 cannot decode), converting each frame to
/// RGB24 with its own size (a stream whose size changes mid-way is refused). Throws a one-line
/// difftrain::Error naming the path for a missing, unreadable, corrupt or frameless file, one
/// without a video stream, or frames over 16384 pixels a side.
VideoFrames read_video(const std::string& path, const VideoReadOptions& options = {});

/// How write_video encodes.
struct VideoWriteOptions {
  double fps = 16;  ///< frames per second (Diffusers' export_to_video default is 10; Wan's is 16)
  /// H.264 / VP9 constant rate factor (lower is better; x264's 0 is lossless), and the WebP
  /// quality 0..100 for .webp (100 with lossless).
  int crf = 18;
  bool lossless = false;  ///< .webp: lossless frames
  /// Each frame's presentation time in seconds (increasing), for a variable-frame-rate file;
  /// empty: frame i at i / fps. (Stored in milliseconds.)
  std::vector<double> timestamps;
};

/// Writes uint8 [F, H, W, 3] (or float in [0, 1], rounded as Diffusers' numpy_to_pil: x * 255
/// then round) to `path`, the format by extension: .mp4 / .mov / .mkv (H.264 via libx264, yuv420p,
/// else MPEG-4 part 2 where the build has no libx264), .webm (VP9), .webp (animated WebP, loops),
/// .gif (loops; 8-bit palette by FFmpeg's RGB8 conversion with dithering). H.264 / VP9 need even
/// sides: an odd side is refused in one line. Written to a temporary file then renamed, so a
/// reader never sees half a video. Throws a one-line difftrain::Error naming the path for an
/// unknown extension, a bad tensor or an encoder failure.
void write_video(const std::string& path, const torch::Tensor& frames,
                 const VideoWriteOptions& options = {});

/// The extensions write_video takes (".mp4", ...) and read_video's registered ones (for
/// media readers and messages).
const std::vector<std::string>& video_write_extensions();
const std::vector<std::string>& video_read_extensions();

}  // namespace difftrain::io
