"""N fresh full-engine bench processes, each with its start-up choices and the GPU clocks sampled by nvidia-smi (run: python3 spread.py N)."""
import json, subprocess, sys, os, time, tempfile
n = int(sys.argv[1]) if len(sys.argv) > 1 else 4
out = os.environ.get("OUT", tempfile.mkdtemp())
for i in range(n):
    f = f"{out}/spread{i}.json"
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active",
                            "--format=csv,noheader", "-lms", "100"], stdout=open(f"{out}/smi{i}.csv", "w"))
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "nanoengine.bench", "--throughput", "--latency", "--out", f], capture_output=True, text=True)
    smi.terminate(); smi.wait()
    if r.returncode:
        print(i, "FAILED", r.stderr[-1500:]); continue
    d = json.load(open(f)); t = d["throughput"]; info = d["engine_info"]
    gemv = sorted(k for k, v in info.get("gemv_report", {}).items() if v.get("gemv"))
    fused = sorted(k for k, v in info.get("fused_report", {}).items() if v.get("fused", v.get("use")))
    clocks = [int(l.split(",")[1].split()[0]) for l in open(f"{out}/smi{i}.csv") if "MHz" in l]
    print(f"{i}: {t['output_tok_per_s']:.0f} tok/s pre {t['prefill_seconds']:.3f} dec {t['decode_seconds']:.3f} "
          f"lat {d['latency']['ms_per_token']:.3f} steps {t['prefill_step_ms']} gemv {len(gemv)} {gemv} fused {len(fused)} "
          f"sm MHz min/med/max {min(clocks, default=0)}/{sorted(clocks)[len(clocks)//2] if clocks else 0}/{max(clocks, default=0)} "
          f"({time.time()-t0:.0f} s)", flush=True)
