// One disk directory shared by several processes (each its own store and memory tier): mixed
// put / match / erase / invalidate from four processes with every hit checked byte for byte
// and the byte budget sampled throughout; a writer SIGKILLed mid-put while another store
// lives; two processes invalidating one model while a third reads.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>

#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "process_util.h"
#include "test_util.h"

namespace kvbridge {
namespace {

using testing::TempDir;

int64_t blocks(int64_t bytes) { return (bytes + 4095) / 4096 * 4096; }

// The directory-wide count every store keeps (kvbridge-v1/USAGE: magic, version, count).
int64_t shared_count(const std::string& dir) {
  std::ifstream f(dir + "/kvbridge-v1/USAGE", std::ios::binary);
  char buf[24] = {};
  f.read(buf, sizeof buf);
  int64_t v = 0;
  std::memcpy(&v, buf + 16, 8);
  return v;
}

// What the entry and temporary files under the fingerprint directories take now, in 4 KiB
// blocks, each inode once (a file being published has two names for a moment).
int64_t tree_blocks(const std::string& dir) {
  std::set<ino_t> seen;
  int64_t total = 0;
  std::error_code ec;
  const std::string root = dir + "/kvbridge-v1/";
  for (auto it = std::filesystem::recursive_directory_iterator(root, ec);
       it != std::filesystem::recursive_directory_iterator(); it.increment(ec)) {
    const std::string p = it->path().string();
    const std::string rel = p.substr(root.size());
    if (rel.find('/') != 32) continue;  // LOCK, USAGE, stores/, quarantine/, a directory
    struct stat st{};
    if (::lstat(p.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
    if (seen.insert(st.st_ino).second) total += blocks(st.st_size);
  }
  return total;
}

std::vector<std::string> temp_files(const std::string& dir) {
  std::vector<std::string> out;
  for (const std::string& f : testing::files_with_suffix(dir, ""))
    if (f.find(".tmp.") != std::string::npos) out.push_back(f);
  return out;
}

// Waits until the process is stopped or gone (its state in /proc/PID/stat).
void wait_stopped(pid_t pid) {
  for (int i = 0; i < 20000; ++i) {
    std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
    std::string all((std::istreambuf_iterator<char>(f)), {});
    const size_t paren = all.rfind(')');
    if (paren == std::string::npos || paren + 2 >= all.size()) return;
    const char state = all[paren + 2];
    if (state == 'T' || state == 't' || state == 'Z' || state == 'X') return;
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

// "name value name value ..." from a helper's output line.
std::map<std::string, int64_t> fields(const std::string& line) {
  std::map<std::string, int64_t> out;
  std::istringstream in(line);
  std::string name;
  int64_t value;
  while (in >> name >> value) out[name] = value;
  return out;
}

// Four processes, three seconds of random puts (45%), matches with empty memory (45%), disk
// erases (7%) and invalidates of one of the two models (3%) over 30 prompts of 4 chunks each
// (120 entries) against a budget of 40 entry files: eviction all the time. Every hit must be
// byte-exact, no file may fail validation, the files (entries and temporary files of writes
// in flight) never take more than the shared count nor the budget at any sample, and once the
// processes are gone the shared count is exactly the files' bytes.
TEST(SharedDisk, FourProcessesMixedOpsEveryHitExactBudgetHeld) {
  const std::string helper = KVBRIDGE_STORE_HELPER;
  TempDir dir;
  const int64_t capacity = 40 * testing::kSharedFileBlocks;
  { KVStore init(testing::shared_options(dir.path, capacity)); }
  std::vector<testing::Child> children;
  for (int i = 0; i < 4; ++i) {
    children.push_back(testing::spawn({helper, "disk-mixed", dir.path, std::to_string(11 + i),
                                       "3000", std::to_string(capacity)},
                                      true));
    ASSERT_GT(children.back().pid, 0) << helper;
  }
  // Every few ms all four are stopped (SIGSTOP, wherever they are, a write half done or not)
  // and the files are summed: never more than the shared count, never more than the budget.
  int64_t samples = 0, most = 0;
  for (bool running = true; running;) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    for (const testing::Child& c : children) ::kill(c.pid, SIGSTOP);
    for (const testing::Child& c : children) wait_stopped(c.pid);
    const int64_t files = tree_blocks(dir.path);
    const int64_t count = shared_count(dir.path);
    for (const testing::Child& c : children) ::kill(c.pid, SIGCONT);
    EXPECT_LE(files, count);
    EXPECT_LE(files, capacity);
    EXPECT_LE(count, capacity);
    most = std::max(most, files);
    ++samples;
    running = false;
    for (const testing::Child& c : children) {
      siginfo_t info{};
      running |= ::waitid(P_PID, static_cast<id_t>(c.pid), &info, WEXITED | WNOHANG | WNOWAIT) ==
                     0 &&
                 info.si_pid == 0;
    }
  }
  int64_t hits = 0, ops = 0;
  for (testing::Child& c : children) {
    std::string out;
    EXPECT_EQ(testing::wait_exit(c, &out), 0) << out;
    const auto f = fields(out);
    hits += f.count("hits") ? f.at("hits") : 0;
    ops += f.count("ops") ? f.at("ops") : 0;
  }
  EXPECT_GT(hits, 100) << "the workload must read other processes' files";
  EXPECT_GT(samples, 10);
  EXPECT_GT(most, capacity / 2) << "the budget must be under pressure";
  const int64_t files = tree_blocks(dir.path);
  EXPECT_LE(files, capacity);
  EXPECT_EQ(shared_count(dir.path), files) << "ops " << ops;
  EXPECT_TRUE(temp_files(dir.path).empty());
}

// A writer process (4 MiB prompts of 1 MiB entries, fsync on) is SIGKILLed at a random moment,
// five times, while this process keeps a store open on the directory. That store never reads
// a torn entry; a store opened next (not alone: the first still lives) recovers the dead
// writers: their temporary files are gone and the shared count is the files' bytes, plus at
// most one entry per kill (a kill between the write's end and its publish leaves its bytes
// counted). A store opened with no other alive recounts exactly.
TEST(SharedDisk, WriterKilledMidPutWhileAnotherStoreLives) {
  const std::string helper = KVBRIDGE_STORE_HELPER;
  TempDir dir;
  const ModelSpec spec = testing::helper_spec();
  const int64_t entry = blocks(160 + 4 * testing::kHelperChunk +
                               spec.kv_bytes_per_token() * testing::kHelperChunk + 16);
  std::mt19937 rng(17);
  auto live = std::make_unique<KVStore>(testing::helper_disk_options(dir.path));
  uint64_t last = 0;
  const int kills = 5;
  for (int round = 0; round < kills; ++round) {
    const uint64_t first = 1000 * (round + 1);
    testing::Child child =
        testing::spawn({helper, "disk-writer", dir.path, std::to_string(first)}, true);
    ASSERT_GT(child.pid, 0) << helper;
    std::string line;
    for (int done = 0; done < 2 && testing::read_line(child.out, &line); ++done) {
    }
    std::this_thread::sleep_for(std::chrono::microseconds(rng() % 20000));
    ::kill(child.pid, SIGKILL);
    last = first;
    while (testing::read_line(child.out, &line)) last = std::stoull(line.substr(6)) + 1;
    testing::wait_exit(child);
    // The live store reads what the writer left: whole and exact, or a miss.
    for (uint64_t seed = first; seed <= last + 1; ++seed) {
      Match m = live->match(spec, testing::helper_tokens(seed));
      if (m.tokens() == 0) continue;
      testing::DenseKV expect(spec, testing::kHelperTokens, seed);
      testing::DenseKV out(spec, m.tokens(), 1);
      m.copy_to(out.view);
      ASSERT_TRUE(testing::same_elements(out.view, expect.view.slice_tokens(0, m.tokens())))
          << "seed " << seed;
      live->clear(kMemoryTier);
    }
  }
  EXPECT_EQ(live->stats().disk.corrupt, 0);
  EXPECT_GT(live->stats().disk.hit_chunks, 0);
  {
    KVStore next(testing::helper_disk_options(dir.path));
    EXPECT_TRUE(temp_files(dir.path).empty());
    EXPECT_EQ(testing::files_with_suffix(dir.path + "/kvbridge-v1/stores", ".lease").size(), 2u);
    const int64_t files = tree_blocks(dir.path);
    EXPECT_GE(shared_count(dir.path), files);
    EXPECT_LE(shared_count(dir.path), files + kills * entry);
  }
  live.reset();
  KVStore alone(testing::helper_disk_options(dir.path));
  EXPECT_EQ(shared_count(dir.path), tree_blocks(dir.path));
  EXPECT_EQ(alone.stats().disk.bytes_used, tree_blocks(dir.path));
}

// Two processes put and invalidate model 0 over and over while a third reads model 0 (a hit
// must be exact) and model 1, which nobody invalidates (every read must be a whole hit). The
// invalidating processes never count a failed write: a directory one of them removes while
// the other writes into it is made again.
TEST(SharedDisk, TwoProcessesInvalidateOneModelWhileAThirdReads) {
  const std::string helper = KVBRIDGE_STORE_HELPER;
  TempDir dir;
  {
    KVStore store(testing::shared_options(dir.path, int64_t{64} << 20));
    const ModelSpec spec = testing::shared_spec(1);
    for (uint64_t seed = 100; seed < 104; ++seed) {
      testing::DenseKV kv(spec, testing::kSharedTokens, seed);
      ASSERT_EQ(store.put(spec, testing::shared_tokens(seed), kv.view), testing::kSharedTokens);
    }
  }
  std::vector<testing::Child> children;
  children.push_back(testing::spawn({helper, "disk-churn", dir.path, "1", "3000"}, true));
  children.push_back(testing::spawn({helper, "disk-churn", dir.path, "2", "3000"}, true));
  children.push_back(testing::spawn({helper, "disk-reader", dir.path, "3000"}, true));
  int64_t invalidated = 0, reads = 0;
  for (testing::Child& c : children) {
    ASSERT_GT(c.pid, 0) << helper;
    std::string out;
    EXPECT_EQ(testing::wait_exit(c, &out), 0) << out;
    const auto f = fields(out);
    invalidated += f.count("invalidated") ? f.at("invalidated") : 0;
    reads += f.count("reads") ? f.at("reads") : 0;
  }
  EXPECT_GT(invalidated, 0);
  EXPECT_GT(reads, 10);
  KVStore after(testing::shared_options(dir.path, int64_t{64} << 20));
  for (uint64_t seed = 100; seed < 104; ++seed)
    EXPECT_EQ(testing::match_exact(after, 1, seed), testing::kSharedTokens);
}

}  // namespace
}  // namespace kvbridge
