// Faults of the disk tier: writers killed mid-write, corrupt and truncated files, write and
// read errors. None of them may ever return wrong KV or throw from put / match.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>

#include <fstream>

#include "process_util.h"
#include "test_util.h"

namespace kvbridge {
namespace {

using testing::DenseKV;
using testing::TempDir;

std::vector<unsigned char> read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::vector<unsigned char>(std::istreambuf_iterator<char>(f), {});
}

void write_file(const std::string& path, const std::vector<unsigned char>& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

// A child process writes 4 MiB prompts (four 1 MiB entries, fsync on) and is SIGKILLed at a
// random moment, five times. Then every prompt it may have touched is matched: a hit must be
// byte-exact, no file may fail validation, and no temporary file may survive the next open.
TEST(StoreFaults, KilledWriterNeverLeavesATornEntry) {
  const std::string helper = KVBRIDGE_STORE_HELPER;
  TempDir dir;
  std::mt19937 rng(7);
  std::vector<std::pair<uint64_t, uint64_t>> touched;  // [first, last] seeds per round
  int64_t temporaries_seen = 0;
  for (uint64_t round = 0; round < 5; ++round) {
    const uint64_t first = 1000 * (round + 1);
    testing::Child child =
        testing::spawn({helper, "disk-writer", dir.path, std::to_string(first)}, true);
    ASSERT_GT(child.pid, 0) << helper;
    std::string line;
    uint64_t last = first;
    for (int done = 0; done < 2 && testing::read_line(child.out, &line); ++done) {
      last = std::stoull(line.substr(6)) + 1;  // the next put may be in flight
    }
    std::this_thread::sleep_for(std::chrono::microseconds(rng() % 20000));
    ::kill(child.pid, SIGKILL);
    while (testing::read_line(child.out, &line)) last = std::stoull(line.substr(6)) + 1;
    testing::wait_exit(child);
    touched.emplace_back(first, last);
    for (const std::string& f : testing::files_with_suffix(dir.path, ""))
      temporaries_seen += f.find(".tmp.") != std::string::npos;  // the next open removes them
  }
  KVStore store(testing::helper_disk_options(dir.path));
  // Temporary files are named <entry>.tmp.<pid>.<n>; the open removed every one.
  for (const std::string& f : testing::files_with_suffix(dir.path, ""))
    EXPECT_EQ(f.find(".tmp."), std::string::npos) << f;
  const ModelSpec spec = testing::helper_spec();
  int64_t whole = 0;
  for (const auto& [first, last] : touched) {
    for (uint64_t seed = first; seed <= last; ++seed) {
      const auto tokens = testing::helper_tokens(seed);
      Match m = store.match(spec, tokens);
      if (m.tokens() == 0) continue;
      DenseKV expect(spec, testing::kHelperTokens, seed);
      DenseKV out(spec, m.tokens(), 1);
      m.copy_to(out.view);
      ASSERT_TRUE(testing::same_elements(out.view, expect.view.slice_tokens(0, m.tokens())))
          << "seed " << seed;
      whole += m.tokens() == testing::kHelperTokens;
      store.clear(kMemoryTier);
    }
  }
  const StoreStats st = store.stats();
  EXPECT_EQ(st.disk.corrupt, 0);
  EXPECT_GE(whole, 10);  // each round saw two complete puts before the kill
  std::printf("killed writer: %lld whole prompts, %lld entries, %lld temporary files left by the kills\n",
              static_cast<long long>(whole), static_cast<long long>(st.disk.entries),
              static_cast<long long>(temporaries_seen));
}

// Flipped bytes at random offsets, truncations and appended bytes: each is a counted miss, the
// file moves to quarantine (which keeps at most 64 files), and a later put restores the entry.
TEST(StoreFaults, CorruptFilesAreCountedMissesAndQuarantined) {
  TempDir dir;
  const ModelSpec spec = testing::small_spec(DType::kBFloat16, 3, 2, 8);
  StoreOptions o = testing::helper_disk_options(dir.path);
  o.chunk_tokens = 16;
  KVStore store(o);
  const auto tokens = testing::random_tokens(16, 5);
  DenseKV kv(spec, 16, 5);
  ASSERT_EQ(store.put(spec, tokens, kv.view), 16);
  const std::string path = testing::files_with_suffix(dir.path + "/kvbridge-v1/" +
                                                          spec.fingerprint(), ".kvb").at(0);
  const std::vector<unsigned char> good = read_file(path);
  std::mt19937_64 rng(11);
  int trials = 0;
  for (int kind = 0; kind < 3; ++kind) {
    for (int t = 0; t < 30; ++t, ++trials) {
      std::vector<unsigned char> bad = good;
      if (kind == 0) {
        bad[rng() % bad.size()] ^= static_cast<unsigned char>(1 + rng() % 255);
      } else if (kind == 1) {
        bad.resize(rng() % bad.size());  // includes the empty file
      } else {
        bad.push_back(static_cast<unsigned char>(rng()));
      }
      store.clear(kMemoryTier);
      write_file(path, bad);
      const int64_t corrupt_before = store.stats().disk.corrupt;
      Match m = store.match(spec, tokens);
      ASSERT_EQ(m.tokens(), 0) << "kind " << kind << " trial " << t;
      EXPECT_EQ(store.stats().disk.corrupt, corrupt_before + 1);
      EXPECT_FALSE(std::filesystem::exists(path));
      EXPECT_EQ(store.stats().disk.entries, 0);
      ASSERT_EQ(store.put(spec, tokens, kv.view), 16);  // the disk copy is written again
      const std::vector<unsigned char> again = read_file(path);
      ASSERT_EQ(again.size(), good.size());
      // The same entry, but for its creation time (header bytes 64..71) and the checksum.
      EXPECT_TRUE(std::equal(good.begin(), good.begin() + 64, again.begin()));
      EXPECT_TRUE(std::equal(good.begin() + 72, good.end() - 16, again.begin() + 72));
    }
  }
  EXPECT_EQ(store.stats().disk.corrupt, trials);
  const auto quarantined = testing::files_with_suffix(dir.path + "/kvbridge-v1/quarantine", "");
  EXPECT_EQ(quarantined.size(), 64u);
  store.clear(kMemoryTier);
  Match m = store.match(spec, tokens);
  ASSERT_EQ(m.tokens(), 16);
  DenseKV out(spec, 16, 1);
  m.copy_to(out.view);
  EXPECT_TRUE(testing::same_elements(out.view, kv.view));
}

// A reopened store does not trust a file it never read: the same corruption is caught lazily.
TEST(StoreFaults, CorruptionFoundAfterReopen) {
  TempDir dir;
  const ModelSpec spec = testing::small_spec();
  StoreOptions o = testing::helper_disk_options(dir.path);
  o.chunk_tokens = 8;
  const auto tokens = testing::random_tokens(24, 3);
  DenseKV kv(spec, 24, 3);
  { KVStore(o).put(spec, tokens, kv.view); }
  // Damage the second chunk's file only: the match stops after the first.
  const Hash128 salt = prefix_salt("default", spec);
  const Hash128 key = prefix_hashes(salt, tokens, 8)[1];
  const std::string path = dir.path + "/kvbridge-v1/" + spec.fingerprint() + "/" +
                           key.hex().substr(0, 2) + "/" + key.hex() + ".kvb";
  std::vector<unsigned char> bytes = read_file(path);
  ASSERT_FALSE(bytes.empty());
  bytes[bytes.size() / 2] ^= 0x40;
  write_file(path, bytes);
  KVStore store(o);
  EXPECT_EQ(store.stats().disk.entries, 3);
  EXPECT_EQ(store.match(spec, tokens).tokens(), 8);
  EXPECT_EQ(store.stats().disk.corrupt, 1);
  EXPECT_EQ(store.stats().disk.entries, 2);
}

// Writes that fail (here: the file size limit, EFBIG) are counted and skipped; put keeps
// serving from memory and leaves no temporary file.
TEST(StoreFaults, WriteErrorsDegradeToSkippedWrites) {
  TempDir dir;
  const ModelSpec spec = testing::small_spec(DType::kFloat32, 4, 4, 16);
  StoreOptions o = testing::helper_disk_options(dir.path);
  o.chunk_tokens = 16;
  KVStore store(o);
  const auto tokens = testing::random_tokens(32, 1);
  DenseKV kv(spec, 32, 1);
  rlimit old{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
  auto* old_handler = ::signal(SIGXFSZ, SIG_IGN);
  rlimit small = old;
  small.rlim_cur = 1000;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  const int64_t stored = store.put(spec, tokens, kv.view);
  ::setrlimit(RLIMIT_FSIZE, &old);
  ::signal(SIGXFSZ, old_handler);
  EXPECT_EQ(stored, 32);
  StoreStats st = store.stats();
  EXPECT_EQ(st.disk.write_failures, 2);
  EXPECT_EQ(st.disk.errors, 2);
  EXPECT_EQ(st.disk.entries, 0);
  EXPECT_EQ(st.disk.bytes_used, 0);
  EXPECT_TRUE(testing::files_with_suffix(dir.path + "/kvbridge-v1/" + spec.fingerprint(), "")
                  .empty());
  EXPECT_EQ(store.match(spec, tokens).tokens(), 32);
  // The next put with a working disk writes them.
  store.put(spec, tokens, kv.view);
  EXPECT_EQ(store.stats().disk.entries, 2);
}

// A read error (the entry's path is now a directory: EISDIR) is a counted miss, not an
// exception, and memory keeps working.
TEST(StoreFaults, ReadErrorsAreCountedMisses) {
  TempDir dir;
  const ModelSpec spec = testing::small_spec();
  StoreOptions o = testing::helper_disk_options(dir.path);
  o.chunk_tokens = 8;
  KVStore store(o);
  const auto tokens = testing::random_tokens(8, 2);
  DenseKV kv(spec, 8, 2);
  store.put(spec, tokens, kv.view);
  store.clear(kMemoryTier);
  const std::string path =
      testing::files_with_suffix(dir.path + "/kvbridge-v1/" + spec.fingerprint(), ".kvb").at(0);
  ASSERT_EQ(::unlink(path.c_str()), 0);
  ASSERT_EQ(::mkdir(path.c_str(), 0755), 0);
  EXPECT_EQ(store.match(spec, tokens).tokens(), 0);
  EXPECT_EQ(store.stats().disk.errors, 1);
  EXPECT_EQ(store.stats().disk.corrupt, 0);
  ::rmdir(path.c_str());
  // A file deleted behind the store's back is a plain miss that drops the index entry.
  store.put(spec, tokens, kv.view);
  store.clear(kMemoryTier);
  EXPECT_EQ(store.stats().disk.entries, 1);
  ASSERT_EQ(::unlink(path.c_str()), 0);
  EXPECT_EQ(store.match(spec, tokens).tokens(), 0);
  EXPECT_EQ(store.stats().disk.entries, 0);
}

}  // namespace
}  // namespace kvbridge

namespace kvbridge {
namespace {

// One flipped byte at each of ~200 offsets (seeded; every region of the entry: header, token
// ids, payload, and for int8 its key scales, value scales and codes, and the trailer), for both
// storage formats: every one is a miss counted as corrupt, the file is moved to quarantine (not
// just deleted: the quarantine grows by one until its cap of 64), and a put restores the entry.
TEST(StoreFaults, EveryCorruptOffsetIsACountedMissMovedAside) {
  const ModelSpec spec = testing::small_spec(DType::kBFloat16, 2, 3, 10);
  constexpr int64_t kChunk = 12;
  for (StorageFormat storage : {StorageFormat::kNative, StorageFormat::kInt8}) {
    TempDir dir;
    StoreOptions o = testing::helper_disk_options(dir.path);
    o.chunk_tokens = kChunk;
    o.storage = storage;
    KVStore store(o);
    const auto tokens = testing::random_tokens(kChunk, 15);
    testing::HFKV raw(spec, kChunk, 2, 16);
    // Finite bfloat16 values (int8 rejects NaN / inf): small integers times 1/8.
    for (auto& plane : raw.storage)
      for (size_t i = 0; i + 1 < plane.size(); i += 2) {
        plane[i] = 0;
        plane[i + 1] = static_cast<unsigned char>(0x3c + (plane[i + 1] & 0x3));
      }
    const KVView kv = raw.view();
    ASSERT_EQ(store.put(spec, tokens, kv), kChunk);
    const std::string path = testing::files_with_suffix(
        dir.path + "/kvbridge-v1/" + spec.fingerprint(), ".kvb").at(0);
    const std::string quarantine = dir.path + "/kvbridge-v1/quarantine";
    const std::vector<unsigned char> good = read_file(path);
    ASSERT_GT(good.size(), 224u + 4 * kChunk + 16);
    std::mt19937_64 rng(storage == StorageFormat::kInt8 ? 23 : 22);
    std::vector<size_t> offsets;
    for (size_t off = 0; off < good.size(); off += good.size() / 97) offsets.push_back(off);
    for (int i = 0; i < 100; ++i) offsets.push_back(rng() % good.size());
    offsets.push_back(good.size() - 1);
    for (size_t n = 0; n < offsets.size(); ++n) {
      std::vector<unsigned char> bad = good;
      bad[offsets[n]] ^= static_cast<unsigned char>(1 + rng() % 255);
      store.clear(kMemoryTier);
      write_file(path, bad);
      const int64_t corrupt = store.stats().disk.corrupt;
      ASSERT_EQ(store.match(spec, tokens).tokens(), 0) << "offset " << offsets[n];
      EXPECT_EQ(store.stats().disk.corrupt, corrupt + 1) << "offset " << offsets[n];
      EXPECT_FALSE(std::filesystem::exists(path));
      EXPECT_EQ(testing::files_with_suffix(quarantine, "").size(), std::min<size_t>(n + 1, 64));
      ASSERT_EQ(store.put(spec, tokens, kv), kChunk);
    }
    store.clear(kMemoryTier);
    Match m = store.match(spec, tokens);
    ASSERT_EQ(m.tokens(), kChunk);
    EXPECT_EQ(store.stats().disk.hit_chunks, 1);
  }
}

}  // namespace
}  // namespace kvbridge
