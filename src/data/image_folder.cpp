#include "difftrain/data/image_folder.h"

#include "difftrain/core/error.h"
#include "difftrain/core/log.h"
#include "difftrain/core/sample_rng.h"
#include "difftrain/data/media_reader.h"
#include "difftrain/io/image.h"

#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <utility>

namespace difftrain::data {
namespace {

namespace fs = std::filesystem;

// The byte offset of the first byte that does not start or continue a well-formed UTF-8
// sequence (overlong forms, surrogates and code points past U+10FFFF count as ill-formed), or
// npos when `text` is valid UTF-8.
size_t first_invalid_utf8(const std::string& text) {
  size_t i = 0;
  while (i < text.size()) {
    const auto c = static_cast<unsigned char>(text[i]);
    size_t len = 0;
    unsigned char lo = 0x80, hi = 0xBF;  // the allowed range of the second byte
    if (c < 0x80) {
      ++i;
      continue;
    } else if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      if (c == 0xE0) lo = 0xA0;
      if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      if (c == 0xF0) lo = 0x90;
      if (c == 0xF4) hi = 0x8F;
    } else {
      return i;
    }
    if (i + len > text.size()) return i;
    for (size_t k = 1; k < len; ++k) {
      const auto b = static_cast<unsigned char>(text[i + k]);
      if (k == 1 ? (b < lo || b > hi) : (b < 0x80 || b > 0xBF)) return i;
    }
    i += len;
  }
  return std::string::npos;
}

constexpr const char* kMetadataName = "metadata.jsonl";

// One image as listed: its path relative to the folder, and what metadata.jsonl says of it.
struct Entry {
  std::string file;
  std::optional<int64_t> label;
  std::optional<std::string> caption;
  std::optional<std::string> mask;  // metadata.jsonl's mask file, relative to the folder
  int64_t line = 0;                 // in metadata.jsonl; 0 when found by scanning
};

// An image, or a clip a registered reader takes (data/media_reader.h).
bool has_image_extension(const fs::path& path) { return is_media_file(path.string()); }

// The mask file of an image (ImageFolderOptions::masks): in mask_dir (same relative path, any
// image extension), else metadata.jsonl's; "" = the image's alpha channel.
std::string find_mask(const Entry& e, const fs::path& dir, const ImageFolderOptions& options) {
  if (!options.mask_dir.empty()) {
    const fs::path rel = fs::path(e.file).replace_extension();
    std::error_code ec;
    for (const char* ext : {".png", ".PNG", ".webp", ".jpg", ".jpeg", ".bmp"}) {
      const fs::path candidate = fs::path(options.mask_dir) / (rel.string() + ext);
      if (fs::is_regular_file(candidate, ec)) return candidate.string();
    }
    throw Error(fmt::format(
        "{}: no mask in {} (looked for {}.png, .webp, .jpg, .bmp); --masked_loss with "
        "--conditioning_data_dir needs one mask image per training image, white = trained",
        (dir / e.file).string(), options.mask_dir, rel.generic_string()));
  }
  return e.mask ? (dir / *e.mask).string() : std::string();
}

// kohya's DreamBooth folder name "<repeats>_<name>" ("10_sks dog"): {repeats, name}, or repeats
// -1 when the name is not of that form.
std::pair<int64_t, std::string> kohya_folder(const std::string& folder) {
  const auto underscore = folder.find('_');
  if (underscore == 0 || underscore == std::string::npos || underscore + 1 == folder.size()) {
    return {-1, ""};
  }
  const std::string digits = folder.substr(0, underscore);
  if (digits.size() > 6 ||
      !std::all_of(digits.begin(), digits.end(), [](unsigned char c) { return std::isdigit(c); })) {
    return {-1, ""};
  }
  return {std::stoll(digits), folder.substr(underscore + 1)};
}

// Hidden files and folders (".git", ".ipynb_checkpoints") and "__MACOSX"-style folders are not
// data, as in HF's data-file patterns.
bool is_hidden(const fs::path& path) {
  const std::string name = path.filename().string();
  return name.rfind('.', 0) == 0 || name.rfind("__", 0) == 0;
}

// Whether `path` (canonical) is `root` (canonical) or lies below it, compared by components so
// that /data/set2 is not "inside" /data/set.
bool is_inside(const fs::path& root, const fs::path& path) {
  auto p = path.begin();
  for (auto r = root.begin(); r != root.end(); ++r, ++p) {
    if (p == path.end() || *r != *p) return false;
  }
  return true;
}

// Round half to even, as Python's round() in torchvision's center_crop.
int64_t round_half_even(double x) { return static_cast<int64_t>(std::nearbyint(x)); }

// Checks one metadata.jsonl file_name and returns it normalised ('/'-separated, no "./").
std::string checked_file_name(const std::string& name, const fs::path& dir, const fs::path& root,
                              const std::string& where) {
  const fs::path relative(name);
  if (name.empty()) throw Error(where + ": file_name is empty; give the image's relative path");
  if (relative.has_root_path()) {
    throw Error(fmt::format("{}: file_name \"{}\" is absolute; give a path relative to {}", where,
                            name, dir.string()));
  }
  for (const auto& part : relative) {
    if (part == "..") {
      throw Error(fmt::format(
          "{}: file_name \"{}\" contains '..'; images must lie inside {} (no '..' components)",
          where, name, dir.string()));
    }
  }
  const fs::path full = dir / relative;
  std::error_code ec;
  if (!fs::exists(full, ec)) {
    throw Error(fmt::format("{}: file_name \"{}\" is listed but {} does not exist", where, name,
                            full.string()));
  }
  const fs::path resolved = fs::weakly_canonical(full, ec);
  if (ec || !is_inside(root, resolved)) {
    throw Error(fmt::format(
        "{}: file_name \"{}\" resolves to {}, outside {} (a symbolic link out of the folder); "
        "copy the image into the folder instead",
        where, name, ec ? "an unresolvable path" : resolved.string(), dir.string()));
  }
  if (!fs::is_regular_file(resolved, ec)) {
    throw Error(fmt::format("{}: file_name \"{}\" is not a file", where, name));
  }
  return relative.lexically_normal().generic_string();
}

std::vector<Entry> read_metadata(const fs::path& metadata, const fs::path& dir,
                                 const fs::path& root, const ImageFolderOptions& options) {
  std::ifstream in(metadata);
  if (!in) throw Error(metadata.string() + ": cannot be read; check its permissions");
  std::vector<Entry> entries;
  std::string text;
  for (int64_t line = 1; std::getline(in, text); ++line) {
    if (!text.empty() && text.back() == '\r') text.pop_back();
    if (std::all_of(text.begin(), text.end(), [](unsigned char c) { return std::isspace(c); })) {
      continue;
    }
    const std::string where = fmt::format("{} line {}", metadata.string(), line);
    // Checked before parsing: the JSON parser's message would quote the bad bytes themselves.
    if (const size_t bad = first_invalid_utf8(text); bad != std::string::npos) {
      throw Error(fmt::format(
          "{}: not valid UTF-8 (byte 0x{:02X} at column {}); save metadata.jsonl as UTF-8, e.g. "
          "iconv -f latin1 -t utf-8",
          where, static_cast<unsigned>(static_cast<unsigned char>(text[bad])), bad + 1));
    }
    nlohmann::json json;
    try {
      json = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception& e) {  // parse_error, or out_of_range for 1e999
      throw Error(
          fmt::format("{}: not valid JSON ({}); each line must be one object such as "
                      "{{\"file_name\": \"a.png\", \"label\": 0}}",
                      where, e.what()));
    }
    if (!json.is_object() || !json.contains("file_name") || !json["file_name"].is_string()) {
      throw Error(where +
                  ": no \"file_name\" string; each line must be one object such as "
                  "{\"file_name\": \"a.png\", \"label\": 0}");
    }
    Entry entry;
    entry.line = line;
    entry.file = checked_file_name(json["file_name"].get<std::string>(), dir, root, where);
    if (auto it = json.find(options.label_column); it != json.end() && !it->is_null()) {
      if (!it->is_number_integer() || it->get<int64_t>() < 0) {
        throw Error(fmt::format("{}: \"{}\" is {}; a label must be an integer >= 0", where,
                                options.label_column, it->dump()));
      }
      entry.label = it->get<int64_t>();
    }
    if (auto it = json.find(options.caption_column); it != json.end() && !it->is_null()) {
      if (!it->is_string()) {
        throw Error(fmt::format("{}: \"{}\" is {}; a caption must be a string", where,
                                options.caption_column, it->dump()));
      }
      entry.caption = it->get<std::string>();
    }
    if (auto it = json.find(options.mask_column);
        options.masks && it != json.end() && !it->is_null()) {
      if (!it->is_string()) {
        throw Error(fmt::format("{}: \"{}\" is {}; a mask must be an image file name", where,
                                options.mask_column, it->dump()));
      }
      entry.mask = checked_file_name(it->get<std::string>(), dir, root, where);
    }
    entries.push_back(std::move(entry));
  }
  const auto labelled = std::count_if(entries.begin(), entries.end(),
                                      [](const Entry& e) { return e.label.has_value(); });
  if (labelled > 0 && labelled < static_cast<int64_t>(entries.size())) {
    const auto& first = *std::find_if(entries.begin(), entries.end(),
                                      [](const Entry& e) { return !e.label.has_value(); });
    throw Error(fmt::format(
        "{} line {}: no \"{}\", but other lines have one; give every line a label or none",
        metadata.string(), first.line, options.label_column));
  }
  return entries;
}

// Every image below `dir`, sorted by relative path; symbolic links must stay inside. The other
// files found (not hidden, not images) go to `others`, relative to `dir`.
std::vector<Entry> scan_folder(const fs::path& dir, const fs::path& root,
                               std::vector<std::string>& others) {
  std::vector<Entry> entries;
  std::error_code ec;
  fs::recursive_directory_iterator it(dir, fs::directory_options::skip_permission_denied, ec);
  for (; !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
    const fs::path& path = it->path();
    if (is_hidden(path)) {
      if (it->is_directory(ec)) it.disable_recursion_pending();
      continue;
    }
    if (!it->is_regular_file(ec)) continue;
    const std::string relative = path.lexically_relative(dir).generic_string();
    if (!has_image_extension(path)) {
      others.push_back(relative);
      continue;
    }
    if (it->is_symlink(ec)) {
      const fs::path resolved = fs::weakly_canonical(path, ec);
      if (ec || !is_inside(root, resolved)) {
        throw Error(fmt::format(
            "{}: a symbolic link to {}, outside {}; copy the image into the folder instead",
            path.string(), ec ? "an unresolvable path" : resolved.string(), dir.string()));
      }
    }
    entries.push_back({relative, std::nullopt, std::nullopt, std::nullopt, 0});
  }
  if (ec) throw Error(fmt::format("{}: cannot list the folder ({})", dir.string(), ec.message()));
  std::sort(entries.begin(), entries.end(),
            [](const Entry& a, const Entry& b) { return a.file < b.file; });
  std::sort(others.begin(), others.end());
  return entries;
}

// Says once (main rank) which files of a scanned folder are not trained on, and why: caption
// files with no image beside them, files of other types (what kohya and Diffusers would also
// pass over, but silently).
void report_other_files(const std::string& dir, const std::vector<Entry>& images,
                        const std::vector<std::string>& others, const std::string& caption_ext) {
  std::set<std::string> stems;
  for (const Entry& e : images) stems.insert(fs::path(e.file).replace_extension().generic_string());
  std::vector<std::string> orphan_captions, other_types;
  for (const auto& f : others) {
    const fs::path p(f);
    if (!caption_ext.empty() && p.extension() == caption_ext) {
      if (stems.count(fs::path(p).replace_extension().generic_string()) == 0) {
        orphan_captions.push_back(f);
      }
    } else if (p.filename() != "metadata.jsonl") {
      other_types.push_back(f);
    }
  }
  if ((orphan_captions.empty() && other_types.empty()) || log::rank() != 0) return;
  std::string why;
  if (!orphan_captions.empty()) {
    why += fmt::format("{} {} file(s) with no image of the same name (first: {})",
                       orphan_captions.size(), caption_ext, orphan_captions.front());
  }
  if (!other_types.empty()) {
    why += fmt::format("{}{} file(s) that are not PNG, JPEG, WebP or BMP images (first: {})",
                       why.empty() ? "" : "; ", other_types.size(), other_types.front());
  }
  log::warn("{}: skipped {} file(s): {}", dir, orphan_captions.size() + other_types.size(), why);
}

// kohya-style sidecar captions: `<dir>/<image without extension><extension>`, UTF-8, its first
// non-empty line with the surrounding white space trimmed. Fills the captions metadata.jsonl did
// not give and returns how many images had both (metadata.jsonl wins).
int64_t read_sidecar_captions(std::vector<Entry>& entries, const fs::path& dir,
                              const std::string& extension) {
  int64_t both = 0;
  if (extension.empty()) return both;
  for (Entry& e : entries) {
    fs::path sidecar = dir / e.file;
    sidecar.replace_extension(extension);
    std::error_code ec;
    if (!fs::is_regular_file(sidecar, ec)) continue;
    if (e.caption) {
      ++both;
      continue;
    }
    std::ifstream in(sidecar, std::ios::binary);
    if (!in) throw Error(sidecar.string() + ": cannot be read; check its permissions");
    std::string line, caption;
    while (caption.empty() && std::getline(in, line)) {
      const auto first = line.find_first_not_of(" \t\r\n");
      if (first == std::string::npos) continue;
      caption = line.substr(first, line.find_last_not_of(" \t\r\n") - first + 1);
    }
    line = caption;
    if (line.rfind("\xEF\xBB\xBF", 0) == 0) line.erase(0, 3);  // a UTF-8 byte order mark
    if (const size_t bad = first_invalid_utf8(line); bad != std::string::npos) {
      throw Error(fmt::format(
          "{}: not valid UTF-8 (byte 0x{:02X} at column {}); save the caption as UTF-8, e.g. "
          "iconv -f latin1 -t utf-8",
          sidecar.string(), static_cast<unsigned>(static_cast<unsigned char>(line[bad])), bad + 1));
    }
    e.caption = line;
  }
  return both;
}

// HF imagefolder's inferred labels: every image directly in a first-level sub-folder, and at
// least two sub-folders. Returns the sorted sub-folder names (empty: no labels).
std::vector<std::string> infer_labels(std::vector<Entry>& entries) {
  std::vector<std::string> names;
  for (const Entry& e : entries) {
    const auto slash = e.file.find('/');
    if (slash == std::string::npos || e.file.find('/', slash + 1) != std::string::npos) return {};
    names.push_back(e.file.substr(0, slash));
  }
  std::sort(names.begin(), names.end());
  names.erase(std::unique(names.begin(), names.end()), names.end());
  if (names.size() < 2) return {};
  for (Entry& e : entries) {
    const auto folder = e.file.substr(0, e.file.find('/'));
    e.label = std::lower_bound(names.begin(), names.end(), folder) - names.begin();
  }
  return names;
}

// kohya's layout: images in first-level "<N>_<name>" folders, used N times per epoch. It counts
// once one first-level folder is so named; then images elsewhere are not trained on (kohya skips
// them too), and said so. Fills `kohya` (folder -> its images) and returns the images kept.
std::vector<Entry> kohya_repeat_folders(std::vector<Entry> entries, const std::string& dir,
                                        std::map<std::string, int64_t>& kohya_) {
  bool kohya = false;
  for (const Entry& e : entries) {
    const auto slash = e.file.find('/');
    if (slash != std::string::npos && kohya_folder(e.file.substr(0, slash)).first >= 0) {
      kohya = true;
      break;
    }
  }
  if (!kohya) return entries;
  std::vector<Entry> kept;
  std::vector<std::string> outside;
  for (Entry& e : entries) {
    const auto slash = e.file.find('/');
    const std::string folder = slash == std::string::npos ? "" : e.file.substr(0, slash);
    const auto [repeats, name] = kohya_folder(folder);
    if (repeats < 0) {
      outside.push_back(e.file);
      continue;
    }
    if (repeats == 0) {
      throw Error(fmt::format(
          "{}/{}: a kohya folder with 0 repeats; name it <repeats>_<name> with repeats >= 1 "
          "(e.g. 10_{})",
          dir, folder, name));
    }
    ++kohya_[folder];
    kept.push_back(std::move(e));
  }
  if (!outside.empty() && log::rank() == 0) {
    log::warn(
        "{}: skipped {} image(s) outside the kohya <repeats>_<name> folders (first: {}); move "
        "them into one such as 1_{}",
        dir, outside.size(), outside.front(), "images");
  }
  return kept;
}

}  // namespace

ImageFolderDataset::ImageFolderDataset(ImageFolderOptions options) : options_(std::move(options)) {
  if (options_.resolution < 1) {
    throw Error(fmt::format("ImageFolderDataset: resolution is {}; it must be >= 1 (e.g. 64)",
                            options_.resolution));
  }
  if (options_.channels != 1 && options_.channels != 3) {
    throw Error(fmt::format("ImageFolderDataset: channels is {}; use 3 (RGB) or 1 (grayscale)",
                            options_.channels));
  }
  const fs::path dir(options_.dir);
  std::error_code ec;
  if (options_.dir.empty() || !fs::exists(dir, ec)) {
    throw Error(
        fmt::format("{}: no such folder; pass --train_data_dir pointing to a folder of "
                    "PNG, JPEG or BMP images",
                    options_.dir.empty() ? "\"\"" : options_.dir));
  }
  if (!fs::is_directory(dir, ec)) {
    throw Error(options_.dir + ": is a file, not a folder; pass the folder that holds the images");
  }
  const fs::path root = fs::canonical(dir, ec);
  if (ec)
    throw Error(fmt::format("{}: cannot resolve the folder ({})", options_.dir, ec.message()));

  const fs::path metadata = dir / kMetadataName;
  std::vector<Entry> entries;
  if (fs::exists(metadata, ec)) {
    entries = read_metadata(metadata, dir, root, options_);
    if (!entries.empty() && entries.front().label) {
      int64_t max_label = 0;
      for (const Entry& e : entries) max_label = std::max(max_label, *e.label);
      for (int64_t k = 0; k <= max_label; ++k) class_names_.push_back(std::to_string(k));
    }
  } else {
    std::vector<std::string> others;
    entries = scan_folder(dir, root, others);
    report_other_files(options_.dir, entries, others, options_.caption_extension);
    if (options_.kohya_repeat_folders) {
      entries = kohya_repeat_folders(std::move(entries), options_.dir, kohya_);
    }
    if (kohya_.empty()) class_names_ = infer_labels(entries);
  }
  if (const int64_t both = read_sidecar_captions(entries, dir, options_.caption_extension);
      both > 0 && log::rank() == 0) {
    log::info(
        "{}: {} image(s) have both a metadata.jsonl caption and a {} file; metadata.jsonl "
        "wins",
        options_.dir, both, options_.caption_extension);
  }
  // kohya: an image of "10_sks dog" without a caption file is captioned "sks dog".
  for (Entry& e : entries) {
    if (e.caption || kohya_.empty()) continue;
    const auto [repeats, name] = kohya_folder(e.file.substr(0, e.file.find('/')));
    if (repeats >= 1) e.caption = name;
  }
  if (entries.empty()) {
    throw Error(fmt::format(
        "{}: no images found ({}); put PNG, JPEG or BMP files (.png .jpg .jpeg .bmp) in it",
        options_.dir,
        fs::exists(metadata, ec) ? "metadata.jsonl lists none" : "searched recursively"));
  }

  if (options_.skip_bad_images) {
    std::vector<std::string> errors(entries.size());
    at::parallel_for(0, static_cast<int64_t>(entries.size()), 1, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) {
        try {
          read_media((dir / entries[i].file).string(), options_.channels);
        } catch (const std::exception& e) {
          errors[i] = e.what();
          if (errors[i].empty()) errors[i] = "unknown error";
        }
      }
    });
    std::vector<Entry> good;
    std::string first_error;
    for (size_t i = 0; i < entries.size(); ++i) {
      if (errors[i].empty()) {
        good.push_back(std::move(entries[i]));
      } else {
        skipped_files_.push_back((dir / entries[i].file).string());
        if (first_error.empty()) first_error = errors[i];
      }
    }
    if (good.empty()) {
      throw Error(fmt::format("{}: none of its {} images could be decoded (first: {})",
                              options_.dir, entries.size(), first_error));
    }
    if (!skipped_files_.empty() && log::rank() == 0) {
      log::warn("{}: skipped {} of {} images that could not be decoded (first: {})", options_.dir,
                skipped_files_.size(), entries.size(), first_error);
    }
    entries = std::move(good);
  }

  // Repeats: each image listed (repeats of its kohya folder) x options.repeats times in a row,
  // so every use has an index (and augmentation stream) of its own.
  if (options_.repeats < 1) {
    throw Error(fmt::format("{}: repeats is {}; each image must be used at least once (1)",
                            options_.dir, options_.repeats));
  }
  const int64_t images = static_cast<int64_t>(entries.size());
  for (Entry& e : entries) {
    std::string mask_file;
    if (options_.masks) mask_file = find_mask(e, dir, options_);
    int64_t n = options_.repeats;
    if (!kohya_.empty()) n *= kohya_folder(e.file.substr(0, e.file.find('/'))).first;
    for (int64_t k = 0; k < n; ++k) {
      files_.push_back(e.file);
      if (e.label) labels_.push_back(*e.label);
      captions_.push_back(e.caption);
      if (options_.masks) mask_files_.push_back(mask_file);
    }
  }
  if (log::rank() == 0 && (!kohya_.empty() || options_.repeats > 1)) {
    std::string folders;
    for (const auto& [folder, count] : kohya_) {
      folders += fmt::format("{}{} ({} x {})", folders.empty() ? "" : ", ", folder, count,
                             kohya_folder(folder).first);
    }
    log::info("{}: {} image(s){}{}: {} examples per epoch", options_.dir, images,
              folders.empty() ? "" : " in kohya repeat folders " + folders,
              options_.repeats > 1 ? fmt::format(", x {} (repeats)", options_.repeats) : "",
              files_.size());
  }
}

void ImageFolderDataset::set_target_sizes(std::vector<std::array<int64_t, 2>> sizes) {
  if (!sizes.empty() && static_cast<int64_t>(sizes.size()) != size()) {
    throw Error(fmt::format("{}: {} target sizes for {} images; give one per image", options_.dir,
                            sizes.size(), size()));
  }
  for (const auto& s : sizes) {
    if (s[0] < 1 || s[1] < 1) {
      throw Error(fmt::format("{}: target size {}x{} is not positive", options_.dir, s[0], s[1]));
    }
  }
  target_sizes_ = std::move(sizes);
}

std::array<int64_t, 2> ImageFolderDataset::target_size(int64_t index) const {
  if (target_sizes_.empty()) return {options_.resolution, options_.resolution};
  return target_sizes_[static_cast<size_t>(index)];
}

void ImageFolderDataset::check_index(int64_t index) const {
  if (index < 0 || index >= size()) {
    throw Error(fmt::format("ImageFolderDataset index {} is out of range: expected 0 <= index < {}",
                            index, size()));
  }
}

std::string ImageFolderDataset::file(int64_t index) const {
  check_index(index);
  return (fs::path(options_.dir) / files_[index]).string();
}

const std::string& ImageFolderDataset::relative_file(int64_t index) const {
  check_index(index);
  return files_[index];
}

std::optional<int64_t> ImageFolderDataset::label(int64_t index) const {
  check_index(index);
  if (labels_.empty()) return std::nullopt;
  return labels_[index];
}

std::optional<std::string> ImageFolderDataset::caption(int64_t index) const {
  check_index(index);
  return captions_[index];
}

Example ImageFolderDataset::get(int64_t index) const {
  const std::string path = file(index);
  torch::Tensor frames;  // uint8 [F, H, W, C]; an image is one frame
  const bool alpha = options_.masks && mask_files_[static_cast<size_t>(index)].empty();
  try {
    frames = read_media(path, alpha ? 4 : options_.channels);
  } catch (const Error& e) {
    throw Error(std::string(e.what()) +
                " (or set skip_bad_images to drop the files that cannot be decoded)");
  }
  // The mask travels as one more channel through the resize, crop and flip.
  torch::Tensor mask;  // uint8 [F, H, W, 1]
  if (alpha) {
    mask = frames.narrow(3, 3, 1);
    frames = frames.narrow(3, 0, options_.channels == 1 ? 1 : 3);
    if (options_.channels == 1) {
      frames = read_media(path, 1);  // luminance as the dataset always reads it
    }
  } else if (options_.masks) {
    const auto& file = mask_files_[static_cast<size_t>(index)];
    mask = read_media(file, 3).narrow(3, 0, 1);  // the red channel, as kohya
    if (mask.size(1) != frames.size(1) || mask.size(2) != frames.size(2)) {
      namespace F = torch::nn::functional;
      auto m = mask[0].permute({2, 0, 1}).unsqueeze(0).to(torch::kFloat);
      m = F::interpolate(m, F::InterpolateFuncOptions()
                                .size(std::vector<int64_t>{frames.size(1), frames.size(2)})
                                .mode(torch::kBilinear)
                                .align_corners(false));
      mask = m[0].permute({1, 2, 0}).round().clamp(0, 255).to(torch::kUInt8).unsqueeze(0);
    }
    mask = mask.narrow(0, 0, 1).expand({frames.size(0), -1, -1, -1});
  }
  const int64_t image_channels = frames.size(3);
  if (mask.defined()) frames = torch::cat({frames, mask.to(frames.scalar_type())}, 3);
  // [F, H, W, C] uint8 → [F, C, H, W] float in [0, 255]; every frame gets the same transforms.
  // (An image goes the way it always went, [H, W, C] → [C, H, W] → [1, C, H, W]: the resize's
  // kernel follows the strides, and images stay bit-identical.)
  const int64_t num_frames = frames.size(0);
  auto x = num_frames == 1 ? frames[0].permute({2, 0, 1}).to(torch::kFloat).unsqueeze(0)
                           : frames.permute({0, 3, 1, 2}).to(torch::kFloat);
  const auto [th, tw] = target_size(index);
  const int64_t h = x.size(2), w = x.size(3);
  // Cover th x tw: torchvision Resize(r) for a square (the shorter side becomes r, the longer
  // int(r * long / short)); for a bucket the side that fits tighter becomes exact.
  const bool width_exact = h * tw >= w * th;
  const int64_t new_h = width_exact ? tw * h / w : th;
  const int64_t new_w = width_exact ? tw : th * w / h;
  if (new_h != h || new_w != w) {
    namespace F = torch::nn::functional;
    x = F::interpolate(x, F::InterpolateFuncOptions()
                              .size(std::vector<int64_t>{new_h, new_w})
                              .mode(torch::kBilinear)
                              .align_corners(false)
                              .antialias(true));
  }
  std::optional<at::Generator> gen;
  if (!options_.center_crop || options_.random_flip) {
    gen = core::sample_generator(options_.seed, epoch_, index, core::SampleStream::kAugmentation);
  }
  int64_t top = 0, left = 0;
  if (options_.center_crop) {
    top = round_half_even(static_cast<double>(new_h - th) / 2.0);
    left = round_half_even(static_cast<double>(new_w - tw) / 2.0);
  } else {
    // torchvision RandomCrop.get_params: top, then left.
    top = torch::randint(0, new_h - th + 1, {1}, *gen, torch::kLong).item<int64_t>();
    left = torch::randint(0, new_w - tw + 1, {1}, *gen, torch::kLong).item<int64_t>();
  }
  x = x.narrow(2, top, th).narrow(3, left, tw);
  bool flipped = false;
  if (options_.random_flip && torch::rand({1}, *gen).item<float>() < 0.5f) {
    x = x.flip({3});
    flipped = true;
  }
  torch::Tensor mask_values;  // [1, H, W]: the first frame's
  if (mask.defined()) {
    mask_values = x[0].narrow(0, image_channels, 1).div(255.0).clamp(0.0, 1.0).contiguous();
    x = x.narrow(1, 0, image_channels);
  }
  // An image's pixel_values are [C, H, W], a clip's [C, F, H, W] (Diffusers' video layout).
  x = num_frames == 1 ? x.squeeze(0) : x.permute({1, 0, 2, 3});
  // SDXL's crop coordinates are those of the flipped image when it is flipped (Diffusers flips
  // before cropping).
  const int64_t crop_left = flipped ? new_w - tw - left : left;
  Example example{{"pixel_values", x.div(255.0).mul(2.0).sub(1.0).contiguous()},
                  {"index", torch::tensor(index, torch::kLong)},
                  {"original_size", torch::tensor({h, w}, torch::kLong)},
                  {"crop_top_left", torch::tensor({top, crop_left}, torch::kLong)}};
  if (!labels_.empty())
    example.emplace("class_labels", torch::tensor(labels_[index], torch::kLong));
  if (mask_values.defined()) example.emplace("mask", mask_values);
  return example;
}

}  // namespace difftrain::data
