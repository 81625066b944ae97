#include "kvbridge/align.h"

#include <algorithm>
#include <map>
#include <utility>

#include "kvbridge/error.h"

namespace kvbridge {

AlignPolicy parse_align_policy(const std::string& name) {
  if (name == "seen") return AlignPolicy::kSeen;
  KVB_CHECK(name == "covering", "alignment policy: expected 'seen' or 'covering', got '" << name
                                                                                   << "'");
  return AlignPolicy::kCovering;
}

const char* align_policy_name(AlignPolicy policy) noexcept {
  return policy == AlignPolicy::kCovering ? "covering" : "seen";
}

namespace {

// One side's tokens split by kind, checked: the ordinary tokens' indices (starts and ends
// non-decreasing), and the special tokens keyed by (role, position) in order of occurrence.
struct Side {
  std::vector<int64_t> ordinary;
  std::vector<int64_t> starts, ends;  // of the ordinary tokens, in order
  std::map<std::pair<std::string, int64_t>, std::vector<int64_t>> specials;
};

Side split(const std::vector<TextSpan>& spans, const std::vector<std::string>& roles,
           const char* what) {
  KVB_CHECK(roles.empty() || roles.size() == spans.size(),
            what << "_roles: expected " << spans.size() << " roles (one per token) or none, got "
                 << roles.size());
  Side s;
  for (size_t i = 0; i < spans.size(); ++i) {
    const TextSpan& t = spans[i];
    KVB_CHECK(t.start >= 0 && t.start <= t.end,
              what << " token " << i << ": span [" << t.start << ", " << t.end
                   << ") is not a byte range");
    const bool special = !roles.empty() && !roles[i].empty();
    if (special) {
      KVB_CHECK(t.start == t.end, what << " token " << i << " (special '" << roles[i]
                                       << "'): span [" << t.start << ", " << t.end
                                       << ") must be empty");
      s.specials[{roles[i], t.start}].push_back(static_cast<int64_t>(i));
      continue;
    }
    if (!s.starts.empty())
      KVB_CHECK(t.start >= s.starts.back() && t.end >= s.ends.back(),
                what << " token " << i << ": span [" << t.start << ", " << t.end
                     << ") goes back before the previous ordinary token's ["
                     << s.starts.back() << ", " << s.ends.back() << ")");
    s.ordinary.push_back(static_cast<int64_t>(i));
    s.starts.push_back(t.start);
    s.ends.push_back(t.end);
  }
  return s;
}

}  // namespace

std::vector<int64_t> align(const std::vector<TextSpan>& source,
                           const std::vector<TextSpan>& target, AlignPolicy policy,
                           const std::vector<std::string>& source_roles,
                           const std::vector<std::string>& target_roles) {
  const Side src = split(source, source_roles, "source");
  const Side tgt = split(target, target_roles, "target");
  std::vector<int64_t> out(target.size(), kNoSource);
  for (size_t k = 0; k < tgt.ordinary.size(); ++k) {
    const int64_t e = tgt.ends[k];
    int64_t i = -1;  // index into src.ordinary
    if (policy == AlignPolicy::kSeen) {
      // last source token with end <= e
      i = std::upper_bound(src.ends.begin(), src.ends.end(), e) - src.ends.begin() - 1;
    } else if (e > tgt.starts[k]) {
      // last source token starting at or before byte e - 1; it covers the byte if it ends past it
      // (starts and ends are non-decreasing, so no earlier token ends later)
      i = std::upper_bound(src.starts.begin(), src.starts.end(), e - 1) - src.starts.begin() - 1;
      if (i >= 0 && src.ends[static_cast<size_t>(i)] <= e - 1) i = -1;
    }
    if (i >= 0) out[static_cast<size_t>(tgt.ordinary[k])] = src.ordinary[static_cast<size_t>(i)];
  }
  for (const auto& [key, indices] : tgt.specials) {
    const auto it = src.specials.find(key);
    if (it == src.specials.end()) continue;
    for (size_t n = 0; n < indices.size() && n < it->second.size(); ++n)
      out[static_cast<size_t>(indices[n])] = it->second[n];
  }
  return out;
}

}  // namespace kvbridge
