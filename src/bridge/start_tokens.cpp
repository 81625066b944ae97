#include "src/bridge/start_tokens.h"

#include "kvbridge/error.h"

namespace kvbridge::detail {

void StartTokens::add(const ModelSpec& spec, int64_t token_id, const KVView& kv, bool replace) {
  kv.check_matches(spec, "kv");
  KVB_CHECK(kv.tokens() >= 1, "kv: holds no token");
  KVB_CHECK(token_id >= 0, "token_id must be >= 0, got " << token_id);
  auto key = std::make_pair(spec.fingerprint(), token_id);
  if (!replace) {
    std::lock_guard<std::mutex> lock(mu_);
    if (starts_.count(key)) return;  // the common case for saves: copy nothing
  }
  auto start = std::make_shared<StartKV>();
  const int64_t bytes = spec.kv_bytes_per_token();
  start->buffer = std::shared_ptr<void>(new unsigned char[static_cast<size_t>(bytes)],
                                        [](void* p) { delete[] static_cast<unsigned char*>(p); });
  start->view = KVView::contiguous(start->buffer.get(), spec.dtype, Device{}, spec.num_layers, 1,
                                   spec.num_kv_heads, spec.head_dim);
  copy_kv(kv.slice_tokens(0, 1), start->view);
  std::lock_guard<std::mutex> lock(mu_);
  if (replace) {
    starts_[key] = std::move(start);
  } else {
    starts_.emplace(std::move(key), std::move(start));  // a concurrent add may have won
  }
}

std::shared_ptr<const StartKV> StartTokens::find(const std::string& spec_fingerprint,
                                                 int64_t token_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = starts_.find(std::make_pair(spec_fingerprint, token_id));
  return it == starts_.end() ? nullptr : it->second;
}

}  // namespace kvbridge::detail
