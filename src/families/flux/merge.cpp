// `difftrain lora merge` for FLUX.1 folders: the transformer's and CLIP's safetensors files with
// the LoRA folded in, file by file (families/lora_merge.h), the FLUX.1 layouts read first.
#include "difftrain/families/lora_merge.h"
#include "flux_family.h"

namespace difftrain::families::flux {

models::LoraFolderMergeSummary merge_flux_lora(const std::string& model_dir,
                                               const std::string& lora_path,
                                               const std::string& output_dir,
                                               const models::LoraFolderMergeOptions& options) {
  FileMergePlan plan;
  plan.components = {{"transformer", "diffusion_pytorch_model"}, {"text_encoder", "model"}};
  plan.read = [](const std::string& lora, const std::string& dir, const io::LoraReadOptions& read) {
    return read_flux_lora(lora, dir, read);
  };
  plan.layouts = "Diffusers, PEFT, kohya or ComfyUI / XLabs FLUX";
  return merge_lora_by_files(model_dir, lora_path, output_dir, options, plan);
}

}  // namespace difftrain::families::flux
