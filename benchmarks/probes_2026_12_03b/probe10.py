"""Host cost of one prefill step's pieces at 16,384 tokens, GPU idle vs queued: F.linear (default
BLAS and cuBLASLt), flash_attn_varlen_func, a torch.compile'd elementwise region."""
import time, statistics as st
import torch, torch.nn.functional as F
from flash_attn import flash_attn_varlen_func
dev, dt = "cuda", torch.bfloat16
T = 16384
x = torch.randn(T, 1024, device=dev, dtype=dt)
ws = {"qkv": torch.randn(4096, 1024, device=dev, dtype=dt), "o": torch.randn(1024, 2048, device=dev, dtype=dt),
      "gate_up": torch.randn(6144, 1024, device=dev, dtype=dt), "down": torch.randn(1024, 3072, device=dev, dtype=dt)}
ins = {"qkv": x, "o": torch.randn(T, 2048, device=dev, dtype=dt), "gate_up": x, "down": torch.randn(T, 3072, device=dev, dtype=dt)}
def host(fn, n=60, sync_each=True):
    out = []
    for _ in range(n):
        if sync_each: torch.cuda.synchronize()
        t = time.perf_counter(); fn(); out.append(time.perf_counter() - t)
    torch.cuda.synchronize(); return round(1e6 * st.median(out), 1)
for lib in ("default", "cublaslt", "cublas"):
    if lib != "default": torch.backends.cuda.preferred_blas_library(lib)
    r = {k: host(lambda k=k: F.linear(ins[k], ws[k])) for k in ws}
    r2 = {k: host(lambda k=k: F.linear(ins[k][:T - 40], ws[k])) for k in ws}
    print("linear us idle", lib, torch.backends.cuda.preferred_blas_library(), r, "M-40:", r2, flush=True)
torch.backends.cuda.preferred_blas_library("default")
big = torch.randn(8192, 8192, device=dev, dtype=dt)
def queued(k):  # a long GEMM in front, then time the launch
    torch.cuda.synchronize(); big @ big; t = time.perf_counter(); F.linear(ins[k], ws[k]); return time.perf_counter() - t
print("linear us behind a long kernel", {k: round(1e6 * st.median([queued(k) for _ in range(30)]), 1) for k in ws})
q = torch.randn(T, 16, 128, device=dev, dtype=dt); kk = torch.randn(T, 8, 128, device=dev, dtype=dt)
cu = torch.arange(0, T + 1, 512, device=dev, dtype=torch.int32)
print("flash varlen us idle", host(lambda: flash_attn_varlen_func(q, kk, kk, cu, cu, 512, 512, causal=True)))
with torch.inference_mode():
    print("flash varlen us idle (inference_mode)", host(lambda: flash_attn_varlen_func(q, kk, kk, cu, cu, 512, 512, causal=True)))
    @torch.compile(dynamic=True)
    def f(a, b): return (a.float() * torch.rsqrt(a.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(a.dtype) * b
    nw = torch.randn(1024, device=dev, dtype=dt)
    f(x, nw); f(x[:100], nw)
    print("compiled rmsnorm region us idle", host(lambda: f(x, nw)), "eager mm", host(lambda: torch.mm(x, ws["qkv"].t())))
    r = {k: host(lambda k=k: F.linear(ins[k], ws[k])) for k in ws}
    print("linear us idle under inference_mode", r)
