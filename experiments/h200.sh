#!/usr/bin/env bash
# The runs behind results/ on the H200 machine, in stages that each fit one 10-minute device call:
#   bash experiments/h200.sh p   # the serving profile alone (with --serving: its overheads measured through a server)
#   bash experiments/h200.sh t   # GPU tests (compiled, graphs and eager paths; ~5 min with an empty compile cache)
#   bash experiments/h200.sh a   # the serving profile, paper-8, paper-48 (with the oracle)
#   bash experiments/h200.sh b   # GPU concurrency sweep
#   bash experiments/h200.sh c   # sustained Poisson arrivals (gpu-only, mixed, eta)
#   bash experiments/h200.sh d   # cache-hit sweep (2 runs: with 3 it did not fit stage a; see results/h200-logs)
#   bash experiments/h200.sh e   # gpu-serial (the GPU at 1 active)
# Before stage a on a new GPU or CPU path, commit the simulator's prediction (experiments/predict_compiled_gpu.py).
# Keep MVLLM_CACHE on a path that survives between calls of one session (e.g. /tmp/mvcache): the compiled GPU
# path compiles once per cache (about 60 s) and then starts in under 30 s.
# The runs at e90c2d3 (results/*-int8-lossy, the sweeps) had cpu=cpu/quant=int8/threads=8, now spelled
# quant=int8-lossy; the experiment files now leave the CPU mode to the machine (int8w on the H200's Xeon).
# Every stage writes results/<experiment>/ plus a log in results/h200-logs/, and stops each step before
# the stage's time (STAGE_S, default 570 s) runs out, so what finished is always kept.
set -u
stage=${1:?stage p, t, a, b, c, d or e}
budget=${STAGE_S:-570}
logs=results/h200-logs
mkdir -p "$logs"
profile=results/profile/h200-serving-compiled.json  # h200-serving.json: the runs before the compiled GPU path
run() {  # run MAX_S NAME CMD...: at most MAX_S seconds and never past the stage's budget
    local max=$1 name=$2; shift 2
    local left=$((budget - SECONDS - 10))
    ((left < max)) && max=$left
    if ((max < 20)); then echo "skipped $name: no time left" | tee -a "$logs/$stage.txt"; return; fi
    echo "== $name (limit ${max}s, at ${SECONDS}s)" | tee -a "$logs/$stage.txt"
    timeout -s INT -k 20 "$max" "$@" >"$logs/$name.txt" 2>&1
    echo "== $name: exit $? after ${SECONDS}s" | tee -a "$logs/$stage.txt"
}
bench() {  # bench MAX_S EXPERIMENT: fresh results folder, the session's one profile
    rm -rf "results/$2" && mkdir -p "results/$2" && cp "$profile" "results/$2/profile.json"
    run "$1" "$2" python3 -m mvllm.cli bench "experiments/$2.toml" --out "results/$2"
}
if [[ ! -f $profile ]]; then  # GPU up to 16 active (the concurrency sweep's largest), CPU as served
    run 480 profile python3 -m mvllm.cli profile --model synthetic:qwen2.5-0.5b --lengths 516 --repeats 3 --serving \
        --steps 8 --backends gpu=cuda/max_active=16,cpu=cpu/threads=8/max_active=4 --out "$profile"
fi
case $stage in
p) ;;  # the profile above
t)
    run 540 gpu-tests python3 -m pytest -q -p no:logging tests/test_gpu.py ;;
a)
    bench 100 paper-8
    bench 220 paper-48 ;;
e)
    bench 300 gpu-serial ;;
b)
    bench 400 sweep-concurrency ;;
c)
    bench 540 sweep-rate ;;
d)
    bench 340 sweep-hit-rate ;;
esac
nvidia-smi --query-gpu=name,memory.used --format=csv >>"$logs/$stage.txt" 2>&1
