// The packed form of one chunk entry, shared by the disk tier (one file per entry) and the Redis
// tier (one value per entry). docs/storage.md is the byte-level specification:
//
//   header   224 bytes (magic, version, geometry, created time, key, parent, salt, fingerprint,
//            provenance)
//   tokens   4 * chunk bytes, u32 little-endian
//   payload  the chunk's KV: native storage [layers, 2, chunk, kv_heads, head_dim] dense,
//            little-endian; int8 storage the scales and codes of src/store/int8_codec.h
//   trailer  16 bytes: XXH3-128 of everything before it (low64, high64, little-endian)
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "kvbridge/dtype.h"
#include "kvbridge/kv_store.h"
#include "kvbridge/prefix_hash.h"

namespace kvbridge::detail {

// Version 2 added the provenance fields (bytes 152..215); version 1 entries (160-byte headers)
// are not read: they are corrupt misses, removed, and the next put writes the chunk again.
constexpr size_t kEntryHeaderBytes = 224;
constexpr size_t kEntryTrailerBytes = 16;
constexpr uint32_t kEntryFormatVersion = 2;
// Offsets of the provenance fields: the source model's and the adapter's fingerprints.
constexpr size_t kEntrySourceOffset = 152;
constexpr size_t kEntryAdapterOffset = 184;

// Largest dimension (layers, chunk tokens, KV heads, head dim) an entry may have: keeps every
// product below 2^63 and bounds StoreOptions::chunk_tokens.
constexpr int64_t kEntryMaxDim = int64_t{1} << 24;

using Fingerprint = std::array<char, 32>;  // ModelSpec::fingerprint() digits, no terminator

/// Where an entry's KV came from: all zero bytes for the model's own KV; for KV converted from
/// another model and written back, that model's fingerprint and the adapter's
/// (LinearAdapter::fingerprint()), 32 lowercase hex digits each.
struct EntryProvenance {
  Fingerprint source{};
  Fingerprint adapter{};
  bool converted() const { return adapter[0] != 0; }
  bool operator==(const EntryProvenance& o) const {
    return source == o.source && adapter == o.adapter;
  }
};

/// The two forms of Provenance (provenance.h) agree: strings (empty or 32 lowercase hex digits,
/// both or neither; InvalidArgument otherwise) to the fixed form and back.
EntryProvenance to_entry_provenance(const Provenance& p);
Provenance from_entry_provenance(const EntryProvenance& p);

Fingerprint to_fingerprint(const std::string& hex);
std::string fingerprint_string(const Fingerprint& fp);

/// Payload bytes of one entry of this geometry: native 2*L*T*H*D*dtype_size, int8 see
/// int8_codec.h. 0 when the product overflows int64 (or a dimension is < 1).
int64_t stored_payload_bytes(StorageFormat storage, DType dtype, int64_t layers, int64_t chunk,
                             int64_t kv_heads, int64_t head_dim);

/// The geometry of a chunk entry: how its payload is laid out and how many bytes it takes. The
/// one description of it, embedded in each form of an entry (header, memory entry, what a lookup
/// expects); header bytes 16..63.
struct ChunkGeometry {
  DType dtype = DType::kFloat32;
  StorageFormat storage = StorageFormat::kNative;
  int64_t layers = 0, chunk = 0, kv_heads = 0, head_dim = 0;
  int64_t payload_bytes = 0;  // stored_payload_bytes(storage, dtype, layers, chunk, ...)

  /// The geometry with its payload_bytes computed (0 when it overflows, see above).
  static ChunkGeometry of(StorageFormat storage, DType dtype, int64_t layers, int64_t chunk,
                          int64_t kv_heads, int64_t head_dim) {
    return {dtype,    storage, layers, chunk, kv_heads, head_dim,
            stored_payload_bytes(storage, dtype, layers, chunk, kv_heads, head_dim)};
  }
  bool operator==(const ChunkGeometry& o) const {
    return dtype == o.dtype && storage == o.storage && layers == o.layers && chunk == o.chunk &&
           kv_heads == o.kv_heads && head_dim == o.head_dim && payload_bytes == o.payload_bytes;
  }
  bool operator!=(const ChunkGeometry& o) const { return !(*this == o); }
};

/// What an entry's header records.
struct EntryHeader {
  ChunkGeometry geometry;
  int64_t created_ms = 0;
  Hash128 key, parent, salt;
  Fingerprint fingerprint{};
  EntryProvenance provenance;
};

/// Bytes of header + tokens (the part before the payload).
inline size_t entry_prefix_bytes(int64_t chunk) {
  return kEntryHeaderBytes + 4 * static_cast<size_t>(chunk);
}
/// Bytes of the whole packed entry.
inline size_t entry_encoded_bytes(int64_t chunk, int64_t payload_bytes) {
  return entry_prefix_bytes(chunk) + static_cast<size_t>(payload_bytes) + kEntryTrailerBytes;
}

/// Writes the header and the token ids (entry_prefix_bytes(h.geometry.chunk) bytes) to `out`.
void encode_entry_prefix(const EntryHeader& h, const uint32_t* tokens, unsigned char* out);
/// XXH3-128 over prefix (header + tokens) then payload.
Hash128 entry_checksum(const unsigned char* prefix, size_t prefix_bytes, const void* payload,
                       size_t payload_bytes);
void encode_trailer(const Hash128& checksum, unsigned char out[kEntryTrailerBytes]);
Hash128 decode_trailer(const unsigned char in[kEntryTrailerBytes]);

/// Parses the kEntryHeaderBytes header bytes and checks that they are self-consistent and
/// describe an entry of exactly `total_bytes` (the file or value size). Throws Corrupt saying
/// what is wrong.
EntryHeader decode_entry_header(const unsigned char* in, size_t total_bytes);

/// The entry a lookup accepts: everything a stored entry must agree with.
struct ExpectedEntry {
  Hash128 key, parent, salt;
  Fingerprint fingerprint{};
  ChunkGeometry geometry;
  const uint32_t* tokens = nullptr;  // geometry.chunk ids
  int64_t now_ms = 0;
  int64_t ttl_ms = 0;  // 0: no expiry
};

/// What verify_entry found, in the order it checks.
enum class EntryCheck {
  kValid,       // the chunk the lookup asks for; payload filled
  kUnreadable,  // the reader failed (an I/O error, or the value ended early)
  kCorrupt,     // header, size, key, identity, geometry or checksum wrong
  kExpired,     // past the lookup's TTL (by the header's creation time)
  kOtherChunk,  // a valid entry of this key, but of other tokens / parent / salt: a collision
};

/// verify_entry reads and hashes the payload in blocks of this many bytes (the last one may be
/// shorter): small enough to be hashed while still in cache.
constexpr size_t kEntryVerifyBlock = size_t{256} << 10;

/// Copies payload bytes [offset, offset + len) into `dst` and, with the last block, the 16
/// trailer bytes into `trailer` (null for every other block). False: the bytes cannot be read.
using EntryPayloadReader =
    std::function<bool(char* dst, size_t offset, size_t len, unsigned char* trailer)>;

/// The one verification of a packed entry, shared by every tier (docs/storage.md, "The packed
/// entry"): the header's structure and that it describes exactly `total_bytes`, key,
/// fingerprint and geometry against `want`; then the payload is read through `read` in
/// kEntryVerifyBlock blocks into `payload` (want.geometry.payload_bytes bytes, caller-owned),
/// each hashed right after it arrives, and the checksum compared; then the TTL; then tokens,
/// parent and salt. `prefix` holds the entry's first entry_prefix_bytes(want.geometry.chunk)
/// bytes (header and token ids; total_bytes must be at least that). *header is set once the
/// header decoded (from kExpired on, it is the verified header). Never throws.
EntryCheck verify_entry(const unsigned char* prefix, size_t total_bytes, const ExpectedEntry& want,
                        const EntryPayloadReader& read, char* payload, EntryHeader* header);

}  // namespace kvbridge::detail
