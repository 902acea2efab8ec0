"""The per-step attention context belongs to each engine: engines in one process share no hidden state."""
import threading

import pytest
import torch

from nanoengine import LLM, SamplingParams
from nanoengine.layers.attention import Attention
from nanoengine.layers.embed_head import ParallelLMHead
from nanoengine.models.checkpoint import write_random_checkpoint
from nanoengine.utils.context import DEFAULT_STEP, get_context


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ctx")
    return (write_random_checkpoint(root / "a", "tiny", seed=0),
            write_random_checkpoint(root / "b", "tiny", seed=1, num_hidden_layers=3))


def test_every_context_reader_of_an_engine_is_bound_to_its_own_runner(two_checkpoints):
    a, b = (LLM(path, num_kvcache_blocks=32, kvcache_block_size=16) for path in two_checkpoints)
    try:
        for llm in (a, b):
            readers = [m for m in llm.model_runner.model.modules() if isinstance(m, (Attention, ParallelLMHead))]
            assert readers and all(m.step_context is llm.model_runner.step for m in readers)
        assert a.model_runner.step is not b.model_runner.step
        a.generate(["hello"], SamplingParams(max_tokens=3), use_tqdm=False)
        assert get_context() == DEFAULT_STEP.current and not get_context().is_prefill  # the default is untouched
    finally:
        a.close()
        b.close()


def test_two_engines_in_two_threads_give_their_own_answers(two_checkpoints):
    prompts = [[5 + i, 17, 3 * i + 1, 9] for i in range(6)]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engines = [LLM(path, num_kvcache_blocks=64, kvcache_block_size=16) for path in two_checkpoints]
    try:
        expected = [[o["token_ids"] for o in llm.generate(prompts, greedy, use_tqdm=False)] for llm in engines]
        assert expected[0] != expected[1]
        results: list[list] = [[], []]
        errors: list[BaseException] = []
        barrier = threading.Barrier(2)

        def work(i: int) -> None:
            barrier.wait()
            try:
                for _ in range(20):
                    results[i].append([o["token_ids"] for o in engines[i].generate(prompts, greedy,
                                                                                     use_tqdm=False)])
            except BaseException as e:  # reported below, with the other thread's results
                errors.append(e)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not errors, errors
        assert all(r == expected[0] for r in results[0]) and len(results[0]) == 20
        assert all(r == expected[1] for r in results[1]) and len(results[1]) == 20
    finally:
        for llm in engines:
            llm.close()


def test_a_closed_runner_refuses_to_run_and_drops_its_model(two_checkpoints):
    llm = LLM(two_checkpoints[0], num_kvcache_blocks=16, kvcache_block_size=16)
    runner = llm.model_runner
    llm.close()
    assert runner.model is None and runner.kv_cache is None and runner.graphs is None
    with pytest.raises(RuntimeError, match="closed"):
        runner.launch([], is_prefill=True)
    llm.close()  # idempotent
    torch.testing.assert_close(torch.ones(1), torch.ones(1))
