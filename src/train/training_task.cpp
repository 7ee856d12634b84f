// The counts every training task reports (training_task.h).
#include "difftrain/train/training_task.h"

#include "difftrain/models/kernels/quantized_weight.h"

#include <fmt/format.h>

namespace difftrain::train {

int64_t frozen_parameter_bytes(const torch::nn::Module& m) {
  int64_t n = 0;
  for (const auto& p : m.parameters())
    n += p.requires_grad() ? 0 : static_cast<int64_t>(p.nbytes());
  // 8-bit frozen weights are not parameters.
  return n + models::quantized_weight_bytes(m);
}

void quantize_frozen_base(accel::Accelerator& acc, const std::string& base_weights_dtype,
                          const std::vector<torch::nn::Module*>& modules) {
  const auto storage = models::parse_weight_storage(base_weights_dtype, "--base_weights_dtype");
  if (storage == models::WeightStorage::kDense) return;
  models::QuantizeSummary total;
  for (auto* m : modules) {
    if (m == nullptr) continue;
    const auto s = models::quantize_frozen_weights(*m, storage);
    total.layers += s.layers;
    total.kept_dense += s.kept_dense;
    total.weights += s.weights;
    total.bytes_before += s.bytes_before;
    total.bytes_after += s.bytes_after;
  }
  const double mib = 1024.0 * 1024.0;
  acc.print(
      "frozen base in {}: {} layer(s), {} weights, {:.2f} MiB -> {:.2f} MiB ({:.2f} bytes per "
      "weight with the scales); {} small layer(s) kept as they were",
      models::to_string(storage), total.layers, total.weights, total.bytes_before / mib,
      total.bytes_after / mib,
      total.weights > 0 ? static_cast<double>(total.bytes_after) / total.weights : 0.0,
      total.kept_dense);
}

std::string parameter_summary(const torch::nn::Module& model, const torch::nn::Module& trainable,
                              bool lora) {
  int64_t trained = 0, total = 0;
  for (const auto& p : model.parameters()) total += p.numel();
  for (const auto& p : trainable.parameters()) trained += p.requires_grad() ? p.numel() : 0;
  if (lora) total += trained;
  return fmt::format("parameters {} (trainable {}{})", total, trained, lora ? ", LoRA" : "");
}

ModelCard TrainingTask::model_card() const {
  ModelCard card;
  card.title = "difftrain " + name() + " model";
  card.description = "A model trained with `difftrain train` (task " + name() + ").";
  card.license = "other";
  card.pipeline_class = "DiffusionPipeline";
  return card;
}

}  // namespace difftrain::train
