"""The guides stay true: every relative link in README.md and docs/ resolves, and every fenced `python` or
`sh` block runs as written.

Each block runs on its own, in a scratch directory laid out like the repository: tiny random checkpoints
stand in for weights/smollm2-135m-instruct (a Llama) and weights/t5-base, small made-up SuperGLUE files
for data/superglue, examples/ is copied, and `source .venv/bin/activate` puts this Python's `capt` and
`python` first on the PATH. A block whose info string says `excerpt` (part of something larger),
`real-weights` (needs the real checkpoint and minutes of CPU) or `gpu` is not run; `text`, `json` and
other languages are output or data.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import tiny_llama, tiny_t5, write_superglue

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RUNNABLE = {"python", "sh"}
NOT_RUN = {"excerpt": "part of something larger", "real-weights": "needs the real checkpoint and minutes of CPU",
           "gpu": "needs CUDA GPUs", "timing": "a timing: minutes of CPU, and its figures are what it is for"}
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def blocks() -> list[tuple[str, int, str, str]]:
    """(page, line, info string, code) of every fenced block."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for m in FENCE.finditer(text):
            found.append(
                (page.relative_to(REPO).as_posix(), text[: m.start()].count("\n") + 1, m.group(1).strip(), m.group(2))
            )
    return found


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings."""
    out = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", title)))
    return out


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        text = FENCE.sub("", page.read_text())  # links inside code are code
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.name}: {target} (no {path})")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                broken.append(f"{page.name}: {target} (no heading #{anchor} in {file.name})")
    assert broken == []


def test_the_scan_finds_the_blocks():
    found = blocks()
    kinds = {info.split()[0] for _, _, info, _ in found if info}
    assert {"python", "sh"} <= kinds and len([b for b in found if b[2] in RUNNABLE]) >= 10
    unknown = [(page, line, info) for page, line, info, _ in found
               if info.split()[:1] and info.split()[0] in RUNNABLE and set(info.split()[1:]) - set(NOT_RUN)]
    assert unknown == [], "an info string word this test does not know"
    bare = [(page, line) for page, line, info, _ in found if not info]
    assert bare == [], "say what a block is: python, sh, text, json ..."


def test_the_readmes_demo_output_is_what_the_demo_printed():
    """README.md's excerpt of `make demo` is, line for line, what the committed seed-0 run printed
    (results/smollm2-135m-cpu-demo/seed0/demo.txt, made by its run.sh), its run directory aside."""
    excerpt = next(code for page, _, info, code in blocks()
                   if page == "README.md" and info == "text excerpt" and "test set" in code)
    printed = (
        (REPO / "results" / "smollm2-135m-cpu-demo" / "seed0" / "demo.txt")
        .read_text()
        .replace("runs/demo-seed0", "runs/demo")
    )
    missing = [line for line in excerpt.splitlines() if line not in printed.splitlines()]
    assert len(excerpt.splitlines()) >= 6 and missing == []


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A repository-like directory with tiny stand-ins; each block gets a fresh copy of it."""
    root = tmp_path_factory.mktemp("docs-template")
    tiny_llama(root / "weights" / "smollm2-135m-instruct")
    tiny_t5(root / "weights" / "t5-base")
    write_superglue(root / "data" / "superglue", {"CB": (48, 12), "COPA": (40, 10)})
    shutil.copytree(REPO / "examples", root / "examples")
    bin_dir = root / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "activate").write_text(f'export PATH="{Path(sys.executable).parent}:$PATH"\n')
    for name in ("python", "python3"):
        (bin_dir / name).symlink_to(sys.executable)
    return root


RUNS = [
    (page, line, info, code) for page, line, info, code in blocks() if info.split()[:1] and info.split()[0] in RUNNABLE
]


@pytest.mark.parametrize("page, line, info, code", RUNS, ids=[f"{p}:{n}" for p, n, _, _ in RUNS])
def test_the_block_runs_as_written(scratch, tmp_path, page, line, info, code):
    reason = next((NOT_RUN[w] for w in info.split()[1:] if w in NOT_RUN), None)
    if reason:
        pytest.skip(f"{page} line {line}: {reason}")
    here = tmp_path / "repo"
    shutil.copytree(scratch, here, symlinks=True)
    env = {k: v for k, v in os.environ.items() if k != "CAPT_DATA"}  # as a new user: the shipped data/superglue
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", TQDM_DISABLE="1", MPLBACKEND="Agg")
    command = ["bash", "-euo", "pipefail", "-c", code] if info.startswith("sh") else [sys.executable, "-c", code]
    done = subprocess.run(command, cwd=here, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{page} line {line} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
