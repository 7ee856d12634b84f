// WanPipeline (wan_pipeline.h), in Diffusers' order: prompt_clean, the UMT5 embeddings, the
// float32 noise of the whole batch from one CPU generator, the UniPC flow loop with CFG and the
// A14B expert switch, the latents de-normalised and the clip decoded.

#include "wan_pipeline.h"

#include "../pipeline_folder.h"
#include "difftrain/core/error.h"
#include "difftrain/core/log.h"
#include "difftrain/families/family.h"
#include "difftrain/io/atomic_file.h"
#include "difftrain/io/image.h"
#include "difftrain/models/lora/lora.h"
#include "difftrain/models/module_info.h"
#include "difftrain/models/pretrained.h"

#include <fmt/format.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <set>

namespace difftrain::families::wan {
namespace {
namespace fs = std::filesystem;

constexpr int64_t kDefaultHeight = 480, kDefaultWidth = 832, kDefaultFrames = 81;
constexpr int64_t kDefaultSteps = 50, kDefaultMaxSequenceLength = 512;
constexpr double kDefaultGuidance = 5.0;

// UTF-8 of one code point.
void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

// html.unescape for numeric references and the common named ones (with their semicolon; amp,
// lt, gt, quot and nbsp also without, as HTML5 allows).
std::string html_unescape(const std::string& s) {
  static const std::map<std::string, uint32_t> named = {
      {"amp", '&'},      {"lt", '<'},        {"gt", '>'},       {"quot", '"'},
      {"apos", '\''},    {"nbsp", 0xA0},     {"copy", 0xA9},    {"reg", 0xAE},
      {"trade", 0x2122}, {"hellip", 0x2026}, {"mdash", 0x2014}, {"ndash", 0x2013},
      {"lsquo", 0x2018}, {"rsquo", 0x2019},  {"ldquo", 0x201C}, {"rdquo", 0x201D},
      {"laquo", 0xAB},   {"raquo", 0xBB},    {"middot", 0xB7},  {"deg", 0xB0},
      {"times", 0xD7},   {"divide", 0xF7},   {"euro", 0x20AC},  {"pound", 0xA3},
      {"yen", 0xA5},     {"cent", 0xA2},     {"sect", 0xA7},    {"para", 0xB6},
      {"bull", 0x2022},  {"eacute", 0xE9},   {"egrave", 0xE8},  {"agrave", 0xE0},
      {"ccedil", 0xE7},  {"uuml", 0xFC},     {"ouml", 0xF6},    {"auml", 0xE4},
      {"szlig", 0xDF},   {"ntilde", 0xF1}};
  static const std::set<std::string> no_semicolon = {"amp", "lt", "gt", "quot", "nbsp"};
  std::string out;
  for (size_t i = 0; i < s.size();) {
    if (s[i] != '&') {
      out += s[i++];
      continue;
    }
    if (i + 2 < s.size() && s[i + 1] == '#') {
      size_t j = i + 2;
      const bool hex = j < s.size() && (s[j] == 'x' || s[j] == 'X');
      if (hex) ++j;
      const size_t digits = j;
      uint64_t cp = 0;
      while (j < s.size() && (hex ? std::isxdigit(static_cast<unsigned char>(s[j]))
                                  : std::isdigit(static_cast<unsigned char>(s[j])))) {
        cp = std::min<uint64_t>(
            cp * (hex ? 16 : 10) +
                static_cast<uint64_t>(std::isdigit(static_cast<unsigned char>(s[j]))
                                          ? s[j] - '0'
                                          : std::tolower(s[j]) - 'a' + 10),
            0x110000);
        ++j;
      }
      if (j > digits) {
        if (j < s.size() && s[j] == ';') ++j;
        if (cp == 0 || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) cp = 0xFFFD;
        append_utf8(out, static_cast<uint32_t>(cp));
        i = j;
        continue;
      }
    }
    size_t j = i + 1;
    while (j < s.size() && std::isalnum(static_cast<unsigned char>(s[j]))) ++j;
    const std::string name = s.substr(i + 1, j - i - 1);
    const auto it = named.find(name);
    if (it != named.end() && j < s.size() && s[j] == ';') {
      append_utf8(out, it->second);
      i = j + 1;
      continue;
    }
    bool done = false;
    for (const auto& n : no_semicolon) {  // the longest prefix that needs no semicolon
      if (name.rfind(n, 0) == 0 && !done) {
        append_utf8(out, named.at(n));
        i += 1 + n.size();
        done = true;
      }
    }
    if (!done) out += s[i++];
  }
  return out;
}

// Python's regex \s over str (what whitespace_clean's re.sub(r"\s+", " ") matches).
bool is_space(uint32_t cp) {
  static const std::set<uint32_t> spaces = {9,    10,   11,   12,   13,   32,   133,  160,  5760,
                                            8192, 8193, 8194, 8195, 8196, 8197, 8198, 8199, 8200,
                                            8201, 8202, 8232, 8233, 8239, 8287, 12288};
  return spaces.count(cp) > 0;
}

std::vector<std::pair<uint32_t, std::string>> utf8_chars(const std::string& s) {
  std::vector<std::pair<uint32_t, std::string>> out;
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    const size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
    uint32_t cp = n == 1 ? c : n == 2 ? c & 0x1F : n == 3 ? c & 0x0F : c & 0x07;
    for (size_t k = 1; k < n && i + k < s.size(); ++k) {
      cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
    }
    out.emplace_back(cp, s.substr(i, n));
    i += n;
  }
  return out;
}

std::string collapse_and_strip(const std::string& s) {
  std::string out;
  bool in_space = false;
  for (const auto& [cp, bytes] : utf8_chars(s)) {
    if (is_space(cp)) {
      in_space = true;
      continue;
    }
    if (in_space && !out.empty()) out += ' ';
    in_space = false;
    out += bytes;
  }
  return out;
}

nlohmann::json read_index(const std::string& dir) {
  const std::string path = (fs::path(dir) / "model_index.json").string();
  try {
    return nlohmann::json::parse(io::read_file(path));
  } catch (const nlohmann::json::exception& e) {
    throw Error(path + ": not valid JSON (" + e.what() + ")");
  }
}

bool has_component(const nlohmann::json& index, const char* name) {
  return index.contains(name) && index[name].is_array() && index[name].size() == 2 &&
         !index[name][0].is_null();
}

}  // namespace

WanFolder resolve_wan_folder(const std::string& dir) {
  const PipelineComponents c = resolve_pipeline_components(
      dir, "WanPipeline", {"transformer", "vae", "text_encoder", "tokenizer"},
      "transformer (and transformer_2 for Wan 2.2 A14B), vae, text_encoder, tokenizer and "
      "scheduler");
  WanFolder f;
  f.dir = dir;
  f.pipeline_class = c.pipeline_class;
  f.transformer_dir = c.paths.at("transformer");
  f.vae_dir = c.paths.at("vae");
  f.text_encoder_dir = c.paths.at("text_encoder");
  f.tokenizer_dir = c.paths.at("tokenizer");
  f.scheduler_config = c.scheduler_config;
  const nlohmann::json index = read_index(dir);
  if (has_component(index, "transformer_2")) {
    f.transformer_2_dir = (fs::path(dir) / "transformer_2").string();
    std::error_code ec;
    if (!fs::is_directory(f.transformer_2_dir, ec)) {
      throw Error(f.transformer_2_dir +
                  ": no such folder; model_index.json lists transformer_2, so the pipeline "
                  "folder is incomplete (copy the whole folder)");
    }
  }
  if (index.contains("boundary_ratio") && index["boundary_ratio"].is_number()) {
    f.boundary_ratio = index["boundary_ratio"].get<double>();
  }
  f.expand_timesteps = index.value("expand_timesteps", false);
  f.image_to_video = c.pipeline_class == "WanImageToVideoPipeline";
  if (f.image_to_video && has_component(index, "image_encoder")) {
    // Wan 2.1 image to video: the CLIP vision model and its processor.
    f.image_encoder_dir = (fs::path(dir) / "image_encoder").string();
    std::error_code ec;
    if (!fs::is_directory(f.image_encoder_dir, ec)) {
      throw Error(f.image_encoder_dir +
                  ": no such folder; model_index.json lists image_encoder, so the pipeline "
                  "folder is incomplete (copy the whole folder)");
    }
    const fs::path processor = fs::path(dir) / "image_processor" / "preprocessor_config.json";
    if (fs::is_regular_file(processor, ec)) f.image_processor_config = processor.string();
  }
  if (!f.transformer_2_dir.empty() && !f.boundary_ratio) {
    throw Error(dir +
                "/model_index.json: transformer_2 without boundary_ratio; Wan 2.2 A14B "
                "folders switch experts at boundary_ratio (e.g. 0.875)");
  }
  return f;
}

std::string wan_transformer_dir(const std::string& dir) {
  return component_or_self(dir, "transformer");
}

std::string wan_prompt_clean(const std::string& text) {
  return collapse_and_strip(html_unescape(html_unescape(text)));
}

torch::Tensor encode_wan_prompts(const models::T5Tokenizer& tokenizer,
                                 models::T5EncoderModel& encoder,
                                 const std::vector<std::string>& prompts,
                                 int64_t max_sequence_length, std::vector<int64_t>* lengths_out) {
  const auto n = static_cast<int64_t>(prompts.size());
  auto ids = torch::zeros({n, max_sequence_length}, torch::kInt64);
  auto mask = torch::zeros({n, max_sequence_length}, torch::kInt64);
  std::vector<int64_t> lengths;
  for (int64_t i = 0; i < n; ++i) {
    const std::string text = wan_prompt_clean(prompts[static_cast<size_t>(i)]);
    const auto row = tokenizer.encode(text, max_sequence_length);
    const int64_t len = std::min<int64_t>(
        static_cast<int64_t>(tokenizer.piece_ids(text).size()) + 1, max_sequence_length);
    std::copy(row.begin(), row.end(), ids[i].data_ptr<int64_t>());
    mask[i].narrow(0, 0, len).fill_(1);
    lengths.push_back(len);
  }
  const torch::Device device = models::module_device(*encoder);
  const torch::Tensor hidden =
      encoder->forward(ids.to(device), mask.to(device)).to(torch::kCPU, torch::kFloat32);
  auto out = torch::zeros_like(hidden);
  for (int64_t i = 0; i < n; ++i) {
    out[i]
        .narrow(0, 0, lengths[static_cast<size_t>(i)])
        .copy_(hidden[i].narrow(0, 0, lengths[static_cast<size_t>(i)]));
  }
  if (lengths_out != nullptr) *lengths_out = lengths;
  return out;
}

void WanPipeline::to(const torch::Device& device, std::optional<torch::Dtype> dtype) {
  if (!transformer || !vae || !text_encoder) {
    throw Error("WanPipeline::to: the pipeline is missing its transformer, VAE or text encoder");
  }
  for (torch::nn::Module* m : std::vector<torch::nn::Module*>{
           text_encoder.ptr().get(), vae.ptr().get(), transformer.ptr().get(),
           transformer_2 ? transformer_2.ptr().get() : nullptr,
           image_encoder ? image_encoder.ptr().get() : nullptr}) {
    if (m == nullptr) continue;
    if (dtype) {
      m->to(device, *dtype);
    } else {
      m->to(device);
    }
  }
  if (dtype) {  // the float32 modules Diffusers keeps
    transformer->to_dtype(*dtype);
    if (transformer_2) transformer_2->to_dtype(*dtype);
  }
}

diffusion::GenerateRequest WanPipeline::resolve(diffusion::GenerateRequest r) const {
  if (r.num_images == 0) r.num_images = 1;
  if (r.num_inference_steps == 0) r.num_inference_steps = kDefaultSteps;
  if (r.max_sequence_length == 0) r.max_sequence_length = kDefaultMaxSequenceLength;
  if (r.height == 0) r.height = kDefaultHeight;
  if (r.width == 0) r.width = kDefaultWidth;
  if (!r.guidance_scale) r.guidance_scale = kDefaultGuidance;
  if (!r.options.contains("num_frames") || r.options["num_frames"].is_null()) {
    r.options["num_frames"] = kDefaultFrames;
  }
  if (!r.options.contains("guidance_scale_2") || r.options["guidance_scale_2"].is_null()) {
    r.options["guidance_scale_2"] =
        folder.boundary_ratio ? nlohmann::json(*r.guidance_scale) : nlohmann::json(nullptr);
  }
  return r;
}

namespace {

struct Run {
  torch::Tensor frames, latents, embeds;
};

}  // namespace

torch::Tensor wan_image_condition(models::AutoencoderKLQwenImage vae, const torch::Tensor& first,
                                  const torch::Tensor& last, int64_t num_frames) {
  const int64_t height = first.size(3), width = first.size(4);
  const int64_t middle = num_frames - (last.defined() ? 2 : 1);
  std::vector<torch::Tensor> parts = {first.to(torch::kFloat32),
                                      torch::zeros({first.size(0), 3, middle, height, width})};
  if (last.defined()) parts.push_back(last.to(torch::kFloat32));
  const torch::Device device = models::module_device(*vae);
  const auto vae_dtype = models::module_dtype(*vae);
  torch::Tensor z = vae->encode(torch::cat(parts, 2).to(device, vae_dtype)).mode();
  z = z.to(torch::kFloat32);
  const auto& c = vae->config();
  const auto stat = [&](const std::vector<double>& v) {
    return torch::tensor(v, torch::kFloat64).view({1, -1, 1, 1, 1}).to(z.device(), torch::kFloat32);
  };
  z = (z - stat(c.latents_mean)) * (1.0 / stat(c.latents_std));
  const int64_t tc = c.temporal_compression_ratio();
  const int64_t h = z.size(3), w = z.size(4), b = z.size(0);
  auto mask = torch::ones({b, 1, num_frames, h, w});
  mask.narrow(2, 1, middle).zero_();
  mask = torch::cat(
      {mask.narrow(2, 0, 1).repeat_interleave(tc, 2), mask.narrow(2, 1, num_frames - 1)}, 2);
  mask = mask.view({b, -1, tc, h, w}).transpose(1, 2).to(z.device());
  return torch::cat({mask, z}, 1);
}

namespace {

// Image to video (prepare_latents): the image (and last image) at the output size as the VAE's
// pixels, zeros for the other frames, the clip's latent mode normalised (z - mean) * (1 / std),
// after a 4-channel mask of the given frames (the first frame counted 4 times, as the VAE's first
// latent frame stands for one frame): [1, 4 + z_dim, T, h, w].
torch::Tensor image_condition(WanPipeline& p, const torch::Tensor& image,
                              const torch::Tensor& last_image, int64_t num_frames, int64_t height,
                              int64_t width) {
  const auto pixels = [&](const torch::Tensor& u8) {
    const torch::Tensor resized = io::resize_image(u8, height, width, io::Resample::kLanczos);
    const auto x = resized.permute({2, 0, 1}).to(torch::kFloat32) / 255.0F;
    return (2.0F * x - 1.0F).unsqueeze(0).unsqueeze(2);  // [1, 3, 1, H, W]
  };
  return wan_image_condition(p.vae, pixels(image),
                             last_image.defined() ? pixels(last_image) : torch::Tensor(),
                             num_frames);
}

Run run_once(WanPipeline& p, const diffusion::GenerateRequest& r,
             const std::vector<std::string>& prompts, const std::vector<std::string>& negatives,
             int64_t k, int64_t num_frames, uint64_t seed, int64_t* counter, int64_t total,
             const torch::Tensor& condition, const torch::Tensor& given_pos,
             const torch::Tensor& given_neg, const torch::Tensor& image_embeds) {
  const double g = *r.guidance_scale;
  const auto& g2_json = r.options.at("guidance_scale_2");
  const double g2 = g2_json.is_null() ? g : g2_json.get<double>();
  const bool cfg = g > 1.0;
  const auto n = static_cast<int64_t>(prompts.size());
  const auto dtype = p.transformer->dtype();
  const torch::Device device = models::module_device(*p.transformer);
  const auto repeat = [&](const torch::Tensor& e) { return e.repeat_interleave(k, 0); };
  const torch::Tensor pos =
      repeat(given_pos.defined() ? given_pos
                                 : encode_wan_prompts(*p.tokenizer, p.text_encoder, prompts,
                                                      r.max_sequence_length));
  torch::Tensor neg;
  if (cfg) {
    neg = repeat(given_neg.defined() ? given_neg
                                     : encode_wan_prompts(*p.tokenizer, p.text_encoder, negatives,
                                                          r.max_sequence_length));
  }
  const int64_t vsf = p.vae->config().spatial_compression_ratio();
  const int64_t frames = (num_frames - 1) / p.vae->config().temporal_compression_ratio() + 1;
  const int64_t C = p.transformer->options().out_channels;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  torch::Tensor latents =
      at::randn({n * k, C, frames, r.height / vsf, r.width / vsf}, gen, torch::kFloat32).to(device);
  p.scheduler->set_timesteps(r.num_inference_steps);
  const torch::Tensor timesteps = p.scheduler->timesteps();
  const double boundary =
      p.folder.boundary_ratio ? *p.folder.boundary_ratio * 1000.0 : -1.0;  // num_train_timesteps
  const torch::Tensor pos_d = pos.to(device, dtype);
  const torch::Tensor neg_d = cfg ? neg.to(device, dtype) : torch::Tensor();
  const bool expand = p.folder.expand_timesteps;
  torch::Tensor first_frame_mask;
  if (expand) {
    first_frame_mask = torch::ones({1, 1, frames, latents.size(3), latents.size(4)},
                                   torch::TensorOptions().dtype(torch::kFloat32).device(device));
    if (condition.defined()) first_frame_mask.select(2, 0).zero_();
  }
  for (int64_t i = 0; i < timesteps.size(0); ++i) {
    const double t = p.scheduler->timestep(i);
    const bool high = boundary < 0 || t >= boundary;
    if (p.select_expert) p.select_expert(high);
    models::WanTransformer3DModel& model =
        high || p.select_expert ? p.transformer : p.transformer_2;
    const double scale = high ? g : g2;
    torch::Tensor ts, x;
    if (expand) {
      // Wan 2.2 TI2V: a timestep per token, mask x t over the patch grid ([B, F h w / 4]); image to
      // video replaces the first latent frame by the image's and gives its tokens t = 0.
      const auto& ps = model->options().patch_size;
      const auto grid =
          first_frame_mask[0][0].slice(1, 0, c10::nullopt, ps[1]).slice(2, 0, c10::nullopt, ps[2]);
      ts = (grid * t).flatten().unsqueeze(0).expand({latents.size(0), -1}).to(device);
      x = (condition.defined() ? (1 - first_frame_mask) * condition + first_frame_mask * latents
                               : latents)
              .to(model->dtype());
    } else {
      ts = timesteps[i].expand({latents.size(0)}).to(device);
      x = (condition.defined()
               ? torch::cat({latents, condition.expand({latents.size(0), -1, -1, -1, -1})}, 1)
               : latents)
              .to(model->dtype());
    }
    // Wan 2.1 I2V: the CLIP features repeated per video (both branches), as image_embeds.repeat.
    const torch::Tensor img =
        image_embeds.defined()
            ? image_embeds.repeat({latents.size(0), 1, 1}).to(device, model->dtype())
            : torch::Tensor();
    torch::Tensor pred = model->forward(x, ts, pos_d, img).to(torch::kFloat32);
    if (cfg) {
      const torch::Tensor uncond = model->forward(x, ts, neg_d, img).to(torch::kFloat32);
      pred = uncond + scale * (pred - uncond);
    }
    latents = p.scheduler->step(pred, t, latents);
    if (r.on_step) r.on_step(++*counter, total);
  }
  if (expand && condition.defined()) {
    latents = (1 - first_frame_mask) * condition + first_frame_mask * latents;
  }
  const auto vae_dtype = models::module_dtype(*p.vae);
  const torch::Tensor z = p.vae->denormalize_latents(latents.to(vae_dtype));
  const torch::Tensor video = p.vae->decode(z);  // [K, 3, F, H, W]
  Run out;
  out.frames = (video.to(torch::kCPU, torch::kFloat32) / 2 + 0.5)
                   .clamp(0, 1)
                   .permute({0, 2, 3, 4, 1})
                   .contiguous();
  out.latents = latents.to(torch::kCPU, torch::kFloat32);
  out.embeds = pos;
  return out;
}

}  // namespace

diffusion::GenerateResult WanPipeline::generate(const diffusion::GenerateRequest& request) {
  diffusion::GenerateRequest r = resolve(request);
  // prompt_embeds (as Diffusers' argument): one row per prompt, used as given; the prompts are
  // then only labels.
  if (r.prompt_embeds.defined()) {
    if (r.prompt_embeds.dim() != 3 ||
        (r.negative_prompt_embeds.defined() &&
         r.negative_prompt_embeds.sizes() != r.prompt_embeds.sizes())) {
      throw Error("WanPipeline: prompt_embeds must be [N, L, D] (negative_prompt_embeds alike)");
    }
    if (r.prompts.empty()) {
      r.prompts.assign(static_cast<size_t>(r.prompt_embeds.size(0)), "prompt_embeds");
    }
    if (static_cast<int64_t>(r.prompts.size()) != r.prompt_embeds.size(0)) {
      throw Error("WanPipeline: one prompt_embeds row per prompt");
    }
  }
  if (r.prompts.empty()) throw Error("Wan needs at least one prompt (--prompt)");
  if (!r.class_labels.empty()) throw Error("--class_labels is for class-conditional UNets");
  if (!text_encoder && (!r.prompt_embeds.defined() ||
                        (*r.guidance_scale > 1.0 && !r.negative_prompt_embeds.defined()))) {
    throw Error(
        "WanPipeline: no text encoder loaded; give prompt_embeds (and, with guidance, "
        "negative_prompt_embeds)");
  }
  if (r.num_images < 1 || r.num_inference_steps < 1) {
    throw Error("--num_videos_per_prompt and --num_inference_steps must be >= 1");
  }
  if (r.max_sequence_length < 1) throw Error("--max_sequence_length must be >= 1");
  int64_t num_frames = r.options.at("num_frames").get<int64_t>();
  const int64_t tc = vae->config().temporal_compression_ratio();
  if (num_frames < 1) throw Error("--num_frames must be >= 1, got " + std::to_string(num_frames));
  if (num_frames % tc != 1) {
    const int64_t rounded = num_frames / tc * tc + 1;
    log::warn("--num_frames {}: num_frames - 1 has to be divisible by {}; rounded to {}",
              num_frames, tc, rounded);
    num_frames = rounded;
  }
  // check_inputs: WanPipeline refuses sizes that are not multiples of 16 (its later flooring to
  // the VAE factor x the patch never runs for Wan 2.1's 8 x 2).
  for (const auto& [what, v] : {std::pair<const char*, int64_t>{"height", r.height},
                                std::pair<const char*, int64_t>{"width", r.width}}) {
    if (v < 16 || v % 16 != 0) {
      throw Error(
          fmt::format("--{} {}: WanPipeline takes heights and widths divisible by 16", what, v));
    }
  }
  // Sizes that do not fill whole patches of latents are rounded down, with a warning (the
  // pipelines' h_multiple_of: 16 for Wan 2.1's VAE, 32 for Wan 2.2's 16x VAE).
  {
    const auto& ps = transformer->options().patch_size;
    const int64_t mh = vae->config().spatial_compression_ratio() * ps[1];
    const int64_t mw = vae->config().spatial_compression_ratio() * ps[2];
    if (r.height % mh != 0 || r.width % mw != 0) {
      const int64_t h = r.height / mh * mh, w = r.width / mw * mw;
      log::warn(
          "height and width must be multiples of ({}, {}) for proper patchification; "
          "adjusting ({}, {}) -> ({}, {})",
          mh, mw, r.height, r.width, h, w);
      if (h < 1 || w < 1) throw Error(fmt::format("--height / --width: at least {} x {}", mh, mw));
      r.height = h;
      r.width = w;
    }
  }
  std::vector<std::string> negatives;
  if (*r.guidance_scale > 1.0) {
    const std::string one = r.negative_prompts.empty() ? "" : r.negative_prompts[0];
    if (r.negative_prompts.size() > 1 && r.negative_prompts.size() != r.prompts.size()) {
      throw Error(
          fmt::format("got {} --negative_prompt for {} prompts; give one, or one per prompt",
                      r.negative_prompts.size(), r.prompts.size()));
    }
    negatives = r.negative_prompts.size() > 1 ? r.negative_prompts
                                              : std::vector<std::string>(r.prompts.size(), one);
  }
  transformer->eval();
  if (transformer_2) transformer_2->eval();
  vae->eval();
  if (text_encoder) text_encoder->eval();
  torch::NoGradGuard no_grad;
  torch::Tensor condition, image_embeds;
  const auto path_option = [&](const char* key) {
    return r.options.contains(key) && r.options[key].is_string() ? r.options[key].get<std::string>()
                                                                 : std::string();
  };
  // Wan 2.2 TI2V-5B is one model for both: an image (given, or the pipeline's) makes the run image
  // to video, as WanImageToVideoPipeline.from_pretrained on its folder does.
  const bool ti2v_image =
      folder.expand_timesteps && (!path_option("image").empty() || image.defined());
  if (folder.image_to_video || ti2v_image) {
    const std::string image_path = path_option("image"), last_path = path_option("last_image");
    const torch::Tensor first = image_path.empty() ? image : io::load_image(image_path, 3);
    const torch::Tensor last = last_path.empty() ? last_image : io::load_image(last_path, 3);
    if (!first.defined()) {
      throw Error("WanImageToVideoPipeline needs the first frame: --image FILE");
    }
    if (last.defined() && num_frames < 2) {
      throw Error("--last_image needs --num_frames of 2 or more");
    }
    if (folder.expand_timesteps) {
      // Wan 2.2 TI2V: the image alone, its latent mode normalised, replaces the first frame.
      if (last.defined()) {
        throw Error("--last_image: Wan 2.2 TI2V conditions on the first frame only");
      }
      const torch::Tensor resized =
          io::resize_image(first, r.height, r.width, io::Resample::kLanczos);
      const auto px = (2.0F * resized.permute({2, 0, 1}).to(torch::kFloat32) / 255.0F - 1.0F)
                          .unsqueeze(0)
                          .unsqueeze(2);
      const auto z = vae->encode(px.to(models::module_device(*vae), models::module_dtype(*vae)))
                         .mode()
                         .to(torch::kFloat32);
      condition = vae->normalize_latents(z);
    } else {
      condition = image_condition(*this, first, last, num_frames, r.height, r.width);
    }
    if (transformer->options().added_kv_proj_dim) {
      // Wan 2.1: CLIP's penultimate hidden states of the image (and the last image), the same for
      // the conditional and unconditional branches (encode_image).
      if (!image_encoder) {
        throw Error(folder.dir +
                    ": the transformer takes CLIP image features (added_kv_proj_dim) "
                    "but the folder has no image_encoder/");
      }
      std::vector<torch::Tensor> images = {first};
      if (last.defined()) images.push_back(last);
      const auto px = models::clip_image_pixel_values(images, image_processor);
      auto hidden = image_encoder
                        ->forward(px.to(models::module_device(*image_encoder),
                                        models::module_dtype(*image_encoder)))
                        .hidden_states;
      image_embeds = hidden[hidden.size() - 2].to(torch::kFloat32);
    }
  } else if (!path_option("image").empty() || !path_option("last_image").empty()) {
    throw Error("--image is for image-to-video folders (WanImageToVideoPipeline); this one is " +
                class_name());
  }
  int64_t counter = 0;
  diffusion::GenerateResult out;
  out.fps = 16;  // Wan's training rate (Diffusers' examples: export_to_video(frames, fps=16))
  const int64_t k = r.num_images;
  if (r.seeding == diffusion::Seeding::kBatch) {
    Run run = run_once(*this, r, r.prompts, negatives, k, num_frames, r.seed, &counter,
                       r.num_inference_steps, condition, r.prompt_embeds, r.negative_prompt_embeds,
                       image_embeds);
    out.images = run.frames;
    out.latents = run.latents;
    out.prompt_embeds = run.embeds;
  } else {
    std::vector<torch::Tensor> frames, latents, embeds;
    const auto n = static_cast<int64_t>(r.prompts.size());
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < k; ++j) {
        const auto idx = static_cast<size_t>(i);
        Run run =
            run_once(*this, r, {r.prompts[idx]},
                     negatives.empty() ? std::vector<std::string>{}
                                       : std::vector<std::string>{negatives[idx]},
                     1, num_frames, r.seed + static_cast<uint64_t>(i * k + j), &counter,
                     n * k * r.num_inference_steps, condition,
                     r.prompt_embeds.defined() ? r.prompt_embeds.narrow(0, i, 1) : torch::Tensor(),
                     r.negative_prompt_embeds.defined() ? r.negative_prompt_embeds.narrow(0, i, 1)
                                                        : torch::Tensor(),
                     image_embeds);
        frames.push_back(run.frames);
        latents.push_back(run.latents);
        embeds.push_back(run.embeds);
      }
    }
    out.images = torch::cat(frames);
    out.latents = torch::cat(latents);
    out.prompt_embeds = torch::cat(embeds);
  }
  out.labels = diffusion::prompt_labels(r.prompts, k);
  return out;
}

WanPipeline load_wan_pipeline(const std::string& dir,
                              const diffusion::PipelineLoadOptions& options) {
  WanPipeline p;
  p.folder = resolve_wan_folder(dir);
  const WanFolder& f = p.folder;
  const torch::Dtype dtype = options.dtype.value_or(torch::kFloat32);
  p.tokenizer =
      std::make_shared<const models::T5Tokenizer>(models::T5Tokenizer::load(f.tokenizer_dir));
  p.text_encoder = models::load_t5_encoder(f.text_encoder_dir, dtype, options.variant);
  p.transformer = models::load_wan_transformer(f.transformer_dir, dtype, options.variant);
  if (!f.transformer_2_dir.empty()) {
    p.transformer_2 = models::load_wan_transformer(f.transformer_2_dir, dtype, options.variant);
  }
  p.vae = models::load_autoencoder_kl_qwen_image(options.vae.empty() ? f.vae_dir : options.vae,
                                                 dtype, options.variant);
  p.scheduler = diffusion::load_sampler(f.scheduler_config, options.scheduler);
  if (!f.image_encoder_dir.empty()) {
    p.image_encoder = models::load_clip_vision_model(f.image_encoder_dir, options.variant);
    if (!f.image_processor_config.empty()) {
      p.image_processor = models::ClipImageProcessorOptions::load(f.image_processor_config);
    }
  }
  if (!options.lora.empty()) {
    const io::LoraWeights lora = read_wan_lora(options.lora, dir);
    check_lora_fits_family(lora, options.lora, dir);
    const auto m = models::merge_lora(*p.transformer, lora, options.lora_scale, "transformer");
    log::info("LoRA {} ({} format): merged into {} transformer modules, scale {}{}", options.lora,
              io::format_label(lora), m.modules_merged, options.lora_scale,
              p.transformer_2 ? " (the high-noise expert; transformer_2 is left as it is)" : "");
  }
  if (p.tokenizer->vocab_size() > p.text_encoder->options().vocab_size()) {
    throw Error(fmt::format(
        "{}: the tokenizer has {} ids but the text encoder's vocab_size is {}; "
        "the folder mixes models",
        f.tokenizer_dir, p.tokenizer->vocab_size(), p.text_encoder->options().vocab_size()));
  }
  const auto& t = p.transformer->options();
  const int64_t expected_in =
      f.image_to_video && !f.expand_timesteps
          ? 2 * p.vae->config().z_dim + p.vae->config().temporal_compression_ratio()
          : p.vae->config().z_dim;
  if (t.text_dim != p.text_encoder->options().d_model() || t.in_channels != expected_in) {
    throw Error(fmt::format(
        "{}: the transformer (text_dim {}, in_channels {}) does not fit the text encoder "
        "(d_model {}) and VAE (z_dim {}); the folder mixes models",
        f.transformer_dir, t.text_dim, t.in_channels, p.text_encoder->options().d_model(),
        p.vae->config().z_dim));
  }
  return p;
}

const DitLoraLayout& wan_lora_layout() {
  // The original checkpoint's names (ComfyUI, musubi-tuner) -> Diffusers', as
  // _convert_non_diffusers_wan_lora_to_diffusers renames them, and back.
  static const DitLoraLayout layout{
      "Wan",
      {"blocks", "condition_embedder", "proj_out", "patch_embedding", "text_embedding",
       "time_embedding", "time_projection", "head", "img_emb"},
      {{R"(\.self_attn\.q$)", ".attn1.to_q"},
       {R"(\.self_attn\.k$)", ".attn1.to_k"},
       {R"(\.self_attn\.v$)", ".attn1.to_v"},
       {R"(\.self_attn\.o$)", ".attn1.to_out.0"},
       {R"(\.cross_attn\.q$)", ".attn2.to_q"},
       {R"(\.cross_attn\.k$)", ".attn2.to_k"},
       {R"(\.cross_attn\.v$)", ".attn2.to_v"},
       {R"(\.cross_attn\.o$)", ".attn2.to_out.0"},
       {R"(\.cross_attn\.k_img$)", ".attn2.add_k_proj"},
       {R"(\.cross_attn\.v_img$)", ".attn2.add_v_proj"},
       {R"(^(blocks\.\d+)\.ffn\.0$)", "$1.ffn.net.0.proj"},
       {R"(^(blocks\.\d+)\.ffn\.2$)", "$1.ffn.net.2"},
       {R"(^text_embedding\.0$)", "condition_embedder.text_embedder.linear_1"},
       {R"(^text_embedding\.2$)", "condition_embedder.text_embedder.linear_2"},
       {R"(^time_embedding\.0$)", "condition_embedder.time_embedder.linear_1"},
       {R"(^time_embedding\.2$)", "condition_embedder.time_embedder.linear_2"},
       {R"(^time_projection\.1$)", "condition_embedder.time_proj"},
       {R"(^head\.head$)", "proj_out"},
       {R"(^img_emb\.proj\.1$)", "condition_embedder.image_embedder.ff.net.0.proj"},
       {R"(^img_emb\.proj\.3$)", "condition_embedder.image_embedder.ff.net.2"}},
      wan_transformer_dir,
      {{R"(\.attn1\.to_q$)", ".self_attn.q"},
       {R"(\.attn1\.to_k$)", ".self_attn.k"},
       {R"(\.attn1\.to_v$)", ".self_attn.v"},
       {R"(\.attn1\.to_out\.0$)", ".self_attn.o"},
       {R"(\.attn2\.to_q$)", ".cross_attn.q"},
       {R"(\.attn2\.to_k$)", ".cross_attn.k"},
       {R"(\.attn2\.to_v$)", ".cross_attn.v"},
       {R"(\.attn2\.to_out\.0$)", ".cross_attn.o"},
       {R"(\.attn2\.add_k_proj$)", ".cross_attn.k_img"},
       {R"(\.attn2\.add_v_proj$)", ".cross_attn.v_img"},
       {R"(^(blocks\.\d+)\.ffn\.net\.0\.proj$)", "$1.ffn.0"},
       {R"(^(blocks\.\d+)\.ffn\.net\.2$)", "$1.ffn.2"},
       {R"(^condition_embedder\.text_embedder\.linear_1$)", "text_embedding.0"},
       {R"(^condition_embedder\.text_embedder\.linear_2$)", "text_embedding.2"},
       {R"(^condition_embedder\.time_embedder\.linear_1$)", "time_embedding.0"},
       {R"(^condition_embedder\.time_embedder\.linear_2$)", "time_embedding.2"},
       {R"(^condition_embedder\.time_proj$)", "time_projection.1"},
       {R"(^proj_out$)", "head.head"},
       {R"(^condition_embedder\.image_embedder\.ff\.net\.0\.proj$)", "img_emb.proj.1"},
       {R"(^condition_embedder\.image_embedder\.ff\.net\.2$)", "img_emb.proj.3"}}};
  return layout;
}

io::LoraWeights read_wan_lora(const std::string& path, const std::string& dir,
                              const io::LoraReadOptions& options) {
  return read_dit_lora(wan_lora_layout(), path, dir, options);
}

std::map<std::string, torch::Tensor> forward_wan(const std::string& dir,
                                                 const std::map<std::string, torch::Tensor>& in,
                                                 const std::string& source, const std::string& lora,
                                                 double lora_scale) {
  const std::string what =
      "WanTransformer3DModel takes hidden_states [B, C, F, H, W], timestep [B] (or [B, N]), "
      "encoder_hidden_states [B, S, text_dim] and, for image-to-video, "
      "encoder_hidden_states_image [B, 257, image_dim]";
  for (const char* name : {"hidden_states", "timestep", "encoder_hidden_states"}) {
    if (!in.count(name)) throw Error(fmt::format("{}: no '{}'; {}", source, name, what));
  }
  for (const auto& [name, value] : in) {
    (void)value;
    if (name != "hidden_states" && name != "timestep" && name != "encoder_hidden_states" &&
        name != "encoder_hidden_states_image" && name.rfind("out", 0) != 0) {
      log::warn("{}: tensor '{}' is not an input of WanTransformer3DModel; ignored", source, name);
    }
  }
  models::WanTransformer3DModel model = models::load_wan_transformer(wan_transformer_dir(dir));
  if (!lora.empty()) {
    const io::LoraWeights weights = read_wan_lora(lora, dir);
    check_lora_fits_family(weights, lora, dir);
    const auto m = models::merge_lora(*model, weights, lora_scale, "transformer");
    log::info("LoRA {}: merged into {} transformer modules, scale {}", lora, m.modules_merged,
              lora_scale);
  }
  model->eval();
  torch::NoGradGuard no_grad;
  const auto image = in.count("encoder_hidden_states_image")
                         ? in.at("encoder_hidden_states_image").to(torch::kFloat32)
                         : torch::Tensor();
  return {{"out", model->forward(in.at("hidden_states").to(torch::kFloat32), in.at("timestep"),
                                 in.at("encoder_hidden_states").to(torch::kFloat32), image)}};
}

}  // namespace difftrain::families::wan
