"""Every Triton kernel (KV store, GEMV, fused GEMV, the unfused prologues, paged decode with its combine, QK-norm + RoPE + store, the one-pass sampler, the prompt step's key gather), run by Triton's CPU interpreter, at each end of the triton range pyproject.toml declares.

The upper end is whatever `pip install` picked (the newest allowed); the lower end is installed by `make test` into
.triton-low/ (or found on the device machine, whose image has it). A kernel line that one end cannot interpret
fails here instead of on a reader's machine.

The interpreter does not compile: it runs a kernel line by line in NumPy, and accepts code that Triton's compiler
rejects (a runtime `if` whose branches leave a variable in two dtypes, for one). So every kernel is also compiled for a
Hopper GPU (sm_90) on this CPU, at both ends of the range, from the arguments its launcher passes: a kernel that
would fail to compile on the GPU fails here, before any device time is spent on it."""
import ast
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LOW_DIR = ROOT / ".triton-low"

CHECK = r'''
import torch
import torch.nn.functional as F
import triton
from nanoengine.kernels.gemv import gemv
from nanoengine.kernels.kv_store import store_kv_torch, store_kv_triton
from nanoengine.kernels.paged_decode import paged_decode
from nanoengine.kernels.fused import fused_gemv
from nanoengine.layers.layernorm import add_rms_norm
from nanoengine.layers.activation import silu_and_mul
from nanoengine.layers.paged_attention import TorchBackend
from nanoengine.utils.context import Context
for m, n, k, bias in [(1, 40, 700, True), (3, 33, 1030, False), (4, 64, 512, True), (2, 5, 17, False)]:
    g = torch.Generator().manual_seed(m * n)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    torch.testing.assert_close(gemv(x, w, b), F.linear(x, w, b), atol=1e-4, rtol=1e-4)
for n, h, d, blocks, bs in [(6, 2, 8, 5, 4), (9, 3, 12, 4, 8), (1, 1, 4, 1, 1)]:
    g = torch.Generator().manual_seed(n)
    key, value = torch.randn(n, h, d, generator=g), torch.randn(n, h, d, generator=g)
    slots = torch.randperm(blocks * bs, generator=g)[:n]
    slots[0] = -1 if n > 1 else slots[0]
    caches = [torch.zeros(blocks, bs, h, d) for _ in range(4)]
    store_kv_triton(key, value, caches[0], caches[1], slots)
    store_kv_torch(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
for lens, width, bs in [([5, 37, 0], 4, 16), ([700, 3], 8, 128), ([3] * 300, 1, 16)]:
    g = torch.Generator().manual_seed(len(lens))
    caches = [torch.randn(len(lens) * width + 1, bs, 2, 16, generator=g) for _ in range(2)]
    tables = (torch.randperm(len(lens) * width, generator=g) + 1).int().view(len(lens), width)
    q, ctx_lens = torch.randn(len(lens), 4, 16, generator=g), torch.tensor(lens, dtype=torch.int32)
    want = TorchBackend().decode(q, *caches, Context(context_lens=ctx_lens, block_tables=tables), 0.25)
    torch.testing.assert_close(paged_decode(q, *caches, tables, ctx_lens, 0.25), want, atol=1e-5, rtol=1e-5)
for m, n, k in [(1, 40, 96), (3, 33, 100)]:
    g = torch.Generator().manual_seed(m)
    x, r, w, nw = (torch.randn(m, k, generator=g), torch.randn(m, k, generator=g),
                   torch.randn(n, k, generator=g), torch.rand(k, generator=g) + 0.5)
    y, res = fused_gemv(x, w, prologue="add_norm", residual=r, norm_weight=nw)
    h, want = add_rms_norm(x, r, nw, 1e-6)
    torch.testing.assert_close(y, F.linear(h, w), atol=1e-4, rtol=1e-4)
    assert torch.equal(res, want)
    gu = torch.randn(m, 2 * k, generator=g)
    torch.testing.assert_close(fused_gemv(gu, w, prologue="silu")[0], F.linear(silu_and_mul(gu), w),
                               atol=1e-4, rtol=1e-4)
from nanoengine.kernels.fused import add_rms_norm_triton, silu_and_mul_triton
for m, k in [(3, 100), (1, 64)]:
    g = torch.Generator().manual_seed(k)
    x, r, nw = torch.randn(m, k, generator=g), torch.randn(m, k, generator=g), torch.rand(k, generator=g)
    y, res = add_rms_norm_triton(x, r, nw, 1e-6)
    h, want = add_rms_norm(x, r, nw, 1e-6)
    torch.testing.assert_close(y, h, atol=1e-5, rtol=1e-5)
    assert torch.equal(res, want)
    gu = torch.randn(m, 2 * k, generator=g)
    torch.testing.assert_close(silu_and_mul_triton(gu), silu_and_mul(gu), atol=1e-5, rtol=1e-5)
from nanoengine.kernels.rope_store import qk_norm_rope_store
from nanoengine.layers.rotary_embedding import RotaryEmbedding
from nanoengine.models.qwen3 import qk_norm_rope
for n, hq, hk, d in [(3, 4, 2, 32), (2, 6, 3, 16)]:
    g = torch.Generator().manual_seed(n)
    qkv, pos = torch.randn(n, (hq + 2 * hk) * d, generator=g), torch.randint(0, 64, (n,), generator=g)
    qw, kw, table = torch.rand(d, generator=g) + 0.5, torch.rand(d, generator=g) + 0.5, RotaryEmbedding(d, d, 64, 1e4).cos_sin_cache
    slots = torch.tensor([-1] + list(range(3, 3 + n - 1)))
    caches = [torch.zeros(2, 8, hk, d) for _ in range(4)]
    q, k, _ = qk_norm_rope_store(qkv, pos, qw, kw, 1e-6, table, *caches[:2], slots, hq, hk)
    q0, k0, v0 = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    want_q, want_k = qk_norm_rope.eager(q0.view(n, hq, d), k0.view(n, hk, d), qw, kw, 1e-6, table, pos)
    store_kv_torch(want_k, v0.view(n, hk, d), *caches[2:], slots)
    for got, want in ((q, want_q), (k, want_k), (caches[0], caches[2]), (caches[1], caches[3])):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
from nanoengine.kernels.race_kernel import race_sample
z = torch.tensor([3.0, 0.0, -1.0, 2.0] * 50).repeat(6, 1)  # 6 rows of 200 tokens
z[1, 77] = z[4, 150] = 40.0  # rows 1 and 4 have a clear winner
temps = torch.tensor([0.7, 1e-3, 0.7, 0.7, 1e-3, 0.0])
drawn = race_sample(z, temps, 2**40 + 1, chunk=64)
assert torch.equal(drawn, race_sample(z, temps, 2**40 + 1, chunk=64)) and drawn.dtype == torch.int64
assert drawn[1] == 77 and drawn[4] == 150 and bool(((drawn >= 0) & (drawn < 200)).all())
print(triton.__version__)
'''


def declared_range() -> tuple[str, str]:
    """The (lower, upper) bounds of triton in pyproject.toml's dependencies."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    spec = next(d for d in deps if re.match(r"triton\b", d))
    return re.search(r">=\s*([\d.]+)", spec).group(1), re.search(r"<\s*([\d.]+)", spec).group(1)


def run_check(extra_path: Path | None = None) -> str:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    if extra_path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(extra_path), str(ROOT)])
    result = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip().splitlines()[-1]


def version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", v)[:3])


def test_the_installed_triton_is_in_the_declared_range_and_interprets_both_kernels():
    low, high = declared_range()
    version = run_check()
    assert version_tuple(low) <= version_tuple(version) < version_tuple(high), (version, low, high)


def test_the_lowest_declared_triton_interprets_both_kernels():
    low, _ = declared_range()
    import triton
    if version_tuple(triton.__version__)[:2] == version_tuple(low)[:2]:
        assert version_tuple(run_check())[:2] == version_tuple(low)[:2]   # this machine is the lower end
        return
    if not (LOW_DIR / "triton").is_dir():
        pytest.skip(f"triton {low} is not in {LOW_DIR} (make test installs it there)")
    assert version_tuple(run_check(LOW_DIR))[:2] == version_tuple(low)[:2]


COMPILE = r'''
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

launches = []  # (kernel, args, kwargs) of every launch, none run
JITFunction.__getitem__ = lambda self, grid: (lambda *a, **k: launches.append((self, a, k)))
from nanoengine.kernels.fused import add_rms_norm_triton, fused_gemv, silu_and_mul_triton
from nanoengine.kernels.gemv import gemv
from nanoengine.kernels.kv_fp8 import fp8_value_layout, store_kv_fp8_triton
from nanoengine.kernels.kv_store import store_kv_triton
from nanoengine.kernels.paged_decode import paged_decode
from nanoengine.kernels.race_kernel import race_sample
from nanoengine.kernels.rope_store import qk_norm_rope_store
from nanoengine.layers.paged_attention import pack_keys_triton
from nanoengine.layers.rotary_embedding import RotaryEmbedding

bf16, f8 = torch.bfloat16, torch.float8_e4m3fn
n, hq, hk, d, blocks, bs = 4, 16, 8, 128, 4, 256  # Qwen3-0.6B's attention shape, bfloat16 as served
kv = [torch.zeros(blocks, bs, hk, d, dtype=bf16) for _ in range(2)]
kv8 = [torch.zeros(blocks, bs, hk, d, dtype=f8) for _ in range(2)]
kv8[1] = fp8_value_layout(kv8[1])
scales = tuple(torch.ones(blocks, bs, hk) for _ in range(2))
slots, key = torch.arange(n), torch.randn(n, hk, d, dtype=bf16)
q, tables = torch.randn(n, hq, d, dtype=bf16), torch.arange(n, dtype=torch.int32)[:, None]
lens, rows = torch.full((n,), 100, dtype=torch.int32), torch.arange(n)
qkv, pos = torch.randn(n, (hq + 2 * hk) * d, dtype=bf16), torch.arange(n)
w, table = torch.rand(d, dtype=bf16), RotaryEmbedding(d, d, 64, 1e6).cos_sin_cache
x, weight, nw = torch.randn(2, 1024, dtype=bf16), torch.randn(64, 1024, dtype=bf16), torch.rand(1024, dtype=bf16)
calls = {
    "store_kv_triton": lambda: store_kv_triton(key, key, *kv, slots),
    "store_kv_fp8_triton": lambda: store_kv_fp8_triton(key, key, *kv8, *scales, slots),
    "paged_decode": lambda: paged_decode(q, *kv, tables, lens, 0.1),
    "paged_decode, one sequence (split)": lambda: paged_decode(q[:1], *kv, tables[:1], lens[:1], 0.1),
    "paged_decode, float8": lambda: paged_decode(q, *kv8, tables, lens, 0.1, torch.arange(n), scales),
    "qk_norm_rope_store": lambda: qk_norm_rope_store(qkv, pos, w, w, 1e-6, table, *kv, slots, hq, hk),
    "qk_norm_rope_store, float8": lambda: qk_norm_rope_store(qkv, pos, w, w, 1e-6, table, *kv8, slots,
                                                             hq, hk, kv_scales=scales),
    "gemv": lambda: gemv(x, weight),
    "fused_gemv, add_norm": lambda: fused_gemv(x, weight, prologue="add_norm", residual=x, norm_weight=nw),
    "fused_gemv, silu": lambda: fused_gemv(torch.randn(2, 2048, dtype=bf16), weight, prologue="silu"),
    "add_rms_norm_triton": lambda: add_rms_norm_triton(x, x, nw, 1e-6),
    "silu_and_mul_triton": lambda: silu_and_mul_triton(torch.randn(2, 2048, dtype=bf16)),
    "race_sample": lambda: race_sample(torch.randn(3, 5000), torch.ones(3), 7),
    "pack_keys_triton": lambda: pack_keys_triton(key, key, *kv, None, rows, rows, rows),
    "pack_keys_triton, float8": lambda: pack_keys_triton(key, key, *kv8, scales, rows, rows, rows),
}
TYPES = {bf16: "bf16", torch.float16: "fp16", torch.float32: "fp32", f8: "fp8e4nv", torch.int32: "i32",
         torch.int64: "i64", torch.uint8: "u8", torch.bool: "i1"}
OPTIONS = {"num_warps", "num_stages", "launch_pdl", "num_ctas", "maxnreg"}
target = GPUTarget("cuda", 90, 32)  # Hopper: the GPUs the engine is measured on
compiled = set()
for name, call in calls.items():
    start = len(launches)
    try:
        call()
    except Exception:  # a launcher that reads its (unwritten) output after the launch
        pass
    assert len(launches) > start, f"{name} launched no kernel"
    for fn, args, kwargs in launches[start:]:
        params = fn.params
        bound = dict(zip([p.name for p in params], args)) | {
            k: v for k, v in kwargs.items() if k not in OPTIONS}
        signature, constexprs = {}, {}
        for i, p in enumerate(params):
            value = bound[p.name] if p.name in bound else p.default
            if p.name == "PDL":
                value = True  # the launch the GPU makes (programmatic dependent launch)
            if p.is_constexpr or value is None:
                signature[p.name], constexprs[(i,)] = "constexpr", value
            elif torch.is_tensor(value):
                signature[p.name] = "*" + TYPES[value.dtype]
            elif isinstance(value, bool):
                signature[p.name] = "i1"
            elif isinstance(value, int):
                signature[p.name] = "i32" if -2**31 <= value < 2**31 else "i64"
            else:
                signature[p.name] = "fp32"
        options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
        triton.compile(ASTSource(fn, signature, constexprs=constexprs), target=target, options=options)
        compiled.add(fn.__name__)
print(sorted(compiled))
print(triton.__version__)
'''


def run_compile(extra_path: Path | None = None) -> tuple[list[str], str]:
    """Every kernel compiled for sm_90 (COMPILE, no interpreter): the kernels' names and triton's version."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if extra_path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(extra_path), str(ROOT)])
    result = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    names, version = result.stdout.strip().splitlines()[-2:]
    return ast.literal_eval(names), version  # the list of names COMPILE printed


def package_kernels() -> set[str]:
    """The names of every Triton kernel the package defines (def _..._kernel under @triton.jit, with or without
    arguments and a comment)."""
    names = set()
    for path in (ROOT / "nanoengine").rglob("*.py"):
        names |= set(re.findall(r"@triton\.jit(?:\(.*\))?[^\n]*\s+def (_\w+_kernel)\(", path.read_text()))
    return names


def test_every_kernel_compiles_for_hopper_with_the_installed_triton():
    names, version = run_compile()
    # a new kernel needs a launch in COMPILE
    assert set(names) == package_kernels()


def test_every_kernel_compiles_for_hopper_with_the_lowest_declared_triton():
    low, _ = declared_range()
    import triton
    if version_tuple(triton.__version__)[:2] == version_tuple(low)[:2]:
        return  # this machine is the lower end: the test above compiled with it
    if not (LOW_DIR / "triton").is_dir():
        pytest.skip(f"triton {low} is not in {LOW_DIR} (make test installs it there)")
    names, version = run_compile(LOW_DIR)
    assert version_tuple(version)[:2] == version_tuple(low)[:2] and set(names) == package_kernels()
