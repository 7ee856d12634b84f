// The video data component (video_data.h).
#include "video_data.h"

#include "difftrain/core/error.h"
#include "difftrain/core/log.h"
#include "difftrain/core/phase.h"
#include "difftrain/io/atomic_file.h"
#include "difftrain/io/image.h"
#include "difftrain/io/safetensors.h"
#include "difftrain/io/video.h"
#include "difftrain/train/training_cache.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <fstream>
#include <set>
#include <sstream>

namespace difftrain::families {
namespace fs = std::filesystem;

namespace {

const std::vector<std::string> kExtractions = {"head", "chunk", "slide", "uniform", "full"};
const std::vector<std::string> kImageExtensions = {".png", ".jpg", ".jpeg", ".bmp", ".webp"};

std::string lower_extension(const fs::path& p) {
  std::string ext = p.extension().string();
  std::transform(ext.begin(), ext.end(), ext.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return ext;
}

bool has(const std::vector<std::string>& list, const std::string& s) {
  return std::find(list.begin(), list.end(), s) != list.end();
}
bool is_image(const fs::path& p) { return has(kImageExtensions, lower_extension(p)); }
bool is_video(const fs::path& p) { return has(io::video_read_extensions(), lower_extension(p)); }

std::string strip(const std::string& s) {
  const auto b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t\r\n") - b + 1);
}

// musubi-tuner reads a caption file whole and strips it.
std::optional<std::string> sidecar_caption(const fs::path& media, const std::string& extension) {
  if (extension.empty()) return std::nullopt;
  fs::path caption = media;
  caption = fs::is_directory(media) ? fs::path(media.string() + extension)
                                    : caption.replace_extension(extension);
  std::error_code ec;
  if (!fs::is_regular_file(caption, ec)) return std::nullopt;
  const std::string text = strip(io::read_file(caption.string()));
  if (text.empty()) return std::nullopt;
  return text;
}

std::vector<fs::path> sorted_entries(const fs::path& dir) {
  std::vector<fs::path> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path());
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<int64_t> rounded_frames(const std::vector<int64_t>& targets) {
  std::set<int64_t> r;
  for (int64_t f : targets) r.insert((f - 1) / 4 * 4 + 1);
  return {r.begin(), r.end()};
}

}  // namespace

torch::Tensor read_media_frames(const MediaFile& m, double target_fps) {
  switch (m.kind) {
    case MediaFile::Kind::kImage: return io::load_image(m.path, 3).unsqueeze(0);
    case MediaFile::Kind::kVideo: {
      io::VideoReadOptions r;
      r.target_fps = target_fps;
      return io::read_video(m.path, r).frames;
    }
    case MediaFile::Kind::kFrames: {
      std::vector<torch::Tensor> frames;
      for (const auto& p : sorted_entries(m.path)) {
        if (!is_image(p)) continue;
        frames.push_back(io::load_image(p.string(), 3));
        if (frames.back().sizes() != frames.front().sizes()) {
          throw Error(
              fmt::format("{}: frame {} is {}x{}, the first {}x{}; a clip's frames share "
                          "one size",
                          m.path, p.filename().string(), frames.back().size(0),
                          frames.back().size(1), frames.front().size(0), frames.front().size(1)));
        }
      }
      if (frames.empty()) throw Error(m.path + ": a folder of frames with no image in it");
      return torch::stack(frames);
    }
  }
  return {};
}

namespace {

// The cached examples: latents (and the family's extras) per item, the captions' embeddings.
class ClipDataset : public data::Dataset {
 public:
  std::vector<torch::Tensor> latents, embeds;                // per item (embeds trimmed)
  std::map<std::string, std::vector<torch::Tensor>> extras;  // name -> per item
  std::vector<int64_t> slot_item;                            // per slot
  int64_t text_length = 512;
  // Caption dropout: a dropped caption's example gets the empty caption's embeddings.
  train::CaptionProcessing captions;
  std::vector<std::string> item_captions;  // per item, for the draws
  torch::Tensor empty_embeds;              // [L, D] trimmed
  uint64_t caption_seed = 0;
  int64_t epoch = 0;

  int64_t size() const override { return static_cast<int64_t>(slot_item.size()); }
  data::Example get(int64_t index) const override {
    if (index < 0 || index >= size()) {
      throw Error(fmt::format("video data: example {} of {}", index, size()));
    }
    const auto i = static_cast<size_t>(slot_item[static_cast<size_t>(index)]);
    const bool dropped =
        captions.drops() &&
        captions.apply(item_captions[i], caption_seed, epoch, static_cast<int64_t>(i)).empty();
    const auto& e = dropped ? empty_embeds : embeds[i];
    auto padded = torch::zeros({text_length, e.size(1)}, e.options());
    padded.narrow(0, 0, std::min(text_length, e.size(0)))
        .copy_(e.narrow(0, 0, std::min(text_length, e.size(0))));
    data::Example ex{{"latents", latents[i]},
                     {"prompt_embeds", padded},
                     {"index", torch::tensor(static_cast<int64_t>(i), torch::kLong)}};
    for (const auto& [name, values] : extras) ex.emplace(name, values[i]);
    return ex;
  }
};

}  // namespace

VideoDataOptions VideoDataOptions::from(const train::FamilyOptions& f) {
  VideoDataOptions v;
  v.target_frames.clear();
  for (const auto& t : f.at("target_frames")) {
    const std::string s = t.is_string() ? t.get<std::string>() : t.dump();
    try {
      size_t used = 0;
      const long long n = std::stoll(s, &used);
      if (used != s.size() || n < 1) throw std::invalid_argument(s);
      v.target_frames.push_back(n);
    } catch (const std::exception&) {
      throw Error("--target_frames " + s + ": each length must be a whole number >= 1 (1 + 4k)");
    }
  }
  if (v.target_frames.empty())
    throw Error("--target_frames: give at least one length (e.g. 1,25,45)");
  v.frame_extraction = f.text("frame_extraction");
  v.frame_stride = f.integer("frame_stride");
  v.frame_sample = f.integer("frame_sample");
  v.max_frames = f.integer("max_frames");
  v.target_fps = f.number("target_fps");
  return v;
}

std::vector<train::OptionSpec> video_data_option_specs() {
  std::vector<train::OptionSpec> specs = {
      {"target_frames",
       "list",
       nlohmann::json::array({"1"}),
       "musubi-tuner's clip lengths, e.g. 1,25,45 (each rounded down to 1 + 4k; 1 trains "
       "stills)",
       {}},
      {"frame_extraction", "string", "head",
       "how clips are cut from a video: head | chunk | slide | uniform | full (musubi-tuner's)",
       train::one_of_check(kExtractions)},
      {"frame_stride", "int", 1, "slide: the window's step in frames", train::range_check(1, 1e9)},
      {"frame_sample", "int", 1, "uniform: clips per length, evenly spaced",
       train::range_check(1, 1e6)},
      {"max_frames", "int", 129, "full: the longest clip (rounded down to 1 + 4k)",
       train::range_check(1, 1e6)},
      {"target_fps", "float", 0.0,
       "resample videos to this rate by their timestamps (Wan trains at 16; musubi-tuner's "
       "source_fps); 0 takes every frame",
       train::range_check(0, 1000)},
  };
  for (auto& s : specs) s.structural = true;
  return specs;
}

std::vector<MediaFile> list_media_files(const train::DataOptions& d,
                                        const std::string& instance_prompt) {
  const fs::path dir(d.train_data_dir);
  std::error_code ec;
  if (d.train_data_dir.empty() || !fs::is_directory(dir, ec)) {
    throw Error("--train_data_dir " + d.train_data_dir +
                ": no such folder; give the folder of clips and images (with .txt captions or a "
                "metadata.jsonl)");
  }
  const fs::path root = fs::weakly_canonical(dir, ec);
  auto inside = [&](const fs::path& p) {
    const fs::path c = fs::weakly_canonical(p, ec);
    const auto r = c.lexically_relative(root);
    return !r.empty() && *r.begin() != "..";
  };
  auto kind_of = [](const fs::path& p) -> std::optional<MediaFile::Kind> {
    std::error_code e;
    if (fs::is_directory(p, e)) return MediaFile::Kind::kFrames;
    if (is_video(p)) return MediaFile::Kind::kVideo;
    if (is_image(p)) return MediaFile::Kind::kImage;
    return std::nullopt;
  };
  std::vector<MediaFile> out;
  std::vector<std::optional<std::string>> captions;
  const fs::path metadata = dir / "metadata.jsonl";
  if (fs::is_regular_file(metadata, ec)) {
    std::istringstream lines(io::read_file(metadata.string()));
    std::string line;
    int64_t number = 0;
    while (std::getline(lines, line)) {
      ++number;
      if (strip(line).empty()) continue;
      const std::string where = fmt::format("{} line {}", metadata.string(), number);
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(line);
      } catch (const nlohmann::json::exception&) {
        throw Error(where + ": not a JSON object");
      }
      const char* key = j.contains("video") ? "video" : "file_name";
      if (!j.is_object() || !j.contains(key) || !j[key].is_string()) {
        throw Error(where + ": needs a \"video\" or \"file_name\" string");
      }
      const fs::path rel(j[key].get<std::string>());
      const fs::path p = dir / rel;
      if (rel.is_absolute() || !inside(p)) {
        throw Error(where + ": " + rel.string() + " lies outside the folder");
      }
      if (!fs::exists(p, ec)) throw Error(where + ": " + p.string() + " does not exist");
      const auto kind = kind_of(p);
      if (!kind) {
        throw Error(where + ": " + rel.string() +
                    " is not an image, a video (.mp4 .webm .mov .mkv .avi .m4v .gif) or a folder "
                    "of frames");
      }
      std::optional<std::string> caption;
      if (j.contains(d.caption_column)) {
        if (!j[d.caption_column].is_string()) {
          throw Error(where + ": \"" + d.caption_column + "\" must be a string");
        }
        caption = j[d.caption_column].get<std::string>();
      }
      if (!caption) caption = sidecar_caption(p, d.caption_extension);
      out.push_back({p.string(), "", *kind});
      captions.push_back(caption);
    }
  } else {
    std::function<void(const fs::path&)> scan = [&](const fs::path& folder) {
      for (const auto& p : sorted_entries(folder)) {
        if (fs::is_directory(p, ec)) {
          // A folder with a caption file beside it is one clip of frames.
          if (!d.caption_extension.empty() &&
              fs::is_regular_file(p.string() + d.caption_extension, ec)) {
            out.push_back({p.string(), "", MediaFile::Kind::kFrames});
            captions.push_back(sidecar_caption(p, d.caption_extension));
          } else {
            scan(p);
          }
          continue;
        }
        const auto kind = kind_of(p);
        if (!kind) continue;
        if (!inside(p)) throw Error(p.string() + ": a link out of --train_data_dir");
        out.push_back({p.string(), "", *kind});
        captions.push_back(sidecar_caption(p, d.caption_extension));
      }
    };
    scan(dir);
  }
  if (out.empty()) {
    throw Error("--train_data_dir " + d.train_data_dir +
                ": no clips or images found; put .mp4 / .webm / .mov / .mkv videos, images, or "
                "folders of frames in it, each with a caption");
  }
  for (size_t i = 0; i < out.size(); ++i) {
    if (!instance_prompt.empty()) {
      out[i].caption = instance_prompt;
    } else if (captions[i]) {
      out[i].caption = *captions[i];
    } else {
      throw Error(out[i].path + ": no caption; give it a " +
                  (d.caption_extension.empty() ? std::string(".txt") : d.caption_extension) +
                  " file beside it, a \"" + d.caption_column +
                  "\" in metadata.jsonl, or --instance_prompt for every file");
    }
  }
  return out;
}

std::vector<std::pair<int64_t, int64_t>> extract_clips(int64_t count, const VideoDataOptions& v) {
  std::vector<std::pair<int64_t, int64_t>> out;
  const std::vector<int64_t> targets = rounded_frames(v.target_frames);
  std::string mode = v.frame_extraction;
  if (mode == "uniform" && v.frame_sample == 1) mode = "head";  // as musubi-tuner
  if (mode == "head") {
    for (int64_t t : targets) {
      if (count >= t) out.emplace_back(0, t);
    }
  } else if (mode == "chunk") {
    for (int64_t t : targets) {
      for (int64_t i = 0; i + t <= count; i += t) out.emplace_back(i, t);
    }
  } else if (mode == "slide") {
    for (int64_t t : targets) {
      for (int64_t i = 0; i + t <= count; i += v.frame_stride) out.emplace_back(i, t);
    }
  } else if (mode == "uniform") {
    for (int64_t t : targets) {
      if (count < t) continue;
      // np.linspace(0, count - t, frame_sample, dtype=int): start + k * step, the last exact.
      const double stop = static_cast<double>(count - t);
      const double step = stop / static_cast<double>(v.frame_sample - 1);
      for (int64_t k = 0; k < v.frame_sample; ++k) {
        const double x = k == v.frame_sample - 1 ? stop : static_cast<double>(k) * step;
        out.emplace_back(static_cast<int64_t>(x), t);
      }
    }
  } else if (mode == "full") {
    int64_t t = std::min(count, v.max_frames);
    t = (t - 1) / 4 * 4 + 1;
    out.emplace_back(0, t);
  } else {
    throw Error("--frame_extraction " + mode + ": use head, chunk, slide, uniform or full");
  }
  return out;
}

torch::Tensor clip_pixels(const torch::Tensor& frames, int64_t height, int64_t width) {
  const int64_t H = frames.size(1), W = frames.size(2);
  const double scale = std::max(static_cast<double>(width) / static_cast<double>(W),
                                static_cast<double>(height) / static_cast<double>(H));
  const auto nw = static_cast<int64_t>(static_cast<double>(W) * scale + 0.5);
  const auto nh = static_cast<int64_t>(static_cast<double>(H) * scale + 0.5);
  std::vector<torch::Tensor> out;
  for (int64_t f = 0; f < frames.size(0); ++f) {
    torch::Tensor x = frames[f];
    if (nw != W || nh != H) {
      x = io::resize_image(x.contiguous(), nh, nw,
                           scale > 1 ? io::Resample::kLanczos : io::Resample::kBilinear);
    }
    const int64_t left = (nw - width) / 2, top = (nh - height) / 2;
    out.push_back(x.narrow(0, top, height).narrow(1, left, width));
  }
  // [F, h, w, 3] → [3, F, h, w], musubi-tuner's contents / 127.5 - 1.
  return torch::stack(out)
      .permute({3, 0, 1, 2})
      .to(torch::kFloat32)
      .div(127.5)
      .sub(1.0)
      .contiguous();
}

std::function<std::vector<int64_t>(int64_t)> VideoData::sampler() const {
  auto layout = buckets_;
  const uint64_t seed = o_.data.seed;
  return [layout, seed](int64_t epoch) { return layout->epoch_order(seed, epoch); };
}

torch::Tensor VideoData::caption_embeds(const std::string& caption) const {
  const auto it = text_.find(caption);
  if (it == text_.end()) throw Error("video data: no cached embeddings of \"" + caption + "\"");
  return it->second;
}

void VideoData::build(accel::Accelerator& acc, const std::string& output_dir, const Parts& parts) {
  const auto& d = o_.data;
  for (int64_t t : v_.target_frames) {
    if ((t - 1) % 4 != 0) {
      acc.print("--target_frames {} is rounded down to {} (1 + 4k, as musubi-tuner rounds)", t,
                (t - 1) / 4 * 4 + 1);
    }
  }
  const int64_t m = parts.size_multiple;
  std::vector<std::array<int64_t, 2>> buckets;
  if (d.resolution_buckets) {
    if (d.bucket_step % m != 0) {
      throw Error(fmt::format("--bucket_step {} is not a multiple of {} ({})", d.bucket_step, m,
                              parts.size_reason));
    }
    data::BucketOptions bo;
    bo.resolution = d.resolution;
    bo.step = d.bucket_step;
    bo.min_side = d.bucket_min_side;
    bo.max_side = d.bucket_max_side;
    buckets = data::make_buckets(bo);
  } else if (d.height() % m != 0 || d.width() % m != 0) {
    throw Error(
        fmt::format("--resolution {}x{} (height x width): each side must be a multiple of "
                    "{} ({})",
                    d.height(), d.width(), m, parts.size_reason));
  }
  if (d.random_flip) {
    throw Error(
        "--random_flip: video latents are cached once (as musubi-tuner caches them); "
        "leave it out");
  }
  const auto& captions = o_.text.captions;
  if (captions.varies()) {
    throw Error(std::string(captions.shuffle ? "--shuffle_caption" : "--caption_tag_dropout_rate") +
                " changes the captions every epoch, and video training runs on cached text "
                "embeddings (as musubi-tuner caches them): leave it out");
  }
  if (d.masked_loss) {
    throw Error(
        "--masked_loss takes its masks from images (alpha or --conditioning_data_dir); video "
        "training has none: leave it out");
  }
  media_ = list_media_files(d, o_.text.instance_prompt);
  // kohya's prefix and suffix are part of every caption (and of the text cache).
  if (captions.affixes()) {
    for (auto& f : media_) f.caption = captions.fixed(f.caption);
  }

  const fs::path dir =
      o_.text.cache_dir.empty() ? fs::path(output_dir) / "cache" : fs::path(o_.text.cache_dir);
  if (acc.is_main_process()) {
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) throw Error("cannot create cache_dir " + dir.string() + ": " + ec.message());
  }
  acc.wait_for_everyone();
  const std::string what = fmt::format(
      "video-latents-v2;{};frames {};{};stride {};sample {};max {};fps {};{}", parts.latent_key,
      fmt::join(v_.target_frames, ","), v_.frame_extraction, v_.frame_stride, v_.frame_sample,
      v_.max_frames, v_.target_fps,
      d.resolution_buckets ? fmt::format("buckets {} {} {} {}", d.resolution, d.bucket_step,
                                         d.bucket_min_side, d.bucket_max_side)
                           : fmt::format("{}x{}", d.height(), d.width()));
  const fs::path file =
      dir / ("video-latents-" + train::cache_key(what + train::folder_stamp(d.train_data_dir)) +
             ".safetensors");
  const int rank = acc.process_index(), world = acc.num_processes();
  if (!fs::exists(file)) {
    core::PhaseScope phase("caching video latents");
    io::TensorMap tensors;
    nlohmann::json items = nlohmann::json::array();
    {
      torch::NoGradGuard no_grad;
      auto autocast = acc.autocast();
      for (size_t k = static_cast<size_t>(rank); k < media_.size(); k += world) {
        const MediaFile& f = media_[k];
        const torch::Tensor frames = read_media_frames(f, v_.target_fps);
        const auto clips = f.kind == MediaFile::Kind::kImage
                               ? std::vector<std::pair<int64_t, int64_t>>{{0, 1}}
                               : extract_clips(frames.size(0), v_);
        if (clips.empty()) {
          log::warn("{}: {} frame(s), fewer than every --target_frames ({}); skipped", f.path,
                    frames.size(0), fmt::join(rounded_frames(v_.target_frames), ","));
        }
        const int64_t H = frames.size(1), W = frames.size(2);
        const std::array<int64_t, 2> size =
            d.resolution_buckets ? buckets[static_cast<size_t>(data::nearest_bucket(buckets, H, W))]
                                 : std::array<int64_t, 2>{d.height(), d.width()};
        for (size_t c = 0; c < clips.size(); ++c) {
          const auto px =
              clip_pixels(frames.narrow(0, clips[c].first, clips[c].second), size[0], size[1])
                  .unsqueeze(0);
          const std::string name = fmt::format("{}.{}", k, c);
          tensors["latents." + name] = parts.encode(px)[0].to(torch::kCPU, torch::kFloat32);
          for (const auto& [extra, encode] : parts.extras) {
            tensors[extra + "." + name] = encode(px)[0].to(torch::kCPU, torch::kFloat32);
          }
          items.push_back({{"media", k},
                           {"clip", c},
                           {"start", clips[c].first},
                           {"frames", clips[c].second},
                           {"height", size[0]},
                           {"width", size[1]}});
        }
        core::note_progress();
      }
    }
    const fs::path part = file.string() + ".part" + std::to_string(rank);
    io::save_safetensors(part.string(), tensors, {{"items", items.dump()}});
    acc.wait_for_everyone();
    if (acc.is_main_process()) {
      std::vector<nlohmann::json> all;
      std::map<std::string, io::TensorMap> by_part;
      for (int r = 0; r < world; ++r) {
        const std::string p = file.string() + ".part" + std::to_string(r);
        auto st = io::load_safetensors(p);
        for (const auto& it : nlohmann::json::parse(st.metadata.at("items"))) all.push_back(it);
        for (auto& [name, t] : st.tensors) by_part[""][name] = t;
      }
      std::sort(all.begin(), all.end(), [](const nlohmann::json& a, const nlohmann::json& b) {
        return std::make_pair(a["media"].get<int64_t>(), a["clip"].get<int64_t>()) <
               std::make_pair(b["media"].get<int64_t>(), b["clip"].get<int64_t>());
      });
      io::TensorMap joined;
      auto& src = by_part[""];
      for (size_t i = 0; i < all.size(); ++i) {
        const std::string name =
            fmt::format("{}.{}", all[i]["media"].get<int64_t>(), all[i]["clip"].get<int64_t>());
        joined["latents." + std::to_string(i)] = src.at("latents." + name);
        for (const auto& extra : parts.extras) {
          joined[extra.first + "." + std::to_string(i)] = src.at(extra.first + "." + name);
        }
      }
      if (all.empty()) {
        throw Error("--train_data_dir " + d.train_data_dir +
                    ": no clip is as long as any --target_frames; lower it");
      }
      io::save_safetensors(file.string(), joined, {{"items", nlohmann::json(all).dump()}});
      for (int r = 0; r < world; ++r) fs::remove(file.string() + ".part" + std::to_string(r));
      log::info("video data: encoded {} clip(s) of {} file(s) into {}", all.size(), media_.size(),
                file.string());
    }
    acc.wait_for_everyone();
  } else {
    acc.print("video data: reusing {}", file.string());
  }
  auto ds = std::make_shared<ClipDataset>();
  ds->text_length = parts.text_length;
  {
    auto st = io::load_safetensors(file.string());
    const auto it = st.metadata.find("items");
    if (it == st.metadata.end()) {
      throw Error(file.string() + ": not a video latent cache; delete it (it is rebuilt)");
    }
    const auto all = nlohmann::json::parse(it->second);
    items_.clear();
    for (size_t i = 0; i < all.size(); ++i) {
      ClipItem c;
      c.media = all[i]["media"].get<int64_t>();
      c.start = all[i]["start"].get<int64_t>();
      c.frames = all[i]["frames"].get<int64_t>();
      c.height = all[i]["height"].get<int64_t>();
      c.width = all[i]["width"].get<int64_t>();
      if (c.media < 0 || c.media >= static_cast<int64_t>(media_.size())) {
        throw Error(file.string() + ": names a file the folder no longer has; delete it");
      }
      c.caption = media_[static_cast<size_t>(c.media)].caption;
      items_.push_back(c);
      const std::string n = std::to_string(i);
      ds->latents.push_back(st.tensors.at("latents." + n));
      for (const auto& extra : parts.extras) {
        ds->extras[extra.first].push_back(st.tensors.at(extra.first + "." + n));
      }
    }
  }

  // The captions' embeddings, trimmed to their tokens.
  std::set<std::string> unique;
  for (const auto& c : items_) unique.insert(c.caption);
  if (o_.text.captions.drops()) unique.insert("");  // a dropped caption is the empty one
  const std::vector<std::string> caption_list(unique.begin(), unique.end());
  std::string text_what = "video-text-v1;" + parts.text_key;
  for (const auto& c : caption_list) text_what += "\n" + c;
  const fs::path text_file =
      dir / ("text-embeddings-" + train::cache_key(text_what) + ".safetensors");
  if (!fs::exists(text_file)) {
    core::PhaseScope phase("caching text embeddings");
    const auto n = static_cast<int64_t>(caption_list.size());
    const int64_t begin = n * rank / world, end = n * (rank + 1) / world;
    io::TensorMap tensors;
    {
      torch::NoGradGuard no_grad;
      for (int64_t s = begin; s < end; s += 16) {
        const int64_t e = std::min(end, s + 16);
        const auto enc = parts.encode_text(
            std::vector<std::string>(caption_list.begin() + s, caption_list.begin() + e));
        const auto embeds = enc.at("prompt_embeds").to(torch::kCPU, torch::kFloat32);
        const auto lengths = enc.at("prompt_lengths").to(torch::kCPU);
        for (int64_t i = s; i < e; ++i) {
          tensors["embeds." + std::to_string(i)] =
              embeds[i - s].narrow(0, 0, lengths[i - s].item<int64_t>()).clone();
        }
        core::note_progress();
      }
    }
    const fs::path part = text_file.string() + ".part" + std::to_string(rank);
    io::save_safetensors(part.string(), tensors);
    acc.wait_for_everyone();
    if (acc.is_main_process()) {
      io::TensorMap all;
      for (int r = 0; r < world; ++r) {
        const std::string p = text_file.string() + ".part" + std::to_string(r);
        for (auto& [name, t] : io::load_safetensors(p).tensors) all[name] = t;
        fs::remove(p);
      }
      io::save_safetensors(text_file.string(), all,
                           {{"captions", nlohmann::json(caption_list).dump()}});
    }
    acc.wait_for_everyone();
  }
  {
    auto st = io::load_safetensors(text_file.string());
    const auto stored = nlohmann::json::parse(st.metadata.at("captions"));
    for (size_t i = 0; i < stored.size(); ++i) {
      text_[stored[i].get<std::string>()] = st.tensors.at("embeds." + std::to_string(i));
    }
  }
  for (const auto& c : items_) {
    ds->embeds.push_back(caption_embeds(c.caption));
    ds->item_captions.push_back(c.caption);
  }
  if (o_.text.captions.drops()) {
    ds->captions = o_.text.captions;
    ds->caption_seed = d.seed;
    ds->empty_embeds = caption_embeds("");
  }
  clips_ = ds;

  // Buckets: the latents' (frames, height, width).
  std::map<std::vector<int64_t>, int64_t> keys;
  std::vector<int64_t> assignment;
  std::vector<std::array<int64_t, 2>> labels;
  for (size_t i = 0; i < items_.size(); ++i) {
    const auto s = ds->latents[i].sizes();
    const std::vector<int64_t> key(s.begin() + 1, s.end());
    auto [it, added] = keys.emplace(key, static_cast<int64_t>(labels.size()));
    if (added) labels.push_back({items_[i].height, items_[i].width});
    assignment.push_back(it->second);
  }
  const int64_t group = acc.options().split_batches
                            ? d.train_batch_size
                            : d.train_batch_size * static_cast<int64_t>(acc.num_processes());
  buckets_ = std::make_shared<data::BucketLayout>(labels, assignment, group);
  for (int64_t k = 0; k < buckets_->num_slots(); ++k) {
    ds->slot_item.push_back(buckets_->image_of_slot(k));
  }
  dataset_ = ds;
  std::map<std::string, int64_t> counts;
  for (const auto& c : items_) counts[fmt::format("{}x{}x{}", c.frames, c.height, c.width)]++;
  std::vector<std::string> lines;
  for (const auto& [k, n] : counts) lines.push_back(fmt::format("{}: {}", k, n));
  acc.print(
      "video data: {} file(s), {} clip(s) in {} slot(s); buckets (frames x height x "
      "width) {}",
      media_.size(), items_.size(), buckets_->num_slots(), fmt::join(lines, ", "));
}

void VideoData::set_epoch(int64_t epoch) {
  if (clips_) static_cast<ClipDataset&>(*clips_).epoch = epoch;
}

}  // namespace difftrain::families
