set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD MVLLM_CACHE=/tmp/mvcache
python3 -m mvllm.cli serve --model synthetic:tiny-qwen2 --backends gpu=cuda,cpu=cpu/threads=2 --port 8123 > $OUT/serve.log 2>&1 &
for i in $(seq 1 90); do curl -s localhost:8123/health >/dev/null && break; sleep 1; done
curl -s localhost:8123/v1/completions -H 'content-type: application/json' -d '{"model":"synthetic:tiny-qwen2","prompt":[1,2,3,4],"max_tokens":8,"temperature":0}'; echo
curl -s localhost:8123/v1/backends | head -c 600; echo
ps -eo pid,ppid,rss,cmd | grep -E "mvllm|forkserver|multiprocessing" | grep -v grep | cut -c1-160
kill %1; wait
tail -5 $OUT/serve.log
