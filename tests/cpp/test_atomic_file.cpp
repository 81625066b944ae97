// Tests of the atomic file writer (src/core/atomic_file.h) and of the safetensors writer that uses
// it.
#include "src/core/atomic_file.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kvbridge/error.h"
#include "src/io/safetensors.h"

namespace kvbridge::detail {
namespace {

namespace fs = std::filesystem;
using Bytes = std::vector<unsigned char>;

struct TempDir {
  fs::path dir;
  TempDir() {
    dir = fs::temp_directory_path() /
          ("kvbridge-atomic-" + std::to_string(::getpid()) + "-" +
           std::to_string(reinterpret_cast<uintptr_t>(this)));
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  ~TempDir() { fs::remove_all(dir); }
  std::string path(const std::string& name) const { return (dir / name).string(); }
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
    return out;
  }
};

Bytes random_bytes(size_t n, uint64_t seed) {
  Bytes b(n);
  std::mt19937_64 rng(seed);
  for (auto& x : b) x = static_cast<unsigned char>(rng() | 1);
  return b;
}

Bytes read_bytes(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

AtomicFile::Options quick() {
  AtomicFile::Options o;
  o.fsync = false;
  o.fsync_dir = false;
  return o;
}

TEST(AtomicFile, ReplacePublishesTheWholeNewFileOverTheOldOne) {
  TempDir t;
  const std::string p = t.path("f.bin");
  const Bytes old_bytes = random_bytes(1000, 1), new_bytes = random_bytes(70001, 2);
  std::ofstream(p, std::ios::binary)
      .write(reinterpret_cast<const char*>(old_bytes.data()), 1000);
  AtomicFile f;
  ASSERT_EQ(f.open(p, AtomicFile::Options{}), 0);  // with fsync of the file and directory
  // Split over two writes and an iovec: the file holds them in order.
  ASSERT_EQ(f.write(new_bytes.data(), 100), 0);
  iovec iov[2] = {{const_cast<unsigned char*>(new_bytes.data()) + 100, 900},
                  {const_cast<unsigned char*>(new_bytes.data()) + 1000, new_bytes.size() - 1000}};
  ASSERT_EQ(f.writev(iov, 2), 0);
  EXPECT_EQ(read_bytes(p), old_bytes);  // nothing visible before the publish
  EXPECT_TRUE(fs::exists(f.temp_path()));
  EXPECT_EQ(f.temp_path().rfind(p + ".tmp.", 0), 0u) << f.temp_path();
  ASSERT_EQ(f.publish(AtomicFile::Publish::kReplace), 0);
  EXPECT_TRUE(f.published());
  EXPECT_EQ(read_bytes(p), new_bytes);
  EXPECT_EQ(t.names(), std::vector<std::string>{"f.bin"});  // no temporary file left
}

TEST(AtomicFile, NoReplaceRefusesAnExistingFileAndKeepsTheTemporaryForAnotherTry) {
  TempDir t;
  const std::string p = t.path("f.bin");
  const Bytes first = random_bytes(5000, 3), second = random_bytes(6000, 4);
  AtomicFile a, b;
  ASSERT_EQ(a.open(p, quick()), 0);
  ASSERT_EQ(b.open(p, quick()), 0);
  EXPECT_NE(a.temp_path(), b.temp_path());
  ASSERT_EQ(a.write(first.data(), first.size()), 0);
  ASSERT_EQ(b.write(second.data(), second.size()), 0);
  ASSERT_EQ(a.publish(AtomicFile::Publish::kNoReplace), 0);
  EXPECT_EQ(b.publish(AtomicFile::Publish::kNoReplace), EEXIST);
  EXPECT_EQ(read_bytes(p), first);
  EXPECT_FALSE(b.published());
  EXPECT_TRUE(fs::exists(b.temp_path()));  // kept: the caller may remove the file and retry
  fs::remove(p);
  ASSERT_EQ(b.publish(AtomicFile::Publish::kNoReplace), 0);
  EXPECT_EQ(read_bytes(p), second);
  EXPECT_EQ(t.names(), std::vector<std::string>{"f.bin"});
}

TEST(AtomicFile, AbandonAndTheDestructorLeaveNothing) {
  TempDir t;
  const Bytes bytes = random_bytes(3000, 5);
  {
    AtomicFile f;
    ASSERT_EQ(f.open(t.path("a.bin"), quick()), 0);
    ASSERT_EQ(f.write(bytes.data(), bytes.size()), 0);
    f.abandon();
    EXPECT_TRUE(t.names().empty());
    f.abandon();  // twice is harmless
  }
  {
    AtomicFile f;
    ASSERT_EQ(f.open(t.path("b.bin"), quick()), 0);
    ASSERT_EQ(f.write(bytes.data(), bytes.size()), 0);
    ASSERT_EQ(f.finish(), 0);  // closed, not published
    EXPECT_EQ(t.names().size(), 1u);
  }
  EXPECT_TRUE(t.names().empty());
  {
    // A moved-from file owns nothing; the one moved to abandons on destruction.
    AtomicFile f;
    ASSERT_EQ(f.open(t.path("c.bin"), quick()), 0);
    AtomicFile g = std::move(f);
    f.abandon();
    EXPECT_EQ(t.names().size(), 1u);
  }
  EXPECT_TRUE(t.names().empty());
  {
    // Published: the destructor leaves the file.
    AtomicFile f;
    ASSERT_EQ(f.open(t.path("d.bin"), quick()), 0);
    ASSERT_EQ(f.write(bytes.data(), bytes.size()), 0);
    ASSERT_EQ(f.publish(AtomicFile::Publish::kReplace), 0);
  }
  EXPECT_EQ(t.names(), std::vector<std::string>{"d.bin"});
  EXPECT_EQ(read_bytes(t.path("d.bin")), bytes);
}

TEST(AtomicFile, TheTagNamesTheTemporaryFile) {
  TempDir t;
  AtomicFile::Options o = quick();
  o.tag = "store42";
  AtomicFile f;
  ASSERT_EQ(f.open(t.path("x.kvb"), o), 0);
  EXPECT_EQ(f.temp_path().rfind(t.path("x.kvb") + ".tmp.store42.", 0), 0u) << f.temp_path();
}

// Each writer publishes a file of its own bytes, many times, while readers check that the path
// always holds one writer's whole file.
TEST(AtomicFile, ConcurrentWritersOfOnePathEachLeaveAWholeFile) {
  TempDir t;
  const std::string p = t.path("shared.bin");
  constexpr int kWriters = 4, kRounds = 40;
  std::vector<Bytes> contents;
  for (int w = 0; w < kWriters; ++w) contents.push_back(random_bytes(65536 + 4099 * w, 10 + w));
  std::atomic<int> failures{0}, torn{0};
  std::atomic<bool> done{false};
  std::vector<std::thread> threads;
  for (int w = 0; w < kWriters; ++w) {
    threads.emplace_back([&, w] {
      for (int r = 0; r < kRounds; ++r) {
        AtomicFile f;
        // Two writes, so a shared temporary name would interleave another writer's bytes.
        const size_t half = contents[w].size() / 2;
        if (f.open(p, quick()) != 0 || f.write(contents[w].data(), half) != 0 ||
            f.write(contents[w].data() + half, contents[w].size() - half) != 0 ||
            f.publish(AtomicFile::Publish::kReplace) != 0)
          ++failures;
      }
    });
  }
  std::thread reader([&] {
    while (!done) {
      if (!fs::exists(p)) continue;
      const Bytes b = read_bytes(p);
      bool whole = false;
      for (const Bytes& c : contents) whole = whole || b == c;
      if (!whole) ++torn;
    }
  });
  for (auto& th : threads) th.join();
  done = true;
  reader.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(torn.load(), 0);
  EXPECT_EQ(t.names(), std::vector<std::string>{"shared.bin"});
}

TEST(AtomicFile, ErrorsAreKvbridgeErrorsNamingThePath) {
  TempDir t;
  const std::string p = t.path("missing-dir/f.bin");
  AtomicFile f;
  EXPECT_EQ(f.open(p, quick()), ENOENT);
  EXPECT_LT(f.fd(), 0);
  try {
    AtomicFile::create(p, quick(), "save");
    FAIL() << "create in a missing directory did not throw";
  } catch (const Unavailable& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("save: "), std::string::npos) << what;
    EXPECT_NE(what.find(p), std::string::npos) << what;
  }
  // A publish whose target cannot be made: the target is a non-empty directory.
  fs::create_directories(t.path("dir.bin/inside"));
  AtomicFile g = AtomicFile::create(t.path("dir.bin"), quick(), "save");
  const std::string temp = g.temp_path();
  const Bytes bytes = random_bytes(10, 6);
  g.write_or_throw(bytes.data(), bytes.size(), "save");
  try {
    g.commit("save");
    FAIL() << "commit over a directory did not throw";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(t.path("dir.bin")), std::string::npos) << what;
  }
  EXPECT_FALSE(fs::exists(temp));  // abandoned
}

// write_safetensors from several threads to one path: every file read back is one writer's whole
// file (a shared temporary name, truncated by each writer, mixed their bytes).
TEST(AtomicFile, ConcurrentSafetensorsWritersOfOnePathLeaveOneWholeFile) {
  TempDir t;
  const std::string p = t.path("adapter.safetensors");
  constexpr int kWriters = 4, kRounds = 15;
  std::vector<io::StTensor> tensors;
  for (int w = 0; w < kWriters; ++w) {
    io::StTensor x;
    x.name = "w";
    x.dtype = io::StDType::kF32;
    x.shape = {257, 129 + w};
    x.data = random_bytes(static_cast<size_t>(257 * (129 + w) * 4), 20 + w);
    tensors.push_back(std::move(x));
  }
  std::atomic<int> failures{0}, torn{0};
  std::atomic<bool> done{false};
  std::vector<std::thread> threads;
  for (int w = 0; w < kWriters; ++w) {
    threads.emplace_back([&, w] {
      for (int r = 0; r < kRounds; ++r) {
        try {
          io::write_safetensors(p, {tensors[w]}, {{"writer", std::to_string(w)}});
        } catch (const Error&) {
          ++failures;
        }
      }
    });
  }
  auto check = [&] {
    try {
      const io::StFile f = io::read_safetensors(p);
      const int w = std::stoi(f.metadata.at("writer"));
      const io::StTensor& got = f.tensors.at("w");
      if (got.shape != tensors[w].shape || got.data != tensors[w].data) ++torn;
    } catch (const std::exception&) {
      ++torn;
    }
  };
  std::thread reader([&] {
    while (!done)
      if (fs::exists(p)) check();
  });
  for (auto& th : threads) th.join();
  done = true;
  reader.join();
  check();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(torn.load(), 0);
  EXPECT_EQ(t.names(), std::vector<std::string>{"adapter.safetensors"});
}

}  // namespace
}  // namespace kvbridge::detail
