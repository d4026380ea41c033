#!/bin/bash
# A file that one rank's node does not see (a --model, a --cluster, a --resume checkpoint, each
# given by a path relative to a working folder of the rank's own): that rank ends the job with
# its rank, host and reason (exit 2) within seconds, where its peers waited in their next
# collective for ever; and a model file that dtexec calibrate --seq-len checks against. Each
# rank runs in work/rRANK, and only r0 has the file.
#
# usage: file_on_one_node.sh DTEXEC MPIRUN [WORKDIR]
set -uo pipefail
dtexec=$1
mpirun=$2
work=${3:-$(mktemp -d)}
data=$(cd "$(dirname "$0")/../../.." && pwd)  # the checkout's models/ and topologies/
rm -rf "$work" && mkdir -p "$work/r0/files" "$work/r1/files" || exit 1
cd "$work" || exit 1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
fail() { echo "FAIL: $*"; exit 1; }
plan=(--model tiny-gpt --dp 2 --global-batch-size 4 --warmup 0)

# The files, made by one rank alone: a model, a cluster, a checkpoint.
cp "$data/models/tiny-gpt.json" r0/files/own-model.json || exit 1
cp "$data/topologies/cpu-host.json" r0/files/own-cluster.json || exit 1
(cd r0 && "$dtexec" run --model tiny-gpt --steps 1 --warmup 0 --global-batch-size 4 \
  --checkpoint files/ckpt > /dev/null) || fail "the checkpoint"

# RANK's working folder: rRANK (Open MPI names the rank in the environment).
each=(sh -c 'cd "r$OMPI_COMM_WORLD_RANK" && exec "$0" "$@"' "$dtexec" run)
for flags in "--model files/own-model.json --dp 2 --global-batch-size 4 --steps 2" \
  "${plan[*]} --steps 2 --cluster files/own-cluster.json" \
  "${plan[*]} --steps 3 --resume files/ckpt"; do
  start=$(date +%s)
  # shellcheck disable=SC2086
  out=$(timeout 60 "$mpirun" -np 2 "${each[@]}" $flags 2>&1 < /dev/null)
  rc=$?
  took=$(($(date +%s) - start))
  echo "$flags: exit $rc in $took s"
  echo "$out" | grep "rank 1 on" | head -2
  [ "$rc" -eq 2 ] || fail "$flags: exit $rc, expected 2 (124: the job hung)"
  [ "$took" -lt 25 ] || fail "$flags: $took s, where the failing rank ends the job at once"
  echo "$out" | grep -q "dtexec run: rank 1 on [^:]*: error: .*files/" || fail "$flags: rank 1's message"
done
# dtexec calibrate alike (its --seq-len is checked against the model's before it measures).
start=$(date +%s)
out=$(timeout 60 "$mpirun" -np 2 sh -c 'cd "r$OMPI_COMM_WORLD_RANK" && exec "$0" "$@"' "$dtexec" \
  calibrate --model files/own-model.json --seq-len 16 --out "$work/p.json" 2>&1 < /dev/null)
rc=$?
took=$(($(date +%s) - start))
echo "calibrate: exit $rc in $took s"
[ "$rc" -eq 2 ] || fail "calibrate: exit $rc, expected 2 (124: the job hung)"
[ "$took" -lt 25 ] || fail "calibrate: $took s"
echo "$out" | grep -q "dtexec calibrate: rank 1 on [^:]*: error: files/own-model.json" || fail "calibrate: rank 1's message: $out"
# Every rank fails, for different reasons (the file missing on rank 0's node, malformed on rank
# 1's): the one message the job prints gives both, where it gave rank 0's alone.
echo '{"name": "broken", "layers": "many"}' > r1/files/broken.json || exit 1
out=$(timeout 60 "$mpirun" -np 2 "${each[@]}" --model files/broken.json --dp 2 \
  --global-batch-size 4 --steps 1 2>&1 < /dev/null)
rc=$?
echo "failing differently: exit $rc"
[ "$rc" -eq 2 ] || fail "failing differently: exit $rc, expected 2"
echo "$out" | grep -q "dtexec run: error: files/broken.json: no such model file" || fail "rank 0's reason: $out"
echo "$out" | grep -q "^  rank 1 on [^:]*: files/broken.json: " || fail "rank 1's reason: $out"
echo ok
