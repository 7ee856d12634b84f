#pragma once
// The one way datasets read a media file, an image or a clip: a reader per kind of file, chosen by
// the file's extension. An image is a clip of one frame. The image reader (PNG, JPEG, BMP and,
// where built with libwebp, WebP) is registered by difftrain itself; a family whose data are
// videos registers a reader for its containers (register_media_reader), and every folder dataset
// then lists and reads those files too.
#include <torch/types.h>

#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace difftrain::data {

/// A reader of one kind of media file.
struct MediaReader {
  std::string name;                     ///< for messages: "image", "video"
  std::vector<std::string> extensions;  ///< lower-case, with the dot: ".png", ".mp4"
  /// The frames, uint8 [F, H, W, C] on the CPU (F = 1 for an image), with `channels` channels
  /// (3 RGB or 1 luminance). Throws a one-line difftrain::Error naming the path.
  std::function<torch::Tensor(const std::string& path, int channels)> read;
  /// {height, width} of its frames, from the file's header where it can (without decoding the
  /// pixels). Throws as read.
  std::function<std::array<int64_t, 2>(const std::string& path)> size;
};

/// Adds `reader`; a later reader of an extension already taken wins for that extension.
void register_media_reader(MediaReader reader);
/// The reader of `path`'s extension (any case), or nullptr when no reader takes it.
const MediaReader* media_reader_for(const std::string& path);
/// Whether some reader takes `path` (by its extension).
bool is_media_file(const std::string& path);
/// `path` read by its reader: uint8 [F, H, W, C]. Throws difftrain::Error naming the path when
/// no reader takes its extension, or as the reader does.
torch::Tensor read_media(const std::string& path, int channels = 3);
/// {height, width} of `path`'s frames (its reader's size()).
std::array<int64_t, 2> media_size(const std::string& path);

}  // namespace difftrain::data
