"""The floor plan holds: no import cycle among gearlab's modules, each package imports only the packages below it,
no module imports its own plug-ins, the public API answers at its documented paths, and nothing in the
repository points at a document outside it.

Imports are read statically (``ast``), every ``import`` statement counted — also those inside functions, which
a runtime check would miss. The plug-in loaders import their plug-ins by computed names (``importlib``), the one
deliberate upward arrow, which is not an import statement.
"""
from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
# bottom to top: a package may import only packages listed before it (and itself)
LAYERS = ["cpu_kernels", "plugins", "errors", "stopping", "envs", "parallel", "core", "config_schema", "config",
          "config_help", "tasks", "signals", "credit", "rollout", "models", "trainer", "commands", "cli"]
SHIMS = {"grpo", "batch", "logprobs"}  # the public API's stable top-level paths, re-exporting gearlab.core


def _modules() -> dict[str, Path]:
    out = {}
    for p in (ROOT / "gearlab").rglob("*.py"):
        name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p
    return out


def _runtime_nodes(tree: ast.AST):
    """Every node except those under ``if TYPE_CHECKING:`` (imports for type hints only, never executed)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and isinstance(child.test, ast.Name) and child.test.id == "TYPE_CHECKING":
                stack.extend(child.orelse)
                continue
            stack.append(child)


def _imports(path: Path, mods: dict[str, Path]) -> set[str]:
    found = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        else:
            continue
        for t in targets:
            while t and t not in mods:
                t = t.rpartition(".")[0]
            if t:
                found.add(t)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(p, mods) - {m, "gearlab"} for m, p in mods.items()}


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "gearlab"


def test_no_import_cycles():
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert cycles == [], f"import cycles: {cycles}"
    assert len(graph) > 50  # the walk saw the whole package


def test_packages_import_only_the_layers_below():
    bad = []
    for m, deps in _graph().items():
        pkg = _package(m)
        if pkg in SHIMS:
            assert deps <= {f"gearlab.core.{pkg}", "gearlab.core"}, (m, deps)
            continue
        if m == "gearlab":  # the package root pins the CPU kernels before anything else runs, and does nothing else
            assert deps == {"gearlab.cpu_kernels"}, deps
            continue
        for d in deps:
            dp = _package(d)
            if dp != pkg and (dp in SHIMS or LAYERS.index(dp) >= LAYERS.index(pkg)):
                bad.append(f"{m} imports {d}")
    assert bad == [], "\n".join(bad)


def test_no_module_imports_its_plugins():
    graph = _graph()
    # concrete tasks and signals are found by the registries' loaders, never imported by the interfaces
    tasks = {
        m for m in graph if m.startswith("gearlab.tasks.") and m not in ("gearlab.tasks.base", "gearlab.tasks.registry")
    }
    assert not graph["gearlab.tasks.base"] & tasks and not graph["gearlab.tasks.registry"] & tasks
    assert not graph["gearlab.tasks"] & tasks
    signal_modules = {"gearlab.signals.saliency", "gearlab.signals.spans"}
    assert not (graph["gearlab.signals.registry"] | graph["gearlab.signals.provider"]) & signal_modules
    # no gearlab module imports a credit method
    for m, p in _modules().items():
        src = p.read_text()
        assert not re.search(r"^\s*(from|import)\s+(gearlab\.)?assigners\b", src, flags=re.M), m


def test_public_api_at_its_documented_paths():
    from gearlab.batch import RolloutBatch
    from gearlab.config import load_config
    from gearlab.credit import CreditAssigner, CreditOutput, Signal, available, build, register
    from gearlab.envs.sandbox import run
    from gearlab.grpo import aggregate, group_advantages, kl_penalty, policy_loss
    from gearlab.logprobs import token_kl, token_logprobs
    from gearlab.tasks import get_task

    import gearlab.core.batch
    import gearlab.core.grpo
    import gearlab.core.logprobs

    assert RolloutBatch is gearlab.core.batch.RolloutBatch and group_advantages is gearlab.core.grpo.group_advantages
    assert token_logprobs is gearlab.core.logprobs.token_logprobs
    assert all(callable(f) for f in (load_config, available, build, register, run, aggregate, kl_penalty, policy_loss,
                                     token_kl, get_task))
    assert isinstance(build("grpo"), CreditAssigner) and Signal.ENTROPY == "entropy"
    assert CreditOutput(token_advantages=torch.zeros(1, 2)).loss_mask is None  # None = the response mask


def test_assigners_are_discovered_through_the_documented_entry_point_group(monkeypatch):
    """The README tells plug-in packages to declare ``[project.entry-points."gearlab.assigners"]``: the registry's
    loader must read that group and import what it names (tests/credit/test_api.py installs such a package)."""
    import importlib.metadata

    from gearlab import credit, plugins

    assert credit.ENTRY_POINT_GROUP == "gearlab.assigners"
    assert '[project.entry-points."gearlab.assigners"]' in (ROOT / "README.md").read_text()
    loaded, asked = [], []

    class Probe:
        def load(self) -> None:
            loaded.append("probe")

    def entry_points(*, group: str) -> list[Probe]:
        asked.append(group)
        return [Probe()] if group == "gearlab.assigners" else []

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    monkeypatch.setattr(plugins, "_LOADED", set())  # discovery runs once per process: start it afresh
    credit.available()
    assert asked == ["gearlab.assigners"] and loaded == ["probe"]


def test_nothing_points_outside_the_repository():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    pattern = re.compile(r"\.\./shared|(?<![\w/])(methods|anchors|gpu-notes|environment)\.md\b")
    hits = []
    for f in files:
        p = ROOT / f
        if p.suffix in {
            ".py", ".md", ".yaml", ".sh", ".toml", ".txt"
        } and p.is_file() and f != "tests/test_architecture.py":
            for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
                if pattern.search(line):
                    hits.append(f"{f}:{i}: {line.strip()[:100]}")
    assert hits == [], "\n".join(hits[:20])
    # and every docs/ link in the repository resolves to a file that exists
    missing = set()
    for f in files:
        p = ROOT / f
        if p.suffix in {".py", ".md", ".yaml"} and p.is_file():
            for m in re.finditer(r"docs/[\w/.-]+\.md", p.read_text(errors="replace")):
                if not (ROOT / m.group(0)).is_file():
                    missing.add(f"{f}: {m.group(0)}")
    assert not missing, sorted(missing)


def test_choice_lists_have_one_place():
    """The config validates the core's own lists (not copies that could drift), and the typed errors are one class."""
    from gearlab import config, errors
    from gearlab.core import grpo

    assert config._CHOICES["algorithm.agg"] is grpo.AGG_MODES and config._CHOICES["algorithm.kl_kind"] is grpo.KL_KINDS
    assert config.ConfigError is errors.ConfigError
    cfg = config.load_config(["algorithm.kl_kind=low_var_kl"])  # a kind the core knows is a kind the config accepts
    assert cfg.algorithm.kl_kind == "low_var_kl"
    lp = torch.tensor([[-0.5, -2.0]])
    assert grpo.kl_penalty(lp, lp, cfg.algorithm.kl_kind).tolist() == [[0.0, 0.0]]  # and the core computes it


def test_per_group_sums_go_through_bin_sum():
    """``index_add_`` adds with atomics on CUDA, in an order that changes from run to run; a per-group float sum made
    with it makes a GPU run stop repeating after its first update (gearlab.core.reduce). Only ``bin_sum`` calls it."""
    calls = []
    for p in [*(ROOT / "gearlab").rglob("*.py"), *(ROOT / "assigners").rglob("*.py")]:
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("index_add_", "index_add"):
                calls.append(str(p.relative_to(ROOT)))
    assert calls == ["gearlab/core/reduce.py"] * 2, calls  # its CPU branch and its CUDA branch
