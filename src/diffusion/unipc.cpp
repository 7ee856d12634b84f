// UniPCMultistepScheduler of Diffusers 0.31 as a Sampler: the UniP predictor and UniC corrector
// with B(h) = h (bh1) or e^h - 1 (bh2), any order, on x0 (predict_x0) or epsilon. The sigmas and
// coefficients are 0-dim float32 tensors and every formula keeps Diffusers' operation order, so a
// step runs the same torch kernels on the same values as Diffusers does.

#include "difftrain/core/error.h"
#include "multistep_common.h"
#include "sampler_classes.h"
#include "sigma_schedule.h"

#include <torch/torch.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

namespace difftrain::diffusion::detail {

namespace {

constexpr const char* kClass = "UniPCMultistepScheduler";

class UniPcSampler final : public Sampler {
 public:
  UniPcSampler(const nlohmann::json& json, const std::string& source) : reader_(json, source) {
    const ConfigReader& r = reader_;
    betas_ = r.beta_config(multistep_beta_schedules());
    solver_order_ = r.get_int("solver_order", 2);
    prediction_type_ =
        r.get_choice("prediction_type", "epsilon", {"epsilon", "sample", "v_prediction"});
    thresholding_ = r.get_bool("thresholding", false);
    dynamic_thresholding_ratio_ = r.get_double("dynamic_thresholding_ratio", 0.995);
    sample_max_value_ = r.get_double("sample_max_value", 1.0);
    predict_x0_ = r.get_bool("predict_x0", true);
    const std::string solver =
        r.get_choice("solver_type", "bh2", {"bh1", "bh2", "midpoint", "heun", "logrho"});
    // Diffusers registers DPM-Solver's solver types as bh2.
    solver_type_ = (solver == "bh1" || solver == "bh2") ? solver : "bh2";
    lower_order_final_ = r.get_bool("lower_order_final", true);
    disable_corrector_ = r.get_int_list("disable_corrector");
    use_karras_sigmas_ = r.get_bool("use_karras_sigmas", false);
    use_exponential_sigmas_ = r.get_bool("use_exponential_sigmas", false);
    use_beta_sigmas_ = r.get_bool("use_beta_sigmas", false);
    timestep_spacing_ =
        r.get_choice("timestep_spacing", "linspace", {"linspace", "leading", "trailing"});
    steps_offset_ = r.get_int("steps_offset", 0);
    final_sigmas_type_ = r.get_choice("final_sigmas_type", "zero", {"zero", "sigma_min"});

    const std::string where = r.where();
    if (solver_order_ < 1) {
      throw Error(where + "solver_order is " + std::to_string(solver_order_) +
                  "; it must be >= 1 (2 for guided sampling, 3 for unconditional)");
    }
    if (int(use_karras_sigmas_) + int(use_exponential_sigmas_) + int(use_beta_sigmas_) > 1) {
      throw Error(where +
                  "only one of use_karras_sigmas, use_exponential_sigmas and "
                  "use_beta_sigmas may be true");
    }
    if (use_exponential_sigmas_ || use_beta_sigmas_) {
      // Diffusers 0.31's UniPC fails on these itself (log_sigmas is undefined there).
      throw Error(where + (use_beta_sigmas_ ? "use_beta_sigmas" : "use_exponential_sigmas") +
                  " is not supported by " + kClass +
                  " (it fails in Diffusers 0.31 too); use "
                  "use_karras_sigmas");
    }
    const auto solver_p = r.json().find("solver_p");
    if (solver_p != r.json().end() && !solver_p->is_null()) {
      throw Error(where +
                  "solver_p (another scheduler as the predictor) is not supported; set "
                  "it to null");
    }
    if (thresholding_ && !(dynamic_thresholding_ratio_ > 0 && dynamic_thresholding_ratio_ <= 1)) {
      throw Error(where + "dynamic_thresholding_ratio must be in (0, 1]");
    }
    if (steps_offset_ < 0) throw Error(where + "steps_offset must be >= 0");

    const torch::Tensor alphas_cumprod = r.alphas_cumprod(multistep_beta_schedules(), true, true);
    train_sigmas_ = sigmas_from_alphas_cumprod(alphas_cumprod);
  }

  std::string class_name() const override { return kClass; }

  nlohmann::json config() const override {
    nlohmann::json c = nlohmann::json::object();
    c["_class_name"] = kClass;
    put_beta_fields(reader_, betas_, c);
    c["solver_order"] = solver_order_;
    c["prediction_type"] = prediction_type_;
    c["thresholding"] = thresholding_;
    c["dynamic_thresholding_ratio"] = dynamic_thresholding_ratio_;
    c["sample_max_value"] = sample_max_value_;
    c["predict_x0"] = predict_x0_;
    c["solver_type"] = solver_type_;
    c["lower_order_final"] = lower_order_final_;
    c["disable_corrector"] = disable_corrector_;
    c["solver_p"] = nullptr;
    c["use_karras_sigmas"] = use_karras_sigmas_;
    c["use_exponential_sigmas"] = use_exponential_sigmas_;
    c["use_beta_sigmas"] = use_beta_sigmas_;
    c["timestep_spacing"] = timestep_spacing_;
    c["steps_offset"] = steps_offset_;
    c["final_sigmas_type"] = final_sigmas_type_;
    return c;
  }

  void set_timesteps(int64_t n) override {
    check_num_inference_steps(n, kClass);
    const int64_t T = betas_.num_train_timesteps;
    std::vector<int64_t> ts = multistep_timesteps(T, T, n, timestep_spacing_, steps_offset_);
    if (ts.empty()) {
      throw Error(std::string(kClass) + ": set_timesteps(" + std::to_string(n) +
                  ") gives no timesteps with timestep_spacing '" + timestep_spacing_ +
                  "'; use more steps or another spacing");
    }
    std::vector<double> sigmas;
    multistep_sigmas(use_karras_sigmas_ ? SigmaSpacing::kKarras : SigmaSpacing::kInterp, n,
                     train_sigmas_, ts, sigmas);
    double sigma_last = 0.0;
    if (final_sigmas_type_ == "sigma_min") {
      // Karras: the last Karras sigma; otherwise the training sigma of timestep 0.
      sigma_last = use_karras_sigmas_ ? sigmas.back() : static_cast<double>(train_sigmas_.front());
    }
    sigmas.push_back(sigma_last);
    std::vector<float> sigmas32(sigmas.begin(), sigmas.end());
    sigmas_ = torch::tensor(sigmas32, torch::kFloat32);
    timesteps_ = torch::tensor(ts, torch::kLong);
    num_inference_steps_ = static_cast<int64_t>(ts.size());
    model_outputs_.assign(static_cast<size_t>(solver_order_), torch::Tensor());
    lower_order_nums_ = 0;
    this_order_ = 0;
    last_sample_ = torch::Tensor();
    step_index_.reset();
  }

  const torch::Tensor& timesteps() const override { return timesteps_; }
  torch::Tensor sigmas() const override { return sigmas_; }

  torch::Tensor step(const torch::Tensor& model_output, double timestep,
                     const torch::Tensor& sample_in, std::optional<at::Generator>) override {
    if (num_inference_steps_ == 0) {
      throw Error(std::string(kClass) +
                  ": step() before set_timesteps(); call set_timesteps first");
    }
    if (!step_index_) step_index_ = index_for_timestep(timesteps_, timestep);
    const int64_t i = *step_index_;
    const int64_t L = timesteps_.size(0);
    if (i >= L) {
      throw Error(std::string(kClass) + ": step() called " + std::to_string(i + 1) +
                  " times after set_timesteps(" + std::to_string(L) +
                  "); call set_timesteps again to sample anew");
    }
    if (model_output.sizes() != sample_in.sizes()) {
      throw Error(std::string(kClass) + ": model_output and sample shapes differ");
    }
    const bool disabled = std::find(disable_corrector_.begin(), disable_corrector_.end(), i - 1) !=
                          disable_corrector_.end();
    const bool use_corrector = i > 0 && !disabled && last_sample_.defined();
    const torch::Tensor converted = convert_model_output(model_output, sample_in, i);
    torch::Tensor sample = sample_in;
    if (use_corrector)
      sample = corrector_update(converted, last_sample_, sample_in, this_order_, i);

    for (int64_t k = 0; k + 1 < solver_order_; ++k) model_outputs_[k] = model_outputs_[k + 1];
    model_outputs_.back() = converted;

    const int64_t order = lower_order_final_ ? std::min(solver_order_, L - i) : solver_order_;
    this_order_ = std::min(order, lower_order_nums_ + 1);  // warm-up of the multistep history
    last_sample_ = sample;
    const torch::Tensor prev = predictor_update(sample, this_order_, i);
    if (lower_order_nums_ < solver_order_) ++lower_order_nums_;
    step_index_ = i + 1;
    return prev;
  }

 private:
  // Diffusers' convert_model_output: x0 (predict_x0) or epsilon.
  torch::Tensor convert_model_output(const torch::Tensor& model_output, const torch::Tensor& sample,
                                     int64_t i) const {
    const auto [alpha_t, sigma_t] = sigma_to_alpha_sigma_t(sigmas_[i]);
    if (predict_x0_) {
      torch::Tensor x0;
      if (prediction_type_ == "epsilon") {
        x0 = (sample - sigma_t * model_output) / alpha_t;
      } else if (prediction_type_ == "sample") {
        x0 = model_output;
      } else {
        x0 = alpha_t * sample - sigma_t * model_output;
      }
      if (thresholding_) {
        x0 = threshold_sample(x0, dynamic_thresholding_ratio_, sample_max_value_, kClass);
      }
      return x0;
    }
    if (prediction_type_ == "epsilon") return model_output;
    if (prediction_type_ == "sample") return (sample - alpha_t * model_output) / sigma_t;
    return alpha_t * model_output + sigma_t * sample;
  }

  // The B(h) coefficients shared by UniP and UniC: h_phi_1 = expm1(hh), B_h, and the
  // right-hand side b [order] of the rho system; rks [order] ends with 1.
  struct Coefficients {
    torch::Tensor hh, h_phi_1, B_h, R, b;
  };
  Coefficients coefficients(const torch::Tensor& h, const std::vector<torch::Tensor>& rks_in,
                            int64_t order, const torch::Device& device) const {
    Coefficients c;
    std::vector<torch::Tensor> rks = rks_in;
    rks.push_back(torch::scalar_tensor(1.0, torch::kFloat32));
    const torch::Tensor rk = torch::stack(rks).to(device);
    c.hh = predict_x0_ ? -h : h;
    c.h_phi_1 = torch::expm1(c.hh);  // h * phi_1(h) = e^h - 1
    torch::Tensor h_phi_k = c.h_phi_1 / c.hh - 1;
    int64_t factorial_i = 1;
    c.B_h = solver_type_ == "bh1" ? c.hh : torch::expm1(c.hh);
    std::vector<torch::Tensor> R, b;
    for (int64_t k = 1; k <= order; ++k) {
      R.push_back(torch::pow(rk, k - 1));
      b.push_back(h_phi_k * factorial_i / c.B_h);
      factorial_i *= k + 1;
      h_phi_k = h_phi_k / c.hh - 1.0 / static_cast<double>(factorial_i);
    }
    c.R = torch::stack(R);
    c.b = torch::stack(b).to(device);
    return c;
  }

  // x_t_ of both updates: the first-order part.
  torch::Tensor base_update(const torch::Tensor& x, const torch::Tensor& m0, const Coefficients& c,
                            const torch::Tensor& alpha_t, const torch::Tensor& sigma_t,
                            const torch::Tensor& alpha_s0, const torch::Tensor& sigma_s0) const {
    if (predict_x0_) return sigma_t / sigma_s0 * x - alpha_t * c.h_phi_1 * m0;
    return alpha_t / alpha_s0 * x - sigma_t * c.h_phi_1 * m0;
  }

  // UniP-`order` (B(h) version) from sample at sigmas[i] to sigmas[i + 1].
  torch::Tensor predictor_update(const torch::Tensor& x, int64_t order, int64_t i) const {
    const torch::Tensor& m0 = model_outputs_.back();
    const auto [alpha_t, sigma_t] = sigma_to_alpha_sigma_t(sigmas_[i + 1]);
    const auto [alpha_s0, sigma_s0] = sigma_to_alpha_sigma_t(sigmas_[i]);
    const torch::Tensor lambda_s0 = lambda_of(alpha_s0, sigma_s0);
    const torch::Tensor h = lambda_of(alpha_t, sigma_t) - lambda_s0;
    std::vector<torch::Tensor> rks, D1s;
    for (int64_t k = 1; k < order; ++k) {
      const torch::Tensor& mi = model_outputs_[model_outputs_.size() - 1 - k];
      const auto [alpha_si, sigma_si] = sigma_to_alpha_sigma_t(sigmas_[i - k]);
      const torch::Tensor rk = (lambda_of(alpha_si, sigma_si) - lambda_s0) / h;
      rks.push_back(rk);
      D1s.push_back((mi - m0) / rk);
    }
    const Coefficients c = coefficients(h, rks, order, x.device());
    const torch::Tensor x_t_ = base_update(x, m0, c, alpha_t, sigma_t, alpha_s0, sigma_s0);
    const torch::Tensor scale = predict_x0_ ? alpha_t * c.B_h : sigma_t * c.B_h;
    torch::Tensor x_t;
    if (D1s.empty()) {
      // Diffusers: pred_res = 0 (a Python int), so the term is (scale * 0), NaN when B_h = -inf.
      x_t = x_t_ - scale * 0;
    } else {
      const torch::Tensor D = torch::stack(D1s, 1);  // [B, K, C, ...]
      torch::Tensor rhos_p;
      if (order == 2) {
        rhos_p =
            torch::tensor({0.5}, torch::TensorOptions().dtype(x.scalar_type()).device(x.device()));
      } else {
        const int64_t k = c.R.size(0) - 1;
        rhos_p = at::linalg_solve(c.R.slice(0, 0, k).slice(1, 0, k), c.b.slice(0, 0, k))
                     .to(x.device())
                     .to(x.scalar_type());
      }
      const torch::Tensor pred_res = torch::einsum("k,bkc...->bc...", {rhos_p, D});
      x_t = x_t_ - scale * pred_res;
    }
    return x_t.to(x.scalar_type());
  }

  // UniC-`order`: corrects this_sample (at sigmas[i]) from last_sample (at sigmas[i - 1]) with
  // the model output at this_sample.
  torch::Tensor corrector_update(const torch::Tensor& model_t, const torch::Tensor& x,
                                 const torch::Tensor& this_sample, int64_t order, int64_t i) const {
    const torch::Tensor& m0 = model_outputs_.back();
    const auto [alpha_t, sigma_t] = sigma_to_alpha_sigma_t(sigmas_[i]);
    const auto [alpha_s0, sigma_s0] = sigma_to_alpha_sigma_t(sigmas_[i - 1]);
    const torch::Tensor lambda_s0 = lambda_of(alpha_s0, sigma_s0);
    const torch::Tensor h = lambda_of(alpha_t, sigma_t) - lambda_s0;
    std::vector<torch::Tensor> rks, D1s;
    for (int64_t k = 1; k < order; ++k) {
      const torch::Tensor& mi = model_outputs_[model_outputs_.size() - 1 - k];
      const auto [alpha_si, sigma_si] = sigma_to_alpha_sigma_t(sigmas_[i - (k + 1)]);
      const torch::Tensor rk = (lambda_of(alpha_si, sigma_si) - lambda_s0) / h;
      rks.push_back(rk);
      D1s.push_back((mi - m0) / rk);
    }
    const torch::Device device = this_sample.device();
    const Coefficients c = coefficients(h, rks, order, device);
    torch::Tensor rhos_c;
    if (order == 1) {
      rhos_c = torch::tensor({0.5}, torch::TensorOptions().dtype(x.scalar_type()).device(device));
    } else {
      rhos_c = at::linalg_solve(c.R, c.b).to(device).to(x.scalar_type());
    }
    const torch::Tensor x_t_ = base_update(x, m0, c, alpha_t, sigma_t, alpha_s0, sigma_s0);
    const torch::Tensor D1_t = model_t - m0;
    const torch::Tensor last_rho = rhos_c[rhos_c.size(0) - 1];
    torch::Tensor inner;
    if (D1s.empty()) {
      inner = 0 + last_rho * D1_t;
    } else {
      const torch::Tensor D = torch::stack(D1s, 1);
      const torch::Tensor corr_res =
          torch::einsum("k,bkc...->bc...", {rhos_c.slice(0, 0, rhos_c.size(0) - 1), D});
      inner = corr_res + last_rho * D1_t;
    }
    const torch::Tensor scale = predict_x0_ ? alpha_t * c.B_h : sigma_t * c.B_h;
    return (x_t_ - scale * inner).to(x.scalar_type());
  }

  ConfigReader reader_;
  SchedulerConfig betas_;
  int64_t solver_order_ = 2;
  std::string prediction_type_, solver_type_, timestep_spacing_, final_sigmas_type_;
  bool thresholding_ = false, predict_x0_ = true, lower_order_final_ = true;
  bool use_karras_sigmas_ = false, use_exponential_sigmas_ = false, use_beta_sigmas_ = false;
  double dynamic_thresholding_ratio_ = 0.995, sample_max_value_ = 1.0;
  std::vector<int64_t> disable_corrector_;
  int64_t steps_offset_ = 0;

  std::vector<float> train_sigmas_;  // [T]

  torch::Tensor timesteps_;  // int64 [L]
  torch::Tensor sigmas_;     // float32 [L + 1]
  int64_t num_inference_steps_ = 0;
  std::vector<torch::Tensor> model_outputs_;  // the last solver_order converted outputs
  int64_t lower_order_nums_ = 0;
  int64_t this_order_ = 0;
  torch::Tensor last_sample_;  // the sample the last predictor started from
  std::optional<int64_t> step_index_;
};

}  // namespace

std::unique_ptr<Sampler> make_unipc_sampler(const nlohmann::json& config,
                                            const std::string& source) {
  return std::make_unique<UniPcSampler>(config, source);
}

}  // namespace difftrain::diffusion::detail
