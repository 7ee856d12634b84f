#pragma once
// The data side of a video family's training run, a component every video family composes (Wan
// first): captioned clips and images from --train_data_dir (`clip.mp4` + `clip.txt`, images,
// folders of frames, or metadata.jsonl with a `video` / `file_name` column), decoded through
// io::read_video, cut into clips as musubi-tuner's dataset config does (target_frames,
// frame_extraction head / chunk / slide / uniform / full, frame_stride, frame_sample,
// max_frames), optionally resampled to a frame rate by timestamps, resized to a resolution or
// aspect-ratio bucket, encoded once by the family's VAE into a latent cache (as musubi-tuner
// always caches), the captions into a text-embedding cache; batches of one (frames, size) bucket.
// Private to src/families.
#include <torch/torch.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "difftrain/accel/accelerator.h"
#include "difftrain/data/buckets.h"
#include "difftrain/data/dataset.h"
#include "difftrain/train/option_spec.h"
#include "difftrain/train/training_task.h"

namespace difftrain::families {

/// musubi-tuner's video dataset options (its dataset config's names), as family options.
struct VideoDataOptions {
  /// Clip lengths; each rounded down to 1 + 4k as musubi-tuner rounds (a VAE frame stride of 4).
  std::vector<int64_t> target_frames = {1};
  std::string frame_extraction = "head";  ///< head | chunk | slide | uniform | full
  int64_t frame_stride = 1;               ///< slide: the window's step
  int64_t frame_sample = 1;               ///< uniform: clips per target length
  int64_t max_frames = 129;               ///< full: the longest clip
  /// > 0: clips resampled to this rate by their frames' timestamps (musubi-tuner's source_fps to
  /// the model's rate; variable-frame-rate files too); 0 takes every decoded frame.
  double target_fps = 0;

  static VideoDataOptions from(const train::FamilyOptions& options);
};

/// --target_frames, --frame_extraction, --frame_stride, --frame_sample, --max_frames,
/// --target_fps (structural: the latent cache and the dataset's items depend on them).
std::vector<train::OptionSpec> video_data_option_specs();

/// A media file of the training folder: an image, a video file or a folder of frames, with its
/// caption.
struct MediaFile {
  std::string path;
  std::string caption;
  enum class Kind { kImage, kVideo, kFrames } kind = Kind::kImage;
};

/// The media files of `d.train_data_dir`: metadata.jsonl's lines in order ("video" or
/// "file_name", the caption under d.caption_column), else every image and video file found
/// recursively (sorted), each sub-folder with a caption file beside it (`clips/a/` +
/// `clips/a.txt`) taken as one clip of frames; captions from `<stem><caption_extension>` (the
/// whole file, stripped, as musubi-tuner reads it) or `instance_prompt` for every file. Throws a
/// one-line difftrain::Error naming the folder, line or file for a missing folder, nothing to
/// train on, a bad metadata line, a file outside the folder, or a file without a caption.
std::vector<MediaFile> list_media_files(const train::DataOptions& d,
                                        const std::string& instance_prompt);

/// The frames of a media file, uint8 [F, H, W, 3]: an image as one frame, a video decoded (with
/// target_fps > 0 resampled to that rate by timestamps), a folder's images in name order (one
/// size). Throws a one-line difftrain::Error naming the file.
torch::Tensor read_media_frames(const MediaFile& media, double target_fps);

/// musubi-tuner's frame extraction: the (start, length) of each clip of a video of
/// `frame_count` frames (an image is one clip of one frame). Lengths are the rounded
/// target_frames; clips longer than the video are skipped.
std::vector<std::pair<int64_t, int64_t>> extract_clips(int64_t frame_count,
                                                       const VideoDataOptions& options);

/// uint8 [F, H, W, 3] resized to cover height x width (scale = max(h / H, w / W), sides
/// int(side * scale + 0.5), musubi-tuner's resize_image_to_bucket: PIL lanczos when enlarging,
/// area-like PIL bilinear when reducing) and centre-cropped (floor offsets), as pixel values
/// float32 [3, F, height, width] in [-1, 1].
torch::Tensor clip_pixels(const torch::Tensor& frames, int64_t height, int64_t width);

/// One training item: a clip of a media file at its bucket size, and its caption.
struct ClipItem {
  int64_t media = 0;  ///< index into the listed media files
  int64_t start = 0, frames = 1;
  int64_t height = 0, width = 0;
  std::string caption;
};

class VideoData {
 public:
  /// What the family loaded for its data.
  struct Parts {
    /// Pixel values [1, 3, F, H, W] in [-1, 1] (float32, CPU) → the latents training sees, float32
    /// [1, C, f, h, w] (the family's VAE, mode or draw, normalisation).
    std::function<torch::Tensor(const torch::Tensor& pixels)> encode;
    /// Optional per-clip tensors computed once from the same pixels and given in every example
    /// under their names (image to video's first-frame "condition" latents, Wan 2.1's CLIP
    /// "image_embeds"): pixels [1, 3, F, H, W] -> float32 [1, ...].
    std::map<std::string, std::function<torch::Tensor(const torch::Tensor& pixels)>> extras;
    /// Captions → {"prompt_embeds": [N, L, D]} (rows zero-padded; "prompt_lengths" int64 [N] the
    /// real rows): cached trimmed, padded back to `text_length` rows in every example.
    std::function<std::map<std::string, torch::Tensor>(const std::vector<std::string>&)>
        encode_text;
    int64_t text_length = 512;
    /// What the caches depend on besides the data and these options: the VAE and text encoder
    /// (config and weights stamps), the family's encode rules.
    std::string latent_key, text_key;
    int64_t size_multiple = 16;
    std::string size_reason = "the VAE's factor times the patch size";
  };

  VideoData(train::TaskOptions options, VideoDataOptions video)
      : o_(std::move(options)), v_(std::move(video)) {}

  /// Lists the media, cuts the clips, assigns buckets and fills (or reuses) the latent and text
  /// caches under the run's cache folder: every rank encodes its share of the files, the main rank
  /// joins them, every rank loads the result. Throws difftrain::Error naming a file that cannot be
  /// decoded.
  void build(accel::Accelerator& acc, const std::string& output_dir, const Parts& parts);

  std::shared_ptr<data::Dataset> dataset() const { return dataset_; }
  /// The epoch of the caption draws (--caption_dropout_rate, --caption_dropout_every_n_epochs:
  /// a dropped caption's example carries the empty caption's cached embeddings).
  void set_epoch(int64_t epoch);
  /// Every global batch from one (frames, height, width) bucket; a function of the epoch alone.
  std::function<std::vector<int64_t>(int64_t)> sampler() const;
  const std::vector<ClipItem>& items() const { return items_; }
  const std::vector<MediaFile>& media() const { return media_; }
  /// The text cache's entries of `caption` ({"prompt_embeds" [L, D] trimmed}), for validation.
  torch::Tensor caption_embeds(const std::string& caption) const;

 private:
  train::TaskOptions o_;
  VideoDataOptions v_;
  std::vector<MediaFile> media_;
  std::vector<ClipItem> items_;
  std::shared_ptr<data::Dataset> dataset_;
  std::shared_ptr<data::Dataset> clips_;  // dataset_ as the cached clips (set_epoch())
  std::shared_ptr<data::BucketLayout> buckets_;
  std::map<std::string, torch::Tensor> text_;  // caption → [L, D]
};

}  // namespace difftrain::families
