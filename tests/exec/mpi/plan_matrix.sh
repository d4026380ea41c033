#!/bin/bash
# Shared by correctness_matrix.sh and bf16_matrix.sh (sourced): runs each entry
# "model|ranks|micro-batch size|plan flags" of the plans given as arguments under mpirun
# (dtexec run --model "$(path_of model)" "${common[@]}" ... --checkpoint run), compares the
# checkpoint with ref_<model>_<micro-batch size> at "${tolerances[@]}" (dtexec compare), and
# prints a row per plan. Returns 1 when any plan failed to run or differed.
# Needs: $dtexec, $mpirun (setup_plan_matrix sets them), the arrays common and tolerances,
# and a function path_of MODEL.
# shellcheck disable=SC2154  # (they are the sourcing script's)

# The arguments DTEXEC MPIRUN [WORKDIR] as $dtexec and $mpirun, the work directory (a fresh
# temporary one by default) made the current one, and mpirun allowed as root, oversubscribed.
setup_plan_matrix() {
  dtexec=$1
  mpirun=$2
  local work=${3:-$(mktemp -d)}
  mkdir -p "$work"
  cd "$work" || exit 1
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
}

run_plan_matrix() {
  local failed=0 entry model ranks mbs flags out result loss weight
  printf '%-9s %-72s %5s %9s %9s  %s\n' model plan ranks loss_diff weight_diff result
  for entry in "$@"; do
    IFS='|' read -r model ranks mbs flags <<<"$entry"
    rm -rf run
    # shellcheck disable=SC2086
    if ! timeout 300 "$mpirun" -np "$ranks" "$dtexec" run --model "$(path_of "$model")" \
        "${common[@]}" --micro-batch-size "$mbs" $flags --checkpoint run >run.log 2>&1 </dev/null; then
      echo "FAILED to run: $flags (mbs $mbs)"
      cat run.log
      failed=1
      continue
    fi
    if out=$("$dtexec" compare "ref_${model}_$mbs" run "${tolerances[@]}"); then
      result=ok
    else
      result=DIFFERENT
      failed=1
    fi
    loss=$(sed -n 's/.*largest loss difference \([^;]*\);.*/\1/p' <<<"$out")
    weight=$(sed -n 's/.*largest weight difference \([^ ]*\).*/\1/p' <<<"$out")
    printf '%-9s %-72s %5s %9s %9s  %s\n' "$model" "$flags --micro-batch-size $mbs" "$ranks" \
      "$loss" "$weight" "$result"
  done
  return $failed
}
