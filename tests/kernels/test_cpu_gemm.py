"""specpilot.kernels.cpu_gemm (linear_backend = "stream"): agrees with its PyTorch reference, is
batch-invariant bit for bit (rows and columns), rounds bf16 results as PyTorch does, refuses bad
input clearly; the engine with it stays lossless."""

import pytest
import torch

from specpilot.kernels import cpu_gemm
from specpilot.kernels.cpu_gemm import pack, packed_linear, reference, stream_linear

pytestmark = pytest.mark.skipif(not cpu_gemm.available(), reason=cpu_gemm.cpu_supported()[1])

# N not a multiple of the 16-column panel, K not a multiple of the 128-k chunk, the real model's shapes.
SHAPES = [(37, 29), (200, 96), (576, 576), (1536, 576), (577, 1539)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_the_reference(shape, dtype):
    torch.manual_seed(0)
    n, k = shape
    weight = torch.randn(n, k).to(dtype)
    for rows in (1, 2, 3, 4, 6, 7, 8, 9, 13, 17, 70):  # 70: past the accumulators kept on the stack
        x = torch.randn(rows, k)
        exact = (x.double() @ weight.double().T)
        got, ref = stream_linear(x, weight), reference.stream_linear(x, weight)
        assert got.dtype == torch.float32 and got.shape == (rows, n)
        # both are fp32 sums of the same products in other orders: within fp32 rounding of |x||w|
        bound = 1e-5 * (x.abs().double() @ weight.abs().double().T) + 1e-6
        assert ((got.double() - exact).abs() <= bound).all(), rows
        assert ((ref.double() - exact).abs() <= bound).all(), rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_are_batch_invariant(dtype):
    """Each row of an M-row call is bit for bit the row's own one-row call (any M, any neighbours)."""
    torch.manual_seed(1)
    weight = pack(torch.randn(203, 581).to(dtype))
    x = torch.randn(70, 581)
    alone = torch.cat([packed_linear(x[i:i + 1], weight, 203) for i in range(70)])
    for rows in [*range(1, 18), 70]:
        assert torch.equal(packed_linear(x[:rows], weight, 203), alone[:rows]), rows
    assert torch.equal(packed_linear(x.flip(0), weight, 203), alone.flip(0))  # other neighbours, same rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_columns_are_independent(dtype):
    """Packing the concatenation of two weights gives each its own bits (a fused QKV computes what
    three separate linears would)."""
    torch.manual_seed(2)
    a, b = torch.randn(40, 130).to(dtype), torch.randn(23, 130).to(dtype)
    x = torch.randn(5, 130)
    both = packed_linear(x, pack(torch.cat([a, b])), 63)
    assert torch.equal(both[:, :40], stream_linear(x, a)) and torch.equal(both[:, 40:], stream_linear(x, b))


def test_bf16_results_round_as_pytorch_does():
    """A bf16 x gives the fp32 result of its exact widening, rounded to nearest even by the kernel
    exactly as ``Tensor.to(torch.bfloat16)`` rounds it (infinities included; NaN stays NaN, its
    payload aside)."""
    torch.manual_seed(3)
    weight = pack(torch.randn(333, 200).to(torch.bfloat16))
    x = torch.randn(9, 200).to(torch.bfloat16)
    x[0, 0], x[1, 5], x[2, 7] = float("inf"), float("nan"), 3e38
    wide = packed_linear(x.float(), weight, 333)
    got, want = packed_linear(x, weight, 333), wide.to(torch.bfloat16)
    assert wide[1].isnan().all() and wide[0].isinf().any()
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(0).view(torch.int16), want.nan_to_num(0).view(torch.int16))


@pytest.mark.skipif(not cpu_gemm.cpu_has_avx512(), reason="this CPU lacks AVX-512F: only the AVX2 code runs here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_avx512_gives_the_avx2_bits(dtype):
    """Calls of 4+ rows run on AVX-512 where the CPU has it: the same FMAs in the same order as the
    AVX2 code, so the same bits (a machine with AVX-512 computes what one without does)."""
    torch.manual_seed(4)
    weight = pack(torch.randn(203, 581).to(dtype))
    x = torch.randn(40, 581).to(dtype)
    assert cpu_gemm.use_avx512() is True  # on by default where the CPU has it
    try:
        got = {m: packed_linear(x[:m], weight, 203) for m in (4, 5, 8, 12, 13, 17, 25, 40)}
        assert cpu_gemm.use_avx512(False) is False
        for m, y in got.items():
            assert torch.equal(y, packed_linear(x[:m], weight, 203)), m
    finally:
        cpu_gemm.use_avx512(True)


def test_avx512_cannot_be_turned_on_without_the_cpu_for_it():
    try:
        assert cpu_gemm.use_avx512(True) is cpu_gemm.cpu_has_avx512()
        assert cpu_gemm.use_avx512() is cpu_gemm.cpu_has_avx512()
    finally:
        cpu_gemm.use_avx512(True)


def test_shape_and_dtype_follow_the_input():
    weight = torch.randn(64, 40, dtype=torch.bfloat16)
    x = torch.randn(2, 3, 40, dtype=torch.bfloat16)
    y = stream_linear(x, weight)
    assert y.shape == (2, 3, 64) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y, reference.stream_linear(x, weight), rtol=1e-2, atol=1e-2)


def test_empty_and_transposed_inputs():
    weight = torch.randn(16, 8)
    assert packed_linear(torch.randn(0, 8), pack(weight), 16).shape == (0, 16)
    x = torch.randn(3, 16)
    torch.testing.assert_close(stream_linear(x, weight.T), reference.stream_linear(x, weight.T))  # packed from a view


def test_bad_input_is_refused_with_a_clear_error():
    weight = torch.randn(16, 8)
    with pytest.raises(RuntimeError, match="has 9 features"):
        stream_linear(torch.randn(1, 9), weight)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        stream_linear(torch.randn(1, 8), weight.half())
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        stream_linear(torch.randn(1, 8).half(), weight)
    with pytest.raises(RuntimeError, match="packed by stream_gemm.pack"):
        packed_linear(torch.randn(1, 8), weight, 16)
    with pytest.raises(RuntimeError, match="17 output features"):
        packed_linear(torch.randn(1, 8), pack(weight), 17)


needs_amx = pytest.mark.skipif(not (cpu_gemm.available() and cpu_gemm.cpu_has_amx()),
                               reason="the AMX path needs a CPU with AMX-BF16 (and Linux's permission)")


@needs_amx
def test_amx_path_agrees_with_the_reference_and_its_rows_are_batch_invariant():
    """Every row count through the tiles (one group of 16, groups of 32, partial groups, several
    passes and a partial last panel): the reference to bf16 rounding, and each row bit for bit what
    it gets alone."""
    torch.manual_seed(11)
    weight = torch.randn(100, 96).to(torch.bfloat16)  # 7 panels, the last of 4 columns
    packed = cpu_gemm.pack_amx(weight)
    x = torch.randn(70, 96).to(torch.bfloat16)
    alone = torch.cat([cpu_gemm.packed_linear_amx(x[i:i + 1], packed, 100) for i in range(70)])
    torch.testing.assert_close(alone, reference.stream_linear(x, weight), rtol=1e-2, atol=2e-2)
    for rows in (2, 8, 16, 17, 32, 33, 70):
        assert torch.equal(cpu_gemm.packed_linear_amx(x[:rows], packed, 100), alone[:rows]), rows
    # columns are independent: a concatenated weight gives each part its own bits
    other = torch.randn(48, 96).to(torch.bfloat16)
    both = cpu_gemm.packed_linear_amx(x[:5], cpu_gemm.pack_amx(torch.cat([weight, other])), 148)
    assert torch.equal(both[:, :100], alone[:5])


@needs_amx
def test_stream_linear_packs_bf16_for_amx_unless_told_not_to():
    from specpilot.engine.packed import StreamLinear

    torch.manual_seed(5)
    weight = torch.randn(96, 64).to(torch.bfloat16)
    x = torch.randn(9, 64).to(torch.bfloat16)
    on_tiles = StreamLinear(weight)
    assert on_tiles.amx and torch.equal(on_tiles(x), cpu_gemm.packed_linear_amx(x, cpu_gemm.pack_amx(weight), 96))
    assert not StreamLinear(weight.float()).amx and not StreamLinear(weight[:, :40]).amx  # fp32; K % 32 != 0
    try:
        assert not cpu_gemm.use_amx(False)
        on_fma = StreamLinear(weight)
        assert not on_fma.amx and torch.equal(on_fma(x), packed_linear(x, pack(weight), 96))
    finally:
        cpu_gemm.use_amx(True)
    assert on_tiles.amx  # chosen at packing: the switch does not move a packed weight


@needs_amx
def test_amx_path_refuses_bad_input_with_a_clear_error():
    weight = torch.randn(32, 64).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="not a multiple of 32"):
        cpu_gemm.pack_amx(weight[:, :48])
    with pytest.raises(RuntimeError, match="bfloat16"):
        cpu_gemm.pack_amx(weight.float())
    packed = cpu_gemm.pack_amx(weight)
    with pytest.raises(RuntimeError, match="x must be bfloat16"):
        cpu_gemm.packed_linear_amx(torch.randn(1, 64), packed, 32)
    with pytest.raises(RuntimeError, match="packed by stream_gemm.pack_amx"):
        cpu_gemm.packed_linear_amx(torch.randn(1, 64).to(torch.bfloat16), weight, 32)
    with pytest.raises(RuntimeError, match="has 63 features"):
        cpu_gemm.packed_linear_amx(torch.randn(1, 63).to(torch.bfloat16), packed, 32)


def test_engine_with_stream_linears_speculates_losslessly():
    """tiny, fp32: with linear_backend = "stream" every drafter setting emits that engine's AR
    tokens; the linears are swapped and a tied LM head still shares the embedding's weight."""
    from specpilot.engine.packed import StreamLinear
    from specpilot.harness.deployment import load_engine

    prompt = list(b"def add(a, b):\n    return a + b\n\ndef add(")
    ar = load_engine("tiny-cpu", {"linear_backend": "stream", "drafter": "none"})
    assert sum(isinstance(m, StreamLinear) for m in ar.model.modules()) == 2 * 7 + 1
    assert ar.model.cfg.tie_embeddings and ar.model.lm_head.weight is ar.model.embed.weight
    want = ar.generate(prompt, 40).tokens
    for options in ({"drafter": "ngram", "block_size": 4, "ngram_min_match": 1},
                    {"drafter": "ngram", "block_size": 6, "verify": "tree", "tree_nodes": 12, "ngram_min_match": 1}):
        sp = load_engine("tiny-cpu", {"linear_backend": "stream", **options})
        got = sp.generate(prompt, 40)
        assert got.tokens == want, options
        assert got.steps < len(want)  # something was accepted: the comparison tested speculation


@pytest.mark.slow
def test_smollm2_with_stream_linears_speculates_losslessly():
    """SmolLM2 fp32 with linear_backend = "stream": the parallel drafter (chain of 8, its own linears
    on the kernel too) and an n-gram tree emit the same-options AR tokens on real prompts."""
    from specpilot.engine.packed import StreamLinear
    from specpilot.harness.deployment import load_engine

    ar = load_engine("smollm2-cpu", {"linear_backend": "stream", "drafter": "none"})
    prompts = [ar.tokenize("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"),
               ar.tokenize("Write a haiku about the sea.", chat=True)]
    want = [ar.generate(p, 48).tokens for p in prompts]
    for options in ({"drafter": "parallel", "block_size": 8},
                    {"drafter": "ngram", "block_size": 6, "verify": "tree", "tree_nodes": 16}):
        sp = load_engine("smollm2-cpu", {"linear_backend": "stream", **options})
        if options["drafter"] == "parallel":
            net = sp.drafter.net
            assert isinstance(net.inp, StreamLinear) and isinstance(net.vocab_linear, StreamLinear)
        assert [sp.generate(p, 48).tokens for p in prompts] == want, options
