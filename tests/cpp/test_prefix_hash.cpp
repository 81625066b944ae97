#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <sstream>

#include "test_util.h"

namespace kvbridge {
namespace {

std::vector<std::map<std::string, std::string>> read_vectors() {
  std::ifstream in(KVBRIDGE_TEST_VECTORS);
  EXPECT_TRUE(in.good()) << KVBRIDGE_TEST_VECTORS;
  std::vector<std::map<std::string, std::string>> out;
  std::map<std::string, std::string> cur;
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty() && line[0] == '#') continue;
    if (line.empty()) {
      if (!cur.empty()) out.push_back(cur);
      cur.clear();
      continue;
    }
    const size_t eq = line.find('=');
    cur[line.substr(0, eq)] = line.substr(eq + 1);
  }
  if (!cur.empty()) out.push_back(cur);
  return out;
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> parts;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) parts.push_back(item);
  return parts;
}

TEST(PrefixHash, SharedVectors) {
  const auto vectors = read_vectors();
  ASSERT_GE(vectors.size(), 3u);
  for (const auto& v : vectors) {
    auto get = [&](const char* k, const char* dflt) {
      auto it = v.find(k);
      return it == v.end() ? std::string(dflt) : it->second;
    };
    ModelSpec spec;
    spec.name = get("name", "");
    spec.version = get("version", "");
    spec.tokenizer = get("tokenizer", "");
    spec.num_layers = std::stoll(get("num_layers", "0"));
    spec.num_kv_heads = std::stoll(get("num_kv_heads", "0"));
    spec.head_dim = std::stoll(get("head_dim", "0"));
    spec.dtype = parse_dtype(get("dtype", "float32"));
    spec.rope_base = std::stod(get("rope_base", "10000"));
    spec.rope_style = parse_rope_style(get("rope_style", "half"));
    std::vector<int64_t> tokens;
    for (const auto& t : split(get("tokens", ""))) tokens.push_back(std::stoll(t));

    EXPECT_EQ(spec.fingerprint(), get("fingerprint", "")) << spec.name;
    const Hash128 salt = prefix_salt(get("namespace", ""), spec);
    EXPECT_EQ(salt.hex(), get("salt", ""));
    const auto chain = prefix_hashes(salt, tokens, std::stoll(get("chunk_tokens", "0")));
    const auto expected = split(get("chain", ""));
    ASSERT_EQ(chain.size(), expected.size());
    for (size_t i = 0; i < chain.size(); ++i) EXPECT_EQ(chain[i].hex(), expected[i]) << i;
  }
}

TEST(PrefixHash, ChainDependsOnEverythingBefore) {
  const ModelSpec spec = testing::small_spec();
  auto tokens = testing::random_tokens(64, 5);
  const Hash128 salt = prefix_salt("default", spec);
  const auto a = prefix_hashes(salt, tokens, 16);
  ASSERT_EQ(a.size(), 4u);
  tokens[3] ^= 1;  // a change in chunk 0 changes every later hash
  const auto b = prefix_hashes(salt, tokens, 16);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NE(a[i], b[i]) << i;
  EXPECT_NE(prefix_salt("tenant-b", spec), salt);
  ModelSpec other = spec;
  other.version = "lora-1";
  EXPECT_NE(prefix_salt("default", other), salt);
}

TEST(PrefixHash, PartialChunkIsNotHashed) {
  const auto tokens = testing::random_tokens(47, 1);
  EXPECT_EQ(prefix_hashes(prefix_salt("x", testing::small_spec()), tokens, 16).size(), 2u);
}

TEST(PrefixHash, RejectsBadTokens) {
  const Hash128 salt = prefix_salt("default", testing::small_spec());
  std::vector<int64_t> tokens = {1, 2, -3, 4};
  try {
    prefix_hashes(salt, tokens, 2);
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("tokens[2]"), std::string::npos) << e.what();
  }
  tokens = {int64_t{1} << 32};
  EXPECT_THROW(prefix_hashes(salt, tokens, 1), InvalidArgument);
  EXPECT_THROW(prefix_hashes(salt, std::vector<int64_t>{}, 1), InvalidArgument);
  EXPECT_THROW(prefix_hashes(salt, std::vector<int64_t>{1}, 0), InvalidArgument);
}

}  // namespace
}  // namespace kvbridge
