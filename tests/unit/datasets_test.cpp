// IDX files and MnistDataset: round trips of IDX files written here (gzip and raw), one-line
// errors naming the file, and the real Fashion-MNIST files of Debian's dataset-fashion-mnist
// package checked against their raw bytes read independently with zlib (tolerance 1e-6).
// ImageFolderDataset has its own file, image_folder_test.cpp.

#include "difftrain/core/error.h"
#include "difftrain/data/idx.h"
#include "difftrain/data/mnist.h"

#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <zlib.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace difftrain::data {
namespace {

using test::error_of;
using test::max_abs;
using test::temp_dir;

namespace fs = std::filesystem;

constexpr const char* kFashionDir = "/usr/share/datasets/fashion-mnist";

// The bytes of an IDX file of unsigned bytes holding `values` (uint8, any shape).
std::string idx_bytes(const torch::Tensor& values) {
  std::string out = {0, 0, 8, static_cast<char>(values.dim())};
  for (const int64_t d : values.sizes()) {
    for (int shift = 24; shift >= 0; shift -= 8) out += static_cast<char>((d >> shift) & 0xFF);
  }
  const auto c = values.contiguous();
  out.append(reinterpret_cast<const char*>(c.data_ptr<uint8_t>()), c.numel());
  return out;
}

void write_raw(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary).write(bytes.data(), bytes.size());
}

void write_gz(const std::string& path, const std::string& bytes) {
  gzFile f = gzopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  ASSERT_EQ(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())),
            static_cast<int>(bytes.size()));
  gzclose(f);
}

// The whole decompressed content of a gzip file, read with zlib directly.
std::string gunzip(const std::string& path) {
  gzFile f = gzopen(path.c_str(), "rb");
  EXPECT_NE(f, nullptr) << path;
  std::string out;
  char buffer[1 << 16];
  int n = 0;
  while ((n = gzread(f, buffer, sizeof buffer)) > 0) out.append(buffer, n);
  gzclose(f);
  return out;
}

torch::Tensor random_bytes(std::vector<int64_t> shape, uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  return at::randint(0, 256, shape, gen, torch::kInt64).to(torch::kUInt8);
}

// ---------------------------------------------------------------- IDX

TEST(Idx, RoundTripGzipAndRaw) {
  const auto dir = temp_dir("idx_rt");
  const auto images = random_bytes({5, 7, 3}, 1);
  const auto labels = random_bytes({5}, 2);
  write_raw(dir + "/images", idx_bytes(images));
  write_gz(dir + "/images.gz", idx_bytes(images));
  write_gz(dir + "/labels.gz", idx_bytes(labels));
  for (const std::string name : {"images", "images.gz"}) {
    const auto back = read_idx(dir + "/" + name);
    EXPECT_EQ(back.scalar_type(), torch::kUInt8);
    EXPECT_EQ(back.sizes(), images.sizes());
    EXPECT_TRUE(torch::equal(back, images)) << name;
  }
  EXPECT_TRUE(torch::equal(read_idx(dir + "/labels.gz"), labels));
  // Compression is detected from the bytes, not the name.
  fs::copy_file(dir + "/images.gz", dir + "/gz_without_suffix");
  EXPECT_TRUE(torch::equal(read_idx(dir + "/gz_without_suffix"), images));
  // An empty array is valid.
  write_gz(dir + "/empty.gz", idx_bytes(torch::empty({0, 4, 4}, torch::kUInt8)));
  EXPECT_EQ(read_idx(dir + "/empty.gz").sizes(), (std::vector<int64_t>{0, 4, 4}));
}

TEST(Idx, TruncatedAndExtraBytesAreErrors) {
  const auto dir = temp_dir("idx_trunc");
  const std::string bytes = idx_bytes(random_bytes({4, 6, 6}, 3));
  const std::string cut = bytes.substr(0, bytes.size() - 10);
  write_raw(dir + "/cut", cut);
  write_gz(dir + "/cut.gz", cut);
  for (const std::string name : {"cut", "cut.gz"}) {
    const auto message = error_of([&] { read_idx(dir + "/" + name); });
    EXPECT_HAS(message, dir + "/" + name + ": truncated");
    EXPECT_HAS(message, "[4, 6, 6] (144 bytes of data) but only 134 bytes follow");
  }
  // A gzip stream cut in the middle (its trailer lost).
  std::string gz;
  write_gz(dir + "/whole.gz", bytes);
  {
    std::ifstream in(dir + "/whole.gz", std::ios::binary);
    gz.assign(std::istreambuf_iterator<char>(in), {});
  }
  write_raw(dir + "/stream_cut.gz", gz.substr(0, gz.size() / 2));
  const auto stream_cut = error_of([&] { read_idx(dir + "/stream_cut.gz"); });
  EXPECT_HAS(stream_cut, dir + "/stream_cut.gz: ");
  // Inside the header.
  write_raw(dir + "/header", bytes.substr(0, 9));
  EXPECT_HAS(error_of([&] { read_idx(dir + "/header"); }), "truncated inside the IDX header");
  // Bytes after the data.
  write_raw(dir + "/extra", bytes + "xyz");
  write_gz(dir + "/extra.gz", bytes + "xyz");
  EXPECT_HAS(error_of([&] { read_idx(dir + "/extra"); }), "3 bytes follow the 144 values");
  EXPECT_HAS(error_of([&] { read_idx(dir + "/extra.gz"); }), "3 bytes follow the 144 values");
}

// Whole-buffer decompression (libdeflate) takes only clean single-member files; the others go
// through zlib's streaming reader, which reads several members and names bad data.
TEST(Idx, MultiMemberAndCorruptGzip) {
  const auto dir = temp_dir("idx_members");
  const auto images = random_bytes({6, 5, 4}, 4);
  const std::string bytes = idx_bytes(images);
  auto slurp = [](const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  write_gz(dir + "/a.gz", bytes.substr(0, 50));
  write_gz(dir + "/b.gz", bytes.substr(50));
  write_raw(dir + "/two.gz", slurp(dir + "/a.gz") + slurp(dir + "/b.gz"));
  EXPECT_TRUE(torch::equal(read_idx(dir + "/two.gz"), images));
  write_gz(dir + "/one.gz", bytes);
  const auto read = read_idx(dir + "/one.gz");
  EXPECT_TRUE(torch::equal(read, images));
  EXPECT_TRUE(read.is_contiguous());
  // A wrong CRC-32 in the trailer: the data decompress, but do not check.
  std::string crc = slurp(dir + "/one.gz");
  crc[crc.size() - 8] = static_cast<char>(crc[crc.size() - 8] ^ 0x55);
  write_raw(dir + "/crc.gz", crc);
  EXPECT_HAS(error_of([&] { read_idx(dir + "/crc.gz"); }),
             dir + "/crc.gz: corrupt gzip data (zlib: ");
}

TEST(Idx, CachedCopyIsReadAndRenewedWhenTheFileChanges) {
  const auto dir = temp_dir("idx_cache");
  const std::string cache = dir + "/cache";
  const auto images = random_bytes({3, 4, 5}, 5);
  write_gz(dir + "/images.gz", idx_bytes(images));
  std::vector<std::string> notes;
  auto note = [&](const std::string& line) { notes.push_back(line); };
  auto copies = [&] {
    std::vector<std::string> names;
    if (!fs::exists(cache + "/datasets")) return names;
    for (const auto& e : fs::directory_iterator(cache + "/datasets"))
      names.push_back(e.path().string());
    return names;
  };
  EXPECT_TRUE(torch::equal(read_idx_cached(dir + "/images.gz", cache, note), images));
  ASSERT_EQ(copies().size(), 1u);
  const std::string copy = copies()[0];
  EXPECT_EQ(fs::path(copy).filename().string().rfind("images-", 0), 0u) << copy;
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_HAS(notes[0], "wrote an uncompressed copy of " + dir + "/images.gz");
  // The copy is what later reads return (a different array written over it proves it).
  const auto other = random_bytes({3, 4, 5}, 6);
  write_raw(copy, idx_bytes(other));
  EXPECT_TRUE(torch::equal(read_idx_cached(dir + "/images.gz", cache, note), other));
  EXPECT_EQ(notes.size(), 1u);
  // A damaged copy is dropped, the original read and the copy written again.
  write_raw(copy, idx_bytes(other).substr(0, 20));
  EXPECT_TRUE(torch::equal(read_idx_cached(dir + "/images.gz", cache, note), images));
  EXPECT_TRUE(torch::equal(read_idx(copy), images));
  // A changed file (size, time) gets a copy of its own.
  const auto bigger = random_bytes({4, 4, 5}, 7);
  write_gz(dir + "/images.gz", idx_bytes(bigger));
  EXPECT_TRUE(torch::equal(read_idx_cached(dir + "/images.gz", cache, note), bigger));
  EXPECT_EQ(copies().size(), 2u);
  // Raw files and no cache folder: read directly, nothing written.
  write_raw(dir + "/raw", idx_bytes(images));
  EXPECT_TRUE(torch::equal(read_idx_cached(dir + "/raw", cache, note), images));
  EXPECT_TRUE(torch::equal(read_idx_cached(dir + "/images.gz", "", note), bigger));
  EXPECT_EQ(copies().size(), 2u);
  // A cache that cannot be written (a file where the folder should be) only costs the speed.
  write_raw(dir + "/not_a_folder", "x");
  notes.clear();
  EXPECT_TRUE(
      torch::equal(read_idx_cached(dir + "/images.gz", dir + "/not_a_folder", note), bigger));
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_HAS(notes[0], "reading the gzip file");
  // Errors of the original file are read_idx's own.
  write_gz(dir + "/cut.gz", idx_bytes(images).substr(0, 30));
  EXPECT_HAS(error_of([&] { read_idx_cached(dir + "/cut.gz", cache, note); }), "truncated");
}

TEST(Idx, BadFilesNameThePath) {
  const auto dir = temp_dir("idx_bad");
  EXPECT_EQ(error_of([&] { read_idx(dir + "/nope.gz"); }),
            dir +
                "/nope.gz: no such IDX file; check the path (MNIST-style files are named e.g. "
                "train-images-idx3-ubyte.gz)");
  write_raw(dir + "/text", "hello world");
  EXPECT_EQ(error_of([&] { read_idx(dir + "/text"); }),
            dir +
                "/text: not an IDX file (first bytes 68 65 6c 6c; IDX files start with 00 00 08 "
                "<ndim>); expected an MNIST-style file such as train-images-idx3-ubyte(.gz)");
  write_gz(dir + "/float.gz", std::string("\0\0\x0d\x01\0\0\0\x01\0\0\0\0", 12));
  EXPECT_EQ(error_of([&] { read_idx(dir + "/float.gz"); }),
            dir +
                "/float.gz: IDX dtype code 0x0d (float32) is not supported; only 0x08 (unsigned "
                "byte, as in MNIST) is");
  // Sizes beyond the limit are refused from the header alone (nothing is allocated).
  write_raw(dir + "/huge", std::string("\0\0\x08\x03\xff\xff\xff\xff\0\0\x10\0\0\0\x10\0", 16));
  EXPECT_HAS(error_of([&] { read_idx(dir + "/huge"); }), "more than the 2 GiB");
  write_raw(dir + "/empty", "");
  EXPECT_HAS(error_of([&] { read_idx(dir + "/empty"); }), dir + "/empty: not an IDX file");
  EXPECT_HAS(error_of([&] { read_idx(dir); }), "is a folder");
}

// ---------------------------------------------------------------- MNIST, real files

TEST(Mnist, FashionMnistMatchesTheRawBytes) {
  MnistOptions options;  // dir "" = the Debian package's folder, split train, resolution 32
  const MnistDataset train(options);
  ASSERT_EQ(train.size(), 60000);
  EXPECT_EQ(train.num_classes(), 10);
  EXPECT_EQ(train.options().dir, kFashionDir);
  EXPECT_EQ(train.labels().min().item<int64_t>(), 0);
  EXPECT_EQ(train.labels().max().item<int64_t>(), 9);

  const std::string raw_images = gunzip(std::string(kFashionDir) + "/train-images-idx3-ubyte.gz");
  const std::string raw_labels = gunzip(std::string(kFashionDir) + "/train-labels-idx1-ubyte.gz");
  ASSERT_EQ(raw_images.size(), 16u + 60000u * 784u);
  ASSERT_EQ(raw_labels.size(), 8u + 60000u);
  for (const int64_t i : {int64_t{0}, int64_t{1}, int64_t{59999}}) {
    SCOPED_TRACE(i);
    const Example ex = train.get(i);
    const auto& x = ex.at("pixel_values");
    ASSERT_EQ(x.sizes(), (std::vector<int64_t>{1, 32, 32}));
    EXPECT_EQ(x.scalar_type(), torch::kFloat);
    EXPECT_GE(x.min().item<float>(), -1.0f);
    EXPECT_LE(x.max().item<float>(), 1.0f);
    // The 2-pixel border of the 32x32 canvas is exactly the background, -1.
    auto border = torch::ones({32, 32}, torch::kBool);
    border.narrow(0, 2, 28).narrow(1, 2, 28).fill_(false);
    EXPECT_TRUE(torch::all(x[0].masked_select(border) == -1.0f).item<bool>());
    // The centre is the raw image, p / 255 * 2 - 1.
    double sum = 0;
    auto expected = torch::empty({28, 28});
    for (int p = 0; p < 784; ++p) {
      const auto byte = static_cast<unsigned char>(raw_images[16 + i * 784 + p]);
      sum += byte;
      expected.view(-1)[p] = byte / 255.0 * 2.0 - 1.0;
    }
    const auto centre = x[0].narrow(0, 2, 28).narrow(1, 2, 28);
    const double diff = max_abs(centre, expected);
    std::printf("Fashion-MNIST train[%lld] vs raw bytes: max abs diff %.3g (tolerance 1e-06)\n",
                static_cast<long long>(i), diff);
    EXPECT_LE(diff, 1e-6);
    const double mean = x.narrow(1, 2, 28).narrow(2, 2, 28).mean().item<double>();
    EXPECT_NEAR(mean, sum / 784 / 255 * 2 - 1, 1e-6);
    EXPECT_EQ(ex.at("class_labels").item<int64_t>(), static_cast<unsigned char>(raw_labels[8 + i]));
    EXPECT_EQ(ex.at("class_labels").dim(), 0);
    EXPECT_EQ(ex.at("class_labels").scalar_type(), torch::kLong);
    EXPECT_EQ(ex.at("index").item<int64_t>(), i);
    EXPECT_EQ(ex.at("index").dim(), 0);
  }
  // Fashion-MNIST's first training image is an ankle boot.
  EXPECT_EQ(train.get(0).at("class_labels").item<int64_t>(), 9);
  EXPECT_EQ(MnistDataset::fashion_mnist_class_names().at(9), "Ankle boot");
  EXPECT_EQ(MnistDataset::fashion_mnist_class_names().size(), 10u);

  options.split = "test";
  EXPECT_EQ(MnistDataset(options).size(), 10000);
  EXPECT_EQ(default_dataset_dir("fashion_mnist"), kFashionDir);
}

TEST(Mnist, OnlyClassLimitAndResolution) {
  MnistOptions options;
  options.split = "test";
  options.only_class = 3;
  const MnistDataset threes(options);
  EXPECT_EQ(threes.size(), 1000);  // Fashion-MNIST's test split has 1000 of each class
  EXPECT_TRUE(torch::all(threes.labels() == 3).item<bool>());
  EXPECT_EQ(threes.num_classes(), 10);
  options.limit = 7;
  const MnistDataset seven(options);
  ASSERT_EQ(seven.size(), 7);
  for (int64_t i = 0; i < 7; ++i) {
    EXPECT_EQ(seven.get(i).at("class_labels").item<int64_t>(), 3);
    EXPECT_TRUE(torch::equal(seven.get(i).at("pixel_values"), threes.get(i).at("pixel_values")));
  }
  options.only_class.reset();
  options.resolution = 28;  // no padding: exactly the image
  const auto plain = MnistDataset(options).get(0).at("pixel_values");
  options.resolution = 33;  // odd margin: 2 above/left, 3 below/right
  const auto odd = MnistDataset(options).get(0).at("pixel_values");
  EXPECT_TRUE(torch::equal(odd.narrow(1, 2, 28).narrow(2, 2, 28), plain));
  EXPECT_TRUE(torch::all(odd.narrow(1, 30, 3) == -1.0f).item<bool>());
  options.resolution = 14;  // antialiased 2x shrink keeps the mean
  const auto small = MnistDataset(options).get(0).at("pixel_values");
  ASSERT_EQ(small.sizes(), (std::vector<int64_t>{1, 14, 14}));
  EXPECT_GE(small.min().item<float>(), -1.0f);
  EXPECT_LE(small.max().item<float>(), 1.0f);
  EXPECT_NEAR(small.mean().item<double>(), plain.mean().item<double>(), 0.02);
}

TEST(Mnist, RandomFlipIsPerSampleAndDeterministic) {
  MnistOptions options;
  options.split = "test";
  options.limit = 16;
  options.random_flip = true;
  options.seed = 5;
  MnistDataset a(options), b(options);
  options.random_flip = false;
  const MnistDataset plain(options);
  int flipped = 0, kept = 0;
  for (int64_t epoch = 0; epoch < 4; ++epoch) {
    a.set_epoch(epoch);
    b.set_epoch(epoch);
    for (int64_t i = 0; i < 16; ++i) {
      const auto x = a.get(i).at("pixel_values");
      EXPECT_TRUE(torch::equal(x, b.get(i).at("pixel_values")));  // same (seed, epoch, i)
      const auto p = plain.get(i).at("pixel_values");
      if (torch::equal(x, p.flip({2})) && !torch::equal(x, p))
        ++flipped;
      else if (torch::equal(x, p))
        ++kept;
    }
  }
  EXPECT_EQ(flipped + kept, 64);  // every example is either itself or its mirror
  EXPECT_GT(flipped, 16);
  EXPECT_GT(kept, 16);
}

// ---------------------------------------------------------------- MNIST, errors

TEST(Mnist, ErrorsNameThePathAndTheFix) {
  MnistOptions options;
  options.dir = "/nonexistent/mnist";
  EXPECT_EQ(error_of([&] { MnistDataset{options}; }),
            "/nonexistent/mnist: no such folder; install Fashion-MNIST with `sudo apt install "
            "dataset-fashion-mnist`, or pass --train_data_dir with the MNIST IDX files");
  EXPECT_HAS(error_of([] { default_dataset_dir("mnist"); }), "pass --train_data_dir");
  EXPECT_HAS(error_of([] { default_dataset_dir("cifar10"); }), "dataset \"cifar10\"");

  const auto dir = temp_dir("mnist_err");
  options.dir = dir;
  EXPECT_EQ(error_of([&] { MnistDataset{options}; }),
            dir +
                ": neither train-images-idx3-ubyte.gz nor train-images-idx3-ubyte found; "
                "install Fashion-MNIST with `sudo apt install dataset-fashion-mnist`, or pass "
                "--train_data_dir with the MNIST IDX files");
  // A small MNIST-format folder: raw images, gzip labels; one label short.
  write_raw(dir + "/train-images-idx3-ubyte", idx_bytes(random_bytes({5, 28, 28}, 9)));
  write_gz(dir + "/train-labels-idx1-ubyte.gz", idx_bytes(torch::arange(4).to(torch::kUInt8)));
  EXPECT_EQ(error_of([&] { MnistDataset{options}; }),
            dir + "/train-labels-idx1-ubyte.gz has 4 labels but " + dir +
                "/train-images-idx3-ubyte has 5 images; the files belong to different datasets "
                "or splits");
  write_gz(dir + "/train-labels-idx1-ubyte.gz", idx_bytes(torch::arange(5).to(torch::kUInt8)));
  const MnistDataset small(options);
  EXPECT_EQ(small.size(), 5);
  EXPECT_EQ(small.num_classes(), 5);
  options.only_class = 7;
  EXPECT_HAS(error_of([&] { MnistDataset{options}; }), "only_class 7 matches no example");
  options.only_class.reset();
  options.split = "val";
  EXPECT_HAS(error_of([&] { MnistDataset{options}; }), "split is \"val\"");
  options.split = "train";
  options.resolution = 0;
  EXPECT_HAS(error_of([&] { MnistDataset{options}; }), "resolution is 0");
  options.resolution = 32;
  options.limit = -1;
  EXPECT_HAS(error_of([&] { MnistDataset{options}; }), "limit is -1");
  EXPECT_HAS(error_of([&] { small.get(5); }), "index 5 is out of range");
}

}  // namespace
}  // namespace difftrain::data
