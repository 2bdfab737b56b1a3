"""The attention backends own their metadata: ``build_metadata`` turns the model runner's plain
per-sequence step facts into masks and gather indices (the runner builds none), checked here against
a mask written out by hand for a small mixed batch with a sliding window."""

from __future__ import annotations

import torch

from tokenmill.layers.attention import SequenceStep, TorchReferenceBackend
from tokenmill.layers.attention.cpu_paged import CpuPagedBackend
from tokenmill.worker.model_runner import ModelRunner

# Blocks of 2 slots. Rows 0-2: a chunk of 3 tokens at positions 1..3 of a sequence on blocks [4, 1];
# row 3: a decode at position 2 of a sequence on blocks [3, 0]; rows 4-5: a prompt's first 2 tokens
# on block [2].
SEQUENCES = [SequenceStep(0, 1, 3, [4, 1]), SequenceStep(3, 2, 1, [3, 0]), SequenceStep(4, 0, 2, [2])]
SLOTS = torch.tensor([9, 2, 3, 0, 4, 5])  # [num_tokens]: block * 2 + position % 2


def test_the_model_runner_builds_no_masks() -> None:
    # (RL's weight-update group methods are about a torch.distributed group, not attention groups.)
    names = [name for name in vars(ModelRunner) if not name.endswith("weights_update_group")]
    assert not any("group" in name or "mask" in name for name in names)
    # The CPU backend reads the reference's metadata (block tables and spans for its kernels).
    assert CpuPagedBackend.build_metadata.__func__ is TorchReferenceBackend.build_metadata.__func__  # type: ignore[attr-defined]


def test_metadata_holds_the_hand_computed_masks_for_each_window() -> None:
    built = TorchReferenceBackend.build_metadata(SEQUENCES, SLOTS, 2, [2, None, 2])
    assert list(built) == [2, None]  # one metadata per distinct window, in the model's order
    for window, metadata in built.items():
        assert metadata.slot_mapping is SLOTS
        decodes, chunks = metadata.groups
        # The decode group: one query (position 2) over keys 0..2 of blocks [3, 0].
        assert decodes.num_queries == 1 and decodes.spans == [(3, 2, 1)]
        assert decodes.query_rows.tolist() == [[3]] and decodes.valid_rows.tolist() == [3]
        assert decodes.kv_slots.tolist() == [[6, 7, 0]]
        allowed = [True, True, True] if window is None else [False, True, True]
        assert decodes.mask.tolist() == [[[allowed]]]  # [S, 1, Q, K]
        # The chunk group: two sequences padded to 3 queries over 4 keys.
        assert chunks.num_queries == 3 and chunks.spans == [(0, 1, 3), (4, 0, 2)]
        assert chunks.query_rows.tolist() == [[0, 1, 2], [4, 5, 0]]  # padding reads row 0
        assert chunks.valid_rows.tolist() == [0, 1, 2, 4, 5] and chunks.valid_index.tolist() == [
            0,
            1,
            2,
            3,
            4,
        ]
        assert chunks.kv_slots.tolist() == [[8, 9, 2, 3], [4, 5, 0, 1]]  # block 2, then padding block 0
        assert chunks.block_tables.tolist() == [[4, 1], [2, 0]]
        assert chunks.seq_lens.tolist() == [4, 2] and chunks.sliding_window == window
        t, f = True, False
        if window is None:  # causal within each sequence
            first = [[t, t, f, f], [t, t, t, f], [t, t, t, t]]
        else:  # and only the last 2 positions, the query's own included
            first = [[t, t, f, f], [f, t, t, f], [f, f, t, t]]
        second = [[t, f, f, f], [t, t, f, f], [f, f, f, f]]  # the padded third query sees nothing
        assert chunks.mask[:, 0].tolist() == [first, second]


def test_released_blocks_are_read_as_block_0_and_never_attended() -> None:
    # A decode at position 4 whose first block the KV manager released (outside every window).
    built = TorchReferenceBackend.build_metadata(
        [SequenceStep(0, 4, 1, [-1, 5, 6])], torch.tensor([12]), 2, [2]
    )
    (group,) = built[2].groups
    assert group.block_tables.tolist() == [[0, 5, 6]]
    assert group.kv_slots.tolist() == [[0, 1, 10, 11, 12]]
    assert group.mask.tolist() == [[[[False, False, False, True, True]]]]
