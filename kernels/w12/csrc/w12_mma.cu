// W12 x bf16 on tensor cores: y[M, N] = x[M, K] @ W[N, K]^T for M <= 32, W in the W12 planes
// (format: ../format.py; the PyTorch reference is format.decode followed by a matmul).
//
// Layout of the work. mma.sync m16n8k16 with the *weights* as the A operand (16 rows of W by 16
// columns) and x^T as B (16 columns by 8 rows of x; one more B for each further 8 rows, up to 4). A
// thread (group g = lane / 4, tig = lane % 4) holds the k-slots {2tig, 2tig+1, 2tig+8, 2tig+9}
// in both A (W rows g and g+8) and B (x row g), so which *memory* column a k-slot stands for
// may be chosen per thread, as long as A and B agree: the sum over k does not care. Each thread
// therefore reads 16 contiguous nib bytes, the 16 low bytes of the same columns j and the 16 of
// kh + j (one 16-byte load each) for each of its two rows, decodes them in place (two SWAR ops
// per four high bytes, one prmt per two bf16) and reads x's matching columns: no shuffles.
// A chunk is 64 nib columns (4 threads x 16), i.e. 128 weights of a row, 8 mma k-steps. A step loads
// `chunks` of them, then multiplies; the launch is pipelined: it issues the next step's loads (volatile, so
// ptxas keeps them ahead) before this step's math, holding two steps' fragments in registers. A warp takes
// one 16-row weight tile.
//
// Scale. The planes hold window-relative patterns (value w * 2^-e0), so x is scaled by 2^64 (exact
// in bf16) and each output row by 2^(e0 - 64) at the end: the result is the fp32 sum of the exact
// products, as in the Triton kernel (valid for 2^-64 <= |x| < 2^64).
//
// Grid: x = blocks of warps x 16 weight rows, y = K splits. With splits > 1 every block
// stores its fp32 partial; the last block of a row tile to arrive (arrival counter) sums the
// partials in split order, so the result never depends on arrival order, finishes the tile and
// resets its counter to 0 (graph-capture safe). Escapes (stored as +0 in the planes) are added
// after the row scale, in index order, as x[m, k] * w.
//
// The launch kinds no dispatch reached left this file on 2026-12-07 (non-pipelined steps, two 16-row tiles a
// warp, the TMA launch and its persistent grid): docs/results/w12-kernel/
// removed-2026-12-07-tma-persistent-rows2-unpipelined.patch re-adds them. The device helpers below keep their
// R (16-row tiles a warp) parameter; the kernel instantiates R = 1.
#include "w12_mma.h"

#include <cuda_bf16.h>

namespace specpilot_w12 {
namespace {

template <bool ORDERED>
__device__ __forceinline__ uint4 load_stream(const uint8_t* p) {
  // Weights are read once: keep them out of L1 so x's lines stay there. ORDERED (volatile): ptxas keeps
  // the load before every later volatile asm (the MMAs), so a step's loads are all in flight before its
  // math instead of interleaved with it (the pipelined loop issues the next step's loads first).
  uint4 v;
  if (ORDERED) {
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
  } else {
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
  }
  return v;
}

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// Four high bytes (sign << 7 | o >> 1) from the low (half 0) or high (half 1) nibbles of four nib bytes.
__device__ __forceinline__ uint32_t high_bytes(uint32_t q, int half) {
  return half == 0 ? ((q & 0x07070707u) | ((q << 4) & 0x80808080u))
                   : (((q >> 4) & 0x07070707u) | (q & 0x80808080u));
}

__device__ __forceinline__ uint32_t scale_pair(uint32_t v) {  // two bf16 times 2^64, exact
  __nv_bfloat162 h = *reinterpret_cast<__nv_bfloat162*>(&v);
  const __nv_bfloat162 s = __floats2bfloat162_rn(18446744073709551616.0f, 18446744073709551616.0f);
  h = __hmul2(h, s);
  return *reinterpret_cast<uint32_t*>(&h);
}

__device__ __forceinline__ uint4 scale_x(uint4 v) {
  return make_uint4(scale_pair(v.x), scale_pair(v.y), scale_pair(v.z), scale_pair(v.w));
}

// U chunks of 64 nib columns, loaded together (`load`), then decoded and multiplied (`compute`). MASKED
// (the tail of a split): a thread whose 16 columns start at or past j_end loads zeros.
template <int R, int G, int U>
struct Chunks {
  uint4 wn[U][R][2], wl0[U][R][2], wl1[U][R][2], xa[U][G][2], xb[U][G][2];

  template <bool MASKED, bool ORDERED>
  __device__ __forceinline__ void load(const MmaArgs& a, const uint8_t* const (&nib_row)[R][2],
                                       const uint8_t* const (&low_row)[R][2], const uint8_t* const (&x_row)[G],
                                       const bool (&x_live)[G], int j0, int j_end, int tig) {
    const uint4 zero = make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = j0 + 64 * u;
      const bool live = !MASKED || j + tig * 16 < j_end;
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          wn[u][r][h] = live ? load_stream<ORDERED>(nib_row[r][h] + j) : zero;
          wl0[u][r][h] = live ? load_stream<ORDERED>(low_row[r][h] + j) : zero;
          wl1[u][r][h] = live ? load_stream<ORDERED>(low_row[r][h] + a.kh + j) : zero;
        }
#pragma unroll
      for (int gg = 0; gg < G; ++gg) {
        const bool on = live && x_live[gg];
        const uint4* p = reinterpret_cast<const uint4*>(x_row[gg] + int64_t(j) * 2);
        const uint4* q = reinterpret_cast<const uint4*>(x_row[gg] + int64_t(a.kh + j) * 2);
        const int col = a.kh + j + tig * 16;  // columns past K (when K < 2 kh) hold zero weights: keep x out
        xa[u][gg][0] = on ? __ldg(p) : zero;
        xa[u][gg][1] = on ? __ldg(p + 1) : zero;
        xb[u][gg][0] = on && col < a.K ? __ldg(q) : zero;
        xb[u][gg][1] = on && col + 8 < a.K ? __ldg(q + 1) : zero;
      }
    }
  }

  __device__ __forceinline__ void compute(float (&acc)[R][G][4]) const {
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        uint4 xs[G][2];
#pragma unroll
        for (int gg = 0; gg < G; ++gg) {
          xs[gg][0] = scale_x(half == 0 ? xa[u][gg][0] : xb[u][gg][0]);
          xs[gg][1] = scale_x(half == 0 ? xa[u][gg][1] : xb[u][gg][1]);
        }
#pragma unroll
        for (int q = 0; q < 4; ++q) {  // nib word q: columns 4q .. 4q+3 of the thread's 16
#pragma unroll
          for (int r = 0; r < R; ++r) {
            uint32_t lo_pair[2], hi_pair[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const uint32_t hb = high_bytes(word(wn[u][r][h], q), half);
              const uint32_t lb = word(half == 0 ? wl0[u][r][h] : wl1[u][r][h], q);
              lo_pair[h] = prmt(lb, hb, 0x5140);  // columns 4q, 4q+1: hi<<8 | lo
              hi_pair[h] = prmt(lb, hb, 0x7362);  // columns 4q+2, 4q+3
            }
#pragma unroll
            for (int gg = 0; gg < G; ++gg) {
              // x's bf16 pairs for the same columns: words 2q, 2q+1 of the thread's 16 columns
              const uint32_t b0 = word(xs[gg][q >> 1], (2 * q) & 3);
              const uint32_t b1 = word(xs[gg][q >> 1], (2 * q + 1) & 3);
              mma_bf16(acc[r][gg], lo_pair[0], lo_pair[1], hi_pair[0], hi_pair[1], b0, b1);
            }
          }
        }
      }
    }
  }
};

template <int R, int G>
__device__ __forceinline__ void zero(float (&acc)[R][G][4]) {
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int gg = 0; gg < G; ++gg)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[r][gg][i] = 0.0f;
}

constexpr int kMaxRows = 32;  // rows of x: four 8-row groups

// f(value, m, n) for each output of the warp's D fragments inside [M, N]: acc[r][gg] holds
// {(n, m), (n, m+1), (n+8, m), (n+8, m+1)} with n = the tile's row g and m = 8gg + 2tig.
template <int R, int G, typename T, typename F>  // T: float, or const float
__device__ __forceinline__ void for_each_output(T (&acc)[R][G][4], const MmaArgs& a, int n_warp, int g, int tig,
                                                F&& f) {
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int gg = 0; gg < G; ++gg)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int n = n_warp + r * 16 + g + 8 * (i >> 1), m = gg * 8 + 2 * tig + (i & 1);
        if (n < a.N && m < a.M) f(acc[r][gg][i], m, n);
      }
}

// Escape e of the tile whose first row is n_tile: its flat index minus n_tile * K (below 16 K) and its value.
__device__ __forceinline__ void read_escape(const MmaArgs& a, int e, int n_tile, int& off, float& w) {
  const int64_t idx = a.idx64 ? static_cast<const int64_t*>(a.esc_idx)[e] : static_cast<const int32_t*>(a.esc_idx)[e];
  off = int(idx - int64_t(n_tile) * a.K);
  w = __bfloat162float(__ushort_as_bfloat16(static_cast<unsigned short>(a.esc_val[e])));
}

// What a warp's epilogue reads besides its sums, loaded before the warp's main loop: each of its rows' base exponent
// (as the row scale), each tile's escape range and, lane l, the tile's escape begin + l (flat index minus the tile's
// first flat index, below 16 K, and its value). These sit in lines no other load touches (e0, esc_ptr, esc_idx,
// esc_val: cold in DRAM when the weights are), and each read depends on the one before (range, then index, then x
// at that column), so read in the epilogue they were a chain of DRAM round trips at the end of every block, after
// its last weight byte had arrived: on a grid of about one wave (the small shapes) the chain is the kernel's tail.
// Loaded in the main loop they arrive while the weights stream. A tile's escapes past its first 32 are read in the
// epilogue. (A hypothesis of session 40, from the sweep's small shapes: measured by the next device call.)
template <int R>
struct EpilogueInputs {
  float row_scale[R][2];  // 2^(e0 - 64) as 2^63 * 2^(e0 - 127), rows n0 and n0 + 8 of tile r
  int begin[R], end[R];   // the tile's escapes: esc_idx[begin .. end)
  int esc_off[R];         // lane l: escape begin + l's flat index minus n_tile * K (when begin + l < end)
  float esc_w[R];         // its value
  bool have_escapes;      // load_escapes has run

  // The loads that depend on nothing: issued at the warp's start, used no sooner than `load_escapes`.
  __device__ __forceinline__ void load_ranges(const MmaArgs& a, int n_warp, int g) {
    have_escapes = false;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int n_tile = n_warp + r * 16;
      begin[r] = end[r] = esc_off[r] = 0;
      esc_w[r] = 0.0f;
      row_scale[r][0] = row_scale[r][1] = 0.0f;
      if (n_tile >= a.N) continue;  // the warp's rows past N: never finished
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int n = n_tile + g + 8 * h;
        if (n < a.N) row_scale[r][h] = __int_as_float(int(a.e0[n]) << 23);
      }
      begin[r] = a.esc_ptr[n_tile >> 4];
      end[r] = a.esc_ptr[(n_tile >> 4) + 1];
    }
  }

  // The escapes' own loads, which need the ranges: called once after the warp's first step of math (by then the
  // ranges, issued with that step's loads, have arrived, so the warp does not wait on them), or before the
  // epilogue where the warp had no step.
  __device__ __forceinline__ void load_escapes(const MmaArgs& a, int n_warp, int lane) {
    if (have_escapes) return;
    have_escapes = true;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int e = begin[r] + lane;
      if (e < end[r]) read_escape(a, e, n_warp + r * 16, esc_off[r], esc_w[r]);
    }
  }
};

// The finished values of a warp's outputs from their scaled sums, in place (outputs outside [M, N] are never
// stored: what they hold does not matter): each row's scale, then the row's escapes in index order, as x[m, k] *
// w. One pass over a tile's 16-row escape group serves all the thread's outputs of that tile (session 39; each
// output had scanned the group on its own: 2 scans a thread at M = 1, 4 at 2-8, 8 at 9-16). The escapes come from
// `EpilogueInputs` (lane e - begin holds escape e, shuffled to the warp; every lane runs the same loop), and x's
// values for a batch of them are loaded together before any is added, so the batch costs one round trip to L2,
// not one an escape. Each output's sums and their order are the same as a scan with one read at a time.
template <int R, int G>
__device__ __forceinline__ void finish_tile(float (&v)[R][G][4], const MmaArgs& a, const EpilogueInputs<R>& in,
                                            int n_warp, int g, int tig) {
  const __nv_bfloat16* x = static_cast<const __nv_bfloat16*>(a.x);
  constexpr int kBatch = G <= 2 ? 4 : 2;  // escapes whose x values are in flight together (registers: kBatch x 2G)
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int n_tile = n_warp + r * 16;  // the thread's rows: n_tile + g (outputs i = 0, 1) and + 8 (i = 2, 3)
    if (n_tile >= a.N) continue;
#pragma unroll
    for (int gg = 0; gg < G; ++gg)
#pragma unroll
      for (int i = 0; i < 4; ++i) v[r][gg][i] = v[r][gg][i] * 9223372036854775808.0f * in.row_scale[r][i >> 1];
    const int lo0 = g * a.K, lo1 = lo0 + 8 * a.K;  // the rows' first flat index past n_tile * K (16 K < 2^31)
    for (int e0 = in.begin[r]; e0 < in.end[r]; e0 += kBatch) {  // warp-uniform bounds: every lane shuffles
      int off[kBatch];
      float w[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int e = e0 + b, slot = e - in.begin[r];
        off[b] = -1;  // no row
        w[b] = 0.0f;
        if (e >= in.end[r]) continue;
        if (slot < 32) {
          off[b] = __shfl_sync(0xffffffffu, in.esc_off[r], slot);
          w[b] = __shfl_sync(0xffffffffu, in.esc_w[r], slot);
        } else {
          read_escape(a, e, n_tile, off[b], w[b]);
        }
      }
      float xv[kBatch][G][2];  // x[m, k] of each escape's column for the thread's rows of x (0 where not its row)
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const bool row0 = off[b] >= lo0 && off[b] < lo0 + a.K, row1 = off[b] >= lo1 && off[b] < lo1 + a.K;
        const int k = off[b] - (row0 ? lo0 : lo1);
#pragma unroll
        for (int gg = 0; gg < G; ++gg)
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const int m = gg * 8 + 2 * tig + j;
            xv[b][gg][j] = (row0 || row1) && m < a.M ? __bfloat162float(x[int64_t(m) * a.ldx + k]) : 0.0f;
          }
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {  // in index order
        const bool row0 = off[b] >= lo0 && off[b] < lo0 + a.K, row1 = off[b] >= lo1 && off[b] < lo1 + a.K;
#pragma unroll
        for (int gg = 0; gg < G; ++gg)
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int m = gg * 8 + 2 * tig + (i & 1);
            if ((i < 2 ? row0 : row1) && m < a.M) v[r][gg][i] += xv[b][gg][i & 1] * w[b];
          }
      }
    }
  }
}

// The outputs of row tile `tile`: finished in place (one split), or stored as this split's partial and, by the
// tile's last block to arrive, summed over the splits in split order and finished. Every thread of the block calls it.
template <int R, int G>
__device__ __forceinline__ void store_tile(const float (&acc)[R][G][4], const MmaArgs& a, const EpilogueInputs<R>& in,
                                           int n_warp, int g, int tig, int tile, int split) {
  __nv_bfloat16* y = static_cast<__nv_bfloat16*>(a.y);
  float v[R][G][4];
  if (a.splits == 1) {
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int gg = 0; gg < G; ++gg)
#pragma unroll
        for (int i = 0; i < 4; ++i) v[r][gg][i] = acc[r][gg][i];
  } else {
    for_each_output(acc, a, n_warp, g, tig,
                    [&](float value, int m, int n) { a.part[(int64_t(split) * a.M + m) * a.N + n] = value; });
    __threadfence();
    __syncthreads();
    __shared__ int last;
    if (threadIdx.x == 0) last = atomicAdd(&a.counters[tile], 1) == a.splits - 1;
    __syncthreads();
    // every thread has read `last` before thread 0 can write it again: a later tile's store passes the first
    // barrier above only when all of them have arrived there
    if (!last) return;
    __threadfence();
    zero(v);
    for (int s = 0; s < a.splits; ++s)  // every split's partial, in split order; a split's reads all in flight
      for_each_output(v, a, n_warp, g, tig, [&](float& value, int m, int n) {
        value += __ldcg(a.part + (int64_t(s) * a.M + m) * a.N + n);
      });
    if (threadIdx.x == 0) a.counters[tile] = 0;
  }
  finish_tile(v, a, in, n_warp, g, tig);
  for_each_output(v, a, n_warp, g, tig,
                  [&](float value, int m, int n) { y[int64_t(m) * a.N + n] = __float2bfloat16(value); });
}

template <int G, int U>
__global__ void __launch_bounds__(256) w12_mma_kernel(const MmaArgs a) {
  constexpr int R = 1;  // 16-row weight tiles a warp
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int g = lane >> 2, tig = lane & 3;
  const int n_warp = (blockIdx.x * warps + warp) * R * 16;
  const int split = blockIdx.y;
  const int j_begin = split * a.j_per_split;
  const int j_end = min(a.kh, j_begin + a.j_per_split);

  const uint8_t* nib_row[R][2];
  const uint8_t* low_row[R][2];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int n = min(n_warp + r * 16 + h * 8 + g, a.N - 1);  // rows past N re-read the last (not stored)
      nib_row[r][h] = a.nib + int64_t(n) * a.kh + tig * 16;
      low_row[r][h] = a.low + int64_t(n) * 2 * a.kh + tig * 16;
    }
  const uint8_t* x_row[G];
  bool x_live[G];
#pragma unroll
  for (int gg = 0; gg < G; ++gg) {
    const int m = gg * 8 + g;
    x_live[gg] = m < a.M;
    x_row[gg] = static_cast<const uint8_t*>(a.x) + (int64_t(min(m, a.M - 1)) * a.ldx + tig * 16) * 2;
  }

  float acc[R][G][4];
  zero(acc);

  int j0 = j_begin;
  const int full_end = j_begin + (j_end - j_begin) / (64 * U) * (64 * U);
  EpilogueInputs<R> in;
  in.load_ranges(a, n_warp, g);
  if (j0 < full_end) {  // software pipeline: the next step's loads go out before this step's math
    Chunks<R, G, U> cur;
    cur.template load<false, true>(a, nib_row, low_row, x_row, x_live, j0, j_end, tig);
    j0 += 64 * U;
    if (j0 < full_end) {  // the first step, peeled: the escapes' loads go out after its math (the c4 launch
      // still spills 16-24 bytes: prefetched values stored before the main loop and loaded after it, none inside)
      Chunks<R, G, U> next;
      next.template load<false, true>(a, nib_row, low_row, x_row, x_live, j0, j_end, tig);
      cur.compute(acc);
      in.load_escapes(a, n_warp, lane);
      cur = next;
      j0 += 64 * U;
    }
    for (; j0 < full_end; j0 += 64 * U) {
      Chunks<R, G, U> next;
      next.template load<false, true>(a, nib_row, low_row, x_row, x_live, j0, j_end, tig);
      cur.compute(acc);
      cur = next;
    }
    cur.compute(acc);
  }
  // Never runs (the pipeline above leaves j0 >= full_end): the loop of the non-pipelined launch, which left on
  // 2026-12-07. Kept because without it ptxas compiles the launch that remains into other code (200-580
  // instructions fewer a kernel, not measured); with it the 7 kernels' SASS is the measured one, instruction for
  // instruction (nvcc 13.0, sm_90a, against the pipelined one-tile instances of before).
  for (; j0 < full_end; j0 += 64 * U) {
    Chunks<R, G, U> c;
    c.template load<false, false>(a, nib_row, low_row, x_row, x_live, j0, j_end, tig);
    c.compute(acc);
  }
  for (; j0 < j_end; j0 += 64) {
    Chunks<R, G, 1> c;
    c.template load<true, false>(a, nib_row, low_row, x_row, x_live, j0, j_end, tig);
    c.compute(acc);
  }
  in.load_escapes(a, n_warp, lane);  // a warp of at most one full step reads them here

  store_tile(acc, a, in, n_warp, g, tig, blockIdx.x, split);
}

constexpr int kMaxPipelined = 4;

template <int G, int U>
const char* launch(const MmaArgs& a, int warps, cudaStream_t stream) {
  const int rows_per_block = warps * 16;
  const dim3 grid((a.N + rows_per_block - 1) / rows_per_block, a.splits);
  // two steps' fragments in registers: beyond 4 (chunks x row groups) ptxas spills kilobytes
  if constexpr (U * G <= kMaxPipelined) {
    w12_mma_kernel<G, U><<<grid, warps * 32, 0, stream>>>(a);
  } else {
    return "chunks x row groups (2 when M > 8, 3 when M > 16, 4 when M > 24) must be <= 4";
  }
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

template <int G>
const char* launch_u(const MmaArgs& a, int chunks, int warps, cudaStream_t stream) {
  switch (chunks) {
    case 1: return launch<G, 1>(a, warps, stream);
    case 2: return launch<G, 2>(a, warps, stream);
    case 4: return launch<G, 4>(a, warps, stream);
    default: return "chunks must be 1, 2 or 4";
  }
}

}  // namespace

const char* launch_mma(const MmaArgs& a, int chunks, int warps, cudaStream_t stream) {
  if (a.M < 1 || a.M > kMaxRows) return "M must be in 1..32";
  if (warps < 1 || warps > 8) return "warps must be in 1..8";
  if (a.kh % 16 != 0 || a.j_per_split % (64 * chunks) != 0 || a.K % 8 != 0)
    return "kh must be a multiple of 16, the columns a split a multiple of 64 * chunks, K a multiple of 8";
  const int groups = (a.M + 7) / 8;  // 8-row groups of x: one mma B operand each
  switch (groups) {
    case 1: return launch_u<1>(a, chunks, warps, stream);
    case 2: return launch_u<2>(a, chunks, warps, stream);
    case 3: return launch_u<3>(a, chunks, warps, stream);
    default: return launch_u<4>(a, chunks, warps, stream);
  }
}

}  // namespace specpilot_w12
