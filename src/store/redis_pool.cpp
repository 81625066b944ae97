#include "src/store/redis_pool.h"

#include <sys/time.h>

#include <algorithm>

#include "src/store/redis_resp.h"

namespace kvbridge::detail {
namespace {

timeval to_timeval(int ms) {
  timeval tv;
  tv.tv_sec = ms / 1000;
  tv.tv_usec = (ms % 1000) * 1000;
  return tv;
}

// Values of a fetch are handed to the consumer straight from hiredis's read buffer: a reader
// callback in place of hiredis's string constructor, active while a fetch on this thread
// parses its reply. The consumed value becomes a nil element, so no reply object copies it.
thread_local const RedisValueConsumer* t_consumer = nullptr;
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

ValueCapture::ValueCapture(const RedisValueConsumer* consume) { t_consumer = consume; }
ValueCapture::~ValueCapture() { t_consumer = nullptr; }

RedisPool::RedisPool(const RedisOptions& options, RedisAddress address, TierCounters* counters,
                     RemoteCounters* remote)
    : options_(options),
      address_(std::move(address)),
      counters_(counters),
      remote_(remote),
      backoff_ms_(options.retry_min_ms) {}

RedisPool::~RedisPool() {
  for (redisContext* c : idle_) redisFree(c);
}

redisContext* RedisPool::connect() {
  redisContext* c = redisConnectWithTimeout(address_.host.c_str(), address_.port,
                                            to_timeval(options_.connect_timeout_ms));
  if (!c) return nullptr;
  if (c->err) {
    redisFree(c);
    return nullptr;
  }
  // Setup commands get the connect timeout: a server that accepts connections but does not
  // answer (stopped, overloaded) counts as unreachable.
  redisSetTimeout(c, to_timeval(options_.connect_timeout_ms));
  auto ok = [&](Reply r, bool status_ok) {
    return r && !c->err && r->type != REDIS_REPLY_ERROR &&
           (!status_ok || r->type == REDIS_REPLY_STATUS);
  };
  bool good = true;
  const std::string& user = address_.user;
  const std::string& password = address_.password;
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
  if (good && address_.db != 0) {
    good = ok(Reply(static_cast<redisReply*>(redisCommand(c, "SELECT %d", address_.db))), true);
  }
  if (good) good = ok(Reply(static_cast<redisReply*>(redisCommand(c, "PING"))), true);
  if (!good) {
    redisFree(c);
    return nullptr;
  }
  redisSetTimeout(c, to_timeval(options_.command_timeout_ms));
  redisEnableKeepAlive(c);
  install_capture(c);
  return c;
}

void RedisPool::mark_down() {
  std::vector<redisContext*> stale;
  {
    std::lock_guard<std::mutex> lock(mu_);
    down_.store(true);
    epoch_.fetch_add(1);  // what was written before may be gone (a restarted server)
    stale.swap(idle_);  // probably dead too (a restarted server)
    open_ -= static_cast<int>(stale.size());
    retry_at_ns_.store(steady_ns() + int64_t{backoff_ms_} * 1000000);
    backoff_ms_ = std::min(backoff_ms_ * 2, options_.retry_max_ms);
  }
  cv_.notify_all();
  for (redisContext* c : stale) redisFree(c);
}

// A connection, or nullptr when the tier is down (then `background` callers are not counted
// as skipped operations).
redisContext* RedisPool::acquire(bool background) {
  if (down_.load()) {
    bool expected = false;
    if (steady_ns() < retry_at_ns_.load() || !probing_.compare_exchange_strong(expected, true)) {
      if (!background) TierCounters::add(remote_->skipped);
      return nullptr;
    }
    redisContext* c = connect();
    if (!c) {
      mark_down();
      probing_.store(false);
      if (!background) {
        TierCounters::add(counters_->errors);
      }
      return nullptr;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++open_;
      backoff_ms_ = options_.retry_min_ms;
      down_.store(false);
    }
    probing_.store(false);
    TierCounters::add(remote_->reconnects);
    return c;
  }
  std::unique_lock<std::mutex> lock(mu_);
  const auto deadline =
      SteadyClock::now() + std::chrono::milliseconds(options_.command_timeout_ms);
  while (idle_.empty() && open_ >= options_.pool_size) {
    if (cv_.wait_until(lock, deadline) == std::cv_status::timeout || down_.load()) {
      if (!background) TierCounters::add(remote_->skipped);
      return nullptr;
    }
  }
  if (!idle_.empty()) {
    redisContext* c = idle_.back();
    idle_.pop_back();
    return c;
  }
  ++open_;
  lock.unlock();
  redisContext* c = connect();
  if (!c) {
    {
      std::lock_guard<std::mutex> relock(mu_);
      --open_;
    }
    TierCounters::add(counters_->errors);
    mark_down();
  }
  return c;
}

// Returns a connection; a broken one is closed and marks the tier down_.
void RedisPool::release(redisContext* c) {
  if (c->err) {
    redisFree(c);
    {
      std::lock_guard<std::mutex> lock(mu_);
      --open_;
    }
    TierCounters::add(counters_->errors);
    mark_down();
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    idle_.push_back(c);
  }
  cv_.notify_one();
}

// Reads `n` replies of the commands appended to c, timing the round trip. Empty on a
// connection failure (c->err set).
std::vector<Reply> RedisPool::replies(redisContext* c, size_t n, int64_t started_ns) {
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
  remote_->record_latency(steady_ns() - started_ns);
  return out;
}

// One command, argv form. nullptr on failure (counted; a broken connection marks the tier
// down).
Reply RedisPool::command(const std::vector<std::string>& args, bool background) {
  redisContext* c = acquire(background);
  if (!c) return nullptr;
  const int64_t t0 = steady_ns();
  append_command(c, args);
  std::vector<Reply> r = replies(c, 1, t0);
  release(c);
  if (r.empty()) return nullptr;
  if (r[0]->type == REDIS_REPLY_ERROR) TierCounters::add(counters_->errors);
  return std::move(r[0]);
}

}  // namespace kvbridge::detail
