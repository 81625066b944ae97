#include "kvbridge/prefix_hash.h"

#include <cstring>
#include <memory>
#include <sstream>
#include <string>

#include "kvbridge/error.h"
#include "src/core/byte_order.h"
#include "src/core/xxh3.h"
#include "src/index/chain_hashes.h"
#include "src/index/token_ids.h"

namespace kvbridge {
namespace {

void append_prefixed(std::string& out, std::string_view s) {
  unsigned char len[4];
  detail::store_le32(len, static_cast<uint32_t>(s.size()));
  out.append(reinterpret_cast<const char*>(len), 4);
  out.append(s.data(), s.size());
}

constexpr int64_t kMaxToken = int64_t{1} << 32;
using detail::kLittleEndianHost;

}  // namespace

namespace {

void check_not_empty(TokenSpan tokens) {
  KVB_CHECK(tokens.size > 0, "tokens must not be empty");
  KVB_CHECK(tokens.data != nullptr || tokens.data32 != nullptr, "tokens: null data pointer");
}

// Names the first id of an int64 span outside [0, 2^32) (called once one is known to exist).
[[noreturn]] void throw_first_bad(const int64_t* ids, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (ids[i] < 0 || ids[i] >= kMaxToken) throw_token_out_of_range(i, std::to_string(ids[i]));
  throw_token_out_of_range(n, "?");  // not reached: the caller saw a bad id
}

}  // namespace

void throw_token_out_of_range(size_t index, std::string_view value) {
  std::ostringstream msg;
  msg << "tokens[" << index << "] = " << value << " is outside the token id range [0, 2^32)";
  throw InvalidArgument(msg.str(), __FILE__, __LINE__);
}

void check_tokens(TokenSpan tokens) {
  check_not_empty(tokens);
  if (tokens.data32) return;  // every u32 is an id
  // One branch-free pass (vectorizes); the slow loop only runs to name the bad id.
  uint64_t high_bits = 0;
  for (size_t i = 0; i < tokens.size; ++i) high_bits |= static_cast<uint64_t>(tokens.data[i]) >> 32;
  if (high_bits != 0) throw_first_bad(tokens.data, tokens.size);
}

namespace detail {

TokenIds::TokenIds(TokenSpan tokens) : size_(tokens.size) {
  check_not_empty(tokens);
  if (tokens.data32) {
    data_ = tokens.data32;
    return;
  }
  narrowed_.reset(new uint32_t[tokens.size]);
  uint32_t* out = narrowed_.get();
  const int64_t* in = tokens.data;
  uint64_t high_bits = 0;  // checked and narrowed in the same pass
  for (size_t i = 0; i < tokens.size; ++i) {
    high_bits |= static_cast<uint64_t>(in[i]) >> 32;
    out[i] = static_cast<uint32_t>(in[i]);
  }
  if (high_bits != 0) throw_first_bad(in, tokens.size);
  data_ = out;
}

}  // namespace detail

Hash128 prefix_salt(std::string_view ns, const ModelSpec& spec) {
  std::string salt = "kvbridge.prefix.v1";
  append_prefixed(salt, ns);
  append_prefixed(salt, spec.fingerprint());
  append_prefixed(salt, dtype_name(spec.dtype));
  return detail::xxh3_128(salt.data(), salt.size());
}

namespace {

// One chain step from the previous key's two halves: callers that chain many steps keep them in
// registers (a Hash128 stored by one step and reloaded whole by the next stalled on store
// forwarding).
Hash128 chain_step(uint64_t low, uint64_t high, const uint32_t* chunk, int64_t count) {
  if (kLittleEndianHost && count == 16) {  // the common chunk (vLLM's block): inlined hash
    Hash128 h;
    detail::xxh3_128_chain16(Hash128{low, high}, chunk, 1, &h);
    return h;
  }
  // Stack buffer for the common chunk sizes; the hash input is small and built once.
  constexpr int64_t kStackTokens = 1024;
  unsigned char stack_buf[16 + 4 * kStackTokens];
  std::string heap_buf;
  unsigned char* buf = stack_buf;
  if (count > kStackTokens) {
    heap_buf.resize(static_cast<size_t>(16 + 4 * count));
    buf = reinterpret_cast<unsigned char*>(heap_buf.data());
  }
  detail::store_le64(buf, low);
  detail::store_le64(buf + 8, high);
  if constexpr (kLittleEndianHost) {
    std::memcpy(buf + 16, chunk, static_cast<size_t>(4 * count));
  } else {
    for (int64_t i = 0; i < count; ++i) detail::store_le32(buf + 16 + 4 * i, chunk[i]);
  }
  return detail::xxh3_128(buf, static_cast<size_t>(16 + 4 * count));
}

}  // namespace

Hash128 chain_hash(const Hash128& previous, const uint32_t* chunk, int64_t count) {
  return chain_step(previous.low, previous.high, chunk, count);
}

Hash128 chain_hash(const Hash128& previous, const int64_t* chunk, int64_t count) {
  // Narrowed on the stack for the common chunk sizes (no allocation per chunk).
  constexpr int64_t kStackTokens = 256;
  uint32_t stack_ids[kStackTokens];
  std::unique_ptr<uint32_t[]> heap_ids;
  uint32_t* ids = stack_ids;
  if (count > kStackTokens) {
    heap_ids.reset(new uint32_t[static_cast<size_t>(count)]);
    ids = heap_ids.get();
  }
  for (int64_t i = 0; i < count; ++i) ids[i] = static_cast<uint32_t>(chunk[i]);
  return chain_hash(previous, ids, count);
}

namespace detail {

void chain_hashes(Hash128 previous, const uint32_t* ids, int64_t chunk, size_t n, Hash128* out) {
  if (kLittleEndianHost && chunk == 16) return xxh3_128_chain16(previous, ids, n, out);
  uint64_t low = previous.low, high = previous.high;
  for (size_t i = 0; i < n; ++i) {
    const Hash128 h = chain_step(low, high, ids + static_cast<int64_t>(i) * chunk, chunk);
    out[i] = h;
    low = h.low;
    high = h.high;
  }
}

}  // namespace detail

std::vector<Hash128> prefix_hashes(const Hash128& salt, TokenSpan tokens, int64_t chunk_tokens) {
  KVB_CHECK(chunk_tokens > 0, "chunk_tokens must be > 0, got " << chunk_tokens);
  const detail::TokenIds ids(tokens);
  const int64_t chunks = static_cast<int64_t>(ids.size()) / chunk_tokens;
  std::vector<Hash128> out(static_cast<size_t>(chunks));
  detail::chain_hashes(salt, ids.data(), chunk_tokens, out.size(), out.data());
  return out;
}

}  // namespace kvbridge
