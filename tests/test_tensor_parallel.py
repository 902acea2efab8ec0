"""Tensor parallelism on CPU (gloo): tp=2 equals tp=1, control planes, start-up checks, failures and cleanup."""
import gc
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import zlib
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import nanoengine.parallel.channels as channels
from nanoengine import LLM, SamplingParams
from nanoengine.engine.model_runner import min_over_ranks
from nanoengine.engine.sequence import Sequence
from nanoengine.parallel.torchrun import run_worker
from nanoengine.parallel.workers import WorkerDiedError, WorkerGroup, serve_echo
from nanoengine.models.checkpoint import write_random_checkpoint
from nanoengine.utils.dist import free_port, run_tp_workers, tp_rank

ENGINE = dict(device="cpu", kvcache_block_size=16, num_kvcache_blocks=24, max_num_batched_tokens=64,
              max_model_len=512)
GREEDY = SamplingParams(temperature=0, max_tokens=24)
LONG = dict(ENGINE, num_kvcache_blocks=512, max_num_batched_tokens=8192)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(3, 380, (70,), generator=g).tolist()
    prompts = [shared + torch.randint(3, 380, (n,), generator=g).tolist() for n in (5, 17, 33, 2, 40, 9, 26)]
    return prompts + [list(prompts[2])]


PROMPTS = _prompts()
LONG_PROMPTS = [torch.randint(3, 380, (300,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(20)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("tp") / "tiny", "tiny", seed=0, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def reference(ckpt):
    """One rank's greedy outputs: the acceptance prompts (cold and warm cache) and the long prompts."""
    with LLM(ckpt, **ENGINE) as llm:
        cold = [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        warm = [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert cold == warm
    with LLM(ckpt, **LONG) as llm:
        long = [o["token_ids"] for o in llm.generate(LONG_PROMPTS, SamplingParams(temperature=0, max_tokens=4),
                                                     use_tqdm=False)]
    return {"cold": cold, "long": long}


def our_shm() -> set[str]:
    """This process's shared-memory segments in /dev/shm, and every multiprocessing semaphore there.

    Semaphore names do not say whose they are: beside other pytest-xdist workers (whose engines come and go) only
    the segments, named after the process that made them, can be told apart, so only they are counted there."""
    segments = {n for n in os.listdir("/dev/shm") if n.startswith(f"nanoengine-{os.getpid()}-")}
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return segments
    return segments | {n for n in os.listdir("/dev/shm") if n.startswith("sem.mp-")}


def process_exists(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


def assert_nothing_left(shm_before: set[str]) -> None:
    gc.collect()
    assert not multiprocessing.active_children(), "no worker process may remain"
    assert not dist.is_initialized(), "rank 0 left the process group"
    assert our_shm() <= shm_before, f"left in /dev/shm: {our_shm() - shm_before}"


def run_acceptance(llm) -> tuple[list, list]:
    llm.trace.clear()
    cold = [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    trace = list(llm.trace)
    assert any(r.is_prefill and r.num_tokens == 64 for r in trace), "a prompt was chunked"
    assert sum(r.num_preempted for r in trace) > 0, "preemption happened"
    assert sum(r.planned_ahead for r in trace) > 0, "decode steps were planned ahead (async scheduling)"
    warm = [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert llm.scheduler.block_manager.num_hit_blocks > 0, "the prefix cache was hit"
    return cold, warm


def test_shm_tp2_equals_tp1_with_chunking_prefix_hits_preemption_and_block_size_16(ckpt, reference):
    """Block size 16 is not the default: workers that used 256 (nano-vllm) would store K/V in wrong slots."""
    before = our_shm()
    with LLM(ckpt, tensor_parallel_size=2, **ENGINE) as llm:
        group = llm.model_runner.driver
        assert isinstance(group.channel, channels.ShmChannel) and group.channel.name in os.listdir("/dev/shm")
        assert llm.model_runner.num_kvcache_blocks == llm.model_runner.local_num_kvcache_blocks == 24
        cold, warm = run_acceptance(llm)
        assert cold == warm == reference["cold"]
    assert group.channel is None
    assert_nothing_left(before)


def test_fp8_cache_tp2_equals_fp8_tp1_with_chunking_prefix_hits_and_preemption(ckpt):
    """An FP8 cache keeps one scale per token and KV head, and each rank holds whole KV heads: two ranks quantize
    exactly what one rank would, so tp=2 gives tp=1's tokens (cold, and warm from the float8 prefix cache)."""
    before = our_shm()
    with LLM(ckpt, kv_cache_dtype="fp8", **ENGINE) as llm:
        one = run_acceptance(llm)
    with LLM(ckpt, tensor_parallel_size=2, kv_cache_dtype="fp8", **ENGINE) as llm:
        runner = llm.model_runner
        assert runner.kv_cache.dtype == torch.float8_e4m3fn and runner.kv_scales is not None
        assert runner.num_kvcache_blocks == 24
        assert run_acceptance(llm) == one
    assert_nothing_left(before)


def test_pipe_tp2_equals_tp1_and_a_forgotten_engine_is_cleaned_up_by_its_finalizer(ckpt, reference):
    before = our_shm()
    llm = LLM(ckpt, tensor_parallel_size=2, control_plane="pipe", **ENGINE)
    pid = llm.model_runner.driver.procs[0].pid
    cold, _ = run_acceptance(llm)
    assert cold == reference["cold"]
    del llm                                                    # no close(): the weakref finalizer must run
    assert_nothing_left(before)
    assert not process_exists(pid)


def test_dist_tp2_equals_tp1_then_a_worker_killed_mid_run_is_reported(ckpt, reference):
    before = our_shm()
    llm = LLM(ckpt, tensor_parallel_size=2, control_plane="dist", **ENGINE)
    assert isinstance(llm.model_runner.driver.channel, channels.DistChannel)
    cold, warm = run_acceptance(llm)
    assert cold == warm == reference["cold"]
    worker = llm.model_runner.driver.procs[0]
    os.kill(worker.pid, signal.SIGKILL)                        # no waiting: the next step may already be running
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+\) exited with code -9 \(killed by SIGKILL\)"):
        llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    assert time.monotonic() - t0 < 10, "detected quickly, never a hang"
    assert_nothing_left(before)
    with pytest.raises(RuntimeError, match="earlier failure"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    llm.close()
    llm.close()


def test_message_larger_than_the_segment_grows_it_then_a_dead_worker_is_an_error(ckpt, reference, monkeypatch):
    monkeypatch.setattr(channels, "SHM_BYTES", 4096)
    before = our_shm()
    llm = LLM(ckpt, tensor_parallel_size=2, **LONG)
    channel = llm.model_runner.driver.channel
    first_segment = channel.name
    out = [o["token_ids"] for o in llm.generate(LONG_PROMPTS, SamplingParams(temperature=0, max_tokens=4),
                                                use_tqdm=False)]
    assert out == reference["long"]
    assert channel.num_grows >= 1 and channel.shm.size >= 16384 and first_segment not in os.listdir("/dev/shm")
    worker = llm.model_runner.driver.procs[0]
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(10)
    with pytest.raises(RuntimeError, match=r"tensor-parallel rank 1 .* exited with code -9"):
        llm.generate(LONG_PROMPTS[:2], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert_nothing_left(before)
    with pytest.raises(RuntimeError, match="earlier failure"):
        llm.generate([[1, 2]], use_tqdm=False)


def test_huge_message_through_every_control_plane_and_a_failing_worker_reports_its_traceback():
    before = our_shm()
    payload = os.urandom(8_000_000)                            # eight times the first segment
    for plane in ("shm", "pipe", "dist"):
        group = WorkerGroup(2, torch.device("cpu"), plane, serve_echo)
        for message in (b"small", payload, b"small again"):
            group.send(("echo", message))
            crc = torch.zeros(1, dtype=torch.int64)
            dist.all_reduce(crc)
            assert crc.item() == zlib.crc32(message), plane
        if plane == "shm":
            assert group.channel.num_grows == 1 and group.channel.shm.size == 8 << 20
        group.close()
        assert_nothing_left(before)
    bad = WorkerGroup(2, torch.device("cpu"), "shm", serve_echo, ("unexpected",))
    bad.procs[0].join(60)
    with pytest.raises(WorkerDiedError, match=r"(?s)rank 1 .*exited with code 1; its error:.*TypeError"):
        bad.send(("echo", b"x"))
    assert_nothing_left(before)


def test_two_engines_on_one_host_at_once_and_exit_without_close_leaves_nothing(ckpt, reference, tmp_path):
    """One engine here, one in another process, both serving at the same time; the other exits by an exception."""
    script = tmp_path / "other_engine.py"
    script.write_text(textwrap.dedent(f"""
        import json, sys
        from nanoengine import LLM, SamplingParams
        if __name__ == "__main__":
            llm = LLM({str(ckpt)!r}, tensor_parallel_size=2, **{ENGINE!r})
            group = llm.model_runner.driver
            print(json.dumps([group.procs[0].pid, group.channel.name]), flush=True)
            sys.stdin.readline()
            out = llm.generate({PROMPTS[:3]!r}, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
            print(json.dumps([o["token_ids"] for o in out]), flush=True)
            raise SystemExit("leaving without close()")
    """))
    before = our_shm()
    other = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        with LLM(ckpt, tensor_parallel_size=2, **ENGINE) as llm:
            other_pid, other_segment = json.loads(other.stdout.readline())
            assert process_exists(other_pid) and other_segment != llm.model_runner.driver.channel.name
            with pytest.raises(RuntimeError, match="already has a torch.distributed process group"):
                LLM(ckpt, tensor_parallel_size=2, **ENGINE)
            with LLM(ckpt, **ENGINE) as one_rank:              # built in tp_world(0, 1): never uses the group
                alongside = [o["token_ids"] for o in one_rank.generate(PROMPTS[:3], GREEDY, use_tqdm=False)]
            assert alongside == reference["cold"][:3]
            other.stdin.write("go\n")
            other.stdin.flush()
            mine = [o["token_ids"] for o in llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False)]
            theirs = json.loads(other.stdout.readline())
        assert mine == theirs == reference["cold"][:3]
        assert other.wait(60) == 1 and "leaving without close()" in other.stderr.read()
    finally:
        other.kill()
    for _ in range(50):
        if not process_exists(other_pid) and other_segment not in os.listdir("/dev/shm"):
            break
        time.sleep(0.1)
    assert not process_exists(other_pid) and other_segment not in os.listdir("/dev/shm")
    assert_nothing_left(before)


def test_rank0_killed_with_sigkill_leaves_no_worker_and_no_segment(ckpt, tmp_path):
    script = tmp_path / "crash.py"
    script.write_text(textwrap.dedent(f"""
        import json, os, signal
        from nanoengine import LLM, SamplingParams
        if __name__ == "__main__":
            llm = LLM({str(ckpt)!r}, tensor_parallel_size=2, **{ENGINE!r})
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3), use_tqdm=False)
            print(json.dumps([llm.model_runner.driver.procs[0].pid, llm.model_runner.driver.channel.name]), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    worker_pid, segment = json.loads(done.stdout)
    for _ in range(100):                                       # the worker polls its parent every POLL_SECONDS
        if not process_exists(worker_pid) and segment not in os.listdir("/dev/shm"):
            break
        time.sleep(0.1)
    assert not process_exists(worker_pid), "the orphaned worker exits by itself"
    assert segment not in os.listdir("/dev/shm"), "the resource tracker unlinks the segment"


def test_torchrun_with_the_dist_control_plane(ckpt, reference, tmp_path):
    script = tmp_path / "serve_tp.py"
    script.write_text(textwrap.dedent(f"""
        import json, os
        from nanoengine import LLM, SamplingParams
        from nanoengine.parallel.torchrun import run_worker
        if int(os.environ["RANK"]) > 0:
            run_worker()
        else:
            with LLM({str(ckpt)!r}, tensor_parallel_size=2, control_plane="dist", **{ENGINE!r}) as llm:
                out = llm.generate({PROMPTS!r}, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
            print(json.dumps([o["token_ids"] for o in out]), flush=True)
    """))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           str(free_port()), str(script)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == reference["cold"]


def test_settings_that_cannot_work_fail_before_any_process_starts(ckpt, monkeypatch):
    for tp, field in ((3, "num_attention_heads=4"), (4, "num_key_value_heads=2")):
        with pytest.raises(ValueError, match=field):
            LLM(ckpt, device="cpu", tensor_parallel_size=tp)
    with pytest.raises(ValueError, match="control_plane"):
        LLM(ckpt, device="cpu", tensor_parallel_size=2, control_plane="carrier pigeon")
    with pytest.raises(TypeError, match="control_plane"):
        LLM(ckpt, device="cpu", control_plan="shm")
    assert not multiprocessing.active_children() and not dist.is_initialized()
    with pytest.raises(RuntimeError, match="torchrun"):
        run_worker()
    for name, value in (("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "1")):
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match="rank 1 of a torchrun job"):
        LLM(ckpt, device="cpu", tensor_parallel_size=2, control_plane="dist")
    assert not dist.is_initialized()


def test_a_sequence_with_another_block_size_is_refused(ckpt):
    with LLM(ckpt, **ENGINE) as llm:
        with pytest.raises(ValueError, match="block_size"):
            llm.model_runner.run([Sequence([1, 2, 3], block_size=256)], True)
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate([[1, 2]], use_tqdm=False)


def _agreed(local_blocks: list[int]) -> int:
    return min_over_ranks(local_blocks[tp_rank()], torch.device("cpu"))


def test_all_ranks_agree_on_the_smallest_kv_pool():
    assert run_tp_workers(_agreed, 2, [100, 60], timeout=60) == [60, 60]
    assert run_tp_workers(_agreed, 2, [7, 9], timeout=60) == [7, 7]
    assert min_over_ranks(42, torch.device("cpu")) == 42       # one rank: no process group, the value itself


def test_a_segment_left_by_a_dead_process_is_removed_by_the_next_channel():
    """What a crash that also kills the resource tracker leaves behind is swept by the next engine on the host."""
    dead_pid = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                                  text=True, timeout=60).stdout)
    name = f"nanoengine-{dead_pid}-0badc0de"
    stale = SharedMemory(name=name, create=True, size=4096)
    resource_tracker.unregister(stale._name, "shared_memory")  # as if the tracker had died with its owner
    stale.close()
    mine = SharedMemory(name=f"nanoengine-{os.getpid()}-0000beef", create=True, size=4096)
    assert name in os.listdir("/dev/shm")
    channel = channels.ShmChannel(1, multiprocessing.get_context("spawn"))
    assert name not in os.listdir("/dev/shm") and mine.name in os.listdir("/dev/shm"), "live owners are left alone"
    channel.close()
    mine.close()
    mine.unlink()


def test_async_tp2_equals_synchronous_tp1_with_stop_strings_chunking_prefix_hits_and_preemption(ckpt):
    """Issue 12: with async scheduling at tp=2 the tokens reach rank 1 by a broadcast, not the host."""
    TIGHT = dict(ENGINE, num_kvcache_blocks=14)
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(ckpt, async_scheduling=False, **TIGHT) as sync1:
        first = sync1.generate(PROMPTS, plain, use_tqdm=False)
        stops = []
        for out in first:  # a stop string that ends about halfway through each completion
            pieces = [sync1.tokenizer.decode(out["token_ids"][:k], skip_special_tokens=True) for k in (8, 9)]
            stops.append(pieces[1][len(pieces[0]):].strip() or None)
        stops[1::2] = [None] * len(stops[1::2])  # the others run to max_tokens: preemption
        extras = [{}, dict(presence_penalty=1.5, repetition_penalty=1.3, logprobs=2),
                  dict(min_tokens=10, frequency_penalty=0.5)]  # counted with tokens in flight at tp=2
        params = [SamplingParams(temperature=0, max_tokens=24, stop=s, **extras[i % 3])
                  for i, s in enumerate(stops)]
        expected = [sync1.generate(PROMPTS, params, use_tqdm=False) for _ in range(2)]
        assert not any(r.planned_ahead for r in sync1.trace)
    assert sum(o["finish_reason"] == "stop" for o in expected[0]) >= 2, "stop strings ended several requests"
    with LLM(ckpt, tensor_parallel_size=2, **TIGHT) as tp2:
        assert tp2.model_runner.share_tokens
        tp2.trace.clear()
        got = [tp2.generate(PROMPTS, params, use_tqdm=False) for _ in range(2)]
        trace = list(tp2.trace)
        assert sum(r.planned_ahead for r in trace) > 0, "decode steps were planned ahead at tp=2"
        assert sum(r.num_preempted for r in trace) > 0 and any(r.is_prefill and r.num_tokens == 64 for r in trace)
        assert tp2.scheduler.block_manager.num_hit_blocks > 0
    for run_expected, run_got in zip(expected, got):
        assert [(o["token_ids"], o["finish_reason"], o["text"]) for o in run_got] == \
               [(o["token_ids"], o["finish_reason"], o["text"]) for o in run_expected]
        for a, b in zip(run_got, run_expected):
            assert (a["logprobs"] is None) == (b["logprobs"] is None)
            for x, y in zip(a["logprobs"] or [], b["logprobs"] or []):
                assert x.token_id == y.token_id and x.logprob == pytest.approx(y.logprob, abs=1e-4)
                assert [t for t, _ in x.top] == [t for t, _ in y.top]


def test_a_script_without_a_main_guard_is_told_what_to_do(ckpt, tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent(f"""
        from nanoengine import LLM
        llm = LLM({str(ckpt)!r}, tensor_parallel_size=2, device="cpu", num_kvcache_blocks=8)
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "WorkerDiedError" in proc.stderr and 'if __name__ == "__main__":' in proc.stderr, proc.stderr[-3000:]
    print(last)


def _recv_until_closed(endpoint) -> None:
    """A stand-in worker: read control messages until rank 0 goes away."""
    end = endpoint.open()
    while end.recv() is not None:
        pass


def test_shm_send_does_not_hang_when_a_waiting_worker_was_killed():
    """A worker killed while it waits for a message: rank 0's next sends write at once or raise, never hang.

    (With multiprocessing.Event, `set()` waited for the killed sleeper to acknowledge: 57 s on two H200s.)"""
    ctx = multiprocessing.get_context("spawn")
    channel = channels.ShmChannel(1, ctx)
    worker = ctx.Process(target=_recv_until_closed, args=(channel.endpoint(0),), daemon=True)
    worker.start()
    channel.send(("hello",), lambda: None, timeout=60)
    channel.send(("again",), lambda: None, timeout=60)  # returns once the worker read "hello": it is in recv()
    time.sleep(0.3)  # asleep on its ready semaphore
    worker.kill()
    worker.join(10)

    def check() -> None:
        if not worker.is_alive():
            raise RuntimeError("the worker died")

    outcome = []

    def sends() -> None:
        channel.send(("third",), check, timeout=30)  # "again" was read: this one is written at once
        outcome.append("written")
        try:
            channel.send(("fourth",), check, timeout=30)  # "third" is never read: the check must fire
        except RuntimeError as e:
            outcome.append(str(e))

    thread = threading.Thread(target=sends, daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(20)
    assert not thread.is_alive(), "send hung on a worker killed while it waited"
    assert outcome == ["written", "the worker died"] and time.monotonic() - started < 5
    channel.close()
