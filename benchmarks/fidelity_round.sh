#!/bin/bash
# One fidelity check (docs/scheduling.md, "Fidelity"): fit runs, evaluation runs on mixed-64, a fresh profile
# fitted on the fit runs only, and the simulator's error on the evaluation runs. About 8 minutes.
#   benchmarks/fidelity_round.sh OUT_DIR
set -e
D=${1:?usage: $0 OUT_DIR}
mkdir -p "$D"
F=".venv/bin/ferry"
W=benchmarks/workloads/mixed-64.json
$F bench offline --num-prompts 64 --input-len 400 --output-len 150 --input-dist uniform --output-dist uniform \
    --range-ratio 0.9 --seed 11 --no-progress --output-json "$D/fit-offline.json" > "$D/fit-offline.log"
$F bench online --num-prompts 48 --input-len 200 --output-len 80 --input-dist lognormal --sigma 0.8 \
    --output-dist uniform --range-ratio 0.8 --seed 12 --request-rate 0.75 --no-progress \
    --output-json "$D/fit-online.json" > "$D/fit-online.log"
$F bench offline --workload $W --no-progress --output-json "$D/eval-offline.json" > "$D/eval-offline.log"
$F bench online --workload $W --request-rate 0.5 --no-progress --output-json "$D/eval-r0.5.json" > "$D/eval-r0.5.log"
$F bench online --workload $W --request-rate 2 --no-progress --output-json "$D/eval-r2.json" > "$D/eval-r2.log"
$F simulate calibrate --from-run "$D/fit-offline.json" "$D/fit-online.json" --out "$D/profile.json"
.venv/bin/python benchmarks/sim_fidelity.py --hardware "$D/profile.json" --workload $W \
    "$D/eval-offline.json" "$D/eval-r0.5.json" "$D/eval-r2.json"
