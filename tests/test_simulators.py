"""The book's in-page simulators (book/_static/sim/*.js) follow the rules of the Python they mirror.

Each JavaScript file exports its pure functions when `module` exists; node runs them on shared
scenarios and the answers are compared with nanoengine's own functions (and torch.softmax for the
temperature race).
"""

import json
import math
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from nanoengine.engine.cuda_graphs import bucket_for, graph_buckets
from nanoengine.utils.memory import kv_cache_bytes_per_token, plan_kv_pool

SIM = Path(__file__).resolve().parents[1] / "book" / "_static" / "sim"
GiB = 2**30

pytestmark = pytest.mark.skipif(
    shutil.which("node") is None, reason="node is not on PATH: the JS simulators cannot run"
)


def run_js(file: str, body: str, scenarios: list) -> list:
    """Evaluate `body` (JS over `m`, the module, and `s`, a scenario) on every scenario in node."""
    script = (
        f"const m = require({json.dumps(str(SIM / file))});"
        f"const scenarios = {json.dumps(scenarios)};"
        "console.log(JSON.stringify(scenarios.map(s => { try { return " + body + "; }"
        " catch (e) { return {error: e.message}; } })));"
    )
    proc = subprocess.run(["node", "-e", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


class HFConfig:
    def __init__(self, layers: int, kv_heads: int, head_dim: int):
        self.num_hidden_layers, self.num_attention_heads = layers, 2 * kv_heads
        self.num_key_value_heads, self.head_dim = kv_heads, head_dim


# layers, KV heads, head dim, dtype bytes, tp, GPU GiB, weights GiB, utilization, context
KV_SCENARIOS = [
    (28, 8, 128, 2, 1, 80, 1.4, 0.9, 4096),
    (28, 8, 128, 2, 2, 80, 1.4, 0.9, 4096),
    (36, 8, 128, 2, 1, 24, 15.3, 0.9, 4096),
    (36, 8, 128, 1, 4, 141, 8, 0.95, 32768),
    (36, 8, 128, 4, 8, 48, 2.5, 0.5, 1024),
    (28, 8, 128, 2, 1, 24, 22, 0.9, 4096),
    (32, 32, 128, 2, 1, 80, 13.5, 0.9, 4096),
    (80, 8, 128, 2, 8, 141, 17.5, 0.92, 8192),
    (1, 1, 64, 2, 1, 8, 0, 1.0, 1),
    (28, 8, 128, 2, 3, 80, 1.4, 0.9, 4096),
    (24, 4, 64, 2, 1, 16.5, 0.75, 0.85, 2000),
    (28, 8, 128, 2, 1, 8, 9, 0.9, 4096),
]


def python_kv(
    layers, kv_heads, head_dim, dtype_bytes, tp, gpu_gib, weights_gib, utilization, context
):
    try:
        bpt = kv_cache_bytes_per_token(HFConfig(layers, kv_heads, head_dim), dtype_bytes, tp)
        plan = plan_kv_pool(
            math.floor(gpu_gib * GiB),
            math.floor(weights_gib * GiB),
            0,
            utilization,
            bpt,
            256,
            context,
        )
    except ValueError:
        return "error"
    return [bpt, plan.num_blocks, plan.num_tokens, plan.kv_bytes, plan.num_max_len_seqs]


def test_kv_pool_matches_python():
    got = run_js(
        "kv_pool.js",
        "(b => { const p = m.planKVPool(Math.floor(s[5] * 2 ** 30),"
        " Math.floor(s[6] * 2 ** 30), 0, s[7], b, 256, s[8]);"
        " return [b, p.numBlocks, p.numTokens, p.kvBytes, p.numMaxLenSeqs]; })"
        "(m.bytesPerToken(s[0], s[1], s[2], s[3], s[4]))",
        KV_SCENARIOS,
    )
    expected = [python_kv(*s) for s in KV_SCENARIOS]
    got = ["error" if isinstance(g, dict) else g for g in got]
    assert got == expected
    assert sum(e == "error" for e in expected) == 2  # tp=3 and does-not-fit: errors in both


BUCKET_SCENARIOS = [
    (m, n)
    for m in (1, 3, 8, 15, 16, 17, 64, 100, 256, 512)
    for n in (0, 1, 2, 3, 5, 9, 16, 17, 33, 99, 100, 101, 255, 256, 257, 512)
]


def test_graph_buckets_match_python():
    got_buckets = run_js(
        "graph_buckets.js", "m.graphBuckets(s)", sorted({m for m, _ in BUCKET_SCENARIOS})
    )
    assert got_buckets == [graph_buckets(m) for m in sorted({m for m, _ in BUCKET_SCENARIOS})]
    got = run_js("graph_buckets.js", "m.bucketFor(m.graphBuckets(s[0]), s[1])", BUCKET_SCENARIOS)

    def python(m: int, n: int):
        try:
            return bucket_for(graph_buckets(m), n)
        except ValueError:
            return "error"

    assert ["error" if isinstance(g, dict) else g for g in got] == [
        python(m, n) for m, n in BUCKET_SCENARIOS
    ]


LOGITS = [
    [2.0, 1.0, 0.5, -1.0, 3.0],
    [0.0, 0.0, 0.0],
    [5.0, 5.0, 1.0],
    [10.0, -10.0, 3.5, 3.4, 0.1, -2.0],
    [100.0, 99.0, 50.0],
]
TEMPERATURES = [0.0, 0.05, 0.5, 1.0, 1.5, 3.0]
TEMP_SCENARIOS = [(logits, t) for logits in LOGITS for t in TEMPERATURES]


def test_temperature_race_matches_torch():
    got = run_js("temperature.js", "[m.probabilities(s[0], s[1]), m.greedy(s[0])]", TEMP_SCENARIOS)
    for (logits, t), (probs, pick) in zip(TEMP_SCENARIOS, got):
        x = torch.tensor(logits, dtype=torch.float64)
        assert pick == int(x.argmax())
        expected = (
            torch.nn.functional.one_hot(x.argmax(), len(logits)).double()
            if t == 0
            else torch.softmax(x / t, -1)
        )
        assert torch.allclose(
            torch.tensor(probs, dtype=torch.float64), expected, rtol=0, atol=1e-12
        ), (logits, t)
