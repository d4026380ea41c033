#!/usr/bin/env python3
"""The README's worked examples against what dtsim prints for them today.

The README quotes figures of a few examples (the default job's plan, its memory front, Mixtral's
expert parallelism, Frontier, Llama 3 405B). When a change to the models moves them, this test
fails until the README says the new figures, instead of the README drifting in silence (a
reviewer found five stale figures on 2026-12-06).

usage: readme_figures.py DTSIM README.md
"""
import json
import re
import subprocess
import sys


def run(dtsim, *args):
    out = subprocess.run([dtsim, *args], capture_output=True, text=True, check=True)
    return out.stdout


def main():
    dtsim, readme_path = sys.argv[1], sys.argv[2]
    # The README wraps its lines: compare with runs of whitespace as one space.
    readme = " ".join(open(readme_path, encoding="utf-8").read().split())
    failures = []

    def expect(phrase, why):
        if phrase not in readme:
            failures.append(f"README lacks {phrase!r} ({why})")

    def best(*args):
        j = json.loads(run(dtsim, "plan", *args, "--json"))
        return j["candidates"][0]

    # The default job: the best plan with cp searched and without.
    default = ["--model", "llama3-8b", "--cluster", "default", "--global-batch-size", "256"]
    with_cp = best(*default)["step_time_s"]
    without = best(*default, "--max-cp", "1")["step_time_s"]
    expect(f"({with_cp:.2f} s against {without:.2f} s",
           "plan of the default job, with and without --max-cp 1")

    # Its memory front: the 90.5 GiB row (dp=16 tp=1 cp=2 ZeRO-3), as the text table prints it.
    text = run(dtsim, "plan", *default)
    row = re.search(r"^\s+(\d+\.\d)\s+[\d.]+\s+([\d.]+)%\s+dp=16 tp=1 pp=1 cp=2 mbs=1 gbs=256 "
                    r"1f1b zero=3 bf16$", text, re.M)
    if not row:
        failures.append("the default job's memory front has no dp=16 tp=1 cp=2 ZeRO-3 row")
    else:
        expect(f"with {row.group(1)} GiB per GPU, dp=16 tp=1 cp=2 ZeRO-3 would run "
               f"{row.group(2)}% faster", "the default job's memory front")

    # Mixtral 8x7B on the default 32 A100s: tp 2 with sequence parallelism and ep 4.
    mixtral = best("--model", "mixtral-8x7b", "--global-batch-size", "256")
    plan = mixtral["plan"]
    if (plan["ep"], plan["tp"], plan["sequence_parallel"]) != (4, 2, True):
        failures.append(f"Mixtral's best plan is {mixtral['summary']}, the README's has tp 2 "
                        "with sequence parallelism and ep 4")
    expect(f"parallelism and ep 4 ({mixtral['step_time_s']:.2f} s;", "Mixtral at --expert-load 1")

    # Frontier, Llama-3 8B with ZeRO-3 on 64 GCDs, analytical network.
    frontier = json.loads(run(dtsim, "simulate", "--model", "llama3-8b", "--cluster", "frontier",
                              "--gpus", "64", "--zero-stage", "3", "--json"))
    expect(f"now both give {frontier['step_time_s']:.2f} s", "Frontier under the analytical model")

    # Llama 3.1 405B on 16,384 H100s with context parallelism searched.
    big = best("--model", "llama3-405b", "--cluster", "h100-roce", "--gpus", "16384",
               "--global-batch-size", "2048", "--seq-len", "8192", "--attention", "flash")
    expect(f"{big['step_time_s']:.2f} s, {100 * big['mfu']:.1f}% MFU",
           "Llama 3 405B's best plan with cp searched")

    for f in failures:
        print(f)
    if failures:
        print("update the README's figures (or the example) to what dtsim prints now")
        return 1
    print("the README's figures are dtsim's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
