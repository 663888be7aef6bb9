// Weight-streaming small-M GEMM for CPUs with AVX2 + FMA (and AVX-512 where the CPU has it; bf16 on
// AMX tiles where the CPU has AMX-BF16, see `amx::`), over weights packed once into k-major panels:
// y[m, n] = sum_k x[m, k] * w[n, k]. See __init__.py for the contract.
//
// Layout (`pack`): W [N, K] becomes P = ceil(N / 16) panels [P, K, 16]: for each k the weights of
// the panel's 16 output columns side by side (zero past N). A thread streams its panels front to
// back, one sequential stream. For bf16 the 16 weights of a k are stored as columns (0-3, 8-11,
// 4-7, 12-15), so one 32-byte load and `unpacklo/hi(0, w)` give columns 0-7 and 8-15 as exact fp32
// (a bf16 is the top half of an fp32).
//
// Arithmetic: one fp32 lane per output. Over each chunk of kChunk k values an output is the FMA
// chain acc = fma(x[m, k], w[n, k], acc) from 0, k ascending; the chunk sums are added in chunk
// order. Nothing of that depends on M, on the other rows of the call or on how rows are grouped,
// so a row's result is bit-identical whatever the other rows are (batch invariance).
//
// Schedule: the rows of x in near-equal groups of at most kGroupRows (6 rows x 2 vectors = 12
// independent FMA chains: enough to hide FMA latency, 15 of 16 vector registers). For each chunk of
// a panel the first group streams it from memory (prefetching kPrefetchBytes ahead) and the other
// groups find it in L1. Each group's inner loop is one 32-byte weight load, two unpacks, and per
// row one broadcast and two FMAs.
//
// AVX-512 (`wide::`, used for calls of kWideMinRows rows or more where the CPU has AVX-512F): the
// same schedule with one 16-lane vector a row, groups of up to kWideGroupRows rows. It performs
// exactly the FMAs and adds of the AVX2 code in the same order, so both give the same bits (a bf16
// panel's lanes come out in the stored column order and are put back in column order with one
// permute a chunk). Fewer rows stay on AVX2: two FMA chains a row hide latency there, and one row
// is bandwidth-bound either way.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kCols = 16;              // output columns a panel (two vectors of eight)
constexpr int64_t kChunk = 128;            // k values a chunk: 4 KB of a bf16 panel, 8 KB of an fp32 one
constexpr int64_t kGroupRows = 6;          // x rows a group
constexpr int64_t kPrefetchBytes = 2048;   // how far ahead of the first group's reads to prefetch
constexpr int64_t kStackRows = 64;         // rows whose accumulators live on the stack
constexpr int64_t kWideGroupRows = 12;     // x rows a group on AVX-512 (12 of 32 vector registers)
constexpr int64_t kWideMinRows = 4;        // calls with fewer rows stay on AVX2
constexpr int kBf16Order[kCols] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};

inline void load_cols(const float* p, __m256& w0, __m256& w1) {
  w0 = _mm256_loadu_ps(p);
  w1 = _mm256_loadu_ps(p + 8);
}
inline void load_cols(const at::BFloat16* p, __m256& w0, __m256& w1) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i zero = _mm256_setzero_si256();
  w0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, raw));
  w1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, raw));
}

// MB rows of x (row stride K) against one panel's chunk k0 <= k < k1; the chunk's sums are added to
// acc [MB][16]. kPrefetch: also prefetch from `prefetch` (kPrefetchBytes past the chunk's first byte)
// up to `prefetch_end`. The loops over m are unrolled so the accumulators stay in registers (without
// the pragmas GCC kept them in a stack array, a store per FMA pair: 1.3-1.7x slower); the k loop is
// unrolled twice and the prefetch is a template argument (-10-15% at 115 rows, 2026-12-02).
template <typename W, int MB, bool kPrefetch>
inline void group_pass(const float* x, int64_t K, const W* panel, int64_t k0, int64_t k1, float* acc,
                       const char* prefetch, const char* prefetch_end) {
  __m256 a[MB][2];
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m) a[m][0] = a[m][1] = _mm256_setzero_ps();
  constexpr int64_t kBytes = kCols * sizeof(W);  // one k of a panel
  const W* w = panel + k0 * kCols;
#pragma GCC unroll 2
  for (int64_t k = k0; k < k1; ++k, w += kCols) {
    if (kPrefetch) {  // a line (64 bytes) a k for fp32, every other k for bf16
      const char* p = prefetch + (k - k0) * kBytes;
      if (p < prefetch_end && (kBytes >= 64 || (k & 1) == 0)) _mm_prefetch(p, _MM_HINT_T0);
    }
    __m256 w0, w1;
    load_cols(w, w0, w1);
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      const __m256 xv = _mm256_broadcast_ss(x + m * K + k);
      a[m][0] = _mm256_fmadd_ps(xv, w0, a[m][0]);
      a[m][1] = _mm256_fmadd_ps(xv, w1, a[m][1]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m) {
    _mm256_storeu_ps(acc + m * kCols, _mm256_add_ps(_mm256_loadu_ps(acc + m * kCols), a[m][0]));
    _mm256_storeu_ps(acc + m * kCols + 8, _mm256_add_ps(_mm256_loadu_ps(acc + m * kCols + 8), a[m][1]));
  }
}

template <typename W, int MB>
inline void group(const float* x, int64_t K, const W* panel, int64_t k0, int64_t k1, float* acc,
                  const char* prefetch, const char* prefetch_end) {
  if (prefetch)
    group_pass<W, MB, true>(x, K, panel, k0, k1, acc, prefetch, prefetch_end);
  else
    group_pass<W, MB, false>(x, K, panel, k0, k1, acc, nullptr, nullptr);
}

template <typename W>
inline void group_any(int64_t mb, const float* x, int64_t K, const W* panel, int64_t k0, int64_t k1,
                      float* acc, const char* prefetch, const char* prefetch_end) {
  switch (mb) {
    case 1: group<W, 1>(x, K, panel, k0, k1, acc, prefetch, prefetch_end); break;
    case 2: group<W, 2>(x, K, panel, k0, k1, acc, prefetch, prefetch_end); break;
    case 3: group<W, 3>(x, K, panel, k0, k1, acc, prefetch, prefetch_end); break;
    case 4: group<W, 4>(x, K, panel, k0, k1, acc, prefetch, prefetch_end); break;
    case 5: group<W, 5>(x, K, panel, k0, k1, acc, prefetch, prefetch_end); break;
    default: group<W, 6>(x, K, panel, k0, k1, acc, prefetch, prefetch_end); break;
  }
}

// ---- AVX-512: the same arithmetic, 16 lanes a vector -------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx512f")
namespace wide {

inline __m512 load_cols(const float* p) { return _mm512_loadu_ps(p); }
// lanes in stored order: lane i holds column kBf16Order[i]
inline __m512 load_cols(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 in_column_order(__m512 v, const float*) { return v; }
inline __m512 in_column_order(__m512 v, const at::BFloat16*) {
  // kBf16Order swaps columns 4-7 and 8-11, so it is its own inverse
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15), v);
}

template <typename W, int MB, bool kPrefetch>
inline void group_pass(const float* x, int64_t K, const W* panel, int64_t k0, int64_t k1, float* acc,
                       const char* prefetch, const char* prefetch_end) {
  __m512 a[MB];
#pragma GCC unroll 16
  for (int m = 0; m < MB; ++m) a[m] = _mm512_setzero_ps();
  constexpr int64_t kBytes = kCols * sizeof(W);
  const W* w = panel + k0 * kCols;
#pragma GCC unroll 2
  for (int64_t k = k0; k < k1; ++k, w += kCols) {
    if (kPrefetch) {
      const char* p = prefetch + (k - k0) * kBytes;
      if (p < prefetch_end && (kBytes >= 64 || (k & 1) == 0)) _mm_prefetch(p, _MM_HINT_T0);
    }
    const __m512 wv = load_cols(w);
#pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) a[m] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * K + k]), wv, a[m]);
  }
#pragma GCC unroll 16
  for (int m = 0; m < MB; ++m)
    _mm512_storeu_ps(acc + m * kCols, _mm512_add_ps(_mm512_loadu_ps(acc + m * kCols), in_column_order(a[m], w)));
}

template <typename W, int MB>
inline void group(const float* x, int64_t K, const W* panel, int64_t k0, int64_t k1, float* acc,
                  const char* prefetch, const char* prefetch_end) {
  if (prefetch)
    group_pass<W, MB, true>(x, K, panel, k0, k1, acc, prefetch, prefetch_end);
  else
    group_pass<W, MB, false>(x, K, panel, k0, k1, acc, nullptr, nullptr);
}

template <typename W>
__attribute__((noinline)) void group_any(int64_t mb, const float* x, int64_t K, const W* panel, int64_t k0,
                                         int64_t k1, float* acc, const char* prefetch, const char* prefetch_end) {
  switch (mb) {
    case 4: group<W, 4>(x, K, panel, k0, k1, acc, prefetch, prefetch_end); break;
    case 5: group<W, 5>(x, K, panel, k0, k1, acc, prefetch, prefetch_end); break;
    case 6: group<W, 6>(x, K, panel, k0, k1, acc, prefetch, prefetch_end); break;
    case 7: group<W, 7>(x, K, panel, k0, k1, acc, prefetch, prefetch_end); break;
    case 8: group<W, 8>(x, K, panel, k0, k1, acc, prefetch, prefetch_end); break;
    case 9: group<W, 9>(x, K, panel, k0, k1, acc, prefetch, prefetch_end); break;
    case 10: group<W, 10>(x, K, panel, k0, k1, acc, prefetch, prefetch_end); break;
    case 11: group<W, 11>(x, K, panel, k0, k1, acc, prefetch, prefetch_end); break;
    default: group<W, 12>(x, K, panel, k0, k1, acc, prefetch, prefetch_end); break;
  }
}

}  // namespace wide
#pragma GCC pop_options

bool cpu_has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f");
  return has;
}
bool use_avx512 = cpu_has_avx512();  // set_avx512 turns it off (and on again) for tests and benchmarks

// fp32 -> bf16 rounding to nearest even (NaN -> 0x7FC0), as c10::BFloat16's constructor does.
inline __m128i to_bf16(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0b1000));
}

inline void store_row(const float* acc, int64_t cols, float* y) { std::memcpy(y, acc, cols * sizeof(float)); }
inline void store_row(const float* acc, int64_t cols, at::BFloat16* y) {
  if (cols == kCols) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y), to_bf16(_mm256_loadu_ps(acc)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y + 8), to_bf16(_mm256_loadu_ps(acc + 8)));
  } else {
    for (int64_t i = 0; i < cols; ++i) y[i] = at::BFloat16(acc[i]);
  }
}

// ---- AMX-BF16: bf16 x against bf16 weights on tiles ----------------------------------------------
// Layout (`pack_amx`, K a multiple of 32): the same [P, K, 16] shape, each panel as K / 2 rows of
// 16 column pairs (VNNI): element (p, j, n, e) = W[16 p + n, 2 j + e], so 32 k of a panel are one
// 1 KB B tile (16 rows of 64 bytes). Arithmetic: each output accumulates TDPBF16PS's pair products
// over k in chunks of 32 from 0, k ascending, in an fp32 tile; the instruction treats every row of
// the A tile alike, so a row's result does not depend on the other rows of the call or on how rows
// are grouped (batch invariance, as on the FMA path, but other bits than it). See `gemm` for the
// schedule.
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f")
namespace amx {

constexpr int64_t kRows = 16;     // rows of an A / C tile
constexpr int64_t kDepth = 32;    // k values an A tile row / a B tile

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

const TileConfig& config() {
  static const TileConfig cfg = [] {
    TileConfig c;
    for (int t = 0; t < 8; ++t) {
      c.colsb[t] = 64;  // C: 16 fp32; A: 32 bf16; B: 16 column pairs
      c.rows[t] = 16;
    }
    return c;
  }();
  return cfg;
}

// Linux hands out AMX state only to a process that asks (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA).
bool ready() {
  static const bool ok = [] {
    if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16")) return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// Results of a pass leave through a C tile: its first `rows` rows, `cols` (<= 16) columns to y.
inline void store_tile(const float* c, int64_t rows, int64_t cols, at::BFloat16* y, int64_t N) {
  for (int64_t m = 0; m < rows; ++m) store_row(c + m * kCols, cols, y + m * N);
}

// One pass of up to 16 rows: NP panels (starting at `panel`, K * 16 elements apart) against the rows
// at `a` (row stride lda elements; 16 readable); C tiles 0..NP-1, A tile 4, B tiles 5-7 (5 again for
// the fourth panel). rows < `rows` of the results go to y (row stride N), `cols` columns from p.
template <int NP>
void pass16(const at::BFloat16* a, int64_t lda, const at::BFloat16* panel, int64_t K, int64_t rows, int64_t cols,
            at::BFloat16* y, int64_t N) {
  const int64_t panel_stride = K * kCols;
  _tile_zero(0);
  if (NP > 1) _tile_zero(1);
  if (NP > 2) _tile_zero(2);
  if (NP > 3) _tile_zero(3);
  for (int64_t k = 0; k < K; k += kDepth) {
    const at::BFloat16* b = panel + k * kCols;  // 32 k of a panel: 512 elements
    _tile_loadd(4, a + k, lda * 2);
    _tile_loadd(5, b, 64);
    _tile_dpbf16ps(0, 4, 5);
    if (NP > 1) { _tile_loadd(6, b + panel_stride, 64); _tile_dpbf16ps(1, 4, 6); }
    if (NP > 2) { _tile_loadd(7, b + 2 * panel_stride, 64); _tile_dpbf16ps(2, 4, 7); }
    if (NP > 3) { _tile_loadd(5, b + 3 * panel_stride, 64); _tile_dpbf16ps(3, 4, 5); }
  }
  alignas(64) float c[4][kRows * kCols];
  _tile_stored(0, c[0], 64);
  if (NP > 1) _tile_stored(1, c[1], 64);
  if (NP > 2) _tile_stored(2, c[2], 64);
  if (NP > 3) _tile_stored(3, c[3], 64);
  for (int i = 0; i < NP; ++i) store_tile(c[i], rows, std::min(kCols, cols - i * kCols), y + i * kCols, N);
}

// One pass of up to 32 rows (two A tiles, 4 and 5) against NP <= 2 panels (B tiles 6, 7): C tile
// 2 r + i holds row half r of panel i. Every row still meets the same instructions over the same k.
template <int NP>
void pass32(const at::BFloat16* a, int64_t lda, const at::BFloat16* panel, int64_t K, int64_t rows, int64_t cols,
            at::BFloat16* y, int64_t N) {
  const int64_t panel_stride = K * kCols;
  _tile_zero(0);
  _tile_zero(2);
  if (NP > 1) { _tile_zero(1); _tile_zero(3); }
  for (int64_t k = 0; k < K; k += kDepth) {
    const at::BFloat16* b = panel + k * kCols;
    _tile_loadd(4, a + k, lda * 2);
    _tile_loadd(5, a + kRows * lda + k, lda * 2);
    _tile_loadd(6, b, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 5, 6);
    if (NP > 1) {
      _tile_loadd(7, b + panel_stride, 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float c[4][kRows * kCols];
  _tile_stored(0, c[0], 64);
  _tile_stored(2, c[2], 64);
  if (NP > 1) { _tile_stored(1, c[1], 64); _tile_stored(3, c[3], 64); }
  const int64_t top = std::min(rows, kRows), bottom = rows - top;
  for (int i = 0; i < NP; ++i) {
    const int64_t n = std::min(kCols, cols - i * kCols);
    store_tile(c[i], top, n, y + i * kCols, N);
    store_tile(c[2 + i], bottom, n, y + kRows * N + i * kCols, N);
  }
}

// Calls of up to 16 rows: one group, passes of four panels. More rows: groups of 32, two panels a
// pass (each weight tile is loaded once for 32 rows). A partial last group reads a zero-padded copy.
void gemm(const at::BFloat16* x, int64_t M, int64_t K, const at::BFloat16* packed, int64_t N, at::BFloat16* y) {
  const bool tall = M > kRows;
  const int64_t group_rows = tall ? 2 * kRows : kRows, pass_panels = tall ? 2 : 4;
  const int64_t panels = (N + kCols - 1) / kCols;
  const int64_t passes = (panels + pass_panels - 1) / pass_panels;
  const int64_t full_groups = M / group_rows, tail = M % group_rows;
  std::vector<at::BFloat16> padded(tail ? group_rows * K : 0, at::BFloat16(0.0f));
  if (tail) std::memcpy(padded.data(), x + full_groups * group_rows * K, tail * K * sizeof(at::BFloat16));
  at::parallel_for(0, passes, 1, [&](int64_t q0, int64_t q1) {
    _tile_loadconfig(&config());
    for (int64_t q = q0; q < q1; ++q) {
      const int64_t p = q * pass_panels, np = std::min(pass_panels, panels - p), cols = N - p * kCols;
      const at::BFloat16* panel = packed + p * K * kCols;
      for (int64_t g = 0; g < full_groups + (tail ? 1 : 0); ++g) {
        const bool last = g == full_groups;
        const at::BFloat16* a = last ? padded.data() : x + g * group_rows * K;
        const int64_t rows = last ? tail : group_rows;
        at::BFloat16* out = y + g * group_rows * N + p * kCols;
        if (tall) {
          if (np == 1) pass32<1>(a, K, panel, K, rows, cols, out, N);
          else pass32<2>(a, K, panel, K, rows, cols, out, N);
        } else {
          switch (np) {
            case 1: pass16<1>(a, K, panel, K, rows, cols, out, N); break;
            case 2: pass16<2>(a, K, panel, K, rows, cols, out, N); break;
            case 3: pass16<3>(a, K, panel, K, rows, cols, out, N); break;
            default: pass16<4>(a, K, panel, K, rows, cols, out, N); break;
          }
        }
      }
    }
    _tile_release();
  });
}

}  // namespace amx
#pragma GCC pop_options

template <typename W, typename Y>
void gemm(const float* x, int64_t M, int64_t K, const W* packed, int64_t N, Y* y) {
  const int64_t panels = (N + kCols - 1) / kCols;
  const bool wide_rows = use_avx512 && M >= kWideMinRows;  // groups of >= 4 rows: wide::group_any's cases
  const int64_t group_rows = wide_rows ? kWideGroupRows : kGroupRows;
  const int64_t groups = (M + group_rows - 1) / group_rows;
  at::parallel_for(0, panels, 4, [&](int64_t p0, int64_t p1) {
    float on_stack[kStackRows * kCols];
    std::vector<float> on_heap(M > kStackRows ? M * kCols : 0);
    float* acc = M > kStackRows ? on_heap.data() : on_stack;
    // Prefetches stay inside this task's panels (the next task's belong to another thread).
    const char* end = reinterpret_cast<const char*>(packed + p1 * K * kCols);
    for (int64_t p = p0; p < p1; ++p) {
      const W* panel = packed + p * K * kCols;
      std::fill(acc, acc + M * kCols, 0.0f);
      for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
        const int64_t k1 = std::min(K, k0 + kChunk);
        const char* ahead = reinterpret_cast<const char*>(panel + k0 * kCols) + kPrefetchBytes;
        for (int64_t g = 0, m = 0; g < groups; ++g) {
          const int64_t mb = (M - m) / (groups - g);  // near-equal groups of at most group_rows
          const char* pf = g == 0 ? ahead : nullptr;
          if (wide_rows)
            wide::group_any(mb, x + m * K, K, panel, k0, k1, acc + m * kCols, pf, end);
          else
            group_any(mb, x + m * K, K, panel, k0, k1, acc + m * kCols, pf, end);
          m += mb;
        }
      }
      const int64_t cols = std::min(kCols, N - p * kCols);
      for (int64_t m = 0; m < M; ++m) store_row(acc + m * kCols, cols, y + m * N + p * kCols);
    }
  });
}

template <typename W>
void pack_into(const W* w, int64_t N, int64_t K, W* out, const int* order) {
  const int64_t panels = (N + kCols - 1) / kCols;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t k = 0; k < K; ++k)
        for (int64_t i = 0; i < kCols; ++i) {
          const int64_t n = p * kCols + (order ? order[i] : i);
          out[(p * K + k) * kCols + i] = n < N ? w[n * K + k] : W(0);
        }
  });
}

at::Tensor pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu(), "stream_gemm.pack: the weight must be a CPU tensor");
  TORCH_CHECK(weight.dim() == 2, "stream_gemm.pack: the weight must be an [N, K] matrix, got ", weight.dim(), " dims");
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16,
              "stream_gemm.pack: the weight must be float32 or bfloat16, got ", weight.scalar_type());
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  at::Tensor out = at::empty({(N + kCols - 1) / kCols, K, kCols}, w.options());
  if (w.scalar_type() == at::kFloat)
    pack_into(w.data_ptr<float>(), N, K, out.data_ptr<float>(), nullptr);
  else
    pack_into(w.data_ptr<at::BFloat16>(), N, K, out.data_ptr<at::BFloat16>(), kBf16Order);
  return out;
}

// x rows as fp32 for the broadcasts: fp32 x as it is, bf16 widened exactly into `buffer`.
const float* rows_fp32(const at::Tensor& rows, std::vector<float>& buffer) {
  if (rows.scalar_type() == at::kFloat) return rows.data_ptr<float>();
  const int64_t n = rows.numel();
  buffer.resize(n);
  const uint16_t* src = reinterpret_cast<const uint16_t*>(rows.data_ptr<at::BFloat16>());
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(buffer.data() + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
  }
  for (; i < n; ++i) {
    const uint32_t bits = uint32_t(src[i]) << 16;
    std::memcpy(buffer.data() + i, &bits, sizeof(float));
  }
  return buffer.data();
}

template <typename W>
void run(const float* x, int64_t M, int64_t K, const at::Tensor& packed, int64_t N, at::Tensor& y) {
  if (y.scalar_type() == at::kFloat)
    gemm(x, M, K, packed.data_ptr<W>(), N, y.data_ptr<float>());
  else
    gemm(x, M, K, packed.data_ptr<W>(), N, y.data_ptr<at::BFloat16>());
}

// Both paths' last checks and set-up: N must fit the packed panels and x's last dim the weight's K;
// returns x as contiguous [M, K] rows and an empty result of x's leading shape by N, in x's dtype.
std::pair<at::Tensor, at::Tensor> rows_and_result(const char* op, const at::Tensor& x, const at::Tensor& packed,
                                                  int64_t N) {
  const int64_t K = packed.size(1);
  TORCH_CHECK(N > (packed.size(0) - 1) * kCols && N <= packed.size(0) * kCols, op, ": ", N,
              " output features do not fit a packed weight of ", packed.size(0), " panels of ", kCols);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, op, ": x has ", x.size(-1), " features, the weight ", K);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(N);
  return {x.reshape({-1, K}).contiguous(), at::empty(shape, x.options())};
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "stream_gemm.linear: CPU tensors only");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kCols && packed.is_contiguous(),
              "stream_gemm.linear: the weight must be packed by stream_gemm.pack");
  TORCH_CHECK(packed.scalar_type() == at::kFloat || packed.scalar_type() == at::kBFloat16,
              "stream_gemm.linear: the packed weight must be float32 or bfloat16, got ", packed.scalar_type());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "stream_gemm.linear: x must be float32 or bfloat16, got ", x.scalar_type());
  const int64_t K = packed.size(1), N = out_features;
  auto [rows, y] = rows_and_result("stream_gemm.linear", x, packed, N);
  const int64_t M = rows.size(0);
  if (M == 0 || K == 0) return y.zero_();
  thread_local std::vector<float> widened;
  const float* xf = rows_fp32(rows, widened);
  if (packed.scalar_type() == at::kFloat)
    run<float>(xf, M, K, packed, N, y);
  else
    run<at::BFloat16>(xf, M, K, packed, N, y);
  return y;
}

at::Tensor pack_amx(const at::Tensor& weight) {
  TORCH_CHECK(amx::ready(), "stream_gemm.pack_amx: this CPU or process cannot use AMX-BF16 (see amx_ready)");
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
              "stream_gemm.pack_amx: the weight must be a bfloat16 [N, K] CPU matrix");
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(K % amx::kDepth == 0, "stream_gemm.pack_amx: K = ", K, " is not a multiple of ", amx::kDepth);
  const int64_t panels = (N + kCols - 1) / kCols;
  at::Tensor out = at::empty({panels, K, kCols}, w.options());
  const at::BFloat16* src = w.data_ptr<at::BFloat16>();
  at::BFloat16* dst = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < K / 2; ++j)
        for (int64_t i = 0; i < kCols; ++i)
          for (int64_t e = 0; e < 2; ++e) {
            const int64_t n = p * kCols + i;
            dst[((p * K / 2 + j) * kCols + i) * 2 + e] = n < N ? src[n * K + 2 * j + e] : at::BFloat16(0.0f);
          }
  });
  return out;
}

at::Tensor linear_amx(const at::Tensor& x, const at::Tensor& packed, int64_t out_features) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "stream_gemm.linear_amx: CPU tensors only");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kCols && packed.is_contiguous() &&
                  packed.scalar_type() == at::kBFloat16 && packed.size(1) % amx::kDepth == 0,
              "stream_gemm.linear_amx: the weight must be packed by stream_gemm.pack_amx");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "stream_gemm.linear_amx: x must be bfloat16, got ", x.scalar_type());
  TORCH_CHECK(amx::ready(), "stream_gemm.linear_amx: this CPU or process cannot use AMX-BF16");
  const int64_t K = packed.size(1), N = out_features;
  auto [rows, y] = rows_and_result("stream_gemm.linear_amx", x, packed, N);
  if (rows.size(0) == 0) return y;
  amx::gemm(rows.data_ptr<at::BFloat16>(), rows.size(0), K, packed.data_ptr<at::BFloat16>(), N,
            y.data_ptr<at::BFloat16>());
  return y;
}

bool amx_ready() { return amx::ready(); }

// mode 1 / 0: use AVX-512 for calls of kWideMinRows rows or more where the CPU has it / never;
// -1: leave as is. Returns whether it is used now. Both give the same bits (tests check that).
bool set_avx512(int64_t mode) {
  TORCH_CHECK(mode >= -1 && mode <= 1, "stream_gemm.set_avx512: mode is -1 (query), 0 (off) or 1 (on), got ", mode);
  if (mode >= 0) use_avx512 = mode == 1 && cpu_has_avx512();
  return use_avx512;
}

}  // namespace

TORCH_LIBRARY(specpilot_cpu, m) {
  m.def("pack(Tensor weight) -> Tensor");
  m.def("linear(Tensor x, Tensor packed, int out_features) -> Tensor");
  m.def("set_avx512(int mode) -> bool", &set_avx512);  // no tensors: one kernel for every dispatch key
  m.def("amx_ready() -> bool", &amx_ready);
  m.def("pack_amx(Tensor weight) -> Tensor");
  m.def("linear_amx(Tensor x, Tensor packed, int out_features) -> Tensor");
}
TORCH_LIBRARY_IMPL(specpilot_cpu, CPU, m) {
  m.impl("pack", &pack);
  m.impl("linear", &linear);
  m.impl("pack_amx", &pack_amx);
  m.impl("linear_amx", &linear_amx);
}
