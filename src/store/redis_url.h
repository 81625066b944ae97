// RedisOptions::url: "redis://[[user]:password@]host[:port][/db]".
#pragma once

#include <string>

namespace kvbridge::detail {

struct RedisAddress {
  std::string host = "127.0.0.1";
  int port = 6379;
  int db = 0;
  std::string user, password;  // AUTH when password is set (with user when that is too)
};

/// Parses a redis URL (port 6379 and db 0 when absent); throws InvalidArgument naming what is
/// wrong.
RedisAddress parse_redis_url(const std::string& url);

}  // namespace kvbridge::detail
