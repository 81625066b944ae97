// kvbridge error model: every failure the library reports is an exception derived from
// kvbridge::Error. A cache miss is not an error; it is an empty Match.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace kvbridge {

/// Base of every exception thrown by kvbridge. what() ends with "[file:line]".
class Error : public std::runtime_error {
 public:
  Error(const std::string& message, const char* file, int line);
  /// The message without the location suffix.
  const std::string& message() const noexcept { return message_; }
  const char* file() const noexcept { return file_; }
  int line() const noexcept { return line_; }

 private:
  std::string message_;
  const char* file_;
  int line_;
};

/// A caller passed a bad argument (shape, dtype, range, mismatched spec). Python: ValueError.
class InvalidArgument : public Error {
  using Error::Error;
};
/// A named thing does not exist. Python: KeyError.
class NotFound : public Error {
  using Error::Error;
};
/// Stored bytes failed validation (bad header, checksum, size). Python: kvbridge.CorruptError.
class Corrupt : public Error {
  using Error::Error;
};
/// A resource (device, server, file system) cannot be used now. Python: kvbridge.UnavailableError.
class Unavailable : public Error {
  using Error::Error;
};

}  // namespace kvbridge

/// Throws `ErrorType` with a streamed message when `cond` is false:
///   KVB_CHECK_AS(kvbridge::Corrupt, n == 8, "header length field is " << n << " bytes");
#define KVB_CHECK_AS(ErrorType, cond, msg)                  \
  do {                                                      \
    if (!(cond)) {                                          \
      std::ostringstream kvb_check_stream_;                 \
      kvb_check_stream_ << msg;                             \
      throw ErrorType(kvb_check_stream_.str(), __FILE__, __LINE__); \
    }                                                       \
  } while (0)

/// Throws kvbridge::InvalidArgument when `cond` is false.
#define KVB_CHECK(cond, msg) KVB_CHECK_AS(::kvbridge::InvalidArgument, cond, msg)
