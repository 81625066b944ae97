// Commands written into a hiredis connection's output buffer (RESP, the Redis protocol). Values
// are written by hand straight into the buffer (an sds string, grown once), so a value given in
// parts is copied once, as a plain SET copies its value once.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "src/store/redis_pool.h"

namespace kvbridge::detail {

/// Appends one command in argv form (hiredis's own writer).
void append_command(redisContext* c, const std::vector<std::string>& args);

/// Writes commands into c's output buffer, first grown by `reserve_bytes`. When memory runs out
/// the rest is dropped and finish() says so.
class RespWriter {
 public:
  RespWriter(redisContext* c, size_t reserve_bytes);
  /// "*n\r\n": a command of n arguments follows.
  void array(size_t n);
  /// One whole argument.
  void bulk(std::string_view s);
  /// One argument of `total` bytes given in parts: bulk_begin, parts, bulk_end.
  void bulk_begin(size_t total);
  void part(const void* data, size_t n);
  void bulk_end();
  /// False when memory ran out: c->err is then REDIS_ERR_OOM and the connection unusable (the
  /// old buffer stays valid and owned by the context).
  bool finish();

 private:
  void append(const void* data, size_t n);
  void grow(sds s);
  redisContext* c_;
  bool ok_ = true;
};

}  // namespace kvbridge::detail
