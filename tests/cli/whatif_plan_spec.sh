#!/bin/sh
# A whatif row's plan_spec saved alone is a plan file: dtsim simulate --plan takes the model and
# cluster it names (a model file by its absolute path, from another folder) and predicts the
# row's step time, on the cluster as the point changed it (--vary nic_gbps) and with the
# straggler figures it set (--vary jitter_cv) and the profile that timed it, which notes say.
#   whatif_plan_spec.sh DTSIM MODELS_DIR PROFILE
set -u
dtsim=$1
dir=whatif_plan_spec
rm -rf "$dir" && mkdir "$dir" || exit 1
fail() { echo "FAIL: $*"; exit 1; }

cp "$2/gpt2-124m.json" "$dir/own-gpt2.json" || exit 1
(cd "$dir" && "$dtsim" whatif --model own-gpt2.json --cluster aws-p4d --global-batch-size 32 \
  --seq-len 1024 --vary gpus=8,16 --vary nic_gbps=100,25 --json > rows.json 2> whatif.err) || fail "whatif"
python3 - "$dir" <<'PY' || fail "rows"
import json, sys
d = sys.argv[1]
rows = json.load(open(f"{d}/rows.json"))
assert len(rows) == 4 and all(r["found"] for r in rows), rows
for i, r in enumerate(rows):
    spec = r["plan_spec"]
    assert spec["model"].endswith(f"/{d}/own-gpt2.json") and spec["model"].startswith("/"), spec
    assert spec["cluster"] == "aws-p4d", spec
    assert spec["cluster_changes"] == {"nic_gbps": r["point"]["nic_gbps"]}, spec
    json.dump(spec, open(f"{d}/spec{i}.json", "w"))
    open(f"{d}/step{i}", "w").write(repr(r["step_time_s"]))
PY
for i in 0 1 2 3; do
  "$dtsim" simulate --plan "$dir/spec$i.json" --json > "$dir/sim$i.json" 2> "$dir/err$i" || fail "simulate spec$i"
  grep -q "spec$i.json: aws-p4d with nic_gbps=[0-9]*, as the dtsim whatif point it was made at" "$dir/err$i" || fail "note $i"
  python3 -c "import json, sys; s = json.load(open(sys.argv[1])); w = float(open(sys.argv[2]).read()); assert s['model'] == 'gpt2-124m' and s['cluster'] == 'aws-p4d', s; assert s['step_time_s'] == w, (s['step_time_s'], w)" "$dir/sim$i.json" "$dir/step$i" || fail "sim$i"
done
# The same file with another --cluster: its changes are the file's cluster's, left out (said).
"$dtsim" simulate --plan "$dir/spec3.json" --cluster aws-p5 --json > /dev/null 2> "$dir/other" || fail "other cluster"
grep -q "spec3.json was made for cluster aws-p4d with nic_gbps=25; --cluster aws-p5 as given, without those changes" "$dir/other" || fail "other cluster's note"
# The straggler figures a point sets are the file's too: simulate takes them (said), and
# predicts the row's step time with them.
"$dtsim" whatif --model gpt2-124m --cluster aws-p4d --gpus 64 --global-batch-size 256 \
  --vary jitter_cv=0.05 --vary rank_spread_cv=0.02 --profile "$3" --json > "$dir/spread.json" 2> /dev/null || fail "whatif spread"
python3 - "$dir" <<'PY' || fail "spread rows"
import json, sys
d = sys.argv[1]
r = json.load(open(f"{d}/spread.json"))[0]
spec = r["plan_spec"]
assert spec["jitter_cv"] == 0.05 and spec["rank_spread_cv"] == 0.02, spec
assert spec["profile"].startswith("/") and spec["profile"].endswith("/profile_test.json"), spec
assert r["straggler_cost_s"] > 0 and r["slow_rank_cost_s"] > 0, r
json.dump(spec, open(f"{d}/spread_spec.json", "w"))
open(f"{d}/spread_step", "w").write(repr(r["step_time_s"]))
PY
"$dtsim" simulate --plan "$dir/spread_spec.json" --json > "$dir/spread_sim.json" 2> "$dir/spread_err" || fail "simulate spread"
grep -q "spread_spec.json: jitter_cv 0.05 from the file" "$dir/spread_err" || fail "jitter note"
grep -q "spread_spec.json: rank_spread_cv 0.02 from the file" "$dir/spread_err" || fail "spread note"
grep -q "spread_spec.json: calibration profile .*profile_test.json from the file" "$dir/spread_err" || fail "profile note"
python3 -c "import json, sys; s = json.load(open(sys.argv[1])); w = float(open(sys.argv[2]).read()); assert s['step_time_s'] == w, (s['step_time_s'], w)" "$dir/spread_sim.json" "$dir/spread_step" || fail "spread step"
# A --fixed-plan's own figures (its straggler figures, its profile) are its rows' plan_spec's too.
"$dtsim" whatif --fixed-plan "$dir/spread_spec.json" --vary global_batch=256 --json > "$dir/fixed.json" 2> /dev/null || fail "whatif fixed"
python3 - "$dir" <<'PY' || fail "fixed rows"
import json, sys
d = sys.argv[1]
r = json.load(open(f"{d}/fixed.json"))[0]
spec = r["plan_spec"]
assert spec["jitter_cv"] == 0.05 and spec["rank_spread_cv"] == 0.02, spec
assert spec["profile"].endswith("/profile_test.json"), spec
json.dump(spec, open(f"{d}/fixed_spec.json", "w"))
open(f"{d}/fixed_step", "w").write(repr(r["step_time_s"]))
PY
"$dtsim" simulate --plan "$dir/fixed_spec.json" --json > "$dir/fixed_sim.json" 2> /dev/null || fail "simulate fixed"
python3 -c "import json, sys; s = json.load(open(sys.argv[1])); w = float(open(sys.argv[2]).read()); assert s['step_time_s'] == w, (s['step_time_s'], w)" "$dir/fixed_sim.json" "$dir/fixed_step" || fail "fixed step"
echo ok
