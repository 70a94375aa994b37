"""The package's layering and habits, read from the source: no import cycle inside capt/, no
function-level import of capt's own modules (the trick that hides a cycle), layers that only look
down (the models below the methods, the library below the entry points in capt/cli), the audit
target (capt/models) within its budget, ruff's checks clean, and long functions named."""

import ast
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "capt"
AUDIT_BUDGET = 1900  # lines of capt/models: the two families, ops, the fused kernel, the protocol, sampling
FUNCTION_SOFT_LIMIT = 80  # lines; longer functions are named in a warning


def module_name(file: Path) -> str:
    """capt/models/llama.py -> models.llama; capt/__init__.py -> __init__; capt/cli/__init__.py -> cli.__init__."""
    return ".".join(file.relative_to(PACKAGE).with_suffix("").parts)


MODULES = {module_name(f): f for f in PACKAGE.rglob("*.py")}


def resolve(name: str) -> str:
    """A dotted path under capt as a module of MODULES (a package is its __init__)."""
    if name == "":
        return "__init__"
    return name if name in MODULES else f"{name}.__init__"


def capt_imports(file: Path) -> list[tuple[str, bool]]:
    """(imported capt module, at module level?) for every import of capt's own modules in file."""
    tree = ast.parse(file.read_text())
    top = {id(node) for node in tree.body}
    package = module_name(file).split(".")[:-1]  # the package this module is in (an __init__'s: its own)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:  # from .x import y, from .. import z
            base, module = package[:len(package) - (node.level - 1)], node.module
        elif (node.module or "").split(".")[0] == "capt":  # from capt.x import y
            base, module = [], node.module.partition(".")[2] or None
        else:
            continue
        if module:
            found.append((resolve(".".join(base + module.split("."))), id(node) in top))
        else:  # from . import a, b: modules, or names of the package
            for alias in node.names:
                candidate = ".".join(base + [alias.name])
                found.append((candidate if candidate in MODULES else resolve(".".join(base)), id(node) in top))
    return found


def graph() -> dict[str, set[str]]:
    return {name: {m for m, _ in capt_imports(f)} - {name} for name, f in MODULES.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_import_reader_sees_the_imports():
    assert graph()["models.llama"] >= {"models.ops", "checks"} and "methods" in graph()["trainer"]
    assert graph()["cli.main"] >= {"cli.args", "trainer"} and "models.__init__" in graph()["load"]


def test_no_import_cycle():
    assert find_cycle(graph()) is None, " -> ".join(find_cycle(graph()))


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_capt_modules_are_imported_at_module_level():
    # the one exception: ops imports the Triton kernel lazily (importing Triton costs ~1 s, and only a GPU uses it)
    late = [(name, m) for name, f in MODULES.items() for m, top in capt_imports(f)
            if not top and (name, m) != ("models.ops", "models.fused")]
    assert late == []


@pytest.mark.parametrize("family", ["models.t5", "models.llama"])
def test_model_files_import_only_the_layers_below(family):
    assert graph()[family] <= {"models.ops", "models.sampling", "errors", "checks"}


LAYERS = [
    {"errors", "checks", "taskfile", "tasks", "stats", "runtime"},
    {"models.fused", "models.ops", "models.sampling"},
    {"models.protocol", "models.t5", "models.llama", "models.__init__"},  # the audit target, with the layer below
    {"baselines", "packed"},
    {"methods"},
    {"hub", "load", "tokenizer", "distributed"},
    {"hf"},
    {"evaluate", "predict"},
    {"rundir", "batches", "stepscale", "trainconfig"},
    {"plots"},
    {"trainer"},
    {"cli.report"},  # the entry points: capt/cli
    {"cli.experiment"},
    {"cli.analysis"},
    {"cli.args"},
    {"cli.main", "cli.demo", "cli.data", "cli.__init__", "__init__", "__main__"},
]


def test_layers_only_look_down():
    level = {m: i for i, group in enumerate(LAYERS) for m in group}
    assert set(level) == set(MODULES), f"modules without a layer: {sorted(set(MODULES) - set(level))}: add them here"
    upward = [(m, d) for m, deps in graph().items() for d in deps if level[d] > level[m] and d != "__init__"]
    assert upward == []


def test_the_library_never_imports_the_entry_points():
    library = [name for name in MODULES if not name.startswith("cli.") and name not in ("__main__",)]
    assert [(m, d) for m in library for d in graph()[m] if d.startswith("cli.")] == []


def test_the_audit_target_keeps_its_budget():
    lines = {name: len(f.read_text().splitlines()) for name, f in MODULES.items() if name.startswith("models.")}
    assert sum(lines.values()) <= AUDIT_BUDGET, lines


def functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def test_long_functions_are_named():
    """A soft limit: functions over FUNCTION_SOFT_LIMIT lines are named in a warning (pytest's summary), not refused."""
    long = sorted(
        (
            (node.end_lineno - node.lineno + 1, f"{name}.{node.name}")
            for name, f in MODULES.items()
            for node in functions(ast.parse(f.read_text()))
            if node.end_lineno - node.lineno + 1 > FUNCTION_SOFT_LIMIT
        ),
        reverse=True,
    )
    if long:
        warnings.warn(f"functions over {FUNCTION_SOFT_LIMIT} lines: " + ", ".join(f"{n} ({k})" for k, n in long))
    assert all(k < 3 * FUNCTION_SOFT_LIMIT for k, _ in long), long  # and none three times as long


def test_the_length_finder_counts_lines():
    tree = ast.parse("def f():\n    a = 1\n    return a\n")
    assert [(n.end_lineno - n.lineno + 1) for n in functions(tree)] == [3]


def ruff() -> list[str]:
    found = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if found is None:
        pytest.skip("ruff is not installed (make setup installs it with the test extra)")
    return [found]


def test_ruff_finds_nothing():
    """pyproject.toml's [tool.ruff]: lines of at most 120 characters and pyflakes' checks, over capt, bench, tests."""
    result = subprocess.run([*ruff(), "check", "--no-cache", "capt", "bench", "tests", "weights"], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:]


def test_ruff_would_find_a_long_line(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nx = '" + "a" * 130 + "'\n")
    result = subprocess.run([*ruff(), "check", "--no-cache", "--config", str(ROOT / "pyproject.toml"), str(bad)],
                            capture_output=True, text=True)
    assert result.returncode == 1 and "E501" in result.stdout and "F401" in result.stdout


def test_both_families_keep_the_model_contract():
    from capt.load import build_model
    from capt.models.ops import Attend
    from capt.models.protocol import CaptModel

    t5 = build_model(
        {"model_type": "t5", "vocab_size": 64, "d_model": 16, "d_kv": 4, "d_ff": 32, "num_layers": 2, "num_heads": 4}
    )
    llama = build_model({"model_type": "llama", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
                         "num_hidden_layers": 2, "num_attention_heads": 4})
    for model in (t5, llama):
        assert isinstance(model, CaptModel)
        assert model.method is None and model.front is None and model.linear_head is None
        assert all(b.capsule is None and b.capsule_active is None and b.entry is None for b in model.capsule_blocks())
        assert model.tasks is None
        assert all(a.prefix is None and isinstance(a.attend, Attend) for a in model.prefix_attentions())
    assert t5.seq2seq and not llama.seq2seq


def test_every_docs_reference_resolves():
    files = [
        f
        for pattern in ("capt/**/*.py", "tests/*.py", "bench/*.py", "bench/*.md", "*.md", "docs/*.md", "weights/*")
        for f in ROOT.glob(pattern)
        if f.is_file()
    ]
    refs = {
        (f.name, m.group(1)) for f in files for m in re.finditer(r"\bdocs/([\w.-]+\.md)", f.read_text(errors="replace"))
    }
    assert refs, "the scan finds nothing: its pattern is wrong"
    assert [(f, r) for f, r in sorted(refs) if not (ROOT / "docs" / r).is_file()] == []
