// io::write_file_atomic: complete files only, private temporaries, no symlink following.

#include "difftrain/io/atomic_file.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <sstream>

namespace difftrain::test {
namespace {

namespace fs = std::filesystem;

std::string read_all(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST(AtomicFile, WritesTheWholeFileWithReadableModeAndLeavesNoTemporary) {
  const std::string dir = temp_dir("atomic_file");
  const std::string path = dir + "/sub/out.json";
  io::write_file_atomic(path, "first");
  io::write_file_atomic(path, "second, longer");
  EXPECT_EQ(read_all(path), "second, longer");
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0644u);
  size_t entries = 0;
  for (const auto& e : fs::directory_iterator(dir + "/sub")) {
    ++entries;
    EXPECT_EQ(e.path().filename(), "out.json") << "left behind: " << e.path();
  }
  EXPECT_EQ(entries, 1u);
}

TEST(AtomicFile, ReplacesAPlantedSymlinkInsteadOfWritingThroughIt) {
  const std::string dir = temp_dir("atomic_symlink");
  const std::string victim = dir + "/victim.txt";
  write_text(victim, "precious");
  const std::string path = dir + "/model.safetensors";
  fs::create_symlink(victim, path);
  io::write_file_atomic(path, "new weights");
  EXPECT_EQ(read_all(victim), "precious");
  EXPECT_FALSE(fs::is_symlink(path));
  EXPECT_EQ(read_all(path), "new weights");
}

TEST(AtomicFile, AFolderThatIsAFileIsAnErrorNamingThePath) {
  const std::string dir = temp_dir("atomic_unwritable");
  write_text(dir + "/plain", "x");
  const std::string path = dir + "/plain/out.json";
  const std::string message = error_of([&] { io::write_file_atomic(path, "data"); });
  EXPECT_NE(message.find(path), std::string::npos) << message;
  EXPECT_EQ(message.find('\n'), std::string::npos) << message;
}

}  // namespace
}  // namespace difftrain::test
