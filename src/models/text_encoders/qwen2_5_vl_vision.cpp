// Qwen2.5-VL's image processor, vision tower and multimodal positions (qwen2_5_vl_vision.h), as
// Transformers computes them with eager attention (the rotary products in float32, the softmax
// in float32, cast back).

#include "difftrain/models/text_encoders/qwen2_5_vl_vision.h"

#include "../json_fields.h"
#include "difftrain/core/error.h"
#include "difftrain/io/image.h"
#include "difftrain/models/pretrained.h"

#include <fmt/format.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>

namespace difftrain::models {

namespace {

Linear vision_linear(int64_t in, int64_t out) {
  return Linear(torch::nn::LinearOptions(in, out).bias(true));
}

torch::Tensor vision_rotate_half(const torch::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

// Python's round(): half to even.
int64_t round_half_even(double x) { return static_cast<int64_t>(std::nearbyint(x)); }

}  // namespace

Qwen2_5VisionOptions Qwen2_5VisionOptions::load(const std::string& path) {
  const nlohmann::json top = detail::parse_json_file(path, "a Qwen2.5-VL config.json");
  if (!top.is_object() || !top.contains("vision_config") || !top.at("vision_config").is_object()) {
    throw Error(path +
                ": no \"vision_config\" object; the Edit pipelines need Qwen2.5-VL's vision tower "
                "(Qwen-Image-Edit's text_encoder/config.json has one)");
  }
  const detail::JsonFields r(top.at("vision_config"), path + " vision_config");
  Qwen2_5VisionOptions o;
  o.depth(r.integer_at_least("depth", o.depth(), 1));
  o.hidden_size(r.integer_at_least("hidden_size", o.hidden_size(), 1));
  o.num_heads(r.integer_at_least("num_heads", o.num_heads(), 1));
  o.intermediate_size(r.integer_at_least("intermediate_size", o.intermediate_size(), 1));
  o.out_hidden_size(r.integer_at_least("out_hidden_size", o.out_hidden_size(), 1));
  o.in_channels(r.integer_at_least("in_channels", r.integer("in_chans", o.in_channels()), 1));
  o.patch_size(r.integer_at_least("patch_size", o.patch_size(), 1));
  o.spatial_merge_size(r.integer_at_least("spatial_merge_size", o.spatial_merge_size(), 1));
  o.temporal_patch_size(r.integer_at_least("temporal_patch_size", o.temporal_patch_size(), 1));
  o.window_size(r.integer_at_least("window_size", o.window_size(), 1));
  o.fullatt_block_indexes(r.integers("fullatt_block_indexes", o.fullatt_block_indexes()));
  r.choice("hidden_act", "silu", {"silu"});
  if (o.hidden_size() % o.num_heads() != 0 || (o.hidden_size() / o.num_heads()) % 4 != 0) {
    r.fail("num_heads", "must divide hidden_size into heads whose width is a multiple of 4");
  }
  if (o.window_size() % (o.spatial_merge_size() * o.patch_size()) != 0) {
    r.fail("window_size", "must be a multiple of spatial_merge_size x patch_size");
  }
  const detail::JsonFields t(top, path);
  o.image_token_id(t.integer("image_token_id", o.image_token_id()));
  o.vision_start_token_id(t.integer("vision_start_token_id", o.vision_start_token_id()));
  return o;
}

Qwen2VLImageProcessorOptions Qwen2VLImageProcessorOptions::load(const std::string& path) {
  const nlohmann::json j = detail::parse_json_file(path, "a Qwen2-VL preprocessor_config.json");
  if (!j.is_object()) throw Error(path + ": expected a JSON object (preprocessor_config.json)");
  const detail::JsonFields r(j, path);
  Qwen2VLImageProcessorOptions o;
  int64_t min_pixels = o.min_pixels, max_pixels = o.max_pixels;
  if (r.has("size") && j.at("size").is_object()) {
    const detail::JsonFields s(j.at("size"), path + " size");
    min_pixels = s.integer("shortest_edge", min_pixels);
    max_pixels = s.integer("longest_edge", max_pixels);
  }
  o.min_pixels = r.integer_at_least("min_pixels", min_pixels, 1);
  o.max_pixels = r.integer_at_least("max_pixels", max_pixels, 1);
  o.patch_size = r.integer_at_least("patch_size", o.patch_size, 1);
  o.merge_size = r.integer_at_least("merge_size", o.merge_size, 1);
  o.temporal_patch_size = r.integer_at_least("temporal_patch_size", o.temporal_patch_size, 1);
  for (const char* key : {"image_mean", "image_std"}) {
    if (!r.has(key)) continue;
    const auto& v = j.at(key);
    if (!v.is_array() || v.size() != 3 || !v[0].is_number() || !v[1].is_number() ||
        !v[2].is_number()) {
      r.fail(key, "must be 3 numbers, got " + v.dump());
    }
    auto& dst = std::string(key) == "image_mean" ? o.image_mean : o.image_std;
    for (size_t i = 0; i < 3; ++i) dst[i] = v[i].get<double>();
  }
  for (double s : o.image_std) {
    if (!(s > 0)) r.fail("image_std", "must be positive");
  }
  return o;
}

std::array<int64_t, 2> qwen2_vl_smart_resize(int64_t height, int64_t width, int64_t factor,
                                             int64_t min_pixels, int64_t max_pixels) {
  if (height < 1 || width < 1) {
    throw Error(fmt::format("Qwen2-VL image processor: an image of {}x{} pixels", width, height));
  }
  const double h = static_cast<double>(height), w = static_cast<double>(width);
  if (std::max(h, w) / std::min(h, w) > 200) {
    throw Error(fmt::format(
        "Qwen2-VL image processor: an image of {}x{} has an aspect ratio above 200; crop it", width,
        height));
  }
  const double f = static_cast<double>(factor);
  int64_t hb = round_half_even(h / f) * factor;
  int64_t wb = round_half_even(w / f) * factor;
  if (hb * wb > max_pixels) {
    const double beta = std::sqrt(h * w / static_cast<double>(max_pixels));
    hb = std::max(factor, static_cast<int64_t>(std::floor(h / beta / f)) * factor);
    wb = std::max(factor, static_cast<int64_t>(std::floor(w / beta / f)) * factor);
  } else if (hb * wb < min_pixels) {
    const double beta = std::sqrt(static_cast<double>(min_pixels) / (h * w));
    hb = static_cast<int64_t>(std::ceil(h * beta / f)) * factor;
    wb = static_cast<int64_t>(std::ceil(w * beta / f)) * factor;
  }
  return {hb, wb};
}

Qwen2VLImagePatches qwen2_vl_image_patches(const std::vector<torch::Tensor>& images,
                                           const Qwen2VLImageProcessorOptions& o) {
  std::vector<torch::Tensor> values;
  std::vector<int64_t> grids;
  const int64_t P = o.patch_size, M = o.merge_size, T = o.temporal_patch_size;
  const auto mean =
      torch::tensor({o.image_mean[0], o.image_mean[1], o.image_mean[2]}, torch::kFloat32)
          .view({3, 1, 1});
  const auto std_ = torch::tensor({o.image_std[0], o.image_std[1], o.image_std[2]}, torch::kFloat32)
                        .view({3, 1, 1});
  for (const auto& image : images) {
    if (image.dim() != 3 || image.size(2) != 3 || image.scalar_type() != torch::kUInt8) {
      throw Error("Qwen2-VL image processor: expected uint8 RGB images [H, W, 3]");
    }
    const auto [rh, rw] =
        qwen2_vl_smart_resize(image.size(0), image.size(1), P * M, o.min_pixels, o.max_pixels);
    const torch::Tensor resized = io::resize_image(image, rh, rw, io::Resample::kBicubic);
    // rescale: float64 x (1 / 255) then float32; normalize in float32.
    auto x = (resized.permute({2, 0, 1}).to(torch::kFloat64) * (1.0 / 255.0)).to(torch::kFloat32);
    x = (x - mean) / std_;
    const int64_t gh = rh / P, gw = rw / P;
    // One frame repeated to the temporal patch: [T, C, H, W] -> patches in merge-block order.
    auto frames = x.unsqueeze(0).expand({T, 3, rh, rw});
    auto p = frames.reshape({1, T, 3, gh / M, M, P, gw / M, M, P})
                 .permute({0, 3, 6, 4, 7, 2, 1, 5, 8})
                 .reshape({gh * gw, 3 * T * P * P});
    values.push_back(p.contiguous());
    grids.insert(grids.end(), {1, gh, gw});
  }
  Qwen2VLImagePatches out;
  out.pixel_values = torch::cat(values, 0);
  out.image_grid_thw =
      torch::tensor(grids, torch::kInt64).view({static_cast<int64_t>(images.size()), 3});
  return out;
}

Qwen2_5VisionBlockImpl::Qwen2_5VisionBlockImpl(const Qwen2_5VisionOptions& o)
    : heads_(o.num_heads()) {
  const int64_t d = o.hidden_size();
  norm1_ = register_module("norm1", Qwen3RMSNorm(d, 1e-6));
  norm2_ = register_module("norm2", Qwen3RMSNorm(d, 1e-6));
  auto attn = register_module("attn", std::make_shared<torch::nn::Module>());
  qkv_ = attn->register_module("qkv", vision_linear(d, 3 * d));
  proj_ = attn->register_module("proj", vision_linear(d, d));
  auto mlp = register_module("mlp", std::make_shared<torch::nn::Module>());
  gate_proj_ = mlp->register_module("gate_proj", vision_linear(d, o.intermediate_size()));
  up_proj_ = mlp->register_module("up_proj", vision_linear(d, o.intermediate_size()));
  down_proj_ = mlp->register_module("down_proj", vision_linear(o.intermediate_size(), d));
}

torch::Tensor Qwen2_5VisionBlockImpl::forward(const torch::Tensor& x, const torch::Tensor& cos,
                                              const torch::Tensor& sin,
                                              const std::vector<int64_t>& bounds) {
  const int64_t N = x.size(0), D = x.size(1), hd = D / heads_;
  const auto qkv = qkv_(norm1_(x)).view({N, 3, heads_, hd});
  auto rotate = [&](const torch::Tensor& t) {
    const auto f = t.to(torch::kFloat32);
    return (f * cos + vision_rotate_half(f) * sin).to(t.scalar_type());
  };
  const auto q = rotate(qkv.select(1, 0)).transpose(0, 1);  // [heads, N, hd]
  const auto k = rotate(qkv.select(1, 1)).transpose(0, 1);
  const auto v = qkv.select(1, 2).transpose(0, 1);
  const double scale = std::pow(static_cast<double>(hd), -0.5);
  std::vector<torch::Tensor> parts;
  for (size_t i = 0; i + 1 < bounds.size(); ++i) {
    const int64_t a = bounds[i], n = bounds[i + 1] - bounds[i];
    if (n <= 0) continue;
    const auto s = torch::matmul(q.narrow(1, a, n), k.narrow(1, a, n).transpose(1, 2)) * scale;
    const auto p = torch::softmax(s, -1, torch::kFloat32).to(q.scalar_type());
    parts.push_back(torch::matmul(p, v.narrow(1, a, n)));
  }
  const auto attn = torch::cat(parts, 1).transpose(0, 1).reshape({N, D});
  const auto h = x + proj_(attn);
  const auto y = norm2_(h);
  return h + down_proj_(torch::silu(gate_proj_(y)) * up_proj_(y));
}

Qwen2_5VisionTransformerImpl::Qwen2_5VisionTransformerImpl(const Qwen2_5VisionOptions& options)
    : options_(options) {
  const auto& o = options_;
  auto embed = register_module("patch_embed", std::make_shared<torch::nn::Module>());
  auto proj = embed->register_module("proj", std::make_shared<torch::nn::Module>());
  patch_weight_ = proj->register_parameter(
      "weight", torch::zeros({o.hidden_size(), o.in_channels(), o.temporal_patch_size(),
                              o.patch_size(), o.patch_size()}));
  auto list = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < o.depth(); ++i) {
    blocks_.push_back(Qwen2_5VisionBlock(o));
    list->push_back(blocks_.back());
  }
  auto merger = register_module("merger", std::make_shared<torch::nn::Module>());
  ln_q_ = merger->register_module("ln_q", Qwen3RMSNorm(o.hidden_size(), 1e-6));
  const int64_t m = o.hidden_size() * o.spatial_merge_size() * o.spatial_merge_size();
  auto mlp = merger->register_module("mlp", torch::nn::ModuleList());
  mlp0_ = vision_linear(m, m);
  mlp2_ = vision_linear(m, o.out_hidden_size());
  mlp->push_back(mlp0_);
  mlp->push_back(torch::nn::GELU());
  mlp->push_back(mlp2_);
}

torch::Tensor Qwen2_5VisionTransformerImpl::forward(const torch::Tensor& pixel_values,
                                                    const torch::Tensor& image_grid_thw) {
  const auto& o = options_;
  const int64_t M = o.spatial_merge_size(), unit = M * M;
  const auto grid = image_grid_thw.to(torch::kCPU).to(torch::kInt64).contiguous();
  TORCH_CHECK(grid.dim() == 2 && grid.size(1) == 3,
              "Qwen2.5-VL vision: image_grid_thw must be "
              "[images, 3], got ",
              grid.sizes());
  const int64_t patch_len = patch_weight_.numel() / o.hidden_size();
  int64_t total = 0;
  for (int64_t i = 0; i < grid.size(0); ++i) {
    const int64_t t = grid[i][0].item<int64_t>(), h = grid[i][1].item<int64_t>(),
                  w = grid[i][2].item<int64_t>();
    TORCH_CHECK(t > 0 && h % M == 0 && w % M == 0 && h > 0 && w > 0,
                "Qwen2.5-VL vision: a grid of ", t, "x", h, "x", w,
                " (rows and columns must be multiples of ", M, ")");
    total += t * h * w;
  }
  TORCH_CHECK(
      pixel_values.dim() == 2 && pixel_values.size(0) == total && pixel_values.size(1) == patch_len,
      "Qwen2.5-VL vision: pixel_values must be [", total, ", ", patch_len, "], got ",
      pixel_values.sizes());
  const auto dtype = patch_weight_.scalar_type();
  const auto device = patch_weight_.device();
  // Conv3d with kernel = stride over one patch each: a product with the flattened kernel.
  auto x = torch::matmul(pixel_values.to(device, dtype),
                         patch_weight_.reshape({o.hidden_size(), patch_len}).t());

  // 2-D rotary positions (row, column) per patch, patches in merge-block order; the window order
  // and the segments of window / full attention.
  const int64_t hd = o.hidden_size() / o.num_heads();
  const int64_t rot = hd / 2;  // VisionRotaryEmbedding(head_dim / 2)
  const auto inv_freq = 1.0 / torch::pow(10000.0, torch::arange(0, rot, 2, torch::kFloat32) /
                                                      static_cast<double>(rot));
  std::vector<int64_t> hpos, wpos, window_index, cu_window{0}, cu_full{0};
  const int64_t ws = o.window_size() / M / o.patch_size();
  int64_t index_base = 0;
  for (int64_t i = 0; i < grid.size(0); ++i) {
    const int64_t t = grid[i][0].item<int64_t>(), h = grid[i][1].item<int64_t>(),
                  w = grid[i][2].item<int64_t>();
    for (int64_t f = 0; f < t; ++f) {
      for (int64_t bh = 0; bh < h / M; ++bh) {
        for (int64_t bw = 0; bw < w / M; ++bw) {
          for (int64_t ih = 0; ih < M; ++ih) {
            for (int64_t iw = 0; iw < M; ++iw) {
              hpos.push_back(bh * M + ih);
              wpos.push_back(bw * M + iw);
            }
          }
        }
      }
      cu_full.push_back(cu_full.back() + h * w);
    }
    const int64_t lh = h / M, lw = w / M;
    // Transformers pads each side to the next multiple of ws, plus a whole window when it
    // divides; empty windows add no segment.
    const int64_t nwh = (lh + ws - lh % ws) / ws, nww = (lw + ws - lw % ws) / ws;
    for (int64_t f = 0; f < t; ++f) {
      for (int64_t a = 0; a < nwh; ++a) {
        for (int64_t b = 0; b < nww; ++b) {
          int64_t count = 0;
          for (int64_t r = a * ws; r < std::min((a + 1) * ws, lh); ++r) {
            for (int64_t c = b * ws; c < std::min((b + 1) * ws, lw); ++c) {
              window_index.push_back(index_base + (f * lh + r) * lw + c);
              ++count;
            }
          }
          if (count > 0) cu_window.push_back(cu_window.back() + count * unit);
        }
      }
    }
    index_base += t * lh * lw;
  }
  const int64_t N = total;
  const auto pos =
      torch::stack({torch::tensor(hpos, torch::kInt64), torch::tensor(wpos, torch::kInt64)},
                   -1);  // [N, 2]
  auto freqs = (pos.to(torch::kFloat32).unsqueeze(-1) * inv_freq.view({1, 1, -1})).reshape({N, -1});
  const auto order = torch::tensor(window_index, torch::kInt64);
  auto reorder = [&](const torch::Tensor& t) {
    return t.reshape({N / unit, unit, -1}).index_select(0, order.to(t.device())).reshape({N, -1});
  };
  x = reorder(x);
  freqs = reorder(freqs);
  const auto emb = torch::cat({freqs, freqs}, -1);
  const auto cos = emb.cos().unsqueeze(1).to(device);  // [N, 1, hd] float32
  const auto sin = emb.sin().unsqueeze(1).to(device);
  const auto& full = o.fullatt_block_indexes();
  for (size_t i = 0; i < blocks_.size(); ++i) {
    const bool is_full = std::find(full.begin(), full.end(), static_cast<int64_t>(i)) != full.end();
    x = blocks_[i]->forward(x, cos, sin, is_full ? cu_full : cu_window);
  }
  x = mlp2_(torch::gelu(mlp0_(ln_q_(x).view({-1, o.hidden_size() * unit}))));
  const auto reverse = torch::argsort(order);
  return x.index_select(0, reverse.to(x.device()));
}

torch::Tensor qwen2_5_vl_rope_index(const torch::Tensor& input_ids,
                                    const torch::Tensor& attention_mask,
                                    const torch::Tensor& image_grid_thw,
                                    const Qwen2_5VisionOptions& o) {
  const auto ids = input_ids.to(torch::kCPU).to(torch::kInt64).contiguous();
  TORCH_CHECK(ids.dim() == 2, "qwen2_5_vl_rope_index: input_ids must be [B, S]");
  const int64_t B = ids.size(0), S = ids.size(1);
  const auto mask = attention_mask.defined()
                        ? attention_mask.to(torch::kCPU).to(torch::kInt64).contiguous()
                        : torch::ones({B, S}, torch::kInt64);
  const auto grid = image_grid_thw.defined()
                        ? image_grid_thw.to(torch::kCPU).to(torch::kInt64).contiguous()
                        : torch::zeros({0, 3}, torch::kInt64);
  auto out = torch::ones({3, B, S}, torch::kInt64);
  auto acc = out.accessor<int64_t, 3>();
  const auto id = ids.accessor<int64_t, 2>();
  const auto m = mask.accessor<int64_t, 2>();
  const int64_t M = o.spatial_merge_size();
  int64_t image = 0;
  for (int64_t b = 0; b < B; ++b) {
    std::vector<int64_t> real;
    for (int64_t s = 0; s < S; ++s) {
      if (m[b][s] == 1) real.push_back(s);
    }
    int64_t next = 0;  // the next text position
    size_t k = 0;
    while (k < real.size()) {
      if (id[b][real[k]] != o.image_token_id()) {
        for (int64_t a = 0; a < 3; ++a) acc[a][b][real[k]] = next;
        ++next;
        ++k;
        continue;
      }
      TORCH_CHECK(image < grid.size(0), "qwen2_5_vl_rope_index: more image blocks than the ",
                  grid.size(0), " image(s) of image_grid_thw");
      const int64_t t = grid[image][0].item<int64_t>(), h = grid[image][1].item<int64_t>() / M,
                    w = grid[image][2].item<int64_t>() / M;
      ++image;
      TORCH_CHECK(k + static_cast<size_t>(t * h * w) <= real.size(),
                  "qwen2_5_vl_rope_index: an image block shorter than its grid");
      int64_t largest = next;
      for (int64_t f = 0; f < t; ++f) {
        for (int64_t r = 0; r < h; ++r) {
          for (int64_t c = 0; c < w; ++c) {
            const int64_t s = real[k++];
            acc[0][b][s] = next;  // images: temporal index 0 (second_per_grid_t = 0)
            acc[1][b][s] = next + r;
            acc[2][b][s] = next + c;
            largest = std::max({largest, next + r, next + c});
          }
        }
      }
      next = largest + 1;
    }
  }
  return out;
}

Qwen3Output qwen2_5_vl_forward(Qwen3Model& language_model, Qwen2_5VisionTransformer& visual,
                               const torch::Tensor& input_ids, const torch::Tensor& attention_mask,
                               const torch::Tensor& pixel_values,
                               const torch::Tensor& image_grid_thw) {
  const auto& vo = visual->options();
  auto embeds = language_model->embed_tokens()(input_ids);
  if (pixel_values.defined() && pixel_values.numel() > 0) {
    const auto features = visual->forward(pixel_values, image_grid_thw).to(embeds.scalar_type());
    const auto is_image = (input_ids == vo.image_token_id());
    const int64_t n = is_image.sum().item<int64_t>();
    if (n != features.size(0)) {
      throw Error(fmt::format(
          "Qwen2.5-VL: the prompt has {} <|image_pad|> tokens but the images give {} features "
          "(each <|image_pad|> must be expanded to its image's merged patch count)",
          n, features.size(0)));
    }
    embeds = embeds.masked_scatter(is_image.unsqueeze(-1).to(embeds.device()),
                                   features.to(embeds.device()));
  }
  const auto positions = qwen2_5_vl_rope_index(input_ids, attention_mask, image_grid_thw, vo);
  return language_model->forward(input_ids, attention_mask, -1, positions, embeds);
}

Qwen2_5VisionTransformer make_qwen2_5_vl_vision(const std::string& config_path,
                                                const io::TensorMap& weights,
                                                const std::string& source, torch::Dtype dtype) {
  Qwen2_5VisionTransformer model(Qwen2_5VisionOptions::load(config_path));
  model->to(dtype);
  io::TensorMap w;
  for (const auto& [name, tensor] : weights) w[name] = tensor.to(dtype);
  if (w.empty()) {
    throw Error(source +
                ": no vision-tower weights (visual.*); the Edit pipelines need Qwen2.5-VL's "
                "vision tower (Qwen-Image-Edit's text_encoder/ has them)");
  }
  load_weights(*model, w, source);
  return model;
}

}  // namespace difftrain::models
