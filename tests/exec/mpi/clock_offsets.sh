#!/bin/bash
# Ranks whose clocks differ, as on several machines, simulated on this one:
# DTEXEC_TEST_CLOCK_SKEW_S=1000 moves rank r's clock r x 1000 s ahead. dtexec run must put the
# ranks' times on rank 0's clock (Comm::clock_offsets, round trips) and measure what it measures
# where the ranks share a clock: every stage's breakdown, amdahl, and a trace on one clock in
# which each pipeline transfer's send and receive start together.
# usage: clock_offsets.sh DTEXEC MPIRUN WORK_DIR
set -euo pipefail
dtexec=$1
mpirun=$2
mkdir -p "$3" && cd "$3"
# The ranks mpirun starts on this host inherit its environment.
DTEXEC_TEST_CLOCK_SKEW_S=1000 "$mpirun" -np 2 "$dtexec" run \
  --model tiny-gpt --pp 2 --global-batch-size 8 --steps 3 --json --trace skew_trace.json \
  </dev/null >skew.json
python3 - <<'PY'
import json

run = json.load(open("skew.json"))
clock = run["clock"]
assert clock["shared"] is False, clock
# Shared memory answers in microseconds; a bound this loose still catches an offset ignored.
assert 0 <= clock["error_s"] < 0.01, clock
assert "put on rank 0's by round trips" in run["breakdown"]["note"], run["breakdown"]["note"]
assert [s["stage"] for s in run["per_stage"]] == [0, 1], run["per_stage"]
assert run["amdahl"] is not None and 0 < run["amdahl"]["serial_fraction"] < 1, run["amdahl"]
# The runner's own work between tasks is a part of the bubble.
breakdown = run["breakdown"]
# (The two are sums over different clocks' readings: a relative tolerance for their rounding.)
assert 0 <= breakdown["runner_s"] <= breakdown["bubble_s"] * (1 + 1e-6) + 1e-12, breakdown
trace = json.load(open("skew_trace.json"))
events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
# One step on one clock: no event a second away from the step's start (1000 s without offsets).
assert all(0 <= e["ts"] and e["ts"] + e["dur"] < 1e6 for e in events), "a task off the step's clock"
start = {(e["pid"], e["name"]): e["ts"] for e in events}
pairs = 0
for (pid, name), ts in start.items():
    if name.startswith("send "):
        peer = [t for (p, n), t in start.items() if p != pid and n == "recv " + name[5:]]
        assert len(peer) == 1, name
        # Both start when both ranks are ready (within the offset's error and the trace's µs).
        assert abs(ts - peer[0]) <= clock["error_s"] * 1e6 + 1, (name, ts, peer[0])
        pairs += 1
assert pairs == 16, pairs  # 8 micro-batches, activations forward and gradients back
print(f"clock offsets: {pairs} transfers aligned, error {clock['error_s'] * 1e6:.1f} us")
PY
