"""ForwardBatch: what the model runner is given for one step.

Slot indices come from the prefix cache and the allocator (numpy, on the
host); the engine converts them once per step to tensors on the model's
device. The model writes each new token's K/V to ``out_slots`` and reads each
request's whole context through ``context_slots``::

    request i:  context_slots[i] = [ cached prefix slots | new token slots ]
                                     \\__ prefix_len __/   \\_ extend_lens[i] _/
                new tokens sit at positions prefix_len .. prefix_len + extend_lens[i] - 1
                and attend causally to the whole context up to themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate
from typing import Literal

import torch

ForwardMode = Literal["extend", "decode", "mixed"]  # mixed: extend chunks and one-token decodes in one step


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64: the new tokens of every request, concatenated
    positions: torch.Tensor  # [T] int64: each new token's position in its sequence
    out_slots: torch.Tensor  # [T] int64: the KV slot each new token's K/V is written to
    context_slots: list[torch.Tensor]  # per request [ctx_len_i] int64: prefix slots then new-token slots
    extend_lens: list[int]  # per request: how many of its tokens are new (all 1 in decode; 1 for a decode in mixed)
    # Per request (empty: none): read alone, never in a group sharing a prefix (cascade attention, whose merge
    # rounds differently): the rows of a decode verifying drafts, which share their request's whole context.
    solo: list[bool] = field(default_factory=list)

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens)

    def tail(self, lens: list[int]) -> tuple[ForwardBatch, torch.Tensor]:
        """The batch of each request's last ``lens[i]`` new tokens, on the same contexts (the new tokens before
        them read as a cached prefix), and those tokens' rows in this batch."""
        ends = list(accumulate(self.extend_lens))
        rows = torch.cat([torch.arange(end - n, end) for end, n in zip(ends, lens)]).to(self.input_ids.device)
        sub = ForwardBatch(
            self.mode,
            self.input_ids[rows],
            self.positions[rows],
            self.out_slots[rows],
            self.context_slots,
            list(lens),
            self.solo,
        )
        return sub, rows
