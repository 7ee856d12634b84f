// The bad-input catalogue's rows of the transformer families (docs/ERRORS.md, after the general
// ones): Z-Image, Qwen-Image and Qwen-Image-Edit.
#include "error_catalogue.h"
#include "train_util.h"

#include "difftrain/io/image.h"

#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <string>

namespace difftrain::testing {
namespace {

const std::string kGolden = kCatalogueGolden;

void write_text(const std::string& path, const std::string& text) {
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  std::ofstream(path, std::ios::binary) << text;
}

// A grey 32 x 48 PNG at `path`.
void write_png(const std::string& path) {
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  io::save_png(path, torch::full({32, 48, 3}, 128, torch::kUInt8));
}

const std::string kTinyQwen = kGolden + "/qwen_image/tiny_qwen_image";

// `difftrain train` of `model` on D (<tmp>/d: a.png captioned "a, grey, square") at 32 px, then
// `flags`.
std::vector<std::string> options_train(const std::string& t, const std::string& model,
                                       std::vector<std::string> flags) {
  write_png(t + "/d/a.png");
  write_text(t + "/d/a.txt", "a, grey, square");
  std::vector<std::string> args = {"train",       "--pretrained_model_name_or_path",
                                   model,         "--dataset",
                                   "imagefolder", "--train_data_dir",
                                   t + "/d",      "--resolution",
                                   "32",          "--output_dir",
                                   t + "/run"};
  args.insert(args.end(), flags.begin(), flags.end());
  return args;
}

}  // namespace

std::vector<Case> family_error_cases() {
  return {
      // ------------------------------------------------------------------ Z-Image
      {"ZImageHeightNotAMultipleOf16",
       "`difftrain sample --model tests/golden/z_image/tiny_z_image --prompt a --height 50`",
       "--height 50 must be a positive multiple of 16 (ZImagePipeline: 2 x the VAE factor; it "
       "does not round); try 48",
       1,
       [](const std::string& t) {
         return BadRun{{"sample", "--model", kGolden + "/z_image/tiny_z_image", "--prompt", "a",
                        "--height", "50", "--width", "32", "--num_inference_steps", "1", "--output",
                        t + "/s.png"}};
       }},
      {"ZImageFolderWithoutItsTokenizer",
       "`difftrain sample --model DIR --prompt a` where DIR (a ZImagePipeline folder) has no "
       "tokenizer/",
       "<tmp>/z/tokenizer: no such folder; model_index.json lists tokenizer, so the pipeline "
       "folder is incomplete (copy the whole folder)",
       1,
       [](const std::string& t) {
         const std::string z = kGolden + "/z_image/tiny_z_image";
         std::filesystem::create_directories(t + "/z");
         for (const char* part :
              {"model_index.json", "transformer", "vae", "scheduler", "text_encoder"}) {
           std::filesystem::create_symlink(std::filesystem::canonical(z + "/" + part),
                                           t + "/z/" + part);
         }
         return BadRun{{"sample", "--model", t + "/z", "--prompt", "a", "--output", t + "/s.png"}};
       }},
      // ------------------------------------------------------------------ Qwen-Image
      {"QwenImageGuidanceScale",
       "`difftrain sample --model tests/golden/qwen_image/tiny_qwen_image --prompt a "
       "--guidance_scale 4`",
       "--guidance_scale is for guidance-distilled models, and no Qwen-Image model is one: "
       "classifier-free guidance is --true_cfg_scale (> 1) with a --negative_prompt",
       1,
       [](const std::string& t) {
         return BadRun{{"sample", "--model", kGolden + "/qwen_image/tiny_qwen_image", "--prompt",
                        "a", "--guidance_scale", "4", "--height", "32", "--width", "32",
                        "--num_inference_steps", "1", "--output", t + "/s.png"}};
       }},
      {"QwenImageVaeConfigWithoutTemporalDownsamples",
       "`difftrain sample --model DIR --prompt a` where DIR's vae/config.json (a QwenImagePipeline "
       "folder) has dim_mult [1, 2, 4, 4] and temperal_downsample [false]",
       "<tmp>/q/vae/config.json: field \"temperal_downsample\" must have one entry per downsample "
       "(len(dim_mult) - 1 = 3)",
       1,
       [](const std::string& t) {
         const std::string q = kGolden + "/qwen_image/tiny_qwen_image";
         std::filesystem::create_directories(t + "/q/vae");
         for (const char* part :
              {"model_index.json", "transformer", "scheduler", "text_encoder", "tokenizer"}) {
           std::filesystem::create_symlink(std::filesystem::canonical(q + "/" + part),
                                           t + "/q/" + part);
         }
         write_text(t + "/q/vae/config.json",
                    R"({"_class_name": "AutoencoderKLQwenImage", "dim_mult": [1, 2, 4, 4],)"
                    R"( "temperal_downsample": [false]})");
         return BadRun{{"sample", "--model", t + "/q", "--prompt", "a", "--output", t + "/s.png"}};
       }},
      // ------------------------------------------------------------------ Qwen-Image-Edit
      {"QwenImageImageForTextToImage",
       "`difftrain sample --model tests/golden/qwen_image/tiny_qwen_image --prompt a --image "
       "a.png` (a QwenImagePipeline folder, no --pipeline)",
       "--image is for the Edit pipelines: this folder is a QwenImagePipeline (text to image); "
       "use a Qwen-Image-Edit folder, or --pipeline QwenImageEditPipeline / "
       "QwenImageEditPlusPipeline with one that has the vision tower",
       1,
       [](const std::string& t) {
         write_png(t + "/a.png");
         return BadRun{{"sample", "--model", kTinyQwen, "--prompt", "a", "--image", t + "/a.png",
                        "--num_inference_steps", "1", "--output", t + "/s.png"}};
       }},
      {"QwenImageEditTwoImages",
       "`difftrain sample --model DIR --pipeline QwenImageEditPipeline --prompt a --image a.png "
       "--image b.png`",
       "QwenImageEditPipeline takes one reference image, got 2; several images are "
       "QwenImageEditPlusPipeline's (Qwen-Image-Edit-2509 and later: --pipeline "
       "QwenImageEditPlusPipeline)",
       1,
       [](const std::string& t) {
         write_png(t + "/a.png");
         write_png(t + "/b.png");
         return BadRun{{"sample", "--model", kTinyQwen, "--pipeline", "QwenImageEditPipeline",
                        "--prompt", "a", "--image", t + "/a.png", "--image", t + "/b.png",
                        "--num_inference_steps", "1", "--output", t + "/s.png"}};
       }},
      {"QwenImageEditWithoutVisionTower",
       "`difftrain sample --model DIR --pipeline QwenImageEditPipeline ...` where DIR's "
       "text_encoder/config.json has no vision_config",
       "<tmp>/q/text_encoder/config.json: no \"vision_config\" object; the Edit pipelines need "
       "Qwen2.5-VL's vision tower (Qwen-Image-Edit's text_encoder/config.json has one)",
       1,
       [](const std::string& t) {
         const std::string q = kTinyQwen;
         std::filesystem::create_directories(t + "/q/text_encoder");
         for (const char* part :
              {"model_index.json", "transformer", "scheduler", "vae", "tokenizer"}) {
           std::filesystem::create_symlink(std::filesystem::canonical(q + "/" + part),
                                           t + "/q/" + part);
         }
         for (const auto& e : std::filesystem::directory_iterator(
                  std::filesystem::canonical(q + "/text_encoder"))) {
           if (e.path().filename() != "config.json") {
             std::filesystem::create_symlink(e.path(),
                                             t + "/q/text_encoder/" + e.path().filename().string());
           }
         }
         auto config = nlohmann::json::parse(std::ifstream(q + "/text_encoder/config.json"));
         config.erase("vision_config");
         write_text(t + "/q/text_encoder/config.json", config.dump());
         write_png(t + "/a.png");
         return BadRun{{"sample", "--model", t + "/q", "--pipeline", "QwenImageEditPipeline",
                        "--prompt", "a", "--image", t + "/a.png", "--num_inference_steps", "1",
                        "--output", t + "/s.png"}};
       }},
      {"QwenImageEditTrainWithoutControl",
       "`difftrain train --pretrained_model_name_or_path DIR --pipeline QwenImageEditPipeline "
       "--dataset imagefolder --train_data_dir D` where D/a.png has no control image",
       "<tmp>/d/a.png: no control image; Qwen-Image-Edit training pairs each target with "
       "control/a.png (or control/a_0.png, _1, ... for several) or a metadata.jsonl "
       "control_image field",
       1,
       [](const std::string& t) {
         write_png(t + "/d/a.png");
         write_text(t + "/d/a.txt", "make it red");
         return BadRun{{"train", "--pretrained_model_name_or_path", kTinyQwen, "--pipeline",
                        "QwenImageEditPipeline", "--dataset", "imagefolder", "--train_data_dir",
                        t + "/d", "--resolution", "32", "--lora", "--max_train_steps", "1",
                        "--output_dir", t + "/out"}};
       }},
      // ------------------------------------------------------------------ Wan
      {"WanSizeNotMultipleOf16",
       "`difftrain sample --model tests/golden/wan/tiny_wan --prompt a --height 40`",
       "--height 40: WanPipeline takes heights and widths divisible by 16", 1,
       [](const std::string& t) {
         return BadRun{{"sample", "--model", kGolden + "/wan/tiny_wan", "--prompt", "a", "--height",
                        "40", "--width", "48", "--num_inference_steps", "1", "--output",
                        t + "/s.png"}};
       }},
      {"WanA14bWithoutExpert",
       "`difftrain train --pretrained_model_name_or_path tests/golden/wan/tiny_wan_a14b ...` "
       "without --train_expert",
       "<golden>/wan/tiny_wan_a14b is Wan 2.2 A14B with two experts: pass --train_expert high "
       "(transformer, the noisy steps t >= boundary) or low (transformer_2), one per run",
       1,
       [](const std::string& t) {
         write_png(t + "/d/a.png");
         write_text(t + "/d/a.txt", "a square");
         return BadRun{{"train", "--pretrained_model_name_or_path", kGolden + "/wan/tiny_wan_a14b",
                        "--dataset", "imagefolder", "--train_data_dir", t + "/d", "--resolution",
                        "32", "--output_dir", t + "/run"}};
       }},
      {"WanCorruptVideo",
       "`difftrain train --pretrained_model_name_or_path tests/golden/wan/tiny_wan "
       "--train_data_dir D` where D/clip.mp4 is not a video",
       "<tmp>/d/clip.mp4: cannot open as a video (Invalid data found when processing input); is "
       "it a complete MP4, WebM, MOV or MKV file?",
       1,
       [](const std::string& t) {
         write_text(t + "/d/clip.mp4", std::string(2000, 'x'));
         write_text(t + "/d/clip.txt", "a clip");
         return BadRun{{"train", "--pretrained_model_name_or_path", kGolden + "/wan/tiny_wan",
                        "--dataset", "imagefolder", "--train_data_dir", t + "/d", "--resolution",
                        "32", "--output_dir", t + "/run"}};
       }},
      {"WanClipWithoutCaption",
       "`difftrain train --pretrained_model_name_or_path tests/golden/wan/tiny_wan "
       "--train_data_dir D` where D/a.png has no caption",
       "<tmp>/d/a.png: no caption; give it a .txt file beside it, a \"text\" in metadata.jsonl, "
       "or --instance_prompt for every file",
       1,
       [](const std::string& t) {
         write_png(t + "/d/a.png");
         return BadRun{{"train", "--pretrained_model_name_or_path", kGolden + "/wan/tiny_wan",
                        "--dataset", "imagefolder", "--train_data_dir", t + "/d", "--resolution",
                        "32", "--output_dir", t + "/run"}};
       }},
      // ------------------------------------------------------------------ trainer options
      {"ShuffleCaptionWithCachedText",
       "`difftrain train --pretrained_model_name_or_path tests/golden/sd/tiny_sd ... "
       "--shuffle_caption --cache_latents`",
       "--shuffle_caption changes the captions every epoch, and this run trains on cached text "
       "embeddings (--cache_latents caches the captions' embeddings too; train without it): "
       "leave it out",
       1,
       [](const std::string& t) {
         return BadRun{options_train(t, kGolden + "/sd/tiny_sd",
                                     {"--center_crop", "--shuffle_caption", "--cache_latents"})};
       }},
      {"TagDropoutOnAlwaysCachedText",
       "`difftrain train --pretrained_model_name_or_path tests/golden/z_image/tiny_z_image ... "
       "--caption_tag_dropout_rate 0.2`",
       "--caption_tag_dropout_rate changes the captions every epoch, and this run trains on "
       "cached text embeddings (Z-Image's Qwen3 is released once every caption is encoded): "
       "leave it out",
       1,
       [](const std::string& t) {
         return BadRun{options_train(t, kGolden + "/z_image/tiny_z_image",
                                     {"--caption_tag_dropout_rate", "0.2"})};
       }},
      {"MaskedLossOnVideo",
       "`difftrain train --pretrained_model_name_or_path tests/golden/wan/tiny_wan ... "
       "--masked_loss`",
       "--masked_loss takes its masks from images (alpha or --conditioning_data_dir); video "
       "training has none: leave it out",
       1,
       [](const std::string& t) {
         return BadRun{options_train(t, kGolden + "/wan/tiny_wan", {"--masked_loss"})};
       }},
      {"HuberSnrUnderFlowMatching",
       "`difftrain train --pretrained_model_name_or_path tests/golden/flux/tiny_flux ... "
       "--loss_type huber --huber_schedule snr`",
       "--huber_schedule snr needs a DDPM scheduler's alphas_cumprod, which flow matching has "
       "not (kohya refuses it too): use exponential or constant",
       1,
       [](const std::string& t) {
         return BadRun{options_train(t, kGolden + "/flux/tiny_flux",
                                     {"--loss_type", "huber", "--huber_schedule", "snr"})};
       }},
      {"BothCaptionDropouts",
       "`difftrain train ... --proportion_empty_prompts 0.1 --caption_dropout_rate 0.1`",
       "--proportion_empty_prompts (Diffusers) and --caption_dropout_rate (kohya) are the same "
       "caption dropout: give one",
       1,
       [](const std::string& t) {
         return BadRun{
             options_train(t, kGolden + "/sd/tiny_sd",
                           {"--proportion_empty_prompts", "0.1", "--caption_dropout_rate", "0.1"})};
       }},
      {"MaskedLossWithoutAMask",
       "`difftrain train ... --masked_loss --conditioning_data_dir C` where C has no mask for "
       "D/a.png",
       "<tmp>/d/a.png: no mask in <tmp>/c (looked for a.png, .webp, .jpg, .bmp); --masked_loss "
       "with --conditioning_data_dir needs one mask image per training image, white = trained",
       1,
       [](const std::string& t) {
         std::filesystem::create_directories(t + "/c");
         return BadRun{options_train(t, kGolden + "/sd/tiny_sd",
                                     {"--masked_loss", "--conditioning_data_dir", t + "/c"})};
       }},
      {"CaptionOptionsOnAnEditRun",
       "`difftrain train --pretrained_model_name_or_path tests/golden/qwen_image/tiny_qwen_image "
       "--pipeline QwenImageEditPipeline ... --caption_dropout_rate 0.1`",
       "the caption options (dropout, shuffling, prefix, suffix) and --masked_loss are for "
       "text-to-image runs: a Qwen-Image-Edit run encodes each instruction with its control "
       "images once; leave them out",
       1,
       [](const std::string& t) {
         return BadRun{options_train(
             t, kTinyQwen,
             {"--pipeline", "QwenImageEditPipeline", "--caption_dropout_rate", "0.1"})};
       }},
      // ------------------------------------------------------------------ block swap
      {"BlockSwapTooManyBlocks",
       "`difftrain train --pretrained_model_name_or_path tests/golden/flux/tiny_flux --lora "
       "--blocks_to_swap 3 ...` (2 double-stream and 2 single-stream blocks)",
       "--blocks_to_swap 3 is too many for this transformer: kohya's FLUX.1 split makes it 1 "
       "double-stream blocks (it has 2) and 4 single-stream blocks (it has 2), and at least one "
       "block stays on the device; use --blocks_to_swap 2 or fewer",
       1,
       [](const std::string& t) {
         write_png(t + "/d/a.png");
         write_text(t + "/d/a.txt", "a grey square");
         return BadRun{{"train", "--pretrained_model_name_or_path", kGolden + "/flux/tiny_flux",
                        "--dataset", "imagefolder", "--train_data_dir", t + "/d", "--resolution",
                        "32", "--max_sequence_length", "16", "--lora", "--blocks_to_swap", "3",
                        "--max_train_steps", "1", "--output_dir", t + "/run"}};
       }},
      {"BlockSwapFullFineTune",
       "`difftrain train --pretrained_model_name_or_path tests/golden/flux/tiny_flux "
       "--blocks_to_swap 2 ...` without --lora",
       "--blocks_to_swap 2 keeps a LoRA run's frozen blocks in host memory, and this is a full "
       "fine-tune (its weights train: their gradients and optimizer updates need them on the "
       "device); add --lora or leave --blocks_to_swap out",
       1,
       [](const std::string& t) {
         write_png(t + "/d/a.png");
         write_text(t + "/d/a.txt", "a grey square");
         return BadRun{{"train", "--pretrained_model_name_or_path", kGolden + "/flux/tiny_flux",
                        "--dataset", "imagefolder", "--train_data_dir", t + "/d", "--resolution",
                        "32", "--max_sequence_length", "16", "--blocks_to_swap", "2",
                        "--max_train_steps", "1", "--output_dir", t + "/run"}};
       }},
      {"BlockSwapUNetFamily",
       "`difftrain train --pretrained_model_name_or_path tests/golden/sd/tiny_sd --lora "
       "--blocks_to_swap 2 ...`",
       "--blocks_to_swap: \"blocks_to_swap\" is an option of the flux, qwen-image, wan, z-image "
       "families; this run trains "
       "the stable-diffusion family (<golden>/sd/tiny_sd), which does not take it (difftrain "
       "train --help --family flux lists that family's options)",
       1,
       [](const std::string& t) {
         return BadRun{{"train", "--pretrained_model_name_or_path", kGolden + "/sd/tiny_sd",
                        "--dataset", "imagefolder", "--train_data_dir", t + "/d", "--lora",
                        "--blocks_to_swap", "2", "--output_dir", t + "/run"}};
       }},
      {"BlockSwapEstimateUNet",
       "`difftrain estimate-memory --model tests/golden/sd/tiny_sd/unet --lora --blocks_to_swap 2`",
       "--blocks_to_swap 2: the unet family's model has no block swap (it swaps a transformer "
       "family's blocks); leave --blocks_to_swap out",
       1,
       [](const std::string&) {
         return BadRun{{"estimate-memory", "--model", kGolden + "/sd/tiny_sd/unet", "--lora",
                        "--blocks_to_swap", "2"}};
       }},
  };
}

}  // namespace difftrain::testing
