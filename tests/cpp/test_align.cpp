// Token alignment on hand-made span tables: multi-byte UTF-8, one target token spanning several
// source tokens and the reverse, special tokens by role, uncovered text, empty input, bad input.
#include <gtest/gtest.h>

#include "kvbridge/align.h"
#include "kvbridge/error.h"

namespace kvbridge {
namespace {

using Spans = std::vector<TextSpan>;
using Ids = std::vector<int64_t>;

TEST(Align, ParsesPolicyNames) {
  EXPECT_EQ(parse_align_policy("seen"), AlignPolicy::kSeen);
  EXPECT_EQ(parse_align_policy("covering"), AlignPolicy::kCovering);
  EXPECT_STREQ(align_policy_name(AlignPolicy::kCovering), "covering");
  EXPECT_STREQ(align_policy_name(AlignPolicy::kSeen), "seen");
  EXPECT_THROW(parse_align_policy("nearest"), InvalidArgument);
  EXPECT_THROW(parse_align_policy(""), InvalidArgument);
}

TEST(Align, TargetTextSpanningSeveralSourceTokens) {
  // text "hello world": source bytes-ish pieces, target two words
  const Spans src = {{0, 2}, {2, 5}, {5, 6}, {6, 9}, {9, 11}};
  const Spans tgt = {{0, 5}, {5, 11}};
  EXPECT_EQ(align(src, tgt, AlignPolicy::kSeen), (Ids{1, 4}));
  EXPECT_EQ(align(src, tgt, AlignPolicy::kCovering), (Ids{1, 4}));
}

TEST(Align, SourceTextSpanningSeveralTargetTokens) {
  // source one token per word, target finer pieces
  const Spans src = {{0, 5}, {5, 11}};
  const Spans tgt = {{0, 1}, {1, 5}, {5, 6}, {6, 8}, {8, 11}};
  // seen: the first target token ends before any source token does
  EXPECT_EQ(align(src, tgt, AlignPolicy::kSeen), (Ids{kNoSource, 0, 0, 0, 1}));
  // covering: the source token holding each target token's last byte
  EXPECT_EQ(align(src, tgt, AlignPolicy::kCovering), (Ids{0, 0, 1, 1, 1}));
}

TEST(Align, MultiByteUtf8PiecesOfOneCharacter) {
  // "aé€" = a(1 byte) é(2 bytes) €(3 bytes): source splits € into byte-fallback pieces that each
  // carry the character's whole range; the target has one token for "é€".
  const Spans src = {{0, 1}, {1, 3}, {3, 6}, {3, 6}, {3, 6}};
  const Spans tgt = {{0, 1}, {1, 6}};
  // seen and covering both take the last piece of the character
  EXPECT_EQ(align(src, tgt, AlignPolicy::kSeen), (Ids{0, 4}));
  EXPECT_EQ(align(src, tgt, AlignPolicy::kCovering), (Ids{0, 4}));
  // reverse: the target splits é into two pieces with é's range
  const Spans tgt2 = {{0, 1}, {1, 3}, {1, 3}, {3, 6}};
  EXPECT_EQ(align(src, tgt2, AlignPolicy::kSeen), (Ids{0, 1, 1, 4}));
}

TEST(Align, SpecialTokensAlignByRoleAndPosition) {
  // source: BOS, "ab", <|sep|> at byte 2, "cd"; target: BOS, "a", "b", <|sep|>, "c", "d", EOS
  const Spans src = {{0, 0}, {0, 2}, {2, 2}, {2, 4}};
  const std::vector<std::string> sr = {"bos", "", "<|sep|>", ""};
  const Spans tgt = {{0, 0}, {0, 1}, {1, 2}, {2, 2}, {2, 3}, {3, 4}, {4, 4}};
  const std::vector<std::string> tr = {"bos", "", "", "<|sep|>", "", "", "eos"};
  // EOS has no source counterpart; ordinary tokens never take a special source token
  EXPECT_EQ(align(src, tgt, AlignPolicy::kSeen, sr, tr),
            (Ids{0, kNoSource, 1, 2, 1, 3, kNoSource}));
  EXPECT_EQ(align(src, tgt, AlignPolicy::kCovering, sr, tr), (Ids{0, 1, 1, 2, 3, 3, kNoSource}));
  // a target BOS where the source tokenization has none
  const Spans src_nobos = {{0, 2}, {2, 4}};
  EXPECT_EQ(align(src_nobos, {{0, 0}, {0, 4}}, AlignPolicy::kSeen, {}, {"bos", ""}),
            (Ids{kNoSource, 1}));
  // two specials of one role at one position pair in order; a third has no partner
  EXPECT_EQ(align({{0, 0}, {0, 0}}, {{0, 0}, {0, 0}, {0, 0}}, AlignPolicy::kSeen, {"m", "m"},
                  {"m", "m", "m"}),
            (Ids{0, 1, kNoSource}));
  // same role at another position does not match
  EXPECT_EQ(align({{1, 1}}, {{0, 0}}, AlignPolicy::kSeen, {"m"}, {"m"}), (Ids{kNoSource}));
}

TEST(Align, TextTheSourceDroppedIsUncovered) {
  // the source skipped byte 3 (a normaliser dropped it): covering finds nothing for it
  const Spans src = {{0, 3}, {4, 6}};
  const Spans tgt = {{0, 2}, {2, 4}, {4, 6}};
  EXPECT_EQ(align(src, tgt, AlignPolicy::kCovering), (Ids{0, kNoSource, 1}));
  EXPECT_EQ(align(src, tgt, AlignPolicy::kSeen), (Ids{kNoSource, 0, 1}));
  // an empty ordinary target token: covering has no last byte, seen takes what ended before
  EXPECT_EQ(align(src, {{3, 3}}, AlignPolicy::kCovering), (Ids{kNoSource}));
  EXPECT_EQ(align(src, {{3, 3}}, AlignPolicy::kSeen), (Ids{0}));
}

TEST(Align, EmptyInputs) {
  EXPECT_TRUE(align({}, {}, AlignPolicy::kSeen).empty());
  EXPECT_EQ(align({}, {{0, 3}}, AlignPolicy::kSeen), (Ids{kNoSource}));
  EXPECT_EQ(align({}, {{0, 3}}, AlignPolicy::kCovering), (Ids{kNoSource}));
  EXPECT_TRUE(align({{0, 3}}, {}, AlignPolicy::kCovering).empty());
}

TEST(Align, RejectsBadSpansAndRoles) {
  EXPECT_THROW(align({{2, 1}}, {}, AlignPolicy::kSeen), InvalidArgument);
  EXPECT_THROW(align({}, {{-1, 1}}, AlignPolicy::kSeen), InvalidArgument);
  EXPECT_THROW(align({{0, 3}, {1, 2}}, {}, AlignPolicy::kSeen), InvalidArgument);  // end goes back
  EXPECT_THROW(align({}, {{2, 3}, {1, 4}}, AlignPolicy::kSeen), InvalidArgument);  // start goes back
  EXPECT_THROW(align({{0, 1}}, {}, AlignPolicy::kSeen, {"bos"}), InvalidArgument);  // special span
  EXPECT_THROW(align({{0, 1}}, {}, AlignPolicy::kSeen, {"", ""}), InvalidArgument);  // role count
  // a special token between ordinary ones does not take part in the order check
  EXPECT_EQ(align({{0, 2}, {5, 5}, {2, 4}}, {{0, 4}}, AlignPolicy::kSeen, {"", "x", ""}),
            (Ids{2}));
}

}  // namespace
}  // namespace kvbridge
