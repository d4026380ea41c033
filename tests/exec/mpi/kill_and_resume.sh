#!/bin/bash
# A rank killed mid-run ends the whole job with an error (no rank left hanging); resuming from
# the last checkpoint loses at most --checkpoint-every steps and continues with losses and
# weights bitwise identical to a run that was never interrupted, its learning-rate schedule
# (warm-up, then a cosine decay over the 10 steps) continued.
#
# usage: kill_and_resume.sh DTEXEC MPIRUN [WORKDIR]
set -uo pipefail
dtexec=$1
mpirun=$2
work=${3:-$(mktemp -d)}
mkdir -p "$work"
cd "$work" || exit 1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
plan=(--model tiny-gpt --steps 10 --warmup 0 --micro-batch-size 2 --global-batch-size 8 --dp 2 --pp 2 --zero-stage 1
  --lr-warmup-steps 2 --lr-decay-style cosine --min-lr 3e-4)
rm -rf whole interrupted interrupted.old
"$mpirun" -np 4 "$dtexec" run "${plan[@]}" --checkpoint whole >/dev/null || exit 1

# Rank 3 dies as step 7 starts; checkpoints every 3 steps: the last one is at step 6.
timeout 120 "$mpirun" -np 4 "$dtexec" run "${plan[@]}" --checkpoint interrupted \
  --checkpoint-every 3 --fail-at 3:7 >killed.log 2>&1
rc=$?
if [ "$rc" -eq 0 ] || [ "$rc" -eq 124 ]; then
  echo "the killed job should end with an error (exit code $rc; 124 is a hang)"
  cat killed.log
  exit 1
fi
grep -q "exited on signal 9" killed.log || { echo "no word of the killed rank:"; cat killed.log; exit 1; }
step=$(sed -n 's/^ *"step": \([0-9]*\),*/\1/p' interrupted/checkpoint.json)
echo "killed at step 7 with exit code $rc; last checkpoint at step $step"
[ "$step" -eq 6 ] || { echo "expected the checkpoint of step 6"; exit 1; }

"$mpirun" -np 4 "$dtexec" run "${plan[@]}" --checkpoint interrupted --resume interrupted >resumed.log || exit 1
"$dtexec" compare whole interrupted --loss-tolerance 0 --weight-tolerance 0
