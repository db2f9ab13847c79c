#!/usr/bin/env bash
# mvllm's CPU backend against llama.cpp on the same CPU, in one call (issue 27): the peer of
# ../shared/tools/cpu-peer (carried as .peer/lcpp.tar.xz: mkdir -p .peer && cp ../shared/tools/cpu-peer/lcpp.tar.xz .peer/)
# and `mvllm profile` at the same cells, then `python experiments/cpu_peer_table.py OUT` prints mvllm/llama.cpp.
#   bash experiments/cpu_peer.sh OUT [BACKENDS]        THREADS=1,2 for a smaller machine (default 8,16)
# Cells: decode at batch 1 and 4, 8 and 16 threads, depth 0 and 516 (llama-bench -d, llama-batched-bench -npl),
# cold prefill of 516 tokens (llama-bench -p 516), warm prefill of 20 after 496 (mvllm only: llama.cpp has none).
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
THREADS=$threads BB_THREADS=${threads##*,} JOBS=$(nproc) TOTAL_BUDGET=${PEER_BUDGET:-330} bash "$lcpp/run.sh" "$out/lcpp" > "$out/lcpp-run.txt" 2>&1
tail -25 "$out/lcpp-run.txt"
timeout ${T_PEER:-200} "$bin/llama-bench" -m "$model" -p 0 -n 64 -d 0,516 -t "$threads" -r 3 -o json > "$out/lcpp/depth.json" 2> "$out/lcpp/depth.log"
echo "llama-bench -d: exit $?"
for t in ${threads//,/ }; do  # batch 1 and 4 at depth 1 and 516 (one prompt of that length each)
    timeout ${T_PEER:-120} "$bin/llama-batched-bench" -m "$model" -c 4096 -npp 1,516 -ntg 64 -npl 1,4 -t $t -lv 4 \
        --output-format jsonl > "$out/lcpp/batched-bench-t$t.jsonl" 2> "$out/lcpp/batched-bench-t$t.log"
    echo "llama-batched-bench -t $t: exit $?"
done
timeout ${T_MVLLM:-400} python3 -m mvllm.cli profile --model synthetic:qwen2.5-0.5b --backends "$backends" --lengths 516 \
    --repeats 3 --steps 8 --contexts 0,516 --no-accuracy --out "$out/mvllm.json" > "$out/mvllm-profile.txt" 2>&1
echo "mvllm profile: exit $?"
tail -12 "$out/mvllm-profile.txt"
python3 experiments/cpu_peer_table.py "$out"
