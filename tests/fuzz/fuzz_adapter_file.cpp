// libFuzzer target: adapter files (src/adapter/adapter_file.cpp: safetensors plus JSON metadata
// with both ModelSpecs, the layer map and the fit report). Each input is written to a file and
// loaded; a malformed one must be a kvbridge::Error. Loaded with allow_unchecked, so inputs
// without a checksum (the corpus has one such seed) reach every check after it; a checksum
// that is present is still verified. A loaded file's serving record must give a tail for every
// prompt length.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "kvbridge/adapter.h"
#include "kvbridge/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path = [] {
    const char* base = std::getenv("TMPDIR");
    return std::string(base && *base ? base : "/tmp") + "/kvbridge-fuzz-adapter-" +
           std::to_string(::getpid()) + ".safetensors";
  }();
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) __builtin_trap();
  if (size && std::fwrite(data, 1, size, f) != size) __builtin_trap();
  std::fclose(f);
  try {
    kvbridge::AdapterLoadOptions options;
    options.allow_unchecked = true;
    const kvbridge::LinearAdapter a = kvbridge::LinearAdapter::load(path, options);
    (void)a.source();
    // A loaded serving record gives a tail for any prompt length, never under its fixed tail.
    const kvbridge::ServingDefaults s = a.serving();
    std::vector<int64_t> lengths = {0, 1, 1000, INT64_MAX / 2, INT64_MAX};
    for (const kvbridge::LengthTail& t : s.by_length) {
      lengths.insert(lengths.end(), {t.prompt_tokens - 1, t.prompt_tokens});  // lengths are > 0
      if (t.prompt_tokens < INT64_MAX) lengths.push_back(t.prompt_tokens + 1);
    }
    for (int64_t n : lengths)
      if (n >= 0 && s.tail_for(n) < (s.recorded ? s.recompute_tail : 0)) __builtin_trap();
  } catch (const kvbridge::Error&) {
  }
  std::remove(path.c_str());
  return 0;
}
