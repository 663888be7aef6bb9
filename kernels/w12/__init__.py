"""W12: lossless 12-bit BF16 weights and a Triton GEMV/GEMM that decodes them in registers.

``format`` is the normative PyTorch reference (pack, decode, verify), ``kernel`` the Triton
kernel (imported lazily: only CUDA and interpreter runs need it) and the dispatch, ``cuda_mma`` the
CUDA C++ tensor-core kernel for 1-32 rows of bf16 ``x`` (``csrc/``), ``linear`` the engine hook,
the ``specpilot w12 pack`` command lives in `specpilot.app.cmd_w12`. README.md explains the format and the kernel.
"""

from .format import W12Weight, decode, pack, pack_verified, verify
from .linear import W12Linear, quantize_model_linears

__all__ = ["W12Linear", "W12Weight", "decode", "pack", "pack_verified", "quantize_model_linears", "verify"]
