// kvbridge lower-tier benchmarks (part of kvbridge_bench; see bench_store.cpp for the rest).
//
// 3. Disk tier read: KVStore::match of one entry of 1, 4, 16 or 64 MiB that only the disk tier
//    holds (the memory copy is erased with the timer paused), so each iteration opens the
//    file, reads and checksums it into a memory entry and indexes it. The peer reads a file of
//    the same size with open + read() into a preallocated, already-touched buffer + close.
//    Both files were just written, so both reads come from the page cache. A second peer adds
//    the verification's floor to the plain read: the same bytes read in the tier's blocks, each
//    hashed with XXH3-128 (the entry checksum) right after it arrives, and nothing else.
// 4. Redis tier: KVStore::match of one entry only Redis holds (memory erased, timer paused):
//    one MGET, verify, copy into a memory entry; and KVStore::put of one entry (memory erased
//    first, timer paused): copy into memory, checksum, MULTI / SET / filter EVAL / EXEC. The
//    peers are a raw hiredis loop of GET and of SET of a value of the same size (the entry's
//    packed size) on one connection.
// 5. Filter: KVStore::match of prefixes nobody stored, with the Redis filter on and off;
//    reports Redis round trips per lookup (the remote calls the filter saves) and the time.
//
// Wall-clock time (UseRealTime): these include system calls and a server on the other end.
// The disk benchmarks write under $KVBRIDGE_BENCH_DIR (default /tmp); the Redis ones need
// $KVBRIDGE_BENCH_REDIS_URL (benchmarks/run_benchmarks.py starts a redis-server and sets it)
// and report an error without it.

#include <benchmark/benchmark.h>
#include <fcntl.h>
#include <hiredis/hiredis.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kvbridge/kvbridge.h"
#include "src/core/xxh3.h"

namespace {

using kvbridge::Device;
using kvbridge::DType;
using kvbridge::KVStore;
using kvbridge::KVView;
using kvbridge::Match;
using kvbridge::ModelSpec;
using kvbridge::StoreOptions;

constexpr int64_t kMiB = int64_t{1} << 20;

std::vector<int64_t> tokens_for(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int64_t> t(n);
  for (auto& x : t) x = static_cast<int64_t>(rng() % 128000);
  return t;
}

std::vector<unsigned char> bytes_for(size_t n, uint64_t seed) {
  std::vector<unsigned char> b(n);
  std::mt19937_64 rng(seed);
  for (size_t i = 0; i < n; i += 8) {
    const uint64_t w = rng() | 0x0101010101010101ull;
    std::memcpy(b.data() + i, &w, std::min<size_t>(8, n - i));
  }
  return b;
}

// 1 layer x 8 kv heads x 128, bfloat16: 4 KiB per token, so an entry of `bytes` is a chunk of
// bytes / 4 KiB tokens.
ModelSpec entry_spec() {
  ModelSpec s;
  s.name = "bench-tiers";
  s.num_layers = 1;
  s.num_kv_heads = 8;
  s.head_dim = 128;
  s.dtype = DType::kBFloat16;
  return s;
}

struct Entry {
  explicit Entry(int64_t bytes)
      : spec(entry_spec()), chunk(bytes / entry_spec().kv_bytes_per_token()),
        tokens(tokens_for(static_cast<size_t>(chunk), 7)),
        kv(bytes_for(static_cast<size_t>(bytes), 8)),
        view(KVView::contiguous(kv.data(), spec.dtype, Device{}, spec.num_layers, chunk,
                                spec.num_kv_heads, spec.head_dim)) {}
  // Bytes of the packed entry (file or Redis value): header, token ids, payload, trailer.
  size_t packed_bytes() const { return 224 + 4 * static_cast<size_t>(chunk) + kv.size() + 16; }
  StoreOptions options() const {
    StoreOptions o;
    o.chunk_tokens = chunk;
    o.capacity_bytes = 2 * static_cast<int64_t>(kv.size()) + 16 * kMiB;
    o.num_shards = 1;
    return o;
  }
  ModelSpec spec;
  int64_t chunk;
  std::vector<int64_t> tokens;
  std::vector<unsigned char> kv;
  KVView view;
};

std::string bench_dir(const std::string& name) {
  const char* base = std::getenv("KVBRIDGE_BENCH_DIR");
  const std::string dir = std::string(base && *base ? base : "/tmp") + "/kvbridge-bench-" +
                          name + "-" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

// ---------------------------------------------------------------------------------------------
// 3. Disk tier read vs a plain sequential read
// ---------------------------------------------------------------------------------------------

// Times KVStore::match of an entry only a lower tier holds: each iteration erases the memory
// copy with the timer paused. Afterwards the bytes read back are checked against the entry.
void time_lower_tier_match(benchmark::State& state, KVStore& store, const Entry& e,
                           const char* tier) {
  for (auto _ : state) {
    state.PauseTiming();
    store.erase(e.spec, e.tokens, "default", kvbridge::kMemoryTier);
    state.ResumeTiming();
    Match m = store.match(e.spec, e.tokens);
    if (m.tokens() != e.chunk) {
      state.SkipWithError((std::string("match did not read the entry from ") + tier).c_str());
      return;
    }
    benchmark::DoNotOptimize(m.tokens());
  }
  std::vector<unsigned char> check(e.kv.size());
  Match m = store.match(e.spec, e.tokens);
  if (m.tokens() != e.chunk) return state.SkipWithError("the entry is gone after the timing");
  m.copy_to(KVView::contiguous(check.data(), e.spec.dtype, Device{}, 1, e.chunk, 8, 128));
  if (check != e.kv) state.SkipWithError("bytes read back differ");
}

void BM_DiskTierRead(benchmark::State& state) {
  const int64_t bytes = state.range(0) * kMiB;
  Entry e(bytes);
  const std::string dir = bench_dir("disk");
  {
    StoreOptions o = e.options();
    o.disk.dir = dir;
    o.disk.fsync = false;
    KVStore store(o);
    if (store.put(e.spec, e.tokens, e.view) != e.chunk) {
      state.SkipWithError("put did not store the entry");
      return;
    }
    time_lower_tier_match(state, store, e, "disk");
    const kvbridge::StoreStats st = store.stats();
    state.counters["disk_hits"] = static_cast<double>(st.disk.hit_chunks);
  }
  std::filesystem::remove_all(dir);
  state.SetBytesProcessed(state.iterations() * bytes);
}

// arg 1: 0 plain read() of the whole file; 1 read in the disk tier's blocks, each hashed.
void PlainFileRead(benchmark::State& state, bool checksummed) {
  const int64_t bytes = state.range(0) * kMiB;
  Entry e(bytes);
  const std::string dir = bench_dir("plain");
  const std::string path = dir + "/plain.bin";
  {
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const std::vector<unsigned char> data = bytes_for(e.packed_bytes(), 9);
    if (fd < 0 || ::write(fd, data.data(), data.size()) != static_cast<ssize_t>(data.size())) {
      state.SkipWithError("cannot write the peer's file");
      return;
    }
    ::close(fd);
  }
  std::vector<unsigned char> buf(e.packed_bytes(), 0x5a);  // preallocated, touched
  const size_t block = checksummed ? size_t{256} << 10 : buf.size();
  kvbridge::detail::Xxh3Stream hash;
  for (auto _ : state) {
    const int fd = ::open(path.c_str(), O_RDONLY);
    size_t done = 0;
    hash.reset();
    while (done < buf.size()) {
      const ssize_t r = ::read(fd, buf.data() + done, std::min(block, buf.size() - done));
      if (r <= 0) break;
      if (checksummed) hash.update(buf.data() + done, static_cast<size_t>(r));
      done += static_cast<size_t>(r);
    }
    ::close(fd);
    if (checksummed) benchmark::DoNotOptimize(hash.digest());
    if (done != buf.size()) {
      state.SkipWithError("short read");
      break;
    }
    benchmark::DoNotOptimize(buf.data());
    benchmark::ClobberMemory();
  }
  std::filesystem::remove_all(dir);
  state.SetBytesProcessed(state.iterations() * bytes);
}

void BM_PlainFileRead(benchmark::State& state) { PlainFileRead(state, false); }
void BM_PlainFileReadChecksummed(benchmark::State& state) { PlainFileRead(state, true); }

// ---------------------------------------------------------------------------------------------
// 4. Redis tier vs raw hiredis
// ---------------------------------------------------------------------------------------------

const char* redis_url() {
  const char* u = std::getenv("KVBRIDGE_BENCH_REDIS_URL");
  return u && *u ? u : nullptr;
}

// host and port of redis://host:port
bool redis_host_port(std::string* host, int* port) {
  const char* u = redis_url();
  if (!u) return false;
  std::string s(u);
  if (s.rfind("redis://", 0) != 0) return false;
  s = s.substr(8);
  const size_t colon = s.rfind(':');
  *host = s.substr(0, colon);
  *port = colon == std::string::npos ? 6379 : std::atoi(s.c_str() + colon + 1);
  return true;
}

StoreOptions redis_options(const Entry& e, const std::string& prefix) {
  StoreOptions o = e.options();
  o.redis.url = redis_url();
  o.redis.key_prefix = prefix;
  o.redis.command_timeout_ms = 5000;
  o.redis.filter_refresh_ms = 3600 * 1000;  // no background refresh during the timing
  return o;
}

void BM_RedisTierGet(benchmark::State& state) {
  if (!redis_url()) return state.SkipWithError("KVBRIDGE_BENCH_REDIS_URL is not set");
  const int64_t bytes = state.range(0) * kMiB;
  Entry e(bytes);
  KVStore store(redis_options(e, "bench-get-" + std::to_string(::getpid())));
  if (store.put(e.spec, e.tokens, e.view) != e.chunk || store.stats().redis.writes != 1)
    return state.SkipWithError("put did not reach Redis");
  time_lower_tier_match(state, store, e, "Redis");
  store.clear(kvbridge::kAllTiers);
  state.SetBytesProcessed(state.iterations() * bytes);
}

void BM_RedisTierPut(benchmark::State& state) {
  if (!redis_url()) return state.SkipWithError("KVBRIDGE_BENCH_REDIS_URL is not set");
  const int64_t bytes = state.range(0) * kMiB;
  Entry e(bytes);
  KVStore store(redis_options(e, "bench-put-" + std::to_string(::getpid())));
  int64_t writes = 0;
  for (auto _ : state) {
    state.PauseTiming();
    store.erase(e.spec, e.tokens, "default", kvbridge::kMemoryTier);
    state.ResumeTiming();
    if (store.put(e.spec, e.tokens, e.view) != e.chunk) {
      state.SkipWithError("put failed");
      break;
    }
    ++writes;
  }
  if (store.stats().redis.writes != writes) state.SkipWithError("a put did not reach Redis");
  store.clear(kvbridge::kAllTiers);
  state.SetBytesProcessed(state.iterations() * bytes);
}

struct RawRedis {
  RawRedis() {
    std::string host;
    int port = 0;
    if (!redis_host_port(&host, &port)) return;
    ctx = redisConnect(host.c_str(), port);
    if (ctx && ctx->err) {
      redisFree(ctx);
      ctx = nullptr;
    }
  }
  ~RawRedis() {
    if (ctx) redisFree(ctx);
  }
  redisContext* ctx = nullptr;
};

void BM_RawHiredisGet(benchmark::State& state) {
  RawRedis r;
  if (!r.ctx) return state.SkipWithError("no Redis (KVBRIDGE_BENCH_REDIS_URL)");
  const int64_t bytes = state.range(0) * kMiB;
  Entry e(bytes);
  const std::vector<unsigned char> value = bytes_for(e.packed_bytes(), 10);
  const std::string key = "bench-raw-get-" + std::to_string(::getpid());
  freeReplyObject(redisCommand(r.ctx, "SET %b %b", key.data(), key.size(), value.data(),
                               value.size()));
  for (auto _ : state) {
    auto* reply = static_cast<redisReply*>(redisCommand(r.ctx, "GET %b", key.data(), key.size()));
    if (!reply || reply->type != REDIS_REPLY_STRING || reply->len != value.size()) {
      state.SkipWithError("GET failed");
      if (reply) freeReplyObject(reply);
      break;
    }
    benchmark::DoNotOptimize(reply->str);
    freeReplyObject(reply);
  }
  freeReplyObject(redisCommand(r.ctx, "DEL %b", key.data(), key.size()));
  state.SetBytesProcessed(state.iterations() * bytes);
}

void BM_RawHiredisSet(benchmark::State& state) {
  RawRedis r;
  if (!r.ctx) return state.SkipWithError("no Redis (KVBRIDGE_BENCH_REDIS_URL)");
  const int64_t bytes = state.range(0) * kMiB;
  Entry e(bytes);
  const std::vector<unsigned char> value = bytes_for(e.packed_bytes(), 11);
  const std::string key = "bench-raw-set-" + std::to_string(::getpid());
  for (auto _ : state) {
    auto* reply = static_cast<redisReply*>(redisCommand(
        r.ctx, "SET %b %b", key.data(), key.size(), value.data(), value.size()));
    if (!reply || reply->type != REDIS_REPLY_STATUS) {
      state.SkipWithError("SET failed");
      if (reply) freeReplyObject(reply);
      break;
    }
    freeReplyObject(reply);
  }
  freeReplyObject(redisCommand(r.ctx, "DEL %b", key.data(), key.size()));
  state.SetBytesProcessed(state.iterations() * bytes);
}

// ---------------------------------------------------------------------------------------------
// 5. Filter: Redis round trips saved on misses
// ---------------------------------------------------------------------------------------------

// arg 0: filter off / on. 1000 prompts are stored (by another store, as another process
// would); the timed lookups are prompts nobody stored, each a fresh one.
void BM_RedisMissLookup(benchmark::State& state) {
  if (!redis_url()) return state.SkipWithError("KVBRIDGE_BENCH_REDIS_URL is not set");
  const bool filter = state.range(0) != 0;
  ModelSpec spec = entry_spec();
  spec.num_kv_heads = 1;
  spec.head_dim = 8;
  StoreOptions o;
  o.chunk_tokens = 16;
  o.redis.url = redis_url();
  o.redis.key_prefix = "bench-filter-" + std::to_string(::getpid());
  o.redis.filter = filter;
  o.redis.filter_refresh_ms = 3600 * 1000;
  const std::vector<unsigned char> kv = bytes_for(static_cast<size_t>(spec.kv_bytes_per_token() * 64), 3);
  const KVView view = KVView::contiguous(const_cast<unsigned char*>(kv.data()), spec.dtype,
                                         Device{}, 1, 64, 1, 8);
  {
    KVStore writer(o);
    for (uint64_t i = 0; i < 1000; ++i) writer.put(spec, tokens_for(64, 100000 + i), view);
  }
  KVStore reader(o);
  std::vector<std::vector<int64_t>> misses;
  for (uint64_t i = 0; i < 4096; ++i) misses.push_back(tokens_for(64, 900000 + i));
  const kvbridge::StoreStats before = reader.stats();
  size_t i = 0;
  int64_t hits = 0;
  for (auto _ : state) {
    Match m = reader.match(spec, misses[i++ % misses.size()]);
    hits += m.tokens();
  }
  const kvbridge::StoreStats after = reader.stats();
  if (hits) state.SkipWithError("a never-stored prefix was a hit");
  const double n = static_cast<double>(state.iterations());
  state.counters["round_trips_per_lookup"] =
      static_cast<double>(after.remote.round_trips - before.remote.round_trips) / n;
  state.counters["filter_negatives_per_lookup"] =
      static_cast<double>(after.remote.filter_negatives - before.remote.filter_negatives) / n;
  state.counters["filter_active"] = after.remote.filter_active ? 1 : 0;
  reader.clear(kvbridge::kAllTiers);
}

void SizeArgs(benchmark::internal::Benchmark* b) {
  b->ArgName("MiB");
  for (int64_t mib : {1, 4, 16, 64}) b->Arg(mib);
  b->UseRealTime();
}

BENCHMARK(BM_DiskTierRead)->Apply(SizeArgs);
BENCHMARK(BM_PlainFileRead)->Apply(SizeArgs);
BENCHMARK(BM_PlainFileReadChecksummed)->Apply(SizeArgs);
BENCHMARK(BM_RedisTierGet)->Apply(SizeArgs);
BENCHMARK(BM_RawHiredisGet)->Apply(SizeArgs);
BENCHMARK(BM_RedisTierPut)->Apply(SizeArgs);
BENCHMARK(BM_RawHiredisSet)->Apply(SizeArgs);
BENCHMARK(BM_RedisMissLookup)->ArgName("filter")->Arg(0)->Arg(1)->UseRealTime();

}  // namespace
