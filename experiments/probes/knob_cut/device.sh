#!/bin/bash
# one device call: build old and new kernels, run the CPU kernel tests (new), bits old vs new, knob_check old/new
cd "$(dirname "$0")/../.."   # the repo root
R=$PWD; P=.old/pre-knobs; export PYTHONUNBUFFERED=1
{ lscpu | grep -E "^Model name|^CPU\(s\)|^Thread"; grep -o -w -E "amx_tile|amx_int8|amx_bf16|avx512_vnni|avx512bw|avx512_bf16" /proc/cpuinfo | sort -u | tr '\n' ' '; echo; g++ --version | head -1; python3 -c 'import torch; print(torch.__version__, torch.get_num_threads())'; } 2>&1 | tee $OUT/info.txt
t0=$(date +%s)
for tree in old new; do
  src=$R; [ $tree = old ] && src=$R/$P
  for m in cpu_int8 cpu_fused cpu_layers; do
    MVLLM_CACHE=/tmp/c_$tree PYTHONPATH=$src python3 -c "from mvllm.kernels import $m as k; print('$tree $m', k.available(), k.why_unavailable)" > /tmp/build_${tree}_$m.log 2>&1 &
  done
done
wait; cat /tmp/build_*.log | tee -a $OUT/info.txt; echo "builds $(( $(date +%s) - t0 )) s" | tee -a $OUT/info.txt
( MVLLM_CACHE=/tmp/c_new timeout 420 python3 -m pytest -q -p no:cacheprovider -rs tests/test_cpu_kernels.py tests/test_cpu_layers.py tests/test_cpu_fused.py tests/test_batch_invariant.py tests/test_quant.py > $OUT/tests.txt 2>&1; echo "rc=$? $(( $(date +%s) - t0 )) s" >> $OUT/tests.txt ) &
TP=$!
( for env in "X=1" "MVLLM_INT8_AMX=0" "MVLLM_INT8_PATH=lanes" "MVLLM_INT8_PATH=int16" "MVLLM_INT8_PATH=float"; do
    for tree in old new; do src=$R; [ $tree = old ] && src=$R/$P
      env $env MVLLM_CACHE=/tmp/c_$tree PYTHONPATH=$src timeout 200 python3 $P/bits.py /tmp/bits_${tree}_${env}.pt
    done
    python3 $P/compare.py /tmp/bits_old_${env}.pt /tmp/bits_new_${env}.pt
  done > $OUT/bits.txt 2>&1; echo "bits done $(( $(date +%s) - t0 )) s" >> $OUT/bits.txt ) &
wait
for i in 1 2; do for tree in old new; do src=$R; [ $tree = old ] && src=$R/$P
  MVLLM_CACHE=/tmp/c_$tree PYTHONPATH=$src timeout 120 python3 experiments/probes/knob_check.py --model synthetic:smollm2-135m >> $OUT/knob_check.jsonl 2>>$OUT/knob_check.err
done; done
echo "all $(( $(date +%s) - t0 )) s" >> $OUT/info.txt
ls -la $OUT
