"""The names of the engine's quant modes, importable without torch: the server checks a backend spec against
them before any worker starts. What each mode does: engine/quant.py."""

QUANTS = ("none", "int8w", "int8-lossy")
LOSSY = ("int8-lossy",)
RENAMED = {"int8": "int8-lossy"}
