"""The package's shape, enforced: layer order, torch only in the executor, files under 400 lines,
and each policy object assembled in one place (docs/architecture.md)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "talaria"

# Low to high: a module imports only its own layer and those below (docs/architecture.md).
LAYERS = [
    {"contracts", "config"},
    {"models"},
    {"memory"},
    {"instance"},
    {"executor"},
    {"node"},
    {"routing"},
    {"gateway"},
    {"sim", "replay", "trace", "tui"},
    {"cli"},
]
NEVER = {"sim": {"executor", "node"}, "tui": {"executor", "node"}}  # they run where no engine does
# (importing module, imported module) -> why the upward import is right; at most 5 entries
ALLOWED = {
    ("talaria.config.loader", "talaria.models.synthetic"):
        "a synthetic model's shape is in the config file, so the structural check of tp against its "
        "heads needs its architecture; the shape -> architecture rule lives with the synthetic model",
}
MAX_LINES = 400
ONE_PLACE = ("MemoryPlanner", "RoundScheduler", "Scheduler", "Batcher", "HostKVRegistry", "Stager", "CostModel")


def modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = ast.parse(path.read_text(encoding="utf-8"), str(path))
    return out


def imports(tree: ast.Module) -> set[str]:
    """Every talaria module `tree` imports, anywhere in it (function bodies and TYPE_CHECKING too)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}  # `from talaria.x import module`
    return {m for m in found if m.startswith("talaria.")}


def layer(module: str) -> int | None:
    folder = module.split(".")[1]
    return next((i for i, names in enumerate(LAYERS) if folder in names), None)


def test_every_folder_has_a_layer():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set().union(*LAYERS)


def test_no_module_imports_a_higher_layer():
    known = modules()
    wrong = []
    for name, tree in known.items():
        if name == "talaria":
            continue
        for target in imports(tree):
            if target not in known and target.rsplit(".", 1)[0] in known:
                continue  # `from talaria.x import name`: the module itself is counted
            here, there = layer(name), layer(target)
            upward = there is not None and here is not None and there > here
            barred = target.split(".")[1] in NEVER.get(name.split(".")[1], ())
            if (upward or barred) and (name, target) not in ALLOWED:
                wrong.append(f"{name} imports {target}")
    assert not wrong, "imports against the layer order (docs/architecture.md):\n" + "\n".join(sorted(wrong))


def test_the_allow_list_is_short_and_every_entry_is_still_needed():
    assert len(ALLOWED) <= 5
    known = modules()
    for importer, target in ALLOWED:
        assert target in imports(known[importer]), f"{importer} no longer imports {target}: drop the entry"


def test_only_the_executor_imports_torch():
    offenders = []
    for name, tree in modules().items():
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n == "torch" or n.startswith("torch.") for n in names) and not name.startswith("talaria.executor"):
                offenders.append(name)
    assert not offenders, f"torch imported outside talaria/executor/: {sorted(set(offenders))}"


def test_the_gateway_routing_and_simulator_load_without_torch():
    packages = ["talaria.gateway", "talaria.routing", "talaria.sim", "talaria.node", "talaria.tui"]
    script = ("import importlib, pkgutil, sys\n"
              f"for pkg in {packages!r}:\n"
              "    p = importlib.import_module(pkg)\n"
              "    for m in pkgutil.walk_packages(p.__path__, pkg + '.'):\n"
              "        importlib.import_module(m.name)\n"
              "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_file_is_over_400_lines(path):
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(PACKAGE.parent)} has {lines} lines; split it by responsibility"


def test_policy_objects_are_constructed_only_in_the_assembly():
    places: dict[str, list[str]] = {cls: [] for cls in ONE_PLACE}
    pattern = re.compile(r"(?<![\w.])(" + "|".join(ONE_PLACE) + r")\(")
    for path in sorted(PACKAGE.rglob("*.py")):
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            code = line.split("#", 1)[0]
            if code.lstrip().startswith(("class ", "def ")):
                continue
            for cls in pattern.findall(code):
                places[cls].append(f"{path.relative_to(PACKAGE.parent)}:{i}")
    assembly = "talaria/instance/assembly.py"
    elsewhere = {cls: [p for p in where if not p.startswith(assembly)] for cls, where in places.items()}
    assert all(len(where) == 1 for where in places.values()), places
    assert not any(elsewhere.values()), elsewhere
