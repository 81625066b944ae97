// The Redis tier's connections: a pool of blocking hiredis connections with connect and command
// timeouts, AUTH / SELECT on connect, and the up / down state (after a failure every operation
// is an instant, counted miss until a retry, with exponential backoff, reconnects). Also the
// capture of fetched values straight from hiredis's read buffer. Thread-safe.
#pragma once

// sds.h (the output buffer of a context, written by hand in redis_resp.cpp) has no C++ guard,
// and hiredis.h includes it, so it comes first.
extern "C" {
#include <hiredis/sds.h>
}
#include <hiredis/hiredis.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "kvbridge/kv_store.h"
#include "src/store/redis_tier.h"
#include "src/store/redis_url.h"
#include "src/store/tier.h"

namespace kvbridge::detail {

struct ReplyDeleter {
  void operator()(redisReply* r) const {
    if (r) freeReplyObject(r);
  }
};
using Reply = std::unique_ptr<redisReply, ReplyDeleter>;

using SteadyClock = std::chrono::steady_clock;
inline int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             SteadyClock::now().time_since_epoch())
      .count();
}

/// While it lives, string elements of replies read on this thread go to `consume` (and become
/// nil elements) on connections of a RedisPool.
class ValueCapture {
 public:
  explicit ValueCapture(const RedisValueConsumer* consume);
  ~ValueCapture();
  ValueCapture(const ValueCapture&) = delete;
  ValueCapture& operator=(const ValueCapture&) = delete;
};

class RedisPool {
 public:
  /// The redis_* connection options of `options` (already checked). Connects lazily.
  RedisPool(const RedisOptions& options, RedisAddress address, TierCounters* counters,
            RemoteCounters* remote);
  ~RedisPool();
  RedisPool(const RedisPool&) = delete;
  RedisPool& operator=(const RedisPool&) = delete;

  /// A connection, or nullptr when the tier is down or every connection stays busy past the
  /// command timeout (counted as skipped unless `background`).
  redisContext* acquire(bool background);
  /// Returns a connection; a broken one is closed and marks the tier down.
  void release(redisContext* c);
  /// Reads `n` replies of the commands appended to c, timing the round trip. Empty on a
  /// connection failure (c->err set).
  std::vector<Reply> replies(redisContext* c, size_t n, int64_t started_ns);
  /// One command, argv form. nullptr on failure (counted; a broken connection marks the tier
  /// down).
  Reply command(const std::vector<std::string>& args, bool background = false);

  /// RedisTier::epoch(): the times the tier was marked down.
  int64_t epoch() const { return epoch_.load(); }
  bool down() const { return down_.load(); }

 private:
  redisContext* connect();
  void mark_down();

  const RedisOptions options_;
  const RedisAddress address_;
  TierCounters* counters_;
  RemoteCounters* remote_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<redisContext*> idle_;
  int open_ = 0;
  std::atomic<bool> down_{false};
  std::atomic<int64_t> epoch_{0};
  std::atomic<int64_t> retry_at_ns_{0};
  int backoff_ms_;  // guarded by mu_
  std::atomic<bool> probing_{false};
};

}  // namespace kvbridge::detail
