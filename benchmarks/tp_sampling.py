"""Sampling at tp=2, today's way and a way not built yet: what each costs per decode step.

Today (chapter 14) every rank computes logits for its half of the vocabulary, `dist.gather` brings both halves
to rank 0, rank 0 samples from the full row, and with async scheduling rank 0 broadcasts the tokens. The
alternative keeps the logits where they are: each rank finds the winner of its own half, and one all-gather of
(score, token id) pairs lets every rank pick the same overall winner, with no broadcast. It is exact for greedy
decoding (argmax) and for the exponential race of chapter 06 (`argmax(logits / T - log E)`, with E the same
exponential noise the one-rank sampler would draw), so tp=2 would still equal tp=1 token for token; top-k and
top-p need the whole row and would keep today's path.

Both ways run here on random logits of Qwen3-0.6B's vocabulary, and must choose the same tokens. On GPUs the
script times each with CUDA events (NCCL); on a CPU (`--device cpu`, gloo) it only checks that they agree.

    python3 benchmarks/tp_sampling.py --out benchmarks/tp_sampling_h200x2.json
    python3 benchmarks/tp_sampling.py --device cpu --vocab 1024      # a quick check of the logic
"""
import argparse
import datetime
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

VOCAB = 151936  # Qwen3-0.6B
BATCHES = [1, 8, 64, 256]
# torch 2.13 renamed all_gather_into_tensor (the device's torch 2.11 has only the old name)
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def gather_then_sample(logits: torch.Tensor, noise: torch.Tensor | None, rank: int) -> torch.Tensor:
    """Today: both halves to rank 0, the full row sampled there, the tokens broadcast back. [B]"""
    parts = [torch.empty_like(logits) for _ in range(2)] if rank == 0 else None
    dist.gather(logits, parts, dst=0)
    tokens = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    if rank == 0:
        full = torch.cat(parts, dim=-1).float()  # [B, V]
        scores = full if noise is None else full - noise.log()  # the race: argmax(l / T - log E), T = 1
        tokens = scores.argmax(dim=-1)
    dist.broadcast(tokens, src=0)
    return tokens


def local_winners(logits: torch.Tensor, noise: torch.Tensor | None, rank: int) -> torch.Tensor:
    """Not built: each rank's winner of its half, then one all-gather of (score, id) pairs. [B]"""
    shard = logits.shape[-1]
    scores = logits.float()
    if noise is not None:
        scores = scores - noise[:, rank * shard:(rank + 1) * shard].log()  # this rank's slice of the noise
    best, where = scores.max(dim=-1)  # [B], [B]
    pair = torch.stack([best.double(), (where + rank * shard).double()], dim=-1)  # [B, 2]; ids < 2**53
    pairs = torch.empty(2 * pair.shape[0], 2, dtype=pair.dtype, device=pair.device)  # [ranks * B, 2]
    ALL_GATHER(pairs, pair)
    pairs = pairs.view(2, *pair.shape)  # [ranks, B, 2]
    winner = pairs[:, :, 0].argmax(dim=0)  # [B]: which rank holds the best score
    return pairs[winner, torch.arange(pair.shape[0], device=pair.device), 1].long()


def time_it(fn, n: int, device: torch.device) -> float:
    """Milliseconds per call, CUDA events around n calls after 5 warm-up calls."""
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / n


def worker(rank: int, args: argparse.Namespace, init_file: str, out_file: str) -> None:
    cuda = args.device == "cuda"
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=2, device_id=device if cuda else None)
    shard = args.vocab // 2
    results = []
    for batch in BATCHES:
        gen = torch.Generator(device=device).manual_seed(batch)  # the same full rows and noise on both ranks
        full = torch.randn(batch, args.vocab, generator=gen, device=device).to(torch.bfloat16)
        noise = torch.empty(batch, args.vocab, device=device).exponential_(generator=gen)
        logits = full[:, rank * shard:(rank + 1) * shard].contiguous()  # [B, V/2], this rank's half
        row = {"batch": batch}
        for name, use_noise in (("greedy", None), ("race", noise)):
            today = gather_then_sample(logits, use_noise, rank)
            other = local_winners(logits, use_noise, rank)
            if not torch.equal(today, other):
                raise AssertionError(f"batch {batch}, {name}: the two ways chose different tokens")
            if cuda:
                row[f"{name}_gather_ms"] = round(time_it(lambda: gather_then_sample(logits, use_noise, rank),
                                                         args.iters, device), 4)
                row[f"{name}_local_ms"] = round(time_it(lambda: local_winners(logits, use_noise, rank),
                                                        args.iters, device), 4)
        results.append(row)
    if rank == 0:
        Path(out_file).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.vocab % 2:
        raise SystemExit("--vocab must be even (two ranks)")
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        raise SystemExit("needs two CUDA GPUs (or --device cpu for the logic alone)")
    with tempfile.TemporaryDirectory() as tmp:
        init_file, out_file = os.path.join(tmp, "init"), os.path.join(tmp, "out.json")
        mp.spawn(worker, args=(args, init_file, out_file), nprocs=2, join=True)
        rows = json.loads(Path(out_file).read_text())
    for row in rows:
        print(json.dumps(row))
    if args.out is not None:
        provenance = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                      "torch": torch.__version__, "device": args.device, "vocab": args.vocab,
                      "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
                      "commit": os.environ.get("NANOENGINE_COMMIT"), "argv": sys.argv[1:]}
        args.out.write_text(json.dumps({"provenance": provenance, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
