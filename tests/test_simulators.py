"""The book's in-page simulators (book/_static/sim/*.js) follow the rules of the Python they mirror.

Each JavaScript file exports its pure functions when `module` exists; node runs them on shared
scenarios and the answers are compared with nanoengine's own functions (torch.softmax and the
sampler's apply_top_k_top_p for the temperature race; the real Scheduler, driven by fabricated
tokens, with prefix caching off and on, for the scheduler stepper).
"""

import json
import math
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from nanoengine.engine.block_manager import check_invariants
from nanoengine.engine.cuda_graphs import bucket_for, graph_buckets
from nanoengine.engine.scheduler import Scheduler
from nanoengine.engine.sequence import Sequence
from nanoengine.layers.sampler import SamplingBatch, apply_top_k_top_p
from nanoengine.sampling_params import SamplingParams
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


PAGE_REQUESTS = [(10, 8), (22, 6), (7, 10), (16, 5)]  # notebook 03's stepper, A to D
# Scheduler stepper: pool blocks, block size, max_num_seqs, token budget, [(prompt, max_tokens)]
SCHEDULER_SCENARIOS = {
    "chunked prefill": (32, 4, 8, 16, [(10, 6), (22, 5), (7, 8), (50, 3)]),
    "preemption": (8, 4, 8, 16, [(6, 12), (5, 12), (7, 10), (4, 9)]),
    "preemption of a half-computed prompt": (9, 2, 8, 6, [(3, 10), (3, 9), (10, 4)]),
    "a pool that just fits": (3, 2, 4, 64, [(2, 5), (2, 5), (2, 5)]),
    "long prompt over the budget": (64, 8, 16, 24, [(150, 4), (9, 20), (30, 6)]),
    "max_num_seqs binds": (
        128, 4, 3, 64, [(5, 9), (8, 4), (3, 12), (6, 6), (4, 3), (7, 7), (2, 10)]
    ),
    "many small requests": (
        20, 4, 8, 32, [(2 + (7 * i) % 9, 1 + (5 * i) % 11) for i in range(20)]
    ),
    "budget of one token": (16, 4, 4, 1, [(3, 3), (2, 4), (5, 2)]),
    "max_tokens of one": (6, 2, 4, 8, [(4, 1), (7, 1), (3, 2), (1, 1)]),
    "the page's requests in a pool of 12": (12, 4, 8, 16, PAGE_REQUESTS),
}


def python_scheduler_steps(
    num_blocks: int, block_size: int, max_num_seqs: int, budget: int, requests: list,
    prefix_caching: bool = False, shared_prefix: int = 0,
) -> list[dict]:
    """Every step of the real Scheduler (made-up tokens), as the JS has it. Prompts are distinct
    except for their first `shared_prefix` tokens; with prefix caching the record also says who was
    admitted with how many cached tokens, and the pool's cache counters."""
    sch = Scheduler(
        num_blocks, block_size, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
        max_model_len=1 << 20, enable_prefix_caching=prefix_caching,
    )
    seqs = []
    for i, (prompt, max_tokens) in enumerate(requests):
        tokens = [t + 1 if t < shared_prefix else 1000 * (i + 1) + t for t in range(prompt)]
        seqs.append(Sequence(tokens, SamplingParams(max_tokens=max_tokens), block_size=block_size))
        sch.add(seqs[-1])
    index = {seq.seq_id: i for i, seq in enumerate(seqs)}
    bm, ever_preempted = sch.block_manager, set()
    steps = []
    while not sch.is_finished():
        had_blocks = {s.seq_id for s in seqs if s.block_table}
        batch = sch.schedule()
        scheduled = [
            {
                "id": index[s.seq_id], "tokens": s.num_scheduled_tokens, "prefill": s.is_prefill,
                "last": s.num_cached_tokens + s.num_scheduled_tokens == s.num_tokens,
            }
            for s in batch.seqs
        ]
        admitted = [  # given blocks by this schedule(): num_cached_tokens are the cache's hits
            {
                "id": index[s.seq_id], "cachedTokens": s.num_cached_tokens,
                "numTokens": s.num_tokens, "readmitted": s.seq_id in ever_preempted,
            }
            for s in batch.seqs if s.is_prefill and s.seq_id not in had_blocks
        ]
        ever_preempted |= {s.seq_id for s in batch.preempted}
        finished = sch.postprocess(batch, [7] * len(batch.seqs))
        check_invariants(bm, [s for s in seqs if s.block_table])
        steps.append({
            "step": batch.step,
            "scheduled": scheduled,
            "numTokens": batch.num_batched_tokens,
            "preempted": [index[s.seq_id] for s in batch.preempted],
            "finished": [index[s.seq_id] for s in finished],
            "waiting": [index[s.seq_id] for s in sch.waiting],
            "running": [index[s.seq_id] for s in sch.running],
            "freeBlocks": sch.block_manager.num_free_blocks,
            "blockTables": [list(s.block_table) for s in seqs],
            "generated": [s.num_completion_tokens for s in seqs],
        })
        if prefix_caching:
            steps[-1].update({
                "admitted": admitted,
                "cachedBlocks": sum(bm.is_cached(b) for b in bm.free_block_ids),
                "hitBlocks": bm.num_hit_blocks, "evictedBlocks": bm.num_evicted_blocks,
            })
    return steps


def js_scheduler_steps(scenarios: list) -> list:
    """The JS stepper's steps; optional scenario items 6 and 7: prefix caching, shared prefix."""
    return run_js(
        "scheduler.js",
        "m.run({numBlocks: s[0], blockSize: s[1], maxNumSeqs: s[2],"
        " maxNumBatchedTokens: s[3], prefixCaching: s[5], sharedPrefix: s[6]}, s[4])",
        scenarios,
    )


def test_scheduler_stepper_matches_python():
    names, scenarios = zip(*SCHEDULER_SCENARIOS.items())
    got = js_scheduler_steps(list(scenarios))
    for name, scenario, js in zip(names, scenarios, got):
        expected = python_scheduler_steps(*scenario)
        assert len(js) == len(expected), f"{name}: {len(js)} steps in JS, {len(expected)} in Python"
        for py_step, js_step in zip(expected, js):
            assert js_step == py_step, f"{name}, step {py_step['step']}"
    # the scenarios cover what their names promise
    steps = {name: python_scheduler_steps(*s) for name, s in SCHEDULER_SCENARIOS.items()}

    def chunked(name):
        return any(x["prefill"] and not x["last"] for st in steps[name] for x in st["scheduled"])

    def preempted(name):
        return [i for st in steps[name] for i in st["preempted"]]

    assert chunked("chunked prefill") and chunked("long prompt over the budget")
    assert preempted("preemption") and preempted("preemption of a half-computed prompt")
    half = steps["preemption of a half-computed prompt"]
    first = next(i for i, st in enumerate(half) if st["preempted"])
    victim = half[first]["preempted"][0]
    assert half[first - 1]["waiting"][0] == victim and half[first - 1]["blockTables"][victim]
    assert max(len(st["scheduled"]) for st in steps["max_num_seqs binds"]) == 3
    assert not any(preempted(n) for n in ("chunked prefill", "max_num_seqs binds"))


def test_scheduler_stepper_refuses_what_python_refuses():
    bad = [
        (4, 4, 8, 16, [(10, 8)]),  # needs 5 blocks of 4, the pool has 4
        (8, 3, 8, 16, [(4, 4)]),  # block size not a power of two
        (8, 4, 0, 16, [(4, 4)]),
        (8, 4, 8, 0, [(4, 4)]),
    ]
    for scenario, js in zip(bad, js_scheduler_steps(bad)):
        assert "error" in js, scenario
        with pytest.raises(ValueError):
            python_scheduler_steps(*scenario)
    js = run_js("scheduler.js", "m.parseRequests(s)", ["10:8, 22 : 6,", "10-8"])
    assert js[0] == [[10, 8], [22, 6]] and "error" in js[1]


def test_scheduler_stepper_page_claims():
    """What notebook 03 tells the reader to look for in the stepper (defaults: 24 blocks of 4)."""
    default = python_scheduler_steps(24, 4, 8, 16, PAGE_REQUESTS)
    assert not any(st["preempted"] for st in default)
    chunks_of_b = [
        x["tokens"] for st in default for x in st["scheduled"] if x["id"] == 1 and x["prefill"]
    ]
    assert chunks_of_b == [6, 15, 1]
    small = python_scheduler_steps(16, 4, 8, 16, PAGE_REQUESTS)
    assert [(st["step"], st["preempted"]) for st in small if st["preempted"]] == [(5, [3])]
    a_b_done = max(st["step"] for st in small if set(st["finished"]) & {0, 1})
    back = [
        (st["step"], x["tokens"])
        for st in small if st["step"] > 5
        for x in st["scheduled"] if x["id"] == 3 and x["prefill"]
    ]
    assert back[0][0] == a_b_done + 1 and [t for _, t in back] == [15, 2]  # 16 + 1 tokens
    assert js_scheduler_steps([(24, 4, 8, 16, PAGE_REQUESTS), (16, 4, 8, 16, PAGE_REQUESTS)]) == [
        default, small
    ]


# --- the scheduler stepper with prefix caching ------------------------------------------------

# pool blocks, block size, max_num_seqs, token budget, [(prompt, max_tokens)], prefix caching,
# shared prefix
CACHING_SCENARIOS = {
    **{f"{name}, caching on": (*s, True, 0) for name, s in SCHEDULER_SCENARIOS.items()},
    "the page's requests in a pool of 11": (11, 4, 8, 16, PAGE_REQUESTS, True, 0),
    "a shared system prompt": (24, 4, 8, 16, PAGE_REQUESTS, True, 8),
    "a shared prefix and preemptions": (
        16, 4, 8, 16, [(12, 6), (14, 5), (9, 8), (20, 4), (12, 3)], True, 9
    ),
    "identical prompts": (12, 4, 4, 8, [(8, 3), (8, 3), (8, 3), (11, 2)], True, 11),
    "many small requests, a shared prefix": (
        20, 2, 8, 32, [(2 + (7 * i) % 9, 1 + (5 * i) % 11) for i in range(20)], True, 5
    ),
    "budget of one token, a shared prefix": (16, 4, 4, 1, [(9, 3), (9, 2), (6, 2)], True, 6),
}
PRESET_SCENARIO = (10, 4, 8, 16, PAGE_REQUESTS, True, 0)  # scheduler.js's PRESET


def prefill_tokens(steps: list[dict], seq_id: int | None = None, after: int = 0) -> int:
    """Prompt tokens computed (of one sequence, or of all) in the steps after step `after`."""
    return sum(
        x["tokens"] for st in steps if st["step"] > after for x in st["scheduled"]
        if x["prefill"] and seq_id in (None, x["id"])
    )


def test_scheduler_stepper_with_prefix_caching_matches_python():
    names, scenarios = zip(*CACHING_SCENARIOS.items())
    got = js_scheduler_steps(list(scenarios))
    steps = {}
    for name, scenario, js in zip(names, scenarios, got):
        steps[name] = expected = python_scheduler_steps(*scenario)
        assert len(js) == len(expected), f"{name}: {len(js)} steps in JS, {len(expected)} in Python"
        for py_step, js_step in zip(expected, js):
            assert js_step == py_step, f"{name}, step {py_step['step']}"
    # together the scenarios exercise every part of the cache
    admissions = [a for s in steps.values() for st in s for a in st["admitted"]]
    assert any(a["readmitted"] and a["cachedTokens"] for a in admissions), "re-admission hits"
    assert any(a["readmitted"] and not a["cachedTokens"] for a in admissions), "all evicted"
    assert any(not a["readmitted"] and a["cachedTokens"] for a in admissions), "shared-prefix hits"
    assert any(st["evictedBlocks"] for s in steps.values() for st in s), "evictions"
    shared_block = any(
        len(b) != len(set(b))
        for s in steps.values() for st in s
        for b in [[blk for table in st["blockTables"] for blk in table]]
    )
    assert shared_block, "a block held by two sequences at once"


def test_scheduler_stepper_caching_off_ignores_the_prompts():
    """Without prefix caching the stepper is what it was: same records, whatever the tokens are."""
    plain = [s for s in SCHEDULER_SCENARIOS.values()]
    off = [(*s, False, 8) for s in plain]
    got_plain, got_off = js_scheduler_steps(plain), js_scheduler_steps(off)
    assert got_off == got_plain
    assert got_off[-1] == python_scheduler_steps(*off[-1])
    assert all("admitted" not in st for steps in got_off for st in steps)


def test_preset_readmits_a_preempted_sequence_from_the_cache():
    on, off = run_js(
        "scheduler.js",
        "(p => m.run({numBlocks: p.num_blocks, blockSize: p.block_size, maxNumSeqs: p.max_num_seqs,"
        " maxNumBatchedTokens: p.budget, prefixCaching: s, sharedPrefix: p.shared_prefix},"
        " m.parseRequests(p.requests)))(m.PRESET)",
        [True, False],
    )
    assert on == python_scheduler_steps(*PRESET_SCENARIO)
    assert off == python_scheduler_steps(*PRESET_SCENARIO[:5])
    first = next(st for st in on if st["preempted"])
    victim = first["preempted"][0]
    back = next(
        (st, a) for st in on for a in st["admitted"] if a["id"] == victim and a["readmitted"]
    )
    readmitted_at, admission = back
    # within a few steps, with cached tokens, and only the rest recomputed
    assert first["step"] <= 6 and readmitted_at["step"] - first["step"] <= 3
    assert 0 < admission["cachedTokens"] < admission["numTokens"]
    assert prefill_tokens(on, victim, after=first["step"]) == (
        admission["numTokens"] - admission["cachedTokens"]
    )
    # without caching the same preemption happens and the victim recomputes all its tokens
    assert next(st for st in off if st["preempted"])["preempted"] == [victim]
    assert prefill_tokens(off, victim, after=first["step"]) == admission["numTokens"]
    assert prefill_tokens(on) < prefill_tokens(off)
    # what the page says: B preempted at step 6, back at step 9 with 20 of its 25 tokens cached
    assert (first["step"], victim, readmitted_at["step"]) == (6, 1, 9)
    assert (admission["cachedTokens"], admission["numTokens"]) == (20, 25)
    assert (prefill_tokens(on), prefill_tokens(off), len(on), len(off)) == (60, 80, 18, 19)
    # in the page's 16-block run with caching on, all of D's blocks are reused before it returns
    small = python_scheduler_steps(16, 4, 8, 16, PAGE_REQUESTS, True)
    returns = [a for st in small for a in st["admitted"] if a["readmitted"]]
    assert returns == [{"id": 3, "cachedTokens": 0, "numTokens": 17, "readmitted": True}]


def test_the_last_block_is_always_recomputed():
    """Identical 8-token prompts in blocks of 4: B finds A's first block only, never its last."""
    scenario = (8, 4, 4, 8, [(8, 2), (8, 2)], True, 8)
    (js,) = js_scheduler_steps([scenario])
    assert js == python_scheduler_steps(*scenario)
    assert js[1]["admitted"] == [
        {"id": 1, "cachedTokens": 4, "numTokens": 8, "readmitted": False}
    ]
    assert prefill_tokens(js, 1) == 4
    hashes = run_js(
        "scheduler.js", "[m.hashBlock(s, null), m.hashBlock(s, m.hashBlock([9, 9], null))]",
        [[1, 2, 3, 4]],
    )[0]
    assert hashes[0] != hashes[1], "chained: the same tokens after another prefix hash differently"


def test_shared_prefix_page_claim():
    """Chapter 03: the defaults with caching on and an 8-token shared prefix. At step 3 C and D
    start from the cache; C's 7-token prompt is all shared, yet its last block is recomputed."""
    (js,) = js_scheduler_steps([(24, 4, 8, 16, PAGE_REQUESTS, True, 8)])
    assert js == python_scheduler_steps(24, 4, 8, 16, PAGE_REQUESTS, True, 8)
    assert [(a["id"], a["cachedTokens"], a["numTokens"]) for a in js[2]["admitted"]] == [
        (2, 4, 7), (3, 8, 16)
    ]
    (off,) = js_scheduler_steps([(24, 4, 8, 16, PAGE_REQUESTS)])
    assert prefill_tokens(js) < prefill_tokens(off)


# --- the temperature race with top-k and top-p ----------------------------------------------------

CHAPTER_06_LOGITS = [4.2, 3.6, 3.1, 2.9, 2.5, 2.2, 2.0, 1.8, 1.7, 1.5, 1.2, 1.0, 0.9, 0.6, 0.4, 0.2,
                     0.0, -0.3, -0.8, -2.0]
FILTER_SCENARIOS = [
    (logits, t, k, p)
    for logits in LOGITS + [CHAPTER_06_LOGITS, [1.0, 3.0, 3.0, 2.0, 3.0]]
    for t in (0.0, 0.5, 1.0, 2.0)
    for k in (0, 1, 2, 3, 5, 50)  # 0: off (the page's slider at its left end)
    for p in (1.0, 0.95, 0.8, 0.5, 0.2, 0.01)
]


def engine_distribution(logits: list[float], t: float, k: int, p: float):
    """(kept mask, probabilities) from the engine's own apply_top_k_top_p, in float64."""
    x = torch.tensor(logits, dtype=torch.float64)
    if t == 0:  # a greedy row: the sampler takes the argmax and switches both filters off
        one_hot = torch.nn.functional.one_hot(x.argmax(), len(logits)).double()
        return [bool(v) for v in one_hot], one_hot
    batch = SamplingBatch(
        1, torch.tensor([t]), top_ks=torch.tensor([k]) if k > 0 else None,
        top_ps=torch.tensor([p], dtype=torch.float64) if p < 1 else None, max_top_k=max(k, 0),
        all_greedy=False, any_greedy=False, any_top_k=k > 0, any_top_p=p < 1,
    )
    filtered = apply_top_k_top_p((x / t).unsqueeze(0), batch)[0]
    return (filtered > float("-inf")).tolist(), torch.softmax(filtered, -1)


def test_top_k_top_p_match_the_engine():
    got = run_js("temperature.js", "m.distribution(s[0], s[1], s[2], s[3])", FILTER_SCENARIOS)
    for scenario, js in zip(FILTER_SCENARIOS, got):
        kept, probs = engine_distribution(*scenario)
        assert js["kept"] == kept, scenario
        js_probs = torch.tensor(js["probs"], dtype=torch.float64)
        assert torch.allclose(js_probs, probs, rtol=0, atol=1e-12), scenario
        before = torch.tensor(js["before"], dtype=torch.float64)
        assert torch.allclose(before, engine_distribution(*scenario[:2], 0, 1.0)[1], atol=1e-12)
    # the scenarios cut everywhere: the top token alone, a few, all, and top-p alone in between
    assert {1, 2, 3, 5, 20} <= {sum(js["kept"]) for js in got}
    assert any(
        s[2] == 0 and s[3] < 1 and 1 < sum(js["kept"]) < len(s[0])
        for s, js in zip(FILTER_SCENARIOS, got)
    )


def test_top_k_top_p_rules():
    cases = {  # name: (logits, temperature, top_k, top_p)
        "top-k 1": ([2.0, 1.0, 0.5, -1.0, 3.0], 1.0, 1, 1.0),
        "top-k 1, hot": (CHAPTER_06_LOGITS, 2.0, 1, 1.0),
        "top-p small": (CHAPTER_06_LOGITS, 1.0, 0, 0.01),
        "top-p small, hot": (CHAPTER_06_LOGITS, 2.0, 0, 0.05),
        "crossing token kept": ([math.log(0.5), math.log(0.3), math.log(0.2)], 1.0, 0, 0.6),
        "top-p after top-k": ([math.log(0.5), math.log(0.3), math.log(0.2)], 1.0, 2, 0.6),
        "ties at the cut": ([1.0, 3.0, 3.0, 2.0, 3.0], 1.0, 1, 1.0),
        "both off": (CHAPTER_06_LOGITS, 0.5, 0, 1.0),
    }
    got = dict(zip(cases, run_js(
        "temperature.js", "m.distribution(s[0], s[1], s[2], s[3])", list(cases.values())
    )))
    for name in ("top-k 1", "top-k 1, hot", "top-p small", "top-p small, hot"):
        logits = cases[name][0]
        argmax = logits.index(max(logits))
        assert [i for i, k in enumerate(got[name]["kept"]) if k] == [argmax], name
        assert got[name]["probs"][argmax] == 1.0, name
    # top-p keeps the token whose probability carries the mass past top_p: 0.5 < 0.6, so 0.3 stays
    assert got["crossing token kept"]["kept"] == [True, True, False]
    assert got["crossing token kept"]["probs"] == pytest.approx([0.625, 0.375, 0.0], abs=1e-12)
    # top-p runs on the top-k survivors renormalised (0.625, 0.375): 0.625 alone reaches 0.6
    assert got["top-p after top-k"]["kept"] == [True, False, False]
    assert got["ties at the cut"]["kept"] == [False, True, True, False, True]
    expected = torch.softmax(torch.tensor(CHAPTER_06_LOGITS, dtype=torch.float64) / 0.5, -1)
    assert all(got["both off"]["kept"])
    assert torch.allclose(torch.tensor(got["both off"]["probs"], dtype=torch.float64), expected)
    # what chapter 06 tells the reader to try
    claims = run_js("temperature.js", "m.distribution(s[0], s[1], s[2], s[3])", [
        (CHAPTER_06_LOGITS, 1.0, 5, 0.8), (CHAPTER_06_LOGITS, 1.0, 0, 0.5),
    ])
    assert [[i for i, k in enumerate(c["kept"]) if k] for c in claims] == [[0, 1, 2], [0, 1]]
    assert [round(100 * p, 1) for p in claims[0]["probs"][:3]] == [53.1, 29.2, 17.7]
    assert [round(100 * p, 1) for p in claims[0]["before"][:2]] == [32.8, 18.0]
    bad = run_js("temperature.js", "m.distribution([1, 2], 1, 0, s)", [0.0, 1.5])
    assert all("error" in b for b in bad), "top-p outside (0, 1], as SamplingParams refuses"
