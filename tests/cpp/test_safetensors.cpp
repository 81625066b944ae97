// Tests of the internal safetensors reader/writer (src/io/safetensors.h).
#include "src/io/safetensors.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "kvbridge/error.h"

namespace kvbridge::io {
namespace {

namespace fs = std::filesystem;
using Bytes = std::vector<unsigned char>;

constexpr StDType kDTypes[] = {StDType::kF64, StDType::kF32, StDType::kF16, StDType::kBF16,
                               StDType::kI64, StDType::kI32, StDType::kU8};

int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

/// A tensor with seeded random bytes, none of them zero.
StTensor random_tensor(const std::string& name, StDType dtype, std::vector<int64_t> shape,
                       uint64_t seed) {
  StTensor t;
  t.name = name;
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.data.resize(static_cast<size_t>(numel(t.shape)) * st_dtype_size(dtype));
  std::mt19937_64 rng(seed);
  for (auto& b : t.data) b = static_cast<unsigned char>(rng() | 1);
  return t;
}

template <typename T>
StTensor typed_tensor(const std::string& name, StDType dtype, std::vector<int64_t> shape,
                      const std::vector<T>& values) {
  StTensor t;
  t.name = name;
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.data.resize(values.size() * sizeof(T));
  if (!values.empty()) std::memcpy(t.data.data(), values.data(), t.data.size());  // little-endian
  return t;
}

template <typename T>
std::vector<T> values_of(const StTensor& t) {
  std::vector<T> v(t.data.size() / sizeof(T));
  if (!v.empty()) std::memcpy(v.data(), t.data.data(), v.size() * sizeof(T));
  return v;
}

/// 8-byte little-endian length + `header` + `buffer`.
Bytes make_file(const std::string& header, const Bytes& buffer = {}) {
  const uint64_t n = header.size();
  Bytes out;
  out.reserve(8 + header.size() + buffer.size());
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<unsigned char>(n >> (8 * i)));
  for (char c : header) out.push_back(static_cast<unsigned char>(c));
  for (unsigned char c : buffer) out.push_back(c);
  return out;
}

Bytes read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

uint64_t header_length(const Bytes& file) {
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(file.at(i)) << (8 * i);
  return n;
}

/// parse_safetensors must throw Corrupt; returns its message.
std::string corrupt_message(const Bytes& bytes) {
  try {
    parse_safetensors(bytes.data(), bytes.size());
  } catch (const Corrupt& e) {
    return e.message();
  }
  ADD_FAILURE() << "no Corrupt thrown";
  return "";
}

void expect_same(const StTensor& a, const StTensor& b) {
  EXPECT_EQ(a.name, b.name);
  EXPECT_EQ(a.dtype, b.dtype) << a.name;
  EXPECT_EQ(a.shape, b.shape) << a.name;
  EXPECT_EQ(a.data, b.data) << a.name;
}

class Safetensors : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() /
           ("kvbridge_st_" + std::to_string(::getpid()) + "_" + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  /// A valid file holding a few tensors of different dtypes, for the corruption tests.
  Bytes sample_file() {
    const std::string p = path("sample.safetensors");
    write_safetensors(p,
                      {random_tensor("a", StDType::kF32, {2, 3}, 1),
                       random_tensor("b.weight", StDType::kBF16, {5}, 2),
                       random_tensor("empty", StDType::kI64, {0, 4}, 3),
                       random_tensor("s", StDType::kU8, {}, 4)},
                      {{"format", "pt"}});
    return read_bytes(p);
  }

  fs::path dir_;
};

TEST_F(Safetensors, DTypeSizesAndNames) {
  EXPECT_EQ(st_dtype_size(StDType::kF64), 8u);
  EXPECT_EQ(st_dtype_size(StDType::kF32), 4u);
  EXPECT_EQ(st_dtype_size(StDType::kF16), 2u);
  EXPECT_EQ(st_dtype_size(StDType::kBF16), 2u);
  EXPECT_EQ(st_dtype_size(StDType::kI64), 8u);
  EXPECT_EQ(st_dtype_size(StDType::kI32), 4u);
  EXPECT_EQ(st_dtype_size(StDType::kU8), 1u);
  EXPECT_STREQ(st_dtype_name(StDType::kBF16), "BF16");
  EXPECT_STREQ(st_dtype_name(StDType::kU8), "U8");
}

TEST_F(Safetensors, RoundTripEveryDTypeAndOddShapes) {
  const std::vector<std::vector<int64_t>> shapes = {{3, 5, 7}, {1}, {0, 4}, {}, {2, 1, 3, 1}, {11}};
  std::vector<StTensor> tensors;
  uint64_t seed = 100;
  for (StDType dtype : kDTypes)
    for (size_t i = 0; i < shapes.size(); ++i)
      tensors.push_back(random_tensor(std::string(st_dtype_name(dtype)) + "/t" +
                                          std::to_string(i),
                                      dtype, shapes[i], seed++));
  const std::map<std::string, std::string> metadata = {{"format", "pt"}, {"rank", "8"}};
  const std::string p = path("all.safetensors");
  write_safetensors(p, tensors, metadata);

  const StFile f = read_safetensors(p);
  EXPECT_EQ(f.metadata, metadata);
  ASSERT_EQ(f.tensors.size(), tensors.size());
  for (const StTensor& t : tensors) {
    const auto it = f.tensors.find(t.name);
    ASSERT_NE(it, f.tensors.end()) << t.name;
    expect_same(it->second, t);
  }
  // The scalar holds one element; the [0, 4] tensor none.
  EXPECT_EQ(f.tensors.at("F64/t3").data.size(), 8u);
  EXPECT_TRUE(f.tensors.at("I32/t2").data.empty());

  // parse_safetensors on the same bytes gives the same result.
  const Bytes bytes = read_bytes(p);
  const StFile g = parse_safetensors(bytes.data(), bytes.size());
  EXPECT_EQ(g.metadata, metadata);
  EXPECT_EQ(g.tensors.size(), tensors.size());
}

TEST_F(Safetensors, MetadataRoundTrip) {
  const std::map<std::string, std::string> metadata = {
      {"format", "pt"},
      {"quote\"and\\backslash", "line\nbreak\ttab"},
      {"unicode", "\xc3\xa9t\xc3\xa9 \xe2\x9c\x93"},
      {"", "empty key"},
      {"empty value", ""}};
  const std::string p = path("meta.safetensors");
  write_safetensors(p, {random_tensor("x", StDType::kF16, {4}, 7)}, metadata);
  const StFile f = read_safetensors(p);
  EXPECT_EQ(f.metadata, metadata);

  // Without metadata there is no "__metadata__" key at all, and nothing comes back.
  write_safetensors(p, {random_tensor("x", StDType::kF16, {4}, 7)}, {});
  const Bytes bytes = read_bytes(p);
  const std::string header(bytes.begin() + 8, bytes.begin() + 8 + header_length(bytes));
  EXPECT_EQ(header.find("__metadata__"), std::string::npos) << header;
  EXPECT_TRUE(read_safetensors(p).metadata.empty());

  // A file with no tensors at all is valid.
  write_safetensors(p, {}, {{"only", "metadata"}});
  const StFile g = read_safetensors(p);
  EXPECT_TRUE(g.tensors.empty());
  EXPECT_EQ(g.metadata.at("only"), "metadata");
}

TEST_F(Safetensors, HeaderIsPaddedSoDataStartIsAligned) {
  const std::string p = path("align.safetensors");
  for (size_t name_len = 1; name_len <= 24; ++name_len) {
    const std::vector<StTensor> tensors = {
        random_tensor(std::string(name_len, 'n'), StDType::kU8, {3}, name_len),
        random_tensor("w", StDType::kF32, {2, 2}, name_len + 1)};
    write_safetensors(p, tensors, name_len % 2 ? std::map<std::string, std::string>{}
                                               : std::map<std::string, std::string>{{"k", "v"}});
    const Bytes bytes = read_bytes(p);
    const uint64_t n = header_length(bytes);
    EXPECT_EQ((8 + n) % 8, 0u) << name_len;
    ASSERT_EQ(bytes.size(), 8 + n + 3 + 16);
    EXPECT_EQ(bytes[8], '{');
    // The header is JSON followed only by space padding.
    const std::string header(bytes.begin() + 8, bytes.begin() + 8 + n);
    const size_t close = header.find_last_of('}');
    ASSERT_NE(close, std::string::npos);
    EXPECT_EQ(header.find_first_not_of(' ', close + 1), std::string::npos);
    EXPECT_LT(header.size() - close - 1, 8u);
    // The data is laid out in the order given.
    EXPECT_TRUE(std::equal(tensors[0].data.begin(), tensors[0].data.end(), bytes.begin() + 8 + n));
    expect_same(read_safetensors(p).tensors.at("w"), tensors[1]);
  }
}

TEST_F(Safetensors, WriteReplacesAtomicallyAndLeavesNoTemporaryFile) {
  const std::string p = path("replace.safetensors");
  write_safetensors(p, {random_tensor("old", StDType::kI32, {9}, 1)}, {});
  write_safetensors(p, {random_tensor("new", StDType::kI64, {2}, 2)}, {{"v", "2"}});
  const StFile f = read_safetensors(p);
  EXPECT_EQ(f.tensors.count("old"), 0u);
  EXPECT_EQ(f.tensors.count("new"), 1u);
  size_t entries = 0;
  for (const auto& e : fs::directory_iterator(dir_)) {
    ++entries;
    EXPECT_EQ(e.path().filename().string(), "replace.safetensors");
  }
  EXPECT_EQ(entries, 1u);
}

TEST_F(Safetensors, WriteRejectsBadTensors) {
  const std::string p = path("bad.safetensors");
  StTensor t = random_tensor("t", StDType::kF32, {2, 3}, 1);
  t.data.pop_back();
  EXPECT_THROW(write_safetensors(p, {t}, {}), InvalidArgument);
  t = random_tensor("t", StDType::kF32, {2, 3}, 1);
  t.shape = {-2, -3};
  EXPECT_THROW(write_safetensors(p, {t}, {}), InvalidArgument);
  t = random_tensor("t", StDType::kF32, {2, 3}, 1);
  EXPECT_THROW(write_safetensors(p, {t, t}, {}), InvalidArgument);
  t.name = "__metadata__";
  EXPECT_THROW(write_safetensors(p, {t}, {}), InvalidArgument);
  t.name = "bad\xff utf8";
  EXPECT_THROW(write_safetensors(p, {t}, {}), InvalidArgument);
  t.name = "ok";
  EXPECT_THROW(write_safetensors(p, {t}, {{"k", "\xc3"}}), InvalidArgument);
  t.shape = {int64_t{1} << 62, 8};
  EXPECT_THROW(write_safetensors(p, {t}, {}), InvalidArgument);
  EXPECT_FALSE(fs::exists(p));
  EXPECT_TRUE(fs::is_empty(dir_));
}

TEST_F(Safetensors, MissingFileIsNotFoundAndUnwritablePathIsUnavailable) {
  EXPECT_THROW(read_safetensors(path("nope.safetensors")), NotFound);
  EXPECT_THROW(read_safetensors(path("no_dir/nope.safetensors")), NotFound);
  // Only regular files are read: a directory or a device is refused before any read (reading
  // /dev/zero never ended).
  EXPECT_THROW(read_safetensors(dir_.string()), Corrupt);
  EXPECT_THROW(read_safetensors("/dev/zero"), Corrupt);
  // A NUL byte would cut the C string short and open another file.
  std::ofstream(path("a"), std::ios::binary) << "abc";
  EXPECT_THROW(read_safetensors(path("a") + std::string(1, '\0') + "x"), InvalidArgument);
  EXPECT_THROW(write_safetensors(path("b") + std::string(1, '\0') + "x", {}, {}),
               InvalidArgument);
  EXPECT_THROW(write_safetensors(path("no_dir/x.safetensors"),
                                 {random_tensor("t", StDType::kU8, {1}, 1)}, {}),
               Unavailable);
  // A corrupt file on disk names its path.
  const std::string p = path("short.safetensors");
  std::ofstream(p, std::ios::binary) << "abc";
  try {
    read_safetensors(p);
    FAIL() << "no Corrupt thrown";
  } catch (const Corrupt& e) {
    EXPECT_NE(e.message().find("short.safetensors"), std::string::npos) << e.message();
  }
}

TEST_F(Safetensors, AcceptsValidFilesFromOtherWriters) {
  // Unpadded header, unaligned data start, tensors stored out of name order, extra fields,
  // whitespace and a null "__metadata__".
  const Bytes buffer = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  const std::string header =
      " {\"z\": {\"dtype\": \"U8\", \"shape\": [2], \"data_offsets\": [0, 2], \"extra\": 1},"
      " \"a\": {\"shape\": [2, 2], \"data_offsets\": [2, 10], \"dtype\": \"BF16\"},"
      " \"__metadata__\": null}\n\t";
  EXPECT_NE(corrupt_message(make_file(header, buffer)).find("does not start with '{'"),
            std::string::npos);
  const Bytes bytes = make_file(header.substr(1), buffer);
  const StFile f = parse_safetensors(bytes.data(), bytes.size());
  EXPECT_TRUE(f.metadata.empty());
  ASSERT_EQ(f.tensors.size(), 2u);
  EXPECT_EQ(f.tensors.at("z").data, (Bytes{1, 2}));
  EXPECT_EQ(f.tensors.at("a").dtype, StDType::kBF16);
  EXPECT_EQ(f.tensors.at("a").shape, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(f.tensors.at("a").data, (Bytes{3, 4, 5, 6, 7, 8, 9, 10}));

  // Several empty tensors may share an offset; "{}" is an empty file.
  const Bytes empties = make_file(
      R"({"e1":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},)"
      R"("x":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
      R"("e2":{"dtype":"I64","shape":[3,0],"data_offsets":[1,1]},)"
      R"("e3":{"dtype":"I64","shape":[0],"data_offsets":[1,1]}})",
      {42});
  EXPECT_EQ(parse_safetensors(empties.data(), empties.size()).tensors.size(), 4u);
  const Bytes empty = make_file("{}");
  EXPECT_TRUE(parse_safetensors(empty.data(), empty.size()).tensors.empty());
}

TEST_F(Safetensors, HandMadeCorruptionsThrowCorruptSayingWhy) {
  struct Case {
    const char* what;
    Bytes bytes;
    const char* message_part;
  };
  const std::string u8_2 = R"({"dtype":"U8","shape":[2],"data_offsets":[0,2]})";
  const Bytes two = {7, 9};
  auto one = [&](const std::string& entry, const Bytes& buffer = {7, 9}) {
    return make_file("{\"t\":" + entry + "}", buffer);
  };
  Bytes huge_len(16, 0);
  huge_len[7] = 0x80;  // 2^63
  Bytes over_limit = make_file("{}");
  over_limit[3] = 0x07;  // 0x07000002 bytes > 100 MiB
  Bytes too_long = make_file("{}");
  too_long[0] = 3;
  const std::vector<Case> cases = {
      {"empty", {}, "shorter than the 8-byte"},
      {"7 bytes", Bytes(7, 0), "shorter than the 8-byte"},
      {"length 2^63", huge_len, "exceeds the limit"},
      {"length over 100 MiB", over_limit, "exceeds the limit"},
      {"length past the end", too_long, "is larger than the"},
      {"zero header", make_file(""), "does not start with '{'"},
      {"not json", make_file("{nope}"), "not valid UTF-8 JSON"},
      {"truncated json", make_file("{\"t\":{"), "not valid UTF-8 JSON"},
      {"trailing garbage", make_file("{} x"), "not valid UTF-8 JSON"},
      {"two objects", make_file("{}{}"), "not valid UTF-8 JSON"},
      {"nul after the object", make_file(std::string("{}\0 junk", 7)), "NUL byte at offset 2"},
      {"nul in a key", make_file(std::string("{\"a\0\":1}", 7)), "NUL byte at offset 3"},
      {"invalid utf-8 key", make_file("{\"\xff\":1}"), "not valid UTF-8 JSON"},
      {"comment", make_file("{/* c */}"), "not valid UTF-8 JSON"},
      {"entry not object", one("[1]"), "entry is a JSON array"},
      {"missing dtype", one(R"({"shape":[2],"data_offsets":[0,2]})"), "missing \"dtype\""},
      {"missing shape", one(R"({"dtype":"U8","data_offsets":[0,2]})"), "missing \"shape\""},
      {"missing offsets", one(R"({"dtype":"U8","shape":[2]})"), "missing \"data_offsets\""},
      {"dtype number", one(R"({"dtype":1,"shape":[2],"data_offsets":[0,2]})"),
       "\"dtype\" is a JSON number"},
      {"unknown dtype", one(R"({"dtype":"F8_E4M3","shape":[2],"data_offsets":[0,2]})"),
       "unsupported dtype 'F8_E4M3'"},
      {"lowercase dtype", one(R"({"dtype":"f32","shape":[2],"data_offsets":[0,8]})"),
       "unsupported dtype"},
      {"shape object", one(R"({"dtype":"U8","shape":{},"data_offsets":[0,2]})"),
       "\"shape\" is a JSON object"},
      {"shape string dim", one(R"({"dtype":"U8","shape":["2"],"data_offsets":[0,2]})"),
       "expected an integer"},
      {"shape float dim", one(R"({"dtype":"U8","shape":[2.0],"data_offsets":[0,2]})"),
       "non-integer number"},
      {"negative dim", one(R"({"dtype":"U8","shape":[-2],"data_offsets":[0,2]})"),
       "negative dim -2"},
      {"negative dims cancel", one(R"({"dtype":"U8","shape":[-1,-2],"data_offsets":[0,2]})"),
       "negative dim"},
      {"dim above int64", one(R"({"dtype":"U8","shape":[9223372036854775808],"data_offsets":[0,2]})"),
       "too large"},
      {"dim above u64", one(R"({"dtype":"U8","shape":[18446744073709551617],"data_offsets":[0,2]})"),
       "non-integer number"},
      {"product overflows",
       one(R"({"dtype":"I64","shape":[4611686018427387904,4],"data_offsets":[0,0]})", {}),
       "too large"},
      {"product wraps to the size",
       one(R"({"dtype":"U8","shape":[4294967296,4294967296,2],"data_offsets":[0,2]})"),
       "too large"},
      {"bytes times dtype size overflow",
       one(R"({"dtype":"F64","shape":[2305843009213693952],"data_offsets":[0,0]})", {}),
       "too large"},
      {"offsets not array", one(R"({"dtype":"U8","shape":[2],"data_offsets":2})"),
       "array of 2 integers"},
      {"offsets 3 long", one(R"({"dtype":"U8","shape":[2],"data_offsets":[0,2,2]})"),
       "array of 2 integers"},
      {"offsets 1 long", one(R"({"dtype":"U8","shape":[2],"data_offsets":[2]})"),
       "array of 2 integers"},
      {"negative offset", one(R"({"dtype":"U8","shape":[2],"data_offsets":[-1,1]})"),
       "non-negative integers"},
      {"float offset", one(R"({"dtype":"U8","shape":[2],"data_offsets":[0,2.5]})"),
       "non-negative integers"},
      {"string offset", one(R"({"dtype":"U8","shape":[2],"data_offsets":["0",2]})"),
       "non-negative integers"},
      {"begin after end", one(R"({"dtype":"U8","shape":[0],"data_offsets":[2,1]})"),
       "is after end"},
      {"end past buffer", one(R"({"dtype":"U8","shape":[3],"data_offsets":[0,3]})"),
       "past the end of the 2-byte data buffer"},
      {"end far past buffer",
       one(R"({"dtype":"U8","shape":[2],"data_offsets":[18446744073709551614,18446744073709551615]})"),
       "past the end"},
      {"size mismatch", one(R"({"dtype":"I32","shape":[1],"data_offsets":[0,2]})"),
       "needs 4 bytes but data_offsets [0, 2] span 2"},
      {"scalar size mismatch", one(R"({"dtype":"U8","shape":[],"data_offsets":[0,2]})"),
       "needs 1 bytes"},
      {"trailing bytes", one(u8_2, {7, 9, 11}), "belong to no tensor"},
      {"buffer without tensors", make_file("{}", {1}), "belong to no tensor"},
      {"hole at the start", one(R"({"dtype":"U8","shape":[1],"data_offsets":[1,2]})"),
       "hole of 1 bytes at offset 0"},
      {"hole in the middle",
       make_file(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                 R"("b":{"dtype":"U8","shape":[1],"data_offsets":[2,3]}})",
                 {1, 2, 3}),
       "hole of 1 bytes at offset 1"},
      {"overlap",
       make_file(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
                 R"("b":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}})",
                 {1, 2, 3}),
       "overlaps tensor 'a'"},
      {"same bytes twice",
       make_file(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
                 R"("b":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})",
                 two),
       "overlaps"},
      {"empty tensor inside another",
       make_file(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
                 R"("b":{"dtype":"U8","shape":[0],"data_offsets":[1,1]}})",
                 two),
       "overlaps"},
      {"metadata not object", make_file(R"({"__metadata__":"x"})"),
       "\"__metadata__\" is a JSON string"},
      {"metadata array", make_file(R"({"__metadata__":[]})"), "expected an object"},
      {"metadata number value", make_file(R"({"__metadata__":{"k":1}})"),
       "value of 'k' is a JSON number"},
      {"metadata nested value", make_file(R"({"__metadata__":{"k":{"a":"b"}}})"),
       "expected a string"},
      {"metadata null value", make_file(R"({"__metadata__":{"k":null}})"), "expected a string"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const std::string msg = corrupt_message(c.bytes);
    EXPECT_NE(msg.find(c.message_part), std::string::npos) << c.what << ": " << msg;
  }
  // A header that is valid JSON but not an object cannot start with '{', so it is caught by the
  // first-byte check; the object check stays as a defence.
  EXPECT_NE(corrupt_message(make_file("[]")).find("does not start with '{'"), std::string::npos);
  EXPECT_NE(corrupt_message(make_file("\"{\"")).find("does not start with '{'"),
            std::string::npos);
  // Null data is only allowed with size 0.
  EXPECT_THROW(parse_safetensors(nullptr, 0), Corrupt);
  EXPECT_THROW(parse_safetensors(nullptr, 8), InvalidArgument);
}

TEST_F(Safetensors, DeeplyNestedJsonIsRejectedWithoutCrashing) {
  std::string header = "{\"t\":";
  header += std::string(200000, '[');
  header += std::string(200000, ']');
  header += "}";
  EXPECT_NE(corrupt_message(make_file(header)).find("entry is a JSON array"), std::string::npos);
  // Unbalanced: never closed.
  EXPECT_NE(corrupt_message(make_file("{\"t\":" + std::string(200000, '['))).find("JSON"),
            std::string::npos);
}

TEST_F(Safetensors, EveryTruncationIsCorrupt) {
  const Bytes file = sample_file();
  ASSERT_TRUE(parse_safetensors(file.data(), file.size()).tensors.size() == 4);
  for (size_t len = 0; len < file.size(); ++len) {
    // Copy into an exact-size buffer so AddressSanitizer catches any read past `len`.
    const Bytes prefix(file.begin(), file.begin() + static_cast<std::ptrdiff_t>(len));
    EXPECT_THROW(parse_safetensors(prefix.data(), prefix.size()), Corrupt) << "length " << len;
  }
  // Appending anything is corrupt too.
  Bytes longer = file;
  longer.push_back(0);
  EXPECT_THROW(parse_safetensors(longer.data(), longer.size()), Corrupt);
}

TEST_F(Safetensors, FlippedBytesGiveCorruptOrAValidParseNeverACrash) {
  const Bytes file = sample_file();
  const uint64_t data_start = 8 + header_length(file);
  size_t corrupt = 0, parsed = 0;
  for (size_t i = 0; i < file.size(); ++i) {
    for (unsigned mask : {0x01u, 0x02u, 0x10u, 0x20u, 0x80u, 0xFFu}) {
      Bytes b = file;
      b[i] ^= static_cast<unsigned char>(mask);
      try {
        const StFile f = parse_safetensors(b.data(), b.size());
        ++parsed;
        // A flip in the length field always breaks the file; a flip in the data buffer never.
        EXPECT_GE(i, 8u) << "offset " << i << " mask " << mask;
        size_t total = 0;
        for (const auto& [name, t] : f.tensors) total += t.data.size();
        EXPECT_EQ(total, file.size() - data_start);
      } catch (const Corrupt&) {
        ++corrupt;
        EXPECT_LT(i, data_start) << "a flip in the data buffer is not detectable";
      } catch (const std::exception& e) {
        ADD_FAILURE() << "offset " << i << " mask " << mask << ": unexpected " << e.what();
      }
    }
  }
  EXPECT_GT(corrupt, 0u);
  EXPECT_GT(parsed, 0u);
}

TEST_F(Safetensors, RandomBytesAreCorrupt) {
  std::mt19937_64 rng(5);
  for (int iter = 0; iter < 3000; ++iter) {
    const size_t size = rng() % 200;
    Bytes b(size);
    for (auto& x : b) x = static_cast<unsigned char>(rng());
    if (size >= 9 && iter % 2 == 0) {  // a plausible length and a '{' to get past the first checks
      const uint64_t n = rng() % (size - 8 + 1);
      for (int i = 0; i < 8; ++i) b[i] = static_cast<unsigned char>(n >> (8 * i));
      if (n > 0) b[8] = '{';
    }
    try {
      parse_safetensors(b.data(), b.size());
    } catch (const Corrupt&) {
      continue;
    }
    // Only a genuinely valid file could parse; random bytes essentially never are.
    ADD_FAILURE() << "random bytes parsed, iteration " << iter;
  }
}

// --- Interop with the reference Python implementation ------------------------------------------

/// Runs `python -c script args...`; true when it exits with status 0.
bool run_python(const std::string& python, const std::string& script,
                const std::vector<std::string>& args) {
  // Single-quoted for /bin/sh: neither the script nor the paths contain single quotes.
  auto quote = [](const std::string& s) {
    EXPECT_EQ(s.find('\''), std::string::npos) << s;
    return "'" + s + "'";
  };
  std::string cmd = quote(python) + " -c " + quote(script);
  for (const auto& a : args) cmd += " " + quote(a);
  const int status = std::system(cmd.c_str());
  return status != -1 && WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

TEST_F(Safetensors, PythonInterop) {
  const char* python_env = std::getenv("KVBRIDGE_PYTHON");
  if (python_env == nullptr || *python_env == '\0')
    GTEST_SKIP() << "KVBRIDGE_PYTHON is not set (a python with the safetensors and numpy "
                    "packages, e.g. .venv/bin/python)";
  const std::string python = python_env;
  ASSERT_TRUE(run_python(python, "import safetensors.numpy, numpy", {}))
      << python << " cannot import safetensors and numpy";

  // (1) The library writes; safetensors.numpy reads. (numpy has no bfloat16, so no BF16 here.)
  std::vector<double> f64(6);
  for (size_t i = 0; i < f64.size(); ++i) f64[i] = 0.25 * static_cast<double>(i) - 1.0;
  std::vector<float> f32(3 * 5 * 7);
  for (size_t i = 0; i < f32.size(); ++i) f32[i] = 0.5f * static_cast<float>(i) + 1.0f;
  const std::vector<uint16_t> f16 = {0x3C00, 0x4000, 0xB800, 0x7BFF};  // 1, 2, -0.5, 65504
  const std::vector<int64_t> i64 = {-3, 0, int64_t{1} << 40, -(int64_t{1} << 50), 7};
  const std::vector<int32_t> i32 = {-2147483647 - 1, -1, 1, 2147483647};
  const std::vector<uint8_t> u8 = {0, 1, 2, 127, 128, 254, 255};
  const std::string out = path("from_cpp.safetensors");
  write_safetensors(out,
                    {typed_tensor("f64", StDType::kF64, {2, 3}, f64),
                     typed_tensor("f32", StDType::kF32, {3, 5, 7}, f32),
                     typed_tensor("f16", StDType::kF16, {4}, f16),
                     typed_tensor("i64", StDType::kI64, {5}, i64),
                     typed_tensor("i32", StDType::kI32, {2, 2}, i32),
                     typed_tensor("u8", StDType::kU8, {7}, u8),
                     typed_tensor("empty", StDType::kF32, {0, 4}, std::vector<float>{}),
                     typed_tensor("scalar", StDType::kI64, {}, std::vector<int64_t>{42})},
                    {{"format", "np"}, {"writer", "kvbridge"}});
  const std::string check_script = R"PY(
import sys
import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file
t = load_file(sys.argv[1])
expect = {
    "f64": np.arange(6, dtype=np.float64).reshape(2, 3) * 0.25 - 1.0,
    "f32": np.arange(105, dtype=np.float32).reshape(3, 5, 7) * np.float32(0.5) + np.float32(1),
    "f16": np.array([1, 2, -0.5, 65504], dtype=np.float16),
    "i64": np.array([-3, 0, 1 << 40, -(1 << 50), 7], dtype=np.int64),
    "i32": np.array([[-2147483648, -1], [1, 2147483647]], dtype=np.int32),
    "u8": np.array([0, 1, 2, 127, 128, 254, 255], dtype=np.uint8),
    "empty": np.zeros((0, 4), dtype=np.float32),
    "scalar": np.array(42, dtype=np.int64),
}
assert sorted(t) == sorted(expect), sorted(t)
for k, v in expect.items():
    assert t[k].dtype == v.dtype, (k, t[k].dtype)
    assert t[k].shape == v.shape, (k, t[k].shape)
    assert np.array_equal(t[k], v), (k, t[k])
with safe_open(sys.argv[1], framework="np") as f:
    assert f.metadata() == {"format": "np", "writer": "kvbridge"}, f.metadata()
)PY";
  EXPECT_TRUE(run_python(python, check_script, {out})) << "safetensors could not read " << out;

  // (2) safetensors.numpy writes; the library reads.
  const std::string in = path("from_python.safetensors");
  const std::string save_script = R"PY(
import sys
import numpy as np
from safetensors.numpy import save_file
save_file({
    "w.f32": np.arange(24, dtype=np.float32).reshape(2, 3, 4) * np.float32(0.5),
    "w.f64": np.array(3.5, dtype=np.float64),
    "w.i64": np.arange(-5, 5, dtype=np.int64),
    "w.i32": np.zeros((0, 3), dtype=np.int32),
    "w.u8": np.arange(10, dtype=np.uint8),
    "w.f16": np.array([1, 2, -0.5], dtype=np.float16),
}, sys.argv[1], metadata={"a": "b", "note": "x y"})
)PY";
  ASSERT_TRUE(run_python(python, save_script, {in})) << "safetensors could not write " << in;
  const StFile f = read_safetensors(in);
  EXPECT_EQ(f.metadata, (std::map<std::string, std::string>{{"a", "b"}, {"note", "x y"}}));
  ASSERT_EQ(f.tensors.size(), 6u);
  const StTensor& w32 = f.tensors.at("w.f32");
  EXPECT_EQ(w32.dtype, StDType::kF32);
  EXPECT_EQ(w32.shape, (std::vector<int64_t>{2, 3, 4}));
  const auto v32 = values_of<float>(w32);
  ASSERT_EQ(v32.size(), 24u);
  for (size_t i = 0; i < v32.size(); ++i) EXPECT_EQ(v32[i], 0.5f * static_cast<float>(i));
  const StTensor& w64 = f.tensors.at("w.f64");
  EXPECT_EQ(w64.dtype, StDType::kF64);
  EXPECT_TRUE(w64.shape.empty());
  EXPECT_EQ(values_of<double>(w64), (std::vector<double>{3.5}));
  EXPECT_EQ(f.tensors.at("w.i64").dtype, StDType::kI64);
  EXPECT_EQ(values_of<int64_t>(f.tensors.at("w.i64")),
            (std::vector<int64_t>{-5, -4, -3, -2, -1, 0, 1, 2, 3, 4}));
  EXPECT_EQ(f.tensors.at("w.i32").dtype, StDType::kI32);
  EXPECT_EQ(f.tensors.at("w.i32").shape, (std::vector<int64_t>{0, 3}));
  EXPECT_TRUE(f.tensors.at("w.i32").data.empty());
  EXPECT_EQ(f.tensors.at("w.u8").data, (Bytes{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}));
  EXPECT_EQ(f.tensors.at("w.f16").dtype, StDType::kF16);
  EXPECT_EQ(values_of<uint16_t>(f.tensors.at("w.f16")),
            (std::vector<uint16_t>{0x3C00, 0x4000, 0xB800}));
}

}  // namespace
}  // namespace kvbridge::io
