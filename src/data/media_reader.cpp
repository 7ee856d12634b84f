// The registered media readers (data/media_reader.h), the image reader first.
#include "difftrain/data/media_reader.h"

#include "difftrain/core/error.h"
#include "difftrain/io/image.h"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>

namespace difftrain::data {
namespace {

struct Readers {
  std::mutex mutex;
  std::vector<std::unique_ptr<MediaReader>> all;
  std::map<std::string, const MediaReader*> by_extension;
};

std::string lower_extension(const std::string& path) {
  std::string ext = std::filesystem::path(path).extension().string();
  std::transform(ext.begin(), ext.end(), ext.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return ext;
}

void add(Readers& r, MediaReader reader) {
  auto owned = std::make_unique<MediaReader>(std::move(reader));
  for (const auto& ext : owned->extensions) r.by_extension[ext] = owned.get();
  r.all.push_back(std::move(owned));
}

// Images are clips of one frame. WebP is listed as the folder scan always did: a build without
// libwebp refuses such a file when it reads it, naming the package.
MediaReader image_reader() {
  MediaReader reader;
  reader.name = "image";
  reader.extensions = {".png", ".jpg", ".jpeg", ".bmp", ".webp"};
  reader.read = [](const std::string& path, int channels) {
    return io::load_image(path, channels).unsqueeze(0);
  };
  reader.size = [](const std::string& path) { return io::image_size(path); };
  return reader;
}

Readers& readers() {
  static Readers* r = [] {
    auto* made = new Readers();  // never destroyed: read by dataset workers until exit
    add(*made, image_reader());
    return made;
  }();
  return *r;
}

}  // namespace

void register_media_reader(MediaReader reader) {
  TORCH_CHECK(reader.read && reader.size, "register_media_reader: reader \"", reader.name,
              "\" needs read and size");
  Readers& r = readers();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (auto& ext : reader.extensions) {
    std::transform(ext.begin(), ext.end(), ext.begin(),
                   [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  }
  add(r, std::move(reader));
}

const MediaReader* media_reader_for(const std::string& path) {
  Readers& r = readers();
  std::lock_guard<std::mutex> lock(r.mutex);
  const auto it = r.by_extension.find(lower_extension(path));
  return it == r.by_extension.end() ? nullptr : it->second;
}

bool is_media_file(const std::string& path) { return media_reader_for(path) != nullptr; }

namespace {
const MediaReader& reader_of(const std::string& path) {
  const MediaReader* reader = media_reader_for(path);
  if (reader == nullptr) {
    std::string known;
    {
      Readers& r = readers();
      std::lock_guard<std::mutex> lock(r.mutex);
      for (const auto& [ext, _] : r.by_extension) known += (known.empty() ? "" : " ") + ext;
    }
    throw Error(path + ": no reader takes \"" + lower_extension(path) + "\" files; use one of " +
                known);
  }
  return *reader;
}
}  // namespace

torch::Tensor read_media(const std::string& path, int channels) {
  return reader_of(path).read(path, channels);
}

std::array<int64_t, 2> media_size(const std::string& path) { return reader_of(path).size(path); }

}  // namespace difftrain::data
