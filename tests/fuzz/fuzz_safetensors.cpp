// libFuzzer target: the safetensors parser (src/io/safetensors.cpp) on arbitrary bytes. A
// malformed file must be a kvbridge::Error (Corrupt); anything else escaping is a finding.
#include <cstddef>
#include <cstdint>

#include "kvbridge/error.h"
#include "src/io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const kvbridge::io::StFile file = kvbridge::io::parse_safetensors(data, size);
    size_t bytes = 0;
    for (const auto& [name, t] : file.tensors) bytes += t.data.size() + name.size();
    for (const auto& [k, v] : file.metadata) bytes += k.size() + v.size();
    if (bytes > 2 * size + 64) __builtin_trap();  // every byte comes from the input
  } catch (const kvbridge::Error&) {
  }
  return 0;
}
