// libFuzzer target: an entry file on disk read back through a KVStore's disk tier. Each input is
// written as the file of one known key, a store is opened on the directory and matches that
// key's tokens: the result must be a verified hit or a counted miss (the file moved aside),
// never a crash, an exception out of match() or a torn read.
#include <sys/stat.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "kvbridge/kv_store.h"

using namespace kvbridge;

namespace {

constexpr int64_t kChunk = 4;

ModelSpec spec() {
  ModelSpec s;
  s.name = "fuzz-model";
  s.num_layers = 2;
  s.num_kv_heads = 1;
  s.head_dim = 4;
  s.dtype = DType::kBFloat16;
  return s;
}

struct Fixture {
  std::string dir, file;
  std::vector<int64_t> tokens{11, 22, 33, 44};
  Fixture() {
    const char* base = std::getenv("TMPDIR");
    std::string templ = std::string(base && *base ? base : "/tmp") + "/kvbridge-fuzz-XXXXXX";
    dir = mkdtemp(templ.data());
    const Hash128 key = chain_hash(prefix_salt("default", spec()), tokens.data(), kChunk);
    const std::string hex = key.hex();
    const std::string leaf =
        dir + "/kvbridge-v1/" + spec().fingerprint() + "/" + hex.substr(0, 2);
    std::filesystem::create_directories(leaf);
    file = leaf + "/" + hex + ".kvb";
  }
  ~Fixture() { std::filesystem::remove_all(dir); }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Fixture fx;
  FILE* f = std::fopen(fx.file.c_str(), "wb");
  if (!f) __builtin_trap();
  if (size && std::fwrite(data, 1, size, f) != size) __builtin_trap();
  std::fclose(f);
  StoreOptions o;
  o.capacity_bytes = 1 << 20;
  o.chunk_tokens = kChunk;
  o.num_shards = 1;
  o.disk.dir = fx.dir;
  o.disk.fsync = false;
  {
    KVStore store(o);
    Match m = store.match(spec(), fx.tokens);
    const StoreStats st = store.stats();
    if (m) {
      std::vector<uint16_t> out(static_cast<size_t>(spec().kv_bytes_per_token() * kChunk / 2));
      m.copy_to(KVView::contiguous(out.data(), DType::kBFloat16, Device{}, 2, kChunk, 1, 4));
      if (st.disk.hit_chunks != 1) __builtin_trap();
    } else if (st.disk.corrupt + st.disk.errors + st.disk.expired + st.collisions == 0) {
      __builtin_trap();  // a file for the key that is neither a hit nor a counted miss
    }
  }
  std::filesystem::remove(fx.file);
  std::filesystem::remove_all(fx.dir + "/kvbridge-v1/quarantine");
  return 0;
}
