import sys, torch
a, b = torch.load(sys.argv[1]), torch.load(sys.argv[2])
print(sys.argv[1], a["path"], a["amx"], "|", b["path"], b["amx"])
assert a.keys() == b.keys()
bad = [k for k in a if isinstance(a[k], torch.Tensor) and not torch.equal(a[k], b[k])]
print("tensors", sum(isinstance(v, torch.Tensor) for v in a.values()), "differ", len(bad), bad[:10])
