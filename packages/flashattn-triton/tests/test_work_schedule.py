"""The persistent Gluon kernels' work schedule (_hopper.work_schedule), on the CPU: every work item once, the
steps it models against the keys each tile's queries see, and the balance a list schedule guarantees."""

from __future__ import annotations

import pytest
import torch

from flashattn_triton import _hopper

CPU = torch.device("cpu")
BLOCK_M, BLOCK_N = 64, 128  # the backward's 64-row steps of a 128-key tile; the forward's 128-key tiles


def programs_items(pass_name: str, steps: list[int], heads: int, programs: int) -> list[list[int]]:
    table = _hopper.work_schedule(pass_name, steps, heads, programs, CPU).tolist()
    offsets, items = table[: programs + 1], table[programs + 1 :]
    assert len(items) == offsets[-1] + 1  # one more: the kernels read past a program's last item
    return [items[offsets[p] : offsets[p + 1]] for p in range(programs)]


def sees(query: int, key: int, causal: bool, window_left: int | None) -> bool:
    return (not causal or key <= query) and (window_left is None or query - key <= window_left)


@pytest.mark.parametrize("causal, window_left", [(True, None), (True, 200), (True, 1024), (False, None)])
@pytest.mark.parametrize("seqlen", [1024, 2048])
def test_backward_steps_run_from_a_key_tiles_first_step_to_its_last_query(seqlen, causal, window_left):
    """A key tile's steps: from its first key (0 without causal) to the step of the last query that sees one
    of its keys."""
    steps = _hopper.tile_steps("bwd", seqlen, BLOCK_M, BLOCK_N, causal, window_left)
    for tile, got in enumerate(steps):
        keys = range(tile * BLOCK_N, (tile + 1) * BLOCK_N)
        last = max(q for q in range(seqlen) if any(sees(q, k, causal, window_left) for k in keys))
        first = keys[0] if causal else 0
        assert got == (last - first) // BLOCK_M + 1


@pytest.mark.parametrize("causal, window_left", [(True, None), (True, 200), (True, 1024), (False, None)])
def test_forward_steps_are_the_key_tiles_a_query_tile_sees(causal, window_left):
    """Item j of a head is query tile T / 128 - 1 - j under causal (the longest first), else tile j."""
    seqlen = 2048
    tiles = seqlen // BLOCK_N
    steps = _hopper.tile_steps("fwd", seqlen, BLOCK_M, BLOCK_N, causal, window_left)
    for j, got in enumerate(steps):
        tile = tiles - 1 - j if causal else j
        queries = range(tile * BLOCK_N, (tile + 1) * BLOCK_N)
        seen = {key // BLOCK_N for q in queries for key in range(seqlen) if sees(q, key, causal, window_left)}
        assert got == len(seen) == max(seen) - min(seen) + 1


@pytest.mark.parametrize("pass_name", ["fwd", "bwd"])
@pytest.mark.parametrize("heads, seqlen, programs", [(100, 2048, 132), (16, 16384, 132), (3, 1024, 7),
                                                     (2, 256, 132)])  # fmt: skip
def test_every_item_runs_once_and_no_program_runs_long_past_the_mean(pass_name, heads, seqlen, programs):
    """A list schedule's longest program runs at most one item's cost beyond the mean (Graham's bound)."""
    steps = _hopper.tile_steps(pass_name, seqlen, BLOCK_M, BLOCK_N, causal=True, window_left=None)
    programs = min(programs, len(steps) * heads)
    items = programs_items(pass_name, steps, heads, programs)
    assert sorted(i for mine in items for i in mine) == list(range(len(steps) * heads))

    def cost(item: int) -> float:
        return steps[item // heads] + _hopper.ITEM_STEPS[pass_name]

    loads = [sum(cost(i) for i in mine) for mine in items]
    assert max(loads) <= sum(loads) / programs + max(cost(i) for i in range(len(steps) * heads))


def test_with_fewer_than_two_programs_a_head_the_first_items_share_few_heads():
    """xl's (4, 25, 2048) backward: 132 programs over 100 heads start on 32 heads (HEADS_A_CHUNK at a
    time), not one tile of every head; 16 heads, two programs a head and more, keep tile-major order."""
    steps = _hopper.tile_steps("bwd", 2048, BLOCK_M, BLOCK_N, causal=True, window_left=None)
    first = [mine[0] for mine in programs_items("bwd", steps, 100, 132)]
    assert len({item % 100 for item in first}) <= 132 // 4
    first = [mine[0] for mine in programs_items("bwd", steps, 16, 132)]
    assert sorted(first) == list(range(132))  # tiles 0 to 8 of every head, in tile-major order
