// Internal reader/writer for the safetensors file format (used for adapter files).
//
// Layout (https://github.com/huggingface/safetensors):
//   u64 little-endian N | N bytes of UTF-8 JSON header | byte buffer
// The header is an object mapping tensor name -> {"dtype", "shape", "data_offsets": [begin, end]}
// (offsets relative to the start of the byte buffer) plus an optional "__metadata__" object of
// string -> string. Tensors are dense, row-major and little-endian. The tensors must tile the
// byte buffer exactly (no holes, no overlap, nothing after the last tensor).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace kvbridge::io {

/// Element types this reader/writer understands (safetensors names F64, F32, F16, BF16, I64, I32,
/// U8). Any other dtype in a file is reported as Corrupt.
enum class StDType { kF64, kF32, kF16, kBF16, kI64, kI32, kU8 };

/// Bytes per element.
size_t st_dtype_size(StDType dtype) noexcept;
/// The safetensors name: "F64", "F32", "F16", "BF16", "I64", "I32" or "U8".
const char* st_dtype_name(StDType dtype) noexcept;

/// One owning tensor: `data` holds the row-major little-endian elements, exactly
/// product(shape) * st_dtype_size(dtype) bytes. An empty shape is a scalar (one element).
struct StTensor {
  std::string name;
  StDType dtype = StDType::kU8;
  std::vector<int64_t> shape;
  std::vector<unsigned char> data;
};

/// Contents of a safetensors file.
struct StFile {
  std::map<std::string, std::string> metadata;  // "__metadata__"; empty when absent
  std::map<std::string, StTensor> tensors;      // by name
};

/// Writes `tensors` (laid out in the given order) and `metadata` to `path`. The header is padded
/// with spaces so the byte buffer starts at an 8-byte aligned file offset; "__metadata__" is
/// omitted when `metadata` is empty. Atomic (src/core/atomic_file.h): writes a temporary file of
/// its own beside `path` (unique per call, so concurrent writers of one path never mix their
/// bytes: the last rename wins), fsyncs it, renames it over `path` and fsyncs the directory, so
/// readers see the old file or a whole new one.
/// Throws InvalidArgument for a bad tensor (negative dim, data size not matching the shape,
/// duplicate name, the reserved name "__metadata__", invalid UTF-8 in a string) and Unavailable
/// when the file cannot be written.
void write_safetensors(const std::string& path, const std::vector<StTensor>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

/// Reads and validates a whole file. Throws NotFound when `path` does not exist, Unavailable when
/// it cannot be read and Corrupt when its contents are not a valid safetensors file.
StFile read_safetensors(const std::string& path);

/// Parses and validates `size` bytes of a safetensors file; the result owns copies of the tensor
/// bytes. Throws Corrupt, with a message saying what is wrong, for any invalid input; never reads
/// outside [data, data + size). `data` may be null only when `size` is 0.
StFile parse_safetensors(const unsigned char* data, size_t size);

}  // namespace kvbridge::io
