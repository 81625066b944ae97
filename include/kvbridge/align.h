// Token alignment between two tokenizations of one text (models with different tokenizers).
//
// Each tokenization is given as one span per token: a half-open [start, end) range of UTF-8
// byte offsets into the text, and a role: "" for an ordinary token, otherwise the special token's
// role ("bos", "eos", or the token's content for other specials such as chat markers). Special
// tokens have an empty range (start == end) at the byte position where they occur.
//
// An alignment assigns every target token j a source token index a(j) in [0, source tokens), or
// kNoSource (-1) where no source token can serve target token j. The adapter then computes target
// token j's KV from source token a(j)'s (keys un-rotated at the source position a(j), re-rotated
// at the target position j).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kvbridge {

/// One token's UTF-8 byte range [start, end) in the text; start <= end.
struct TextSpan {
  int64_t start = 0;
  int64_t end = 0;
  bool operator==(const TextSpan& o) const noexcept { return start == o.start && end == o.end; }
};

/// How an ordinary target token j with span [s_j, e_j) picks its source token (special tokens
/// always align by role, see align()).
enum class AlignPolicy : uint8_t {
  /// The last ordinary source token whose span ends at or before e_j: the source token has seen
  /// no text beyond the end of target token j (it may have seen less).
  kSeen = 0,
  /// The ordinary source token whose span covers j's last byte (e_j - 1); of several sharing that
  /// byte (byte-fallback pieces of one character), the last. It may have seen text past e_j.
  kCovering = 1,
};

/// Marks a target token no source token can serve.
constexpr int64_t kNoSource = -1;

/// "seen" / "covering". Throws InvalidArgument for any other name.
AlignPolicy parse_align_policy(const std::string& name);
const char* align_policy_name(AlignPolicy policy) noexcept;

/// The alignment of `target` onto `source` (two tokenizations of one text), one entry per target
/// token: a source index in [0, source.size()) or kNoSource.
///
/// source, target: spans per token. Ordinary tokens' starts and ends must each be non-decreasing
///     along the sequence (every real tokenizer's offsets are); special tokens' ranges must be
///     empty.
/// source_roles, target_roles: empty (every token ordinary) or one role per token ("" ordinary).
///
/// Ordinary target tokens follow `policy` among the ordinary source tokens, and get kNoSource
/// where none qualifies: under kSeen when no source token ends by e_j (e.g. the source's first
/// token spans more text than the target's first), under kCovering when no source token covers
/// byte e_j - 1 (text the source tokenizer dropped) or j's span is empty.
/// A special target token aligns to a source special token with the same role at the same byte
/// position: the k-th target one of a (role, position) to the k-th source one, kNoSource when the
/// source has fewer (e.g. a target BOS where the source tokenization has none).
/// Throws InvalidArgument for negative or reversed spans, decreasing starts or ends, a non-empty
/// special span, or a role list of the wrong length.
std::vector<int64_t> align(const std::vector<TextSpan>& source,
                           const std::vector<TextSpan>& target, AlignPolicy policy,
                           const std::vector<std::string>& source_roles = {},
                           const std::vector<std::string>& target_roles = {});

}  // namespace kvbridge
