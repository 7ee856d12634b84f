// make_text_to_image_task: the Stable-Diffusion text-to-image task (text_to_image_task.h), and
// the text-embedding cache it shares with SDXL.
#include "text_to_image_task.h"

namespace difftrain::train {

namespace t2i {

void build_text_embedding_cache(
    accel::Accelerator& acc, const std::vector<std::string>& captions, const fs::path& file,
    const std::function<std::map<std::string, torch::Tensor>(const std::vector<std::string>&)>&
        encode) {
  core::PhaseScope phase("caching text embeddings");
  const int rank = acc.process_index(), world = acc.num_processes();
  const size_t n = captions.size();
  const size_t begin = n * static_cast<size_t>(rank) / static_cast<size_t>(world);
  const size_t end = n * static_cast<size_t>(rank + 1) / static_cast<size_t>(world);
  const fs::path part = file.string() + ".part" + std::to_string(rank);
  {
    torch::NoGradGuard no_grad;
    auto autocast = acc.autocast();
    std::map<std::string, std::vector<torch::Tensor>> rows;
    for (size_t s = begin; s < end; s += 64) {
      std::vector<std::string> chunk(
          captions.begin() + static_cast<std::ptrdiff_t>(s),
          captions.begin() + static_cast<std::ptrdiff_t>(std::min(end, s + 64)));
      for (auto& [name, t] : encode(chunk)) rows[name].push_back(t);
      core::note_progress();
    }
    io::TensorMap tensors;
    for (auto& [name, list] : rows) tensors[name] = torch::cat(list).to(torch::kCPU);
    io::save_safetensors(part.string(), tensors, {{"rows", std::to_string(end - begin)}});
  }
  acc.wait_for_everyone();
  if (acc.is_main_process()) {
    std::map<std::string, std::vector<torch::Tensor>> rows;
    for (int r = 0; r < world; ++r) {
      auto st = io::load_safetensors(file.string() + ".part" + std::to_string(r));
      for (auto& [name, t] : st.tensors) rows[name].push_back(t);
    }
    io::TensorMap tensors;
    for (auto& [name, list] : rows) tensors[name] = torch::cat(list);
    io::save_safetensors(file.string(), tensors, {{"captions", nlohmann::json(captions).dump()}});
    for (int r = 0; r < world; ++r) fs::remove(file.string() + ".part" + std::to_string(r));
    log::info("cache_latents: encoded {} caption(s) into {} ({} rank(s))", n, file.string(), world);
  }
}

}  // namespace t2i

std::unique_ptr<TrainingTask> make_text_to_image_task(TaskOptions options) {
  return std::make_unique<t2i::TextToImageTask>(std::move(options));
}

}  // namespace difftrain::train
