#pragma once
// Qwen-Image-Edit training data: (control image(s), target image, instruction) triples from an
// image folder, in the two layouts edit trainers use —
//   - a `control/` folder beside the targets: `control/<stem>.<ext>` for one control image, or
//     `control/<stem>_0.<ext>`, `<stem>_1.<ext>`, ... for several (musubi-tuner's naming);
//   - metadata.jsonl lines with a `control_image` field (a path relative to the folder, or a list
//     of them) beside `file_name` and the caption column.
// Each target is resized (shorter side) and centre-cropped to the run's size, and its controls
// exactly the same way, so that the pair stays aligned; everything a step needs is computed once
// (the targets' VAE posteriors, the controls' normalised packed latents, the instruction encoded
// by Qwen2.5-VL with the control images in the prompt) and the encoder released.

#include "edit.h"

#include "difftrain/data/dataset.h"

#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace difftrain::families::qwen_image {

struct EditPair {
  std::string target;                 ///< the target image's path
  std::vector<std::string> controls;  ///< its control images' paths, in order
  std::string caption;                ///< the instruction
};

/// The pairs of `dir` (see the file comment); `instance_prompt` is the caption of images that
/// have none. Throws difftrain::Error naming the file for a target without control images, a
/// control image that is missing, targets with different numbers of controls, or a target with
/// no caption and no instance prompt.
std::vector<EditPair> find_edit_pairs(const std::string& dir, const std::string& caption_column,
                                      const std::string& caption_extension,
                                      const std::string& instance_prompt);

/// uint8 [H, W, 3] resized (PIL bicubic) so that it covers height x width, then centre-cropped.
torch::Tensor cover_and_center_crop(const torch::Tensor& image, int64_t height, int64_t width);

/// The encoded pairs: columns "index" [N], "latent_mean" / "latent_logvar" [N, C, h, w] (the
/// targets' posteriors), "reference_latents" [N, Lr, 4C], "reference_shapes" int64 [N, R, 3],
/// "prompt_embeds" [N, L, D] (zero-padded to the longest), "prompt_attention_mask" int64 [N, L].
struct EditEncoders {
  const diffusion::Qwen3TextEncoder* encoder = nullptr;
  models::Qwen2_5VisionTransformer visual{nullptr};
  models::Qwen2VLImageProcessorOptions processor;
  models::AutoencoderKLQwenImage vae{nullptr};
  EditKind kind = EditKind::kEdit;
};
std::shared_ptr<data::TensorDataset> encode_edit_pairs(const std::vector<EditPair>& pairs,
                                                       int64_t height, int64_t width,
                                                       EditEncoders& enc,
                                                       const std::function<void()>& progress);

}  // namespace difftrain::families::qwen_image
