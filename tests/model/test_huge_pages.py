"""Kept weights copied into huge-page memory (radixserve/model/huge_pages.py): the same values in memory of their own,
one copy for a tensor placed twice (a tied lm_head and its embedding), chunks unmapped with their last tensor."""

from __future__ import annotations

import gc

import pytest
import torch

from radixserve.model import huge_pages
from radixserve.model.huge_pages import in_huge_pages
from radixserve.model.quant_blocks import BlockEmbedding, BlockLinear, QuantBlocks

pytestmark = pytest.mark.skipif(not huge_pages.available(), reason="no huge-page advice on this platform")


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.float16, torch.float32])
def test_a_copy_has_the_values_in_memory_of_its_own(dtype: torch.dtype) -> None:
    source = (torch.randn(37, 96) * 50).to(dtype)
    copy = in_huge_pages(source)
    assert copy.dtype == dtype and copy.shape == source.shape and torch.equal(copy, source)
    assert copy.data_ptr() != source.data_ptr() and copy.data_ptr() % huge_pages.ALIGN == 0
    source.zero_()
    assert not torch.equal(copy, source)  # its own memory
    assert in_huge_pages(torch.empty(0, 4)).numel() == 0


def test_a_tensor_placed_twice_is_one_copy_and_a_tied_head_shares_it() -> None:
    blocks = QuantBlocks.quantize(torch.randn(64, 128), "q8_0")
    head, embedding = BlockLinear(blocks, None, torch.float32), BlockEmbedding(blocks, torch.float32)
    assert head.qs.data_ptr() == embedding.qs.data_ptr() and head.d.data_ptr() == embedding.d.data_ptr()
    assert head.qs.data_ptr() != blocks.qs.data_ptr()
    twin = blocks.qs.clone()  # equal values, another tensor: another copy
    assert in_huge_pages(twin).data_ptr() != head.qs.data_ptr()
    ids = torch.tensor([3, 0, 63])
    assert torch.equal(embedding(ids), blocks.dequantize()[ids])


def test_a_chunk_is_unmapped_with_its_last_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(huge_pages, "CHUNK_BYTES", 4 << 20)
    monkeypatch.setattr(huge_pages, "_chunks", [])
    small = in_huge_pages(torch.ones(1000, dtype=torch.uint8))
    big = in_huge_pages(torch.ones(9 << 20, dtype=torch.uint8))  # more than a chunk's room: a chunk of its own
    first, chunk = huge_pages._chunks
    assert chunk.memory() is not None and int(big.sum()) == 9 << 20 and int(small.sum()) == 1000
    del big
    gc.collect()
    assert chunk.memory() is None and first.memory() is not None  # small's chunk stays
