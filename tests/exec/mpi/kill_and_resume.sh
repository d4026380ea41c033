#!/bin/bash
# A rank killed mid-run ends the whole job with an error (no rank left hanging); resuming from
# the last checkpoint loses at most --checkpoint-every steps and continues with losses and
# weights bitwise identical to a run that was never interrupted, its learning-rate schedule
# (warm-up, then a cosine decay over the 10 steps) continued. The same with asynchronous saves
# (--checkpoint-async): their checkpoints are bitwise those of the synchronous run, and a rank
# killed two steps after a save resumes from it, or from the one before when its shards were
# not yet all written.
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
"$dtexec" compare whole interrupted --loss-tolerance 0 --weight-tolerance 0 || exit 1

# Asynchronous saves: the same checkpoints, bit for bit.
rm -rf async async.tmp killed-async killed-async.tmp
"$mpirun" -np 4 "$dtexec" run "${plan[@]}" --checkpoint async --checkpoint-every 3 --checkpoint-async \
  >async.log || exit 1
grep -q "checkpoint of step 6 in place in async after step [6-9]" async.log ||
  { echo "no word of the asynchronous checkpoint of step 6:"; cat async.log; exit 1; }
"$dtexec" compare whole async --loss-tolerance 0 --weight-tolerance 0 || exit 1

# Rank 3 dies as step 8 starts, two steps after the save of step 6.
timeout 120 "$mpirun" -np 4 "$dtexec" run "${plan[@]}" --checkpoint killed-async \
  --checkpoint-every 3 --checkpoint-async --fail-at 3:8 >killed-async.log 2>&1
rc=$?
if [ "$rc" -eq 0 ] || [ "$rc" -eq 124 ]; then
  echo "the killed asynchronous job should end with an error (exit code $rc; 124 is a hang)"
  cat killed-async.log
  exit 1
fi
step=$(sed -n 's/^ *"step": \([0-9]*\),*/\1/p' killed-async/checkpoint.json)
echo "asynchronous saves: killed at step 8 with exit code $rc; last checkpoint at step $step"
[ "$step" -eq 6 ] || [ "$step" -eq 3 ] || { echo "expected the checkpoint of step 6 (or 3)"; exit 1; }
"$mpirun" -np 4 "$dtexec" run "${plan[@]}" --checkpoint killed-async --checkpoint-async \
  --resume killed-async >resumed-async.log || exit 1
"$dtexec" compare whole killed-async --loss-tolerance 0 --weight-tolerance 0
