// LinearAdapter's serving defaults: accessors, validation and the file's JSON form.
#include "src/adapter/serving.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <mutex>
#include <nlohmann/json.hpp>

#include "kvbridge/error.h"
#include "src/adapter/adapter_impl.h"

namespace kvbridge {
namespace detail {
namespace {

using nlohmann::json;

bool in_unit(double v) { return std::isnan(v) || (v >= 0 && v <= 1); }

json number_or_null(double v) { return std::isnan(v) ? json(nullptr) : json(v); }

// A JSON number, or NaN for null; anything else throws Corrupt naming `what`.
double number_from(const json& j, const char* key, const std::string& what) {
  const auto it = j.find(key);
  KVB_CHECK_AS(Corrupt, it != j.end() && (it->is_number() || it->is_null()),
               "adapter file: serving" << what << "." << key << " must be a number or null");
  return it->is_null() ? std::numeric_limits<double>::quiet_NaN() : it->get<double>();
}

int64_t count_from(const json& j, const char* key, const std::string& what) {
  const auto it = j.find(key);
  constexpr auto kMax = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  KVB_CHECK_AS(Corrupt, it != j.end() && it->is_number_unsigned() && it->get<uint64_t>() <= kMax,
               "adapter file: serving" << what << "." << key << " must be an integer >= 0");
  return it->get<int64_t>();
}

}  // namespace

void check_serving(const ServingDefaults& s) {
  if (!s.recorded) return;
  KVB_CHECK(s.recompute_tail >= 0,
            "serving defaults: recompute_tail must be >= 0, got " << s.recompute_tail);
  KVB_CHECK(s.recompute_share >= 0.0 && s.recompute_share <= 1.0,
            "serving defaults: recompute_share must lie in [0, 1], got " << s.recompute_share);
  KVB_CHECK(in_unit(s.agreement_goal),
            "serving defaults: agreement_goal must lie in [0, 1] (or be NaN: none stated), got "
                << s.agreement_goal);
  for (size_t i = 0; i < s.by_length.size(); ++i) {
    const LengthTail& t = s.by_length[i];
    const int64_t shorter = i == 0 ? 0 : s.by_length[i - 1].prompt_tokens;
    KVB_CHECK(t.prompt_tokens > shorter && t.recompute_tail >= 0,
              "serving defaults: by_length[" << i << "] needs prompt_tokens > " << shorter
                                             << " (lengths > 0, strictly increasing) and "
                                             << "recompute_tail >= 0, got " << t.prompt_tokens
                                             << " and " << t.recompute_tail);
  }
  for (size_t i = 0; i < s.measured.size(); ++i) {
    const ServingPoint& p = s.measured[i];
    KVB_CHECK(p.recompute_tail >= 0 && p.prompt_tokens >= 0,
              "serving defaults: measured[" << i << "] needs recompute_tail and prompt_tokens >= 0"
                                            << ", got " << p.recompute_tail << " and "
                                            << p.prompt_tokens);
    KVB_CHECK(!std::isinf(p.kept),
              "serving defaults: measured[" << i << "].kept must be finite or NaN");
    KVB_CHECK(in_unit(p.agreement) && in_unit(p.computed_share),
              "serving defaults: measured[" << i << "] agreement and computed_share must lie in "
                                            << "[0, 1] or be NaN, got " << p.agreement << " and "
                                            << p.computed_share);
  }
}

std::string serving_json(const ServingDefaults& s) {
  json measured = json::array();
  for (const ServingPoint& p : s.measured)
    measured.push_back({{"recompute_tail", p.recompute_tail},
                        {"kept", number_or_null(p.kept)},
                        {"agreement", number_or_null(p.agreement)},
                        {"computed_share", number_or_null(p.computed_share)},
                        {"prompt_tokens", p.prompt_tokens}});
  json by_length = json::array();
  for (const LengthTail& t : s.by_length)
    by_length.push_back({{"prompt_tokens", t.prompt_tokens}, {"recompute_tail", t.recompute_tail}});
  const json j = {{"recompute_tail", s.recompute_tail},
                  {"recompute_share", s.recompute_share},
                  {"by_length", by_length},
                  {"agreement_goal", number_or_null(s.agreement_goal)},
                  {"measured", measured},
                  {"note", s.note}};
  return j.dump();
}

ServingDefaults parse_serving(const std::string& text) {
  ServingDefaults s;
  s.recorded = true;
  try {
    const json j = json::parse(text);
    KVB_CHECK_AS(Corrupt, j.is_object(), "adapter file: serving is not a JSON object");
    s.recompute_tail = count_from(j, "recompute_tail", "");
    if (j.contains("recompute_share")) {  // files written before it record the tail alone
      const json& share = j.at("recompute_share");
      KVB_CHECK_AS(Corrupt, share.is_number(), "adapter file: serving.recompute_share must be a "
                                               "number");
      s.recompute_share = share.get<double>();
    }
    if (j.contains("by_length")) {  // files written before it record the share rule alone
      const json& by_length = j.at("by_length");
      KVB_CHECK_AS(Corrupt, by_length.is_array(), "adapter file: serving.by_length must be a list");
      for (size_t i = 0; i < by_length.size(); ++i) {
        const json& t = by_length[i];
        const std::string what = ".by_length[" + std::to_string(i) + "]";
        KVB_CHECK_AS(Corrupt, t.is_object(),
                     "adapter file: serving" << what << " is not an object");
        s.by_length.push_back(
            {count_from(t, "prompt_tokens", what), count_from(t, "recompute_tail", what)});
      }
    }
    s.agreement_goal = number_from(j, "agreement_goal", "");
    const auto note = j.find("note");
    KVB_CHECK_AS(Corrupt, note != j.end() && note->is_string(),
                 "adapter file: serving.note must be a string");
    s.note = note->get<std::string>();
    const auto measured = j.find("measured");
    KVB_CHECK_AS(Corrupt, measured != j.end() && measured->is_array(),
                 "adapter file: serving.measured must be a list");
    for (size_t i = 0; i < measured->size(); ++i) {
      const json& p = (*measured)[i];
      const std::string what = ".measured[" + std::to_string(i) + "]";
      KVB_CHECK_AS(Corrupt, p.is_object(), "adapter file: serving" << what << " is not an object");
      ServingPoint point;
      point.recompute_tail = count_from(p, "recompute_tail", what);
      point.kept = number_from(p, "kept", what);
      point.agreement = number_from(p, "agreement", what);
      point.computed_share = number_from(p, "computed_share", what);
      point.prompt_tokens = count_from(p, "prompt_tokens", what);
      s.measured.push_back(point);
    }
    check_serving(s);
  } catch (const json::exception& e) {
    KVB_CHECK_AS(Corrupt, false, "adapter file: serving: " << e.what());
  } catch (const InvalidArgument& e) {
    KVB_CHECK_AS(Corrupt, false, "adapter file: " << e.message());
  }
  return s;
}

}  // namespace detail

namespace {

// ceil(share * n) for share >= 0; the 1e-9 keeps a product that is whole up to rounding
// (0.07 * 100) from rounding up past it. Clamped to 2^62 (no prompt is that long) so that
// converting it back to int64 stays defined for any n.
int64_t ceil_share(double share, int64_t n) {
  constexpr double kMax = 4611686018427387904.0;  // 2^62
  const double tail = std::ceil(share * static_cast<double>(n) - 1e-9);
  return tail <= 0.0 ? 0 : tail >= kMax ? int64_t{1} << 62 : static_cast<int64_t>(tail);
}

}  // namespace

int64_t ServingDefaults::tail_for(int64_t prompt_tokens) const {
  if (!recorded) return 0;
  if (by_length.empty() || prompt_tokens > by_length.back().prompt_tokens)
    return std::max(recompute_tail, ceil_share(recompute_share, prompt_tokens));
  int64_t tail = recompute_tail;
  for (const LengthTail& t : by_length) {
    const double share =
        static_cast<double>(t.recompute_tail) / static_cast<double>(t.prompt_tokens);
    tail = std::max(tail, prompt_tokens >= t.prompt_tokens ? t.recompute_tail
                                                           : ceil_share(share, prompt_tokens));
  }
  return tail;
}

ServingDefaults LinearAdapter::serving() const {
  std::lock_guard<std::mutex> lock(impl_->serving_mutex);
  return impl_->serving;
}

void LinearAdapter::set_serving(const ServingDefaults& serving) {
  detail::check_serving(serving);
  ServingDefaults value = serving.recorded ? serving : ServingDefaults{};
  std::lock_guard<std::mutex> lock(impl_->serving_mutex);
  impl_->serving = std::move(value);
}

}  // namespace kvbridge
