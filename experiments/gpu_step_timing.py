"""Where a GPU engine step's host time goes (compiled against plain), and cold prefill with the new buckets."""
import sys, time, torch
from mvllm import LLM, SamplingParams
torch.set_grad_enabled(False)
model = sys.argv[1] if len(sys.argv) > 1 else "synthetic:qwen2.5-0.5b"
greedy = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
acc = {}
def timer(obj, name, label):
    fn = getattr(obj, name)
    def wrapped(*a, **k):
        torch.cuda.synchronize(); t = time.perf_counter(); out = fn(*a, **k); torch.cuda.synchronize()
        acc.setdefault(label, []).append((time.perf_counter() - t) * 1000); return out
    setattr(obj, name, wrapped)
for kw in (dict(), dict(compile=False)):
    t0 = time.perf_counter()
    llm = LLM(model, device="cuda", dtype="bfloat16", max_active=16, num_blocks=400, **kw)
    print(kw or "compiled", f"ready {time.perf_counter()-t0:.1f} s", flush=True)
    eng, r = llm.engine, llm.engine.runner
    g = torch.Generator().manual_seed(0); vocab = eng.source.config.vocab_size - 1
    for b in (1, 4, 16):
        seqs = [eng.add_request(torch.randint(0, vocab, (570,), generator=g).tolist(), greedy(60)) for _ in range(b)]
        eng.step(); eng.step()
        plain = []
        for _ in range(20):
            torch.cuda.synchronize(); t = time.perf_counter(); eng.step(); plain.append((time.perf_counter() - t) * 1000)
        acc.clear()
        timer(eng.scheduler, "schedule", "schedule"); timer(r.graphs, "pack", "pack"); timer(r.graphs, "run", "graphs.run")
        timer(r, "run", "runner.run"); timer(eng.scheduler, "postprocess", "postprocess")
        import mvllm.engine.model_runner as mr
        orig_sample = mr.sample; 
        def s2(*a):
            torch.cuda.synchronize(); t = time.perf_counter(); out = orig_sample(*a); acc.setdefault("sample", []).append((time.perf_counter()-t)*1000); return out
        mr.sample = s2
        for _ in range(20): eng.step()
        mr.sample = orig_sample
        for name in ("schedule", "pack", "graphs.run", "runner.run", "postprocess"):
            delattr(eng.scheduler if name in ("schedule", "postprocess") else r.graphs if name in ("pack", "graphs.run") else r, name.split(".")[-1])
        key = r.graphs.bucket([(len(s) - 1, len(s)) for s in seqs])
        torch.cuda.synchronize(); t = time.perf_counter()
        for _ in range(50): r.graphs.graphs[key].replay()
        torch.cuda.synchronize(); replay = (time.perf_counter() - t) / 50 * 1000
        med = lambda x: sorted(x)[len(x) // 2]
        print(f"{kw or 'compiled'} b{b}: step {med(plain):.3f} ms; replay alone {replay:.3f}; " +
              ", ".join(f"{k} {med(v):.3f}" for k, v in acc.items()), flush=True)
        while eng.has_unfinished(): eng.step()
    for n in (516, 516, 516, 1024):
        p = torch.randint(0, vocab, (n,), generator=g).tolist()
        torch.cuda.synchronize(); t = time.perf_counter()
        eng.add_request(p, greedy(1)); eng.step(); torch.cuda.synchronize()
        print(f"{kw or 'compiled'} cold prefill {n}: {(time.perf_counter()-t)*1000:.2f} ms", flush=True)
    del llm, eng, r; torch.cuda.empty_cache()
