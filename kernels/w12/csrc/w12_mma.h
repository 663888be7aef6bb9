// W12 x bf16 on tensor cores (mma.sync m16n8k16): the launcher's contract, shared by the kernel
// file (plain CUDA, fast to compile) and the PyTorch binding.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

namespace specpilot_w12 {

struct MmaArgs {
  const void* x;          // bf16 [M, ldx], 16-byte aligned rows
  int64_t ldx;            // elements
  const uint8_t* low;     // [N, 2*kh]
  const uint8_t* nib;     // [N, kh]
  const uint8_t* e0;      // [N]
  const int32_t* esc_ptr; // [ceil(N/16) + 1]
  const void* esc_idx;    // int32 or int64 [E]
  int idx64;              // esc_idx is int64
  const int16_t* esc_val; // bf16 bits [E]
  void* y;                // bf16 [M, N], contiguous
  float* part;            // fp32 [splits, M, N] when splits > 1
  int* counters;          // >= ceil(N / rows a block) zeros (left at zero)
  int M, N, K, kh;
  int j_per_split;        // nib columns per split, a multiple of 64 * chunks
  int splits;
};

// M: 1..32 rows of x; one 16-row weight tile a warp; chunks: 64-column chunks loaded together (1, 2, 4; chunks x
// row groups of x <= 4: the next step's loads are issued before this step's math, two steps' fragments in
// registers); warps: warps a block (1..8). Returns an error string or nullptr.
const char* launch_mma(const MmaArgs& a, int chunks, int warps, cudaStream_t stream);

}  // namespace specpilot_w12
