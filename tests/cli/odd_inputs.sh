#!/bin/sh
# Inputs that once crashed dtsim or ended it as an internal error (exit 1), each now a clear
# refusal (exit 2) or a run: a JSON file nested 100,000 levels deep (nlohmann's printing and
# comparison recurse), a huge array echoed whole in a message, a file name that is not UTF-8
# copied into JSON output.
#   odd_inputs.sh DTSIM
set -u
dtsim=$1
dir=odd_inputs
rm -rf "$dir" && mkdir "$dir" || exit 1
fail() { echo "FAIL: $*"; exit 1; }

python3 -c "n = 100000; open('$dir/deep.json', 'w').write('{\"zero_stage\": ' + '[' * n + ']' * n + '}')"
out=$("$dtsim" memory --model tiny --plan "$dir/deep.json" 2>&1); rc=$?
echo "$out" | head -c 300; echo
[ $rc -eq 2 ] || fail "deep plan: exit $rc, expected 2"
echo "$out" | grep -q "deep.json: nested more than 512 levels deep (line 1); expected a JSON file" || fail "deep plan: message"

python3 -c "open('$dir/wide.json', 'w').write('{\"zero_stage\": [' + ','.join(['1'] * 200000) + ']}')"
out=$("$dtsim" memory --model tiny --plan "$dir/wide.json" 2>&1); rc=$?
echo "$out" | head -c 300; echo
[ $rc -eq 2 ] || fail "wide plan: exit $rc, expected 2"
echo "$out" | grep -q "zero_stage: expected 0, 1, 2 or 3, got an array" || fail "wide plan: message"
[ ${#out} -lt 1000 ] || fail "wide plan: a message of ${#out} characters"

# (A Hugging Face config takes its name from the file's.)
odd=$(printf "$dir/gpt2-\377.json")
echo '{"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2, "n_positions": 64, "vocab_size": 256}' > "$odd" || exit 1
"$dtsim" simulate --model "$odd" --gpus 8 --seq-len 64 --json > "$dir/odd.json"; rc=$?
[ $rc -eq 0 ] || fail "a model file not named in UTF-8: exit $rc, expected 0"
python3 -c "import json; json.load(open('$dir/odd.json'))" || fail "a model file not named in UTF-8: JSON output unreadable"
echo "ok"
