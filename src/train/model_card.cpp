// The README.md model card of an export (model_card.h): the YAML front matter through yaml-cpp's
// emitter (it quotes and escapes whatever a prompt holds), the Markdown body by hand, and the
// validation images beside it.
#include "difftrain/train/model_card.h"

#include "difftrain/core/env.h"
#include "difftrain/core/log.h"
#include "difftrain/io/atomic_file.h"
#include "difftrain/io/image.h"
#include "difftrain/train/trainer.h"
#include "difftrain/train/training_task.h"
#include "difftrain/version.h"

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <sstream>

namespace difftrain::train {
namespace fs = std::filesystem;
namespace {

std::string card_join(const std::vector<std::string>& items, const std::string& sep) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) out += (i ? sep : "") + items[i];
  return out;
}

// A number as a person writes it: 0.0001 -> 1e-04, 4 -> 4, 0.5 -> 0.5.
std::string card_number(double v) { return fmt::format("{:g}", v); }

// `text` as Markdown inline code on one line (a double-backtick span when it holds a backtick).
std::string card_code(std::string text) {
  std::replace(text.begin(), text.end(), '\n', ' ');
  std::replace(text.begin(), text.end(), '\r', ' ');
  if (text.find('`') != std::string::npos) return "`` " + text + " ``";
  return "`" + text + "`";
}

// A Markdown table cell: one line, '|' escaped.
std::string card_cell(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (c == '|') {
      out += "\\|";
    } else if (c == '\n' || c == '\r') {
      out += ' ';
    } else {
      out += c;
    }
  }
  return out;
}

// A Python string literal (JSON's double-quoted escapes are Python's too).
std::string py_string(const std::string& text) { return nlohmann::json(text).dump(); }

// A fenced code block that no line of `body` can close.
std::string card_fence(const std::string& lang, const std::string& body) {
  std::string fence = "```";
  while (body.find(fence) != std::string::npos) fence += '`';
  return fence + lang + "\n" + body + (body.empty() || body.back() != '\n' ? "\n" : "") + fence +
         "\n";
}

std::string front_matter(const ModelCard& card) {
  std::vector<std::string> tags = card.tags;
  for (const char* t : {"diffusers", "diffusers-training"}) tags.emplace_back(t);
  if (card.lora) tags.insert(tags.end(), {"lora", "template:sd-lora"});
  tags.emplace_back("difftrain");
  std::vector<std::string> unique;
  for (const auto& t : tags) {
    if (std::find(unique.begin(), unique.end(), t) == unique.end()) unique.push_back(t);
  }
  YAML::Emitter y;
  y << YAML::BeginMap;
  if (!card.base_model.empty()) y << YAML::Key << "base_model" << YAML::Value << card.base_model;
  y << YAML::Key << "library_name" << YAML::Value << "diffusers";
  y << YAML::Key << "license" << YAML::Value << card.license;
  y << YAML::Key << "tags" << YAML::Value << YAML::BeginSeq;
  for (const auto& t : unique) y << t;
  y << YAML::EndSeq;
  if (!card.instance_prompt.empty()) {
    y << YAML::Key << "instance_prompt" << YAML::Value << YAML::DoubleQuoted
      << card.instance_prompt;
  }
  if (!card.widget_texts.empty()) {
    y << YAML::Key << "widget" << YAML::Value << YAML::BeginSeq;
    for (size_t i = 0; i < card.widget_texts.size(); ++i) {
      y << YAML::BeginMap << YAML::Key << "text" << YAML::Value << YAML::DoubleQuoted
        << card.widget_texts[i] << YAML::Key << "output" << YAML::Value << YAML::BeginMap
        << YAML::Key << "url" << YAML::Value << "image_" + std::to_string(i) + ".png"
        << YAML::EndMap << YAML::EndMap;
    }
    y << YAML::EndSeq;
  }
  y << YAML::EndMap;
  return std::string("---\n") + y.c_str() + "\n---\n";
}

std::vector<std::pair<std::string, std::string>> run_rows(const ModelCardRun& r) {
  const int64_t global = r.per_rank_batch * r.ranks * r.accumulation;
  std::string lr = card_number(r.learning_rate);
  if (r.scale_lr) lr += fmt::format(" x global batch {} (--scale_lr)", global);
  std::string schedule = r.lr_scheduler;
  if (r.lr_warmup_steps > 0) schedule += fmt::format(", {} warm-up updates", r.lr_warmup_steps);
  return {{"updates", std::to_string(r.updates)},
          {"global batch", fmt::format("{} ({} per rank x {} rank(s) x {} accumulation step(s))",
                                       global, r.per_rank_batch, r.ranks, r.accumulation)},
          {"ranks", std::to_string(r.ranks)},
          {"mixed precision", r.mixed_precision.empty() ? "no" : r.mixed_precision},
          {"learning rate", lr},
          {"learning-rate schedule", schedule},
          {"optimizer", r.optimizer},
          {"EMA", r.ema ? "yes" : "no"},
          {"seed", std::to_string(r.seed)},
          {"difftrain version", DIFFTRAIN_VERSION}};
}

// Where the usage snippets load the export from: the run's folder as given.
std::string card_location(const ModelCard& card) {
  return card.run.output_dir.empty() ? std::string("path/to/this/folder") : card.run.output_dir;
}

std::string usage_python(const ModelCard& card) {
  const std::string here = card_location(card);
  const std::string model = card.lora && !card.base_model.empty() ? card.base_model : here;
  std::string py = "import torch\nfrom diffusers import " + card.pipeline_class + "\n\n";
  py += "pipeline = " + card.pipeline_class + ".from_pretrained(" + py_string(model) +
        (card.torch_dtype.empty() ? "" : ", torch_dtype=" + card.torch_dtype) + ")\n";
  // Half precision is for the GPU (Diffusers' cards: .to("cuda")); fp32 runs anywhere.
  py += card.torch_dtype.empty()
            ? "pipeline.to(\"cuda\" if torch.cuda.is_available() else \"cpu\")\n"
            : "pipeline.to(\"cuda\")\n";
  if (card.lora) {
    py += card.lora_loader + "(" + py_string(here) +
          ", weight_name=" + py_string(card.lora_weight_name) + card.lora_loader_args + ")\n";
  }
  if (!card.python_generate.empty()) {
    py += card.python_generate;
    if (py.back() != '\n') py += '\n';
  } else {
    const std::string prompt = !card.prompt.empty()            ? card.prompt
                               : !card.instance_prompt.empty() ? card.instance_prompt
                                                               : "your prompt";
    py += "image = pipeline(" + py_string(prompt) + ").images[0]\n";
  }
  return py + "image.save(\"image.png\")\n";
}

std::string usage_sample(const ModelCard& card) {
  const std::string here = card_location(card);
  std::vector<std::string> argv = {"difftrain", "sample", "--model"};
  argv.push_back(card.lora && !card.base_model.empty() ? card.base_model : here);
  if (card.lora)
    argv.insert(argv.end(), {"--lora", (fs::path(here) / card.lora_weight_name).string()});
  argv.insert(argv.end(), card.sample_flags.begin(), card.sample_flags.end());
  argv.insert(argv.end(), {"--output", "image.png"});
  return shell_command(argv);
}

}  // namespace

void add_task_details(ModelCard& card, const TaskOptions& o) {
  auto& rows = card.details;
  const auto& d = o.data;
  std::string dataset = d.dataset == "imagefolder" ? "image folder" : d.dataset;
  if (!d.train_data_dir.empty()) dataset += " (" + d.train_data_dir + ")";
  if (d.only_class) dataset += fmt::format(", class {} only", *d.only_class);
  if (d.max_train_samples > 0) dataset += fmt::format(", first {} examples", d.max_train_samples);
  rows.emplace_back("dataset", dataset);
  std::string resolution =
      d.crop_width > 0 ? fmt::format("{} x {} (width x height)", d.crop_width, d.crop_height)
                       : std::to_string(d.resolution);
  if (d.center_crop) resolution += ", center crop";
  if (d.random_flip) resolution += ", random flip";
  rows.emplace_back("resolution", resolution);
  if (d.resolution_buckets) {
    std::string b = fmt::format("step {}", d.bucket_step);
    if (d.bucket_min_side > 0) b += fmt::format(", shortest side {}", d.bucket_min_side);
    if (d.bucket_max_side > 0) b += fmt::format(", longest side {}", d.bucket_max_side);
    rows.emplace_back("aspect-ratio buckets", b);
  }
  if (o.lora.enabled) {
    const auto& l = o.lora;
    rows.emplace_back("LoRA", fmt::format("rank {}, alpha {}, dropout {}", l.rank,
                                          card_number(l.alpha), card_number(l.dropout)));
    rows.emplace_back("LoRA target modules",
                      card_join(l.layers.empty() ? l.target_modules : l.layers, ", "));
    rows.emplace_back("LoRA format", l.format);
    if (l.train_text_encoder) {
      rows.emplace_back(
          "text encoder",
          "LoRA too" + (l.text_encoder_target_modules.empty()
                            ? std::string()
                            : " (" + card_join(l.text_encoder_target_modules, ", ") + ")"));
    }
  }
  if (o.model.base_weights_dtype != "none" && !o.model.base_weights_dtype.empty()) {
    rows.emplace_back("frozen base weights", o.model.base_weights_dtype);
  }
  if (o.model.gradient_checkpointing) rows.emplace_back("gradient checkpointing", "yes");
  if (!o.text.instance_prompt.empty()) rows.emplace_back("instance prompt", o.text.instance_prompt);
  if (o.text.with_prior_preservation) {
    rows.emplace_back(
        "prior preservation",
        fmt::format("class prompt \"{}\", {} class images, loss weight {}", o.text.class_prompt,
                    o.text.num_class_images, card_number(o.text.prior_loss_weight)));
  }
  if (!o.validation.prompt.empty()) rows.emplace_back("validation prompt", o.validation.prompt);
  card.instance_prompt = o.text.instance_prompt;
  card.prompt = o.validation.prompt;
}

std::string card_prompt(const TaskOptions& o) {
  if (!o.validation.prompt.empty()) return o.validation.prompt;
  if (!o.text.instance_prompt.empty()) return o.text.instance_prompt;
  return "your prompt";
}

void set_card_detail(ModelCard& card, const std::string& name, const std::string& value) {
  for (auto& row : card.details) {
    if (row.first == name) {
      row.second = value;
      return;
    }
  }
  card.details.emplace_back(name, value);
}

ModelCardRun model_card_run(const TrainerOptions& o, int64_t ranks,
                            const std::string& mixed_precision, int64_t updates) {
  ModelCardRun r;
  r.updates = updates;
  r.per_rank_batch = o.train_batch_size;
  r.ranks = ranks;
  r.accumulation = o.gradient_accumulation_steps;
  r.mixed_precision = mixed_precision;
  r.learning_rate = o.learning_rate;
  r.scale_lr = o.scale_lr;
  r.lr_scheduler = o.lr_scheduler;
  r.lr_warmup_steps = o.lr_warmup_steps;
  std::string kind = o.optimizer;
  std::transform(kind.begin(), kind.end(), kind.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  r.optimizer = kind == "prodigy" ? "Prodigy" : o.use_8bit_adam ? "8-bit AdamW" : "AdamW";
  r.ema = o.use_ema;
  r.seed = o.seed;
  r.command = user_command();
  const nlohmann::json& shown = o.shown_config.is_null() ? o.config : o.shown_config;
  r.config_json = shown.is_null() ? "" : shown.dump(2);
  r.output_dir = o.output_dir;
  return r;
}

std::string render_model_card(const ModelCard& card) {
  std::ostringstream md;
  md << front_matter(card) << "\n# " << card.title << "\n\n";
  if (!card.widget_texts.empty()) md << "<Gallery />\n\n";
  md << "## Model description\n\n" << card.description << "\n\n";
  if (card.base_model.empty()) {
    md << "Trained from scratch: there is no base model.\n\n";
  } else {
    md << "Base model: " << card_code(card.base_model) << ".\n\n";
  }
  if (card.lora) {
    md << "These are LoRA weights, in " << card_code(card.lora_weight_name)
       << "; load them on top of the base model.\n\n";
  }
  if (!card.instance_prompt.empty()) {
    md << "## Trigger words\n\nYou should use " << card_code(card.instance_prompt)
       << " to trigger the image generation.\n\n";
  }
  md << "## Training details\n\n| setting | value |\n|---|---|\n";
  auto rows = card.details;
  const auto run = run_rows(card.run);
  rows.insert(rows.end(), run.begin(), run.end());
  for (const auto& [name, value] : rows) md << "| " << name << " | " << card_cell(value) << " |\n";
  md << "\nTrained with difftrain " << DIFFTRAIN_VERSION;
  if (!card.run.command.empty()) {
    md << ":\n\n" << card_fence("bash", card.run.command);
  } else {
    md << ".\n";
  }
  if (!card.run.config_json.empty()) {
    md << "\n<details>\n<summary>The resolved configuration of the run</summary>\n\n"
       << card_fence("json", card.run.config_json) << "\n</details>\n";
  }
  md << "\n## How to use\n\nWith [🧨 Diffusers](https://github.com/huggingface/diffusers) (use "
        "the "
        "Hub repository's name instead of the folder once uploaded):\n\n"
     << card_fence("py", usage_python(card)) << "\nWith difftrain:\n\n"
     << card_fence("bash", usage_sample(card));
  if (!card.license_note.empty()) md << "\n## License\n\n" << card.license_note << "\n";
  return md.str();
}

void write_model_card(const fs::path& dir, ModelCard card, const torch::Tensor& images,
                      const std::vector<std::string>& labels) {
  card.widget_texts.clear();
  if (images.defined() && images.size(0) > 0) {
    // A clip [F, H, W, C] is shown as its frames side by side.
    const bool clips = images.dim() == 5;
    const auto bytes = io::to_uint8_images(clips ? images.flatten(0, 1).permute({0, 3, 1, 2})
                                                 : images.permute({0, 3, 1, 2}));
    const int64_t count = images.size(0), frames = clips ? images.size(1) : 1;
    for (int64_t i = 0; i < count; ++i) {
      const auto file = (dir / ("image_" + std::to_string(i) + ".png")).string();
      io::save_png(file, clips ? io::make_grid(bytes.narrow(0, i * frames, frames), {}, frames, 0)
                               : bytes[i]);
      const auto at = static_cast<size_t>(i);
      card.widget_texts.push_back(!card.prompt.empty() ? card.prompt
                                  : at < labels.size() ? labels[at]
                                                       : " ");
    }
  }
  const auto path = (dir / "README.md").string();
  io::write_file_atomic(path, render_model_card(card));
  log::info("model card: {} ({} validation image(s))", path, card.widget_texts.size());
}

}  // namespace difftrain::train
