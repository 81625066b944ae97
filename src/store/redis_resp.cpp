#include "src/store/redis_resp.h"

namespace kvbridge::detail {

void append_command(redisContext* c, const std::vector<std::string>& args) {
  std::vector<const char*> argv;
  std::vector<size_t> lens;
  argv.reserve(args.size());
  lens.reserve(args.size());
  for (const std::string& a : args) {
    argv.push_back(a.data());
    lens.push_back(a.size());
  }
  redisAppendCommandArgv(c, static_cast<int>(argv.size()), argv.data(), lens.data());
}

RespWriter::RespWriter(redisContext* c, size_t reserve_bytes) : c_(c) {
  grow(sdsMakeRoomFor(c_->obuf, reserve_bytes));
}

void RespWriter::grow(sds s) {
  if (s) {
    c_->obuf = s;
  } else {
    ok_ = false;  // the old buffer stays valid and owned by the context
  }
}

void RespWriter::append(const void* data, size_t n) {
  if (ok_) grow(sdscatlen(c_->obuf, data, n));
}

void RespWriter::array(size_t n) {
  const std::string h = "*" + std::to_string(n) + "\r\n";
  append(h.data(), h.size());
}

void RespWriter::bulk(std::string_view s) {
  bulk_begin(s.size());
  part(s.data(), s.size());
  bulk_end();
}

void RespWriter::bulk_begin(size_t total) {
  const std::string h = "$" + std::to_string(total) + "\r\n";
  append(h.data(), h.size());
}

void RespWriter::part(const void* data, size_t n) { append(data, n); }

void RespWriter::bulk_end() { append("\r\n", 2); }

bool RespWriter::finish() {
  if (!ok_) c_->err = REDIS_ERR_OOM;
  return ok_;
}

}  // namespace kvbridge::detail
