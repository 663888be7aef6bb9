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
// `chunks` of them, then multiplies; a pipelined launch issues the next step's loads (volatile, so ptxas
// keeps them ahead) before this step's math, holding two steps' fragments in registers.
//
// Scale. The planes hold window-relative patterns (value w * 2^-e0), so x is scaled by 2^64 (exact
// in bf16) and each output row by 2^(e0 - 64) at the end: the result is the fp32 sum of the exact
// products, as in the Triton kernel (valid for 2^-64 <= |x| < 2^64).
//
// Grid (register launch): x = blocks of warps x rows x 16 weight rows, y = K splits; the TMA launch walks the same
// (row tile, split) items from a 1-D grid, one an item or persistent. With splits > 1 every block
// stores its fp32 partial; the last block of a row tile to arrive (arrival counter) sums the
// partials in split order, so the result never depends on arrival order, finishes the tile and
// resets its counter to 0 (graph-capture safe). Escapes (stored as +0 in the planes) are added
// after the row scale, in index order, as x[m, k] * w.
#include "w12_mma.h"

#include <cuda.h>  // CUtensorMap (the TMA launches)
#include <cudaTypedefs.h>
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

constexpr int kMaxRows = 32;  // rows of x: four 8-row groups (1 row tile a warp beyond 16)

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

// Block barriers for `store_tile`: the register launch syncs the whole block; the TMA launch only its consumer
// warps (named barrier 1), since its producer may already be streaming a later item of a persistent grid.
struct BlockBarrier {
  __device__ __forceinline__ void sync() const { __syncthreads(); }
};
struct ConsumerBarrier {
  int threads;  // the consumer warps' threads, a multiple of 32
  __device__ __forceinline__ void sync() const { asm volatile("bar.sync 1, %0;" ::"r"(threads) : "memory"); }
};

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
// tile's last block to arrive, summed over the splits in split order and finished. Every thread that `bar` syncs
// calls it; thread 0 is one of them.
template <int R, int G, typename Barrier>
__device__ __forceinline__ void store_tile(const float (&acc)[R][G][4], const MmaArgs& a, const EpilogueInputs<R>& in,
                                           int n_warp, int g, int tig, int tile, int split, const Barrier& bar) {
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
    bar.sync();
    __shared__ int last;
    if (threadIdx.x == 0) last = atomicAdd(&a.counters[tile], 1) == a.splits - 1;
    bar.sync();
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

template <int R, int G, int U, bool PIPE>
__global__ void __launch_bounds__(256) w12_mma_kernel(const MmaArgs a) {
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
  if (PIPE && j0 < full_end) {  // software pipeline: the next step's loads go out before this step's math
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
  in.load_escapes(a, n_warp, lane);  // unpipelined launches, and a warp of one step, read them here

  store_tile(acc, a, in, n_warp, g, tig, blockIdx.x, split, BlockBarrier{});
}

// ---------------------------------------------------------------------------------------------------------------
// The TMA launch (Hopper, sm_90): a producer warp streams the planes and x into a ring of shared-memory stages with
// the tensor-memory accelerator (one instruction a box, no registers held by loads in flight); `warps` consumer
// warps, `rows` (1, 2) 16-row weight tiles each, read their fragments from the ring (the same 16 columns a thread
// and the same rows a warp as the register launch, so `Chunks::compute` is shared) and hand the stage back. A stage
// is `chunks` 64-column chunks: for each, x's columns j.. and kh + j.. (boxes of 8 G rows x 128 bytes, 128-byte
// swizzle: a thread's two 16-byte units of row g land on distinct banks) and the block's weight rows' nib, low j..
// and low kh + j.. bytes (boxes of 16 rows warps rows x 64 bytes: rows 2p and 2p + 1 of a quarter-warp share one
// 128-byte line, so no bank is read twice; rows 2 shares each x box between twice the weight rows). The tensor maps
// zero-fill past the planes' columns (low is viewed as [N, 2, kh]), past N and past x's M rows and K columns, so
// no load is masked and any kh % 16 == 0 works. Same split-K merge, epilogue and bits as `store_tile`.
struct TmaParams {
  CUtensorMap nib;  // uint8 [N, kh], box [64, 16 rows warps]
  CUtensorMap low;  // uint8 [N, 2, kh], box [64, 1, 16 rows warps]
  CUtensorMap x;    // bf16 [M, K], box [64, 8 G], 128-byte swizzle
  MmaArgs a;
  int chunks;  // 64-column chunks a stage
  int stages;  // slots of the ring
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
  }
}

__device__ __forceinline__ void tma_2d(void* dst, const CUtensorMap* map, int c0, int c1, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(
          smem_addr(dst)),
      "l"(map), "r"(c0), "r"(c1), "r"(smem_addr(bar))
      : "memory");
}

__device__ __forceinline__ void tma_3d(void* dst, const CUtensorMap* map, int c0, int c1, int c2, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];" ::"r"(
          smem_addr(dst)),
      "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(smem_addr(bar))
      : "memory");
}

__device__ __forceinline__ uint4 lds(const uint8_t* p) { return *reinterpret_cast<const uint4*>(p); }

constexpr int kSwizzleAlign = 1024;  // a 128-byte-swizzled box starts on a 1024-byte boundary
constexpr int kMaxDevices = 64;  // the shared-memory opt-in is kept per device

template <int R, int G>
__global__ void __launch_bounds__(288, R * G == 1 ? 3 : R * G == 2 ? 2 : 1)
    w12_tma_kernel(const __grid_constant__ TmaParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ uint8_t smem_raw[];
  // aligned by offsetting the shared array itself (not through an integer), so the compiler still knows the ring
  // is shared memory and reads it with LDS (a generic pointer gave generic 128-bit loads and 64-bit addressing)
  uint8_t* smem = smem_raw + (kSwizzleAlign - smem_addr(smem_raw) % kSwizzleAlign) % kSwizzleAlign;
  const MmaArgs& a = p.a;
  const int warps = blockDim.x / 32 - 1;  // consumers; the last warp produces
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tig = lane & 3;
  const int block_rows = 16 * R * warps;  // weight rows a block: R 16-row tiles a consumer warp
  const int x_box = 1024 * G, w_box = 64 * block_rows;  // bytes: 8 G rows x 128, the block's rows x 64
  const int chunk_bytes = 2 * x_box + 3 * w_box, stage_bytes = p.chunks * chunk_bytes;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + p.stages * stage_bytes);
  uint64_t* empty = full + p.stages;
  // Items: (row tile, split) pairs, tile fastest; block b takes items b, b + gridDim.x, ... (one each when the grid
  // has a block an item; fewer, resident blocks make the grid persistent). The ring runs on across items: step t
  // of the block's whole sequence uses slot t % stages, so the producer streams the next item during this one's
  // math and epilogue.
  const int tiles = (a.N + block_rows - 1) / block_rows, items = tiles * a.splits;
  if (threadIdx.x == 0) {
    for (int s = 0; s < p.stages; ++s) {
      mbar_init(full + s, 1);
      mbar_init(empty + s, warps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (warp == warps) {  // producer: one lane issues every copy, then leaves (the consumers keep the block alive)
    if (lane != 0) return;
    int t = 0;
    for (int item = blockIdx.x; item < items; item += gridDim.x) {
      const int n_block = (item % tiles) * block_rows, split = item / tiles;
      const int j_begin = split * a.j_per_split, j_end = min(a.kh, j_begin + a.j_per_split);
      for (int j0 = j_begin; j0 < j_end; j0 += 64 * p.chunks, ++t) {
        const int s = t % p.stages;
        mbar_wait(empty + s, ((t / p.stages) & 1) ^ 1);  // a fresh slot passes at once
        const int n_chunks = min(p.chunks, (j_end - j0 + 63) / 64);
        mbar_expect_tx(full + s, n_chunks * chunk_bytes);
        for (int c = 0; c < n_chunks; ++c) {
          const int j = j0 + 64 * c;
          uint8_t* base = smem + s * stage_bytes + c * chunk_bytes;
          tma_2d(base, &p.x, j, 0, full + s);
          tma_2d(base + x_box, &p.x, a.kh + j, 0, full + s);
          tma_2d(base + 2 * x_box, &p.nib, j, n_block, full + s);
          tma_3d(base + 2 * x_box + w_box, &p.low, j, 0, n_block, full + s);
          tma_3d(base + 2 * x_box + 2 * w_box, &p.low, j, 1, n_block, full + s);
        }
      }
    }
    return;
  }

  int t = 0;
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    const int tile = item % tiles, split = item / tiles, n_block = tile * block_rows;
    const int j_begin = split * a.j_per_split, j_end = min(a.kh, j_begin + a.j_per_split);
    float acc[R][G][4];
    zero(acc);
    EpilogueInputs<R> in;  // the ranges read while the producer's first copies of the item are in flight
    in.load_ranges(a, n_block + warp * 16 * R, g);
    for (int j0 = j_begin; j0 < j_end; j0 += 64 * p.chunks, ++t) {
      const int s = t % p.stages;
      mbar_wait(full + s, (t / p.stages) & 1);
      in.load_escapes(a, n_block + warp * 16 * R, lane);  // the ranges are in by now: the first copies were slower
      const int n_chunks = min(p.chunks, (j_end - j0 + 63) / 64);
      for (int c = 0; c < n_chunks; ++c) {
        const uint8_t* base = smem + s * stage_bytes + c * chunk_bytes;
        Chunks<R, G, 1> ch;
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
          for (int h = 0; h < 2; ++h) {  // the register launch's rows: tile r of the warp, then h * 8 + g
            const int off = ((warp * R + r) * 16 + h * 8 + g) * 64 + tig * 16;
            ch.wn[0][r][h] = lds(base + 2 * x_box + off);
            ch.wl0[0][r][h] = lds(base + 2 * x_box + w_box + off);
            ch.wl1[0][r][h] = lds(base + 2 * x_box + 2 * w_box + off);
          }
#pragma unroll
        for (int gg = 0; gg < G; ++gg) {
          const int row = gg * 8 + g, swz = row & 7;  // 128-byte swizzle: unit u of row r sits at u ^ (r % 8)
          const int u0 = row * 128 + (((2 * tig) ^ swz) << 4), u1 = row * 128 + (((2 * tig + 1) ^ swz) << 4);
          ch.xa[0][gg][0] = lds(base + u0);
          ch.xa[0][gg][1] = lds(base + u1);
          ch.xb[0][gg][0] = lds(base + x_box + u0);
          ch.xb[0][gg][1] = lds(base + x_box + u1);
        }
        ch.compute(acc);
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(empty + s);
    }
    in.load_escapes(a, n_block + warp * 16 * R, lane);
    store_tile<R, G>(acc, a, in, n_block + warp * 16 * R, g, tig, tile, split, ConsumerBarrier{32 * warps});
  }
#endif
}

int tma_stage_bytes(int groups, int rows, int warps, int chunks) {
  return chunks * (2 * 1024 * groups + 3 * 1024 * rows * warps);
}

const char* encode_maps(TmaParams& p, int groups, int block_rows) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    const cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                                             &found);
    return err == cudaSuccess && found == cudaDriverEntryPointSuccess
               ? reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn)
               : nullptr;
  }();
  if (encode == nullptr) return "the driver has no cuTensorMapEncodeTiled (TMA needs CUDA 12 and a Hopper card)";
  const MmaArgs& a = p.a;
  const cuuint32_t ones[3] = {1, 1, 1};
  {
    const cuuint64_t dims[2] = {cuuint64_t(a.kh), cuuint64_t(a.N)};
    const cuuint64_t strides[1] = {cuuint64_t(a.kh)};
    const cuuint32_t box[2] = {64, cuuint32_t(block_rows)};
    if (encode(&p.nib, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<uint8_t*>(a.nib), dims, strides, box, ones,
               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
      return "cuTensorMapEncodeTiled refused the nib plane";
  }
  {
    const cuuint64_t dims[3] = {cuuint64_t(a.kh), 2, cuuint64_t(a.N)};
    const cuuint64_t strides[2] = {cuuint64_t(a.kh), cuuint64_t(2 * a.kh)};
    const cuuint32_t box[3] = {64, 1, cuuint32_t(block_rows)};
    if (encode(&p.low, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, const_cast<uint8_t*>(a.low), dims, strides, box, ones,
               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
      return "cuTensorMapEncodeTiled refused the low plane";
  }
  {
    const cuuint64_t dims[2] = {cuuint64_t(a.K), cuuint64_t(a.M)};
    const cuuint64_t strides[1] = {cuuint64_t(a.ldx) * 2};
    const cuuint32_t box[2] = {64, cuuint32_t(8 * groups)};
    if (encode(&p.x, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(a.x), dims, strides, box, ones,
               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
      return "cuTensorMapEncodeTiled refused x (rows must be 16-byte aligned)";
  }
  return nullptr;
}

template <int R, int G>
const char* launch_tma_g(TmaParams& p, int warps, int persistent, cudaStream_t stream) {
  const int bytes = p.stages * tma_stage_bytes(G, R, warps, p.chunks) + kSwizzleAlign + 2 * 8 * p.stages;
  int device = 0, limit = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  static int static_bytes = -1;  // the kernel's static shared memory (the epilogue's flag), read once
  if (static_bytes < 0) {
    cudaFuncAttributes attrs{};
    if (cudaFuncGetAttributes(&attrs, w12_tma_kernel<R, G>) != cudaSuccess) return "cannot read the TMA kernel's attributes";
    static_bytes = int(attrs.sharedSizeBytes);
  }
  // the opt-in covers dynamic memory only: the static part comes off the card's limit
  if (bytes + static_bytes > limit)
    return "the TMA ring does not fit the card's shared memory: fewer stages, chunks or warps";
  // raised per device to the largest ring asked for so far (no stream work, so graph capture is safe)
  static int opted[kMaxDevices] = {};
  if (device >= kMaxDevices) return "the TMA launch keeps its shared-memory opt-in for devices 0..63";
  if (opted[device] < bytes) {
    const cudaError_t err = cudaFuncSetAttribute(w12_tma_kernel<R, G>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (err != cudaSuccess) return cudaGetErrorString(err);
    opted[device] = bytes;
  }
  const int threads = (warps + 1) * 32;
  const int items = (p.a.N + 16 * R * warps - 1) / (16 * R * warps) * p.a.splits;
  int blocks = items;  // a block an item
  if (persistent > 0) {  // at most `persistent` blocks an SM (fewer if fewer fit), each walking its share of the items
    int sms = 0, per_sm = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, w12_tma_kernel<R, G>, threads, bytes) != cudaSuccess ||
        per_sm < 1)
      return "cannot place a persistent TMA grid (occupancy query failed)";
    blocks = min(items, sms * min(per_sm, persistent));
  }
  w12_tma_kernel<R, G><<<blocks, threads, bytes, stream>>>(p);
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

constexpr int kMaxPipelined = 4;

template <int R, int G, int U>
const char* launch(const MmaArgs& a, int warps, bool pipelined, cudaStream_t stream) {
  const int rows_per_block = warps * R * 16;
  const dim3 grid((a.N + rows_per_block - 1) / rows_per_block, a.splits);
  if (pipelined) {
    // two steps' fragments in registers: beyond 4 (rows x chunks x row groups) ptxas spills kilobytes
    if constexpr (R * U * G <= kMaxPipelined) {
      w12_mma_kernel<R, G, U, true><<<grid, warps * 32, 0, stream>>>(a);
    } else {
      return "pipelined needs rows x chunks x row groups (2 when M > 8) <= 4";
    }
  } else {
    w12_mma_kernel<R, G, U, false><<<grid, warps * 32, 0, stream>>>(a);
  }
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

template <int R, int G>
const char* launch_u(const MmaArgs& a, int chunks, int warps, bool pipelined, cudaStream_t stream) {
  switch (chunks) {
    case 1: return launch<R, G, 1>(a, warps, pipelined, stream);
    case 2: return launch<R, G, 2>(a, warps, pipelined, stream);
    case 4: return launch<R, G, 4>(a, warps, pipelined, stream);
    default: return "chunks must be 1, 2 or 4";
  }
}

}  // namespace

const char* launch_tma(const MmaArgs& a, int rows, int chunks, int warps, int stages, int persistent,
                       cudaStream_t stream) {
  if (a.M < 1 || a.M > kMaxRows) return "M must be in 1..32";
  if (warps < 1 || warps > 8) return "warps must be in 1..8";
  if (stages < 2 || stages > 16 || chunks < 1 || chunks > 4) return "stages must be in 2..16 and chunks in 1..4";
  if (persistent < 0) return "persistent (blocks an SM) must be 0 (a block an item) or more";
  if (rows != 1 && rows != 2) return "rows must be 1 or 2";
  if (rows == 2 && a.M > 16) return "rows 2 takes at most 16 rows of x";
  if (a.kh % 16 != 0 || a.j_per_split % (64 * chunks) != 0 || a.K % 8 != 0 || a.ldx % 8 != 0)
    return "kh must be a multiple of 16, the columns a split a multiple of 64 * chunks, K and x's row stride of 8";
  int device = 0, major = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (major < 9) return "the TMA launch needs a Hopper card (compute capability 9.0)";
  const int groups = (a.M + 7) / 8;
  TmaParams p{};
  p.a = a;
  p.chunks = chunks;
  p.stages = stages;
  if (const char* err = encode_maps(p, groups, 16 * rows * warps)) return err;
  if (rows == 2) return groups == 2 ? launch_tma_g<2, 2>(p, warps, persistent, stream)
                                    : launch_tma_g<2, 1>(p, warps, persistent, stream);
  switch (groups) {
    case 1: return launch_tma_g<1, 1>(p, warps, persistent, stream);
    case 2: return launch_tma_g<1, 2>(p, warps, persistent, stream);
    case 3: return launch_tma_g<1, 3>(p, warps, persistent, stream);
    default: return launch_tma_g<1, 4>(p, warps, persistent, stream);
  }
}

const char* launch_mma(const MmaArgs& a, int rows, int chunks, int warps, bool pipelined, cudaStream_t stream) {
  if (a.M < 1 || a.M > kMaxRows) return "M must be in 1..32";
  if (warps < 1 || warps > 8) return "warps must be in 1..8";
  if (a.kh % 16 != 0 || a.j_per_split % (64 * chunks) != 0 || a.K % 8 != 0)
    return "kh must be a multiple of 16, the columns a split a multiple of 64 * chunks, K a multiple of 8";
  const int groups = (a.M + 7) / 8;  // 8-row groups of x: one mma B operand each
  if (rows == 1) {
    switch (groups) {
      case 1: return launch_u<1, 1>(a, chunks, warps, pipelined, stream);
      case 2: return launch_u<1, 2>(a, chunks, warps, pipelined, stream);
      case 3: return launch_u<1, 3>(a, chunks, warps, pipelined, stream);
      default: return launch_u<1, 4>(a, chunks, warps, pipelined, stream);
    }
  }
  if (rows == 2) {
    if (groups > 2) return "rows 2 takes at most 16 rows of x";
    return groups == 2 ? launch_u<2, 2>(a, chunks, warps, pipelined, stream)
                       : launch_u<2, 1>(a, chunks, warps, pipelined, stream);
  }
  return "rows must be 1 or 2";
}

}  // namespace specpilot_w12
