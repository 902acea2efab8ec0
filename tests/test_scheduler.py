"""Scheduler tests: rejection of impossible requests, chunking, preemption, stop rules, and random workloads."""
import random

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings
from transformers import PretrainedConfig

from nanoengine.config import Config, Optimizations
from nanoengine.engine.block_manager import check_invariants
from nanoengine.engine.scheduler import ContextLengthError, Scheduler
from nanoengine.engine.sequence import Sequence, SequenceStatus
from nanoengine.sampling_params import SamplingParams


def seq(n: int, max_tokens: int = 4, block_size: int = 4, start: int = 0, **kw) -> Sequence:
    return Sequence(list(range(start, start + n)), SamplingParams(max_tokens=max_tokens, **kw), block_size=block_size)


def drain(sch: Scheduler, rng: random.Random, vocab: int = 50, max_steps: int = 100_000) -> int:
    """Run the scheduler with random tokens until every request finished; return the number of steps."""
    for step in range(max_steps):
        if sch.is_finished():
            return step
        batch = sch.schedule()
        assert batch.seqs, "every step makes progress"
        if batch.is_prefill:
            assert batch.num_batched_tokens <= sch.max_num_batched_tokens
        assert len(batch.seqs) <= sch.max_num_seqs
        sch.postprocess(batch, [rng.randrange(1, vocab) for _ in batch.seqs])
        live = list(sch.running) + [s for s in sch.waiting if s.block_table]
        check_invariants(sch.block_manager, live)
    raise AssertionError("did not finish")


def test_impossible_requests_are_rejected_when_added_and_the_scheduler_keeps_serving():
    sch = Scheduler(8, 4, max_model_len=64)
    with pytest.raises(ContextLengthError, match="max_model_len"):  # a ValueError
        sch.add(seq(60, max_tokens=5))
    with pytest.raises(ContextLengthError, match="KV blocks"):
        sch.add(seq(30, max_tokens=10))
    with pytest.raises(ValueError, match="block_size"):
        sch.add(seq(4, block_size=8))
    with pytest.raises(ValueError, match="empty"):
        sch.check_request(0, SamplingParams())
    ok = seq(20, max_tokens=13)
    sch.add(ok)
    assert drain(sch, random.Random(0)) > 0 and ok.is_finished and ok.num_completion_tokens == 13


def test_largest_acceptable_request_runs_alone_in_the_pool():
    sch = Scheduler(4, 4, max_model_len=64)
    big = seq(10, max_tokens=7)
    sch.add(big)
    drain(sch, random.Random(1))
    assert big.num_completion_tokens == 7 and sch.block_manager.num_free_blocks == 4


def test_chunked_prefill_fills_the_budget_and_running_requests_keep_decoding():
    sch = Scheduler(64, 4, max_num_batched_tokens=16, max_model_len=256)
    a, b = seq(10, start=0), seq(30, start=100)
    sch.add(a)
    sch.add(b)
    first = sch.schedule()
    assert first.is_prefill and first.seqs == [a, b] and first.num_batched_tokens == 16
    assert (a.num_scheduled_tokens, b.num_scheduled_tokens) == (10, 6), "the last admitted request gets the rest"
    assert a.status == SequenceStatus.RUNNING and b.status == SequenceStatus.WAITING
    sch.postprocess(first, [1, 2])
    assert a.completion_token_ids == [1] and b.completion_token_ids == [], "a partial chunk's token is discarded"
    second = sch.schedule()
    assert second.is_prefill and second.seqs == [a, b] and second.num_batched_tokens == 16
    assert (a.num_scheduled_tokens, b.num_cached_tokens, b.num_scheduled_tokens) == (1, 6, 15), "a decodes alongside"


def test_a_long_prompt_never_stalls_running_requests():
    """nano-vllm's #73: prefill first meant every running request waited while a long prompt was chunked in."""
    sch = Scheduler(1024, 4, max_num_batched_tokens=64, max_model_len=2048)
    running = [seq(10, max_tokens=100, start=100 * i) for i in range(4)]
    for s in running:
        sch.add(s)
    sch.postprocess(first := sch.schedule(), [7] * len(first.seqs))
    long_prompt = seq(1000, max_tokens=5, start=5000)
    sch.add(long_prompt)
    rng = random.Random(0)
    chunks = 0
    while long_prompt.status == SequenceStatus.WAITING:
        batch = sch.schedule()
        assert batch.seqs[:4] == running and all(s.num_scheduled_tokens == 1 for s in running)
        remaining = long_prompt.num_tokens - long_prompt.num_cached_tokens
        assert long_prompt.num_scheduled_tokens == min(60, remaining) and batch.num_batched_tokens == 4 + min(60, remaining)
        before = [s.num_completion_tokens for s in running]
        sch.postprocess(batch, [rng.randrange(1, 50) for _ in batch.seqs])
        assert [s.num_completion_tokens for s in running] == [n + 1 for n in before], "every running request advanced"
        chunks += 1
    assert chunks == 17  # ceil(1000 / 60): the prompt shared every step with the four decodes


def test_a_half_computed_prompt_is_preempted_before_running_requests():
    """When a decode needs a block, the newest admission (a prompt still being chunked) gives its blocks back first."""
    sch = Scheduler(6, 4, max_num_batched_tokens=8, max_model_len=64)
    old = seq(4, max_tokens=20, start=0)
    sch.add(old)
    sch.postprocess(sch.schedule(), [9])  # old: 5 tokens in 2 blocks
    big = seq(16, max_tokens=2, start=100)
    sch.add(big)
    batch = sch.schedule()  # old decodes; big is admitted with 4 blocks and gets a 7-token chunk
    assert batch.seqs == [old, big] and big.block_table and sch.block_manager.num_free_blocks == 0
    sch.postprocess(batch, [9, 3])
    for _ in range(3):  # old fills its second block
        batch = sch.schedule()
        sch.postprocess(batch, [9] * len(batch.seqs))
        if batch.preempted:
            break
    assert batch.preempted == [big] and big.block_table == [] and sch.waiting[0] is big and old.status.name == "RUNNING"
    drain(sch, rng := random.Random(1))
    assert old.num_completion_tokens == 20 and big.num_completion_tokens == 2
    assert sch.block_manager.num_free_blocks == 6


def test_preemption_picks_the_newest_and_readmits_it_first_mostly_from_cache():
    sch = Scheduler(10, 4, max_model_len=64)
    first, second = seq(8, max_tokens=20, start=0), seq(8, max_tokens=20, start=100)
    sch.add(first)
    sch.add(second)
    rng = random.Random(0)
    batch = sch.schedule()
    while not batch.preempted:
        sch.postprocess(batch, [rng.randrange(1, 50) for _ in batch.seqs])
        batch = sch.schedule()
    assert batch.preempted == [second] and sch.waiting[0] is second and second.block_table == []
    assert second.status == SequenceStatus.WAITING and sch.num_preemptions == 1
    tokens_before = second.num_tokens
    sch.postprocess(batch, [rng.randrange(1, 50) for _ in batch.seqs])
    while True:
        batch = sch.schedule()
        if batch.is_prefill:
            break
        sch.postprocess(batch, [rng.randrange(1, 50) for _ in batch.seqs])
    assert first.is_finished and batch.seqs == [second] and second.num_tokens == tokens_before
    assert second.num_cached_tokens >= tokens_before // 2, "most of its blocks were still in the prefix cache"
    drain(sch, rng)
    assert first.num_completion_tokens == second.num_completion_tokens == 20


def test_stop_tokens_finish_reason_and_ignore_eos():
    sch = Scheduler(16, 4, max_model_len=64, eos_token_ids=(0, 99))
    stop, ignore, length = seq(3, max_tokens=10), seq(3, max_tokens=3, ignore_eos=True, start=50), seq(3, max_tokens=2, start=70)
    for s in (stop, ignore, length):
        sch.add(s)
    sch.postprocess(sch.schedule(), [5, 99, 6])
    sch.postprocess(sch.schedule(), [99, 0, 7])
    assert stop.finish_reason == "stop" and stop.completion_token_ids == [5, 99]
    assert length.finish_reason == "length" and length.completion_token_ids == [6, 7]
    sch.postprocess(sch.schedule(), [3])
    assert ignore.finish_reason == "length" and ignore.completion_token_ids == [99, 0, 3]
    assert sch.is_finished() and sch.block_manager.num_free_blocks == 16


def test_max_num_seqs_limits_both_phases():
    sch = Scheduler(64, 4, max_num_seqs=2, max_model_len=64)
    for i in range(5):
        sch.add(seq(4, max_tokens=3, start=10 * i))
    first = sch.schedule()
    assert len(first.seqs) == 2
    assert drain(sch, random.Random(0)) > 0


def test_postprocess_rejects_a_wrong_number_of_tokens():
    sch = Scheduler(8, 4)
    sch.add(seq(4))
    with pytest.raises(ValueError, match="tokens for a batch"):
        sch.postprocess(sch.schedule(), [1, 2])


def test_many_requests_finish_in_order_and_leave_no_block_behind():
    sch = Scheduler(40, 16, max_num_seqs=64, max_num_batched_tokens=256, max_model_len=512)
    rng = random.Random(3)
    system = [rng.randrange(1000) for _ in range(48)]
    reqs = []
    for i in range(300):
        prompt = (system if i % 2 else []) + [rng.randrange(1000) for _ in range(rng.randint(1, 60))]
        s = Sequence(prompt, SamplingParams(max_tokens=rng.randint(1, 40)), block_size=16)
        sch.add(s)
        reqs.append(s)
    drain(sch, rng)
    assert all(s.is_finished and s.num_completion_tokens == s.sampling_params.max_tokens for s in reqs)
    assert sch.block_manager.num_free_blocks == 40 and not sch.block_manager.used_block_ids


@settings(max_examples=60, deadline=None)
@given(num_blocks=st.integers(4, 24), block_size=st.sampled_from([1, 2, 4, 8]), budget=st.integers(1, 40),
       max_num_seqs=st.integers(1, 6), seed=st.integers(0, 10**6),
       requests=st.lists(st.tuples(st.lists(st.integers(0, 3), min_size=1, max_size=24), st.integers(1, 12)),
                         min_size=1, max_size=12))
def test_random_workloads_always_finish_with_invariants_intact(num_blocks, block_size, budget, max_num_seqs, seed,
                                                               requests):
    sch = Scheduler(num_blocks, block_size, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                    max_model_len=64, eos_token_ids=(0,))
    accepted = []
    for prompt, max_tokens in requests:
        s = Sequence(prompt, SamplingParams(max_tokens=max_tokens), block_size=block_size)
        try:
            sch.add(s)
            accepted.append(s)
        except ValueError:
            assert -(-(len(prompt) + max_tokens - 1) // block_size) > num_blocks
    drain(sch, random.Random(seed), vocab=4)
    assert all(s.is_finished for s in accepted)
    check_invariants(sch.block_manager, [])


def _step_like_the_engine(plan_ahead: bool, num_blocks: int, block_size: int, budget: int, max_num_seqs: int,
                          requests: list, arrivals: dict, eos: tuple,
                          plan_prompt_steps: bool = True) -> tuple[list, list, list]:
    """Step a scheduler as the engine does, planning each step ahead when `plan_ahead` and the scheduler allow, with
    tokens that depend only on the request and the position. Returns the steps (phase, rows, preemptions), the
    completions and finish reasons; the requests of `arrivals[k]` join before step k is chosen
    (or when nothing runs)."""
    sch = Scheduler(num_blocks, block_size, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                    max_model_len=64, eos_token_ids=eos, plan_prompt_steps=plan_prompt_steps)
    seqs, index = [], {}

    def add(prompt, max_tokens):
        s = Sequence(prompt, SamplingParams(max_tokens=max_tokens), block_size=block_size)
        try:
            sch.add(s)
        except ValueError:
            return
        index[s.seq_id] = len(seqs)
        seqs.append(s)

    def tokens(batch):  # the token sampled at index num_tokens of each row's request
        return [(index[s.seq_id] * 7 + s.num_tokens * 3) % 5 for s in batch.seqs]

    def record(batch):
        return batch.is_prefill, [(index[s.seq_id], s.num_scheduled_tokens) for s in batch.seqs], len(batch.preempted)

    for prompt, max_tokens in requests:
        add(prompt, max_tokens)
    arrivals = dict(arrivals)

    def arrive():  # the requests due before the next step is chosen; the next ones at once if nothing runs
        due = [k for k in arrivals if k <= sch.num_steps + 1]
        if not due and arrivals and sch.is_finished() and in_flight is None:
            due = [min(arrivals)]
        for k in sorted(due):
            for prompt, max_tokens in arrivals.pop(k):
                add(prompt, max_tokens)

    steps, in_flight, i = [], None, 0
    while not sch.is_finished() or in_flight is not None or arrivals:
        i += 1
        if in_flight is None:
            arrive()
            if sch.is_finished():
                continue
            batch = sch.schedule()
            in_flight = (batch, tokens(batch))
            steps.append(record(batch))
        (batch, sampled), in_flight = in_flight, None
        if plan_ahead:
            arrive()
        ahead = sch.schedule_ahead(batch) if plan_ahead else None
        if ahead is not None:
            assert not ahead.preempted and len(ahead.source_rows) == sum(not s.is_prefill for s in ahead.seqs)
            in_flight = (ahead, tokens(ahead))
            steps.append(record(ahead) + ("ahead",))
        sch.postprocess(batch, sampled)
        check_invariants(sch.block_manager, list(sch.running) + [s for s in sch.waiting if s.block_table])
        assert i < 10_000, "did not finish"
    assert all(s.is_finished and -1 not in s.token_ids for s in seqs)
    check_invariants(sch.block_manager, [])
    return steps, [s.completion_token_ids for s in seqs], [s.finish_reason for s in seqs]


_workload = dict(
    num_blocks=st.integers(4, 24), block_size=st.sampled_from([1, 2, 4, 8]), budget=st.integers(1, 40),
    max_num_seqs=st.integers(1, 6),
    requests=st.lists(st.tuples(st.lists(st.integers(0, 3), min_size=1, max_size=24), st.integers(1, 12)),
                      min_size=1, max_size=10),
    arrivals=st.dictionaries(st.integers(0, 30), st.lists(
        st.tuples(st.lists(st.integers(0, 3), min_size=1, max_size=24), st.integers(1, 12)), max_size=3),
        max_size=4),
)


@settings(max_examples=80, deadline=None)
@given(**_workload)
def test_planned_steps_are_the_steps_schedule_would_take(num_blocks, block_size, budget, max_num_seqs, requests,
                                                         arrivals):
    """Without stop tokens a step planned ahead (prompt chunks, retired requests and arrivals included) is exactly
    the step `schedule()` takes after `postprocess`, so both loops take the same steps and produce the same tokens."""
    sync = _step_like_the_engine(False, num_blocks, block_size, budget, max_num_seqs, requests, arrivals, ())
    ahead = _step_like_the_engine(True, num_blocks, block_size, budget, max_num_seqs, requests, arrivals, ())
    assert [s[:3] for s in ahead[0]] == sync[0]
    assert ahead[1:] == sync[1:]
    decode_only = _step_like_the_engine(True, num_blocks, block_size, budget, max_num_seqs, requests, arrivals, (),
                                        plan_prompt_steps=False)
    assert [s[:3] for s in decode_only[0]] == sync[0] and decode_only[1:] == sync[1:]
    assert not any(s[0] for s in decode_only[0] if len(s) == 4), "plan_prompt_steps=False plans decode steps only"


@settings(max_examples=60, deadline=None)
@given(**_workload)
def test_planning_ahead_with_stop_tokens_gives_the_same_tokens(num_blocks, block_size, budget, max_num_seqs,
                                                               requests, arrivals):
    """With stop tokens a stopped request's planned row is wasted and the steps may differ, never the tokens."""
    sync = _step_like_the_engine(False, num_blocks, block_size, budget, max_num_seqs, requests, arrivals, (0,))
    ahead = _step_like_the_engine(True, num_blocks, block_size, budget, max_num_seqs, requests, arrivals, (0,))
    assert ahead[1:] == sync[1:]


def test_a_step_with_prompt_work_is_planned_ahead_after_a_prefill_and_a_mixed_step():
    steps, _, _ = _step_like_the_engine(True, 24, 4, 8, 6, [([1, 2, 3], 3), (list(range(11)), 4)],
                                        {2: [([3, 2], 3)]}, ())
    planned = [s for s in steps if len(s) == 4]
    assert any(prefill for prefill, *_ in planned), "a step with a prompt chunk was planned ahead"
    assert len(planned) == len(steps) - 1, "every step after the first was planned ahead"


def _config(**kw) -> Config:
    return Config("no-checkpoint", hf_config=PretrainedConfig(max_position_embeddings=128), device="cpu", **kw)


def test_from_config_passes_the_limits_and_plan_prompt_steps():
    config = _config(num_kvcache_blocks=12, kvcache_block_size=8, max_num_seqs=5, max_num_batched_tokens=32,
                     enable_prefix_caching=False, optimizations=Optimizations(plan_prompt_steps=False))
    sch = Scheduler.from_config(config, eos_token_ids=(1,))
    assert type(sch) is Scheduler
    assert (sch.block_manager.num_blocks, sch.block_size, sch.max_num_seqs, sch.max_num_batched_tokens,
            sch.max_model_len, sch.eos_token_ids) == (12, 8, 5, 32, 128, {1})
    assert not sch.block_manager.enable_prefix_caching and not sch.plan_prompt_steps
    assert Scheduler.from_config(_config(num_kvcache_blocks=4)).plan_prompt_steps
    with pytest.raises(ValueError, match="num_kvcache_blocks"):
        Scheduler.from_config(_config())
    with pytest.raises(TypeError, match="plan_prompt_steps"):
        Scheduler(4, 4, plan_prompt_steps="no")


def test_without_plan_prompt_steps_only_a_decode_step_after_a_decode_step_is_planned():
    steps, _, _ = _step_like_the_engine(True, 24, 4, 8, 6, [([1, 2, 3], 3), (list(range(11)), 4)],
                                        {2: [([3, 2], 3)]}, (), plan_prompt_steps=False)
    planned = [s for s in steps if len(s) == 4]
    assert planned and not any(prefill for prefill, *_ in planned)
    assert len(planned) < len(steps) - 1, "steps next to prompt work are scheduled synchronously"
