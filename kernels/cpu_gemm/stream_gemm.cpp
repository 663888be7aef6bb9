// Weight-streaming small-M GEMM for CPUs with AVX2 + FMA: y[m, n] = sum_k x[m, k] * w[n, k].
// See __init__.py for the contract. Each output is one fixed sequence of fp32 FMAs over k (eight
// lanes, then a fixed lane sum), whatever M is and whichever row block m falls in, so a row's
// result does not depend on the other rows of the call (batch invariance).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int kRowsPerBlock = 4;   // weight rows streamed together (4 sequential streams)

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {  // bf16 -> fp32 is a 16-bit shift: exact
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline float load1(const float* p) { return *p; }
inline float load1(const at::BFloat16* p) { return static_cast<float>(*p); }

inline float lane_sum(__m256 v) {  // fixed order: (lo + hi), then pairs
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// R weight rows against MB x rows, all of K: MB x R accumulators of eight lanes. `ahead` (or
// null): the bytes of R rows further on, prefetched over this pass, `ahead_step` bytes a k step.
template <typename W, int R, int MB>
inline void block(const float* x, int64_t K, const W* w, float* y, int64_t ldy, const char* ahead,
                  int64_t ahead_step) {
  __m256 acc[MB][R];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_ps();
  const int64_t K8 = K & ~int64_t(7);
  for (int64_t k = 0; k < K8; k += 8) {
    if (ahead) {
      const char* p = ahead + (k / 8) * ahead_step;
      for (int64_t b = 0; b < ahead_step; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
    }
    __m256 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = load8(w + r * K + k);
    for (int m = 0; m < MB; ++m) {
      __m256 xv = _mm256_loadu_ps(x + m * K + k);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm256_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) {
      float s = lane_sum(acc[m][r]);
      for (int64_t k = K8; k < K; ++k) s = std::fma(x[m * K + k], load1(w + r * K + k), s);
      y[m * ldy + r] = s;
    }
}

#ifndef PREFETCH_BLOCKS
#define PREFETCH_BLOCKS 2
#endif
constexpr int64_t kPrefetchBlocks = PREFETCH_BLOCKS;  // how far ahead (in blocks) the first pass prefetches

// One block of `rows` (<= kRowsPerBlock) weight rows against MB x rows, as sub-blocks of R rows
// (R x MB <= 12 accumulators; one weight row at a time at a block's tail). `prefetch`: this pass
// also prefetches the same rows kPrefetchBlocks blocks on (the first pass over a block streams it
// from memory; the hardware prefetcher alone left one core at ~6 GB/s on these short streams).
template <typename W, int MB>
inline void chunk(const float* x, int64_t K, const W* w, int64_t rows, float* y, int64_t N, bool prefetch,
                  const W* end) {
  constexpr int R = MB <= 3 ? 4 : (MB <= 6 ? 2 : 1);
  const int64_t ahead_step = R * 8 * int64_t(sizeof(W));  // R rows' worth of one k step
  int64_t r = 0;
  for (; r + R <= rows; r += R) {
    const W* wr = w + r * K;
    const W* far = wr + kPrefetchBlocks * kRowsPerBlock * K;
    const char* ahead = prefetch && far + R * K <= end ? reinterpret_cast<const char*>(far) : nullptr;
    block<W, R, MB>(x, K, wr, y + r, N, ahead, ahead_step);
  }
  for (; r < rows; ++r) block<W, 1, MB>(x, K, w + r * K, y + r, N, nullptr, 0);
}

template <typename W>
inline void chunk_any(int64_t mb, const float* x, int64_t K, const W* w, int64_t rows, float* y, int64_t N,
                      bool prefetch, const W* end) {
  switch (mb) {
    case 1: chunk<W, 1>(x, K, w, rows, y, N, prefetch, end); break;
    case 2: chunk<W, 2>(x, K, w, rows, y, N, prefetch, end); break;
    case 3: chunk<W, 3>(x, K, w, rows, y, N, prefetch, end); break;
    case 4: chunk<W, 4>(x, K, w, rows, y, N, prefetch, end); break;
    case 5: chunk<W, 5>(x, K, w, rows, y, N, prefetch, end); break;
    case 6: chunk<W, 6>(x, K, w, rows, y, N, prefetch, end); break;
    case 7: chunk<W, 7>(x, K, w, rows, y, N, prefetch, end); break;
    default: chunk<W, 8>(x, K, w, rows, y, N, prefetch, end); break;
  }
}

constexpr int64_t kMaxRowsPerPass = 8;

template <typename W>
void gemm(const float* x, int64_t M, int64_t K, const W* w, int64_t N, float* y) {
  const int64_t blocks = (N + kRowsPerBlock - 1) / kRowsPerBlock;
  // x rows in near-equal passes of at most 8: one pass over the weights up to M = 8.
  const int64_t passes = (M + kMaxRowsPerPass - 1) / kMaxRowsPerPass;
  // Grain: at least 16 blocks (64 weight rows) a task, so small matrices are not split into slivers.
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    const W* end = w + std::min(N, b1 * kRowsPerBlock) * K;  // prefetch stays inside this task's rows
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = b * kRowsPerBlock;
      const int64_t rows = std::min<int64_t>(kRowsPerBlock, N - n);
      for (int64_t p = 0, m = 0; p < passes; ++p) {
        const int64_t mb = (M - m) / (passes - p);
        chunk_any(mb, x + m * K, K, w + n * K, rows, y + m * N + n, N, p == 0, end);
        m += mb;
      }
    }
  });
}

at::Tensor stream_linear(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "stream_linear: CPU tensors only");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "stream_linear: weight must be a contiguous [N, K] matrix");
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16,
              "stream_linear: weight must be float32 or bfloat16, got ", weight.scalar_type());
  const int64_t K = weight.size(1), N = weight.size(0);
  TORCH_CHECK(x.size(-1) == K, "stream_linear: x has ", x.size(-1), " features, weight ", K);
  at::Tensor rows = x.reshape({-1, K}).to(at::kFloat).contiguous();
  const int64_t M = rows.size(0);
  at::Tensor y = at::empty({M, N}, rows.options());
  if (weight.scalar_type() == at::kFloat)
    gemm(rows.data_ptr<float>(), M, K, weight.data_ptr<float>(), N, y.data_ptr<float>());
  else
    gemm(rows.data_ptr<float>(), M, K, weight.data_ptr<at::BFloat16>(), N, y.data_ptr<float>());
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(N);
  return y.view(shape).to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY(specpilot_cpu, m) { m.def("stream_linear(Tensor x, Tensor weight) -> Tensor"); }
TORCH_LIBRARY_IMPL(specpilot_cpu, CPU, m) { m.impl("stream_linear", &stream_linear); }
