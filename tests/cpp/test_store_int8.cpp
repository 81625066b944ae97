// int8 storage (StorageFormat::kInt8): reconstruction against a float64 reference on odd sizes
// and strided views, the memory it saves, and the round trip through the disk and Redis tiers.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <random>

#include "process_util.h"
#include "src/adapter/numeric.h"
#include "src/store/entry_codec.h"
#include "src/store/int8_codec.h"
#include "test_util.h"

namespace kvbridge {
namespace {

using testing::RedisServer;
using testing::TempDir;

constexpr int64_t kChunk = 16;
constexpr int64_t kTokens = 37;  // two whole chunks and a partial one that is never stored

double read_element(const char* p, DType dtype) {
  uint16_t b;
  switch (dtype) {
    case DType::kFloat32: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    case DType::kBFloat16:
      std::memcpy(&b, p, 2);
      return detail::bf16_to_float(b);
    case DType::kFloat16:
      std::memcpy(&b, p, 2);
      return detail::fp16_to_float(b);
  }
  return 0;
}

void write_element(char* p, DType dtype, float v) {
  uint16_t b;
  switch (dtype) {
    case DType::kFloat32:
      std::memcpy(p, &v, 4);
      return;
    case DType::kBFloat16:
      b = detail::float_to_bf16(v);
      std::memcpy(p, &b, 2);
      return;
    case DType::kFloat16:
      b = detail::float_to_fp16(v);
      std::memcpy(p, &b, 2);
      return;
  }
}

double element(const KVView& v, int64_t l, int k, int64_t t, int64_t h, int64_t d) {
  const KVPlane& p = v.plane(l, static_cast<KVView::Kind>(k));
  const int64_t es = static_cast<int64_t>(dtype_size(v.dtype()));
  return read_element(static_cast<const char*>(p.data) +
                          (t * p.token_stride + h * p.head_stride + d * p.dim_stride) * es,
                      v.dtype());
}

// Hugging Face layout with a gap after each row (strided), filled with seeded Gaussian values
// whose spread differs per channel (keys) and per token (values), as real KV does, plus a few
// outliers; never zero.
struct StridedKV {
  std::vector<std::vector<char>> storage;
  std::vector<TensorView> keys, values;
  StridedKV(const ModelSpec& spec, int64_t tokens, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> gauss(0.0f, 1.0f);
    std::uniform_real_distribution<float> spread(0.05f, 4.0f);
    const int64_t es = static_cast<int64_t>(dtype_size(spec.dtype));
    const int64_t row = spec.head_dim + 3;
    std::vector<float> channel(static_cast<size_t>(spec.num_kv_heads * spec.head_dim));
    std::vector<float> token(static_cast<size_t>(tokens));
    for (int64_t l = 0; l < 2 * spec.num_layers; ++l) {
      for (auto& c : channel) c = spread(rng);
      for (auto& t : token) t = spread(rng);
      storage.emplace_back(static_cast<size_t>(spec.num_kv_heads * tokens * row * es), 0);
      char* base = storage.back().data();
      for (int64_t h = 0; h < spec.num_kv_heads; ++h)
        for (int64_t t = 0; t < tokens; ++t)
          for (int64_t d = 0; d < spec.head_dim; ++d) {
            float x = gauss(rng) * (l % 2 == 0 ? channel[h * spec.head_dim + d] : token[t]);
            if (rng() % 97 == 0) x *= 6.0f;
            if (x == 0.0f) x = 0.5f;
            write_element(base + ((h * tokens + t) * row + d) * es, spec.dtype, x);
          }
      TensorView v;
      v.data = base;
      v.dtype = spec.dtype;
      v.shape = {1, spec.num_kv_heads, tokens, spec.head_dim};
      v.strides = {spec.num_kv_heads * tokens * row, tokens * row, row, 1};
      (l % 2 == 0 ? keys : values).push_back(v);
    }
  }
  KVView view() const { return KVView::from_hf_layers(keys, values); }
};

struct ErrorReport {
  double max_excess = 0;  // largest |x - x̂| - bound (<= 0 when every element is in bound)
  double err2 = 0, ref2 = 0;
  double rms_relative() const { return std::sqrt(err2 / ref2); }
};

// Checks `out` (tokens [begin, begin + out.tokens()) of the stored prefix) against the float64
// reference computed from `in`: per chunk, key scales over its tokens per (layer, head, channel),
// value scales over channels per (layer, head, token). Bound per element: scale/2 (exact
// rounding to the nearest code) with a 1e-5 relative allowance for the float32 arithmetic, plus
// the rounding of the result to the dtype (half an ulp: 2^-8 relative for bfloat16).
ErrorReport check_against_reference(const KVView& in, const KVView& out, int64_t begin,
                                    int64_t group = kChunk) {
  const double unit = out.dtype() == DType::kBFloat16  ? std::ldexp(1.0, -8)
                      : out.dtype() == DType::kFloat16 ? std::ldexp(1.0, -11)
                                                       : std::ldexp(1.0, -24);
  ErrorReport r;
  const int64_t layers = in.num_layers(), heads = in.kv_heads(), dim = in.head_dim();
  for (int64_t l = 0; l < layers; ++l)
    for (int64_t t = begin; t < begin + out.tokens(); ++t) {
      const int64_t c0 = t / group * group;
      for (int64_t h = 0; h < heads; ++h) {
        double vmax = 0;
        for (int64_t d = 0; d < dim; ++d)
          vmax = std::max(vmax, std::fabs(element(in, l, 1, t, h, d)));
        for (int64_t d = 0; d < dim; ++d) {
          double kmax = 0;
          for (int64_t u = c0; u < c0 + group; ++u)
            kmax = std::max(kmax, std::fabs(element(in, l, 0, u, h, d)));
          for (int k = 0; k < 2; ++k) {
            const double scale = (k == 0 ? kmax : vmax) / 127.0;
            const double x = element(in, l, k, t, h, d);
            const double y = element(out, l, k, t - begin, h, d);
            const double bound = scale / 2 * (1 + 1e-5) + std::fabs(y) * unit;
            r.max_excess = std::max(r.max_excess, std::fabs(x - y) - bound);
            r.err2 += (x - y) * (x - y);
            r.ref2 += x * x;
          }
        }
      }
    }
  return r;
}

class StoreInt8 : public ::testing::TestWithParam<DType> {
 protected:
  StoreOptions options() const {
    StoreOptions o;
    o.capacity_bytes = 1 << 24;
    o.chunk_tokens = kChunk;
    o.num_shards = 3;
    o.storage = StorageFormat::kInt8;
    return o;
  }
  // ModelSpec needs an even head dim (RoPE); the codec test below also covers 17.
  ModelSpec spec() const { return testing::small_spec(GetParam(), 3, 3, 18); }
};

TEST_P(StoreInt8, ReconstructionIsWithinHalfAScaleOfTheFloat64Reference) {
  const ModelSpec s = spec();
  const auto tokens = testing::random_tokens(kTokens, 11);
  StridedKV kv(s, kTokens, 12);
  KVStore store(options());
  ASSERT_EQ(store.put(s, tokens, kv.view()), 2 * kChunk);
  Match m = store.match(s, tokens);
  ASSERT_EQ(m.tokens(), 2 * kChunk);

  // Whole prefix into a strided view.
  StridedKV out(s, m.tokens(), 99);
  m.copy_to(out.view());
  const ErrorReport whole = check_against_reference(kv.view(), out.view(), 0);
  EXPECT_LE(whole.max_excess, 0.0);
  // A range that starts inside chunk 0 and ends inside chunk 1, into a dense view.
  testing::DenseKV part(s, 19, 5);
  m.copy_range_to(7, part.view);
  const ErrorReport range = check_against_reference(kv.view(), part.view, 7);
  EXPECT_LE(range.max_excess, 0.0);

  // Lossy, but not by much: a step of max/127 per group gives ~0.5% RMS on this data.
  const double rms = whole.rms_relative();
  std::printf("int8 storage, %s input (3 layers, 3 heads, dim 18, 32 tokens): RMS relative "
              "error %.5f\n",
              dtype_name(GetParam()), rms);
  RecordProperty("rms_relative_error", std::to_string(rms));
  EXPECT_GT(rms, 0.0);
  EXPECT_LT(rms, 0.02);
}

TEST_P(StoreInt8, MemoryAndByteCountersUseTheInt8Size) {
  const ModelSpec s = spec();
  const auto tokens = testing::random_tokens(kTokens, 21);
  StridedKV kv(s, kTokens, 22);
  StoreOptions o = options();
  TempDir dir;
  o.disk.dir = dir.path;
  o.disk.fsync = false;
  KVStore store(o);
  ASSERT_EQ(store.put(s, tokens, kv.view()), 2 * kChunk);
  const int64_t payload = 2 * 3 * kChunk * 3 * 18 + 4 * 3 * 3 * (18 + kChunk);
  ASSERT_EQ(detail::int8_payload_bytes(3, kChunk, 3, 18), payload);
  const StoreStats st = store.stats();
  EXPECT_EQ(st.bytes_used,
            2 * ((payload + 63) / 64 * 64 + 4 * kChunk + StoreStats::kEntryOverheadBytes));
  EXPECT_EQ(st.disk.bytes_written,
            2 * static_cast<int64_t>(detail::entry_encoded_bytes(kChunk, payload)));
}

// A typical geometry: bfloat16, 64-dim heads, 256-token chunks. The accounted bytes of an int8
// entry are at most 55% of the bfloat16 entry's (formula in store_options.h: 1/2 + 1/T + 1/D of
// the payload, plus the same 4*T + 128 bytes of token ids and overhead).
TEST(StoreInt8Memory, AccountedBytesAreAtMost55PercentOfBFloat16) {
  const ModelSpec s = testing::small_spec(DType::kBFloat16, 4, 2, 64);
  const int64_t chunk = 256;
  const auto tokens = testing::random_tokens(2 * chunk, 31);
  testing::DenseKV raw(s, 2 * chunk, 32);
  // DenseKV's random bytes include NaN patterns; int8 needs finite input, so rewrite them.
  std::mt19937 rng(33);
  std::normal_distribution<float> gauss;
  for (size_t i = 0; i + 1 < raw.bytes.size(); i += 2)
    write_element(reinterpret_cast<char*>(raw.bytes.data() + i), s.dtype, gauss(rng));
  int64_t used[2];
  for (int f = 0; f < 2; ++f) {
    StoreOptions o;
    o.chunk_tokens = chunk;
    o.storage = f == 0 ? StorageFormat::kNative : StorageFormat::kInt8;
    KVStore store(o);
    ASSERT_EQ(store.put(s, tokens, raw.view), 2 * chunk);
    used[f] = store.stats().bytes_used;
  }
  const double ratio = static_cast<double>(used[1]) / static_cast<double>(used[0]);
  std::printf("int8 / bfloat16 accounted bytes per entry (4 layers, 2 heads, dim 64, chunk 256):"
              " %.4f (payload formula 1/2 + 1/256 + 1/64 = %.4f)\n",
              ratio, 0.5 + 1.0 / 256 + 1.0 / 64);
  EXPECT_LE(ratio, 0.55);
  EXPECT_GT(ratio, 0.5);
}

TEST_P(StoreInt8, DiskTierKeepsTheInt8PayloadForAStoreOpenedLater) {
  const ModelSpec s = spec();
  const auto tokens = testing::random_tokens(kTokens, 41);
  StridedKV kv(s, kTokens, 42);
  TempDir dir;
  StoreOptions o = options();
  o.disk.dir = dir.path;
  o.disk.fsync = false;
  testing::DenseKV first(s, 2 * kChunk, 1), second(s, 2 * kChunk, 2);
  {
    KVStore store(o);
    ASSERT_EQ(store.put(s, tokens, kv.view()), 2 * kChunk);
    store.match(s, tokens).copy_to(first.view);
  }
  // Every entry file records the int8 format in its header.
  int files = 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir.path)) {
    if (e.path().extension() != ".kvb") continue;
    ++files;
    FILE* f = std::fopen(e.path().c_str(), "rb");
    ASSERT_NE(f, nullptr);
    std::vector<unsigned char> bytes(std::filesystem::file_size(e.path()));
    ASSERT_EQ(std::fread(bytes.data(), 1, bytes.size(), f), bytes.size());
    std::fclose(f);
    const detail::EntryHeader h = detail::decode_entry_header(bytes.data(), bytes.size());
    EXPECT_EQ(h.geometry.storage, StorageFormat::kInt8);
    EXPECT_EQ(h.geometry.dtype, s.dtype);
  }
  EXPECT_EQ(files, 2);
  KVStore reopened(o);
  Match m = reopened.match(s, tokens);
  ASSERT_EQ(m.tokens(), 2 * kChunk);
  EXPECT_EQ(reopened.stats().disk.hit_chunks, 2);
  m.copy_to(second.view);
  EXPECT_TRUE(testing::same_elements(first.view, second.view));  // the same codes and scales
  EXPECT_LE(check_against_reference(kv.view(), second.view, 0).max_excess, 0.0);
}

TEST_P(StoreInt8, NativeAndInt8StoresOnOneDirectoryNeverShareEntries) {
  const ModelSpec s = spec();
  const auto tokens = testing::random_tokens(kTokens, 51);
  StridedKV kv(s, kTokens, 52);
  TempDir dir;
  StoreOptions native = options();
  native.storage = StorageFormat::kNative;
  native.disk.dir = dir.path;
  native.disk.fsync = false;
  {
    KVStore store(native);
    ASSERT_EQ(store.put(s, tokens, kv.view()), 2 * kChunk);
  }
  StoreOptions q = native;
  q.storage = StorageFormat::kInt8;
  {
    KVStore store(q);
    EXPECT_FALSE(store.match(s, tokens));
    const StoreStats st = store.stats();
    EXPECT_EQ(st.disk.corrupt, 0);  // a plain miss: the native files are not touched
    EXPECT_EQ(st.disk.misses, 1);
    EXPECT_EQ(store.put(s, tokens, kv.view()), 2 * kChunk);
  }
  KVStore store(native);
  Match m = store.match(s, tokens);
  ASSERT_EQ(m.tokens(), 2 * kChunk);  // still bit-exact native entries
  StridedKV out(s, m.tokens(), 3);
  m.copy_to(out.view());
  EXPECT_TRUE(testing::same_elements(out.view(), kv.view().slice_tokens(0, 2 * kChunk)));
  EXPECT_EQ(store.stats().disk.entries, 4);
}

TEST_P(StoreInt8, RedisTierCarriesTheInt8Payload) {
  if (RedisServer::binary().empty())
    GTEST_SKIP() << "redis-server is not installed (scripts/bootstrap.sh installs it)";
  RedisServer server;
  ASSERT_TRUE(server.start());
  const ModelSpec s = spec();
  const auto tokens = testing::random_tokens(kTokens, 61);
  StridedKV kv(s, kTokens, 62);
  StoreOptions o = options();
  o.redis.url = server.url();
  o.redis.filter = false;
  testing::DenseKV first(s, 2 * kChunk, 1), second(s, 2 * kChunk, 2);
  KVStore a(o);
  ASSERT_EQ(a.put(s, tokens, kv.view()), 2 * kChunk);
  a.match(s, tokens).copy_to(first.view);
  const int64_t payload = detail::int8_payload_bytes(3, kChunk, 3, 18);
  EXPECT_EQ(a.stats().redis.bytes_written,
            2 * static_cast<int64_t>(detail::entry_encoded_bytes(kChunk, payload)));
  KVStore b(o);
  Match m = b.match(s, tokens);
  ASSERT_EQ(m.tokens(), 2 * kChunk);
  EXPECT_EQ(b.stats().redis.hit_chunks, 2);
  EXPECT_EQ(b.stats().redis.corrupt, 0);
  m.copy_to(second.view);
  EXPECT_TRUE(testing::same_elements(first.view, second.view));
}

TEST_P(StoreInt8, NonFiniteKVIsRejected) {
  const ModelSpec s = spec();
  const auto tokens = testing::random_tokens(kTokens, 71);
  StridedKV kv(s, kTokens, 72);
  const int64_t es = static_cast<int64_t>(dtype_size(s.dtype));
  write_element(static_cast<char*>(kv.values[1].data) + 5 * es, s.dtype, std::nanf(""));
  KVStore store(options());
  EXPECT_THROW(store.put(s, tokens, kv.view()), InvalidArgument);
  EXPECT_EQ(store.stats().entries, 0);
}

// The codec alone on an odd head dim: one group of all 37 tokens, strided in and out.
TEST_P(StoreInt8, CodecOnOddHeadDimMatchesTheFloat64Reference) {
  ModelSpec s = testing::small_spec(GetParam(), 3, 3, 18);
  s.head_dim = 17;  // StridedKV needs only the geometry, not a valid spec
  StridedKV kv(s, kTokens, 81);
  std::vector<float> payload(
      static_cast<size_t>(detail::int8_payload_bytes(3, kTokens, 3, 17) + 3) / 4);
  detail::quantize_int8(kv.view(), reinterpret_cast<char*>(payload.data()));
  StridedKV out(s, 30, 82);
  detail::dequantize_int8(reinterpret_cast<const char*>(payload.data()), kTokens, 4, out.view());
  const ErrorReport r = check_against_reference(kv.view(), out.view(), 4, kTokens);
  EXPECT_LE(r.max_excess, 0.0);
  EXPECT_GT(r.rms_relative(), 0.0);
  EXPECT_LT(r.rms_relative(), 0.02);
  EXPECT_THROW(detail::dequantize_int8(reinterpret_cast<const char*>(payload.data()), kTokens, 8,
                                       out.view()),
               InvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, StoreInt8,
                         ::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

// Format version 2: bytes 152..215 carry the provenance (both fingerprints or all zero);
// version 1 entries and half-set or non-hex provenance are corrupt.
TEST(EntryCodec, Version2HeaderCarriesProvenance) {
  detail::EntryHeader h;
  h.geometry.dtype = DType::kFloat16;
  h.geometry.layers = 2;
  h.geometry.chunk = 3;
  h.geometry.kv_heads = 1;
  h.geometry.head_dim = 4;
  h.geometry.payload_bytes = 2 * 2 * 3 * 1 * 4 * 2;
  h.fingerprint = detail::to_fingerprint(std::string(32, 'b'));
  const std::vector<uint32_t> ids = {7, 8, 9};
  const size_t total = detail::entry_encoded_bytes(3, h.geometry.payload_bytes);
  std::vector<unsigned char> buf(total, 0);
  detail::encode_entry_prefix(h, ids.data(), buf.data());
  EXPECT_FALSE(detail::decode_entry_header(buf.data(), total).provenance.converted());
  const std::string source(32, 'c'), adapter = "0123456789abcdef0123456789abcdef";
  h.provenance = detail::to_entry_provenance(Provenance{source, adapter});
  detail::encode_entry_prefix(h, ids.data(), buf.data());
  EXPECT_EQ(std::string(buf.begin() + 152, buf.begin() + 184), source);
  EXPECT_EQ(std::string(buf.begin() + 184, buf.begin() + 216), adapter);
  const detail::EntryHeader back = detail::decode_entry_header(buf.data(), total);
  EXPECT_TRUE(back.provenance == h.provenance);
  EXPECT_EQ(detail::from_entry_provenance(back.provenance).adapter_fingerprint, adapter);
  std::vector<unsigned char> bad = buf;
  bad[190] = 'G';
  EXPECT_THROW(detail::decode_entry_header(bad.data(), total), Corrupt);
  bad = buf;
  std::fill(bad.begin() + 184, bad.begin() + 216, 0);  // a source without an adapter
  EXPECT_THROW(detail::decode_entry_header(bad.data(), total), Corrupt);
  bad = buf;
  bad[8] = 1;  // version 1
  EXPECT_THROW(detail::decode_entry_header(bad.data(), total), Corrupt);
  EXPECT_THROW(detail::to_entry_provenance(Provenance{source, ""}), InvalidArgument);
  EXPECT_THROW(detail::to_entry_provenance(Provenance{source, "ABCDEF0123456789ABCDEF0123456789"}),
               InvalidArgument);
}

TEST(StoreInt8Codec, HeaderRecordsTheStorageFormatAndRejectsUnknownOnes) {
  detail::EntryHeader h;
  h.geometry.dtype = DType::kBFloat16;
  h.geometry.storage = StorageFormat::kInt8;
  h.geometry.layers = 3;
  h.geometry.chunk = 5;
  h.geometry.kv_heads = 2;
  h.geometry.head_dim = 7;
  h.geometry.payload_bytes = detail::int8_payload_bytes(3, 5, 2, 7);
  h.fingerprint = detail::to_fingerprint(std::string(32, 'a'));
  const std::vector<uint32_t> ids = {1, 2, 3, 4, 5};
  const size_t total = detail::entry_encoded_bytes(5, h.geometry.payload_bytes);
  std::vector<unsigned char> buf(total, 0);
  detail::encode_entry_prefix(h, ids.data(), buf.data());
  const detail::EntryHeader back = detail::decode_entry_header(buf.data(), total);
  EXPECT_EQ(back.geometry.storage, StorageFormat::kInt8);
  EXPECT_EQ(back.geometry.payload_bytes, h.geometry.payload_bytes);
  // The native size of the same geometry does not fit an int8 header, and vice versa.
  EXPECT_THROW(detail::decode_entry_header(
                   buf.data(), detail::entry_encoded_bytes(5, 2 * 3 * 5 * 2 * 7 * 2)),
               Corrupt);
  buf[20] = 2;
  EXPECT_THROW(detail::decode_entry_header(buf.data(), total), Corrupt);
  EXPECT_EQ(detail::int8_payload_bytes(int64_t{1} << 24, int64_t{1} << 24, int64_t{1} << 24, 2),
            0);  // overflow is reported, not wrapped
  EXPECT_EQ(parse_storage_format("int8"), StorageFormat::kInt8);
  EXPECT_STREQ(storage_format_name(StorageFormat::kNative), "native");
  EXPECT_THROW(parse_storage_format("int4"), InvalidArgument);
}

}  // namespace
}  // namespace kvbridge
