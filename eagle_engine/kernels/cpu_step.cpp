// The small per-iteration steps of the CPU engine, in C++: the greedy argmax of logits rows,
// greedy tree acceptance, the tree (with the context's chain) and its bookkeeping from its
// parents, the KV commit, and sampling's distribution and draw.
//
// On a CPU an EAGLE-3 iteration of the bundled target costs ~5 ms, and each small ATen op
// ~5-30 us with the weights' stream evicting its code and data from the caches: as ~40 such
// ops, acceptance, the tree and the commit cost ~0.35 ms an iteration.
// Each function here returns exactly what its torch reference returns (`reference.py`,
// `verify.greedy_acceptance`; tests/test_cpu_step.py), and the engine uses them once the q4
// weights have loaded this module (`kernels/__init__.py`). Built with `cpu_lowbit.cpp` into one
// module (`cpu_lowbit.load`). Not here: the products and layers (`cpu_lowbit.cpp`).
// Narrow headers, as in cpu_lowbit.cpp (why: there).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <utility>
#include <vector>

#include <immintrin.h>

#include "cpu_vec.h"

namespace {

// The first index of the row's maximum, as torch's max(-1).indices gives it; a row holding NaN
// gives its first NaN (torch's max propagates NaN).
int64_t argmax_row(const float* x, int64_t V) {
  int64_t i = 0;
  float best = -INFINITY;
  bool nan = false;
  if (V >= 32) {
    __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0, m2 = m0, m3 = m0;
    __m256 un = _mm256_setzero_ps();  // lanes that met NaN
    for (; i + 32 <= V; i += 32) {
      const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
      const __m256 c = _mm256_loadu_ps(x + i + 16), d = _mm256_loadu_ps(x + i + 24);
      un = _mm256_or_ps(un, _mm256_or_ps(_mm256_cmp_ps(a, b, _CMP_UNORD_Q),
                                         _mm256_cmp_ps(c, d, _CMP_UNORD_Q)));
      m0 = _mm256_max_ps(m0, a);
      m1 = _mm256_max_ps(m1, b);
      m2 = _mm256_max_ps(m2, c);
      m3 = _mm256_max_ps(m3, d);
    }
    nan = _mm256_movemask_ps(un) != 0;
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, _mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3)));
    for (float v : lanes) best = std::max(best, v);
  }
  for (int64_t j = i; j < V; ++j) {
    nan = nan || std::isnan(x[j]);
    best = std::max(best, x[j]);
  }
  for (int64_t j = 0; j < V; ++j)
    if (nan ? std::isnan(x[j]) : x[j] == best) return j;
  return 0;  // not reached: best is one of the row's values
}

void check_vector(const at::Tensor& t, const char* name, int64_t n) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == n && t.scalar_type() == at::kLong && t.is_contiguous(),
              name, " must be a contiguous int64 [", n, "], got ", t.scalar_type(), " ", t.sizes());
}

}  // namespace

// logits [M, V] float32 -> [M] int64: each row's first maximum (greedy decoding's token).
at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous() &&
                  logits.size(1) > 0,
              "logits must be contiguous float32 [M, V], got ", logits.scalar_type(), " ",
              logits.sizes());
  const int64_t M = logits.size(0), V = logits.size(1);
  auto out = at::empty({M}, at::kLong);
  for (int64_t m = 0; m < M; ++m)
    out.data_ptr<int64_t>()[m] = argmax_row(logits.data_ptr<float>() + m * V, V);
  return out;
}

// Greedy acceptance of a verified tree (`verify.greedy_acceptance`): node j is right when its
// token is the target's argmax after its parent, the accepted node is the deepest one whose
// whole root path is right (the first on ties), and the iteration emits its path's tokens then
// the argmax after it. Only the rows on right paths are reduced to their argmax.
// logits [N, V] float32; tokens, parents (-1: the root; a parent precedes its child), depth [N]
// int64; retrieve [N, W] int64 (each node's root path, -1 padded) ->
// {accepted_nodes [W] (retrieve's row), num_accepted [1], emitted [W] (-1 padded)}.
std::vector<at::Tensor> greedy_accept(const at::Tensor& logits, const at::Tensor& tokens,
                                         const at::Tensor& parents, const at::Tensor& depth,
                                         const at::Tensor& retrieve) {
  const int64_t N = tokens.numel();
  TORCH_CHECK(logits.dim() == 2 && logits.size(0) == N && logits.scalar_type() == at::kFloat &&
                  logits.is_contiguous(),
              "logits must be contiguous float32 [", N, ", V], got ", logits.scalar_type(), " ",
              logits.sizes());
  check_vector(tokens, "tokens", N);
  check_vector(parents, "parents", N);
  check_vector(depth, "depth", N);
  TORCH_CHECK(N > 0 && retrieve.dim() == 2 && retrieve.size(0) == N &&
                  retrieve.scalar_type() == at::kLong && retrieve.is_contiguous(),
              "retrieve must be contiguous int64 [", N, ", W], got ", retrieve.sizes());
  const int64_t V = logits.size(1), W = retrieve.size(1);
  const int64_t* tok = tokens.data_ptr<int64_t>();
  const int64_t* par = parents.data_ptr<int64_t>();
  const int64_t* dep = depth.data_ptr<int64_t>();
  std::vector<int64_t> predict(N, -1);  // argmax after node j, once needed
  auto argmax_after = [&](int64_t j) {
    if (predict[j] < 0) predict[j] = argmax_row(logits.data_ptr<float>() + j * V, V);
    return predict[j];
  };
  std::vector<char> ok(N, 0);
  int64_t best = 0;
  for (int64_t j = 0; j < N; ++j) {
    const int64_t p = par[j];
    TORCH_CHECK(j == 0 ? p < 0 : (p >= 0 && p < j), "parents must list the root first and ",
                "every parent before its child; node ", j, " has parent ", p);
    ok[j] = j == 0 || (ok[p] && tok[j] == argmax_after(p));
    if (ok[j] && dep[j] > dep[best]) best = j;
  }
  auto nodes = retrieve[best].clone();  // [W]
  auto num = at::full({1}, dep[best], at::kLong);
  auto emitted = at::full({W}, -1, at::kLong);
  const int64_t* path = nodes.data_ptr<int64_t>();
  int64_t* out = emitted.data_ptr<int64_t>();
  TORCH_CHECK(dep[best] < W, "depth ", dep[best], " does not fit retrieve's ", W, " columns");
  for (int64_t k = 0; k < dep[best]; ++k) out[k] = tok[path[k + 1]];
  out[dep[best]] = argmax_after(best);
  return {nodes, num, emitted};
}

// `reference.build_tree_from_parents`: parents [N] int64 -> depth [N] int64, ancestors [N, N]
// bool (ancestor-or-self, at most max_depth links up), retrieve [N, min(N, max_depth + 1)]
// int64 (the ancestors in index order, -1 padded).
std::vector<at::Tensor> tree_from_parents(const at::Tensor& parents, int64_t max_depth) {
  const int64_t N = parents.numel();
  check_vector(parents, "parents", N);
  TORCH_CHECK(N > 0 && max_depth >= 0, "a tree needs nodes and max_depth >= 0, got ", N, ", ",
              max_depth);
  const int64_t W = std::min(N, max_depth + 1);
  auto depth = at::empty({N}, at::kLong);
  auto ancestors = at::zeros({N, N}, at::kBool);
  auto retrieve = at::full({N, W}, -1, at::kLong);
  const int64_t* par = parents.data_ptr<int64_t>();
  bool* anc = ancestors.data_ptr<bool>();
  for (int64_t i = 0; i < N; ++i) {
    int64_t node = i;
    for (int64_t link = 0; link <= max_depth && node >= 0; ++link) {
      TORCH_CHECK(node < N, "parent ", node, " of a node past the tree's ", N, " nodes");
      anc[i * N + node] = true;
      node = par[node];
    }
    int64_t k = 0;
    for (int64_t j = 0; j < N; ++j)
      if (anc[i * N + j]) {
        if (k < W) retrieve.data_ptr<int64_t>()[i * W + k] = j;
        ++k;
      }
    depth.data_ptr<int64_t>()[i] = k - 1;
  }
  return {depth, ancestors, retrieve};
}

// `tree.merge_context` (when the context has a chain) then `tree.build_tree`, in one call: the
// head's candidates scores [C] float32, tokens, parents (-1: a child of the root; parents
// precede children), sources [C] int64 (or empty: all the head's); the context's chain
// chain_tokens / chain_scores [L] (L may be 0); the head's depth S = num_steps; the root's token
// [1] (read here: Python reads no scalar, as on a GPU); the tree's size, its min_score (0: none),
// its context_extra with the score a chain node needs past the budget (CHAIN_SURE), and
// max_depth ->
// {tokens, parents, depth, ancestors, retrieve, scores, sources} of the selected tree, root
// first (`EagleVerifyInput`).
std::vector<at::Tensor> build_tree(const at::Tensor& scores, const at::Tensor& tokens,
                                      const at::Tensor& parents, const at::Tensor& sources,
                                      const std::vector<int64_t>& chain_tokens,
                                      const std::vector<double>& chain_scores, int64_t num_steps,
                                      const at::Tensor& root, int64_t num_draft_tokens,
                                      double min_score, int64_t context_extra, double chain_sure,
                                      int64_t max_depth) {
  const int64_t C = tokens.numel(), L = chain_tokens.size();
  TORCH_CHECK(scores.dim() == 1 && scores.size(0) == C && scores.scalar_type() == at::kFloat &&
                  scores.is_contiguous(),
              "scores must be contiguous float32 [", C, "], got ", scores.sizes());
  check_vector(tokens, "tokens", C);
  check_vector(parents, "parents", C);
  const bool own_sources = sources.numel() > 0;
  if (own_sources) check_vector(sources, "sources", C);
  TORCH_CHECK(int64_t(chain_scores.size()) == L, "chain of ", L, " tokens and ",
              chain_scores.size(), " scores");
  check_vector(root, "root", 1);
  TORCH_CHECK(num_draft_tokens >= 1 && num_steps >= 1, "num_draft_tokens ", num_draft_tokens,
              " and num_steps ", num_steps, " must be >= 1");
  // the candidates: the head's C, then the chain's L (merge_context)
  std::vector<float> sc(scores.data_ptr<float>(), scores.data_ptr<float>() + C);
  std::vector<int64_t> tok(tokens.data_ptr<int64_t>(), tokens.data_ptr<int64_t>() + C);
  std::vector<int64_t> par(parents.data_ptr<int64_t>(), parents.data_ptr<int64_t>() + C);
  std::vector<int64_t> src(C, 0);
  if (own_sources) std::copy_n(sources.data_ptr<int64_t>(), C, src.begin());
  if (L > 0) {
    std::vector<int64_t> depth(C);
    std::vector<char> on_chain(C);  // its root path is the chain's first tokens
    std::vector<int64_t> shared(L, -1);  // the head's candidate on chain node j, the last one
    for (int64_t c = 0; c < C; ++c) {
      const int64_t p = par[c];
      TORCH_CHECK(p < c, "candidate ", c, " has parent ", p, ": parents must come first");
      depth[c] = p < 0 ? 1 : depth[p] + 1;
      const int64_t d = depth[c];
      const bool same = d <= std::min(num_steps, L) && tok[c] == chain_tokens[d - 1];
      on_chain[c] = same && (p < 0 || on_chain[p]);
      if (on_chain[c]) shared[d - 1] = c;
    }
    // a shared node scores 1 - (1 - head) * (1 - chain); the chain's nodes past the last shared
    // one score its score times the chain's own rates past it (p * lift), in float32 in torch's
    // order (a chain score of 0, float32 underflow, lifts nothing)
    float lift = 1.f;
    for (int64_t j = 0; j < L; ++j) {
      const float p = float(chain_scores[j]);
      const int64_t holder_parent = j == 0 ? -1 : (shared[j - 1] >= 0 ? shared[j - 1] : C + j - 1);
      if (shared[j] >= 0) {
        float miss = (1.f - sc[shared[j]]) * (1.f - p);
        asm("" : "+x"(miss));  // rounded here, as torch rounds it: no fused multiply-subtract
        sc[shared[j]] = 1.f - miss;
        lift = p > 0.f ? sc[shared[j]] / p : 1.f;
        src[shared[j]] = std::max<int64_t>(src[shared[j]], 2);  // NodeSource.BOTH
      }
      sc.push_back(shared[j] >= 0 ? -1.f : p * lift);  // a shared node's own copy: never selected
      tok.push_back(chain_tokens[j]);
      par.push_back(holder_parent);
      src.push_back(1);  // NodeSource.CONTEXT
    }
  }
  // the best num_draft_tokens - 1 candidates (a stable descending sort) that score at least
  // min_score, in candidate order
  const int64_t total = sc.size();
  std::vector<int64_t> order(total);
  for (int64_t c = 0; c < total; ++c) order[c] = c;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return sc[a] > sc[b]; });
  int64_t n = std::min(total, num_draft_tokens - 1);
  if (min_score > 0)  // compared in float32, as the torch reference compares
    while (n > 0 && !(sc[order[n - 1]] >= float(min_score))) --n;
  std::vector<int64_t> selected(order.begin(), order.begin() + n);
  // past the budget, the first context_extra of the rest that came from the context and score
  // at least chain_sure (and min_score), in ranking order: a parent comes before its child
  const float sure = float(std::max(chain_sure, min_score));
  for (int64_t i = n, extra = 0; i < total && extra < context_extra; ++i)
    if (src[order[i]] > 0 && sc[order[i]] >= sure) selected.push_back(order[i]), ++extra;
  n = selected.size();
  std::sort(selected.begin(), selected.end());
  const int64_t N = n + 1;
  auto out_tokens = at::empty({N}, at::kLong), out_parents = at::empty({N}, at::kLong);
  auto out_scores = at::empty({N}, at::kFloat), out_sources = at::empty({N}, at::kLong);
  int64_t* ot = out_tokens.data_ptr<int64_t>();
  int64_t* op = out_parents.data_ptr<int64_t>();
  float* os = out_scores.data_ptr<float>();
  int64_t* osrc = out_sources.data_ptr<int64_t>();
  ot[0] = root.data_ptr<int64_t>()[0], op[0] = -1, os[0] = 1.f, osrc[0] = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t c = selected[i], p = par[c];
    ot[i + 1] = tok[c], os[i + 1] = sc[c], osrc[i + 1] = src[c];
    // the parent's node: 1 + its rank among the selected (searchsorted, as build_tree does)
    op[i + 1] = p < 0 ? 0 : 1 + (std::lower_bound(selected.begin(), selected.end(), p) -
                                 selected.begin());
  }
  auto bookkeeping = tree_from_parents(out_parents, max_depth);
  return {out_tokens, out_parents, bookkeeping[0], bookkeeping[1], bookkeeping[2], out_scores,
          out_sources};
}

// `reference.compact_kv`: cache [B, H, max_len, d] (any dtype) rows src_rows [n] -> rows
// [dst_start, dst_start + n), every source read before any row is written. Rows already in
// place are not copied: each copy of a plane's row is a cache miss (the planes lie max_len
// rows apart), and an accepted path often starts where it belongs.
void compact_rows(at::Tensor cache, const at::Tensor& src_rows, int64_t dst_start) {
  TORCH_CHECK(cache.dim() == 4 && cache.is_contiguous(), "cache must be contiguous [B, H, len, d]");
  const int64_t n = src_rows.numel(), len = cache.size(2);
  check_vector(src_rows, "src_rows", n);
  TORCH_CHECK(dst_start >= 0 && dst_start + n <= len, "rows [", dst_start, ", ", dst_start + n,
              ") past the cache's ", len);
  const int64_t* src = src_rows.data_ptr<int64_t>();
  for (int64_t k = 0; k < n; ++k)
    TORCH_CHECK(src[k] >= 0 && src[k] < len, "source row ", src[k], " past the cache's ", len);
  const int64_t row = cache.size(3) * cache.element_size(), planes = cache.size(0) * cache.size(1);
  char* base = static_cast<char*>(cache.data_ptr());
  std::vector<int64_t> moved;  // slots whose row comes from elsewhere
  for (int64_t k = 0; k < n; ++k)
    if (src[k] != dst_start + k) moved.push_back(k);
  std::vector<char> rows(moved.size() * row);
  for (int64_t p = 0; p < planes; ++p) {
    char* plane = base + p * len * row;
    for (size_t i = 0; i < moved.size(); ++i)
      std::memcpy(rows.data() + i * row, plane + src[moved[i]] * row, row);
    for (size_t i = 0; i < moved.size(); ++i)
      std::memcpy(plane + (dst_start + moved[i]) * row, rows.data() + i * row, row);
  }
}

// ---- Sampling (`reference.sampling_probs`, `reference.sample_rows`) ---------------------------
// The torch reference takes ~0.5 ms for a row of the target's 49,152 logits (its partial top-k
// of 256 alone ~0.3 ms) and its draw ~0.3 ms more: ~15% of a sampled one-token step, and more
// for a tree's rows. Here a row is a few passes over the logits, and top-p sorts only the
// tokens within a factor of the most likely one (2^10, then 2^20, ... until they hold top_p),
// which is the set a full sort would keep. The numbers equal the reference's up to float
// rounding (a vector exp and other summation orders; tests/test_cpu_step.py), and every caller
// on a CPU that has loaded this module uses these, the plain sampler and tree acceptance alike,
// so acceptance stays exact for the distribution they share.

namespace {

// One row: x [V] logits -> out [V] probabilities; l [V] scratch.
void probs_row(const float* x, float* out, int64_t V, float temperature, int64_t top_k,
               float top_p, std::vector<float>& l, std::vector<std::pair<float, int64_t>>& cand) {
  const __m256 t = _mm256_set1_ps(temperature);
  __m256 vmax = _mm256_set1_ps(-INFINITY);
  int64_t i = 0;
  for (; i + 8 <= V; i += 8) {  // as torch: a float32 division
    const __m256 v = _mm256_div_ps(_mm256_loadu_ps(x + i), t);
    _mm256_storeu_ps(l.data() + i, v);
    vmax = _mm256_max_ps(vmax, v);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  float m = -INFINITY;
  for (float v : lanes) m = std::max(m, v);
  for (; i < V; ++i) m = std::max(m, l[i] = x[i] / temperature);
  if (top_k > 0 && top_k < V) {  // the k-th largest value, duplicates counted; below it dropped
    std::vector<float> heap(l.begin(), l.begin() + top_k);  // a min-heap of the k largest
    std::make_heap(heap.begin(), heap.end(), std::greater<float>());
    for (int64_t j = top_k; j < V; ++j)
      if (l[j] > heap.front()) {
        std::pop_heap(heap.begin(), heap.end(), std::greater<float>());
        heap.back() = l[j];
        std::push_heap(heap.begin(), heap.end(), std::greater<float>());
      }
    const float kth = heap.front();
    for (int64_t j = 0; j < V; ++j)
      if (l[j] < kth) l[j] = -INFINITY;
  }
  // e = exp(l - max) into out (1 for the most likely token), summed in double (torch's softmax
  // sums in float32: ~1e-6 of the mass apart)
  __m256d acc_lo = _mm256_setzero_pd(), acc_hi = acc_lo;
  for (i = 0; i + 8 <= V; i += 8) {
    const __m256 e = vexp(_mm256_sub_ps(_mm256_loadu_ps(l.data() + i), _mm256_set1_ps(m)));
    _mm256_storeu_ps(out + i, e);
    acc_lo = _mm256_add_pd(acc_lo, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
    acc_hi = _mm256_add_pd(acc_hi, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
  }
  alignas(32) double sums[4];
  _mm256_store_pd(sums, _mm256_add_pd(acc_lo, acc_hi));
  double z = sums[0] + sums[1] + sums[2] + sums[3];
  for (; i < V; ++i) {
    alignas(32) float one[8] = {l[i] - m};
    _mm256_store_ps(one, vexp(_mm256_load_ps(one)));
    z += out[i] = one[0];
  }
  const float inv = float(1.0 / z);  // p = e * inv
  if (top_p >= 1.f) {
    for (int64_t j = 0; j < V; ++j) out[j] *= inv;
    return;
  }
  // the nucleus: in descending order (ties by index), the tokens whose predecessors hold less
  // than top_p (mass strictly before a token as torch's cumsum gives it: a double sum, rounded),
  // found among the tokens with e >= floor, floor lowered 2^10 at a time until they hold top_p
  float floor = 1.f / 1024.f;
  for (;;) {
    cand.clear();
    double mass = 0;
    const __m256 f = _mm256_set1_ps(floor);
    for (i = 0; i < V; i += 8) {
      if (i + 8 <= V && !_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(out + i), f, _CMP_GE_OQ)))
        continue;  // no candidate among these 8
      for (int64_t j = i; j < std::min(i + 8, V); ++j)
        if (out[j] >= floor && out[j] > 0.f) {
          cand.emplace_back(out[j] * inv, j);
          mass += cand.back().first;
        }
    }
    if (mass >= top_p || floor == 0.f) break;
    floor = floor < 1e-30f ? 0.f : floor / 1024.f;
  }
  std::sort(cand.begin(), cand.end(), [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  });
  double before = 0, kept = 0;
  size_t n = 0;
  for (; n < cand.size(); ++n) {
    const double upto = before + cand[n].first;
    if (float(upto) - cand[n].first >= top_p) break;
    before = upto;
    kept += cand[n].first;
  }
  std::fill(out, out + V, 0.f);
  const float scale = float(1.0 / kept);
  for (size_t k = 0; k < n; ++k) out[cand[k].second] = cand[k].first * scale;
}

// Calls visit(k) for k = 0, 1, ... in order, skipping blocks of 8 zeros (adding 0 leaves a sum
// as it is), until visit returns true: the rows of a top-p distribution are mostly zeros.
template <class Visit>
void nonzero_in_order(const float* p, int64_t V, Visit visit) {
  const __m256 all = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  int64_t j = 0;
  for (; j + 8 <= V; j += 8) {
    if (_mm256_testz_ps(_mm256_cmp_ps(_mm256_loadu_ps(p + j), _mm256_setzero_ps(), _CMP_NEQ_UQ), all))
      continue;
    for (int64_t k = j; k < j + 8; ++k)
      if (visit(k)) return;
  }
  for (; j < V; ++j)
    if (visit(j)) return;
}

// One inverse-CDF draw from p [V] (unnormalized allowed) with coin in [0, 1): the first token
// whose running sum (in double, rounded to float: torch's cumsum on a CPU) exceeds coin * the
// total; past the end, the last token; a token of probability 0 (a coin on a zero tail) gives
// the row's first maximum instead.
int64_t sample_row(const float* p, int64_t V, float coin) {
  double total = 0;
  nonzero_in_order(p, V, [&](int64_t k) { total += p[k]; return false; });
  const float target = coin * float(total);
  double acc = 0;
  int64_t id = V - 1;
  nonzero_in_order(p, V, [&](int64_t k) { return float(acc += p[k]) > target && (id = k, true); });
  return p[id] == 0.f ? argmax_row(p, V) : id;
}

}  // namespace

// logits [M, V] float32 -> probabilities [M, V] float32 (temperature > 0; top_k 0: off;
// top_p 1: off).
at::Tensor sampling_probs(const at::Tensor& logits, double temperature, int64_t top_k,
                             double top_p) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous() &&
                  logits.size(1) > 0,
              "logits must be contiguous float32 [M, V], got ", logits.scalar_type(), " ",
              logits.sizes());
  TORCH_CHECK(temperature > 0 && top_k >= 0 && top_p > 0 && top_p <= 1,
              "sampling needs temperature > 0, top_k >= 0 and 0 < top_p <= 1, got ", temperature,
              ", ", top_k, ", ", top_p);
  const int64_t M = logits.size(0), V = logits.size(1);
  auto out = at::empty({M, V}, at::kFloat);
  std::vector<float> scratch(V);
  std::vector<std::pair<float, int64_t>> cand;
  for (int64_t r = 0; r < M; ++r)
    probs_row(logits.data_ptr<float>() + r * V, out.data_ptr<float>() + r * V, V,
              float(temperature), top_k, float(top_p), scratch, cand);
  return out;
}

// probs [M, V] float32 (unnormalized allowed), coins [M] float32 in [0, 1) -> [M] int64, a
// `sample_row` draw per row.
at::Tensor sample_rows(const at::Tensor& probs, const at::Tensor& coins) {
  TORCH_CHECK(probs.dim() == 2 && probs.scalar_type() == at::kFloat && probs.is_contiguous() &&
                  probs.size(1) > 0,
              "probs must be contiguous float32 [M, V], got ", probs.scalar_type(), " ",
              probs.sizes());
  const int64_t M = probs.size(0), V = probs.size(1);
  TORCH_CHECK(coins.dim() == 1 && coins.size(0) == M && coins.scalar_type() == at::kFloat &&
                  coins.is_contiguous(),
              "coins must be contiguous float32 [", M, "], got ", coins.scalar_type(), " ",
              coins.sizes());
  auto out = at::empty({M}, at::kLong);
  for (int64_t r = 0; r < M; ++r)
    out.data_ptr<int64_t>()[r] = sample_row(probs.data_ptr<float>() + r * V, V, coins.data_ptr<float>()[r]);
  return out;
}

// Tree speculative sampling (`verify.sampled_acceptance_torch`): from the root, the children of
// the accepted node are tried in index order against the coin of their level, child k accepted
// iff sum_{j<k} p(x_j) <= u < sum_{j<=k} p(x_j) under the node's distribution (in double); when
// none is, the bonus token is drawn from that distribution with the children's tokens removed
// (itself if they held all its mass). Siblings hold distinct tokens, as a drafted tree's do.
// Only the rows on the accepted path get a distribution (`probs_row`, as `sampling_probs` gives
// them), where the reference computes every row.
// logits [N, V] float32; tokens, parents, depth [N] int64; retrieve [N, W] int64; coins
// [max(W - 1, 1)] and bonus_coin [1] float32 -> {accepted_nodes [W], num_accepted [1], emitted
// [W] (-1 padded)}.
std::vector<at::Tensor> sampled_accept(const at::Tensor& logits, const at::Tensor& tokens,
                                          const at::Tensor& parents, const at::Tensor& depth,
                                          const at::Tensor& retrieve, const at::Tensor& coins,
                                          const at::Tensor& bonus_coin, double temperature,
                                          int64_t top_k, double top_p) {
  const int64_t N = tokens.numel();
  TORCH_CHECK(N > 0 && logits.dim() == 2 && logits.size(0) == N && logits.size(1) > 0 &&
                  logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "logits must be contiguous float32 [", N, ", V], got ", logits.scalar_type(), " ",
              logits.sizes());
  check_vector(tokens, "tokens", N);
  check_vector(parents, "parents", N);
  check_vector(depth, "depth", N);
  TORCH_CHECK(retrieve.dim() == 2 && retrieve.size(0) == N && retrieve.scalar_type() == at::kLong &&
                  retrieve.is_contiguous(),
              "retrieve must be contiguous int64 [", N, ", W], got ", retrieve.sizes());
  const int64_t V = logits.size(1), W = retrieve.size(1);
  TORCH_CHECK(coins.dim() == 1 && coins.size(0) == std::max<int64_t>(W - 1, 1) &&
                  coins.scalar_type() == at::kFloat && coins.is_contiguous() &&
                  bonus_coin.numel() == 1 && bonus_coin.scalar_type() == at::kFloat,
              "coins must be float32 [", std::max<int64_t>(W - 1, 1), "] and bonus_coin float32 [1], got ",
              coins.sizes(), " and ", bonus_coin.sizes());
  TORCH_CHECK(temperature > 0 && top_k >= 0 && top_p > 0 && top_p <= 1,
              "sampling needs temperature > 0, top_k >= 0 and 0 < top_p <= 1, got ", temperature,
              ", ", top_k, ", ", top_p);
  const int64_t* tok = tokens.data_ptr<int64_t>();
  const int64_t* par = parents.data_ptr<int64_t>();
  const int64_t* dep = depth.data_ptr<int64_t>();
  const float* u = coins.data_ptr<float>();
  for (int64_t j = 0; j < N; ++j) {
    TORCH_CHECK(j == 0 ? par[j] < 0 : (par[j] >= 0 && par[j] < j), "parents must list the root first ",
                "and every parent before its child; node ", j, " has parent ", par[j]);
    TORCH_CHECK(tok[j] >= 0 && tok[j] < V, "token ", tok[j], " of node ", j, " is outside [0, ", V, ")");
    TORCH_CHECK(j == 0 || (dep[j] >= 1 && dep[j] < W), "node ", j, " has depth ", dep[j],
                ", outside [1, ", W, ")");
  }
  std::vector<float> p(V), scratch(V);
  std::vector<std::pair<float, int64_t>> cand;
  int64_t node = 0;
  for (;;) {
    probs_row(logits.data_ptr<float>() + node * V, p.data(), V, float(temperature), top_k,
              float(top_p), scratch, cand);
    int64_t next = -1;
    double below = 0;
    for (int64_t j = node + 1; j < N && next < 0; ++j) {
      if (par[j] != node) continue;
      const double upto = below + double(p[tok[j]]), coin = u[dep[j] - 1];
      if (below <= coin && coin < upto) next = j;
      below = upto;
    }
    if (next < 0) break;
    node = next;
  }
  std::vector<float> residual(p);
  for (int64_t j = node + 1; j < N; ++j)
    if (par[j] == node) residual[tok[j]] = 0.f;
  const bool left = std::any_of(residual.begin(), residual.end(), [](float v) { return v > 0.f; });
  const int64_t bonus = sample_row(left ? residual.data() : p.data(), V, bonus_coin.data_ptr<float>()[0]);
  auto nodes = retrieve[node].clone();  // [W]
  auto num = at::full({1}, dep[node], at::kLong);
  auto emitted = at::full({W}, -1, at::kLong);
  const int64_t* path = nodes.data_ptr<int64_t>();
  int64_t* out = emitted.data_ptr<int64_t>();
  for (int64_t k = 0; k < dep[node]; ++k) out[k] = tok[path[k + 1]];
  out[dep[node]] = bonus;
  return {nodes, num, emitted};
}

void register_step(pybind11::module& m) {
  m.def("argmax_rows", &argmax_rows, "logits [M, V] f32 -> [M] first index of each row's maximum");
  m.def("greedy_accept", &greedy_accept, "greedy tree acceptance -> accepted nodes, count, emitted");
  m.def("build_tree", &build_tree, "candidates (+ the context's chain) -> the tree to verify");
  m.def("tree_from_parents", &tree_from_parents, "parents [N] -> depth, ancestors, retrieve");
  m.def("compact_rows", &compact_rows, "cache rows src_rows -> [dst_start, dst_start + n)");
  m.def("sampling_probs", &sampling_probs, "logits [M, V] -> probabilities (temperature, top-k, top-p)");
  m.def("sample_rows", &sample_rows, "probs [M, V], coins [M] -> [M] inverse-CDF draws");
  m.def("sampled_accept", &sampled_accept, "tree speculative sampling -> accepted nodes, count, emitted");
}
