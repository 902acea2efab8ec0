"""Sample a process's threads (CPU% and last core, from /proc) and every core's busy % once a second.
usage: python3 mon.py PID OUTFILE"""
import os, sys, time
pid, out = int(sys.argv[1]), open(sys.argv[2], "w")
hz = os.sysconf("SC_CLK_TCK")
def threads():
    r = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try: f = open(f"/proc/{pid}/task/{tid}/stat").read()
        except OSError: continue
        name = f[f.index("(") + 1:f.rindex(")")]; rest = f[f.rindex(")") + 2:].split()
        r[tid] = (name, int(rest[11]) + int(rest[12]), int(rest[36]))
    return r
def cpus():
    r = {}
    for line in open("/proc/stat"):
        if line.startswith("cpu") and line[3].isdigit():
            p = line.split(); v = list(map(int, p[1:])); r[p[0]] = (sum(v) - v[3] - v[4], sum(v))
    return r
a, c = threads(), cpus()
while os.path.exists(f"/proc/{pid}"):
    time.sleep(1.0)
    try: b, d = threads(), cpus()
    except Exception: break
    busy = [(t, b[t][0], 100 * (b[t][1] - a[t][1]) / hz, b[t][2]) for t in b if t in a and b[t][1] - a[t][1] > 0.05 * hz]
    cores = {k: round(100 * (d[k][0] - c[k][0]) / max(1, d[k][1] - c[k][1])) for k in d}
    print(f"{time.time():.0f} threads>5%:", [(t, n, round(p), core) for t, n, p, core in busy],
          "cores>10%:", {k: v for k, v in cores.items() if v > 10}, file=out, flush=True)
    a, c = b, d
