"""The benchmark harness on CPU: the workload is nano-vllm's exactly, and the command line works."""
import json
import subprocess
import sys

from nanoengine.bench import BENCH_OUTPUT_TOKENS, BENCH_PROMPT_TOKENS, bench_workload, provenance


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
