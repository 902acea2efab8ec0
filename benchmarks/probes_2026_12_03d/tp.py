"""Host cost per call and GPU time: torch.compile'd add_rms_norm / silu_and_mul vs plain Triton kernels."""
import json, sys, time
import torch, triton, triton.language as tl
from nanoengine.layers.layernorm import add_rms_norm
from nanoengine.layers.activation import silu_and_mul

@triton.jit
def _add_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, r_out_ptr, K, eps, sx, sr, sy, so,
                     HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, BLOCK)
    mask = ks < K
    xi = tl.load(x_ptr + row * sx + ks, mask=mask, other=0.0)
    xf = xi.to(tl.float32)
    if HAS_RES:
        xf += tl.load(r_ptr + row * sr + ks, mask=mask, other=0.0).to(tl.float32)
        tl.store(r_out_ptr + row * so + ks, xf.to(xi.dtype), mask=mask)
    xf = xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / K + eps)
    w = tl.load(w_ptr + ks, mask=mask, other=0.0)
    tl.store(y_ptr + row * sy + ks, xf.to(xi.dtype) * w.to(xi.dtype), mask=mask)

@triton.jit
def _silu_mul_kernel(x_ptr, y_ptr, K, sx, sy, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    ks = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = ks < K
    g = tl.load(x_ptr + row * sx + ks, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * sx + K + ks, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    tl.store(y_ptr + row * sy + ks, (gf / (1.0 + tl.exp(-gf)) * u.to(tl.float32)).to(g.dtype), mask=mask)

def tri_add_norm(x, r, w, eps):
    m, k = x.shape
    y = torch.empty_like(x); ro = torch.empty_like(x)
    _add_norm_kernel[(m,)](x, r, w, y, ro, k, eps, x.stride(0), r.stride(0), y.stride(0), ro.stride(0),
                           HAS_RES=True, BLOCK=triton.next_power_of_2(k), num_warps=4)
    return y, ro

def tri_silu(x, block=1024):
    m, k2 = x.shape; k = k2 // 2
    y = torch.empty(m, k, dtype=x.dtype, device=x.device)
    _silu_mul_kernel[(m, triton.cdiv(k, block))](x, y, k, x.stride(0), y.stride(0), BLOCK=block, num_warps=4)
    return y

def host_us(fn, n=3000):
    for _ in range(50): fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n): fn()
    t = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return round(t, 2)

def gpu_us(fn, n=200):
    for _ in range(10): fn()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(); a.record()
    for _ in range(n): fn()
    b.record(); torch.cuda.synchronize()
    return round(a.elapsed_time(b) / n * 1000, 2)

out = {}
dt = torch.bfloat16
w = (torch.rand(1024, device="cuda", dtype=dt) + 0.5)
for m in (16384, 256, 16, 1):
    x = torch.randn(m, 1024, device="cuda", dtype=dt); r = torch.randn(m, 1024, device="cuda", dtype=dt)
    g = torch.randn(m, 6144, device="cuda", dtype=dt)
    a1, a2 = add_rms_norm(x, r, w, 1e-6); b1, b2 = tri_add_norm(x, r, w, 1e-6)
    s1, s2 = silu_and_mul(g), tri_silu(g)
    row = {"norm_max_diff": (a1.float() - b1.float()).abs().max().item(),
           "norm_frac_differ": (a1 != b1).float().mean().item(), "res_equal": bool(torch.equal(a2, b2)),
           "silu_max_diff": (s1.float() - s2.float()).abs().max().item(),
           "silu_frac_differ": (s1 != s2).float().mean().item()}
    if m >= 256:
        row.update(norm_gpu_us_compiled=gpu_us(lambda: add_rms_norm(x, r, w, 1e-6)),
                   norm_gpu_us_triton=gpu_us(lambda: tri_add_norm(x, r, w, 1e-6)),
                   silu_gpu_us_compiled=gpu_us(lambda: silu_and_mul(g)),
                   silu_gpu_us_triton=gpu_us(lambda: tri_silu(g)),
                   silu_gpu_us_triton_2048=gpu_us(lambda: tri_silu(g, 2048)),
                   silu_gpu_us_triton_512=gpu_us(lambda: tri_silu(g, 512)))
    if m == 16:
        row.update(norm_host_us_compiled=host_us(lambda: add_rms_norm(x, r, w, 1e-6)),
                   norm_host_us_triton=host_us(lambda: tri_add_norm(x, r, w, 1e-6)),
                   silu_host_us_compiled=host_us(lambda: silu_and_mul(g)),
                   silu_host_us_triton=host_us(lambda: tri_silu(g)),
                   linear_host_us=host_us(lambda: torch.nn.functional.linear(x, torch.empty(1024, 1024, device="cuda", dtype=dt))),
                   empty_host_us=host_us(lambda: torch.empty_like(x)))
    out[m] = row
    print(m, row, flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
