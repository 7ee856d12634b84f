// The README.md model card (train/model_card.h): its YAML front matter parses with yaml-cpp and
// holds every field the Hub reads (base_model only with a base, lora tags only for a LoRA, a
// widget only with images), awkward prompts round-trip exactly, and the body carries the
// training details and the usage snippets.

#include "difftrain/train/model_card.h"
#include "difftrain/io/atomic_file.h"
#include "difftrain/io/image.h"
#include "difftrain/version.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

namespace difftrain::test {
namespace {
namespace fs = std::filesystem;

// The YAML between the first two "---" lines of a card.
YAML::Node card_front_matter(const std::string& text) {
  EXPECT_EQ(text.rfind("---\n", 0), 0u) << text;
  const auto end = text.find("\n---\n", 4);
  EXPECT_NE(end, std::string::npos) << text;
  return YAML::Load(text.substr(4, end - 4));
}

std::vector<std::string> card_tags(const YAML::Node& y) {
  std::vector<std::string> tags;
  for (const auto& t : y["tags"]) tags.push_back(t.as<std::string>());
  return tags;
}

bool card_has(const std::vector<std::string>& v, const std::string& x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

train::ModelCard card_run_part(train::ModelCard card) {
  card.run.updates = 500;
  card.run.per_rank_batch = 4;
  card.run.ranks = 3;
  card.run.accumulation = 2;
  card.run.mixed_precision = "bf16";
  card.run.learning_rate = 1e-4;
  card.run.lr_scheduler = "cosine";
  card.run.lr_warmup_steps = 50;
  card.run.optimizer = "8-bit AdamW";
  card.run.seed = 42;
  card.run.command = "difftrain train --lora --rank 8";
  card.run.output_dir = "runs/my lora";
  return card;
}

TEST(ModelCard, PipelineFromScratchHasNoBaseModelAndLabelsAsWidgets) {
  train::ModelCard card;
  card.title = "DDPM class-conditional UNet";
  card.description = "A UNet.";
  card.license = "mit";
  card.tags = {"unconditional-image-generation", "ddpm"};
  card.pipeline_class = "DDPMPipeline";
  card.details = {{"dataset", "fashion_mnist"}};
  card.widget_texts = {"T-shirt/top", "Trouser"};
  card = card_run_part(card);
  const std::string text = train::render_model_card(card);
  const YAML::Node y = card_front_matter(text);
  EXPECT_FALSE(y["base_model"]) << text;
  EXPECT_EQ(y["library_name"].as<std::string>(), "diffusers");
  EXPECT_EQ(y["license"].as<std::string>(), "mit");
  const auto tags = card_tags(y);
  for (const char* t :
       {"unconditional-image-generation", "ddpm", "diffusers", "diffusers-training", "difftrain"}) {
    EXPECT_TRUE(card_has(tags, t)) << t;
  }
  EXPECT_FALSE(card_has(tags, "lora"));
  EXPECT_FALSE(card_has(tags, "template:sd-lora"));
  EXPECT_FALSE(y["instance_prompt"]);
  ASSERT_EQ(y["widget"].size(), 2u);
  EXPECT_EQ(y["widget"][0]["text"].as<std::string>(), "T-shirt/top");
  EXPECT_EQ(y["widget"][1]["output"]["url"].as<std::string>(), "image_1.png");
  EXPECT_NE(text.find("Trained from scratch: there is no base model."), std::string::npos);
  EXPECT_NE(text.find("DDPMPipeline.from_pretrained(\"runs/my lora\")"), std::string::npos) << text;
  EXPECT_NE(text.find("difftrain sample --model 'runs/my lora'"), std::string::npos) << text;
  // The run's part: the global batch spelt out, the version, the command.
  EXPECT_NE(text.find("| global batch | 24 (4 per rank x 3 rank(s) x 2 accumulation step(s)) |"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("| learning-rate schedule | cosine, 50 warm-up updates |"),
            std::string::npos);
  EXPECT_NE(text.find("| optimizer | 8-bit AdamW |"), std::string::npos);
  EXPECT_NE(text.find("| mixed precision | bf16 |"), std::string::npos);
  EXPECT_NE(text.find(std::string("| difftrain version | ") + DIFFTRAIN_VERSION + " |"),
            std::string::npos);
  EXPECT_NE(text.find("```bash\ndifftrain train --lora --rank 8\n```"), std::string::npos);
}

TEST(ModelCard, LoraWithAwkwardPromptsRoundTripsThroughYaml) {
  const std::string prompt = "a \"sks\" dog: #1 on 'grass' | {x: [y]}\nsecond line \\ `tick`";
  const std::string instance = "- sks: & * ! % @ `dog`";
  const std::string base = "org/model: v1 #main";
  train::ModelCard card;
  card.title = "Stable Diffusion DreamBooth LoRA";
  card.description = "Adapters.";
  card.base_model = base;
  card.license = "creativeml-openrail-m";
  card.tags = {"text-to-image", "stable-diffusion"};
  card.pipeline_class = "StableDiffusionPipeline";
  card.lora = true;
  card.lora_weight_name = "pytorch_lora_weights.safetensors";
  card.instance_prompt = instance;
  card.prompt = prompt;
  card.details = {{"validation prompt", prompt}};
  card.widget_texts = {prompt};
  card.sample_flags = {"--prompt", prompt};
  card = card_run_part(card);
  const std::string text = train::render_model_card(card);
  const YAML::Node y = card_front_matter(text);
  EXPECT_EQ(y["base_model"].as<std::string>(), base);
  EXPECT_EQ(y["license"].as<std::string>(), "creativeml-openrail-m");
  EXPECT_EQ(y["instance_prompt"].as<std::string>(), instance);
  ASSERT_EQ(y["widget"].size(), 1u);
  EXPECT_EQ(y["widget"][0]["text"].as<std::string>(), prompt);
  EXPECT_EQ(y["widget"][0]["output"]["url"].as<std::string>(), "image_0.png");
  const auto tags = card_tags(y);
  for (const char* t : {"lora", "template:sd-lora", "stable-diffusion", "text-to-image",
                        "diffusers", "diffusers-training", "difftrain"}) {
    EXPECT_TRUE(card_has(tags, t)) << t;
  }
  // The body: the LoRA loaded on the base with its file's name, the prompt as a Python string,
  // one table line with '|' escaped, and no line of the prompt starting a YAML key.
  EXPECT_NE(text.find("StableDiffusionPipeline.from_pretrained(\"org/model: v1 #main\")"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("pipeline.load_lora_weights(\"runs/my lora\", "
                      "weight_name=\"pytorch_lora_weights.safetensors\")"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("pipeline(\"a \\\"sks\\\" dog: #1 on 'grass' | {x: [y]}\\nsecond line "
                      "\\\\ `tick`\")"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("| validation prompt | a \"sks\" dog: #1 on 'grass' \\| {x: [y]} second "
                      "line \\ `tick` |"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("--lora 'runs/my lora/pytorch_lora_weights.safetensors'"), std::string::npos)
      << text;
  EXPECT_NE(text.find("## Trigger words"), std::string::npos);
}

TEST(ModelCard, WriteSavesTheImagesItNamesAndNoWidgetWithoutImages) {
  const auto dir = temp_dir("model_card");
  train::ModelCard card;
  card.title = "t";
  card.license = "mit";
  card.pipeline_class = "DDPMPipeline";
  card.prompt = "a red square";
  // No images (validation skipped): no widget, no files.
  fs::create_directories(dir + "/none");
  train::write_model_card(dir + "/none", card);
  const std::string none = io::read_file(dir + "/none/README.md");
  EXPECT_FALSE(card_front_matter(none)["widget"]) << none;
  EXPECT_EQ(none.find("<Gallery />"), std::string::npos);
  EXPECT_FALSE(fs::exists(dir + "/none/image_0.png"));
  // Two images [K, H, W, C] in [0, 1]: image_0/1.png as to_uint8_images makes them.
  fs::create_directories(dir + "/two");
  const auto images = torch::rand({2, 8, 6, 3});
  train::write_model_card(dir + "/two", card, images, {"label 0", "label 1"});
  const YAML::Node y = card_front_matter(io::read_file(dir + "/two/README.md"));
  ASSERT_EQ(y["widget"].size(), 2u);
  const auto expected = io::to_uint8_images(images.permute({0, 3, 1, 2}));
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(y["widget"][i]["text"].as<std::string>(), "a red square");
    const std::string file = y["widget"][i]["output"]["url"].as<std::string>();
    ASSERT_TRUE(fs::exists(dir + "/two/" + file)) << file;
    EXPECT_TRUE(torch::equal(io::load_image(dir + "/two/" + file), expected[i])) << file;
  }
  EXPECT_FALSE(fs::exists(dir + "/two/image_2.png"));
  // Without a prompt the widget texts are the labels, else " " (as Diffusers' scripts).
  card.prompt.clear();
  train::write_model_card(dir + "/two", card, images, {"Trouser"});
  const YAML::Node z = card_front_matter(io::read_file(dir + "/two/README.md"));
  EXPECT_EQ(z["widget"][0]["text"].as<std::string>(), "Trouser");
  EXPECT_EQ(z["widget"][1]["text"].as<std::string>(), " ");
  // Clips [K, F, H, W, C] (issue 57): each clip's widget image is its frames side by side.
  fs::create_directories(dir + "/clips");
  const auto clips = torch::rand({2, 3, 8, 6, 3});
  train::write_model_card(dir + "/clips", card, clips, {"a", "b"});
  const YAML::Node c = card_front_matter(io::read_file(dir + "/clips/README.md"));
  ASSERT_EQ(c["widget"].size(), 2u);
  for (int i = 0; i < 2; ++i) {
    const auto frames = io::to_uint8_images(clips[i].permute({0, 3, 1, 2}));  // [3, 8, 6, 3]
    const auto strip = torch::cat({frames[0], frames[1], frames[2]}, 1);      // [8, 18, 3]
    EXPECT_TRUE(
        torch::equal(io::load_image(dir + "/clips/image_" + std::to_string(i) + ".png"), strip))
        << i;
  }
}

}  // namespace
}  // namespace difftrain::test
