#include "src/store/redis_url.h"

#include "kvbridge/error.h"

namespace kvbridge::detail {

RedisAddress parse_redis_url(const std::string& url) {
  RedisAddress a;
  RedisAddress* m = &a;
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
  return a;
}

}  // namespace kvbridge::detail
