#include "src/store/redis_tier.h"

#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>

#include "kvbridge/error.h"
#include "src/store/memory_tier.h"
#include "src/store/redis_filter.h"
#include "src/store/redis_pool.h"
#include "src/store/redis_resp.h"
#include "src/store/redis_url.h"

namespace kvbridge::detail {
namespace {

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
  const size_t prefix = entry_prefix_bytes(want.geometry.chunk);
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
      : options(o), counters(c), remote(r), pool(o.redis, parse_redis_url(o.redis.url), c, r) {}

  StoreOptions options;
  TierCounters* counters;
  RemoteCounters* remote;
  std::string key_prefix;  // "<prefix>:v1:"
  std::string filter_key, lock_key;
  RedisPool pool;

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

  Reply command(const std::vector<std::string>& args, bool background = false) {
    return pool.command(args, background);
  }

  // --- filter --------------------------------------------------------------------------------

  std::shared_ptr<FilterCopy> current_filter() const { return std::atomic_load(&filter); }

  void note_put(const Hash128& key) {
    if (auto f = current_filter()) f->add(key);
    std::lock_guard<std::mutex> lock(recent_mu);
    if (refreshing) recent.push_back(key);
  }

  // Fetches the shared filter; installs it when ready, else drops the local copy (filtering
  // off) and rebuilds it when it is missing, invalid or too full.
  void refresh(bool background) {
    if (!options.redis.filter) return;
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
    const int log2_bits = filter_log2_bits(options.redis.filter_bits);
    std::string value = filter_header(options.redis.filter_hashes, log2_bits, false);
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
      worker_cv.wait_for(lock, std::chrono::milliseconds(options.redis.filter_refresh_ms),
                         [&] { return stop; });
      if (stop) break;
      lock.unlock();
      refresh(/*background=*/true);
      lock.lock();
    }
  }

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

RedisTier::RedisTier(const StoreOptions& options) {
  KVB_CHECK(options.redis.connect_timeout_ms > 0 && options.redis.command_timeout_ms > 0,
            "redis timeouts must be > 0 ms");
  KVB_CHECK(options.redis.pool_size >= 1, "redis_pool_size must be >= 1");
  KVB_CHECK(options.redis.retry_min_ms > 0 &&
                options.redis.retry_max_ms >= options.redis.retry_min_ms,
            "redis retry: need 0 < redis_retry_min_ms <= redis_retry_max_ms");
  KVB_CHECK(options.redis.batch_bytes > 0, "redis_batch_bytes must be > 0");
  KVB_CHECK(!options.redis.key_prefix.empty(), "redis_key_prefix must not be empty");
  KVB_CHECK(options.redis.filter_bits >= (int64_t{1} << kFilterMinLog2) &&
                options.redis.filter_bits <= (int64_t{1} << kFilterMaxLog2) &&
                (options.redis.filter_bits & (options.redis.filter_bits - 1)) == 0,
            "redis_filter_bits must be a power of two in [2^10, 2^31], got "
                << options.redis.filter_bits);
  KVB_CHECK(options.redis.filter_hashes >= 1 && options.redis.filter_hashes <= 16,
            "redis_filter_hashes must be in [1, 16], got " << options.redis.filter_hashes);
  KVB_CHECK(options.redis.filter_refresh_ms > 0, "redis_filter_refresh_ms must be > 0");
  impl_ = std::make_unique<Impl>(options, &counters_, &remote_);
  Impl& m = *impl_;
  std::string p;
  percent_encode_into(&p, options.redis.key_prefix);
  m.key_prefix = p + ":v1:";
  m.filter_key = m.key_prefix + "filter";
  m.lock_key = m.key_prefix + "filter-lock";
  // First contact in this thread (bounded by the timeouts), so the filter is in use at once.
  m.refresh(/*background=*/true);
  if (!m.current_filter() && options.redis.filter && !m.pool.down()) m.refresh(true);
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

int64_t RedisTier::epoch() const { return impl_->pool.epoch(); }

bool RedisTier::filter_active() const { return impl_->current_filter() != nullptr; }

void RedisTier::refresh_filter_now() { impl_->refresh(false); }

bool RedisTier::fetch(const std::vector<std::string>& keys, const ValueConsumer& consume) {
  Impl& m = *impl_;
  std::vector<std::string> args;
  args.reserve(keys.size() + 1);
  args.emplace_back("MGET");
  args.insert(args.end(), keys.begin(), keys.end());
  ValueCapture capture(&consume);
  Reply r = m.command(args);
  return r && r->type == REDIS_REPLY_ARRAY && r->elements == keys.size();
}

bool RedisTier::write_values(const std::vector<Write>& writes) {
  Impl& m = *impl_;
  const int64_t ttl_ms = m.options.ttl_seconds * 1000;
  if (writes.empty()) return true;
  redisContext* c = m.pool.acquire(false);
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
  RespWriter out(c, total_bytes + 256 * writes.size());
  for (const Write& w : writes) {
    unsigned char trailer[kEntryTrailerBytes];
    encode_trailer(w.checksum, trailer);
    out.array(ttl_ms > 0 ? 5 : 3);
    out.bulk("SET");
    out.bulk(w.key);
    out.bulk_begin(w.prefix_bytes + w.payload_bytes + sizeof trailer);
    out.part(w.prefix, w.prefix_bytes);
    out.part(w.payload, w.payload_bytes);
    out.part(trailer, sizeof trailer);
    out.bulk_end();
    if (ttl_ms > 0) {
      out.bulk("PX");
      out.bulk(ttl);
    }
  }
  if (!out.finish()) {  // out of memory: this connection's buffer is unusable
    m.pool.release(c);
    TierCounters::add(m.counters->write_failures, static_cast<int64_t>(writes.size()));
    return false;
  }
  std::vector<std::string> eval = {"EVAL", kAddScript, "1", m.filter_key};
  for (const Write& w : writes) {
    eval.push_back(std::to_string(probe_h1(w.hash)));
    eval.push_back(std::to_string(probe_h2(w.hash)));
  }
  append_command(c, eval);
  redisAppendCommand(c, "EXEC");
  std::vector<Reply> r = m.pool.replies(c, writes.size() + 3, t0);
  m.pool.release(c);
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

void RedisTier::invalidate(const Fingerprint& fp, InvalidateResult* r) {
  Impl& m = *impl_;
  r->redis_complete = true;
  // Namespaces are percent-encoded, so no ':' of theirs can fake the fingerprint component.
  r->redis = m.delete_matching(m.glob_prefix() + "*:" + fingerprint_string(fp) + ":*",
                               &r->redis_complete);
}

void RedisTier::invalidate_adapter(const Fingerprint& fp, const Fingerprint& adapter,
                                   InvalidateResult* r) {
  Impl& m = *impl_;
  r->redis_complete = true;
  r->redis = m.delete_matching(m.glob_prefix() + "*:" + fingerprint_string(fp) + ":*",
                               &r->redis_complete, &adapter);
}

void RedisTier::fill(TierStats* own, StoreStats* all) const {
  counters_.fill(own);
  remote_.fill(&all->remote);
  all->remote.filter_active = filter_active();
}

size_t RedisTier::batch_bytes() const {
  return static_cast<size_t>(impl_->options.redis.batch_bytes);
}

bool RedisTier::wants(const Hash128&, const Fingerprint&, const ChunkEntry* pinned) {
  return !pinned || pinned->tier_marks[slot()].load(std::memory_order_relaxed) != epoch();
}

void RedisTier::store(std::string_view ns, const Fingerprint& fp,
                      const std::vector<ChunkWrite>& batch, std::vector<char>* stored) {
  std::vector<Write> writes;
  writes.reserve(batch.size());
  for (const ChunkWrite& w : batch) {
    writes.push_back({key_for(ns, fp, w.key), w.key, w.packed->prefix.data(),
                      w.packed->prefix.size(), w.entry->kv, w.entry->payload_size(),
                      w.packed->checksum});
  }
  const int64_t before = epoch();  // read first: a failure meanwhile re-sends
  const bool ok = write_values(writes);
  stored->assign(batch.size(), ok);
  if (ok)
    for (const ChunkWrite& w : batch)
      w.entry->tier_marks[slot()].store(before, std::memory_order_relaxed);
}

int64_t RedisTier::erase(std::string_view ns, const Fingerprint& fp,
                         const std::vector<Hash128>& keys) {
  std::vector<std::string> names;
  names.reserve(keys.size());
  for (const Hash128& key : keys) names.push_back(key_for(ns, fp, key));
  if (!names.empty()) remove(names);
  return 0;
}

size_t RedisTier::read_ahead_chunks(const ChunkGeometry& g) const {
  const size_t value_bytes = entry_encoded_bytes(g.chunk, g.payload_bytes);
  return std::max<size_t>(
      1, std::min<size_t>(1024, static_cast<size_t>(impl_->options.redis.batch_bytes) /
                                    value_bytes));
}

namespace {

// What one fetched value became: verified into its payload buffer, or not.
struct Slot {
  bool present = false;
  bool no_room = false;
  bool drop = false;  // corrupt or expired: delete it from the server
  LoadResult result = LoadResult::kMiss;
  LoadedMeta meta;
};

}  // namespace

void RedisTier::lookup(const LookupBatch& batch, PayloadPool& payloads,
                       std::vector<LookupAnswer>* answers) {
  RemoteCounters& rc = remote_;
  if (batch.run.empty()) {  // the filter ruled the first chunk out
    TierCounters::add(rc.filter_negatives);
    TierCounters::add(counters_.misses);
    return;
  }
  TierCounters::add(rc.filter_passes);
  const size_t count = batch.run.size();
  const int64_t before = epoch();  // the hits' mark
  std::vector<std::string> names;
  names.reserve(count);
  for (const ExpectedEntry& want : batch.run)
    names.push_back(key_for(batch.ns, batch.fp, want.key));
  std::vector<Slot> slots(count);
  // Each value is verified and copied into its buffer while hiredis parses the reply.
  auto consume = [&](size_t i, const unsigned char* data, size_t size) {
    if (i >= count) return;
    Slot& slot = slots[i];
    slot.present = true;
    char* payload = payloads.get(i);
    if (!payload) {
      slot.no_room = true;
      return;
    }
    slot.result =
        load_value(data, size, batch.run[i], payload, &slot.meta, &counters_, &slot.drop);
    if (slot.result != LoadResult::kHit) payloads.discard(i);
  };
  if (!fetch(names, consume)) {
    TierCounters::add(counters_.misses);
    answers->push_back({LoadResult::kMiss, {}});
    return;
  }
  std::vector<std::string> damaged;
  for (size_t i = 0; i < count; ++i)
    if (slots[i].drop) damaged.push_back(names[i]);
  if (!damaged.empty()) remove(damaged);
  // The walk stops at the first chunk that is not a hit, so the answers do too (an absent
  // value counts its miss only when it is answered).
  for (size_t i = 0; i < count; ++i) {
    const Slot& slot = slots[i];
    LookupAnswer& a = answers->emplace_back();
    if (!slot.present) {
      TierCounters::add(counters_.misses);
      if (filter_active()) TierCounters::add(rc.filter_false_positives);
      a.result = LoadResult::kMiss;
      return;
    }
    if (slot.no_room) {
      a.result = LoadResult::kNoRoom;
      return;
    }
    a.result = slot.result;
    if (a.result != LoadResult::kHit) return;
    a.meta = slot.meta;
    a.meta.mark = before;
  }
}

int64_t RedisTier::clear() {
  bool complete = true;
  return impl_->delete_matching(impl_->glob_prefix() + "*", &complete);
}

}  // namespace kvbridge::detail
