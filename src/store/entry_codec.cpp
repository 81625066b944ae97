#include "src/store/entry_codec.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "kvbridge/error.h"
#include "src/core/byte_order.h"
#include "src/core/xxh3.h"
#include "src/store/int8_codec.h"

namespace kvbridge::detail {
namespace {

constexpr char kMagic[8] = {'K', 'V', 'B', 'E', 'N', 'T', 'R', 'Y'};

bool is_hex_digit(char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); }

}  // namespace

Fingerprint to_fingerprint(const std::string& hex) {
  Fingerprint fp{};
  std::memcpy(fp.data(), hex.data(), std::min(hex.size(), fp.size()));
  return fp;
}

std::string fingerprint_string(const Fingerprint& fp) { return std::string(fp.data(), fp.size()); }

EntryProvenance to_entry_provenance(const Provenance& p) {
  auto field = [](const std::string& hex, const char* name) {
    KVB_CHECK(hex.size() == 32 && std::all_of(hex.begin(), hex.end(), is_hex_digit),
              "provenance." << name << " must be 32 lowercase hex digits, got '" << hex << "'");
    return to_fingerprint(hex);
  };
  EntryProvenance e;
  if (p.source_fingerprint.empty() && p.adapter_fingerprint.empty()) return e;
  e.source = field(p.source_fingerprint, "source_fingerprint");
  e.adapter = field(p.adapter_fingerprint, "adapter_fingerprint");
  return e;
}

Provenance from_entry_provenance(const EntryProvenance& p) {
  if (!p.converted()) return {};
  return Provenance{fingerprint_string(p.source), fingerprint_string(p.adapter)};
}

int64_t stored_payload_bytes(StorageFormat storage, DType dtype, int64_t layers, int64_t chunk,
                             int64_t kv_heads, int64_t head_dim) {
  if (storage == StorageFormat::kInt8) return int8_payload_bytes(layers, chunk, kv_heads, head_dim);
  uint64_t bytes = 2 * static_cast<uint64_t>(dtype_size(dtype));
  for (int64_t d : {layers, chunk, kv_heads, head_dim}) {
    if (d < 1 || bytes > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) /
                             static_cast<uint64_t>(d))
      return 0;
    bytes *= static_cast<uint64_t>(d);
  }
  return static_cast<int64_t>(bytes);
}

void encode_entry_prefix(const EntryHeader& h, const uint32_t* tokens, unsigned char* out) {
  std::memset(out, 0, kEntryHeaderBytes);
  std::memcpy(out, kMagic, 8);
  store_le32(out + 8, kEntryFormatVersion);
  store_le32(out + 12, static_cast<uint32_t>(kEntryHeaderBytes));
  const ChunkGeometry& g = h.geometry;
  store_le32(out + 16, static_cast<uint32_t>(g.dtype));
  store_le32(out + 20, static_cast<uint32_t>(g.storage));
  store_le64(out + 24, static_cast<uint64_t>(g.layers));
  store_le64(out + 32, static_cast<uint64_t>(g.chunk));
  store_le64(out + 40, static_cast<uint64_t>(g.kv_heads));
  store_le64(out + 48, static_cast<uint64_t>(g.head_dim));
  store_le64(out + 56, static_cast<uint64_t>(g.payload_bytes));
  store_le64(out + 64, static_cast<uint64_t>(h.created_ms));
  store_hash(out + 72, h.key);
  store_hash(out + 88, h.parent);
  store_hash(out + 104, h.salt);
  std::memcpy(out + 120, h.fingerprint.data(), 32);
  if (h.provenance.converted()) {
    std::memcpy(out + kEntrySourceOffset, h.provenance.source.data(), 32);
    std::memcpy(out + kEntryAdapterOffset, h.provenance.adapter.data(), 32);
  }
  unsigned char* t = out + kEntryHeaderBytes;
  for (int64_t i = 0; i < g.chunk; ++i) store_le32(t + 4 * i, tokens[i]);
}

Hash128 entry_checksum(const unsigned char* prefix, size_t prefix_bytes, const void* payload,
                       size_t payload_bytes) {
  Xxh3Stream s;
  s.update(prefix, prefix_bytes);
  s.update(payload, payload_bytes);
  return s.digest();
}

void encode_trailer(const Hash128& checksum, unsigned char out[kEntryTrailerBytes]) {
  store_hash(out, checksum);
}

Hash128 decode_trailer(const unsigned char in[kEntryTrailerBytes]) { return load_hash(in); }

EntryHeader decode_entry_header(const unsigned char* in, size_t total_bytes) {
  KVB_CHECK_AS(Corrupt, total_bytes >= kEntryHeaderBytes + kEntryTrailerBytes,
               "entry: " << total_bytes << " bytes is shorter than a header and trailer");
  KVB_CHECK_AS(Corrupt, std::memcmp(in, kMagic, 8) == 0, "entry: bad magic");
  const uint32_t version = load_le32(in + 8);
  KVB_CHECK_AS(Corrupt, version == kEntryFormatVersion,
               "entry: format version " << version << ", expected " << kEntryFormatVersion);
  KVB_CHECK_AS(Corrupt, load_le32(in + 12) == kEntryHeaderBytes,
               "entry: header size " << load_le32(in + 12));
  const uint32_t dtype = load_le32(in + 16);
  KVB_CHECK_AS(Corrupt, dtype <= static_cast<uint32_t>(DType::kFloat16),
               "entry: unknown dtype code " << dtype);
  const uint32_t storage = load_le32(in + 20);
  KVB_CHECK_AS(Corrupt, storage <= static_cast<uint32_t>(StorageFormat::kInt8),
               "entry: unknown storage format " << storage);
  for (size_t off = kEntryAdapterOffset + 32; off < kEntryHeaderBytes; ++off)
    KVB_CHECK_AS(Corrupt, in[off] == 0, "entry: reserved header byte " << off << " is not zero");
  EntryHeader h;
  ChunkGeometry& g = h.geometry;
  g.dtype = static_cast<DType>(dtype);
  g.storage = static_cast<StorageFormat>(storage);
  int64_t* dims[] = {&g.layers, &g.chunk, &g.kv_heads, &g.head_dim};
  for (int i = 0; i < 4; ++i) {
    const uint64_t v = load_le64(in + 24 + 8 * i);
    KVB_CHECK_AS(Corrupt, v >= 1 && v <= static_cast<uint64_t>(kEntryMaxDim),
                 "entry: dimension " << i << " is " << v);
    *dims[i] = static_cast<int64_t>(v);
  }
  const int64_t elements =
      stored_payload_bytes(g.storage, g.dtype, g.layers, g.chunk, g.kv_heads, g.head_dim);
  KVB_CHECK_AS(Corrupt, elements > 0, "entry: payload size overflows");
  const uint64_t payload = load_le64(in + 56);
  KVB_CHECK_AS(Corrupt, payload == static_cast<uint64_t>(elements),
               "entry: payload size " << payload << " does not match its geometry (" << elements
                                      << ")");
  g.payload_bytes = static_cast<int64_t>(payload);
  const uint64_t expect_total =
      kEntryHeaderBytes + 4 * static_cast<uint64_t>(g.chunk) + payload + kEntryTrailerBytes;
  KVB_CHECK_AS(Corrupt, expect_total == total_bytes,
               "entry: " << total_bytes << " bytes, its header describes " << expect_total);
  h.created_ms = static_cast<int64_t>(load_le64(in + 64));
  h.key = load_hash(in + 72);
  h.parent = load_hash(in + 88);
  h.salt = load_hash(in + 104);
  std::memcpy(h.fingerprint.data(), in + 120, 32);
  for (char c : h.fingerprint) KVB_CHECK_AS(Corrupt, is_hex_digit(c), "entry: bad fingerprint");
  // Provenance: both fields zero (the model's own KV) or both fingerprints.
  std::memcpy(h.provenance.source.data(), in + kEntrySourceOffset, 32);
  std::memcpy(h.provenance.adapter.data(), in + kEntryAdapterOffset, 32);
  const bool native = std::all_of(in + kEntrySourceOffset, in + kEntryAdapterOffset + 32,
                                  [](unsigned char b) { return b == 0; });
  if (!native) {
    for (char c : h.provenance.source)
      KVB_CHECK_AS(Corrupt, is_hex_digit(c), "entry: bad provenance source fingerprint");
    for (char c : h.provenance.adapter)
      KVB_CHECK_AS(Corrupt, is_hex_digit(c), "entry: bad provenance adapter fingerprint");
  }
  return h;
}

namespace {

bool header_fits(const EntryHeader& h, const ExpectedEntry& want) {
  return h.key == want.key && h.fingerprint == want.fingerprint && h.geometry == want.geometry;
}

bool same_chunk(const EntryHeader& h, const unsigned char* tokens, const ExpectedEntry& want) {
  if (h.salt != want.salt || h.parent != want.parent) return false;
  for (int64_t i = 0; i < want.geometry.chunk; ++i)
    if (load_le32(tokens + 4 * i) != want.tokens[i]) return false;
  return true;
}

}  // namespace

EntryCheck verify_entry(const unsigned char* prefix, size_t total_bytes, const ExpectedEntry& want,
                        const EntryPayloadReader& read, char* payload, EntryHeader* header) {
  EntryHeader& h = *header;
  try {
    h = decode_entry_header(prefix, total_bytes);
  } catch (const Corrupt&) {
    return EntryCheck::kCorrupt;
  }
  if (!header_fits(h, want)) return EntryCheck::kCorrupt;
  const size_t prefix_bytes = entry_prefix_bytes(h.geometry.chunk);
  Xxh3Stream hash;
  hash.update(prefix, prefix_bytes);
  unsigned char trailer[kEntryTrailerBytes];
  const size_t n = static_cast<size_t>(h.geometry.payload_bytes);
  for (size_t off = 0; off < n; off += kEntryVerifyBlock) {
    const size_t len = std::min(kEntryVerifyBlock, n - off);
    if (!read(payload + off, off, len, off + len < n ? nullptr : trailer))
      return EntryCheck::kUnreadable;
    hash.update(payload + off, len);
  }
  if (hash.digest() != load_hash(trailer)) return EntryCheck::kCorrupt;
  if (want.ttl_ms > 0 && want.now_ms - h.created_ms >= want.ttl_ms) return EntryCheck::kExpired;
  if (!same_chunk(h, prefix + kEntryHeaderBytes, want)) return EntryCheck::kOtherChunk;
  return EntryCheck::kValid;
}

}  // namespace kvbridge::detail
