"""Bits of the int8 kernel and the fused attention under this process's tree and env, saved for an old/new compare.
usage: python bits.py OUT.pt"""
import sys, torch
from mvllm.kernels import cpu_int8 as ck, cpu_fused
assert ck.available(), ck.why_unavailable
out = {"path": ck.build_info()["path"], "amx": ck.amx()}
gen = torch.Generator().manual_seed(3)
rows_list = (1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 17, 20, 24, 25, 31, 32, 33, 48, 64, 100, 300, 516)
for (o, i) in ((1936, 896), (896, 4864), (9728, 896), (160, 960)):
    q, s = ck.quantize_weight(torch.randn(o, i, generator=gen))
    b = torch.randn(o, generator=gen)
    x = torch.randn(516, i, generator=gen)
    packed = ck.pack(q, s) if ck.packs() else (q, s)
    for threads in (16, 3, 1):
        torch.set_num_threads(threads)
        for r in rows_list:
            out[f"{o}x{i}/t{threads}/r{r}"] = ck.int8_linear(x[:r], *packed, b)
            if threads == 16:
                out[f"{o}x{i}/flat/r{r}"] = ck.int8_linear(x[:r], q, s, b)  # [out, in]: the float path
torch.set_num_threads(16)
if cpu_fused.available():
    for mode in (None, 0, 1, 2):
        old = cpu_fused.attention_knob("lanes", mode) if mode is not None else None
        for d, heads, kv in ((64, 14, 2), (64, 9, 3)):
            bs, blocks = 16, 140
            cache = torch.randn(2, blocks * bs, kv, d, generator=gen)
            seqs = [(0, 516), (496, 516), (300, 301), (40, 80)]
            table = torch.arange(4 * 33).view(4, 33)
            qs, seq_of, klen = [], [], []
            for si, (a, e) in enumerate(seqs):
                for p in range(a, e):
                    seq_of.append(si); klen.append(p + 1)
            T = len(seq_of)
            q = torch.randn(T, heads, d, generator=gen)
            y = cpu_fused.paged_attention(q, cache, table, torch.tensor(seq_of), torch.tensor(klen), bs, d ** -0.5)
            out[f"attn/{mode}/{heads}x{kv}"] = y
        if old is not None:
            cpu_fused.attention_knob("lanes", old)
torch.save(out, sys.argv[1])
print("saved", len(out), out["path"], out["amx"])
