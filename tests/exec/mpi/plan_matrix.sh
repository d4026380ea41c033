#!/bin/bash
# Shared by correctness_matrix.sh and bf16_matrix.sh (sourced): runs each entry
# "model|ranks|micro-batch size|plan flags" of the plans given as arguments under mpirun
# (dtexec run --model "$(path_of model)" "${common[@]}" ... --checkpoint run), compares the
# checkpoint with ref_<model>_<micro-batch size> at "${tolerances[@]}" (dtexec compare), and
# prints a row per plan. Returns 1 when any plan failed to run or differed.
# Needs: $dtexec, $mpirun (setup_plan_matrix sets them), the arrays common and tolerances,
# and a function path_of MODEL. With norm_tolerance set, each run's per-step gradient norms
# (--json's grad_norms: common must hold a --clip-grad) are compared with those of
# ref_<model>_<micro-batch size>.json (the reference run's --json) too, relative: AdamW's
# update is the same for a gradient scaled by any constant, so a sum that should be a mean
# (over dp replicas, micro-batches, a split backward) leaves the losses and weights alone.
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

# The grad_norms of a run's --json output (in FILE), on one line.
norms() { sed -n '/"grad_norms": \[/,/\]/p' "$1" | grep -o '[0-9][0-9.e+-]*' | tr '\n' ' '; }

# The largest relative difference between the norms A and B (norms' lines), "missing" where
# their counts differ or are 0; with MIN, "unclipped" where one of A is not above it.
norm_diff() {
  awk -v a="$1" -v b="$2" -v min="${3:-}" 'BEGIN {
    n = split(a, x, " "); m = split(b, y, " ")
    if (n == 0 || n != m) { print "missing"; exit }
    worst = 0
    for (i = 1; i <= n; ++i) {
      if (min != "" && x[i] <= min + 0) { print "unclipped"; exit }
      d = (x[i] > y[i] ? x[i] - y[i] : y[i] - x[i]) / x[i]
      if (d > worst) worst = d
    }
    printf "%.2e", worst }'
}

# Whether DIFF (norm_diff's) is a number no larger than TOLERANCE.
within() { awk -v d="$1" -v t="$2" 'BEGIN { exit !(d + 0 == d && d <= t + 0) }'; }

run_plan_matrix() {
  local failed=0 entry model ranks mbs flags out result loss weight norm=- json=()
  [ -n "${norm_tolerance:-}" ] && json=(--json)
  printf '%-9s %-72s %5s %9s %9s %9s  %s\n' model plan ranks loss_diff weight_diff norm_diff result
  for entry in "$@"; do
    IFS='|' read -r model ranks mbs flags <<<"$entry"
    rm -rf run
    # shellcheck disable=SC2086
    if ! timeout 300 "$mpirun" -np "$ranks" "$dtexec" run --model "$(path_of "$model")" \
        "${common[@]}" --micro-batch-size "$mbs" $flags --checkpoint run "${json[@]}" \
        >run.log 2>&1 </dev/null; then
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
    if [ -n "${norm_tolerance:-}" ]; then
      norm=$(norm_diff "$(norms "ref_${model}_$mbs.json")" "$(norms run.log)")
      if ! within "$norm" "$norm_tolerance"; then
        result=DIFFERENT
        failed=1
      fi
    fi
    loss=$(sed -n 's/.*largest loss difference \([^;]*\);.*/\1/p' <<<"$out")
    weight=$(sed -n 's/.*largest weight difference \([^ ]*\).*/\1/p' <<<"$out")
    printf '%-9s %-72s %5s %9s %9s %9s  %s\n' "$model" "$flags --micro-batch-size $mbs" "$ranks" \
      "$loss" "$weight" "$norm" "$result"
  done
  return $failed
}
