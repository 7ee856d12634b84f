#include "difftrain/train/training_cache.h"

#include "difftrain/core/error.h"
#include "difftrain/core/log.h"
#include "difftrain/core/phase.h"
#include "difftrain/data/media_reader.h"
#include "difftrain/io/image.h"
#include "difftrain/io/safetensors.h"
#include "difftrain/models/module_info.h"

#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>

namespace difftrain::train {
namespace fs = std::filesystem;

std::string file_stamp(const fs::path& p) {
  std::error_code ec;
  const auto size = fs::file_size(p, ec);
  const auto time = fs::last_write_time(p, ec).time_since_epoch().count();
  return p.string() + ":" + std::to_string(ec ? 0 : size) + ":" + std::to_string(time) + ";";
}

std::string folder_stamp(const fs::path& dir) {
  std::vector<std::string> entries;
  std::error_code ec;
  for (const auto& e : fs::recursive_directory_iterator(dir, ec)) {
    if (e.is_regular_file()) entries.push_back(file_stamp(e.path()));
  }
  std::sort(entries.begin(), entries.end());
  std::string out;
  for (const auto& e : entries) out += e;
  return out;
}

std::string cache_key(const std::string& key) {
  uint64_t h = 1469598103934665603ULL;  // FNV-1a
  for (unsigned char ch : key) h = (h ^ ch) * 1099511628211ULL;
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

std::pair<std::vector<torch::Tensor>, std::vector<torch::Tensor>> cached_latents(
    accel::Accelerator& acc, const data::ImageFolderDataset& images, const fs::path& file,
    const PixelEncoder& encode, int64_t batch_size) {
  const int64_t n = images.size();
  const auto load = [&] {
    auto st = io::load_safetensors(file.string());
    std::vector<torch::Tensor> mean, logvar;
    for (int64_t i = 0; i < n; ++i) {
      const auto m = st.tensors.find("mean." + std::to_string(i));
      const auto l = st.tensors.find("logvar." + std::to_string(i));
      if (m == st.tensors.end() || l == st.tensors.end() ||
          st.tensors.size() != static_cast<size_t>(2 * n)) {
        throw Error(file.string() + ": not a latent cache of " + std::to_string(n) +
                    " images; delete it (it is rebuilt)");
      }
      mean.push_back(m->second.clone());
      logvar.push_back(l->second.clone());
    }
    return std::make_pair(mean, logvar);
  };
  if (fs::exists(file)) {
    acc.print("cache_latents: reusing {}", file.string());
    return load();
  }
  core::PhaseScope phase("caching latents");
  const int rank = acc.process_index(), world = acc.num_processes();
  const fs::path part = file.string() + ".part" + std::to_string(rank);
  const auto batch = static_cast<size_t>(batch_size);
  {
    // This rank's images, grouped by output size so each VAE call stacks one shape.
    std::map<std::array<int64_t, 2>, std::vector<int64_t>> by_size;
    for (int64_t i = rank; i < n; i += world) by_size[images.target_size(i)].push_back(i);
    io::TensorMap tensors;
    torch::NoGradGuard no_grad;
    auto autocast = acc.autocast();
    for (const auto& [size, mine] : by_size) {
      for (size_t s = 0; s < mine.size(); s += batch) {
        std::vector<torch::Tensor> px;
        const size_t end = std::min(mine.size(), s + batch);
        for (size_t k = s; k < end; ++k) px.push_back(images.get(mine[k]).at("pixel_values"));
        auto post = encode(torch::stack(px));
        const auto mean = post.mean.to(torch::kCPU, torch::kFloat32);
        const auto logvar = post.logvar.to(torch::kCPU, torch::kFloat32);
        for (size_t k = s; k < end; ++k) {
          const auto j = static_cast<int64_t>(k - s);
          tensors["mean." + std::to_string(mine[k])] = mean[j].clone();
          tensors["logvar." + std::to_string(mine[k])] = logvar[j].clone();
        }
      }
    }
    io::save_safetensors(part.string(), tensors);
  }
  acc.wait_for_everyone();
  if (acc.is_main_process()) {
    io::TensorMap all;
    for (int r = 0; r < world; ++r) {
      auto st = io::load_safetensors(file.string() + ".part" + std::to_string(r));
      for (auto& [name, t] : st.tensors) all[name] = t;
    }
    io::save_safetensors(file.string(), all, {{"images", std::to_string(n)}});
    for (int r = 0; r < world; ++r) fs::remove(file.string() + ".part" + std::to_string(r));
    log::info("cache_latents: encoded {} image(s) into {}", n, file.string());
  }
  acc.wait_for_everyone();
  return load();
}

torch::Tensor centre_crop_geometry(const data::ImageFolderDataset& images) {
  std::vector<int64_t> geometry;
  for (int64_t i = 0; i < images.size(); ++i) {
    const auto size = data::media_size(images.file(i));
    const auto [th, tw] = images.target_size(i);
    const bool width_exact = size[0] * tw >= size[1] * th;
    const int64_t new_h = width_exact ? tw * size[0] / size[1] : th;
    const int64_t new_w = width_exact ? tw : th * size[1] / size[0];
    geometry.insert(geometry.end(),
                    {size[0], size[1], static_cast<int64_t>(std::nearbyint((new_h - th) / 2.0)),
                     static_cast<int64_t>(std::nearbyint((new_w - tw) / 2.0))});
  }
  return torch::tensor(geometry, torch::kInt64).view({-1, 4});
}

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
    log::info("text embeddings: encoded {} caption(s) into {} ({} rank(s))", n, file.string(),
              world);
  }
}

std::map<std::string, std::map<std::string, torch::Tensor>> load_text_embedding_cache(
    const fs::path& file) {
  auto st = io::load_safetensors(file.string());
  const auto it = st.metadata.find("captions");
  if (it == st.metadata.end()) {
    throw Error(file.string() +
                ": not a text-embedding cache (no captions); delete it (it is "
                "rebuilt)");
  }
  const auto stored = nlohmann::json::parse(it->second);
  std::map<std::string, std::map<std::string, torch::Tensor>> out;
  for (const auto& [name, t] : st.tensors) {
    const auto all = t.clone();
    for (size_t i = 0; i < stored.size(); ++i) {
      out[stored[i].get<std::string>()][name] = all[static_cast<int64_t>(i)];
    }
  }
  return out;
}

}  // namespace difftrain::train
