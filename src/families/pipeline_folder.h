#pragma once
// A Diffusers pipeline folder's components, as the transformer families (FLUX.1, Z-Image,
// Qwen-Image) resolve them: model_index.json read, each listed component's folder checked, the
// scheduler's config found; every failure is one line naming the file or folder.

#include <map>
#include <string>
#include <vector>

namespace difftrain::families {

struct PipelineComponents {
  std::string dir;
  std::string pipeline_class;                ///< model_index.json's _class_name ("" if none)
  std::map<std::string, std::string> paths;  ///< component name -> its folder
  std::string scheduler_config;              ///< scheduler/scheduler_config.json
};

/// Resolves `components` (and "scheduler") of the pipeline folder `dir`, a `kind` folder (e.g.
/// "FluxPipeline", for messages) that has `listing` ("transformer, vae, text_encoder, tokenizer
/// and scheduler").
PipelineComponents resolve_pipeline_components(const std::string& dir, const std::string& kind,
                                               const std::vector<std::string>& components,
                                               const std::string& listing);

/// A pipeline of one transformer, one text encoder and its tokenizer, one VAE and a scheduler
/// (ZImagePipeline, QwenImagePipeline).
struct TransformerFolder {
  std::string dir;
  std::string pipeline_class;  ///< model_index.json's _class_name
  std::string transformer_dir, vae_dir, text_encoder_dir, tokenizer_dir;
  std::string scheduler_config;  ///< scheduler/scheduler_config.json
};

/// Resolves such a folder (`kind`: its pipeline class, for messages).
TransformerFolder resolve_transformer_folder(const std::string& dir, const std::string& kind);

/// `dir/<component>` when `dir` is a pipeline folder (it has model_index.json), else `dir`
/// itself (a bare model folder).
std::string component_or_self(const std::string& dir, const std::string& component);

}  // namespace difftrain::families
