// The sampler factory (Diffusers' `Class.from_config`), the --scheduler names, ConfigReader, and
// the DDPM/DDIM adapters over the existing NoiseScheduler classes.

#include "difftrain/diffusion/sampler.h"

#include "config_json.h"
#include "difftrain/core/error.h"
#include "difftrain/diffusion/noise_scheduler.h"
#include "sampler_classes.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <sstream>
#include <utility>

namespace difftrain::diffusion {

void Sampler::set_timesteps_with(int64_t num_inference_steps, const TimestepOptions& options) {
  if (!options.sigmas.empty() || options.mu) {
    throw Error(class_name() +
                "::set_timesteps: custom sigmas and mu are arguments of flow-matching schedulers "
                "(FlowMatchEulerDiscreteScheduler) only; use that scheduler or leave them out");
  }
  set_timesteps(num_inference_steps);
}

double flow_match_mu(int64_t image_seq_len, const nlohmann::json& config) {
  const auto number_or = [&](const char* key, double fallback) {
    const auto it = config.find(key);
    if (it == config.end() || it->is_null()) return fallback;
    if (!it->is_number()) {
      throw Error(std::string("flow_match_mu: the scheduler config's ") + key + " is " +
                  it->dump() + "; expected a number");
    }
    return it->get<double>();
  };
  const double base_len = number_or("base_image_seq_len", 256);
  const double max_len = number_or("max_image_seq_len", 4096);
  const double base_shift = number_or("base_shift", 0.5);
  const double max_shift = number_or("max_shift", 1.15);
  if (max_len == base_len) {
    throw Error("flow_match_mu: base_image_seq_len and max_image_seq_len are both " +
                std::to_string(static_cast<int64_t>(base_len)) +
                " in the scheduler config; they must differ");
  }
  const double m = (max_shift - base_shift) / (max_len - base_len);
  const double b = base_shift - m * base_len;
  return static_cast<double>(image_seq_len) * m + b;
}

double Sampler::timestep(int64_t i) const {
  const torch::Tensor& ts = timesteps();
  if (i < 0 || i >= ts.size(0)) {
    throw Error(class_name() + "::timestep: index " + std::to_string(i) + " is outside [0, " +
                std::to_string(ts.size(0)) + "); call set_timesteps() first and index within it");
  }
  return ts[i].to(torch::kFloat64).item<double>();
}

namespace {

using detail::shown;
using detail::where_of;
using nlohmann::json;

// One --scheduler name: the Diffusers class it builds and the config fields it sets.
struct Preset {
  const char* name;
  const char* class_name;
  std::function<void(json&)> apply;
};

void karras(json& c) {
  c["use_karras_sigmas"] = true;
  // Diffusers refuses two sigma schedules at once; the name asks for Karras'.
  c["use_exponential_sigmas"] = false;
  c["use_beta_sigmas"] = false;
}

// The "DPM++ 2M" names: solver_order 2 with `algorithm_type`, on Karras sigmas when asked.
std::function<void(json&)> dpmpp_2m(const char* algorithm_type, bool karras_sigmas) {
  return [=](json& c) {
    c["algorithm_type"] = algorithm_type;
    c["solver_order"] = 2;
    if (karras_sigmas) karras(c);
  };
}

const std::vector<Preset>& presets() {
  static const std::vector<Preset> list = {
      {"ddpm", "DDPMScheduler", [](json&) {}},
      {"ddim", "DDIMScheduler", [](json&) {}},
      {"pndm", "PNDMScheduler", [](json&) {}},
      {"euler", "EulerDiscreteScheduler", [](json&) {}},
      {"euler_karras", "EulerDiscreteScheduler", karras},
      {"euler_ancestral", "EulerAncestralDiscreteScheduler", [](json&) {}},
      {"dpmpp_2m", "DPMSolverMultistepScheduler", dpmpp_2m("dpmsolver++", false)},
      {"dpmpp_2m_karras", "DPMSolverMultistepScheduler", dpmpp_2m("dpmsolver++", true)},
      {"dpmpp_2m_sde", "DPMSolverMultistepScheduler", dpmpp_2m("sde-dpmsolver++", false)},
      {"dpmpp_2m_sde_karras", "DPMSolverMultistepScheduler", dpmpp_2m("sde-dpmsolver++", true)},
      {"unipc", "UniPCMultistepScheduler", [](json&) {}},
      {"flow_match_euler", "FlowMatchEulerDiscreteScheduler", [](json&) {}},
  };
  return list;
}

const std::vector<std::string>& class_names() {
  static const std::vector<std::string> list = {
      "DDPMScheduler",
      "DDIMScheduler",
      "PNDMScheduler",
      "EulerDiscreteScheduler",
      "EulerAncestralDiscreteScheduler",
      "DPMSolverMultistepScheduler",
      "UniPCMultistepScheduler",
      "FlowMatchEulerDiscreteScheduler",
  };
  return list;
}

std::string joined(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& s : items) out += (out.empty() ? "" : ", ") + s;
  return out;
}

std::unique_ptr<Sampler> build(const std::string& class_name, const json& config,
                               const std::string& source, const SamplerOptions& options) {
  if (class_name == "DDPMScheduler") return detail::make_ddpm_sampler(config, source);
  if (class_name == "DDIMScheduler") return detail::make_ddim_sampler(config, source, options.eta);
  if (class_name == "PNDMScheduler") return detail::make_pndm_sampler(config, source);
  if (class_name == "EulerDiscreteScheduler") return detail::make_euler_sampler(config, source);
  if (class_name == "EulerAncestralDiscreteScheduler") {
    return detail::make_euler_ancestral_sampler(config, source);
  }
  if (class_name == "DPMSolverMultistepScheduler") {
    return detail::make_dpm_solver_multistep_sampler(config, source);
  }
  if (class_name == "UniPCMultistepScheduler") return detail::make_unipc_sampler(config, source);
  if (class_name == "FlowMatchEulerDiscreteScheduler") {
    return detail::make_flow_match_euler_sampler(config, source);
  }
  throw Error(where_of(source) + ": no sampler class " + class_name);
}

// Diffusers' from_config keeps the file's keys the class does not take in `scheduler.config`
// (its "hidden" config: SD-1.5's skip_prk_steps stays in an Euler scheduler's config, and
// save_config writes it back). This wrapper adds them to config(); everything else forwards.
class WithFileKeys : public Sampler {
 public:
  WithFileKeys(std::unique_ptr<Sampler> inner, json file_keys)
      : inner_(std::move(inner)), file_keys_(std::move(file_keys)) {}
  std::string class_name() const override { return inner_->class_name(); }
  json config() const override {
    json j = inner_->config();
    for (const auto& [key, value] : file_keys_.items()) {
      if (!j.contains(key)) j[key] = value;
    }
    return j;
  }
  void set_timesteps(int64_t n) override { inner_->set_timesteps(n); }
  void set_timesteps_with(int64_t n, const TimestepOptions& options) override {
    inner_->set_timesteps_with(n, options);
  }
  const torch::Tensor& timesteps() const override { return inner_->timesteps(); }
  torch::Tensor sigmas() const override { return inner_->sigmas(); }
  double init_noise_sigma() const override { return inner_->init_noise_sigma(); }
  torch::Tensor scale_model_input(const torch::Tensor& sample, double timestep) override {
    return inner_->scale_model_input(sample, timestep);
  }
  torch::Tensor step(const torch::Tensor& model_output, double timestep,
                     const torch::Tensor& sample, std::optional<at::Generator> generator) override {
    return inner_->step(model_output, timestep, sample, std::move(generator));
  }

 private:
  std::unique_ptr<Sampler> inner_;
  json file_keys_;
};

}  // namespace

std::vector<std::string> sampler_names() {
  std::vector<std::string> names;
  for (const auto& p : presets()) names.emplace_back(p.name);
  return names;
}

std::unique_ptr<Sampler> make_sampler(const json& scheduler_config, const std::string& kind,
                                      const std::string& source, const SamplerOptions& options) {
  const std::string at = where_of(source);
  if (!scheduler_config.is_object()) {
    throw Error(at + ": expected a JSON object (a scheduler_config.json), got " +
                shown(scheduler_config));
  }
  json config = scheduler_config;
  // from_config: keys the saving class filled from its own defaults do not carry over.
  if (config.contains("_use_default_values")) {
    const json& used = config["_use_default_values"];
    if (used.is_array()) {
      for (const auto& key : used) {
        if (key.is_string()) config.erase(key.get<std::string>());
      }
    }
    config.erase("_use_default_values");
  }
  const std::string choices = "use one of " + joined(sampler_names()) +
                              " (or a Diffusers class name: " + joined(class_names()) + ")";
  std::string class_name;
  const Preset* preset = nullptr;
  if (kind.empty()) {
    if (!config.contains("_class_name") || !config["_class_name"].is_string()) {
      throw Error(at + ": has no _class_name string, so the sampler is not known; choose one " +
                  "with --scheduler: " + choices);
    }
    class_name = config["_class_name"].get<std::string>();
    if (std::find(class_names().begin(), class_names().end(), class_name) == class_names().end()) {
      throw Error(at + ": _class_name '" + class_name +
                  "' is not a supported sampler; choose one with --scheduler: " + choices);
    }
  } else {
    for (const auto& p : presets()) {
      if (kind == p.name) preset = &p;
    }
    if (preset != nullptr) {
      class_name = preset->class_name;
    } else if (std::find(class_names().begin(), class_names().end(), kind) != class_names().end()) {
      class_name = kind;
    } else {
      throw Error("unknown scheduler '" + kind + "' for " + at + "; " + choices);
    }
  }
  if (preset != nullptr) preset->apply(config);
  config["_class_name"] = class_name;
  std::unique_ptr<Sampler> sampler = build(class_name, config, source, options);
  json file_keys = json::object();
  for (const auto& [key, value] : config.items()) {
    if (!key.empty() && key[0] != '_') file_keys[key] = value;
  }
  return std::make_unique<WithFileKeys>(std::move(sampler), std::move(file_keys));
}

std::unique_ptr<Sampler> load_sampler(const std::string& path, const std::string& kind,
                                      const SamplerOptions& options) {
  const std::string text = detail::read_config_text(path);
  json config;
  try {
    config = parse_python_json(text);
  } catch (const json::exception& e) {
    throw Error("scheduler config " + path + ": not valid JSON (" + e.what() + ")");
  }
  return make_sampler(config, kind, path, options);
}

namespace detail {

ConfigReader::ConfigReader(const nlohmann::json& config, std::string source)
    : config_(config), source_(std::move(source)) {}

std::string ConfigReader::where() const { return where_of(source_) + ": "; }

namespace {
const nlohmann::json* present(const nlohmann::json& config, const std::string& key) {
  if (!config.is_object() || !config.contains(key)) return nullptr;
  const nlohmann::json& v = config.at(key);
  return v.is_null() ? nullptr : &v;
}
}  // namespace

int64_t ConfigReader::get_int(const std::string& key, int64_t fallback) const {
  const nlohmann::json* v = present(config_, key);
  if (v == nullptr) return fallback;
  if (!v->is_number_integer()) {
    // Diffusers writes integers as JSON integers; 1.0 is accepted where it is whole.
    if (v->is_number_float()) {
      const double d = v->get<double>();
      if (std::isfinite(d) && d == std::floor(d) && std::abs(d) < 9.0e15) {
        return static_cast<int64_t>(d);
      }
    }
    throw Error(where() + key + " must be an integer, got " + shown(*v));
  }
  return v->get<int64_t>();
}

int64_t ConfigReader::get_non_negative_int(const std::string& key, int64_t fallback) const {
  const int64_t value = get_int(key, fallback);
  if (value < 0) throw Error(where() + key + " is " + std::to_string(value) + "; it must be >= 0");
  return value;
}

double ConfigReader::get_double(const std::string& key, double fallback) const {
  const nlohmann::json* v = present(config_, key);
  if (v == nullptr) return fallback;
  if (const auto token = python_float_token(*v)) return *token;
  if (!v->is_number()) throw Error(where() + key + " must be a number, got " + shown(*v));
  return v->get<double>();
}

std::optional<double> ConfigReader::get_optional_double(const std::string& key) const {
  const nlohmann::json* v = present(config_, key);
  if (v == nullptr) return std::nullopt;
  if (const auto token = python_float_token(*v)) return *token;
  if (!v->is_number()) throw Error(where() + key + " must be a number or null, got " + shown(*v));
  return v->get<double>();
}

bool ConfigReader::get_bool(const std::string& key, bool fallback) const {
  const nlohmann::json* v = present(config_, key);
  if (v == nullptr) return fallback;
  if (!v->is_boolean()) throw Error(where() + key + " must be true or false, got " + shown(*v));
  return v->get<bool>();
}

std::string ConfigReader::get_string(const std::string& key, const std::string& fallback) const {
  const nlohmann::json* v = present(config_, key);
  if (v == nullptr) return fallback;
  if (!v->is_string()) throw Error(where() + key + " must be a string, got " + shown(*v));
  return v->get<std::string>();
}

std::string ConfigReader::get_choice(const std::string& key, const std::string& fallback,
                                     const std::vector<std::string>& allowed) const {
  const std::string value = get_string(key, fallback);
  if (std::find(allowed.begin(), allowed.end(), value) == allowed.end()) {
    std::string list;
    for (const auto& a : allowed) list += (list.empty() ? "\"" : ", \"") + a + "\"";
    throw Error(where() + key + " is \"" + value + "\"; supported: " + list);
  }
  return value;
}

std::vector<int64_t> ConfigReader::get_int_list(const std::string& key) const {
  const nlohmann::json* v = present(config_, key);
  if (v == nullptr) return {};
  if (!v->is_array()) throw Error(where() + key + " must be a list of integers, got " + shown(*v));
  std::vector<int64_t> out;
  for (const auto& item : *v) {
    if (!item.is_number_integer()) {
      throw Error(where() + key + " must be a list of integers, got an item " + shown(item));
    }
    out.push_back(item.get<int64_t>());
  }
  return out;
}

SchedulerConfig ConfigReader::beta_config(const std::vector<BetaSchedule>& allowed) const {
  // Only the beta fields go through SchedulerConfig's reader (which type-checks and validates);
  // the other classes' fields (e.g. DPM's variance_type: null) are not DDPM's business.
  nlohmann::json betas = nlohmann::json::object();
  for (const char* key : {"num_train_timesteps", "beta_start", "beta_end", "beta_schedule",
                          "trained_betas", "rescale_betas_zero_snr"}) {
    const nlohmann::json* v = present(config_, key);
    if (v != nullptr) betas[key] = *v;
  }
  SchedulerConfig c = SchedulerConfig::from_json(betas, source_);
  if (std::find(allowed.begin(), allowed.end(), c.beta_schedule) == allowed.end()) {
    std::string list;
    for (const auto& a : allowed) list += (list.empty() ? "\"" : ", \"") + to_string(a) + "\"";
    const std::string cls = get_string("_class_name", "this scheduler");
    throw Error(where() + "beta_schedule \"" + to_string(c.beta_schedule) +
                "\" is not available in " + cls + "; supported: " + list);
  }
  return c;
}

torch::Tensor ConfigReader::alphas_cumprod(const std::vector<BetaSchedule>& allowed, bool rescale,
                                           bool zero_snr_fix) const {
  const SchedulerConfig c = beta_config(allowed);
  torch::Tensor betas = make_betas(c);
  const bool rescaled = rescale && c.rescale_betas_zero_snr;
  if (rescaled) betas = rescale_zero_terminal_snr(betas);
  const torch::Tensor alphas = 1.0 - betas;
  torch::Tensor ac = torch::cumprod(alphas, 0);
  // Diffusers: alphas_cumprod[-1] = 2**-24, so sigma_T = sqrt((1 - a) / a) stays finite.
  if (rescaled && zero_snr_fix) ac[-1] = std::ldexp(1.0, -24);
  return ac;
}

const std::vector<BetaSchedule>& sampler_beta_schedules() {
  static const std::vector<BetaSchedule> kAllowed = {
      BetaSchedule::kLinear, BetaSchedule::kScaledLinear, BetaSchedule::kSquaredcosCapV2};
  return kAllowed;
}

void put_beta_fields(const SchedulerConfig& betas, nlohmann::json& out) {
  out["num_train_timesteps"] = betas.num_train_timesteps;
  out["beta_start"] = betas.beta_start;
  out["beta_end"] = betas.beta_end;
  out["beta_schedule"] = to_string(betas.beta_schedule);
  out["trained_betas"] =
      betas.trained_betas ? nlohmann::json(*betas.trained_betas) : nlohmann::json(nullptr);
}

// ------------------------------------------------------------------------------ DDPM / DDIM

namespace {

SchedulerConfig noise_scheduler_config(const json& config, const std::string& source, bool ddim) {
  // DDPMScheduler takes every key but set_alpha_to_one, DDIMScheduler every key but variance_type.
  const char* not_taken = ddim ? "variance_type" : "set_alpha_to_one";
  json subset = json::object();
  for (const auto& key : noise_scheduler_keys()) {
    if (key == not_taken) continue;
    const json* v = present(config, key);
    if (v != nullptr) subset[key] = *v;
  }
  SchedulerConfig c = SchedulerConfig::from_json(subset, source);
  c.class_name = ddim ? "DDIMScheduler" : "DDPMScheduler";
  return c;
}

class NoiseSchedulerSampler : public Sampler {
 public:
  NoiseSchedulerSampler(std::unique_ptr<NoiseScheduler> scheduler, double eta)
      : scheduler_(std::move(scheduler)), eta_(eta) {}

  std::string class_name() const override { return scheduler_->class_name(); }

  json config() const override {
    json j = scheduler_->config().to_json();
    j.erase("_diffusers_version");
    for (const auto& [key, value] : scheduler_->config().extra.items()) j.erase(key);
    return j;
  }

  void set_timesteps(int64_t num_inference_steps) override {
    scheduler_->set_timesteps(num_inference_steps);
  }

  const torch::Tensor& timesteps() const override { return scheduler_->timesteps(); }

  torch::Tensor step(const torch::Tensor& model_output, double timestep,
                     const torch::Tensor& sample, std::optional<at::Generator> generator) override {
    const auto t = static_cast<int64_t>(timestep);
    if (static_cast<double>(t) != timestep) {
      throw Error(class_name() + "::step: timestep " + std::to_string(timestep) +
                  " is not an integer; pass timesteps()[i]");
    }
    if (auto* ddim = dynamic_cast<DDIMScheduler*>(scheduler_.get())) {
      return ddim->step(model_output, t, sample, eta_, false, generator).prev_sample;
    }
    return scheduler_->step(model_output, t, sample, generator).prev_sample;
  }

 private:
  std::unique_ptr<NoiseScheduler> scheduler_;
  double eta_;
};

}  // namespace

std::unique_ptr<Sampler> make_ddpm_sampler(const json& config, const std::string& source) {
  return std::make_unique<NoiseSchedulerSampler>(
      std::make_unique<DDPMScheduler>(noise_scheduler_config(config, source, false)), 0.0);
}

std::unique_ptr<Sampler> make_ddim_sampler(const json& config, const std::string& source,
                                           double eta) {
  if (!(eta >= 0) || !std::isfinite(eta)) {
    std::ostringstream shown_eta;
    shown_eta << eta;
    throw Error("DDIMScheduler: eta is " + shown_eta.str() +
                "; it must be a finite number >= 0 (0: deterministic DDIM, 1: DDPM-like noise)");
  }
  return std::make_unique<NoiseSchedulerSampler>(
      std::make_unique<DDIMScheduler>(noise_scheduler_config(config, source, true)), eta);
}

}  // namespace detail
}  // namespace difftrain::diffusion
