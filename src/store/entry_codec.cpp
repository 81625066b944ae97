#include "src/store/entry_codec.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "kvbridge/error.h"
#include "src/core/xxh3.h"
#include "src/store/int8_codec.h"

namespace kvbridge::detail {
namespace {

constexpr char kMagic[8] = {'K', 'V', 'B', 'E', 'N', 'T', 'R', 'Y'};

void put_u32(unsigned char* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}
void put_u64(unsigned char* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}
uint32_t get_u32(const unsigned char* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}
uint64_t get_u64(const unsigned char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}
void put_hash(unsigned char* p, const Hash128& h) {
  put_u64(p, h.low);
  put_u64(p + 8, h.high);
}
Hash128 get_hash(const unsigned char* p) { return Hash128{get_u64(p), get_u64(p + 8)}; }

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
  put_u32(out + 8, kEntryFormatVersion);
  put_u32(out + 12, static_cast<uint32_t>(kEntryHeaderBytes));
  put_u32(out + 16, static_cast<uint32_t>(h.dtype));
  put_u32(out + 20, static_cast<uint32_t>(h.storage));
  put_u64(out + 24, static_cast<uint64_t>(h.layers));
  put_u64(out + 32, static_cast<uint64_t>(h.chunk));
  put_u64(out + 40, static_cast<uint64_t>(h.kv_heads));
  put_u64(out + 48, static_cast<uint64_t>(h.head_dim));
  put_u64(out + 56, static_cast<uint64_t>(h.payload_bytes));
  put_u64(out + 64, static_cast<uint64_t>(h.created_ms));
  put_hash(out + 72, h.key);
  put_hash(out + 88, h.parent);
  put_hash(out + 104, h.salt);
  std::memcpy(out + 120, h.fingerprint.data(), 32);
  if (h.provenance.converted()) {
    std::memcpy(out + kEntrySourceOffset, h.provenance.source.data(), 32);
    std::memcpy(out + kEntryAdapterOffset, h.provenance.adapter.data(), 32);
  }
  unsigned char* t = out + kEntryHeaderBytes;
  for (int64_t i = 0; i < h.chunk; ++i) put_u32(t + 4 * i, tokens[i]);
}

Hash128 entry_checksum(const unsigned char* prefix, size_t prefix_bytes, const void* payload,
                       size_t payload_bytes) {
  Xxh3Stream s;
  s.update(prefix, prefix_bytes);
  s.update(payload, payload_bytes);
  return s.digest();
}

void encode_trailer(const Hash128& checksum, unsigned char out[kEntryTrailerBytes]) {
  put_hash(out, checksum);
}

Hash128 decode_trailer(const unsigned char in[kEntryTrailerBytes]) { return get_hash(in); }

EntryHeader decode_entry_header(const unsigned char* in, size_t total_bytes) {
  KVB_CHECK_AS(Corrupt, total_bytes >= kEntryHeaderBytes + kEntryTrailerBytes,
               "entry: " << total_bytes << " bytes is shorter than a header and trailer");
  KVB_CHECK_AS(Corrupt, std::memcmp(in, kMagic, 8) == 0, "entry: bad magic");
  const uint32_t version = get_u32(in + 8);
  KVB_CHECK_AS(Corrupt, version == kEntryFormatVersion,
               "entry: format version " << version << ", expected " << kEntryFormatVersion);
  KVB_CHECK_AS(Corrupt, get_u32(in + 12) == kEntryHeaderBytes,
               "entry: header size " << get_u32(in + 12));
  const uint32_t dtype = get_u32(in + 16);
  KVB_CHECK_AS(Corrupt, dtype <= static_cast<uint32_t>(DType::kFloat16),
               "entry: unknown dtype code " << dtype);
  const uint32_t storage = get_u32(in + 20);
  KVB_CHECK_AS(Corrupt, storage <= static_cast<uint32_t>(StorageFormat::kInt8),
               "entry: unknown storage format " << storage);
  for (size_t off = kEntryAdapterOffset + 32; off < kEntryHeaderBytes; ++off)
    KVB_CHECK_AS(Corrupt, in[off] == 0, "entry: reserved header byte " << off << " is not zero");
  EntryHeader h;
  h.dtype = static_cast<DType>(dtype);
  h.storage = static_cast<StorageFormat>(storage);
  int64_t* dims[] = {&h.layers, &h.chunk, &h.kv_heads, &h.head_dim};
  for (int i = 0; i < 4; ++i) {
    const uint64_t v = get_u64(in + 24 + 8 * i);
    KVB_CHECK_AS(Corrupt, v >= 1 && v <= static_cast<uint64_t>(kEntryMaxDim),
                 "entry: dimension " << i << " is " << v);
    *dims[i] = static_cast<int64_t>(v);
  }
  const int64_t elements =
      stored_payload_bytes(h.storage, h.dtype, h.layers, h.chunk, h.kv_heads, h.head_dim);
  KVB_CHECK_AS(Corrupt, elements > 0, "entry: payload size overflows");
  const uint64_t payload = get_u64(in + 56);
  KVB_CHECK_AS(Corrupt, payload == static_cast<uint64_t>(elements),
               "entry: payload size " << payload << " does not match its geometry (" << elements
                                      << ")");
  h.payload_bytes = static_cast<int64_t>(payload);
  const uint64_t expect_total =
      kEntryHeaderBytes + 4 * static_cast<uint64_t>(h.chunk) + payload + kEntryTrailerBytes;
  KVB_CHECK_AS(Corrupt, expect_total == total_bytes,
               "entry: " << total_bytes << " bytes, its header describes " << expect_total);
  h.created_ms = static_cast<int64_t>(get_u64(in + 64));
  h.key = get_hash(in + 72);
  h.parent = get_hash(in + 88);
  h.salt = get_hash(in + 104);
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

}  // namespace kvbridge::detail
