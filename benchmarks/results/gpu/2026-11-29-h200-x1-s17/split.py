"""Session 17's split of the H200 TPOT at 12 req/s: the client's, the engine actor's own
(first to last output, from the request trace) and the simulator's, request by request.
Run from the repository root after unpacking spans-12/colocated-1-raw.tar.xz into /tmp/r4:

    mkdir -p /tmp/r4 && tar -xJf benchmarks/results/gpu/2026-11-29-h200-x1-s17/spans-12/colocated-1-raw.tar.xz -C /tmp/r4
    .venv/bin/python benchmarks/results/gpu/2026-11-29-h200-x1-s17/split.py
"""
import csv, json, shlex, sys
import numpy as np
from pdserve.engine.step_trace import read_request_spans
from pdserve.sim import cli
from pdserve.sim.runner import SimConfig, Simulation

# The simulator's command for this rate, as benchmarks/sim_validate_gpu.py wrote it.
CMD = ("pdserve sim run --profile benchmarks/results/gpu/2026-11-29-h200-x1-s17/profile-1/profile.json "
       "--mode colocated --replicas 1 --dataset-name random --random-input-len 2048 --random-output-len 256 "
       "--random-range-ratio 0 --num-prompts 96 --request-rate 12.0 --burstiness 1 --seed 12000 "
       "--goodput ttft:500 tpot:10")
spans = read_request_spans("/tmp/r4/colocated-1-steps")["colocated-0"]
rows = list(csv.DictReader(open("/tmp/r4/colocated-1-raw/rate-12.csv")))
spans = spans[-len(rows):]
client_tpot = np.array([float(r["tpot_ms"]) for r in rows])
client_ttft = np.array([float(r["ttft_ms"]) for r in rows])
eng_tpot = np.array([(last - first) / (n - 1) * 1000 for _, first, last, n in spans])
eng_ttft = np.array([(first - sub) * 1000 for sub, first, _, _ in spans])
args = cli.build_parser().parse_args(shlex.split(CMD)[2:])
profile = cli.load_profile(args); slo, _ = cli._slos(args)
run = Simulation(SimConfig(profile, cli.build_topology(args), slo)).run(cli.build_workload(args))
reqs = sorted(run.requests, key=lambda r: r.arrival)
sim_tpot = np.array([(r.finish - r.first_token) / (r.output - 1) * 1000 for r in reqs])
sim_ttft_engine = np.array([(r.first_token - r.arrival) * 1000 for r in reqs])
def pct(x): return "p50 %.2f p90 %.2f mean %.2f" % (np.percentile(x, 50), np.percentile(x, 90), x.mean())
print("TPOT client  ", pct(client_tpot), " >20ms:", (client_tpot > 20).sum())
print("TPOT engine  ", pct(eng_tpot), " >20ms:", (eng_tpot > 20).sum())
print("TPOT sim     ", pct(sim_tpot), " >20ms:", (sim_tpot > 20).sum())
print("client - engine per request: mean %.3f ms sd %.3f; corr %.4f" % ((client_tpot - eng_tpot).mean(), (client_tpot - eng_tpot).std(), np.corrcoef(client_tpot, eng_tpot)[0, 1]))
print("engine - sim per request:    mean %.3f ms sd %.3f; corr %.4f" % ((eng_tpot - sim_tpot).mean(), (eng_tpot - sim_tpot).std(), np.corrcoef(eng_tpot, sim_tpot)[0, 1]))
print("TTFT client", pct(client_ttft), "| actor submit->first", pct(eng_ttft), "| sim first-token (engine, no response path)", pct(sim_ttft_engine))
# way out: client e2e end vs engine last, aligned on the first request's submit
off = spans[0][0] - float(rows[0]["arrival_s"])
client_end = np.array([float(r["arrival_s"]) + float(r["e2el_ms"]) / 1000 for r in rows]) + off
client_first = np.array([float(r["arrival_s"]) + float(r["ttft_ms"]) / 1000 for r in rows]) + off
last = np.array([s[2] for s in spans]); first = np.array([s[1] for s in spans])
print("client first - actor first: %s ms" % pct((client_first - first) * 1000))
print("client last - actor last:   %s ms" % pct((client_end - last) * 1000))
