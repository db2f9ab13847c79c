#!/usr/bin/env bash
# mvllm's CPU backend against llama.cpp on the same CPU, in one call: the peer of
# ../shared/tools/cpu-peer (carried as .peer/lcpp.tar.xz: mkdir -p .peer && cp ../shared/tools/cpu-peer/lcpp.tar.xz .peer/)
# and `mvllm profile` at the same cells, then `python experiments/cpu_peer_table.py OUT` prints mvllm/llama.cpp.
#   bash experiments/cpu_peer.sh OUT [BACKENDS]        THREADS=1,2 for a smaller machine (default 8,16)
#   ROUNDS=2 bash experiments/cpu_peer.sh OUT          both sides twice, in alternating order (OUT/round-K)
# Cells: decode at batch 1 and 4, 8 and 16 threads, depth 0 and 516 (llama-bench -d, llama-batched-bench -npl),
# cold prefill of 516 tokens (llama-bench -p 516), warm prefill of 20 after 496 (mvllm only: llama.cpp has none).
# Each round also reads a buffer of the weights' size pass after pass (experiments/read_bandwidth.cpp), and one of
# 4 GB (DRAM alone), at 1 thread and each count: the floor under a batch-1 step on this host, which the table adds.
set -u
out=${1:?OUT}
threads=${THREADS:-8,16}
default=$(echo "$threads" | tr ',' '\n' | sed 's|.*|cpu&=cpu/threads=&|' | paste -sd,)
backends=${2:-$default}
mkdir -p "$out"
if [[ ! -d /tmp/lcpp-src/lcpp ]]; then  # the peer's source, unpacked once per machine
    mkdir -p /tmp/lcpp-src && tar xJf .peer/lcpp.tar.xz -C /tmp/lcpp-src
fi
lcpp=/tmp/lcpp-src/lcpp
bin=/tmp/lcpp-build/bin
model=/tmp/lcpp-qwen2.5-0.5b-q8_0.gguf
peer() {  # llama.cpp's cells into $1/lcpp (the first time through the peer's run.sh, which builds it)
    local o=$1
    mkdir -p "$o/lcpp"
    if [[ ! -x $bin/llama-bench || ! -f $model ]]; then
        THREADS=$threads BB_THREADS=${threads##*,} JOBS=$(nproc) TOTAL_BUDGET=${PEER_BUDGET:-330} bash "$lcpp/run.sh" "$o/lcpp" > "$o/lcpp-run.txt" 2>&1
        tail -25 "$o/lcpp-run.txt"
    else  # built: the prefill cells of run.sh's llama-bench again
        timeout ${T_PEER:-200} "$bin/llama-bench" -m "$model" -p 516 -n 0 -t "$threads" -r 3 -o json > "$o/lcpp/llama-bench.json" 2> "$o/lcpp/llama-bench.log"
        echo "llama-bench -p 516: exit $?"
    fi
    timeout ${T_PEER:-200} "$bin/llama-bench" -m "$model" -p 0 -n 64 -d 0,516 -t "$threads" -r 3 -o json > "$o/lcpp/depth.json" 2> "$o/lcpp/depth.log"
    echo "llama-bench -d: exit $?"
    for t in ${threads//,/ }; do  # batch 1 and 4 at depth 1 and 516 (one prompt of that length each)
        timeout ${T_PEER:-120} "$bin/llama-batched-bench" -m "$model" -c 4096 -npp 1,516 -ntg 64 -npl 1,4 -t $t -lv 4 \
            --output-format jsonl > "$o/lcpp/batched-bench-t$t.jsonl" 2> "$o/lcpp/batched-bench-t$t.log"
        echo "llama-batched-bench -t $t: exit $?"
    done
}
floor_bw() {  # this host's read rate into $1/read-bandwidth.jsonl
    [[ -x /tmp/read_bw ]] || g++ -O3 -march=native -fopenmp -o /tmp/read_bw experiments/read_bandwidth.cpp
    local counts
    counts=$(echo "1,$threads" | tr ',' '\n' | sort -nu | paste -sd,)
    timeout 120 /tmp/read_bw "$(python3 experiments/cpu_peer_table.py --step-mb),4000" "$counts" 20 > "$1/read-bandwidth.jsonl"
    echo "read_bandwidth: exit $?"
    cat "$1/read-bandwidth.jsonl"
}
mine() {  # mvllm's cells into $1/mvllm.json
    timeout ${T_MVLLM:-400} python3 -m mvllm.cli profile --model synthetic:qwen2.5-0.5b --backends "$backends" --lengths 516 \
        --repeats 3 --steps 8 --contexts 0,516 --no-accuracy --out "$1/mvllm.json" > "$1/mvllm-profile.txt" 2>&1
    echo "mvllm profile: exit $?"
    tail -12 "$1/mvllm-profile.txt"
}
rounds=${ROUNDS:-1}
if (( rounds == 1 )); then
    peer "$out"
    floor_bw "$out"
    mine "$out"
else  # ROUNDS=N: N rounds, llama.cpp first in odd rounds and mvllm first in even ones, so drift over the call
    for (( k = 1; k <= rounds; k++ )); do  # does not favour one side; the table takes each round's ratios
        mkdir -p "$out/round-$k"
        if (( k % 2 )); then peer "$out/round-$k"; floor_bw "$out/round-$k"; mine "$out/round-$k"
        else mine "$out/round-$k"; floor_bw "$out/round-$k"; peer "$out/round-$k"; fi
    done
fi
python3 experiments/cpu_peer_table.py "$out" --bundle  # table.json and raw.json.gz (every other output)
