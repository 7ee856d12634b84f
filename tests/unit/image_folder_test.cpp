// ImageFolderDataset: HF imagefolder listing (recursive, sub-folder labels, metadata.jsonl with
// labels and captions), files escaping the folder rejected, bad images (lazy error or
// skip_bad_images), and Diffusers' transforms checked by hand on small images: resize, centre
// and random crop, flip, channel conversion (tolerance 1e-6 on values in [-1, 1]).

#include "difftrain/data/image_folder.h"
#include "difftrain/core/error.h"
#include "difftrain/data/media_reader.h"
#include "difftrain/io/atomic_file.h"
#include "difftrain/io/image.h"

#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <thread>
#include <vector>

// stb's encoders for the BMP and JPEG fixtures, private to this file (its warnings silenced).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#pragma GCC diagnostic ignored "-Wunused-parameter"
#pragma GCC diagnostic ignored "-Wsign-compare"
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"
#pragma GCC diagnostic ignored "-Wimplicit-fallthrough"
#define STB_IMAGE_WRITE_STATIC
#define STB_IMAGE_WRITE_IMPLEMENTATION
#include <stb/stb_image_write.h>
#pragma GCC diagnostic pop

namespace difftrain::data {
namespace {

using test::error_of;
using test::max_abs;
using test::temp_dir;

namespace fs = std::filesystem;

torch::Tensor random_image(int64_t h, int64_t w, int64_t c, uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  return at::randint(0, 256, {h, w, c}, gen, torch::kInt64).to(torch::kUInt8);
}

// uint8 [H, W, C] → the float [C, H, W] in [-1, 1] a dataset returns without resizing.
torch::Tensor normalised(const torch::Tensor& image) {
  return image.permute({2, 0, 1}).to(torch::kFloat).div(255.0).mul(2.0).sub(1.0);
}

// Checks max |a - b| <= tol and prints the difference seen.
void expect_close(const std::string& what, const torch::Tensor& a, const torch::Tensor& b,
                  double tol) {
  const double diff = max_abs(a, b);
  std::printf("%s: max abs diff %.3g (tolerance %.0e)\n", what.c_str(), diff, tol);
  EXPECT_LE(diff, tol) << what;
}

void write_text(const std::string& path, const std::string& text) {
  fs::create_directories(fs::path(path).parent_path());
  std::ofstream(path, std::ios::binary) << text;
}

void save(const std::string& path, const torch::Tensor& image) {
  fs::create_directories(fs::path(path).parent_path());
  const auto c = image.contiguous();
  const int h = static_cast<int>(c.size(0)), w = static_cast<int>(c.size(1));
  const int ch = static_cast<int>(c.size(2));
  const auto ext = fs::path(path).extension().string();
  if (ext == ".bmp" || ext == ".BMP") {
    ASSERT_TRUE(stbi_write_bmp(path.c_str(), w, h, ch, c.data_ptr<uint8_t>()));
  } else if (ext == ".jpg" || ext == ".jpeg" || ext == ".JPG") {
    ASSERT_TRUE(stbi_write_jpg(path.c_str(), w, h, ch, c.data_ptr<uint8_t>(), 95));
  } else {
    io::save_png(path, c);
  }
}

ImageFolderOptions opts(const std::string& dir, int64_t resolution = 4) {
  ImageFolderOptions o;
  o.dir = dir;
  o.resolution = resolution;
  o.center_crop = true;
  return o;
}

std::vector<std::string> listing(const ImageFolderDataset& ds) {
  std::vector<std::string> out;
  for (int64_t i = 0; i < ds.size(); ++i) out.push_back(ds.relative_file(i));
  return out;
}

// ---------------------------------------------------------------- listing and labels

TEST(ImageFolder, ListsRecursivelySortedWithoutLabels) {
  const auto dir = temp_dir("if_list");
  save(dir + "/b.png", random_image(4, 4, 3, 1));
  save(dir + "/a.BMP", random_image(4, 4, 3, 2));
  save(dir + "/sub/c.jpeg", random_image(4, 4, 3, 3));
  save(dir + "/sub/deeper/d.JPG", random_image(4, 4, 3, 4));
  write_text(dir + "/notes.txt", "not an image");
  save(dir + "/.hidden/e.png", random_image(4, 4, 3, 5));
  const ImageFolderDataset ds(opts(dir));
  EXPECT_EQ(listing(ds),
            (std::vector<std::string>{"a.BMP", "b.png", "sub/c.jpeg", "sub/deeper/d.JPG"}));
  EXPECT_EQ(ds.num_classes(), 0);
  EXPECT_TRUE(ds.class_names().empty());
  EXPECT_FALSE(ds.label(0).has_value());
  EXPECT_FALSE(ds.caption(0).has_value());
  const Example ex = ds.get(2);
  EXPECT_EQ(ex.count("class_labels"), 0u);
  EXPECT_EQ(ex.at("index").item<int64_t>(), 2);
  EXPECT_EQ(ex.at("pixel_values").sizes(), (std::vector<int64_t>{3, 4, 4}));
  EXPECT_EQ(ds.file(1), (fs::path(dir) / "b.png").string());
}

TEST(ImageFolder, FirstLevelSubFoldersAreClasses) {
  const auto dir = temp_dir("if_classes");
  save(dir + "/dog/1.png", random_image(4, 4, 3, 1));
  save(dir + "/cat/2.png", random_image(4, 4, 3, 2));
  save(dir + "/cat/1.png", random_image(4, 4, 3, 3));
  save(dir + "/emu/x.bmp", random_image(4, 4, 3, 4));
  const ImageFolderDataset ds(opts(dir));
  EXPECT_EQ(listing(ds),
            (std::vector<std::string>{"cat/1.png", "cat/2.png", "dog/1.png", "emu/x.bmp"}));
  EXPECT_EQ(ds.class_names(), (std::vector<std::string>{"cat", "dog", "emu"}));
  EXPECT_EQ(ds.num_classes(), 3);
  const std::vector<int64_t> expected = {0, 0, 1, 2};
  for (int64_t i = 0; i < 4; ++i) {
    EXPECT_EQ(ds.label(i), expected[i]);
    const auto label = ds.get(i).at("class_labels");
    EXPECT_EQ(label.dim(), 0);
    EXPECT_EQ(label.scalar_type(), torch::kLong);
    EXPECT_EQ(label.item<int64_t>(), expected[i]);
  }
  // An image at the top level, or a single sub-folder, means no labels (as HF).
  save(dir + "/top.png", random_image(4, 4, 3, 5));
  EXPECT_EQ(ImageFolderDataset(opts(dir)).num_classes(), 0);
  const auto one = temp_dir("if_one_class");
  save(one + "/train/a.png", random_image(4, 4, 3, 6));
  save(one + "/train/b.png", random_image(4, 4, 3, 7));
  EXPECT_EQ(ImageFolderDataset(opts(one)).num_classes(), 0);
}

// kohya's layout (issue 56): "<N>_<name>" sub-folders repeat their images N times per epoch,
// an image without a caption file is captioned <name>, images elsewhere are skipped, no labels
// are inferred; --dataset_repeats multiplies every image; WebP files are images.
TEST(ImageFolder, KohyaRepeatFoldersAndDatasetRepeats) {
  const auto dir = temp_dir("if_kohya");
  save(dir + "/3_sks dog/a.png", random_image(4, 4, 3, 1));
  write_text(dir + "/3_sks dog/a.txt", "a photo of sks dog on grass");
  difftrain::io::write_file_atomic(dir + "/3_sks dog/b.webp",
                                   difftrain::io::encode_webp_lossless(random_image(4, 4, 3, 2)));
  save(dir + "/1_dog/c.png", random_image(4, 4, 3, 3));
  save(dir + "/stray.png", random_image(4, 4, 3, 4));  // outside the kohya folders
  save(dir + "/misc/d.png", random_image(4, 4, 3, 5));
  write_text(dir + "/orphan.txt", "a caption without its image");
  const ImageFolderDataset ds(opts(dir));
  EXPECT_EQ(ds.size(), 3 + 3 + 1);
  EXPECT_EQ(ds.num_classes(), 0);
  EXPECT_EQ(listing(ds), (std::vector<std::string>{
                             "1_dog/c.png", "3_sks dog/a.png", "3_sks dog/a.png", "3_sks dog/a.png",
                             "3_sks dog/b.webp", "3_sks dog/b.webp", "3_sks dog/b.webp"}));
  EXPECT_EQ(ds.caption(0), "dog");
  EXPECT_EQ(ds.caption(1), "a photo of sks dog on grass");
  EXPECT_EQ(ds.caption(4), "sks dog");
  // Each repeat has its own index, so its own augmentation stream; the pixels are the file's.
  expect_close("repeat of a.png", ds.get(1).at("pixel_values"), ds.get(3).at("pixel_values"), 0);
  EXPECT_EQ(ds.get(3).at("index").item<int64_t>(), 3);

  auto twice = opts(dir);
  twice.repeats = 2;
  EXPECT_EQ(ImageFolderDataset(twice).size(), 14);
  // A flat folder with repeats: each image twice, in a row.
  const auto flat = temp_dir("if_repeats");
  save(flat + "/a.png", random_image(4, 4, 3, 6));
  save(flat + "/b.png", random_image(4, 4, 3, 7));
  auto flat_opts = opts(flat);
  flat_opts.repeats = 2;
  EXPECT_EQ(listing(ImageFolderDataset(flat_opts)),
            (std::vector<std::string>{"a.png", "a.png", "b.png", "b.png"}));
  flat_opts.repeats = 0;
  EXPECT_HAS(error_of([&] { ImageFolderDataset{flat_opts}; }), "repeats is 0");
  save(dir + "/0_cat/e.png", random_image(4, 4, 3, 8));
  EXPECT_HAS(error_of([&] { ImageFolderDataset{opts(dir)}; }), "0 repeats");
  // Without kohya's reading (the class-conditional UNet task), such folders are HF classes.
  const auto classes = temp_dir("if_kohya_classes");
  save(classes + "/0_airplane/a.png", random_image(4, 4, 3, 9));
  save(classes + "/1_car/b.png", random_image(4, 4, 3, 10));
  auto hf = opts(classes);
  hf.kohya_repeat_folders = false;
  const ImageFolderDataset labelled(hf);
  EXPECT_EQ(labelled.size(), 2);
  EXPECT_EQ(labelled.class_names(), (std::vector<std::string>{"0_airplane", "1_car"}));
  EXPECT_FALSE(labelled.caption(0).has_value());
}

TEST(ImageFolder, MetadataListsFilesLabelsAndCaptions) {
  const auto dir = temp_dir("if_meta");
  save(dir + "/img/z.png", random_image(4, 4, 3, 1));
  save(dir + "/a.png", random_image(4, 4, 3, 2));
  save(dir + "/unlisted.png", random_image(4, 4, 3, 3));
  write_text(dir + "/metadata.jsonl",
             "{\"file_name\": \"img/z.png\", \"label\": 4, \"text\": \"a red square\"}\r\n"
             "\n"
             "{\"file_name\": \"./a.png\", \"label\": 1, \"extra\": [1, 2]}\n");
  const ImageFolderDataset ds(opts(dir));
  EXPECT_EQ(listing(ds), (std::vector<std::string>{"img/z.png", "a.png"}));  // metadata order
  EXPECT_EQ(ds.num_classes(), 5);
  EXPECT_EQ(ds.class_names().back(), "4");
  EXPECT_EQ(ds.get(0).at("class_labels").item<int64_t>(), 4);
  EXPECT_EQ(ds.get(1).at("class_labels").item<int64_t>(), 1);
  EXPECT_EQ(ds.caption(0), std::optional<std::string>("a red square"));
  EXPECT_FALSE(ds.caption(1).has_value());
  // Other column names.
  write_text(dir + "/metadata.jsonl",
             "{\"file_name\": \"a.png\", \"cls\": 2, \"prompt\": \"p\"}\n");
  auto o = opts(dir);
  o.label_column = "cls";
  o.caption_column = "prompt";
  const ImageFolderDataset renamed(o);
  EXPECT_EQ(renamed.label(0), 2);
  EXPECT_EQ(renamed.caption(0), std::optional<std::string>("p"));
  EXPECT_EQ(ImageFolderDataset(opts(dir)).num_classes(), 0);  // "label" absent: unlabelled
}

// kohya-style sidecar captions (issue 38): a.png's caption is the first non-empty line of a.txt;
// metadata.jsonl wins where both exist; --caption_extension picks another suffix or none.
TEST(ImageFolder, SidecarCaptionFilesBesideTheImages) {
  const auto dir = temp_dir("if_sidecar");
  save(dir + "/a.png", random_image(4, 4, 3, 1));
  save(dir + "/sub/b.jpg", random_image(4, 4, 3, 2));
  save(dir + "/c.png", random_image(4, 4, 3, 3));
  write_text(dir + "/a.txt", "\n  a red square, studio light \r\nsecond line\n");
  write_text(dir + "/sub/b.txt",
             "\xEF\xBB\xBF"
             "b caption");
  write_text(dir + "/c.caption", "c from .caption");
  const ImageFolderDataset scanned(opts(dir));
  EXPECT_EQ(listing(scanned), (std::vector<std::string>{"a.png", "c.png", "sub/b.jpg"}));
  EXPECT_EQ(scanned.caption(0), std::optional<std::string>("a red square, studio light"));
  EXPECT_FALSE(scanned.caption(1).has_value());  // c.png has only c.caption
  EXPECT_EQ(scanned.caption(2), std::optional<std::string>("b caption"));
  auto o = opts(dir);
  o.caption_extension = ".caption";
  EXPECT_EQ(ImageFolderDataset(o).caption(1), std::optional<std::string>("c from .caption"));
  o.caption_extension = "";
  EXPECT_FALSE(ImageFolderDataset(o).caption(0).has_value());
  // metadata.jsonl's caption wins; a line without one takes the sidecar.
  write_text(dir + "/metadata.jsonl",
             "{\"file_name\": \"a.png\", \"text\": \"from metadata\"}\n"
             "{\"file_name\": \"sub/b.jpg\"}\n");
  const ImageFolderDataset listed(opts(dir));
  EXPECT_EQ(listed.caption(0), std::optional<std::string>("from metadata"));
  EXPECT_EQ(listed.caption(1), std::optional<std::string>("b caption"));
  // A caption file that is not UTF-8 is named.
  write_text(dir + "/sub/b.txt", "caf\xe9");
  EXPECT_HAS(error_of([&] { ImageFolderDataset{opts(dir)}; }),
             dir + "/sub/b.txt: not valid UTF-8 (byte 0xE9 at column 4)");
}

TEST(ImageFolder, MetadataErrorsNameTheLine) {
  const auto dir = temp_dir("if_meta_err");
  save(dir + "/a.png", random_image(4, 4, 3, 1));
  const std::string meta = dir + "/metadata.jsonl";
  auto error_for = [&](const std::string& text) {
    write_text(meta, text);
    return error_of([&] { ImageFolderDataset{opts(dir)}; });
  };
  EXPECT_HAS(error_for("{\"file_name\": \"a.png\"}\n{\"file_name\": \"a.png\",\n"),
             meta + " line 2: not valid JSON (");
  EXPECT_EQ(error_for("[1]\n"), meta +
                                    " line 1: no \"file_name\" string; each line must be one "
                                    "object such as {\"file_name\": \"a.png\", \"label\": 0}");
  EXPECT_EQ(error_for("{\"file_name\": \"a.png\", \"label\": -1}\n"),
            meta + " line 1: \"label\" is -1; a label must be an integer >= 0");
  EXPECT_HAS(error_for("{\"file_name\": \"a.png\", \"label\": \"cat\"}\n"), "\"label\" is \"cat\"");
  EXPECT_HAS(error_for("{\"file_name\": \"a.png\", \"text\": 3}\n"), "a caption must be a string");
  EXPECT_EQ(error_for("{\"file_name\": \"a.png\", \"label\": 0}\n{\"file_name\": \"a.png\"}\n"),
            meta +
                " line 2: no \"label\", but other lines have one; give every line a label or "
                "none");
  EXPECT_EQ(error_for("{\"file_name\": \"a.png\"}\n{\"file_name\": \"gone.png\"}\n"),
            meta + " line 2: file_name \"gone.png\" is listed but " +
                (fs::path(dir) / "gone.png").string() + " does not exist");
  EXPECT_HAS(error_for("\n\n"), dir + ": no images found (metadata.jsonl lists none)");
}

// Captions in any script load; a line in a legacy encoding is named with its first bad byte
// (the JSON parser's own message would quote the bytes themselves).
TEST(ImageFolder, MetadataMustBeUtf8) {
  const auto dir = temp_dir("if_meta_utf8");
  save(dir + "/a.png", random_image(4, 4, 3, 1));
  const std::string meta = dir + "/metadata.jsonl";
  const std::string caption = "caf\xc3\xa9 \xf0\x9f\x90\xb1 \xe6\x97\xa5\xe6\x9c\xac";
  write_text(meta, "{\"file_name\": \"a.png\", \"text\": \"" + caption + "\"}\n");
  EXPECT_EQ(ImageFolderDataset(opts(dir)).caption(0), std::optional<std::string>(caption));
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"caf\xe9", "byte 0xE9 at column 36"},       // Latin-1
      {"\xed\xa0\x80", "byte 0xED at column 33"},  // a UTF-16 surrogate
      {"\xc0\xaf", "byte 0xC0 at column 33"},      // an overlong '/'
      {"\xe6\x97", "byte 0xE6 at column 33"}};     // cut inside a character
  for (const auto& [text, where] : bad) {
    write_text(meta, "{\"file_name\": \"a.png\", \"text\": \"" + text + "\"}\n");
    EXPECT_EQ(error_of([&] { ImageFolderDataset{opts(dir)}; }),
              meta + " line 1: not valid UTF-8 (" + where +
                  "); save metadata.jsonl as UTF-8, e.g. iconv -f latin1 -t utf-8");
  }
}

// ---------------------------------------------------------------- escaping the folder

TEST(ImageFolder, FilesOutsideTheFolderAreRejected) {
  const auto base = temp_dir("if_escape");
  const auto dir = base + "/data";
  save(dir + "/in.png", random_image(4, 4, 3, 1));
  save(base + "/x.png", random_image(4, 4, 3, 2));  // exists, so only the escape is wrong
  save(base + "/data2/y.png", random_image(4, 4, 3, 3));
  const std::string meta = dir + "/metadata.jsonl";
  auto error_for = [&](const std::string& name) {
    write_text(meta, "{\"file_name\": \"in.png\"}\n{\"file_name\": \"" + name + "\"}\n");
    return error_of([&] { ImageFolderDataset{opts(dir)}; });
  };
  EXPECT_EQ(error_for("../x.png"),
            meta + " line 2: file_name \"../x.png\" contains '..'; images must lie inside " + dir +
                " (no '..' components)");
  EXPECT_HAS(error_for("sub/../../x.png"), "contains '..'");
  EXPECT_EQ(error_for(base + "/x.png"), meta + " line 2: file_name \"" + base +
                                            "/x.png\" is absolute; give a path relative to " + dir);
  fs::create_symlink(base + "/x.png", dir + "/link.png");
  const auto canonical_x = fs::canonical(base + "/x.png").string();
  EXPECT_EQ(error_for("link.png"),
            meta + " line 2: file_name \"link.png\" resolves to " + canonical_x + ", outside " +
                dir +
                " (a symbolic link out of the folder); copy the image into the folder instead");
  // A linked folder out, and a sibling whose name merely starts with the folder's.
  fs::create_directory_symlink(base + "/data2", dir + "/linked_dir");
  EXPECT_HAS(error_for("linked_dir/y.png"), "outside " + dir);
  // Without metadata.jsonl, a scanned link out of the folder is rejected too.
  fs::remove(meta);
  EXPECT_HAS(error_of([&] { ImageFolderDataset{opts(dir)}; }),
             dir + "/link.png: a symbolic link to " + canonical_x + ", outside " + dir);
  // Links that stay inside are fine.
  fs::remove(dir + "/link.png");
  fs::create_symlink(dir + "/in.png", dir + "/inner_link.png");
  write_text(meta, "{\"file_name\": \"inner_link.png\"}\n");
  EXPECT_EQ(ImageFolderDataset(opts(dir)).size(), 1);
}

// ---------------------------------------------------------------- bad images and folders

TEST(ImageFolder, BadImagesThrowLazilyOrAreSkipped) {
  const auto dir = temp_dir("if_bad");
  save(dir + "/a.png", random_image(4, 4, 3, 1));
  write_text(dir + "/b.png", "not a png at all");
  save(dir + "/c.png", random_image(4, 4, 3, 2));
  const ImageFolderDataset lazy(opts(dir));
  EXPECT_EQ(lazy.size(), 3);
  EXPECT_NO_THROW(lazy.get(0));
  const auto message = error_of([&] { lazy.get(1); });
  EXPECT_HAS(message, "cannot load image '" + (fs::path(dir) / "b.png").string() + "'");
  EXPECT_HAS(message, "(or set skip_bad_images to drop the files that cannot be decoded)");

  auto o = opts(dir);
  o.skip_bad_images = true;
  const ImageFolderDataset skipping(o);
  EXPECT_EQ(skipping.size(), 2);
  EXPECT_EQ(skipping.skipped(), 1);
  EXPECT_EQ(skipping.skipped_files(),
            (std::vector<std::string>{(fs::path(dir) / "b.png").string()}));
  EXPECT_EQ(listing(skipping), (std::vector<std::string>{"a.png", "c.png"}));
  EXPECT_EQ(skipping.get(1).at("index").item<int64_t>(), 1);

  const auto all_bad = temp_dir("if_all_bad");
  write_text(all_bad + "/x.png", "junk");
  o.dir = all_bad;
  EXPECT_HAS(error_of([&] { ImageFolderDataset{o}; }),
             all_bad + ": none of its 1 images could be decoded (first: cannot load image");
}

TEST(ImageFolder, FolderAndOptionErrors) {
  const auto empty = temp_dir("if_empty");
  write_text(empty + "/readme.txt", "no images here");
  EXPECT_EQ(error_of([&] { ImageFolderDataset{opts(empty)}; }),
            empty +
                ": no images found (searched recursively); put PNG, JPEG or BMP files (.png "
                ".jpg .jpeg .bmp) in it");
  EXPECT_EQ(error_of([&] { ImageFolderDataset{opts(empty + "/missing")}; }),
            empty +
                "/missing: no such folder; pass --train_data_dir pointing to a folder of PNG, "
                "JPEG or BMP images");
  EXPECT_HAS(error_of([&] { ImageFolderDataset{opts(empty + "/readme.txt")}; }),
             "is a file, not a folder");
  auto o = opts(empty);
  o.channels = 4;
  EXPECT_HAS(error_of([&] { ImageFolderDataset{o}; }), "channels is 4; use 3 (RGB) or 1");
  o = opts(empty, 0);
  EXPECT_HAS(error_of([&] { ImageFolderDataset{o}; }), "resolution is 0");
}

// ---------------------------------------------------------------- transforms

TEST(ImageFolder, CenterCropIsExactAgainstAHandComputation) {
  const auto dir = temp_dir("if_center");
  const auto wide = random_image(3, 8, 3, 1);  // short side 3 = resolution: no resize
  const auto tall = random_image(7, 3, 3, 2);
  const auto narrow_odd = random_image(3, 4, 3, 3);
  save(dir + "/a_wide.png", wide);
  save(dir + "/b_tall.bmp", tall);
  save(dir + "/c_odd.png", narrow_odd);
  const ImageFolderDataset ds(opts(dir, 3));
  // torchvision: left = round((8 - 3) / 2) = round(2.5) = 2 (half to even), top = round(2.0)
  // = 2, left = round(0.5) = 0.
  const auto a = ds.get(0).at("pixel_values");
  const auto b = ds.get(1).at("pixel_values");
  const auto c = ds.get(2).at("pixel_values");
  EXPECT_EQ(a.sizes(), (std::vector<int64_t>{3, 3, 3}));
  expect_close("centre crop 3x8", a, normalised(wide.narrow(1, 2, 3)), 1e-6);
  expect_close("centre crop 7x3", b, normalised(tall.narrow(0, 2, 3)), 1e-6);
  expect_close("centre crop 3x4", c, normalised(narrow_odd.narrow(1, 0, 3)), 1e-6);
  EXPECT_GE(a.min().item<float>(), -1.0f);
  EXPECT_LE(a.max().item<float>(), 1.0f);
}

TEST(ImageFolder, ResizeKeepsTheAspectAndConstantColours) {
  const auto dir = temp_dir("if_resize");
  // 10 x 30 → shorter side 4, longer int(4 * 30 / 10) = 12, then a centre crop of 4 x 4.
  auto image = torch::empty({10, 30, 3}, torch::kUInt8);
  image.select(2, 0).fill_(200);
  image.select(2, 1).fill_(10);
  image.select(2, 2).fill_(255);
  save(dir + "/flat.png", image);
  const auto x = ImageFolderDataset(opts(dir)).get(0).at("pixel_values");
  ASSERT_EQ(x.sizes(), (std::vector<int64_t>{3, 4, 4}));
  const auto expected = normalised(image.narrow(0, 0, 4).narrow(1, 0, 4));
  expect_close("resized flat colour", x, expected, 1e-5);
  // Shrinking 0/254 stripes 2x with antialiasing (a triangle filter over 4 columns, weights
  // 1/8 3/8 3/8 1/8) averages them to 127 away from the edges.
  auto stripes = torch::zeros({8, 8, 1}, torch::kUInt8);
  stripes.slice(1, 0, 8, 2).fill_(254);
  save(dir + "/flat.png", stripes);
  auto o = opts(dir);
  o.channels = 1;
  const auto grey = ImageFolderDataset(o).get(0).at("pixel_values");
  ASSERT_EQ(grey.sizes(), (std::vector<int64_t>{1, 4, 4}));
  expect_close("shrunk stripes", grey.narrow(2, 1, 2), torch::full({1, 4, 2}, 127.0 / 255 * 2 - 1),
               1e-5);
}

TEST(ImageFolder, ChannelConversionsAndFormats) {
  const auto dir = temp_dir("if_channels");
  const auto grey = random_image(4, 4, 1, 1);
  const auto rgba = random_image(4, 4, 4, 2);
  const auto rgb = random_image(4, 4, 3, 3);
  save(dir + "/a_grey.png", grey);
  save(dir + "/b_rgba.png", rgba);
  save(dir + "/c_rgb.bmp", rgb);
  save(dir + "/d_rgb.jpg", rgb);
  const ImageFolderDataset ds(opts(dir));
  expect_close("grey as RGB", ds.get(0).at("pixel_values"), normalised(grey.expand({4, 4, 3})),
               1e-6);
  expect_close("RGBA as RGB", ds.get(1).at("pixel_values"), normalised(rgba.narrow(2, 0, 3)), 1e-6);
  expect_close("BMP (lossless)", ds.get(2).at("pixel_values"), normalised(rgb), 1e-6);
  const auto jpeg = ds.get(3).at("pixel_values");
  EXPECT_EQ(jpeg.sizes(), (std::vector<int64_t>{3, 4, 4}));
  // JPEG is lossy on random noise; its mean stays close (tolerance 0.1 of the [-1, 1] range).
  EXPECT_NEAR(jpeg.mean().item<double>(), normalised(rgb).mean().item<double>(), 0.1);
  auto o = opts(dir);
  o.channels = 1;
  const auto one = ImageFolderDataset(o).get(0).at("pixel_values");
  expect_close("grey as grey", one, normalised(grey), 1e-6);
}

TEST(ImageFolder, AugmentationIsPerSampleAndDeterministic) {
  const auto dir = temp_dir("if_aug");
  std::vector<torch::Tensor> images;
  for (int i = 0; i < 6; ++i) {
    images.push_back(random_image(6, 9, 3, 10 + i));
    save(dir + "/" + std::to_string(i) + ".png", images.back());
  }
  auto o = opts(dir, 6);
  o.center_crop = false;
  o.random_flip = true;
  o.seed = 42;
  ImageFolderDataset a(o), b(o);
  o.random_flip = false;
  ImageFolderDataset no_flip(o);
  std::set<int64_t> lefts;
  int flipped = 0, kept = 0;
  for (int64_t epoch = 0; epoch < 6; ++epoch) {
    a.set_epoch(epoch);
    b.set_epoch(epoch);
    no_flip.set_epoch(epoch);
    for (int64_t i = 0; i < 6; ++i) {
      const auto x = a.get(i).at("pixel_values");
      EXPECT_TRUE(torch::equal(x, b.get(i).at("pixel_values")));  // same (seed, epoch, i)
      // The crop (drawn before the flip) does not depend on random_flip: find its offset.
      const auto crop = no_flip.get(i).at("pixel_values");
      int64_t left = -1;
      for (int64_t l = 0; l <= 3; ++l) {
        if (max_abs(crop, normalised(images[i].narrow(1, l, 6))) <= 1e-6) left = l;
      }
      ASSERT_GE(left, 0) << "the random crop is not a window of the image";
      lefts.insert(left);
      if (torch::equal(x, crop.flip({2})) && !torch::equal(x, crop))
        ++flipped;
      else if (torch::equal(x, crop))
        ++kept;
    }
  }
  EXPECT_EQ(flipped + kept, 36);  // a flipped example is exactly the mirror of the unflipped one
  EXPECT_GT(flipped, 5);
  EXPECT_GT(kept, 5);
  EXPECT_GE(lefts.size(), 3u);  // the crops move
  // get() from several threads gives the same examples as sequential calls.
  std::vector<torch::Tensor> parallel(6);
  std::vector<std::thread> threads;
  for (int64_t i = 0; i < 6; ++i) {
    threads.emplace_back([&, i] { parallel[i] = a.get(i).at("pixel_values"); });
  }
  for (auto& t : threads) t.join();
  for (int64_t i = 0; i < 6; ++i)
    EXPECT_TRUE(torch::equal(parallel[i], b.get(i).at("pixel_values")));
}

// ---------------------------------------------------------------- clips (issue 57)

// A test container of clips: a PNG holding 3 frames side by side, under the extension ".strip3".
void register_strip_reader() {
  static const bool once = [] {
    MediaReader reader;
    reader.name = "test strip";
    reader.extensions = {".STRIP3"};  // registered in any case, matched in any case
    reader.read = [](const std::string& path, int channels) {
      const auto sheet = io::decode_image(io::read_file(path), path, channels);  // [H, 3W, C]
      return sheet.reshape({sheet.size(0), 3, sheet.size(1) / 3, sheet.size(2)})
          .permute({1, 0, 2, 3})
          .contiguous();
    };
    reader.size = [](const std::string& path) {
      auto hw = io::image_size(path);
      return std::array<int64_t, 2>{hw[0], hw[1] / 3};
    };
    register_media_reader(reader);
    return true;
  }();
  (void)once;
}

// Images and clips come through one reader interface: a registered clip reader's files are
// listed beside the images, a clip's pixel_values are [C, F, H, W], and every frame gets exactly
// the crop, resize and flip its image alone would get (an image is one frame, as before).
TEST(ImageFolder, ClipsOfARegisteredReaderGetTheirFramesTheImageTransforms) {
  register_strip_reader();
  EXPECT_TRUE(is_media_file("a/b.strip3"));
  EXPECT_TRUE(is_media_file("x.PNG"));
  EXPECT_FALSE(is_media_file("notes.txt"));
  EXPECT_HAS(error_of([] { read_media("clip.avi"); }), "no reader takes \".avi\" files");
  const auto clips = temp_dir("if_clips"), frames = temp_dir("if_clip_frames");
  std::vector<torch::Tensor> sheets;
  for (int i = 0; i < 3; ++i) {
    std::vector<torch::Tensor> f;
    for (int k = 0; k < 3; ++k) f.push_back(random_image(7, 10, 3, 100 + 10 * i + k));
    sheets.push_back(torch::cat(f, 1));
    save(clips + "/" + std::to_string(i) + ".strip3", sheets.back());
    for (int k = 0; k < 3; ++k) {
      save(frames + "/f" + std::to_string(k) + "/" + std::to_string(i) + ".png", f[k]);
    }
  }
  save(clips + "/still.png", random_image(7, 10, 3, 7));
  EXPECT_EQ(media_size(clips + "/0.strip3"), (std::array<int64_t, 2>{7, 10}));
  EXPECT_EQ(read_media(clips + "/0.strip3").sizes(), (torch::IntArrayRef{3, 7, 10, 3}));
  for (const bool center : {true, false}) {
    auto o = opts(clips, 6);
    o.center_crop = center;
    o.random_flip = true;
    o.seed = 9;
    ImageFolderDataset ds(o);
    ASSERT_EQ(listing(ds),
              (std::vector<std::string>{"0.strip3", "1.strip3", "2.strip3", "still.png"}));
    EXPECT_EQ(ds.get(3).at("pixel_values").sizes(), (torch::IntArrayRef{3, 6, 6}));
    for (int64_t epoch = 0; epoch < 3; ++epoch) {
      ds.set_epoch(epoch);
      for (int64_t i = 0; i < 3; ++i) {
        const auto x = ds.get(i).at("pixel_values");
        ASSERT_EQ(x.sizes(), (torch::IntArrayRef{3, 3, 6, 6}));
        for (int64_t k = 0; k < 3; ++k) {
          o.dir = frames + "/f" + std::to_string(k);
          ImageFolderDataset frame(o);
          frame.set_epoch(epoch);
          const auto alone = frame.get(i);  // the same (seed, epoch, index): the same draws
          EXPECT_LE(max_abs(x.select(1, k), alone.at("pixel_values")), 1e-6)
              << "clip " << i << " frame " << k << " epoch " << epoch;
          EXPECT_TRUE(torch::equal(ds.get(i).at("crop_top_left"), alone.at("crop_top_left")));
        }
      }
    }
  }
}

}  // namespace
}  // namespace difftrain::data
