// AutoencoderKLQwenImageConfig (autoencoder_kl_qwen_image.h): config.json read and checked, for
// Qwen-Image's VAE, Wan 2.1's and Wan 2.2's 48-channel one.

#include "../json_fields.h"
#include "difftrain/core/error.h"
#include "difftrain/io/atomic_file.h"
#include "difftrain/models/autoencoders/autoencoder_kl_qwen_image.h"

#include <string>
#include <vector>

namespace difftrain::models {

namespace {

// Qwen-Image's released statistics (the config's defaults in Diffusers).
const std::vector<double> kQwenImageLatentsMean = {
    -0.7571, -0.7089, -0.9113, 0.1075,  -0.1745, 0.9653,  -0.1517, 1.5508,
    0.4134,  -0.0715, 0.5517,  -0.3632, -0.1922, -0.9497, 0.2503,  -0.2921};
const std::vector<double> kQwenImageLatentsStd = {2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708,
                                                  2.6052, 2.0743, 3.2687, 2.1526, 2.8652, 1.5579,
                                                  1.6382, 1.1253, 2.8251, 1.9160};

}  // namespace

int64_t AutoencoderKLQwenImageConfig::temporal_compression_ratio() const {
  int64_t r = 1;
  for (const bool t : temperal_downsample) r *= t ? 2 : 1;
  return r;
}

AutoencoderKLQwenImageConfig AutoencoderKLQwenImageConfig::parse(const std::string& json_text,
                                                                 const std::string& source) {
  const nlohmann::json j =
      detail::parse_json_text(json_text, source, "a Diffusers AutoencoderKLQwenImage config.json");
  if (!j.is_object()) throw Error(source + ": expected a JSON object (a VAE config.json)");
  const detail::JsonFields r(j, source);
  AutoencoderKLQwenImageConfig c;
  c.source = source;
  c.base_dim = r.integer_at_least("base_dim", c.base_dim, 1);
  c.z_dim = r.integer_at_least("z_dim", c.z_dim, 1);
  c.num_res_blocks = r.integer_at_least("num_res_blocks", c.num_res_blocks, 1);
  c.wan = r.string("_class_name", "") == "AutoencoderKLWan";
  // AutoencoderKLWan's config (Wan 2.1: the same model) names it in_channels.
  c.input_channels =
      r.integer_at_least("input_channels", r.integer("in_channels", c.input_channels), 1);
  if (r.has("out_channels") && r.integer("out_channels", 0) != c.input_channels) {
    r.fail("out_channels", "must equal in_channels (" + std::to_string(c.input_channels) + ")");
  }
  if (r.has("patch_size") && !r.at("patch_size").is_null()) {
    c.patch_size = r.integer_at_least("patch_size", 1, 1);
  }
  c.is_residual = r.boolean("is_residual", false);
  if (r.has("decoder_base_dim") && !r.at("decoder_base_dim").is_null()) {
    c.decoder_base_dim = r.integer_at_least("decoder_base_dim", c.base_dim, 1);
  }
  if (c.input_channels % (c.patch_size * c.patch_size) != 0) {
    r.fail("in_channels", "must be a multiple of patch_size^2 (" +
                              std::to_string(c.patch_size * c.patch_size) + ")");
  }
  if (r.has("dim_mult")) {
    const auto& v = r.at("dim_mult");
    if (!v.is_array() || v.size() < 2) r.fail("dim_mult", "must be a list of 2 or more integers");
    c.dim_mult.clear();
    for (const auto& e : v) {
      if (!e.is_number_integer() || e.get<int64_t>() < 1) {
        r.fail("dim_mult", "must be integers >= 1, got " + v.dump());
      }
      c.dim_mult.push_back(e.get<int64_t>());
    }
  }
  if (r.has("temperal_downsample")) {
    const auto& v = r.at("temperal_downsample");
    if (!v.is_array()) r.fail("temperal_downsample", "must be a list of true/false");
    c.temperal_downsample.clear();
    for (const auto& e : v) {
      if (!e.is_boolean()) r.fail("temperal_downsample", "must be a list of true/false");
      c.temperal_downsample.push_back(e.get<bool>());
    }
  }
  if (c.temperal_downsample.size() + 1 != c.dim_mult.size()) {
    r.fail("temperal_downsample", "must have one entry per downsample (len(dim_mult) - 1 = " +
                                      std::to_string(c.dim_mult.size() - 1) + ")");
  }
  if (r.has("attn_scales")) {
    for (const auto& e : r.at("attn_scales")) {
      if (!e.is_number()) r.fail("attn_scales", "must be a list of numbers");
      c.attn_scales.push_back(e.get<double>());
    }
  }
  auto stats = [&](const char* key, const std::vector<double>& fallback) {
    if (!r.has(key)) {
      if (c.z_dim != static_cast<int64_t>(fallback.size())) {
        r.fail(key, "is missing and z_dim is not 16; give one value per latent channel");
      }
      return fallback;
    }
    std::vector<double> out;
    for (const auto& e : r.at(key)) {
      if (!e.is_number()) r.fail(key, "must be a list of numbers");
      out.push_back(e.get<double>());
    }
    if (static_cast<int64_t>(out.size()) != c.z_dim) {
      r.fail(key,
             "has " + std::to_string(out.size()) + " values for z_dim " + std::to_string(c.z_dim));
    }
    return out;
  };
  c.latents_mean = stats("latents_mean", kQwenImageLatentsMean);
  c.latents_std = stats("latents_std", kQwenImageLatentsStd);
  for (const double s : c.latents_std) {
    if (!(s > 0)) r.fail("latents_std", "must be > 0");
  }
  if (r.has("scale_factor_spatial") && !r.at("scale_factor_spatial").is_null() &&
      r.integer("scale_factor_spatial", 0) != c.spatial_compression_ratio()) {
    r.fail("scale_factor_spatial", "must be patch_size x 2^len(temperal_downsample) = " +
                                       std::to_string(c.spatial_compression_ratio()));
  }
  return c;
}

AutoencoderKLQwenImageConfig AutoencoderKLQwenImageConfig::load(const std::string& path) {
  return parse(io::read_file(path), path);
}

}  // namespace difftrain::models
