// The Bridge's quality monitoring: what a caller reports (QualityCheck) and what the Bridge
// keeps per adapter (AdapterHealth).
//
// Quality checks and fallback. Callers that can run the target's own prefill of a loaded prompt
// (kvbridge.monitor in Python) compare it with the converted cache and report each comparison
// through record_check(). Per adapter, the bridge keeps the last BridgeOptions::check_window
// checks; once it holds at least min_checks of them and their pooled top-1 agreement is below
// min_agreement, the adapter is disabled: loads skip it (counted in adapters_skipped_disabled) and
// fall back to the target's own cache or a miss, so the target prefills itself. Disabling purges
// what the adapter wrote back (invalidate_adapter). enable_adapter() re-enables it with an empty
// window. The state lives here, so every binding and the vLLM connector see one state.
// Checks are pooled by position: the window's agreement is its agreed positions over its
// compared positions, not a mean of per-check ratios.
#pragma once

#include <cstdint>
#include <string>

namespace kvbridge {

/// One comparison of a converted cache with the target's own prefill at a prompt's last
/// positions. Sums, so checks pool by position.
struct QualityCheck {
  int64_t positions = 0;      ///< positions compared (> 0)
  int64_t agreed = 0;         ///< of which with equal greedy next tokens (0..positions)
  double kl_sum = 0;          ///< sum over positions of KL(own || converted), nats (>= 0)
  int64_t loss_positions = 0; ///< positions whose true next token is known (0..positions)
  double loss_gap_sum = 0;    ///< sum over those of CE(converted) - CE(own), nats
};

/// An adapter's monitoring state (Bridge::adapter_health). Rolling figures are pooled over the
/// checks in the window (NaN when it is empty, or for loss_gap when no position had a loss).
struct AdapterHealth {
  std::string adapter;             ///< LinearAdapter::fingerprint()
  std::string source, target;      ///< model names
  bool enabled = true;
  int64_t checks = 0;              ///< record_check calls since registration
  int64_t window_checks = 0;       ///< checks in the rolling window now
  int64_t window_positions = 0;    ///< positions they compared
  double agreement = 0;            ///< agreed / positions over the window
  double kl = 0;                   ///< mean KL(own || converted) per position over the window
  double loss_gap = 0;             ///< mean CE gap per position with a loss, over the window
  int64_t disables = 0;            ///< times disabled by the agreement floor
};

}  // namespace kvbridge
