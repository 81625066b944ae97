#include "src/store/redis_tier.h"

// sds.h (the output buffer of a context, written by hand in store()) has no C++ guard, and
// hiredis.h includes it, so it comes first.
extern "C" {
#include <hiredis/sds.h>
}
#include <hiredis/hiredis.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <random>
#include <thread>

#include "kvbridge/error.h"
#include "src/core/xxh3.h"

namespace kvbridge::detail {
namespace {

using Clock = std::chrono::steady_clock;

int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

timeval to_timeval(int ms) {
  timeval tv;
  tv.tv_sec = ms / 1000;
  tv.tv_usec = (ms % 1000) * 1000;
  return tv;
}

// The shared filter's value: an 8-byte header, then 2^log2_bits bits (Redis bit order: bit 0 is
// the most significant bit of the first byte). Header: "KVBF", version 1, probes k, log2 of the
// bit count, ready flag (1 once every key present when it was created has been added).
constexpr char kFilterMagic[4] = {'K', 'V', 'B', 'F'};
constexpr size_t kFilterHeader = 8;
constexpr int kFilterMinLog2 = 10;
constexpr int kFilterMaxLog2 = 31;  // Redis bit offsets stay below 2^32
constexpr double kFilterMaxFill = 0.5;  // above this the filter is rebuilt from the keys

// Adds the bits of each (h1, h2) pair in ARGV when the filter exists (never creates it, so a
// missing filter stays missing until a rebuild that scans every key).
// UNLINKs the KEYS whose value bytes [ARGV[1], ARGV[2]] equal ARGV[3] (an entry's adapter
// fingerprint); returns how many.
constexpr char kUnlinkAdapterScript[] =
    "local n = 0 "
    "for _, k in ipairs(KEYS) do "
    "  if redis.call('GETRANGE', k, ARGV[1], ARGV[2]) == ARGV[3] then "
    "    redis.call('UNLINK', k) n = n + 1 "
    "  end "
    "end "
    "return n";
constexpr char kAddScript[] =
    "local h = redis.call('GETRANGE', KEYS[1], 0, 7)\n"
    "if #h < 8 or string.sub(h, 1, 4) ~= 'KVBF' then return 0 end\n"
    "local k = string.byte(h, 6)\n"
    "local m = 2 ^ string.byte(h, 7)\n"
    "for i = 1, #ARGV, 2 do\n"
    "  local h1 = tonumber(ARGV[i])\n"
    "  local h2 = tonumber(ARGV[i + 1])\n"
    "  for j = 0, k - 1 do\n"
    "    redis.call('SETBIT', KEYS[1], 64 + (h1 + j * h2) % m, 1)\n"
    "  end\n"
    "end\n"
    "return 1\n";

uint64_t probe_h1(const Hash128& key) { return key.low & 0xffffffffu; }
uint64_t probe_h2(const Hash128& key) { return key.high & 0xffffffffu; }

struct FilterCopy {
  int probes = 0;
  int log2_bits = 0;
  std::unique_ptr<std::atomic<uint8_t>[]> bytes;  // header + bits; atomics: local puts add
  size_t size = 0;
  double fill = 0;

  uint64_t offset(uint64_t h1, uint64_t h2, int j) const {
    const uint64_t mask = (uint64_t{1} << log2_bits) - 1;
    return 64 + ((h1 + static_cast<uint64_t>(j) * h2) & mask);
  }
  bool test(const Hash128& key) const {
    for (int j = 0; j < probes; ++j) {
      const uint64_t off = offset(probe_h1(key), probe_h2(key), j);
      if (!(bytes[off >> 3].load(std::memory_order_relaxed) & (0x80u >> (off & 7)))) return false;
    }
    return true;
  }
  void add(const Hash128& key) {
    for (int j = 0; j < probes; ++j) {
      const uint64_t off = offset(probe_h1(key), probe_h2(key), j);
      bytes[off >> 3].fetch_or(static_cast<uint8_t>(0x80u >> (off & 7)),
                               std::memory_order_relaxed);
    }
  }
};

enum class FilterState { kReady, kMissing, kBuilding, kInvalid };

// Parses a fetched filter value.
FilterState parse_filter(const char* data, size_t size, std::shared_ptr<FilterCopy>* out) {
  if (!data) return FilterState::kMissing;
  if (size < kFilterHeader || std::memcmp(data, kFilterMagic, 4) != 0 || data[4] != 1)
    return FilterState::kInvalid;
  const int k = static_cast<unsigned char>(data[5]);
  const int b = static_cast<unsigned char>(data[6]);
  if (k < 1 || k > 16 || b < kFilterMinLog2 || b > kFilterMaxLog2) return FilterState::kInvalid;
  // SETBIT beyond the current length grows a string, so a filter created at full size has it.
  if (size != kFilterHeader + (size_t{1} << b) / 8) return FilterState::kInvalid;
  if (data[7] != 1) return FilterState::kBuilding;
  auto f = std::make_shared<FilterCopy>();
  f->probes = k;
  f->log2_bits = b;
  f->size = size;
  f->bytes.reset(new std::atomic<uint8_t>[size]);
  size_t ones = 0;
  for (size_t i = 0; i < size; ++i) {
    const auto v = static_cast<uint8_t>(data[i]);
    f->bytes[i].store(v, std::memory_order_relaxed);
    if (i >= kFilterHeader) ones += static_cast<size_t>(__builtin_popcount(v));
  }
  f->fill = static_cast<double>(ones) / static_cast<double>(size_t{1} << b);
  *out = std::move(f);
  return FilterState::kReady;
}

struct ReplyDeleter {
  void operator()(redisReply* r) const {
    if (r) freeReplyObject(r);
  }
};
using Reply = std::unique_ptr<redisReply, ReplyDeleter>;

// Percent-encodes every byte outside [A-Za-z0-9._-] (the key schema's one encoding).
void percent_encode_into(std::string* out, std::string_view s) {
  static const char* hex = "0123456789ABCDEF";
  for (unsigned char ch : s) {
    const bool plain = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') ||
                       (ch >= '0' && ch <= '9') || ch == '.' || ch == '_' || ch == '-';
    if (plain) {
      out->push_back(static_cast<char>(ch));
    } else {
      out->push_back('%');
      out->push_back(hex[ch >> 4]);
      out->push_back(hex[ch & 15]);
    }
  }
}

// A SCAN MATCH pattern matching exactly the key text `literal` (glob metacharacters escaped).
std::string glob_literal(std::string_view literal) {
  std::string g;
  for (char ch : literal) {
    const bool meta = ch == '*' || ch == '?' || ch == '[' || ch == ']' || ch == '\\' || ch == '^';
    if (meta) g.push_back('\\');
    g.push_back(ch);
  }
  return g;
}

bool parse_hex_key(std::string_view s, Hash128* out) {
  if (s.size() != 32) return false;
  uint64_t parts[2] = {0, 0};
  for (size_t i = 0; i < 32; ++i) {
    const char c = s[i];
    uint64_t d;
    if (c >= '0' && c <= '9') {
      d = static_cast<uint64_t>(c - '0');
    } else if (c >= 'a' && c <= 'f') {
      d = static_cast<uint64_t>(c - 'a' + 10);
    } else {
      return false;
    }
    parts[i / 16] = (parts[i / 16] << 4) | d;
  }
  out->high = parts[0];
  out->low = parts[1];
  return true;
}

// Values of a fetch are handed to the consumer straight from hiredis's read buffer: a reader
// callback in place of hiredis's string constructor, active while a fetch on this thread
// parses its reply. The consumed value becomes a nil element, so no reply object copies it.
thread_local const RedisTier::ValueConsumer* t_consumer = nullptr;
redisReplyObjectFunctions g_capture_functions;
const redisReplyObjectFunctions* g_default_functions = nullptr;
std::once_flag g_capture_once;

void* capture_string(const redisReadTask* task, char* str, size_t len) {
  if (t_consumer && task->type == REDIS_REPLY_STRING && task->parent) {
    try {
      (*t_consumer)(static_cast<size_t>(task->idx), reinterpret_cast<const unsigned char*>(str),
                    len);
    } catch (...) {
    }
    return g_default_functions->createNil(task);
  }
  return g_default_functions->createString(task, str, len);
}

void install_capture(redisContext* c) {
  std::call_once(g_capture_once, [c] {
    g_default_functions = c->reader->fn;
    g_capture_functions = *c->reader->fn;
    g_capture_functions.createString = capture_string;
  });
  c->reader->fn = &g_capture_functions;
}

}  // namespace

void RemoteCounters::record_latency(int64_t ns) {
  round_trips.fetch_add(1, std::memory_order_relaxed);
  latency_ns_sum.fetch_add(ns, std::memory_order_relaxed);
  const double s = static_cast<double>(ns) * 1e-9;
  for (size_t i = 0; i < RemoteStats::kLatencyBounds.size(); ++i)
    if (s <= RemoteStats::kLatencyBounds[i])
      latency_buckets[i].fetch_add(1, std::memory_order_relaxed);
  latency_buckets[RemoteStats::kLatencyBuckets - 1].fetch_add(1, std::memory_order_relaxed);
}

void RemoteCounters::fill(RemoteStats* s) const {
  auto get = [](const std::atomic<int64_t>& a) { return a.load(std::memory_order_relaxed); };
  KVBRIDGE_REMOTE_COUNTERS(KVBRIDGE_STATS_LOAD_)
  s->latency_seconds_sum = static_cast<double>(get(latency_ns_sum)) * 1e-9;
  for (size_t i = 0; i < latency_buckets.size(); ++i) s->latency_buckets[i] = get(latency_buckets[i]);
}

LoadResult load_value(const unsigned char* data, size_t size, const ExpectedEntry& want,
                      char* payload, LoadedMeta* meta, TierCounters* counters, bool* drop) {
  *drop = false;
  // The value is whole in memory: a block is read by copying it (verify_entry hashes each
  // block right after the copy, while it is still in cache).
  const size_t prefix = entry_prefix_bytes(want.chunk);
  auto copy = [&](char* dst, size_t off, size_t len, unsigned char* trailer) {
    std::memcpy(dst, data + prefix + off, len);
    if (trailer) std::memcpy(trailer, data + prefix + off + len, kEntryTrailerBytes);
    return true;
  };
  EntryHeader h;
  const EntryCheck r = verify_entry(data, size, want, copy, payload, &h);
  const LoadResult result = count_check(r, size, *counters);
  *drop = r == EntryCheck::kCorrupt || r == EntryCheck::kExpired;
  if (result == LoadResult::kHit) *meta = LoadedMeta::of(h);
  return result;
}

struct RedisTier::Impl {
  Impl(const StoreOptions& o, TierCounters* c, RemoteCounters* r)
      : options(o), counters(c), remote(r), backoff_ms(o.redis_retry_min_ms) {}

  StoreOptions options;
  TierCounters* counters;
  RemoteCounters* remote;
  std::string host = "127.0.0.1";
  int port = 6379;
  int db = 0;
  std::string user, password;
  std::string key_prefix;  // "<prefix>:v1:"
  std::string filter_key, lock_key;

  // Connection pool.
  std::mutex pool_mu;
  std::condition_variable pool_cv;
  std::vector<redisContext*> idle;
  int open = 0;
  std::atomic<bool> down{false};
  std::atomic<int64_t> epoch{0};  // RedisTier::epoch()
  std::atomic<int64_t> retry_at_ns{0};
  int backoff_ms;  // guarded by pool_mu
  std::atomic<bool> probing{false};

  // Filter.
  std::shared_ptr<FilterCopy> filter;  // read and replaced with std::atomic_load / _store
  std::mutex recent_mu;
  bool refreshing = false;
  std::vector<Hash128> recent;  // keys put while a refresh is in flight

  // Background thread.
  std::thread worker;
  std::mutex worker_mu;
  std::condition_variable worker_cv;
  bool stop = false;

  // --- connections ---------------------------------------------------------------------------

  redisContext* connect() {
    redisContext* c = redisConnectWithTimeout(host.c_str(), port,
                                              to_timeval(options.redis_connect_timeout_ms));
    if (!c) return nullptr;
    if (c->err) {
      redisFree(c);
      return nullptr;
    }
    // Setup commands get the connect timeout: a server that accepts connections but does not
    // answer (stopped, overloaded) counts as unreachable.
    redisSetTimeout(c, to_timeval(options.redis_connect_timeout_ms));
    auto ok = [&](Reply r, bool status_ok) {
      return r && !c->err && r->type != REDIS_REPLY_ERROR &&
             (!status_ok || r->type == REDIS_REPLY_STATUS);
    };
    bool good = true;
    if (!password.empty()) {
      if (user.empty()) {
        good = ok(Reply(static_cast<redisReply*>(
                      redisCommand(c, "AUTH %b", password.data(), password.size()))),
                  true);
      } else {
        good = ok(Reply(static_cast<redisReply*>(redisCommand(
                      c, "AUTH %b %b", user.data(), user.size(), password.data(),
                      password.size()))),
                  true);
      }
    }
    if (good && db != 0) {
      good = ok(Reply(static_cast<redisReply*>(redisCommand(c, "SELECT %d", db))), true);
    }
    if (good) good = ok(Reply(static_cast<redisReply*>(redisCommand(c, "PING"))), true);
    if (!good) {
      redisFree(c);
      return nullptr;
    }
    redisSetTimeout(c, to_timeval(options.redis_command_timeout_ms));
    redisEnableKeepAlive(c);
    install_capture(c);
    return c;
  }

  void mark_down() {
    std::vector<redisContext*> stale;
    {
      std::lock_guard<std::mutex> lock(pool_mu);
      down.store(true);
      epoch.fetch_add(1);  // what was written before may be gone (a restarted server)
      stale.swap(idle);  // probably dead too (a restarted server)
      open -= static_cast<int>(stale.size());
      retry_at_ns.store(steady_ns() + int64_t{backoff_ms} * 1000000);
      backoff_ms = std::min(backoff_ms * 2, options.redis_retry_max_ms);
    }
    pool_cv.notify_all();
    for (redisContext* c : stale) redisFree(c);
  }

  // A connection, or nullptr when the tier is down (then `background` callers are not counted
  // as skipped operations).
  redisContext* acquire(bool background) {
    if (down.load()) {
      bool expected = false;
      if (steady_ns() < retry_at_ns.load() || !probing.compare_exchange_strong(expected, true)) {
        if (!background) TierCounters::add(remote->skipped);
        return nullptr;
      }
      redisContext* c = connect();
      if (!c) {
        mark_down();
        probing.store(false);
        if (!background) {
          TierCounters::add(counters->errors);
        }
        return nullptr;
      }
      {
        std::lock_guard<std::mutex> lock(pool_mu);
        ++open;
        backoff_ms = options.redis_retry_min_ms;
        down.store(false);
      }
      probing.store(false);
      TierCounters::add(remote->reconnects);
      return c;
    }
    std::unique_lock<std::mutex> lock(pool_mu);
    const auto deadline =
        Clock::now() + std::chrono::milliseconds(options.redis_command_timeout_ms);
    while (idle.empty() && open >= options.redis_pool_size) {
      if (pool_cv.wait_until(lock, deadline) == std::cv_status::timeout || down.load()) {
        if (!background) TierCounters::add(remote->skipped);
        return nullptr;
      }
    }
    if (!idle.empty()) {
      redisContext* c = idle.back();
      idle.pop_back();
      return c;
    }
    ++open;
    lock.unlock();
    redisContext* c = connect();
    if (!c) {
      {
        std::lock_guard<std::mutex> relock(pool_mu);
        --open;
      }
      TierCounters::add(counters->errors);
      mark_down();
    }
    return c;
  }

  // Returns a connection; a broken one is closed and marks the tier down.
  void release(redisContext* c) {
    if (c->err) {
      redisFree(c);
      {
        std::lock_guard<std::mutex> lock(pool_mu);
        --open;
      }
      TierCounters::add(counters->errors);
      mark_down();
      return;
    }
    {
      std::lock_guard<std::mutex> lock(pool_mu);
      idle.push_back(c);
    }
    pool_cv.notify_one();
  }

  // Reads `n` replies of the commands appended to c, timing the round trip. Empty on a
  // connection failure (c->err set).
  std::vector<Reply> replies(redisContext* c, size_t n, int64_t started_ns) {
    std::vector<Reply> out;
    out.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      void* r = nullptr;
      if (redisGetReply(c, &r) != REDIS_OK || !r) {
        if (!c->err) c->err = REDIS_ERR_IO;  // no reply: treat the connection as broken
        return {};
      }
      out.emplace_back(static_cast<redisReply*>(r));
    }
    remote->record_latency(steady_ns() - started_ns);
    return out;
  }

  // One command, argv form. nullptr on failure (counted; a broken connection marks the tier
  // down).
  Reply command(const std::vector<std::string>& args, bool background = false) {
    redisContext* c = acquire(background);
    if (!c) return nullptr;
    std::vector<const char*> argv;
    std::vector<size_t> lens;
    for (const std::string& a : args) {
      argv.push_back(a.data());
      lens.push_back(a.size());
    }
    const int64_t t0 = steady_ns();
    redisAppendCommandArgv(c, static_cast<int>(argv.size()), argv.data(), lens.data());
    std::vector<Reply> r = replies(c, 1, t0);
    release(c);
    if (r.empty()) return nullptr;
    if (r[0]->type == REDIS_REPLY_ERROR) TierCounters::add(counters->errors);
    return std::move(r[0]);
  }

  // --- filter --------------------------------------------------------------------------------

  std::shared_ptr<FilterCopy> current_filter() const { return std::atomic_load(&filter); }

  void note_put(const Hash128& key) {
    if (auto f = current_filter()) f->add(key);
    std::lock_guard<std::mutex> lock(recent_mu);
    if (refreshing) recent.push_back(key);
  }

  std::string filter_header(int probes, int log2_bits, bool ready) const {
    std::string h(kFilterMagic, 4);
    h.push_back(1);
    h.push_back(static_cast<char>(probes));
    h.push_back(static_cast<char>(log2_bits));
    h.push_back(ready ? 1 : 0);
    return h;
  }

  // Fetches the shared filter; installs it when ready, else drops the local copy (filtering
  // off) and rebuilds it when it is missing, invalid or too full.
  void refresh(bool background) {
    if (!options.redis_filter) return;
    {
      std::lock_guard<std::mutex> lock(recent_mu);
      refreshing = true;
      recent.clear();
    }
    Reply r = command({"GET", filter_key}, background);
    std::shared_ptr<FilterCopy> fresh;
    FilterState state = FilterState::kInvalid;
    const bool answered = r && r->type != REDIS_REPLY_ERROR;
    if (answered) {
      state = parse_filter(r->type == REDIS_REPLY_STRING ? r->str : nullptr,
                           r->type == REDIS_REPLY_STRING ? r->len : 0, &fresh);
    }
    {
      std::lock_guard<std::mutex> lock(recent_mu);
      refreshing = false;
      if (fresh) {
        for (const Hash128& k : recent) fresh->add(k);
      }
      recent.clear();
    }
    if (!answered) return;  // unreachable: keep the copy we have (lookups skip Redis anyway)
    TierCounters::add(remote->filter_refreshes);
    std::atomic_store(&filter, state == FilterState::kReady ? fresh : nullptr);
    if (state != FilterState::kReady || fresh->fill > kFilterMaxFill) rebuild(background);
  }

  // Rebuilds the shared filter from the keys, under a lock key so that one store does it.
  void rebuild(bool background) {
    const std::string token = std::to_string(steady_ns()) + "." + std::to_string(::getpid());
    Reply got = command({"SET", lock_key, token, "NX", "PX", "60000"}, background);
    if (!got || got->type != REDIS_REPLY_STATUS) return;  // somebody else holds it
    auto unlock = [&] { command({"DEL", lock_key}, background); };
    Reply cur = command({"GET", filter_key}, background);
    if (!cur) return unlock();
    std::shared_ptr<FilterCopy> copy;
    const FilterState state =
        parse_filter(cur->type == REDIS_REPLY_STRING ? cur->str : nullptr,
                     cur->type == REDIS_REPLY_STRING ? cur->len : 0, &copy);
    if (state == FilterState::kReady && copy->fill <= kFilterMaxFill) return unlock();
    if (state == FilterState::kInvalid || state == FilterState::kReady) {
      if (!command({"DEL", filter_key}, background)) return unlock();
    }
    // Create it empty and not ready (keep a half-built one: its bits are all still valid).
    int log2_bits = kFilterMinLog2;
    while (log2_bits < kFilterMaxLog2 && (int64_t{1} << log2_bits) < options.redis_filter_bits)
      ++log2_bits;
    std::string value = filter_header(options.redis_filter_hashes, log2_bits, false);
    value.resize(kFilterHeader + (size_t{1} << log2_bits) / 8, '\0');
    if (!command({"SET", filter_key, value, "NX"}, background)) return unlock();
    // From here on every put adds its bits; the scan adds the keys that existed before.
    const std::string pattern = glob_prefix() + "*";
    std::string cursor = "0";
    do {
      Reply page = command({"SCAN", cursor, "MATCH", pattern, "COUNT", "1000"}, background);
      if (!page || page->type != REDIS_REPLY_ARRAY || page->elements != 2) return unlock();
      cursor.assign(page->element[0]->str, page->element[0]->len);
      std::vector<std::string> args = {"EVAL", kAddScript, "1", filter_key};
      const redisReply* keys = page->element[1];
      for (size_t i = 0; i < keys->elements; ++i) {
        Hash128 h;
        const std::string_view k(keys->element[i]->str, keys->element[i]->len);
        const size_t colon = k.rfind(':');
        if (colon == std::string_view::npos || !parse_hex_key(k.substr(colon + 1), &h)) continue;
        args.push_back(std::to_string(probe_h1(h)));
        args.push_back(std::to_string(probe_h2(h)));
      }
      if (args.size() > 4) {
        Reply added = command(args, background);
        if (!added || added->type == REDIS_REPLY_ERROR) return unlock();
      }
      command({"PEXPIRE", lock_key, "60000"}, background);
    } while (cursor != "0");
    Reply ready = command({"SETRANGE", filter_key, "7", std::string(1, '\1')}, background);
    unlock();
    if (ready && ready->type == REDIS_REPLY_INTEGER) TierCounters::add(remote->filter_rebuilds);
  }

  // Keys are written with the percent-encoded prefix, so SCAN must match that form.
  std::string glob_prefix() const { return glob_literal(key_prefix); }

  void run_worker() {
    std::unique_lock<std::mutex> lock(worker_mu);
    while (!stop) {
      worker_cv.wait_for(lock, std::chrono::milliseconds(options.redis_filter_refresh_ms),
                         [&] { return stop; });
      if (stop) break;
      lock.unlock();
      refresh(/*background=*/true);
      lock.lock();
    }
  }

  void parse_url(const std::string& url);

  // SCAN + UNLINK of every key matching `pattern` (and, when `adapter` is set, whose value's
  // provenance names that adapter: checked by a script on the server, one per SCAN page).
  // Returns the keys removed.
  int64_t delete_matching(const std::string& pattern, bool* complete,
                          const Fingerprint* adapter = nullptr) {
    int64_t removed = 0;
    std::string cursor = "0";
    do {
      Reply page = command({"SCAN", cursor, "MATCH", pattern, "COUNT", "1000"});
      if (!page || page->type != REDIS_REPLY_ARRAY || page->elements != 2) {
        *complete = false;
        return removed;
      }
      cursor.assign(page->element[0]->str, page->element[0]->len);
      const redisReply* keys = page->element[1];
      if (keys->elements == 0) continue;
      std::vector<std::string> args = {"UNLINK"};
      if (adapter) {
        args = {"EVAL", kUnlinkAdapterScript, std::to_string(keys->elements)};
      }
      for (size_t i = 0; i < keys->elements; ++i)
        args.emplace_back(keys->element[i]->str, keys->element[i]->len);
      if (adapter) {
        args.push_back(std::to_string(kEntryAdapterOffset));
        args.push_back(std::to_string(kEntryAdapterOffset + adapter->size() - 1));
        args.push_back(fingerprint_string(*adapter));
      }
      Reply r = command(args);
      if (!r || r->type != REDIS_REPLY_INTEGER) {
        *complete = false;
        return removed;
      }
      removed += r->integer;
    } while (cursor != "0");
    return removed;
  }
};

RedisTier::RedisTier(const StoreOptions& options, TierCounters* counters,
                     RemoteCounters* remote)
    : impl_(std::make_unique<Impl>(options, counters, remote)) {
  Impl& m = *impl_;
  KVB_CHECK(options.redis_connect_timeout_ms > 0 && options.redis_command_timeout_ms > 0,
            "redis timeouts must be > 0 ms");
  KVB_CHECK(options.redis_pool_size >= 1, "redis_pool_size must be >= 1");
  KVB_CHECK(options.redis_retry_min_ms > 0 &&
                options.redis_retry_max_ms >= options.redis_retry_min_ms,
            "redis retry: need 0 < redis_retry_min_ms <= redis_retry_max_ms");
  KVB_CHECK(options.redis_batch_bytes > 0, "redis_batch_bytes must be > 0");
  KVB_CHECK(!options.redis_key_prefix.empty(), "redis_key_prefix must not be empty");
  KVB_CHECK(options.redis_filter_bits >= (int64_t{1} << kFilterMinLog2) &&
                options.redis_filter_bits <= (int64_t{1} << kFilterMaxLog2) &&
                (options.redis_filter_bits & (options.redis_filter_bits - 1)) == 0,
            "redis_filter_bits must be a power of two in [2^10, 2^31], got "
                << options.redis_filter_bits);
  KVB_CHECK(options.redis_filter_hashes >= 1 && options.redis_filter_hashes <= 16,
            "redis_filter_hashes must be in [1, 16], got " << options.redis_filter_hashes);
  KVB_CHECK(options.redis_filter_refresh_ms > 0, "redis_filter_refresh_ms must be > 0");
  m.parse_url(options.redis_url);
  std::string p;
  percent_encode_into(&p, options.redis_key_prefix);
  m.key_prefix = p + ":v1:";
  m.filter_key = m.key_prefix + "filter";
  m.lock_key = m.key_prefix + "filter-lock";
  // First contact in this thread (bounded by the timeouts), so the filter is in use at once.
  m.refresh(/*background=*/true);
  if (!m.current_filter() && options.redis_filter && !m.down.load()) m.refresh(true);
  m.worker = std::thread([this] { impl_->run_worker(); });
}

RedisTier::~RedisTier() {
  Impl& m = *impl_;
  {
    std::lock_guard<std::mutex> lock(m.worker_mu);
    m.stop = true;
  }
  m.worker_cv.notify_all();
  m.worker.join();
  for (redisContext* c : m.idle) redisFree(c);
}

std::string RedisTier::key_for(std::string_view ns, const Fingerprint& fp,
                               const Hash128& key) const {
  std::string k = impl_->key_prefix;
  percent_encode_into(&k, ns);
  k.push_back(':');
  k.append(fp.data(), fp.size());
  k.push_back(':');
  k += key.hex();
  return k;
}

bool RedisTier::may_contain(const Hash128& key) const {
  const auto f = impl_->current_filter();
  return !f || f->test(key);
}

int64_t RedisTier::epoch() const { return impl_->epoch.load(); }

bool RedisTier::filter_active() const { return impl_->current_filter() != nullptr; }

void RedisTier::refresh_filter_now() { impl_->refresh(false); }

bool RedisTier::fetch(const std::vector<std::string>& keys, const ValueConsumer& consume) {
  Impl& m = *impl_;
  std::vector<std::string> args;
  args.reserve(keys.size() + 1);
  args.emplace_back("MGET");
  args.insert(args.end(), keys.begin(), keys.end());
  struct Capture {
    explicit Capture(const ValueConsumer* c) { t_consumer = c; }
    ~Capture() { t_consumer = nullptr; }
  } capture(&consume);
  Reply r = m.command(args);
  return r && r->type == REDIS_REPLY_ARRAY && r->elements == keys.size();
}

bool RedisTier::store(const std::vector<Write>& writes, int64_t ttl_ms) {
  Impl& m = *impl_;
  if (writes.empty()) return true;
  redisContext* c = m.acquire(false);
  if (!c) {
    TierCounters::add(m.counters->write_failures, static_cast<int64_t>(writes.size()));
    return false;
  }
  // MULTI / EXEC: the values and their filter bits land together or not at all (a dropped
  // connection discards the queued transaction), so no value is ever stored without its bits.
  const int64_t t0 = steady_ns();
  redisAppendCommand(c, "MULTI");
  const std::string ttl = std::to_string(ttl_ms);
  size_t total_bytes = 0;
  for (const Write& w : writes)
    total_bytes += w.prefix_bytes + w.payload_bytes + kEntryTrailerBytes;
  // Each SET is written in RESP by hand straight into the connection's output buffer (an sds
  // string, grown once), so a value's three parts are copied once, as a plain SET copies its
  // value once.
  bool appended = true;
  auto grow = [&](sds s) {
    if (s) {
      c->obuf = s;
    } else {
      appended = false;  // the old buffer stays valid and owned by the context
    }
  };
  grow(sdsMakeRoomFor(c->obuf, total_bytes + 256 * writes.size()));
  auto append = [&](const void* data, size_t n) {
    if (appended) grow(sdscatlen(c->obuf, data, n));
  };
  auto append_str = [&](const std::string& str) { append(str.data(), str.size()); };
  for (const Write& w : writes) {
    unsigned char trailer[kEntryTrailerBytes];
    encode_trailer(w.checksum, trailer);
    const size_t vlen = w.prefix_bytes + w.payload_bytes + sizeof trailer;
    append_str(std::string(ttl_ms > 0 ? "*5\r\n" : "*3\r\n") + "$3\r\nSET\r\n$" +
               std::to_string(w.key.size()) + "\r\n" + w.key + "\r\n$" + std::to_string(vlen) +
               "\r\n");
    append(w.prefix, w.prefix_bytes);
    append(w.payload, w.payload_bytes);
    append(trailer, sizeof trailer);
    append_str("\r\n");
    if (ttl_ms > 0) append_str("$2\r\nPX\r\n$" + std::to_string(ttl.size()) + "\r\n" + ttl + "\r\n");
  }
  if (!appended) {  // out of memory: this connection's buffer is unusable
    c->err = REDIS_ERR_OOM;
    m.release(c);
    TierCounters::add(m.counters->write_failures, static_cast<int64_t>(writes.size()));
    return false;
  }
  std::vector<std::string> eval = {"EVAL", kAddScript, "1", m.filter_key};
  for (const Write& w : writes) {
    eval.push_back(std::to_string(probe_h1(w.hash)));
    eval.push_back(std::to_string(probe_h2(w.hash)));
  }
  std::vector<const char*> argv;
  std::vector<size_t> lens;
  for (const std::string& a : eval) {
    argv.push_back(a.data());
    lens.push_back(a.size());
  }
  redisAppendCommandArgv(c, static_cast<int>(argv.size()), argv.data(), lens.data());
  redisAppendCommand(c, "EXEC");
  std::vector<Reply> r = m.replies(c, writes.size() + 3, t0);
  m.release(c);
  bool ok = !r.empty() && r.back()->type == REDIS_REPLY_ARRAY &&
            r.back()->elements == writes.size() + 1;
  if (ok) {
    const redisReply* exec = r.back().get();
    for (size_t i = 0; i < writes.size(); ++i)
      ok = ok && exec->element[i]->type == REDIS_REPLY_STATUS;
    if (exec->element[writes.size()]->type == REDIS_REPLY_ERROR) {
      // Values stored without their bits: drop the filter so that it is rebuilt from the keys.
      TierCounters::add(m.counters->errors);
      m.command({"DEL", m.filter_key});
    }
  } else if (!r.empty()) {
    TierCounters::add(m.counters->errors);  // the server refused (e.g. out of memory)
  }
  if (!ok) {
    TierCounters::add(m.counters->write_failures, static_cast<int64_t>(writes.size()));
    return false;
  }
  for (const Write& w : writes) m.note_put(w.hash);
  TierCounters::add(m.counters->writes, static_cast<int64_t>(writes.size()));
  TierCounters::add(m.counters->bytes_written, static_cast<int64_t>(total_bytes));
  return true;
}

bool RedisTier::remove(const std::vector<std::string>& keys) {
  std::vector<std::string> args = {"UNLINK"};
  args.insert(args.end(), keys.begin(), keys.end());
  Reply r = impl_->command(args);
  return r && r->type == REDIS_REPLY_INTEGER;
}

int64_t RedisTier::invalidate(const Fingerprint& fp, bool* complete) {
  Impl& m = *impl_;
  *complete = true;
  // Namespaces are percent-encoded, so no ':' of theirs can fake the fingerprint component.
  return m.delete_matching(m.glob_prefix() + "*:" + fingerprint_string(fp) + ":*", complete);
}

int64_t RedisTier::invalidate_adapter(const Fingerprint& fp, const Fingerprint& adapter,
                                      bool* complete) {
  Impl& m = *impl_;
  *complete = true;
  return m.delete_matching(m.glob_prefix() + "*:" + fingerprint_string(fp) + ":*", complete,
                           &adapter);
}

int64_t RedisTier::clear() {
  bool complete = true;
  return impl_->delete_matching(impl_->glob_prefix() + "*", &complete);
}

void RedisTier::Impl::parse_url(const std::string& url) {
  Impl* m = this;
  const std::string scheme = "redis://";
  KVB_CHECK(url.compare(0, scheme.size(), scheme) == 0,
            "redis_url: expected redis://[[user]:password@]host[:port][/db], got '" << url
                                                                                    << "'");
  std::string rest = url.substr(scheme.size());
  const size_t at = rest.rfind('@');
  if (at != std::string::npos) {
    const std::string auth = rest.substr(0, at);
    rest = rest.substr(at + 1);
    const size_t colon = auth.find(':');
    KVB_CHECK(colon != std::string::npos,
              "redis_url: credentials must be [user]:password, got '" << auth << "'");
    m->user = auth.substr(0, colon);
    m->password = auth.substr(colon + 1);
  }
  const size_t slash = rest.find('/');
  if (slash != std::string::npos) {
    const std::string db = rest.substr(slash + 1);
    rest = rest.substr(0, slash);
    if (!db.empty()) {
      KVB_CHECK(db.find_first_not_of("0123456789") == std::string::npos && db.size() < 6,
                "redis_url: bad database number '" << db << "'");
      m->db = std::stoi(db);
    }
  }
  const size_t colon = rest.rfind(':');
  if (colon != std::string::npos && rest.find(']') == std::string::npos) {
    const std::string port = rest.substr(colon + 1);
    KVB_CHECK(!port.empty() && port.find_first_not_of("0123456789") == std::string::npos &&
                  port.size() <= 5 && std::stoi(port) > 0 && std::stoi(port) < 65536,
              "redis_url: bad port '" << port << "'");
    m->port = std::stoi(port);
    rest = rest.substr(0, colon);
  }
  if (!rest.empty()) m->host = rest;
}

}  // namespace kvbridge::detail
