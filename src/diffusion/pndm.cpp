// Diffusers' PNDMScheduler (0.31): pseudo numerical methods for diffusion models. With
// skip_prk_steps (Stable Diffusion 1.x's setting) only the linear multistep (PLMS) part runs; the
// timestep list then repeats one timestep (n + 1 entries). Without it, 12 Runge-Kutta (PRK) steps
// over the last four timesteps come first. The step arithmetic is Diffusers' float32 tensor ops in
// Diffusers' order.

#include "difftrain/core/error.h"
#include "difftrain/diffusion/noise_scheduler.h"
#include "sampler_classes.h"

#include <torch/torch.h>

#include <algorithm>

namespace difftrain::diffusion::detail {
namespace {

using nlohmann::json;

constexpr int64_t kPndmOrder = 4;

class PndmSampler : public Sampler {
 public:
  PndmSampler(const json& config, const std::string& source) {
    const ConfigReader r(config, source);
    betas_ = r.beta_config(sampler_beta_schedules());
    skip_prk_steps_ = r.get_bool("skip_prk_steps", false);
    set_alpha_to_one_ = r.get_bool("set_alpha_to_one", false);
    prediction_type_ = r.get_choice("prediction_type", "epsilon", {"epsilon", "v_prediction"});
    timestep_spacing_ =
        r.get_choice("timestep_spacing", "leading", {"linspace", "leading", "trailing"});
    steps_offset_ = r.get_non_negative_int("steps_offset", 0);
    // PNDM has no rescale_betas_zero_snr: Diffusers ignores the key for this class.
    SchedulerConfig plain = betas_;
    plain.rescale_betas_zero_snr = false;
    alphas_cumprod_ = torch::cumprod(1.0 - make_betas(plain), 0);
    final_alpha_cumprod_ =
        set_alpha_to_one_ ? torch::tensor(1.0f, torch::kFloat32) : alphas_cumprod_[0].clone();
    timesteps_ = torch::empty({0}, torch::kLong);
  }

  std::string class_name() const override { return "PNDMScheduler"; }

  json config() const override {
    json j = json::object();
    j["_class_name"] = class_name();
    put_beta_fields(betas_, j);
    j["skip_prk_steps"] = skip_prk_steps_;
    j["set_alpha_to_one"] = set_alpha_to_one_;
    j["prediction_type"] = prediction_type_;
    j["timestep_spacing"] = timestep_spacing_;
    j["steps_offset"] = steps_offset_;
    return j;
  }

  void set_timesteps(int64_t n) override {
    const int64_t T = betas_.num_train_timesteps;
    if (!skip_prk_steps_ && n < kPndmOrder) {
      throw Error("PNDMScheduler: num_inference_steps is " + std::to_string(n) +
                  "; with skip_prk_steps false it must be at least 4 (the Runge-Kutta warm-up "
                  "uses the last four timesteps); use more steps or skip_prk_steps true");
    }
    // _timesteps, ascending (Diffusers keeps them ascending here and reverses below).
    torch::Tensor desc =
        make_inference_timesteps(T, n, parse_timestep_spacing(timestep_spacing_), steps_offset_);
    std::vector<int64_t> asc(desc.data_ptr<int64_t>(), desc.data_ptr<int64_t>() + desc.numel());
    std::reverse(asc.begin(), asc.end());
    const auto len = static_cast<int64_t>(asc.size());
    prk_timesteps_.clear();
    std::vector<int64_t> plms;
    if (skip_prk_steps_) {
      // concatenate([_t[:-1], _t[-2:-1], _t[-1:]])[::-1]
      std::vector<int64_t> cat(asc.begin(), asc.end() - 1);
      if (len >= 2) cat.push_back(asc[static_cast<size_t>(len - 2)]);
      cat.push_back(asc.back());
      plms.assign(cat.rbegin(), cat.rend());
    } else {
      // prk = _t[-4:].repeat(2) + tile([0, T // n // 2], 4); then prk[:-1].repeat(2)[1:-1][::-1]
      const int64_t half = T / n / 2;
      std::vector<int64_t> prk;
      for (int64_t k = len - kPndmOrder; k < len; ++k) {
        prk.push_back(asc[static_cast<size_t>(k)]);
        prk.push_back(asc[static_cast<size_t>(k)] + half);
      }
      prk.pop_back();
      std::vector<int64_t> doubled;
      for (int64_t v : prk) {
        doubled.push_back(v);
        doubled.push_back(v);
      }
      std::vector<int64_t> inner(doubled.begin() + 1, doubled.end() - 1);
      prk_timesteps_.assign(inner.rbegin(), inner.rend());
      // _t[:-3][::-1]
      plms.assign(asc.rbegin() + 3, asc.rend());
    }
    std::vector<int64_t> all = prk_timesteps_;
    all.insert(all.end(), plms.begin(), plms.end());
    timesteps_ = torch::tensor(all, torch::kLong);
    num_inference_steps_ = n;
    ets_.clear();
    counter_ = 0;
    cur_model_output_ = torch::Tensor();
    cur_sample_ = torch::Tensor();
  }

  const torch::Tensor& timesteps() const override { return timesteps_; }

  torch::Tensor step(const torch::Tensor& model_output, double timestep,
                     const torch::Tensor& sample, std::optional<at::Generator>) override {
    if (num_inference_steps_ == 0) {
      throw Error("PNDMScheduler::step: call set_timesteps() before the sampling loop");
    }
    const auto t = static_cast<int64_t>(timestep);
    if (static_cast<double>(t) != timestep) {
      throw Error("PNDMScheduler::step: timestep " + std::to_string(timestep) +
                  " is not an integer; pass timesteps()[i]");
    }
    if (counter_ < static_cast<int64_t>(prk_timesteps_.size()) && !skip_prk_steps_) {
      return step_prk(model_output, t, sample);
    }
    return step_plms(model_output, t, sample);
  }

 private:
  torch::Tensor step_prk(const torch::Tensor& model_output_in, int64_t timestep,
                         const torch::Tensor& sample) {
    const int64_t T = betas_.num_train_timesteps;
    const int64_t diff_to_prev = counter_ % 2 ? 0 : T / num_inference_steps_ / 2;
    const int64_t prev_timestep = timestep - diff_to_prev;
    timestep = prk_timesteps_[static_cast<size_t>(counter_ / 4 * 4)];
    torch::Tensor model_output = model_output_in;
    const auto accumulate = [&](double weight) {
      const torch::Tensor term = model_output_in * weight;
      if (cur_model_output_.defined()) {
        cur_model_output_ += term;
      } else {
        cur_model_output_ = 0 + term;  // Python: 0 + tensor
      }
    };
    if (counter_ % 4 == 0) {
      accumulate(1.0 / 6);
      ets_.push_back(model_output_in);
      cur_sample_ = sample;
    } else if ((counter_ - 1) % 4 == 0 || (counter_ - 2) % 4 == 0) {
      accumulate(1.0 / 3);
    } else {
      model_output = cur_model_output_ + model_output_in * (1.0 / 6);
      cur_model_output_ = torch::Tensor();
    }
    const torch::Tensor cur_sample = cur_sample_.defined() ? cur_sample_ : sample;
    torch::Tensor prev = prev_sample(cur_sample, timestep, prev_timestep, model_output);
    ++counter_;
    return prev;
  }

  torch::Tensor step_plms(const torch::Tensor& model_output_in, int64_t timestep,
                          const torch::Tensor& sample_in) {
    const int64_t T = betas_.num_train_timesteps;
    if (!skip_prk_steps_ && ets_.size() < 3) {
      throw Error(
          "PNDMScheduler::step: the PLMS steps need the 12 Runge-Kutta steps first; run "
          "the loop over timesteps() from its start");
    }
    int64_t prev_timestep = timestep - T / num_inference_steps_;
    if (counter_ != 1) {
      if (ets_.size() > 3) ets_.erase(ets_.begin(), ets_.end() - 3);
      ets_.push_back(model_output_in);
    } else {
      prev_timestep = timestep;
      timestep = timestep + T / num_inference_steps_;
    }
    torch::Tensor model_output = model_output_in;
    torch::Tensor sample = sample_in;
    const size_t n = ets_.size();
    if (n == 1 && counter_ == 0) {
      cur_sample_ = sample;
    } else if (n == 1 && counter_ == 1) {
      model_output = (model_output_in + ets_[n - 1]) / 2;
      sample = cur_sample_;
      cur_sample_ = torch::Tensor();
    } else if (n == 2) {
      model_output = (3 * ets_[n - 1] - ets_[n - 2]) / 2;
    } else if (n == 3) {
      model_output = (23 * ets_[n - 1] - 16 * ets_[n - 2] + 5 * ets_[n - 3]) / 12;
    } else {
      model_output =
          (1.0 / 24) * (55 * ets_[n - 1] - 59 * ets_[n - 2] + 37 * ets_[n - 3] - 9 * ets_[n - 4]);
    }
    torch::Tensor prev = prev_sample(sample, timestep, prev_timestep, model_output);
    ++counter_;
    return prev;
  }

  // Formula (9) of the PNDM paper: x_{t - delta} from x_t and the (combined) epsilon.
  torch::Tensor prev_sample(const torch::Tensor& sample, int64_t timestep, int64_t prev_timestep,
                            torch::Tensor model_output) const {
    const int64_t T = betas_.num_train_timesteps;
    if (timestep < 0 || timestep >= T || prev_timestep >= T) {
      throw Error("PNDMScheduler::step: timestep " + std::to_string(timestep) + " (previous " +
                  std::to_string(prev_timestep) + ") is outside [0, " + std::to_string(T - 1) +
                  "]; pass timesteps()[i] in order");
    }
    const torch::Tensor alpha_prod_t = alphas_cumprod_[timestep];
    const torch::Tensor alpha_prod_t_prev =
        prev_timestep >= 0 ? alphas_cumprod_[prev_timestep] : final_alpha_cumprod_;
    const torch::Tensor beta_prod_t = 1 - alpha_prod_t;
    const torch::Tensor beta_prod_t_prev = 1 - alpha_prod_t_prev;
    if (prediction_type_ == "v_prediction") {
      model_output = alpha_prod_t.pow(0.5) * model_output + beta_prod_t.pow(0.5) * sample;
    }
    const torch::Tensor sample_coeff = (alpha_prod_t_prev / alpha_prod_t).pow(0.5);
    const torch::Tensor denom = alpha_prod_t * beta_prod_t_prev.pow(0.5) +
                                (alpha_prod_t * beta_prod_t * alpha_prod_t_prev).pow(0.5);
    return sample_coeff * sample - (alpha_prod_t_prev - alpha_prod_t) * model_output / denom;
  }

  SchedulerConfig betas_;
  bool skip_prk_steps_ = false, set_alpha_to_one_ = false;
  std::string prediction_type_, timestep_spacing_;
  int64_t steps_offset_ = 0;
  torch::Tensor alphas_cumprod_, final_alpha_cumprod_;
  torch::Tensor timesteps_;
  std::vector<int64_t> prk_timesteps_;
  int64_t num_inference_steps_ = 0;
  int64_t counter_ = 0;
  std::vector<torch::Tensor> ets_;
  torch::Tensor cur_model_output_, cur_sample_;
};

}  // namespace

std::unique_ptr<Sampler> make_pndm_sampler(const json& config, const std::string& source) {
  return std::make_unique<PndmSampler>(config, source);
}

}  // namespace difftrain::diffusion::detail
