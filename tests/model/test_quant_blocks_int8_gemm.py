"""The int8-activation kernel at every row count (csrc/block_q8_panels.h with AVX512-VNNI; block_q8_linear.cpp's
own loops elsewhere): a row's outputs have the same bits alone and in any batch, for Q4_0, Q4_1 and Q8_0 weights,
so split invariance (model/invariance.py) holds with ``--quantization q4_1`` and prefill runs the same kernel.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from radixserve.model import paged_kernel
from radixserve.model.gguf_loader import load_gguf_blocks
from radixserve.model.invariance import amx_available, make_split_invariant
from radixserve.model.precision import cpu_flags
from radixserve.model.quant_blocks import INT8_KERNEL_MAX_ROWS, BlockLinear, QuantBlocks, quantize_activations
from tests.model.test_quant_blocks import needs_kernel, random_blocks
from tests.model.test_quant_blocks_q4_0 import gguf_model, no_tokenizer, q4_0_gguf, random_q4_0  # noqa: F401

# Batches a row is compared in: every size 1..8, tiles of 6 rows and their remainders, odd sizes, 64.
BATCHES = [*range(1, 9), 11, 13, 17, 31, 33, 47, 64]
# |kernel - reference| / (sum|x| * max|w|) over the cases below: at most 3.2e-8 measured (float32 rounding of
# up to 48 block terms); pinned with room.
REFERENCE_BOUND = 2e-7


def integer_reference(x: torch.Tensor, blocks: QuantBlocks) -> torch.Tensor:
    """float64 from the integer codes: sum_b d_b s_b (q_b . xq_b) (Q4_0: q - 8) + m_b s_b sum(xq_b) (Q4_1)."""
    codes, scales = quantize_activations(x)
    n = blocks.shape[0]
    if blocks.bits == 8:
        weights = blocks.qs.view(n, -1, 32).long()
    else:
        nibbles = blocks.qs.view(n, -1, 16).long()
        weights = torch.cat((nibbles & 0x0F, nibbles >> 4), dim=-1) - (8 if blocks.m is None else 0)
    xq = codes.view(x.shape[0], -1, 32).long()
    out = torch.einsum("rbj,nbj->rnb", xq, weights).double() * blocks.d.double()[None] * scales.double()[:, None]
    if blocks.m is not None:
        out = out + (scales.double() * xq.sum(-1).double())[:, None] * blocks.m.double()[None]
    return out.sum(-1)


def relative_error(got: torch.Tensor, x: torch.Tensor, blocks: QuantBlocks) -> float:
    scale = (x.float().abs().sum(-1, keepdim=True).double() * blocks.dequantize().abs().max().double()).clamp(1e-30)
    return float(((got.double() - integer_reference(x.float(), blocks)).abs() / scale).max())


def blocks_of(fmt: str, out_features: int, in_features: int, seed: int) -> QuantBlocks:
    if fmt == "q4_0":
        return QuantBlocks.from_gguf(random_q4_0(out_features, in_features, seed), "q4_0")
    return random_blocks(fmt, out_features, in_features, seed)


def check_rows_alone(x: torch.Tensor, blocks: QuantBlocks, residual: torch.Tensor | None = None) -> torch.Tensor:
    """Every row alone, then the rows in each of BATCHES' sizes from several offsets: the same bits."""
    op = torch.ops.radixserve.block_linear_q8

    def call(rows: slice) -> torch.Tensor:
        res = None if residual is None else residual[rows].contiguous()
        out: torch.Tensor = op(x[rows], blocks.qs, blocks.d, blocks.m, None, res)
        return out

    alone = torch.cat([call(slice(r, r + 1)) for r in range(x.shape[0])])
    for size in BATCHES:
        for start in {0, 1, x.shape[0] - size} & set(range(x.shape[0] - size + 1)):
            assert torch.equal(call(slice(start, start + size)), alone[start : start + size]), (size, start)
    return alone


@needs_kernel
@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0"])
@pytest.mark.parametrize(("out_features", "in_features"), [(37, 576), (130, 160), (16, 1536)])
def test_a_row_has_the_same_bits_alone_and_in_any_batch(fmt: str, out_features: int, in_features: int) -> None:
    """37 and 130 channels: partial panels of 16 and groups of 64; 576 = 18 blocks (groups of 4 and 16 with a
    remainder); 160 = 5 blocks. float32 and bfloat16 rows, a residual added."""
    blocks = blocks_of(fmt, out_features, in_features, seed=out_features)
    generator = torch.Generator().manual_seed(in_features)
    x = torch.randn(67, in_features, generator=generator) * torch.logspace(-2, 2, 67)[:, None]
    x[3, :32] = 0.0  # an all-zero block: scale 0
    alone = check_rows_alone(x, blocks)
    assert relative_error(alone, x, blocks) <= REFERENCE_BOUND
    residual = torch.randn(67, out_features, generator=generator).bfloat16()
    check_rows_alone(x.bfloat16(), blocks, residual)


@needs_kernel
def test_the_q4_0_fixtures_blocks_keep_it(q4_0_gguf: Path) -> None:  # noqa: F811
    """A real file's Q4_0 blocks (the tiny Llama's, written by gguf's quantizer) and its Q8_0 head."""
    names = ("q_proj.weight", "down_proj.weight", "embed_tokens.weight")
    for name, blocks in load_gguf_blocks(q4_0_gguf).items():
        if isinstance(blocks, QuantBlocks) and name.endswith(names):
            x = torch.randn(40, blocks.shape[1], generator=torch.Generator().manual_seed(5))
            assert relative_error(check_rows_alone(x, blocks), x, blocks) <= REFERENCE_BOUND, name
            check_rows_alone(x.bfloat16(), blocks)


@needs_kernel
@pytest.mark.parametrize("rows", [1, INT8_KERNEL_MAX_ROWS + 1, 200])
def test_an_invariant_int8_linear_runs_the_kernel_at_every_row_count(rows: int) -> None:
    """Split-invariant, a BlockLinear with int8 activations never takes the GEMM path (which it takes past
    INT8_KERNEL_MAX_ROWS otherwise): its prefill rows, with or without the residual, are the kernel's."""
    blocks = blocks_of("q4_0", 48, 576, seed=rows)
    layer = BlockLinear(blocks, None, torch.bfloat16, int8_activations=True)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)).bfloat16()
    kernel = torch.ops.radixserve.block_linear_q8(x, blocks.qs, blocks.d, None)
    model = torch.nn.Sequential(layer)
    assert make_split_invariant(model)[0] and layer.invariant_kernel == "vector"
    assert torch.equal(layer(x), kernel)
    residual = torch.randn(rows, 48).bfloat16()
    assert torch.equal(
        layer.forward_add(x, residual),
        torch.ops.radixserve.block_linear_q8(x, blocks.qs, blocks.d, None, None, residual),
    )


def test_int8_activations_are_split_invariant_and_say_so(q4_0_gguf: Path) -> None:  # noqa: F811
    """make_split_invariant now takes q4_1's int8-activation linears (before: "not split-invariant")."""
    model = gguf_model(q4_0_gguf, "q4_1", torch.bfloat16)
    linears = [m for m in model.modules() if isinstance(m, BlockLinear)]
    assert linears and all(m.int8_activations for m in linears)
    kernel = "amx" if amx_available() else "vector"  # under amx, int8 activations keep their own kernel
    holds, why = make_split_invariant(model, kernel)
    assert holds, why
    assert all(m.invariant_kernel == kernel for m in linears)
    x = torch.randn(3, linears[0].in_features).bfloat16()
    if paged_kernel.load():
        expected = torch.ops.radixserve.block_linear_q8(x, linears[0].qs, linears[0].d, linears[0].m)
        assert torch.equal(linears[0](x), expected)


PORTABLE_CHECK = """
import json, sys, numpy as np, torch
from torch.utils import cpp_extension
sys.path.insert(0, {root!r})
cpp_extension.load(name={name!r}, sources=[{source!r}], extra_cflags=["-O2", "-fopenmp", {march!r}],
                   build_directory={build!r}, is_python_module=False)
from radixserve.model import paged_kernel
paged_kernel.load = lambda: False  # the full library would register the same ops again
from tests.model.test_quant_blocks_int8_gemm import blocks_of, check_rows_alone, relative_error
errors = {{}}
for fmt in ("q4_0", "q4_1", "q8_0"):
    blocks = blocks_of(fmt, 37, 576, seed=1)
    x = torch.randn(20, 576, generator=torch.Generator().manual_seed(2))
    errors[fmt] = relative_error(check_rows_alone(x, blocks), x, blocks)
print(json.dumps({{"panels": bool(torch.ops.radixserve.block_q8_panels()), "errors": errors}}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("march", ["-march=x86-64-v3", "-march=x86-64-v2"], ids=["avx2", "portable"])
def test_a_build_without_vnni_is_still_correct_and_invariant(march: str, tmp_path: Path) -> None:
    """block_q8_linear.cpp alone, built for AVX2 (its vpmaddubsw loops) and for no AVX at all (plain C++), in a
    process of its own (its ops would clash with the full library's): every row alone equals its batches, and the
    outputs equal the integer reference within the bound. On an AVX2 CPU without AVX512 or AVX-VNNI the library's
    own build (-march=native) is that AVX2 build, which test_quant_blocks_int8.py checks the same way."""
    if march.endswith("v3") and not {"avx512f", "avx_vnni"} & cpu_flags() and "avx2" in cpu_flags():
        pytest.skip("this CPU's own build is the AVX2 path (tests/model/test_quant_blocks_int8.py)")
    source = Path(paged_kernel.CSRC) / "block_q8_linear.cpp"
    name = f"q8_{march.split('=')[1].replace('-', '_')}"
    script = PORTABLE_CHECK.format(
        root=str(Path(__file__).parents[2]), name=name, source=str(source), march=march, build=str(tmp_path)
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["panels"] is False  # not the VNNI kernel: the path under test
    # The AVX2 / portable loops keep per-lane float partial sums (their own order): within 1e-6, as
    # tests/model/test_quant_blocks_int8.py pins them.
    assert all(error <= 1e-6 for error in found["errors"].values()), found
    assert np.isfinite(list(found["errors"].values())).all()
