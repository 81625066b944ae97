#include "kvbridge/hash128.h"

namespace kvbridge {

std::string Hash128::hex() const {
  static const char* digits = "0123456789abcdef";
  std::string s(32, '0');
  for (int i = 0; i < 16; ++i) {
    s[15 - i] = digits[(high >> (4 * i)) & 0xf];
    s[31 - i] = digits[(low >> (4 * i)) & 0xf];
  }
  return s;
}

}  // namespace kvbridge
