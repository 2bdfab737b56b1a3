"""build_decode_group returns exactly what build_group returns for one-token decodes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tokenmill.layers.attention.backend import SequenceStep
from tokenmill.layers.attention.decode_group import build_decode_group
from tokenmill.layers.attention.torch_ref import build_group

DECODES = [
    SequenceStep(row_offset=0, start_position=0, num_new_tokens=1, block_table=[7]),
    SequenceStep(row_offset=1, start_position=37, num_new_tokens=1, block_table=[-1, -1, 4, 9, 2]),
    SequenceStep(row_offset=2, start_position=16, num_new_tokens=1, block_table=[3, 5, 11]),
]


@pytest.mark.parametrize("window", [None, 8, 20])
@pytest.mark.parametrize("members", [DECODES, DECODES[1:2], DECODES[::-1]])
def test_decode_group_equals_the_general_builder(members: list[SequenceStep], window: int | None) -> None:
    fast = build_decode_group(members, 16, window, torch.device("cpu"))
    general = build_group(members, 16, window, torch.device("cpu"))
    names = [f.name for f in dataclasses.fields(general) if f.name != "gather_plan"] + ["kv_slots", "mask"]
    for name in names:
        a, b = getattr(fast, name), getattr(general, name)
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name
        else:
            assert a == b, name


def test_decode_group_refuses_chunks() -> None:
    chunk = SequenceStep(row_offset=0, start_position=0, num_new_tokens=4, block_table=[1])
    with pytest.raises(ValueError, match="one-token decodes"):
        build_decode_group([chunk], 16, None, torch.device("cpu"))
