"""The shape of the code: no import cycle between modules or packages (imports inside functions count), a
command line that starts without torch, a tracked tree of code rather than data, and no block of code copied
between two files of mvllm/."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mvllm"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The mvllm modules `path` imports anywhere in it (a `from pkg import name` counts pkg.name where that
    is a module, else pkg)."""
    this = module_name(path)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
    return {m for m in found if m in modules and m not in (this, "mvllm")}


def graph() -> dict[str, set[str]]:
    files = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(f) for f in files}
    return {module_name(f): imports_of(f, modules) for f in files}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each a cycle's members."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(edges):
        if v not in index:
            visit(v)
    return out


def package_of(module: str) -> str:
    """mvllm.engine.engine -> engine; a top-level module (mvllm.cli) is its own package."""
    return module.split(".")[1] if module.count(".") else module


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle_between_modules():
    assert cycles(graph()) == []


def test_no_import_cycle_between_packages():
    packages: dict[str, set[str]] = {}
    for module, deps in graph().items():
        for dep in deps:
            if package_of(dep) != package_of(module):
                packages.setdefault(package_of(module), set()).add(package_of(dep))
    assert cycles(packages) == []


@pytest.mark.parametrize("module", ["mvllm.cli", "mvllm.report", "mvllm.simulate.sim"])
def test_light_modules_import_no_torch(module):
    """`mvllm --help`, `report` and `simulate` start without torch (4 s of imports on this machine)."""
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", f"import {module}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    loaded = {line.split("|")[-1].strip() for line in out.stderr.splitlines() if "|" in line}
    assert not {"torch", "fastapi", "transformers"} & loaded


def test_the_tracked_tree_is_small():
    try:
        files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, timeout=60,
                               check=True).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    size = sum((ROOT / f).stat().st_size for f in files if f and (ROOT / f).is_file())
    assert size <= 10 * 2**20, f"the tracked tree is {size / 2**20:.1f} MiB"


def windows(path: Path, n: int = 6):
    """Every run of n consecutive code lines of a file (blank lines, comments and docstring-only lines left
    out), stripped of indentation."""
    lines = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        text = line.strip()
        if text and not text.startswith("#") and not re.fullmatch(r"[\])}]+,?|\"\"\"|else:|try:|return", text):
            lines.append((number, text))
    for i in range(len(lines) - n + 1):
        yield lines[i][0], "\n".join(t for _, t in lines[i:i + n])


def test_no_block_of_code_is_copied_between_files():
    seen: dict[str, tuple[Path, int]] = {}
    copies = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for line, block in windows(path):
            first = seen.setdefault(block, (path, line))
            if first[0] != path:
                copies.append(f"{path.relative_to(ROOT)}:{line} = {first[0].relative_to(ROOT)}:{first[1]}")
    assert not copies, "\n".join(copies[:10])


PATH_NAMED = re.compile(r"(?<![\w/<.-])((?:[A-Za-z_][\w.-]*/)+[\w-]+\.(?:py|cpp|h|toml|md|json))\b")


def test_every_path_a_comment_names_exists():
    """A docstring or comment in mvllm/ that names a file (engine/quant.py, docs/routing.md) names one that is
    there: relative to the repository, mvllm/, a package of it, or the naming file's folder."""
    bases = [ROOT, PACKAGE] + [d for d in PACKAGE.iterdir() if d.is_dir()]
    missing = []
    for path in sorted([*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.cpp"), *PACKAGE.rglob("*.h")]):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.lstrip().startswith("#include"):
                continue
            for name in PATH_NAMED.findall(line):
                if not any((base / name).exists() for base in [*bases, path.parent]):
                    missing.append(f"{path.relative_to(ROOT)}:{number}: {name}")
    assert missing == []


def test_every_environment_variable_read_is_registered():
    """mvllm/knobs.py lists every MVLLM_* name in mvllm/ (Python and C++) and no other; docs/knobs.md is its table."""
    from mvllm.knobs import NAMES, markdown

    found = set()
    for path in [*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.cpp"), *PACKAGE.rglob("*.h")]:
        if path.name != "knobs.py":
            found |= set(re.findall(r"\bMVLLM_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    assert found - NAMES == set(), "read but not in mvllm/knobs.py"
    assert NAMES - found == set(), "in mvllm/knobs.py but read nowhere"
    assert len(NAMES) <= 10, "a tuning value is a named constant in the kernel, not a variable"
    assert (ROOT / "docs/knobs.md").read_text().endswith(markdown())


def test_tests_import_nothing_from_experiments_by_path():
    for path in (ROOT / "tests").glob("*.py"):
        text = path.read_text()
        assert not re.search(r"sys\.path\.(insert|append)\([^)]*experiments", text), path.name


def test_readme_and_docs_name_no_commits():
    """README.md and docs/ say how things work now; commits and their history live in git and results/."""
    found = [f"{path.name}:{n}" for path in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
             for n, line in enumerate(path.read_text().splitlines(), 1) if re.search(r"\b[0-9a-f]{7,40}\b", line)]
    assert found == []
