#pragma once
// The SDXL reference fixtures (tests/golden/sdxl, copied from ../shared/fixtures/sdxl) and the
// call behind their txt2img references, shared by the SDXL unit tests.

#include "difftrain/families/stable_diffusion/pipeline.h"
#include "source_dir.h"

#include <string>
#include <vector>

namespace difftrain::test {

inline const std::string kSdxlGolden =
    std::string(difftrain_test::source_dir()) + "/tests/golden/sdxl";
inline const std::string kTinySdxl = kSdxlGolden + "/tiny_sdxl";

inline const std::vector<std::string> kSdxlPrompts = {
    "a photo of a cat", "an astronaut riding a horse on mars, highly detailed"};

/// txt2img_seed42.json's call: height = width = 32, guidance 5, 8 steps, seed 42, the negative
/// prompt "blurry, low quality".
inline families::stable_diffusion::TextToImageOptions sdxl_fixture_call() {
  families::stable_diffusion::TextToImageOptions o;
  o.prompts = kSdxlPrompts;
  o.negative_prompts = {"blurry, low quality"};
  o.guidance_scale = 5.0;
  o.num_inference_steps = 8;
  o.height = o.width = 32;
  o.seed = 42;
  return o;
}

}  // namespace difftrain::test
