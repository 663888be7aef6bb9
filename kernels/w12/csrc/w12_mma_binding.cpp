// PyTorch op torch.ops.specpilot_w12.mma: checks its tensors, allocates the output and the split
// partials, and launches the tensor-core W12 kernel (w12_mma.cu) on the current stream.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "w12_mma.h"

namespace {

at::Tensor mma(const at::Tensor& x, const at::Tensor& low, const at::Tensor& nib, const at::Tensor& e0,
               const at::Tensor& esc_ptr, const at::Tensor& esc_idx, const at::Tensor& esc_val,
               const at::Tensor& counters, int64_t k, int64_t chunks, int64_t warps, int64_t splits) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be a 2-D bf16 CUDA tensor");
  TORCH_CHECK(x.size(1) == k && k % 8 == 0, "x must be [M, K] with K a multiple of 8");
  TORCH_CHECK(x.stride(1) == 1 && x.stride(0) % 8 == 0 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0,
              "x's rows must be contiguous and 16-byte aligned");
  const int64_t m = x.size(0), n = low.size(0), kh = nib.size(1);
  TORCH_CHECK(m >= 1 && m <= 32, "the tensor-core W12 kernel takes 1 to 32 rows of x");
  TORCH_CHECK(low.is_contiguous() && nib.is_contiguous() && low.size(1) == 2 * kh && nib.size(0) == n &&
                  kh % 16 == 0 && 2 * kh >= k && 2 * kh < k + 32,
              "low/nib are not W12 planes of a [N, K] matrix");
  TORCH_CHECK(e0.numel() == n && esc_ptr.numel() == (n + 15) / 16 + 1 && esc_idx.numel() == esc_val.numel(),
              "e0/escape tensors do not match the planes");
  TORCH_CHECK(esc_idx.scalar_type() == at::kInt || esc_idx.scalar_type() == at::kLong, "esc_idx must be int32 or int64");
  TORCH_CHECK(splits >= 1 && chunks >= 1, "splits and chunks must be positive");
  const int64_t step = 64 * chunks;
  const int64_t per_split = (((kh + splits - 1) / splits) + step - 1) / step * step;
  const int64_t used_splits = (kh + per_split - 1) / per_split;
  const int64_t tiles = (n + warps * 16 - 1) / (warps * 16);
  TORCH_CHECK(used_splits == 1 || (counters.scalar_type() == at::kInt && counters.numel() >= tiles),
              "need ", tiles, " int32 arrival counters");

  const c10::cuda::CUDAGuard guard(x.device());
  auto y = at::empty({m, n}, x.options());
  at::Tensor part;
  if (used_splits > 1) part = at::empty({used_splits, m, n}, x.options().dtype(at::kFloat));

  specpilot_w12::MmaArgs a{};
  a.x = x.data_ptr();
  a.ldx = x.stride(0);
  a.low = low.data_ptr<uint8_t>();
  a.nib = nib.data_ptr<uint8_t>();
  a.e0 = e0.data_ptr<uint8_t>();
  a.esc_ptr = esc_ptr.data_ptr<int32_t>();
  a.esc_idx = esc_idx.data_ptr();
  a.idx64 = esc_idx.scalar_type() == at::kLong;
  a.esc_val = esc_val.data_ptr<int16_t>();
  a.y = y.data_ptr();
  a.part = used_splits > 1 ? part.data_ptr<float>() : nullptr;
  a.counters = used_splits > 1 ? counters.data_ptr<int32_t>() : nullptr;
  a.M = static_cast<int>(m);
  a.N = static_cast<int>(n);
  a.K = static_cast<int>(k);
  a.kh = static_cast<int>(kh);
  a.j_per_split = static_cast<int>(per_split);
  a.splits = static_cast<int>(used_splits);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const char* err = specpilot_w12::launch_mma(a, static_cast<int>(chunks), static_cast<int>(warps), stream);
  TORCH_CHECK(err == nullptr, "W12 tensor-core kernel: ", err);
  return y;
}

}  // namespace

TORCH_LIBRARY(specpilot_w12, lib) {
  lib.def("mma(Tensor x, Tensor low, Tensor nib, Tensor e0, Tensor esc_ptr, Tensor esc_idx, Tensor esc_val, "
          "Tensor counters, int k, int chunks, int warps, int splits) -> Tensor");
}

TORCH_LIBRARY_IMPL(specpilot_w12, CUDA, lib) { lib.impl("mma", &mma); }
