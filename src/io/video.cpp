// Video files through FFmpeg's libraries (io/video.h). Built with DIFFTRAIN_HAVE_FFMPEG where
// CMake found libavformat, libavcodec, libavutil and libswscale; without, every call is refused
// naming the Debian packages.
#include "difftrain/io/video.h"

#include "difftrain/core/error.h"

#include <fmt/format.h>
#include <torch/torch.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <memory>

#if DIFFTRAIN_HAVE_FFMPEG
extern "C" {
#include <libavcodec/avcodec.h>
#include <libavformat/avformat.h>
#include <libavutil/imgutils.h>
#include <libavutil/opt.h>
#include <libswscale/swscale.h>
}
#endif

namespace difftrain::io {
namespace fs = std::filesystem;

namespace {

std::string lower_extension(const std::string& path) {
  std::string ext = fs::path(path).extension().string();
  std::transform(ext.begin(), ext.end(), ext.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return ext;
}

constexpr int64_t kMaxSide = 16384;

}  // namespace

const std::vector<std::string>& video_write_extensions() {
  static const std::vector<std::string> e = {".mp4", ".mov", ".mkv", ".webm", ".webp", ".gif"};
  return e;
}

const std::vector<std::string>& video_read_extensions() {
  static const std::vector<std::string> e = {".mp4", ".webm", ".mov", ".mkv",
                                             ".avi", ".m4v",  ".gif"};
  return e;
}

#if !DIFFTRAIN_HAVE_FFMPEG

bool video_supported() { return false; }

namespace {
[[noreturn]] void no_ffmpeg(const std::string& path) {
  throw Error(path +
              ": this build of difftrain has no video support; install libavformat-dev "
              "libavcodec-dev libswscale-dev (scripts/setup does) and rebuild");
}
}  // namespace

VideoInfo probe_video(const std::string& path) { no_ffmpeg(path); }
VideoFrames read_video(const std::string& path, const VideoReadOptions&) { no_ffmpeg(path); }
void write_video(const std::string& path, const torch::Tensor&, const VideoWriteOptions&) {
  no_ffmpeg(path);
}

#else

bool video_supported() { return true; }

namespace {

std::string av_error(int code) {
  char buf[AV_ERROR_MAX_STRING_SIZE] = {0};
  av_strerror(code, buf, sizeof(buf));
  return buf;
}

struct FormatInput {
  AVFormatContext* ctx = nullptr;
  ~FormatInput() {
    if (ctx) avformat_close_input(&ctx);
  }
};
struct CodecContext {
  AVCodecContext* ctx = nullptr;
  ~CodecContext() {
    if (ctx) avcodec_free_context(&ctx);
  }
};
struct Frame {
  AVFrame* f = av_frame_alloc();
  ~Frame() { av_frame_free(&f); }
};
struct Packet {
  AVPacket* p = av_packet_alloc();
  ~Packet() { av_packet_free(&p); }
};
struct Scaler {
  SwsContext* ctx = nullptr;
  ~Scaler() { sws_freeContext(ctx); }
};

// FFmpeg's own log says only errors (x264 prints its statistics at info level).
void quiet_ffmpeg() {
  static const bool once = [] {
    av_log_set_level(AV_LOG_ERROR);
    return true;
  }();
  (void)once;
}

// Opens `path` and finds its first video stream; throws naming the file.
int open_video(const std::string& path, FormatInput& in) {
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    throw Error(path + ": no such video file; check the path (or the dataset's file_name)");
  }
  quiet_ffmpeg();
  int rc = avformat_open_input(&in.ctx, path.c_str(), nullptr, nullptr);
  if (rc < 0) {
    throw Error(
        fmt::format("{}: cannot open as a video ({}); is it a complete MP4, WebM, MOV or "
                    "MKV file?",
                    path, av_error(rc)));
  }
  rc = avformat_find_stream_info(in.ctx, nullptr);
  if (rc < 0) {
    throw Error(fmt::format("{}: cannot read the video's streams ({}); the file may be corrupt",
                            path, av_error(rc)));
  }
  const int stream = av_find_best_stream(in.ctx, AVMEDIA_TYPE_VIDEO, -1, -1, nullptr, 0);
  if (stream < 0) {
    throw Error(path + ": has no video stream; give a video file (or an image)");
  }
  return stream;
}

double stream_fps(const AVStream* s) {
  AVRational r = s->avg_frame_rate;
  if (r.num <= 0 || r.den <= 0) r = s->r_frame_rate;
  return r.num > 0 && r.den > 0 ? av_q2d(r) : 0.0;
}

}  // namespace

VideoInfo probe_video(const std::string& path) {
  FormatInput in;
  const int index = open_video(path, in);
  const AVStream* s = in.ctx->streams[index];
  VideoInfo info;
  info.width = s->codecpar->width;
  info.height = s->codecpar->height;
  info.fps = stream_fps(s);
  if (s->nb_frames > 0) {
    info.num_frames = s->nb_frames;
  } else if (info.fps > 0) {
    double seconds = 0;
    if (s->duration != AV_NOPTS_VALUE) {
      seconds = static_cast<double>(s->duration) * av_q2d(s->time_base);
    } else if (in.ctx->duration != AV_NOPTS_VALUE) {
      seconds = static_cast<double>(in.ctx->duration) / AV_TIME_BASE;
    }
    info.num_frames = static_cast<int64_t>(std::llround(seconds * info.fps));
  }
  if (info.width <= 0 || info.height <= 0) {
    throw Error(path + ": the video stream has no frame size; the file may be corrupt");
  }
  return info;
}

VideoFrames read_video(const std::string& path, const VideoReadOptions& options) {
  if (options.start_frame < 0) throw Error(path + ": start_frame must be >= 0");
  FormatInput in;
  const int index = open_video(path, in);
  AVStream* stream = in.ctx->streams[index];
  const AVCodec* codec = avcodec_find_decoder(stream->codecpar->codec_id);
  if (!codec) {
    throw Error(
        fmt::format("{}: no decoder for its video codec ({}) in this FFmpeg build; "
                    "re-encode it to H.264 (e.g. ffmpeg -i in -c:v libx264 out.mp4)",
                    path, avcodec_get_name(stream->codecpar->codec_id)));
  }
  CodecContext dec;
  dec.ctx = avcodec_alloc_context3(codec);
  int rc = avcodec_parameters_to_context(dec.ctx, stream->codecpar);
  dec.ctx->thread_count = 1;
  if (rc >= 0) rc = avcodec_open2(dec.ctx, codec, nullptr);
  if (rc < 0) {
    throw Error(
        fmt::format("{}: cannot open its {} decoder ({})", path, codec->name, av_error(rc)));
  }

  VideoFrames out;
  out.fps = stream_fps(stream);
  const double time_base = av_q2d(stream->time_base);
  std::vector<torch::Tensor> frames;
  Scaler scaler;
  Frame frame;
  Packet packet;
  int64_t width = 0, height = 0;
  int64_t decoded = 0;      // frames decoded so far
  int64_t next_output = 0;  // the output index the next kept frame takes
  bool have_first_pts = false;
  double first_pts = 0;
  bool done = false;

  // Takes one decoded frame: resampling by time, the [start, end) window, RGB conversion.
  auto take = [&](AVFrame* f) {
    const int64_t ts = f->best_effort_timestamp;
    double t = ts == AV_NOPTS_VALUE ? (out.fps > 0 ? static_cast<double>(decoded) / out.fps : 0.0)
                                    : static_cast<double>(ts) * time_base;
    ++decoded;
    if (!have_first_pts) {
      first_pts = t;
      have_first_pts = true;
    }
    t -= first_pts;
    int64_t k = next_output;
    if (options.target_fps > 0) {
      // The first output index whose time k / fps this frame reaches or passes; frames that
      // reach none (between two output times) are dropped.
      const double eps = 1e-6;
      if (t + eps < static_cast<double>(next_output) / options.target_fps) return;
      k = next_output;
    }
    ++next_output;
    if (options.end_frame >= 0 && k >= options.end_frame) {
      done = true;
      return;
    }
    if (k < options.start_frame) return;
    if (f->width <= 0 || f->height <= 0 || f->width > kMaxSide || f->height > kMaxSide) {
      throw Error(fmt::format("{}: frame {} is {}x{}; frames must be 1..{} pixels a side", path,
                              decoded - 1, f->width, f->height, kMaxSide));
    }
    if (width == 0) {
      width = f->width;
      height = f->height;
    } else if (f->width != width || f->height != height) {
      throw Error(
          fmt::format("{}: the frame size changes from {}x{} to {}x{} at frame {}; "
                      "re-encode it at one size",
                      path, width, height, f->width, f->height, decoded - 1));
    }
    scaler.ctx = sws_getCachedContext(
        scaler.ctx, f->width, f->height, static_cast<AVPixelFormat>(f->format), f->width, f->height,
        AV_PIX_FMT_RGB24, SWS_BICUBIC | SWS_ACCURATE_RND, nullptr, nullptr, nullptr);
    if (!scaler.ctx) {
      throw Error(fmt::format("{}: cannot convert its pixel format ({}) to RGB", path,
                              av_get_pix_fmt_name(static_cast<AVPixelFormat>(f->format))));
    }
    auto rgb = torch::empty({height, width, 3}, torch::kUInt8);
    uint8_t* dst[4] = {rgb.data_ptr<uint8_t>(), nullptr, nullptr, nullptr};
    int dst_stride[4] = {static_cast<int>(width * 3), 0, 0, 0};
    sws_scale(scaler.ctx, f->data, f->linesize, 0, f->height, dst, dst_stride);
    frames.push_back(rgb);
    out.timestamps.push_back(t);
  };

  auto drain = [&]() {
    while (!done) {
      const int r = avcodec_receive_frame(dec.ctx, frame.f);
      if (r == AVERROR(EAGAIN) || r == AVERROR_EOF) return;
      if (r < 0) {
        throw Error(fmt::format("{}: cannot decode frame {} ({}); the file may be corrupt", path,
                                decoded, av_error(r)));
      }
      take(frame.f);
      av_frame_unref(frame.f);
    }
  };

  while (!done) {
    rc = av_read_frame(in.ctx, packet.p);
    if (rc == AVERROR_EOF) break;
    if (rc < 0) {
      throw Error(fmt::format("{}: cannot read past frame {} ({}); the file may be truncated", path,
                              decoded, av_error(rc)));
    }
    if (packet.p->stream_index == index) {
      const int s = avcodec_send_packet(dec.ctx, packet.p);
      av_packet_unref(packet.p);
      if (s < 0 && s != AVERROR(EAGAIN)) {
        throw Error(fmt::format("{}: cannot decode frame {} ({}); the file may be corrupt", path,
                                decoded, av_error(s)));
      }
      drain();
    } else {
      av_packet_unref(packet.p);
    }
  }
  if (!done) {
    avcodec_send_packet(dec.ctx, nullptr);  // flush the decoder's delayed frames
    drain();
  }
  if (frames.empty()) {
    throw Error(decoded == 0
                    ? path + ": no frame could be decoded; the file may be empty or corrupt"
                    : fmt::format("{}: has {} frame(s), none at or after frame {}", path, decoded,
                                  options.start_frame));
  }
  out.frames = torch::stack(frames);
  return out;
}

namespace {

struct FormatOutput {
  AVFormatContext* ctx = nullptr;
  bool opened = false;
  ~FormatOutput() {
    if (ctx) {
      if (opened) avio_closep(&ctx->pb);
      avformat_free_context(ctx);
    }
  }
};

// The muxer name and encoder choices per extension.
struct Target {
  const char* muxer;
  std::vector<std::string> encoders;   // the first this FFmpeg has
  std::vector<AVPixelFormat> formats;  // the first the encoder takes
};

Target target_of(const std::string& path, const std::string& ext) {
  if (ext == ".mp4" || ext == ".mov" || ext == ".mkv") {
    return {ext == ".mp4"   ? "mp4"
            : ext == ".mov" ? "mov"
                            : "matroska",
            {"libx264", "mpeg4"},
            {AV_PIX_FMT_YUV420P}};
  }
  if (ext == ".webm") return {"webm", {"libvpx-vp9", "libvpx"}, {AV_PIX_FMT_YUV420P}};
  if (ext == ".webp") return {"webp", {"libwebp_anim"}, {AV_PIX_FMT_RGB32, AV_PIX_FMT_YUV420P}};
  if (ext == ".gif") return {"gif", {"gif"}, {AV_PIX_FMT_RGB8}};
  std::string known;
  for (const auto& e : video_write_extensions()) known += (known.empty() ? "" : " ") + e;
  throw Error(fmt::format("{}: cannot write a video with extension \"{}\"; use one of {}", path,
                          ext, known));
}

// The encoder's pixel formats (AV_PIX_FMT_NONE-terminated; nullptr: any): FFmpeg 7.1 replaced
// AVCodec::pix_fmts with avcodec_get_supported_config.
const AVPixelFormat* pixel_formats(const AVCodec* codec) {
#if LIBAVCODEC_VERSION_INT >= AV_VERSION_INT(61, 13, 100)
  const void* out = nullptr;
  int count = 0;
  if (avcodec_get_supported_config(nullptr, codec, AV_CODEC_CONFIG_PIX_FORMAT, 0, &out, &count) <
      0) {
    return nullptr;
  }
  return static_cast<const AVPixelFormat*>(out);
#else
  return codec->pix_fmts;
#endif
}

}  // namespace

void write_video(const std::string& path, const torch::Tensor& frames_in,
                 const VideoWriteOptions& options) {
  if (!frames_in.defined() || frames_in.dim() != 4 || frames_in.size(3) != 3 ||
      frames_in.size(0) < 1) {
    throw Error(path + ": a video to write must be [F, H, W, 3] with F >= 1");
  }
  if (!(options.fps > 0)) throw Error(path + ": the frame rate must be > 0");
  torch::Tensor frames = frames_in.cpu();
  if (frames.scalar_type() != torch::kUInt8) {
    frames = frames.to(torch::kFloat).mul(255).round().clamp(0, 255).to(torch::kUInt8);
  }
  frames = frames.contiguous();
  const int64_t F = frames.size(0), H = frames.size(1), W = frames.size(2);
  const std::string ext = lower_extension(path);
  quiet_ffmpeg();
  const Target target = target_of(path, ext);
  const AVCodec* codec = nullptr;
  for (const auto& name : target.encoders) {
    codec = avcodec_find_encoder_by_name(name.c_str());
    if (codec) break;
  }
  if (!codec) {
    throw Error(fmt::format("{}: this FFmpeg build has no {} encoder; write .mp4 or .gif instead",
                            path, target.encoders.front()));
  }
  const bool yuv420 = target.formats.front() == AV_PIX_FMT_YUV420P;
  if (yuv420 && (H % 2 != 0 || W % 2 != 0)) {
    throw Error(
        fmt::format("{}: {} needs even sides and the frames are {}x{}; write .webp or "
                    ".gif, or sample an even size",
                    path, codec->name, H, W));
  }
  const std::string tmp = path + ".partial";
  FormatOutput out;
  int rc = avformat_alloc_output_context2(&out.ctx, nullptr, target.muxer, tmp.c_str());
  if (rc < 0 || !out.ctx) {
    throw Error(fmt::format("{}: no {} muxer in this FFmpeg build", path, target.muxer));
  }
  AVStream* stream = avformat_new_stream(out.ctx, nullptr);
  CodecContext enc;
  enc.ctx = avcodec_alloc_context3(codec);
  enc.ctx->width = static_cast<int>(W);
  enc.ctx->height = static_cast<int>(H);
  const bool timed = !options.timestamps.empty();
  if (timed) {
    if (static_cast<int64_t>(options.timestamps.size()) != F) {
      throw Error(
          fmt::format("{}: {} timestamps for {} frames", path, options.timestamps.size(), F));
    }
    for (int64_t i = 1; i < F; ++i) {
      if (std::llround(options.timestamps[i] * 1000) <=
          std::llround(options.timestamps[i - 1] * 1000)) {
        throw Error(path + ": frame timestamps must increase by at least 1 ms");
      }
    }
  }
  const AVRational rate = av_d2q(options.fps, 100000);
  enc.ctx->time_base = timed ? AVRational{1, 1000} : av_inv_q(rate);
  enc.ctx->framerate = rate;
  enc.ctx->thread_count = 1;
  enc.ctx->gop_size = 12;
  // The first pixel format of ours the encoder takes.
  const AVPixelFormat* formats = pixel_formats(codec);
  AVPixelFormat pix = AV_PIX_FMT_NONE;
  for (AVPixelFormat want : target.formats) {
    if (!formats) {
      pix = want;
      break;
    }
    for (const AVPixelFormat* p = formats; *p != AV_PIX_FMT_NONE; ++p) {
      if (*p == want) pix = want;
    }
    if (pix != AV_PIX_FMT_NONE) break;
  }
  if (pix == AV_PIX_FMT_NONE) pix = formats[0];
  enc.ctx->pix_fmt = pix;
  if (out.ctx->oformat->flags & AVFMT_GLOBALHEADER) enc.ctx->flags |= AV_CODEC_FLAG_GLOBAL_HEADER;
  const std::string name = codec->name;
  if (name == "libx264") {
    av_opt_set(enc.ctx->priv_data, "crf", std::to_string(options.crf).c_str(), 0);
    av_opt_set(enc.ctx->priv_data, "preset", "medium", 0);
  } else if (name == "libvpx-vp9" || name == "libvpx") {
    av_opt_set(enc.ctx->priv_data, "crf", std::to_string(options.crf).c_str(), 0);
    enc.ctx->bit_rate = 0;
  } else if (name == "mpeg4") {
    enc.ctx->flags |= AV_CODEC_FLAG_QSCALE;
    enc.ctx->global_quality = FF_QP2LAMBDA * 2;
  } else if (name == "libwebp_anim") {
    av_opt_set_int(enc.ctx->priv_data, "lossless", options.lossless ? 1 : 0, 0);
    av_opt_set_double(enc.ctx->priv_data, "quality", options.lossless ? 100.0 : 90.0, 0);
  }
  rc = avcodec_open2(enc.ctx, codec, nullptr);
  if (rc < 0) {
    throw Error(fmt::format("{}: cannot open the {} encoder for {}x{} frames ({})", path, name, W,
                            H, av_error(rc)));
  }
  avcodec_parameters_from_context(stream->codecpar, enc.ctx);
  stream->time_base = enc.ctx->time_base;
  if (ext == ".gif" || ext == ".webp") av_opt_set_int(out.ctx->priv_data, "loop", 0, 0);
  rc = avio_open(&out.ctx->pb, tmp.c_str(), AVIO_FLAG_WRITE);
  if (rc < 0) {
    throw Error(
        fmt::format("{}: cannot create the file ({}); check the folder exists and is "
                    "writable",
                    path, av_error(rc)));
  }
  out.opened = true;
  auto fail = [&](const std::string& what, int code) {
    avio_closep(&out.ctx->pb);
    out.opened = false;
    std::error_code ec;
    fs::remove(tmp, ec);
    throw Error(fmt::format("{}: {} ({})", path, what, av_error(code)));
  };
  rc = avformat_write_header(out.ctx, nullptr);
  if (rc < 0) fail("cannot write the container header", rc);

  Scaler scaler;
  scaler.ctx = sws_getContext(static_cast<int>(W), static_cast<int>(H), AV_PIX_FMT_RGB24,
                              static_cast<int>(W), static_cast<int>(H), pix,
                              SWS_BICUBIC | SWS_ACCURATE_RND | SWS_FULL_CHR_H_INT, nullptr, nullptr,
                              nullptr);
  if (!scaler.ctx) fail("cannot set up the RGB conversion", AVERROR(EINVAL));
  Frame frame;
  frame.f->format = pix;
  frame.f->width = static_cast<int>(W);
  frame.f->height = static_cast<int>(H);
  rc = av_frame_get_buffer(frame.f, 0);
  if (rc < 0) fail("cannot allocate a frame", rc);
  Packet packet;
  // A frame's duration in the encoder's time base, by its pts.
  std::vector<int64_t> pts_of(static_cast<size_t>(F));
  for (int64_t i = 0; i < F; ++i) {
    pts_of[i] = timed ? std::llround(options.timestamps[i] * 1000) : i;
  }
  auto frame_duration = [&](int64_t pts) -> int64_t {
    if (!timed) return 1;
    const auto it = std::upper_bound(pts_of.begin(), pts_of.end(), pts);
    if (it != pts_of.end()) return *it - pts;
    return F > 1 ? pts_of[F - 1] - pts_of[F - 2] : std::llround(1000 / options.fps);
  };
  auto pump = [&]() {
    while (true) {
      const int r = avcodec_receive_packet(enc.ctx, packet.p);
      if (r == AVERROR(EAGAIN) || r == AVERROR_EOF) return;
      if (r < 0) fail("the encoder failed", r);
      // The encoders leave a packet's duration 0 here; MP4's edit list then ends before the
      // last frame, which readers drop: every frame lasts until the next (the last one as long
      // as the one before it, or 1 / fps).
      if (packet.p->duration <= 0) packet.p->duration = frame_duration(packet.p->pts);
      av_packet_rescale_ts(packet.p, enc.ctx->time_base, stream->time_base);
      packet.p->stream_index = stream->index;
      const int w = av_interleaved_write_frame(out.ctx, packet.p);
      if (w < 0) fail("cannot write a packet", w);
    }
  };
  for (int64_t i = 0; i < F; ++i) {
    rc = av_frame_make_writable(frame.f);
    if (rc < 0) fail("cannot write a frame", rc);
    const uint8_t* src[4] = {frames[i].data_ptr<uint8_t>(), nullptr, nullptr, nullptr};
    const int src_stride[4] = {static_cast<int>(W * 3), 0, 0, 0};
    sws_scale(scaler.ctx, src, src_stride, 0, static_cast<int>(H), frame.f->data,
              frame.f->linesize);
    frame.f->pts = pts_of[i];
    rc = avcodec_send_frame(enc.ctx, frame.f);
    if (rc < 0) fail(fmt::format("cannot encode frame {}", i), rc);
    pump();
  }
  avcodec_send_frame(enc.ctx, nullptr);
  pump();
  rc = av_write_trailer(out.ctx);
  if (rc < 0) fail("cannot finish the container", rc);
  avio_closep(&out.ctx->pb);
  out.opened = false;
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) {
    fs::remove(tmp, ec);
    throw Error(
        fmt::format("{}: cannot move the finished video into place ({})", path, ec.message()));
  }
}

#endif

}  // namespace difftrain::io
