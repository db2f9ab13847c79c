"""Host timeline of engine decode steps, no added syncs: where the step's wall time goes."""
import sys, time, torch
from collections import defaultdict
from mvllm import LLM, SamplingParams
import mvllm.engine.model_runner as mr
torch.set_grad_enabled(False)
model = sys.argv[1]
llm = LLM(model, device="cuda", dtype="bfloat16", max_active=16, num_blocks=1000)
eng = llm.engine; r = eng.runner
acc = defaultdict(list)
def wrap(obj, name, label):
    fn = getattr(obj, name)
    def w(*a, **k):
        t = time.perf_counter(); out = fn(*a, **k); acc[label].append((time.perf_counter() - t) * 1e6); return out
    setattr(obj, name, w)
wrap(eng.scheduler, "schedule", "schedule"); wrap(eng.scheduler, "postprocess", "postprocess")
wrap(r.graphs, "pack", "pack"); wrap(r, "run", "runner.run"); wrap(mr, "sample", "sample(wait)")
orig = torch.cuda.CUDAGraph.replay
def rp(self):
    t = time.perf_counter(); orig(self); acc["replay call"].append((time.perf_counter() - t) * 1e6)
torch.cuda.CUDAGraph.replay = rp
g = torch.Generator().manual_seed(0); vocab = eng.source.config.vocab_size - 1
for b in (1, 4, 16):
    seqs = [eng.add_request(torch.randint(0, vocab, (570,), generator=g).tolist(),
            SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)) for _ in range(b)]
    for _ in range(5): eng.step()
    acc.clear(); steps = []
    for _ in range(40):
        t = time.perf_counter(); eng.step(); steps.append((time.perf_counter() - t) * 1e6)
    med = lambda x: sorted(x)[len(x) // 2]
    print(f"b{b}: step {med(steps):.0f} us; " + ", ".join(f"{k} {med(v):.0f}" for k, v in acc.items()), flush=True)
    while eng.has_unfinished(): eng.step()
