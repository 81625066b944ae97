#include "src/io/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <system_error>
#include <utility>

#include "kvbridge/error.h"
#include "src/core/atomic_file.h"
#include "src/core/byte_order.h"
#include "src/core/path_check.h"

namespace kvbridge::io {
namespace {

using nlohmann::json;

/// Largest header accepted or written (the reference implementation uses 100 MB).
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;
constexpr char kMetadataKey[] = "__metadata__";

constexpr StDType kAllDTypes[] = {StDType::kF64, StDType::kF32, StDType::kF16, StDType::kBF16,
                                  StDType::kI64, StDType::kI32, StDType::kU8};

bool parse_dtype_name(const std::string& s, StDType* out) {
  for (StDType d : kAllDTypes) {
    if (s == st_dtype_name(d)) {
      *out = d;
      return true;
    }
  }
  return false;
}

std::string errno_text(int err) { return std::error_code(err, std::generic_category()).message(); }

/// Bytes of a tensor with `shape` and element size `esize`, or false when a dim is negative or the
/// element count or byte size of the nonzero dims does not fit in int64 (so callers can always
/// multiply the dims safely).
bool tensor_nbytes(const std::vector<int64_t>& shape, size_t esize, uint64_t* out) {
  constexpr uint64_t kLimit = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  uint64_t product = esize;
  bool any_zero = false;
  for (int64_t d : shape) {
    if (d < 0) return false;
    if (d == 0) {
      any_zero = true;
      continue;
    }
    const uint64_t ud = static_cast<uint64_t>(d);
    if (product > kLimit / ud) return false;
    product *= ud;
  }
  *out = any_zero ? 0 : product;
  return true;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

/// A non-negative JSON integer as u64; false for any other JSON value.
bool json_u64(const json& j, uint64_t* out) {
  if (j.is_number_unsigned()) {
    *out = j.get<uint64_t>();
    return true;
  }
  if (j.is_number_integer() && j.get<int64_t>() >= 0) {
    *out = static_cast<uint64_t>(j.get<int64_t>());
    return true;
  }
  return false;
}

StTensor parse_tensor_entry(const std::string& name, const json& entry, uint64_t buffer_size,
                            uint64_t* begin, uint64_t* end) {
  KVB_CHECK_AS(Corrupt, entry.is_object(),
               "safetensors: tensor '" << name << "': entry is a JSON " << entry.type_name()
                                       << ", expected an object");
  StTensor t;
  t.name = name;

  const auto dtype_it = entry.find("dtype");
  KVB_CHECK_AS(Corrupt, dtype_it != entry.end(),
               "safetensors: tensor '" << name << "': missing \"dtype\"");
  KVB_CHECK_AS(Corrupt, dtype_it->is_string(),
               "safetensors: tensor '" << name << "': \"dtype\" is a JSON "
                                       << dtype_it->type_name() << ", expected a string");
  const std::string& dtype_name = dtype_it->get_ref<const std::string&>();
  KVB_CHECK_AS(Corrupt, parse_dtype_name(dtype_name, &t.dtype),
               "safetensors: tensor '" << name << "': unsupported dtype '" << dtype_name
                                       << "' (expected F64, F32, F16, BF16, I64, I32 or U8)");

  const auto shape_it = entry.find("shape");
  KVB_CHECK_AS(Corrupt, shape_it != entry.end(),
               "safetensors: tensor '" << name << "': missing \"shape\"");
  KVB_CHECK_AS(Corrupt, shape_it->is_array(),
               "safetensors: tensor '" << name << "': \"shape\" is a JSON "
                                       << shape_it->type_name() << ", expected an array");
  t.shape.reserve(shape_it->size());
  for (const json& dim : *shape_it) {
    KVB_CHECK_AS(Corrupt, dim.is_number_integer(),
                 "safetensors: tensor '" << name << "': shape element is a JSON "
                                         << (dim.is_number() ? "non-integer number"
                                                             : dim.type_name())
                                         << ", expected an integer");
    if (dim.is_number_unsigned()) {
      const uint64_t u = dim.get<uint64_t>();
      KVB_CHECK_AS(Corrupt, u <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()),
                   "safetensors: tensor '" << name << "': dim " << u << " is too large");
      t.shape.push_back(static_cast<int64_t>(u));
    } else {
      const int64_t d = dim.get<int64_t>();
      KVB_CHECK_AS(Corrupt, d >= 0, "safetensors: tensor '" << name << "': negative dim " << d);
      t.shape.push_back(d);
    }
  }

  const auto off_it = entry.find("data_offsets");
  KVB_CHECK_AS(Corrupt, off_it != entry.end(),
               "safetensors: tensor '" << name << "': missing \"data_offsets\"");
  KVB_CHECK_AS(Corrupt, off_it->is_array() && off_it->size() == 2,
               "safetensors: tensor '" << name
                                       << "': \"data_offsets\" must be an array of 2 integers");
  KVB_CHECK_AS(Corrupt, json_u64((*off_it)[0], begin) && json_u64((*off_it)[1], end),
               "safetensors: tensor '" << name
                                       << "': \"data_offsets\" must hold non-negative integers");
  KVB_CHECK_AS(Corrupt, *begin <= *end,
               "safetensors: tensor '" << name << "': data_offsets begin " << *begin
                                       << " is after end " << *end);
  KVB_CHECK_AS(Corrupt, *end <= buffer_size,
               "safetensors: tensor '" << name << "': data_offsets end " << *end
                                       << " is past the end of the " << buffer_size
                                       << "-byte data buffer");

  uint64_t nbytes = 0;
  KVB_CHECK_AS(Corrupt, tensor_nbytes(t.shape, st_dtype_size(t.dtype), &nbytes),
               "safetensors: tensor '" << name << "': shape " << shape_text(t.shape)
                                       << " is too large");
  KVB_CHECK_AS(Corrupt, nbytes == *end - *begin,
               "safetensors: tensor '" << name << "': shape " << shape_text(t.shape) << " of "
                                       << dtype_name << " needs " << nbytes
                                       << " bytes but data_offsets [" << *begin << ", " << *end
                                       << "] span " << (*end - *begin));
  return t;
}

}  // namespace

size_t st_dtype_size(StDType dtype) noexcept {
  switch (dtype) {
    case StDType::kF64:
    case StDType::kI64:
      return 8;
    case StDType::kF32:
    case StDType::kI32:
      return 4;
    case StDType::kF16:
    case StDType::kBF16:
      return 2;
    case StDType::kU8:
      return 1;
  }
  return 0;
}

const char* st_dtype_name(StDType dtype) noexcept {
  switch (dtype) {
    case StDType::kF64:
      return "F64";
    case StDType::kF32:
      return "F32";
    case StDType::kF16:
      return "F16";
    case StDType::kBF16:
      return "BF16";
    case StDType::kI64:
      return "I64";
    case StDType::kI32:
      return "I32";
    case StDType::kU8:
      return "U8";
  }
  return "unknown";
}

StFile parse_safetensors(const unsigned char* data, size_t size) {
  KVB_CHECK(data != nullptr || size == 0, "parse_safetensors: null data with size " << size);
  KVB_CHECK_AS(Corrupt, size >= 8,
               "safetensors: file is " << size
                                       << " bytes, shorter than the 8-byte header length field");
  const uint64_t header_len = detail::load_le64(data);
  KVB_CHECK_AS(Corrupt, header_len <= kMaxHeaderBytes,
               "safetensors: header length " << header_len << " exceeds the limit of "
                                             << kMaxHeaderBytes << " bytes");
  KVB_CHECK_AS(Corrupt, header_len <= size - 8,
               "safetensors: header length " << header_len << " is larger than the "
                                             << (size - 8)
                                             << " bytes after the length field");
  const char* header_begin = reinterpret_cast<const char*>(data + 8);
  const char* header_end = header_begin + header_len;
  KVB_CHECK_AS(Corrupt, header_len > 0 && header_begin[0] == '{',
               "safetensors: header does not start with '{'");

  // nlohmann's lexer treats NUL as the end of input, which would silently ignore what follows.
  const void* nul = std::memchr(header_begin, '\0', header_len);
  KVB_CHECK_AS(Corrupt, nul == nullptr,
               "safetensors: header contains a NUL byte at offset "
                   << (static_cast<const char*>(nul) - header_begin));

  json header;
  try {
    header = json::parse(header_begin, header_end, nullptr, /*allow_exceptions=*/false,
                         /*ignore_comments=*/false);
  } catch (const json::exception& e) {
    KVB_CHECK_AS(Corrupt, false, "safetensors: header is not valid JSON: " << e.what());
  }
  KVB_CHECK_AS(Corrupt, !header.is_discarded(), "safetensors: header is not valid UTF-8 JSON");
  KVB_CHECK_AS(Corrupt, header.is_object(),
               "safetensors: header is a JSON " << header.type_name() << ", expected an object");

  const unsigned char* buffer = data + 8 + header_len;
  const uint64_t buffer_size = size - 8 - header_len;

  struct Span {
    uint64_t begin, end;
    const std::string* name;
  };
  std::vector<Span> spans;
  spans.reserve(header.size());
  StFile file;
  try {
    for (auto it = header.begin(); it != header.end(); ++it) {
      const std::string& key = it.key();
      if (key == kMetadataKey) {
        if (it->is_null()) continue;  // serde-based writers may emit null for "no metadata"
        KVB_CHECK_AS(Corrupt, it->is_object(),
                     "safetensors: \"__metadata__\" is a JSON " << it->type_name()
                                                                << ", expected an object");
        for (auto m = it->begin(); m != it->end(); ++m) {
          KVB_CHECK_AS(Corrupt, m->is_string(),
                       "safetensors: \"__metadata__\" value of '"
                           << m.key() << "' is a JSON " << m->type_name()
                           << ", expected a string");
          file.metadata.emplace(m.key(), m->get<std::string>());
        }
        continue;
      }
      uint64_t begin = 0, end = 0;
      StTensor t = parse_tensor_entry(key, *it, buffer_size, &begin, &end);
      t.data.assign(buffer + begin, buffer + end);
      auto placed = file.tensors.emplace(key, std::move(t));
      spans.push_back({begin, end, &placed.first->first});
    }
  } catch (const json::exception& e) {  // not expected: every access is type-checked first
    KVB_CHECK_AS(Corrupt, false, "safetensors: malformed header: " << e.what());
  }

  // The tensors must tile the data buffer exactly: no overlap, no holes, nothing left over.
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t offset = 0;
  const std::string* previous = nullptr;
  for (const Span& s : spans) {
    KVB_CHECK_AS(Corrupt, s.begin >= offset,
                 "safetensors: tensor '" << *s.name << "' (bytes [" << s.begin << ", " << s.end
                                         << "]) overlaps tensor '"
                                         << (previous ? *previous : std::string()) << "'");
    KVB_CHECK_AS(Corrupt, s.begin == offset,
                 "safetensors: data buffer has a hole of " << (s.begin - offset)
                                                           << " bytes at offset " << offset
                                                           << " before tensor '" << *s.name
                                                           << "'");
    offset = s.end;
    previous = s.name;
  }
  KVB_CHECK_AS(Corrupt, offset == buffer_size,
               "safetensors: " << (buffer_size - offset) << " bytes of the " << buffer_size
                               << "-byte data buffer after offset " << offset
                               << " belong to no tensor");
  return file;
}

StFile read_safetensors(const std::string& path) {
  detail::check_path(path, "safetensors: path");
  int fd;
  do {  // O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused below)
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) {
    const int err = errno;
    KVB_CHECK_AS(NotFound, err != ENOENT && err != ENOTDIR,
                 "safetensors: no file '" << path << "'");
    KVB_CHECK_AS(Unavailable, false,
                 "safetensors: cannot open '" << path << "': " << errno_text(err));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    KVB_CHECK_AS(Corrupt, false,
                 "safetensors: '" << path << "' is not a regular file (a device, FIFO, socket "
                                     "or directory is never read)");
  }
  // A regular file's size bounds the read; the header length is checked against it by
  // parse_safetensors before anything is sized from the header.
  std::vector<unsigned char> bytes(static_cast<size_t>(st.st_size));
  size_t got = 0;
  while (got < bytes.size()) {
    const ssize_t n = ::read(fd, bytes.data() + got, bytes.size() - got);
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      ::close(fd);
      KVB_CHECK_AS(Unavailable, false,
                   "safetensors: cannot read '" << path << "': " << errno_text(err));
    }
    if (n == 0) break;  // shrank while reading: parsed as the shorter file it now is
    got += static_cast<size_t>(n);
  }
  bytes.resize(got);
  ::close(fd);
  try {
    return parse_safetensors(bytes.data(), bytes.size());
  } catch (const Corrupt& e) {
    throw Corrupt("'" + path + "': " + e.message(), e.file(), e.line());
  }
}

void write_safetensors(const std::string& path, const std::vector<StTensor>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  detail::check_path(path, "safetensors: path");
  json header = json::object();
  std::set<std::string> names;
  uint64_t offset = 0;
  for (const StTensor& t : tensors) {
    KVB_CHECK(t.name != kMetadataKey,
              "write_safetensors: the tensor name \"__metadata__\" is reserved");
    KVB_CHECK(names.insert(t.name).second,
              "write_safetensors: duplicate tensor name '" << t.name << "'");
    uint64_t nbytes = 0;
    KVB_CHECK(tensor_nbytes(t.shape, st_dtype_size(t.dtype), &nbytes),
              "write_safetensors: tensor '" << t.name << "': invalid shape "
                                            << shape_text(t.shape));
    KVB_CHECK(nbytes == t.data.size(),
              "write_safetensors: tensor '" << t.name << "': shape " << shape_text(t.shape)
                                            << " of " << st_dtype_name(t.dtype) << " needs "
                                            << nbytes << " bytes, data has " << t.data.size());
    header[t.name] = {{"dtype", st_dtype_name(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
  }
  if (!metadata.empty()) header[kMetadataKey] = metadata;

  std::string text;
  try {
    text = header.dump();
  } catch (const json::exception& e) {
    KVB_CHECK(false, "write_safetensors: a tensor name or metadata string is not valid UTF-8 ("
                         << e.what() << ")");
  }
  while ((8 + text.size()) % 8 != 0) text.push_back(' ');
  KVB_CHECK(text.size() <= kMaxHeaderBytes,
            "write_safetensors: header of " << text.size() << " bytes exceeds the limit of "
                                            << kMaxHeaderBytes << " bytes");

  // A temporary file of this writer's own (unique per call, so writers of one path, in any
  // threads or processes, never share one), fsynced, renamed over `path`, the directory fsynced.
  detail::AtomicFile file = detail::AtomicFile::create(path, {}, "write_safetensors");
  unsigned char len[8];
  detail::store_le64(len, text.size());
  file.write_or_throw(len, sizeof(len), "write_safetensors");
  file.write_or_throw(text.data(), text.size(), "write_safetensors");
  for (const StTensor& t : tensors)
    file.write_or_throw(t.data.data(), t.data.size(), "write_safetensors");
  file.commit("write_safetensors");
}

}  // namespace kvbridge::io
