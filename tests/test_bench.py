"""The benchmark harness on CPU: the workload is nano-vllm's exactly, and the command line works."""
import json
import subprocess
import sys

import pytest

from nanoengine.bench import ABLATIONS, BENCH_OUTPUT_TOKENS, BENCH_PROMPT_TOKENS, bench_workload, provenance


def test_workload_reproduces_nano_vllm_exactly():
    prompts, params = bench_workload()
    assert len(prompts) == len(params) == 256
    assert sum(map(len, prompts)) == BENCH_PROMPT_TOKENS == 142_827
    assert sum(p.max_tokens for p in params) == BENCH_OUTPUT_TOKENS == 133_966
    assert all(100 <= len(p) <= 1024 and all(0 <= t <= 10000 for t in p) for p in prompts)
    assert all(p.temperature == 0.6 and p.ignore_eos for p in params)


def test_help_and_provenance():
    done = subprocess.run([sys.executable, "-m", "nanoengine.bench", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "--throughput" in done.stdout and "--ablations" in done.stdout
    info = provenance()
    assert {"date", "torch", "gpu", "commit", "flash_attn", "triton"} <= set(info)
    assert provenance("0123abc")["commit"] == "0123abc"  # --commit, where git cannot tell


def test_a_scaled_down_run_on_cpu(tmp_path):
    out = tmp_path / "r.json"
    engine = {"device": "cpu", "kvcache_block_size": 16, "max_model_len": 1024}
    done = subprocess.run([sys.executable, "-m", "nanoengine.bench", "--preset", "tiny", "--throughput",
                           "--num-seqs", "4", "--max-input-len", "110", "--max-output-len", "104",
                           "--engine-json", json.dumps(engine), "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(out.read_text())
    expected = sum(p.max_tokens for p in bench_workload(4, 110, 104)[1])
    assert results["throughput"]["output_tokens"] == expected and results["throughput"]["output_tok_per_s"] > 0
    assert results["engine_info"]["attention_backend"] == "TorchBackend"
    # on a CPU the engine compiles nothing (torch.compile serves CUDA inputs), least of all inside the timing
    assert results["throughput"]["compiled_in_run"] == {"triton": {}, "torch_compile_graphs": 0}
    run = results["throughput"]
    assert len(run["prefill_step_ms"]) == run["prefill_steps"] > 0 and run["allocator_segments_added"] == 0
    assert 0 <= run["outside_steps_seconds"] < run["seconds"]
    # the host's time to queue each step (on a CPU the step runs inside its launch)
    assert len(run["prefill_launch_ms"]) == run["prefill_steps"] and min(run["prefill_launch_ms"]) > 0
    assert 0 < run["decode_launch_ms_median"] < 1000 * run["decode_seconds"]


def test_latency_reports_the_launch_time_of_its_decode_steps(tmp_path):
    from nanoengine import LLM
    from nanoengine.bench import measure_latency
    from nanoengine.models.checkpoint import write_random_checkpoint

    ckpt = write_random_checkpoint(tmp_path / "tiny", "tiny", seed=0)
    with LLM(ckpt, device="cpu", kvcache_block_size=16, num_kvcache_blocks=16, max_model_len=128) as llm:
        r = measure_latency(llm, prompt_len=8, extra_tokens=6, repeats=2)
        decode = [s.launch_seconds for s in llm.trace if not s.is_prefill]
    assert r["ms_per_token"] > 0 and r["compiled_in_run"] == {"triton": {}, "torch_compile_graphs": 0}
    assert len(decode) >= 2 * 6 and 0 < r["launch_ms_median"] <= 1000 * max(decode)  # two timed runs of 6


# --- the host-only mode: scheduler, block manager and input packing without a model --------------------------------

def test_host_only_reproduces_the_full_workload_and_the_gpu_runs_schedule():
    from nanoengine.bench import measure_host

    r = measure_host(repeats=1)
    assert r["output_tokens"] == BENCH_OUTPUT_TOKENS == 133_966
    # benchmarks/h200.json: the engine on one H200 (its pool of H200_NUM_KV_BLOCKS) ran 9 prefill and 1,023 decode steps
    assert (r["prefill"]["steps"], r["decode"]["steps"], r["preemptions"]) == (9, 1023, 0)
    for kind in ("prefill", "decode"):
        phases = sum(r[kind][f"{p}_us"] for p in ("schedule", "prepare", "sample", "postprocess"))
        assert r[kind]["us_per_step"] > 0 and abs(r[kind]["us_per_step"] - phases) < 1e-6


def test_the_host_only_pool_is_the_h200_runs():
    from pathlib import Path

    from nanoengine.bench import H200_NUM_KV_BLOCKS

    h200 = json.loads((Path(__file__).parents[1] / "benchmarks" / "h200.json").read_text())
    assert H200_NUM_KV_BLOCKS == h200["engine_info"]["num_kvcache_blocks"]
    steps = (h200["throughput"]["prefill_steps"], h200["throughput"]["decode_steps"], h200["throughput"]["preemptions"])
    assert steps == (9, 1023, 0)  # the schedule the host-only run reproduces


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_host_only_takes_the_steps_a_real_cpu_engine_takes(tmp_path, async_scheduling):
    from nanoengine import LLM
    from nanoengine.bench import ensure_checkpoint, host_steps, host_workload

    sizes = (6, 110, 104)
    settings = {"kvcache_block_size": 16, "num_kvcache_blocks": 30, "max_num_batched_tokens": 128,
                "max_model_len": 1024}  # small: prompts are chunked and requests preempted
    scheduler, runner, seqs = host_workload(*sizes, **settings)
    steps = list(host_steps(scheduler, runner))
    llm = LLM(ensure_checkpoint("tiny", tmp_path / "tiny"), device="cpu", async_scheduling=async_scheduling,
              **settings)
    prompts, params = bench_workload(*sizes)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    trace = list(llm.trace)
    assert [len(o["token_ids"]) for o in outputs] == [s.num_completion_tokens for s in seqs]
    assert [(s.is_prefill, s.num_seqs, s.num_preempted) for s in steps] == [
        (r.is_prefill, r.num_seqs, r.num_preempted) for r in trace
    ]
    assert sum(s.num_preempted for s in steps) > 0 and sum(s.is_prefill for s in steps) > len(prompts)
    llm.close()


def test_host_only_on_the_command_line(tmp_path):
    out = tmp_path / "host.json"
    engine = {"kvcache_block_size": 16, "max_model_len": 1024}
    done = subprocess.run([sys.executable, "-m", "nanoengine.bench", "--host-only", "--repeats", "2",
                           "--num-seqs", "4", "--max-input-len", "110", "--max-output-len", "104",
                           "--engine-json", json.dumps(engine), "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    host = json.loads(out.read_text())["host_only"]
    assert host["repeats"] == 2 and host["output_tokens"] == sum(p.max_tokens for p in bench_workload(4, 110, 104)[1])
    assert "decode:" in done.stdout and "model" not in json.loads(out.read_text())


def test_the_ladder_runs_the_reference_backend_only_when_named_and_refuses_unknown_rungs(tmp_path, monkeypatch):
    import nanoengine.bench as bench

    def not_run(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, "", "not run")

    monkeypatch.setattr(bench.subprocess, "run", not_run)
    assert list(bench.run_ablations(tmp_path, tmp_path)) == [n for n in bench.ABLATIONS if n not in
                                                               bench.ONLY_WHEN_NAMED]
    assert bench.run_ablations(tmp_path, tmp_path, ["torch attention"])["torch attention"]["error"] == "not run"
    with pytest.raises(ValueError, match="unknown ablation rung"):
        bench.run_ablations(tmp_path, tmp_path, ["no such rung"])


# --- the ladder: each rung an engine configuration, reaching its fresh process by name -----------------------------

@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    from nanoengine.bench import ensure_checkpoint

    return ensure_checkpoint("tiny", tmp_path_factory.mktemp("tiny"))


@pytest.mark.parametrize("rung", ABLATIONS)
def test_every_rung_is_a_valid_engine_configuration(tiny_checkpoint, rung):
    import dataclasses
    import inspect

    from nanoengine.bench import engine_settings
    from nanoengine.config import Config, Optimizations
    from nanoengine.engine.llm_engine import LLMEngine

    settings = engine_settings({"device": "cpu", "max_model_len": 1024}, rung)
    arguments = set(inspect.signature(LLMEngine.__init__).parameters) - {"self", "model"}
    assert set(settings) <= arguments, f"{rung}: not arguments of the engine"
    fields = {f.name for f in dataclasses.fields(Config)} - {"model", "hf_config"}
    config = Config(tiny_checkpoint, **{k: v for k, v in settings.items() if k in fields})
    assert isinstance(config.optimizations, Optimizations)
    engine_only = {k: v for k, v in settings.items() if k not in fields}
    assert engine_only in ({}, {"async_scheduling": False})
    switched = len(config.optimizations.off()) + (not config.enable_prefix_caching) + config.enforce_eager
    adds = ("all optimisations", "torch attention", "fp8 KV cache")  # rungs that switch nothing off
    assert switched + len(engine_only) == (rung not in adds)
    assert (config.kv_cache_dtype == "fp8") == (rung == "fp8 KV cache")


def test_a_rung_builds_its_engine(tiny_checkpoint):
    from nanoengine import LLM
    from nanoengine.bench import engine_settings

    llm = LLM(tiny_checkpoint, **engine_settings({"device": "cpu", "max_model_len": 256}, "no Triton GEMV"))
    assert llm.config.optimizations.off() == ["triton_gemv"]  # built, the workload not run
    llm.close()


def test_the_ladder_covers_every_optimisation():
    from nanoengine.bench import ABLATIONS
    from nanoengine.config import Optimizations

    off = [f for r in ABLATIONS.values() if "optimizations" in r for f in r["optimizations"].off()]
    assert sorted(off) == sorted(Optimizations.__dataclass_fields__)
    assert "no one-copy decode inputs" not in ABLATIONS  # history: its numbers stay in h200.json


def test_a_rung_reaches_its_child_by_name_only(tmp_path, monkeypatch):
    import inspect

    import nanoengine.bench as bench

    calls = []

    def not_run(cmd, **kwargs):
        calls.append((cmd, kwargs))
        return subprocess.CompletedProcess(cmd, 1, "", "not run")

    monkeypatch.setattr(bench.subprocess, "run", not_run)
    bench.run_ablations(tmp_path, tmp_path, ["no Triton GEMV", "no CUDA graphs"], device="cpu")
    for (cmd, kwargs), name in zip(calls, ["no Triton GEMV", "no CUDA graphs"]):
        assert "env" not in kwargs  # the child inherits this process's environment, unchanged
        assert cmd[cmd.index("--rung") + 1] == name and not any("NANOENGINE_" in part for part in cmd)
        assert json.loads(cmd[cmd.index("--engine-json") + 1]) == {"device": "cpu"}
        args = bench._parser().parse_args(cmd[3:])
        assert args.rung == name and args.throughput and args.latency
    assert "NANOENGINE_" not in inspect.getsource(bench)  # no environment variable chooses a path


def test_engine_json_optimizations_combine_with_a_rung():
    from nanoengine.bench import engine_settings
    from nanoengine.config import Optimizations

    run = {"optimizations": {"fused_prologues": False}}
    assert engine_settings(run)["optimizations"] == Optimizations(fused_prologues=False)
    both = engine_settings(run, "no fused RoPE + store")["optimizations"]
    assert both == Optimizations(fused_prologues=False, fused_rope_store=False)
    with pytest.raises(TypeError, match="no_such"):
        engine_settings({"optimizations": {"no_such": False}})
