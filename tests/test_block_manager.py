"""Block manager invariants under random allocate / append / rollback / free sequences."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_specdec import BlockManager, OutOfBlocksError

operations = st.lists(
    st.tuples(st.sampled_from(["add", "region", "append", "rollback", "free", "grow"]), st.integers(0, 5),
              st.integers(0, 40)),
    max_size=80,
)


def check_invariants(manager: BlockManager) -> None:
    used = [b for s in manager.sequences() for b in manager.block_table(s)]
    idle = [b for s, region in manager._regions.items() if s not in manager.sequences() for b in region]
    free = list(manager._free)
    assert len(used) == len(set(used)), "a block is held by two sequences"
    assert not set(used) & set(free) and not set(idle) & set(free + used), "a block is in two places"
    assert sorted(used + idle + free) == list(range(manager.num_reserved, manager.num_blocks)), "a block was lost"
    for s in manager.sequences():
        region = manager.region(s)
        assert manager.block_table(s)[:len(region)] == region
        assert len(manager.block_table(s)) == max(manager.blocks_for(manager.length(s)), len(region))


@settings(max_examples=300, deadline=None)
@given(operations, st.integers(1, 8))
def test_blocks_are_conserved(ops, block_size):
    manager = BlockManager(num_blocks=12, block_size=block_size, max_num_blocks=40)
    for op, seq, n in ops:
        try:
            if op == "add":
                manager.add_sequence(seq)
            elif op == "region":
                manager.give_regions([seq], n % 4 + 1)
            elif op == "append" and seq in manager.sequences():
                manager.append(seq, n)
            elif op == "rollback" and seq in manager.sequences():
                manager.rollback(seq, min(n, manager.length(seq)))
            elif op == "free" and seq in manager.sequences():
                manager.free(seq)
            elif op == "grow":
                manager.grow(n % 6)
        except (OutOfBlocksError, ValueError):
            pass  # refused operations must leave the state intact, which the invariants then check
        check_invariants(manager)
    for seq in manager.sequences():
        manager.free(seq)
    assert manager.num_free_blocks == manager.num_blocks - manager.num_reserved - manager.num_region_blocks


def test_rollback_frees_tail_blocks_only():
    manager = BlockManager(num_blocks=10, block_size=4)
    manager.add_sequence(0)
    manager.append(0, 10)  # 3 blocks
    head = manager.block_table(0)[:1]
    manager.rollback(0, 3)
    assert manager.block_table(0) == head and manager.length(0) == 3
    assert manager.num_free_blocks == 8


def test_out_of_blocks_is_refused_without_side_effects():
    manager = BlockManager(num_blocks=3, block_size=2, max_num_blocks=3)
    manager.add_sequence(0)
    with pytest.raises(OutOfBlocksError):
        manager.append(0, 5)
    assert manager.length(0) == 0 and manager.num_free_blocks == 2
    with pytest.raises(OutOfBlocksError, match="capped"):
        manager.grow(1)


def test_rollback_beyond_length_is_an_error():
    manager = BlockManager(num_blocks=4, block_size=2)
    manager.add_sequence(0)
    manager.append(0, 2)
    with pytest.raises(ValueError):
        manager.rollback(0, 3)


def test_regions_lie_one_after_another_and_survive_rollback_and_free():
    manager = BlockManager(num_blocks=5, block_size=4)
    manager.add_sequence(3)  # live but empty: takes its region at once
    manager.give_regions([3, 1, 2], 3)
    manager.add_sequence(1)
    manager.add_sequence(2)
    assert [manager.block_table(s) for s in (3, 1, 2)] == [[5, 6, 7], [8, 9, 10], [11, 12, 13]]
    assert manager.num_blocks == 14 and manager.num_free_blocks == 4  # the regions are not on the free list
    assert manager.contiguous_run([3, 1, 2]) == (5, 3)
    assert manager.contiguous_run([3, 1]) == (5, 3)
    assert manager.contiguous_run([3, 2]) is None  # a gap: row 1's region lies between
    assert manager.contiguous_run([1, 3, 2]) is None  # out of order
    manager.append(1, 12)
    manager.rollback(1, 2)  # rolling back keeps the region
    assert manager.block_table(1) == [8, 9, 10] and manager.contiguous_run([3, 1, 2]) == (5, 3)
    manager.append(1, 11)  # past its region: a block from the free list, and the rows are no longer one run
    assert manager.block_table(1)[:3] == [8, 9, 10] and len(manager.block_table(1)) == 4
    assert manager.contiguous_run([3, 1, 2]) is None
    manager.rollback(1, 0)
    assert manager.contiguous_run([3, 1, 2]) == (5, 3)
    manager.append(2, 13)
    manager.free(2)  # the block past the region goes back; the region stays with row 2 for its next sequence
    assert manager.num_free_blocks == 4 and manager.num_used_blocks == 6
    manager.add_sequence(2)
    assert manager.block_table(2) == [11, 12, 13] and manager.contiguous_run([3, 1, 2]) == (5, 3)
    manager.add_sequence(0)
    assert manager.contiguous_run([3, 1, 2, 0]) is None  # a row without a region
    with pytest.raises(ValueError, match="already has a region"):
        manager.give_regions([2], 2)
    manager.append(0, 1)
    with pytest.raises(ValueError, match="holds tokens"):
        manager.give_regions([0], 2)


def test_regions_are_refused_past_the_cap_without_side_effects():
    manager = BlockManager(num_blocks=4, block_size=2, max_num_blocks=8)
    manager.add_sequence(0)
    with pytest.raises(OutOfBlocksError, match="capped"):
        manager.give_regions([0, 1], 3)
    assert manager.num_blocks == 4 and manager.block_table(0) == [] and manager.region(0) == []


def test_batch_append_and_rollback_do_what_one_row_at_a_time_does():
    """`blocks_missing_total`, `append_many` and `rollback_many` (a step's every row in one pass) leave the manager
    as the per-row calls do, regions included, over random steps."""
    import random

    rng = random.Random(0)
    one, many = BlockManager(64, 4), BlockManager(64, 4)
    for manager in (one, many):
        manager.give_regions([1], 2)
        for seq in range(4):
            manager.add_sequence(seq)
    seqs = [0, 1, 2, 3]
    for _ in range(200):
        counts = [rng.randint(1, 6) for _ in seqs]
        assert many.blocks_missing_total(seqs, counts) == sum(one.blocks_missing(s, n) for s, n in zip(seqs, counts))
        assert many.append_many(seqs, counts) == [one.append(s, n) for s, n in zip(seqs, counts)]
        keep = [rng.randint(max(0, one.length(s) - 7), one.length(s)) for s in seqs]
        for s, n in zip(seqs, keep):
            one.rollback(s, n)
        many.rollback_many(seqs, keep)
        assert [one.block_table(s) for s in seqs] == [many.block_table(s) for s in seqs]
        assert [one.length(s) for s in seqs] == [many.length(s) for s in seqs]
        assert one.num_free_blocks == many.num_free_blocks
    with pytest.raises(ValueError, match="cannot roll"):
        many.rollback_many([0], [many.length(0) + 1])
    with pytest.raises(OutOfBlocksError):
        many.append_many([0], [1000])
