"""The simulator's calibration from engine step traces: what the engines recorded
(pdserve.engine.step_trace) turned into the numbers of a simulated engine's profile.

- `trace_reader`: reads step and request traces (a directory, or one packed by proof.sh).
- `step_fit`: the step-time model (`fit_steps`, `fit_replicas`: `step_fit` in a profile).
- `step_noise`: how steps wander around that model, fitted and replayed (`StepNoise`).
- `step_interference`: engines of one host slowing each other, fitted and replayed.

Nothing here runs in a serving process; the engines only write traces.
"""
