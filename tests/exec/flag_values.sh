#!/bin/bash
# Bad input never crashes: every flag of `dtexec run` that takes a value, given one of the kind
# that most often breaks a parser or a model (nan, a word, -1), either runs (exit 0) or
# is refused with exit code 2 and a message that names the flag (as --flag, flag_name or
# "flag name"; --resume's names the folder given, "no such checkpoint folder"); never another
# exit code, a signal or a hang.
#
# usage: flag_values.sh DTEXEC [WORKDIR]
set -uo pipefail
dtexec=$1
work=${2:-$(mktemp -d)}
mkdir -p "$work" && cd "$work" || exit 1
flags=$("$dtexec" run --help | sed -n 's/^  --\([a-z0-9-]*\) arg.*/\1/p')
[ "$(echo "$flags" | wc -w)" -ge 30 ] || { echo "FAIL: only $(echo "$flags" | wc -w) flags read from --help"; exit 1; }
failed=0 runs=0 refused=0
for flag in $flags; do
  for value in nan x -1; do
    extra=()
    case $flag in
      model) continue ;;  # every run's model (a value of it is a model's name or file)
      checkpoint-every | checkpoint-timeout) extra=(--checkpoint ck) ;;
    esac
    # (Each in an empty folder: --checkpoint x or --trace x leaves a file x for the next.)
    rm -rf run && mkdir run || exit 1
    out=$(cd run && timeout 60 "$dtexec" run --model tiny-gpt --steps 1 --warmup 0 \
      "${extra[@]}" "--$flag" "$value" 2>&1 </dev/null)
    rc=$?
    if [ $rc -eq 0 ]; then
      runs=$((runs + 1))
    elif [ $rc -eq 2 ]; then
      refused=$((refused + 1))
      named=$flag
      [ "$flag" = resume ] && named="$value: no such checkpoint folder"
      if ! grep -q -e "$named" -e "${flag//-/_}" -e "${flag//-/ }" <<<"$out"; then
        echo "FAIL: --$flag $value: refused without naming the flag: $(tail -1 <<<"$out")"
        failed=1
      fi
    else
      echo "FAIL: --$flag $value: exit code $rc: $(tail -2 <<<"$out" | tr '\n' ' ')"
      failed=1
    fi
  done
done
echo "$runs runs, $refused refusals"
[ $refused -gt 0 ] || { echo "FAIL: nothing refused"; failed=1; }
exit $failed
