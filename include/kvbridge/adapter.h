// Linear adapters between two models' KV spaces: fitting (AdapterFitter) and conversion
// (LinearAdapter::convert).
//
// For each target layer j the adapter holds two affine maps, one producing the target's keys and
// one its values, whose input features are the keys and values of a set S_j of source layers,
// flattened per token ([kv_heads * head_dim] keys, then values, for each layer of S_j in order).
// With rope_aware (the default) keys are mapped in position-free space: source keys are
// un-rotated with the source RoPE, mapped, and rotated with the target RoPE at the same absolute
// positions. Values carry no RoPE.
//
// An adapter may also take the target's own token ids as features (token codes, FitOptions::
// target_token_codes): a fixed code per target vocabulary entry, of the token and the ones just
// before it, feeds a second affine term of each map. Across tokenizers this restores what the
// alignment loses, which target token a position holds (benchmarks/recorded/245-token-codes.md).
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "kvbridge/align.h"
#include "kvbridge/kv_view.h"
#include "kvbridge/model_spec.h"
#include "kvbridge/prefix_hash.h"

namespace kvbridge {

/// A fixed code per entry of the target's vocabulary, which an adapter takes as features of the
/// target tokens besides the source's KV (FitOptions::target_token_codes). Any fixed map of ids
/// to vectors works; kvbridge.hf.token_codes derives one from the target's input embeddings.
struct TokenCodes {
  int64_t vocab = 0;          ///< ids 0 .. vocab - 1 have a code
  int64_t dims = 0;           ///< code width
  std::vector<float> values;  ///< [vocab, dims] row-major, finite
  bool empty() const noexcept { return vocab == 0; }
};

/// The target's ids of the tokens a convert writes (or a fitter sample holds), for adapters with
/// token codes (LinearAdapter::has_token_codes).
struct TargetTokens {
  TokenSpan ids;  ///< one id per target token of the call, in order (not owned)
  /// The ids of the tokens just before ids[0], nearest last (previous.back() is the token at
  /// position first - 1); the adapter reads the last token_context - 1 of them. Fewer than
  /// that only when the call starts near position 0: the tokens before position 0 have no code
  /// (zeros), as in the fit.
  std::vector<int64_t> previous;
};

struct FitOptions {
  enum class Selection : uint8_t {
    kAuto = 0,      ///< per target layer, greedy forward selection by held-out R²
    kAll = 1,       ///< every source layer feeds every target layer
    kExplicit = 2,  ///< `source_layers[j]` lists target layer j's source layers
  };
  Selection selection = Selection::kAuto;
  std::vector<std::vector<int64_t>> source_layers;  ///< kExplicit only; one list per target layer
  int64_t max_source_layers = 8;  ///< kAuto: most layers one target layer may draw on
  bool rope_aware = true;         ///< false: map post-RoPE keys directly (an ablation)
  /// The alignment policy (align.h: "seen", "covering") the samples of a pair with different
  /// tokenizers are aligned with; "" (the default) for a pair sharing one tokenizer. Recorded in
  /// the report and the adapter file; the fitter itself takes the alignments given to add().
  std::string alignment_policy;
  /// Ridge strengths relative to the features' variance: the penalty on the weights of a source
  /// layer's features is the strength times that layer's mean feature variance (on training
  /// tokens), as if every source layer were scaled to mean variance 1. The best on held-out
  /// tokens is chosen per map. A single value fixes it.
  std::vector<double> ridge_grid = {1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0};
  double holdout = 0.1;  ///< share of tokens held out for selection and R², in (0, 0.5]
  uint64_t seed = 0;     ///< decides which tokens are held out
  /// Bound on the fitter's float64 accumulators (see AdapterFitter); exceeding it is an error
  /// at construction, not an allocation failure later.
  int64_t max_memory_bytes = int64_t{8} << 30;
  /// kAuto: a source layer is added only when it raises the held-out R² of its target layer
  /// (mean of K and V) by at least this much.
  double min_gain = 1e-4;
  /// kAuto, from a target layer's second source layer on: how many candidates, ranked by the
  /// screen (see AdapterFitter), are fitted exactly at each step while the target layer holds
  /// fewer than max_source_layers / 2 source layers (one after that, where exact fits cost
  /// most); the best of them is taken.
  int64_t exact_candidates = 2;
  /// The target's key norm, for targets that RMS-normalize each key head before RoPE (QK-norm:
  /// Gemma 3, Qwen3, ...): per target layer the gains g [target.head_dim] of that norm, so that
  /// the target's own pre-RoPE key heads are k = g * x / rms(x), elementwise. Empty (the
  /// default): the target has none, and convert returns the maps' keys as they are. Given, it
  /// holds one finite vector per target layer, and convert puts each converted key head back on
  /// the set the target's own keys lie on: its dimensions with g_i = 0 are set to 0 and the
  /// others are scaled together so that the mean over them of (k_i / g_i)² is 1 (a head whose
  /// sum is 0 is left as it is). A least-squares map cannot keep that constraint and pulls keys
  /// toward their mean, which flattens attention (benchmarks/recorded/240-real-headroom.md).
  /// The fit itself and its R² are those of the maps alone. Kept by the adapter
  /// (LinearAdapter::key_norm) and in its file.
  std::vector<std::vector<float>> target_key_norm;
  /// Codes of the target's vocabulary (TokenCodes), or empty (the default: the maps take the
  /// source's KV alone). Given, every add() needs the target's token ids (TargetTokens), and
  /// each target map gets a second term: the codes of target token t and of the token_context -
  /// 1 tokens before it (zeros before position 0), concatenated (Dz = token_context * dims
  /// features), times weights [Dz, kv_heads * head_dim]. The source layers are chosen without
  /// it; then each map is refitted with it, jointly with its source weights at their chosen
  /// ridge strength, the codes' strength chosen on held-out tokens from ridge_grid (relative to
  /// the codes' mean variance); a map keeps no term when no strength lowers its held-out error.
  /// The report's R² include it. Codes wider than token_code_dims are compressed: the maps'
  /// terms are first fitted on the full codes, the token_code_dims directions of code space
  /// that carry most of them (by the codes' covariance) are kept, and the terms are fitted
  /// again on the codes projected on them. The adapter keeps the codes it uses
  /// (LinearAdapter::token_codes: [vocab, min(dims, token_code_dims)]) and its convert needs
  /// the ids; when no map keeps a term it has none.
  /// Memory: the fitter holds 16 * Dz * (1 + Dz + U * Fl + 2 * Lt * O) bytes more (train and
  /// held-out), U and Fl as in AdapterFitter; fit() takes, per target layer in progress, about
  /// six float64 matrices of its set's size (|S_j| Fl)², and O((|S_j| Fl)³) time per map.
  TokenCodes target_token_codes;
  /// Tokens whose codes feed each target token: it and the ones before it, in [1, 8].
  int64_t token_context = 2;
  /// Width the adapter's codes are compressed to (above); 0 keeps them as given. 128: on the real
  /// pair 64 kept 0.006-0.017 less of the context (benchmarks/recorded/250-wider-codes.md).
  int64_t token_code_dims = 128;
};

/// One step of kAuto's selection for one target layer: a candidate source layer fitted exactly
/// together with the layers chosen before it.
struct SelectionStep {
  int64_t source_layer = -1;
  double r2_key = 0, r2_value = 0;  ///< held-out R² of the set with it (each at its best ridge)
  /// The screen's estimate of the mean held-out R² with it (for the first layer: its exact
  /// single-layer R²).
  double screen = 0;
  bool accepted = false;  ///< taken into the set (at most one per round)
};

/// Fit quality of one target layer, measured on held-out tokens.
struct LayerFit {
  std::vector<int64_t> source_layers;
  /// Held-out R² of un-rotated keys / values (with the token codes' term where there is one).
  double r2_key = 0, r2_value = 0;
  double ridge_key = 0, ridge_value = 0;  ///< chosen relative ridge strengths
  /// The token codes' term (FitOptions::target_token_codes): its relative ridge strengths, NaN
  /// where the adapter has no such term (no codes, or none of the strengths helped that map).
  double token_ridge_key = std::numeric_limits<double>::quiet_NaN();
  double token_ridge_value = std::numeric_limits<double>::quiet_NaN();
  /// kAuto: every exactly fitted step in order, a round at a time (the accepted one of a round
  /// last among that round's), so that the R² after each added layer and the gains that stopped
  /// the selection can be read off. Empty for kAll and kExplicit (and in files without it).
  std::vector<SelectionStep> selection;
};

struct FitReport {
  std::vector<LayerFit> layers;  ///< one per target layer
  int64_t train_tokens = 0;
  int64_t holdout_tokens = 0;
  bool rope_aware = true;
  std::string alignment_policy;  ///< FitOptions::alignment_policy of the fit
};

/// How LinearAdapter::load treats a file.
struct AdapterLoadOptions {
  /// Accept a file without a checksum (every other check still applies; a checksum that is
  /// present is always verified). Off by default: such a file's damage cannot be detected.
  bool allow_unchecked = false;
};

/// One point of an adapter's measured tail-recompute curve (ServingDefaults::measured): held-out
/// figures with the target computing the last recompute_tail + 1 prompt tokens itself over the
/// converted prefix (DESIGN.md, "Definitions"). NaN for a figure that was not measured (JSON
/// null in the file).
struct ServingPoint {
  int64_t recompute_tail = 0;  ///< r, >= 0
  double kept = std::numeric_limits<double>::quiet_NaN();       ///< kept at r (finite, any sign)
  double agreement = std::numeric_limits<double>::quiet_NaN();  ///< agreement at r, in [0, 1]
  /// Share of the prompt the target computed itself, (r + 1) / prompt_tokens, in [0, 1].
  double computed_share = std::numeric_limits<double>::quiet_NaN();
  int64_t prompt_tokens = 0;  ///< prompt length the point was measured at (>= 0; 0: unknown)
};

/// The least tail that reached ServingDefaults::agreement_goal at one measured prompt length
/// (ServingDefaults::by_length).
struct LengthTail {
  int64_t prompt_tokens = 0;   ///< the prompt length measured (mean of its windows), > 0
  int64_t recompute_tail = 0;  ///< the least tail that reached the goal there, >= 0
};

/// How an adapter should be served, recorded from its held-out evaluation (kvbridge eval
/// --save-adapter, the real-pair eval): the least tail recompute that reached an agreement goal,
/// and the curve it was chosen from. Bridge uses tail_for(n) for loads of n-token prompts
/// converted by the adapter unless BridgeOptions::recompute_tail says otherwise. Stored in the
/// adapter file as the optional metadata key "serving" (docs/adapter_file.md): files without it
/// load with nothing recorded. It is covered by the file's checksum but not by
/// LinearAdapter::fingerprint(), which identifies the conversion (weights, specs, layer map,
/// report): setting it changes no conversion and no provenance.
struct ServingDefaults {
  bool recorded = false;       ///< false: nothing recorded (the other fields are their defaults)
  int64_t recompute_tail = 0;  ///< the tail to serve with, >= 0
  /// The share of the prompt to recompute, in [0, 1]: a prompt of n tokens is served with
  /// tail_for(n) = max(recompute_tail, ceil(recompute_share * n)), since a tail agrees less after
  /// a longer converted prompt. 0 (the default, and files that do not record it): the fixed
  /// tail alone. With by_length, this rule serves only prompts longer than every length there.
  double recompute_share = 0.0;
  /// The least tail that reached agreement_goal at each measured prompt length, shortest first
  /// (prompt_tokens strictly increasing). Empty (the default, and files that do not record it):
  /// recompute_share's rule serves every length. Otherwise a prompt of n tokens, n at most the
  /// longest length L, is served with
  ///   max(recompute_tail, max over i of ceil(recompute_tail_i * min(1, n / prompt_tokens_i))):
  /// each measured tail, scaled down in proportion below its length (as recompute_share's rule
  /// assumes) and held above it. The needed share of the prompt can fall as prompts grow
  /// on real pairs, so between measured lengths this serves less than one share would; past L
  /// nothing was measured and recompute_share's rule applies.
  std::vector<LengthTail> by_length;
  /// The agreement the tail was chosen to reach, in [0, 1]; NaN when none was stated (a tail set
  /// by hand).
  double agreement_goal = std::numeric_limits<double>::quiet_NaN();
  std::vector<ServingPoint> measured;  ///< the measured curve, in the order measured
  std::string note;  ///< free text, e.g. why the tail is not the goal's (no point reached it)

  /// The tail for a prompt of prompt_tokens (>= 0) tokens (see recompute_share and by_length);
  /// 0 when nothing is recorded.
  int64_t tail_for(int64_t prompt_tokens) const;
};

class LinearAdapter {
 public:
  LinearAdapter(const LinearAdapter&) = delete;
  LinearAdapter& operator=(const LinearAdapter&) = delete;
  LinearAdapter(LinearAdapter&&) noexcept;
  LinearAdapter& operator=(LinearAdapter&&) noexcept;
  ~LinearAdapter();

  const ModelSpec& source() const noexcept;
  const ModelSpec& target() const noexcept;
  const FitReport& report() const noexcept;

  /// The serving defaults recorded for this adapter (a copy; recorded == false when none are).
  /// Thread-safe.
  ServingDefaults serving() const;
  /// Records serving defaults (the adapter's only mutable part; see ServingDefaults). A value
  /// with recorded == false clears the record (its other fields are ignored); otherwise it is
  /// stored as given. Thread-safe, also while a Bridge serves the adapter: loads that start
  /// after it returns use the new tail. save() writes it; fingerprint() does not change.
  /// Throws InvalidArgument, changing nothing, for a recompute_tail < 0, a recompute_share
  /// outside [0, 1], an agreement_goal outside [0, 1] (NaN allowed), a by_length whose
  /// prompt_tokens are not > 0 and strictly increasing or whose tail is negative, or a point with a
  /// negative tail or prompt_tokens, an infinite kept, or an agreement or computed_share outside
  /// [0, 1] (NaN allowed).
  void set_serving(const ServingDefaults& serving);

  /// Converts a source KV cache to the target's, on the CPU or on a CUDA device (the views'
  /// device decides). CUDA views use the legacy default stream; see the overload below.
  /// src: view matching source() (layers, kv_heads, head_dim, dtype), any strides, tokens at
  ///      absolute positions start_pos, start_pos + 1, ...
  /// dst: view matching target(), same token count and same device as src; written, never read.
  ///      Must not overlap src. Only the viewed elements are written.
  /// CPU views: computed before the call returns, with float32 arithmetic; the result is rounded
  /// to the target dtype. Tokens are converted in blocks, one per OpenMP thread at a time, each
  /// with single-threaded GEMMs (an input shorter than two 128-token blocks is one block whose
  /// GEMMs use the threads). A block's working memory is float32: one source layer's un-rotated
  /// keys and values, one target layer's key and value planes and the RoPE tables, so it does
  /// not grow with the number of layers; blocks are sized so the working memory of all blocks in
  /// flight is at most 90% of the output's size in dst's dtype, unless 128-token blocks alone
  /// need more. No float32 copy of the whole source is made.
  /// A bfloat16 dst on a CPU with AMX (Intel Sapphire Rapids and later): the GEMMs take the
  /// un-rotated features and the weights rounded to bfloat16, with float32 accumulation, on AMX
  /// tiles, as the CUDA path does (the rest stays float32); the weights are packed for it on the
  /// first such call and kept with the adapter (half their float32 size), and a block's working
  /// memory holds its features once more in bfloat16. KVBRIDGE_CPU_ISA=avx512 (or lower) keeps
  /// float32 GEMMs. Either way the result agrees with convert_reference within 2e-2 of the
  /// largest output magnitude per plane.
  /// Non-finite inputs propagate to the outputs of the tokens that contain them (nothing else is
  /// affected). Throws InvalidArgument for views that do not match or are on different devices.
  void convert(const KVView& src, int64_t start_pos, const KVView& dst) const;

  /// As above, with the CUDA stream to use (ignored for CPU views).
  /// cuda_stream: a cudaStream_t of src's device; nullptr is the legacy default stream.
  ///
  /// CUDA views (device memory of cuda:index, or managed memory): the conversion is enqueued on
  /// cuda_stream and the call returns without waiting for it; src must stay unchanged and dst
  /// must not be read until the stream has reached that point. Nothing is enqueued on other
  /// streams and the device is not synchronised, except by allocations: the first call for a
  /// device uploads the weights in the source dtype (sum over target layers of
  /// |source layers| * 2 * source width * 2 * target width elements, plus float32 biases) through
  /// a private stream and waits for that copy. The device copy and the workspaces are kept until
  /// the adapter is destroyed (which waits for their last use). Safe to call from several
  /// threads at once.
  /// Work: per block of tokens, one gather per used source layer (keys un-rotated), one cuBLAS
  /// GEMM per target layer (keys and values together; more when its source layers are not
  /// consecutive) with float32 accumulation, and one fused kernel (bias, target RoPE, cast,
  /// scatter). GEMM inputs have the source dtype: float32 caches use true float32 (no TF32),
  /// bfloat16 and float16 caches round the un-rotated keys and the weights to that dtype
  /// (float16 weights scaled by a power of two per target layer, so their range is not a
  /// concern). Against the CPU path the results agree within 1e-4 (float32), 2e-2 (bfloat16)
  /// and 4e-3 (float16) of the largest output magnitude per plane, as the CPU path agrees with
  /// convert_reference.
  /// Workspace: each call in flight holds at most 512 MiB of device scratch (the features of
  /// every used source layer in the source dtype, one target layer's float32 output and the RoPE
  /// tables, for a block of tokens; longer inputs are processed in blocks that fit) plus 32 MiB of
  /// cuBLAS workspace; workspaces are reused by later calls, stream-ordered. A call that needs
  /// more scratch than its workspace holds reallocates it (at least doubling), and cudaFree /
  /// cudaMalloc may synchronise the device then.
  /// cuBLAS is loaded on first use from libcublas.so.13 (the environment variable KVBRIDGE_CUBLAS
  /// may name the file).
  /// Throws Unavailable when this build has no CUDA path, no CUDA device is present, cuBLAS
  /// cannot be loaded, a CUDA or cuBLAS call fails, or the adapter has a key norm (has_key_norm:
  /// such adapters convert on the CPU only, so far); InvalidArgument for views that do not
  /// match, a device index that does not exist, or planes that are not device memory of src's
  /// device. Views that do not match are rejected before any memory is touched.
  void convert(const KVView& src, int64_t start_pos, const KVView& dst, void* cuda_stream) const;

  /// Conversion across tokenizers (the source and target tokenize one text differently; see
  /// align.h), on the CPU or a CUDA device like the overloads above.
  /// src: source tokens at absolute positions start_pos, start_pos + 1, ...
  /// dst: target tokens at absolute positions target_start_pos, target_start_pos + 1, ...; its
  ///      token count is alignment.size() and may differ from src's.
  /// alignment: per target token j the source token index alignment[j] in [0, src.tokens()) it
  ///      is computed from (kNoSource is refused: convert only the target tokens that have a
  ///      source token). Output token j is the map applied to source token alignment[j], its keys
  ///      un-rotated at start_pos + alignment[j] and the result's re-rotated at
  ///      target_start_pos + j. Entries may repeat and need not be ordered.
  /// Arithmetic, blocking, memory and the CUDA path's stream semantics as above (blocks are
  /// blocks of target tokens; the CUDA path copies each block's alignment entries to the device
  /// from the host vector, stream-ordered, before the call returns). Throws InvalidArgument also
  /// for an alignment of the wrong length or with an entry out of range.
  void convert(const KVView& src, int64_t start_pos, const KVView& dst,
               const std::vector<int64_t>& alignment, int64_t target_start_pos,
               void* cuda_stream = nullptr) const;

  /// The overloads above for an adapter with token codes (has_token_codes), which also takes
  /// the target's ids: tokens.ids holds dst.tokens() ids, each below token_codes().vocab, for
  /// the target tokens at target_start_pos, target_start_pos + 1, ... (start_pos without an
  /// alignment), and tokens.previous at least the min(token_context() - 1, target_start_pos)
  /// ids before them. Adapters without token codes ignore `tokens`, so a caller may always pass
  /// them. The codes' term is added to each map's output before the key norm and RoPE. CPU
  /// views only so far: CUDA views throw Unavailable for an adapter with token codes, as the
  /// overloads without `tokens` do, and those throw InvalidArgument for a CPU convert with token
  /// codes (the ids are needed). Throws InvalidArgument as above, and for ids that are missing
  /// or out of range.
  void convert(const KVView& src, int64_t start_pos, const KVView& dst,
               const TargetTokens& tokens, void* cuda_stream = nullptr) const;
  void convert(const KVView& src, int64_t start_pos, const KVView& dst,
               const std::vector<int64_t>& alignment, int64_t target_start_pos,
               const TargetTokens& tokens, void* cuda_stream = nullptr) const;

  /// float64 reference of convert (for tests and validation): same contract for CPU views,
  /// computed in double and rounded once at the end, all tokens in one block (its working
  /// memory is float64: one source layer's features and one target layer's planes for the whole
  /// input). Throws InvalidArgument for CUDA views.
  void convert_reference(const KVView& src, int64_t start_pos, const KVView& dst) const;
  /// float64 reference of the aligned convert.
  void convert_reference(const KVView& src, int64_t start_pos, const KVView& dst,
                         const std::vector<int64_t>& alignment, int64_t target_start_pos) const;
  /// float64 references of the overloads that take the target's ids.
  void convert_reference(const KVView& src, int64_t start_pos, const KVView& dst,
                         const TargetTokens& tokens) const;
  void convert_reference(const KVView& src, int64_t start_pos, const KVView& dst,
                         const std::vector<int64_t>& alignment, int64_t target_start_pos,
                         const TargetTokens& tokens) const;

  /// 32 lowercase hex digits identifying this adapter's content: the checksum save() writes
  /// (XXH3-128 over its metadata, which holds both ModelSpecs in their roles, the layer map and
  /// the fit report, and over its weights; docs/adapter_file.md), computed without the serving
  /// defaults (so for an adapter with a serving record the file's checksum differs from it).
  /// Equal for an adapter and its saved and reloaded copy, whatever serving defaults either
  /// records; computed on first use (it hashes every weight once).
  std::string fingerprint() const;

  /// Writes the adapter as a safetensors file (atomically: temporary file, fsync, rename).
  /// Tensors "layers.{j}.{key,value}.{weight,bias}" (float32) and metadata: format
  /// "kvbridge.adapter", format_version "2", both ModelSpecs, the layer map, rope settings, the
  /// fit report (JSON strings) and "checksum" (fingerprint()). An adapter between tokenizers
  /// (report().alignment_policy not empty) is written as format_version "3" with the extra key
  /// "alignment_policy" (both tokenizer ids are in the specs). Recorded serving defaults add the
  /// key "serving" (JSON; covered by the checksum), in any version. An adapter with a key norm
  /// adds the tensors "layers.{j}.key_norm" (float32 [target.head_dim]), covered by the checksum
  /// and the fingerprint (readers that predate them refuse the file). Throws Unavailable on I/O
  /// failure.
  void save(const std::string& path) const;
  /// Reads and validates a file written by save (or by any safetensors writer with the same
  /// metadata strings and tensors: the checksum covers content, not the header's layout).
  /// Throws InvalidArgument for a path with a NUL byte, NotFound for a missing file and Corrupt
  /// for anything else: not a regular file, a header longer than the file, a checksum that does
  /// not match (any damaged byte, an edited report, swapped source and target specs), a missing
  /// checksum (format_version "1" files and writers that drop it) unless
  /// options.allow_unchecked, unknown format or version, an alignment_policy that is not a
  /// policy name or that a version other than "3" carries (or a version "3" file without one), specs or layer map that do not parse,
  /// a fit report out of range (R² not finite or > 1, ridge not finite or < 0, negative token
  /// counts), missing, extra or mis-shaped tensors (key_norm tensors for some target layers
  /// only among them), non-float32 dtypes, non-finite weights or gains, a "serving" record that
  /// does not parse or is out of set_serving's ranges. A file without "serving" loads with
  /// nothing recorded.
  static LinearAdapter load(const std::string& path, const AdapterLoadOptions& options = {});

  /// Raw parameters of target layer j: weights [features, kv_heads * head_dim] row-major and bias
  /// [kv_heads * head_dim], float32, for keys (kind 0) or values (kind 1).
  const std::vector<float>& weights(int64_t layer, int kind) const;
  const std::vector<float>& bias(int64_t layer, int kind) const;
  /// Whether convert applies the target's key norm (FitOptions::target_key_norm), and its gains
  /// [target.head_dim] for target layer j (an empty vector when it has none).
  bool has_key_norm() const noexcept;
  const std::vector<float>& key_norm(int64_t layer) const;
  /// Whether the maps take the target's token codes (FitOptions::target_token_codes); the codes
  /// (empty when none), the context (tokens per target token whose codes feed it; 0 when none)
  /// and target layer j's weights of the codes' term for K (kind 0) or V (kind 1),
  /// [token_context * dims, kv_heads * head_dim] row-major (an empty vector for a map without
  /// the term).
  bool has_token_codes() const noexcept;
  const TokenCodes& token_codes() const noexcept;
  int64_t token_context() const noexcept;
  const std::vector<float>& token_weights(int64_t layer, int kind) const;

  struct Impl;

 private:
  friend class AdapterFitter;
  explicit LinearAdapter(std::unique_ptr<Impl> impl);
  void convert_dispatch(const KVView& src, int64_t start_pos, const KVView& dst,
                        const std::vector<int64_t>* alignment, int64_t target_start_pos,
                        const TargetTokens* tokens, void* cuda_stream) const;
  std::unique_ptr<Impl> impl_;
};

/// The GEMM kernel that LinearAdapter::convert of CPU views into a target of `target_dtype`
/// runs on this machine: for bfloat16 targets "amx-bf16" (bfloat16 inputs on AMX tiles) or
/// "avx512-bf16" (AVX512-BF16 dot products) where the CPU has them, else the float32 kernel
/// "avx512", "avx2" or "generic". Chosen once per process from the CPU and KVBRIDGE_CPU_ISA
/// ("amx", "avx512bf16", "avx512", "avx2" or "generic" caps the choice).
const char* cpu_convert_kernel(DType target_dtype) noexcept;

/// Progress of AdapterFitter::fit, passed to its callback.
struct FitProgress {
  /// Work finished and work in all, in units of about 1e9 floating-point operations (an
  /// estimate). total may shrink (never below done) when a selection stops early.
  double done = 0, total = 0;
  int64_t target_layer = -1;  ///< the target layer whose step just finished; -1 for other work
  int64_t source_layers = 0;  ///< how many source layers that target layer has chosen so far
};
/// Called from any of fit()'s threads, one call at a time. An exception it throws stops fit()
/// (at the next step of each thread) and propagates out of fit().
using FitProgressCallback = std::function<void(const FitProgress&)>;

/// Accumulates paired samples and solves the ridge regressions.
///
/// Shapes: Ls, Lt = source / target num_layers; Fl = 2 * source.num_kv_heads * source.head_dim
/// features per source layer (its keys and values); O = target.num_kv_heads * target.head_dim
/// outputs per map (one K map and one V map per target layer); C_j = the candidate source layers
/// of target layer j (all Ls for kAuto and kAll, the list for kExplicit).
///
/// Memory: the float64 accumulators (train and held-out parts) hold, whatever the number of
/// samples, 16 * (U * Fl + B * Fl^2 + sum_j (|C_j| * Fl * 2 * O + 2 * O + 2)) bytes, U the number
/// of distinct candidate layers and B the number of layer pairs that share some C_j (U(U+1)/2 when
/// every C_j holds all layers). add() also takes 8 * tokens * (U * Fl + 2 * Lt * O) bytes of
/// temporaries per call. A fitter fed CUDA views (see add()) holds the cross products (the Fl^2
/// and Fl * 2 O blocks above) a second time in device memory, where they accumulate; the host
/// copy is what fit() solves from. max_memory_bytes bounds each copy. Per call it also takes the
/// viewed spans of both views in host memory and at most 1 GiB of device staging (the features
/// go up in chunks of rows).
///
/// Two passes: when kAuto's all-layer accumulators exceed options.max_memory_bytes, the fitter
/// first runs a probe pass (passes() == 2, pass() == 0) that fits every source layer alone to
/// every target map's outputs projected on r = min(O, 32) seeded random directions, which takes
/// 16 * Ls * (Fl + Fl^2 + Fl * 2 * Lt * r) bytes. next_pass() ranks the source layers per target
/// layer by that held-out fit and keeps, round-robin by rank, as many candidates per target layer
/// as max_memory_bytes allows (at most max_source_layers); the samples are then added again (the
/// same ones: the held-out split restarts and repeats) and fit() selects among the candidates.
/// For two 32-layer models with 8 KV heads of dim 128 (Fl = 2048, O = 1024): one-pass
/// accumulators would take about 100 GiB; the probe takes 4 GiB, and every candidate costs about
/// 64 MiB for its K/V cross products plus 64 MiB per new layer pair, so the default 8 GiB keeps
/// about two candidates per target layer.
/// Time: add() is O(tokens * (U * Fl + B * Fl^2 + sum_j |C_j| * Fl * 2 * O)) in float64 BLAS
/// products (dsyrk for the diagonal blocks, dgemm for the rest), independent products running in
/// parallel on omp_get_max_threads() threads; with CUDA views the same products run on the device
/// (cuBLAS DSYRK / DGEMM, one after another on one stream) and the host's part is building and
/// uploading the float64 features, O(tokens * (U * Fl + 2 * Lt * O)).
/// fit() works on standardised features (each source layer's divided by the square root of its
/// mean variance), with A = ridge_grid.size() strengths and c = 2 O outputs per target layer:
/// - kAll, kExplicit: one eigendecomposition (LAPACK dsyevd) of size |S| * Fl per distinct set S,
///   shared by every target layer that uses it and by every ridge strength (independent sets in
///   parallel, a lone one on threaded LAPACK), plus O(|S| Fl * (|S| Fl + c) * c) per target layer.
/// - kAuto: per candidate layer an eigendecomposition of size Fl (shared by all target layers);
///   then each target layer on its own (target layers in parallel, one thread each): its first
///   layer is the best candidate alone by exact held-out R²; after that, with n = k Fl features
///   chosen, the remaining candidates are screened in O(n Fl c) each (the held-out R² of fitting
///   the current maps' training residual with that layer alone, every strength from the layer's
///   eigenbasis): all of them for the second layer, later the max(8, 4 exact_candidates) best by
///   the previous screen; and the exact_candidates best by the screen (one from max_source_layers
///   / 2 layers on) are fitted exactly, at every
///   strength, by extending the chosen set's Cholesky factors (one per strength) by one layer:
///   O(A n^2 (Fl + 3 c)) each. The best exact one is added if it gains at least min_gain in
///   held-out R² (the mean of K and V), else the target layer stops; at most max_source_layers.
///   Memory per target layer in progress: about A (n^2 + 2 n c) float64 for the factors,
///   weights and held-out products, n^2 + n c for the held-out scatter, and per exactly fitted
///   candidate A (n Fl + 2 n c); plus, shared, 3 Fl^2 per candidate layer and per target layer
///   in progress 2 |C_j| Fl c. For 30 source layers of Fl = 384 and 18 target layers of O = 256
///   with max_source_layers 8: at most about 1.1 GiB per target layer in progress (the eighth
///   layer's round), 1.6 GiB the other way round (Fl = 512, O = 192).
/// next_pass() does Ls eigendecompositions of size Fl.
class AdapterFitter {
 public:
  /// Throws InvalidArgument for bad specs or options, including accumulators over
  /// options.max_memory_bytes (for kAuto: when neither one pass nor the probe pass fits).
  AdapterFitter(const ModelSpec& source, const ModelSpec& target, const FitOptions& options = {});
  ~AdapterFitter();
  AdapterFitter(const AdapterFitter&) = delete;
  AdapterFitter& operator=(const AdapterFitter&) = delete;

  /// Adds one sequence: src and tgt are views matching the two specs, with the same token
  /// count, for the same tokens at absolute positions start_pos, start_pos + 1, ..., both on the
  /// CPU or both on one CUDA device.
  /// CUDA views (device or managed memory of cuda:index, any strides): the features are built on
  /// the host by the same code as for CPU views (RoPE, layer sets, held-out split and passes
  /// alike), from copies of the views made with synchronous copies on the legacy default stream
  /// (work on blocking streams is waited for; synchronise non-blocking streams that write the
  /// views first). The normal-equation products then run on that device with cuBLAS in float64
  /// (DSYRK, DGEMM) into accumulators kept on the device; fit() and next_pass() copy them back
  /// and solve on the CPU. The call returns when the products are complete. The results equal
  /// the CPU path's but for the products' summation order (float64 rounding). cuBLAS is loaded
  /// on first use as for LinearAdapter::convert.
  /// One device per fitter: the first add() that accumulates anything fixes it (the CPU or one
  /// CUDA device), for both passes; samples on any other device are refused (InvalidArgument).
  /// Throws InvalidArgument on mismatch, on non-finite values, for views on two devices or on
  /// another device than the fitter's, or planes that are not device memory of their device
  /// (nothing is accumulated then); Unavailable when this build has no CUDA path, no CUDA device
  /// is present, cuBLAS cannot be loaded or device memory allocated (nothing is accumulated
  /// then), or a CUDA call fails during the products, after which the accumulators may be
  /// incomplete and every later add(), next_pass() and fit() throws Unavailable.
  void add(const KVView& src, const KVView& tgt, int64_t start_pos = 0);
  /// Adds one sequence of a pair with different tokenizers (two tokenizations of one text):
  /// alignment holds one entry per target token (tgt.tokens() of them), a source token index in
  /// [0, src.tokens()) or kNoSource (align.h). Target token j (at absolute position
  /// start_pos + j) is paired with source token alignment[j] (its keys un-rotated at the source
  /// position start_pos + alignment[j]); target tokens with kNoSource are skipped. The token
  /// counts of src and tgt may differ. Memory and time as add() with tokens = the paired tokens
  /// (plus the un-rotated rows of every source token). Throws InvalidArgument as add(), and for an
  /// alignment of the wrong length or with an entry out of range (nothing is accumulated then).
  void add(const KVView& src, const KVView& tgt, int64_t start_pos,
           const std::vector<int64_t>& alignment);
  /// The two overloads above with the target's token ids (TargetTokens: tokens.ids one per
  /// target token of tgt, each below options.target_token_codes.vocab, tokens.previous as for
  /// LinearAdapter::convert), which a fitter with token codes needs (the others throw
  /// InvalidArgument then) and one without ignores. Throws InvalidArgument also for ids that are
  /// missing or out of range (nothing is accumulated then).
  void add(const KVView& src, const KVView& tgt, int64_t start_pos, const TargetTokens& tokens);
  void add(const KVView& src, const KVView& tgt, int64_t start_pos,
           const std::vector<int64_t>& alignment, const TargetTokens& tokens);

  /// 1, or 2 when a probe pass runs first (see above).
  int passes() const noexcept;
  /// The pass being accumulated, from 0.
  int pass() const noexcept;
  /// Ends the probe pass: picks each target layer's candidate source layers, frees the probe's
  /// accumulators (on the device too) and starts the final pass with no samples. Throws InvalidArgument if the fitter
  /// is not in a probe pass or the probe holds fewer than 2 training and 2 held-out tokens.
  void next_pass();
  /// [target layer] -> ascending source layers fit() chooses from. Throws InvalidArgument during
  /// a probe pass.
  std::vector<std::vector<int64_t>> candidate_layers() const;

  /// Tokens of the current pass.
  int64_t train_tokens() const noexcept;
  int64_t holdout_tokens() const noexcept;
  /// Bytes held by the accumulators.
  int64_t memory_bytes() const noexcept;

  /// Solves the regressions (a CUDA fitter first copies its device accumulators back; it keeps
  /// them, so more samples may follow). Throws InvalidArgument during a probe pass or if too few
  /// tokens were added (fewer than 2 training or 2 held-out tokens); Unavailable when a CUDA
  /// copy fails or an earlier add() failed on the device.
  LinearAdapter fit() const;
  /// As fit(), reporting progress to `progress` (may be empty) after every step.
  LinearAdapter fit(const FitProgressCallback& progress) const;

 private:
  void add_impl(const KVView& src, const KVView& tgt, int64_t start_pos,
                const std::vector<int64_t>* alignment, const TargetTokens* tokens);
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvbridge
