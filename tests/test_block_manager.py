"""Property-based tests of the BlockManager's invariants (hypothesis state machine)."""
import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from nanoengine.engine.block_manager import BlockManager, check_invariants, hash_block
from nanoengine.engine.sequence import Sequence


class BlockManagerMachine(RuleBasedStateMachine):
    """Random programs of admit / prefill chunk / decode / finish over a small pool with a tiny vocabulary."""

    def __init__(self):
        super().__init__()
        self.bm: BlockManager | None = None
        self.live: list[Sequence] = []

    @precondition(lambda self: self.bm is None)
    @rule(num_blocks=st.integers(1, 16), block_size=st.sampled_from([1, 2, 4, 16]),
          caching=st.booleans())
    def setup(self, num_blocks, block_size, caching):
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)

    @precondition(lambda self: self.bm is not None)
    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=40))
    def admit(self, tokens):
        s = Sequence(tokens, block_size=self.bm.block_size)
        free_before = self.bm.num_free_blocks
        if self.bm.allocate(s):
            assert len(s.block_table) == s.num_blocks
            assert s.num_cached_tokens % self.bm.block_size == 0 and s.num_cached_tokens < s.num_tokens
            self.live.append(s)
        else:
            assert s.block_table == [] and self.bm.num_free_blocks == free_before

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 10**6), size=st.integers(1, 64))
    def prefill_chunk(self, pick, size):
        s = self.live[pick % len(self.live)]
        if s.num_cached_tokens < s.num_tokens:
            s.num_scheduled_tokens = min(size, s.num_tokens - s.num_cached_tokens)
            self.bm.hash_blocks(s)
            s.num_cached_tokens += s.num_scheduled_tokens
            s.num_scheduled_tokens = 0

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 10**6), token=st.integers(0, 2))
    def decode(self, pick, token):
        s = self.live[pick % len(self.live)]
        if s.num_cached_tokens != s.num_tokens:
            return
        s.append_token(token)
        if self.bm.can_append(s):
            self.bm.may_append(s)
            s.num_scheduled_tokens = 1
            self.bm.hash_blocks(s)
            s.num_cached_tokens += 1
            s.num_scheduled_tokens = 0
        else:
            self.bm.deallocate(s)
            self.live.remove(s)

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 10**6))
    def finish(self, pick):
        s = self.live.pop(pick % len(self.live))
        self.bm.deallocate(s)
        assert s.block_table == [] and s.num_cached_tokens == 0

    @invariant()
    def invariants_hold(self):
        if self.bm is not None:
            check_invariants(self.bm, self.live)

    def teardown(self):
        if self.bm is not None:
            for s in self.live:
                self.bm.deallocate(s)
            check_invariants(self.bm, [])


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


def test_chained_hash_names_the_whole_prefix():
    a, b = hash_block([1, 2, 3, 4]), hash_block([9, 9, 9, 9])
    assert hash_block([5, 6], a) != hash_block([5, 6], b) != hash_block([5, 6])
    assert hash_block([5, 6], a) == hash_block([5, 6], hash_block([1, 2, 3, 4]))


def test_prefix_hit_shares_blocks_and_skips_the_last_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    first = Sequence(list(range(12)), block_size=4)
    assert bm.allocate(first)
    first.num_scheduled_tokens = 12
    bm.hash_blocks(first)
    first.num_cached_tokens, first.num_scheduled_tokens = 12, 0
    same = Sequence(list(range(12)), block_size=4)
    assert bm.allocate(same)
    assert same.block_table[:2] == first.block_table[:2] and same.block_table[2] != first.block_table[2]
    assert same.num_cached_tokens == 8
    check_invariants(bm, [first, same])


def test_invalid_arguments_name_the_field():
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, 3)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(-1, 4)
    with pytest.raises(ValueError, match="already has blocks"):
        bm = BlockManager(4, 2)
        s = Sequence([1, 2], block_size=2)
        bm.allocate(s)
        bm.allocate(s)
