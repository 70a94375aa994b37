"""The package's layering, read from the source with ast: no import cycle inside capt/, no
function-level import of capt's own modules (the trick that hides a cycle), and each model file
importing only the ops below it."""

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "capt"


def capt_imports(file: Path) -> list[tuple[str, bool]]:
    """(imported capt module, at module level?) for every import of capt's own modules in file."""
    tree = ast.parse(file.read_text())
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names = [node.module] if node.module else [a.name for a in node.names]
            found += [(name.split(".")[0], id(node) in top) for name in names]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("capt"):
            found.append(((node.module.split(".") + ["__init__"])[1], id(node) in top))
    return found


def graph() -> dict[str, set[str]]:
    modules = {f.stem for f in PACKAGE.glob("*.py")}
    edges = {}
    for file in PACKAGE.glob("*.py"):
        edges[file.stem] = {m if m in modules else "__init__" for m, _ in capt_imports(file)} - {file.stem}
    return edges


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


def test_no_import_cycle():
    assert find_cycle(graph()) is None, " -> ".join(find_cycle(graph()))


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_capt_modules_are_imported_at_module_level():
    # the one exception: ops imports the Triton kernel lazily (importing Triton costs ~1 s, and only a GPU uses it)
    late = [(f.name, m) for f in PACKAGE.glob("*.py") for m, top in capt_imports(f) if not top and (f.stem, m) != ("ops", "fused")]
    assert late == []


@pytest.mark.parametrize("family", ["t5", "llama"])
def test_model_files_import_only_the_layers_below(family):
    assert graph()[family] <= {"ops", "sampling", "errors", "checks"}


def test_layers_only_look_down():
    layers = [{"errors", "checks", "sampling", "taskfile", "tasks"}, {"fused", "ops"}, {"protocol", "t5", "llama"}, {"methods"},
              {"hub", "load", "tokenizer", "distributed"}, {"hf"}, {"evaluate", "predict"}, {"rundir", "batches", "stepscale"}, {"plots"}, {"trainer"}, {"report"},
              {"experiment"}, {"analysis"},
              {"cli", "demo", "data", "__init__", "__main__"}]
    level = {m: i for i, group in enumerate(layers) for m in group}
    assert set(level) == {f.stem for f in PACKAGE.glob("*.py")}, "a module without a layer: add it to this test"
    upward = [(m, d) for m, deps in graph().items() for d in deps if level[d] > level[m] and d != "__init__"]
    assert upward == []


def test_no_module_is_too_long():
    long = {f.name: n for f in PACKAGE.glob("*.py") if (n := len(f.read_text().splitlines())) > 700}
    assert long == {}


def test_both_families_keep_the_model_contract():
    from capt.load import build_model
    from capt.protocol import CaptModel

    t5 = build_model({"model_type": "t5", "vocab_size": 64, "d_model": 16, "d_kv": 4, "d_ff": 32, "num_layers": 2, "num_heads": 4})
    llama = build_model({"model_type": "llama", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
                         "num_hidden_layers": 2, "num_attention_heads": 4})
    for model in (t5, llama):
        assert isinstance(model, CaptModel)
        assert model.method is None and model.prompt is None and model.linear_head is None
        assert all(b.capsule is None and b.capsule_active is None and b.deep_prompt is None for b in model.capsule_blocks())
        assert model.tasks is None
        assert all(a.prefix_k is None and a.prefix_v is None for a in model.prefix_attentions())
    assert t5.seq2seq and not llama.seq2seq


def test_every_docs_reference_resolves():
    root = PACKAGE.parent
    files = [f for pattern in ("capt/*.py", "tests/*.py", "bench/*.py", "bench/*.md", "*.md", "docs/*.md", "weights/*")
             for f in root.glob(pattern) if f.is_file()]
    refs = {(f.name, m.group(1)) for f in files for m in re.finditer(r"\bdocs/([\w.-]+\.md)", f.read_text(errors="replace"))}
    assert refs, "the scan finds nothing: its pattern is wrong"
    assert [(f, r) for f, r in sorted(refs) if not (root / "docs" / r).is_file()] == []
