#pragma once
// The captioned-image dataset of text-to-image training, a component a model family composes
// (Stable Diffusion, SDXL; next FLUX.1): the instance images with their captions (metadata.jsonl,
// caption files, or one instance prompt), for DreamBooth the class images with the class prompt,
// aspect-ratio bucket slots, and the cached latents / text embeddings that replace pixels and token
// ids when present.

#include "difftrain/data/dataset.h"
#include "difftrain/data/image_folder.h"
#include "difftrain/train/training_task.h"

#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace difftrain::train {

/// The image-folder options of the run (resolution, crops, flips, seed, captions) for `dir`.
data::ImageFolderOptions image_folder_options(const DataOptions& o, const std::string& dir,
                                              int channels);

/// Adds the token ids of `caption` to an example under `prefix` ("" or "class_"); a family's
/// tokenizers decide the entries ("input_ids", SDXL's "input_ids_2").
using CaptionIds =
    std::function<void(data::Example&, const std::string& prefix, const std::string& caption)>;

/// The class half of a DreamBooth batch draws its randomness under keys far from the instance
/// indices, so the two halves never share a stream: example `index`'s class half uses
/// class_key(index).
inline constexpr int64_t kClassKeyOffset = int64_t{1} << 40;
inline int64_t class_key(int64_t index) { return index + kClassKeyOffset; }

/// Images plus a caption each: the instance images, and for DreamBooth the class images. Example
/// entries per half (prefix "" or "class_"): "pixel_values" [3, H, W] (or, cached,
/// "latent_mean" / "latent_logvar" [C, h, w]), "original_size" [2], "crop_top_left" [2], and the
/// caption as CaptionIds' entries or the cached text embeddings ("prompt_embeds", ...); plus
/// "index".
class TextImageDataset : public data::Dataset {
 public:
  struct Half {
    std::shared_ptr<data::ImageFolderDataset> images;
    std::vector<std::string> captions;        ///< one per image
    std::vector<torch::Tensor> mean, logvar;  ///< cached posteriors [C, h, w] per image, or empty
    torch::Tensor geometry;            ///< with the cache: [N, 4] original h, w, crop top, left
    std::vector<torch::Tensor> masks;  ///< with the cache and --masked_loss: [1, H, W] per image
  };

  TextImageDataset(Half instance, std::optional<Half> cls, CaptionIds caption_ids);

  /// The slots (with buckets), else the larger half's image count.
  int64_t size() const override;
  /// Example `index` is a slot: with buckets, slot i shows image slots[i] (the class half image
  /// index % class images).
  data::Example get(int64_t index) const override;

  /// Aspect-ratio buckets: the slots (data::BucketLayout) replace the plain indices.
  void set_slots(std::vector<int64_t> slot_image) { slot_image_ = std::move(slot_image); }
  /// The image folders' epoch (random crops and flips).
  void set_epoch(int64_t epoch);
  /// What the instance captions go through each epoch (dropout, shuffling, tag dropout; their
  /// prefix and suffix are in Half::captions already), example i drawing from
  /// (seed, epoch, i); the class half's prompt is never changed.
  void set_caption_processing(CaptionProcessing processing, uint64_t seed) {
    processing_ = std::move(processing);
    caption_seed_ = seed;
  }

  Half& instance() { return instance_; }
  std::optional<Half>& class_half() { return class_; }
  /// Cached text embeddings by caption (empty: tokenise instead): the example entries
  /// ("prompt_embeds", SDXL's "pooled_prompt_embeds") of each caption.
  std::map<std::string, std::map<std::string, torch::Tensor>> cached_text;

 private:
  void add(data::Example& ex, const std::string& prefix, const Half& half, int64_t i,
           int64_t key) const;

  Half instance_;
  CaptionProcessing processing_;
  uint64_t caption_seed_ = 0;
  int64_t epoch_ = 0;
  std::optional<Half> class_;
  CaptionIds caption_ids_;
  std::vector<int64_t> slot_image_;  // empty: example i is image i
};

/// The images of `dir` (image_folder_options(d, dir, 3)) with their captions: `prompt` for every
/// image when given (DreamBooth's instance or class prompt), else each image's caption
/// (metadata.jsonl's caption_column, or a caption file). Throws difftrain::Error naming the first
/// image without a caption and the three ways to give one.
TextImageDataset::Half captioned_images(const DataOptions& d, const std::string& dir,
                                        const std::string& prompt);

/// Images (.png .jpg .jpeg .bmp, any case) under `dir`, recursively; 0 when it is not a folder.
int64_t count_images(const std::string& dir);

}  // namespace difftrain::train
