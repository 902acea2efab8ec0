"""Decode projections at 8 to 128 rows: cuBLAS after the separate norm / SiLU x mul kernel (the engine today) against
one Triton kernel that computes the prologue on the fly and multiplies with tl.dot (a candidate for section 11.2).

    python skinny_sweep.py OUT.json [--quick]      (needs a CUDA GPU)

Qwen3-0.6B's projections: qkv_proj after add + RMSNorm, gate_up_proj after add + RMSNorm, down_proj after SiLU x mul,
o_proj with no prologue. Each timing cycles through ten copies of the weight in a CUDA graph after a small producer
kernel (nanoengine.layers.gemv._graph_time_us, as the engine's start-up choice times them). Every config is checked
against the engine's path first (max abs difference; bf16). Results are written after each shape."""
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from nanoengine.bench import provenance
from nanoengine.layers.activation import silu_and_mul
from nanoengine.layers.gemv import _graph_time_us, linear
from nanoengine.layers.layernorm import add_rms_norm
from nanoengine.layers.paged_decode import pdl_capable

SHAPES = {  # name: (out features, in features, prologue); 0 none, 2 add + RMSNorm, 3 SiLU x mul
    "qkv_proj": (4096, 1024, 2), "gate_up_proj": (6144, 1024, 2), "down_proj": (1024, 3072, 3),
    "o_proj": (1024, 2048, 0),
}


@triton.jit
def _skinny_kernel(
    x_ptr, r_ptr, nw_ptr, w_ptr, y_ptr, r_out_ptr, M, N, K, eps, stride_xm, stride_rm, stride_wn, stride_ym,
    stride_om, PROLOGUE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    live = rows < M
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    if PROLOGUE == 2:  # 1 / rms of each row of x + r over all K (and the new residual, by program 0)
        ss = tl.zeros((BLOCK_M,), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            xi = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=live[:, None], other=0.0)
            xf = xi.to(tl.float32) + tl.load(
                r_ptr + rows[:, None] * stride_rm + ks[None, :], mask=live[:, None], other=0.0
            ).to(tl.float32)
            if pid == 0:
                tl.store(r_out_ptr + rows[:, None] * stride_om + ks[None, :], xf.to(xi.dtype), mask=live[:, None])
            ss += tl.sum(xf * xf, axis=1)
        rstd = tl.rsqrt(ss / K + eps)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + cols[None, :].to(tl.int64) * stride_wn + ks[:, None], mask=cols[None, :] < N,
                    other=0.0)  # [BLOCK_K, BLOCK_N]
        if PROLOGUE == 3:  # x = silu(gate) * up, from the fused gate/up output [M, 2K]
            g = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=live[:, None], other=0.0)
            u = tl.load(x_ptr + rows[:, None] * stride_xm + K + ks[None, :], mask=live[:, None], other=0.0)
            gf = g.to(tl.float32)
            x = (gf / (1.0 + tl.exp(-gf)) * u.to(tl.float32)).to(g.dtype)
        elif PROLOGUE == 2:
            xi = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=live[:, None], other=0.0)
            xf = xi.to(tl.float32) + tl.load(
                r_ptr + rows[:, None] * stride_rm + ks[None, :], mask=live[:, None], other=0.0
            ).to(tl.float32)
            x = (xf * rstd[:, None]).to(xi.dtype) * tl.load(nw_ptr + ks).to(xi.dtype)[None, :]
        else:
            x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=live[:, None], other=0.0)
        acc += tl.dot(x, w)
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=live[:, None] & (cols[None, :] < N))


def skinny(x, w, prologue, residual=None, norm_weight=None, eps=1e-6, *, block_n=32, block_k=128, warps=4,
           stages=3):
    """prologue(x) @ w.T in one kernel: (y, new residual or None)."""
    m, n, k = x.shape[0], w.shape[0], w.shape[1]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    r_out = torch.empty(m, k, dtype=x.dtype, device=x.device) if prologue == 2 else y
    pdl = pdl_capable(x.device)
    _skinny_kernel[(triton.cdiv(n, block_n),)](
        x, residual if residual is not None else x, norm_weight if norm_weight is not None else x, w, y, r_out,
        m, n, k, eps, x.stride(0), residual.stride(0) if residual is not None else 0, w.stride(0), y.stride(0),
        r_out.stride(0), PROLOGUE=prologue, BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=block_n,
        BLOCK_K=block_k, PDL=pdl, launch_pdl=pdl, num_warps=warps, num_stages=stages,
    )
    return y, (r_out if prologue == 2 else None)


def apart(x, w, prologue, residual=None, norm_weight=None):
    """The engine's path: the prologue's own kernel, then the projection (cuBLAS at these row counts)."""
    if prologue == 3:
        return linear(silu_and_mul(x), w)
    if prologue == 2:
        return linear(add_rms_norm(x, residual, norm_weight, 1e-6)[0], w)
    return linear(x, w)


CONFIGS = [(bn, bk, 4, st) for bn in (16, 32, 64) for bk in (128, 256) for st in (3, 4)]
QUICK = [(32, 128, 4, 3), (16, 256, 4, 4), (64, 128, 4, 3)]


@torch.inference_mode()
def main(path: str, quick: bool = False) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float16  # Triton 3.6's CPU interpreter: no bf16 dot
    rows_list = (8, 16) if quick else (8, 16, 32, 64, 128)
    results = {"provenance": provenance(), "what": __doc__.split("\n\n")[0], "shapes": {}}
    for name, (n, k, prologue) in SHAPES.items():
        if quick:
            n = min(n, 64)
        weights = [torch.randn(n, k, device=device, dtype=dtype) * 0.02 for _ in range(1 if quick else 10)]
        norm_w = torch.rand(k, device=device, dtype=dtype) + 0.5
        entry = results["shapes"][name] = {}
        for m in rows_list:
            x = torch.randn(m, 2 * k if prologue == 3 else k, device=device, dtype=dtype)
            r = torch.randn(m, k, device=device, dtype=dtype) if prologue == 2 else None
            want = apart(x, weights[0], prologue, r, norm_w)
            row = {"configs": []}
            if device == "cuda":
                row["apart_us"] = round(_graph_time_us(lambda x, w: apart(x, w, prologue, r, norm_w), weights, x, 20), 3)
            for bn, bk, wp, st in QUICK if quick else CONFIGS:
                try:
                    got, new_r = skinny(x, weights[0], prologue, r, norm_w, block_n=bn, block_k=bk, warps=wp, stages=st)
                except Exception as e:  # a tile that needs more shared memory than the SM has
                    row["configs"].append({"block_n": bn, "block_k": bk, "stages": st, "error": type(e).__name__})
                    continue
                diff = (got.float() - want.float()).abs().max().item()
                c = {"block_n": bn, "block_k": bk, "warps": wp, "stages": st, "max_abs_diff": diff}
                if prologue == 2:
                    c["residual_diff"] = (new_r.float() - (x.float() + r.float()).to(x.dtype).float()).abs().max().item()
                if device == "cuda" and diff < 0.05:
                    c["us"] = round(_graph_time_us(lambda x, w: skinny(
                        x, w, prologue, r, norm_w, block_n=bn, block_k=bk, warps=wp, stages=st), weights, x, 20), 3)
                row["configs"].append(c)
            timed = [c for c in row["configs"] if "us" in c]
            if timed:
                best = min(timed, key=lambda c: c["us"])
                row["best"] = best
                row["speedup"] = round(row["apart_us"] / best["us"], 3)
            entry[f"rows={m}"] = row
            print(name, m, {k2: v for k2, v in row.items() if k2 != "configs"}, flush=True)
        Path(path).write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main(sys.argv[1], "--quick" in sys.argv)
