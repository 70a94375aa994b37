"""The evidence program (docs/results.md, "Does CaPT beat its baselines?"): every run, one at a time, resumable.

    python bench/evidence.py run --out runs/evidence            # the next runs of the plan, until done or stopped
    python bench/evidence.py run --out runs/evidence --code DIR  # DIR: a checkout of the pinned commit
    python bench/evidence.py run --out runs/evidence --code DIR --code DIR2  # DIR2: an amendment's commit
    python bench/evidence.py status --out runs/evidence          # what is done, what is left, the CPU hours so far
    python bench/evidence.py table --out runs/evidence --results results/smollm2-135m-cpu-evidence
    python bench/evidence.py same --code DIR --out /tmp/same      # does this checkout compute what DIR does?

The plan is fixed here and written to OUT/program.json on the first start, with the commit of the
code that makes every run, and an amendment's with its own commit (AMENDMENTS) once it is made; a
start refuses code at any other commit (`--code` names a checkout to run from, by default this
repository; once for each commit). Each run is one `capt` process: `capt eval` for zero-shot, `capt
train` for a trained method (resumed exactly from its state.pt when it was cut off), `capt run
--lengths` for the length searches (their run at the grid's length copied from the grid where it is
still here). A finished run is skipped. Each run directory gets made-at.json (the commit, processor,
torch and Python versions, the command, its wall and CPU time over all its processes, and the
machine's mean load while it ran, which says whether it had the cores to itself). A finished run's
records name paths relative to the repository, the data directory as $CAPT_DATA (make_portable), so
that they read the same on any machine. OUT/.lock keeps a second driver out. Ctrl-C, or `kill PID`
for a driver in the background, stops it and its run with the run's state saved (capt's own stop);
the next start resumes that run. The table command reads the finished runs, compares every method
with CaPT on the same test rows (capt/stats.py) and applies the decision rule fixed in
docs/results.md.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import platform
import re
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WEIGHTS = Path(os.environ.get("EVIDENCE_WEIGHTS") or ROOT / "weights" / "smollm2-135m-instruct")
DATA = Path(os.environ.get("CAPT_DATA") or ROOT / "data" / "superglue")  # SuperGLUE's RTE, WiC and MultiRC files

# The program, fixed before the first run (docs/results.md states it and why).
TASKS = ["wic", "rte", "multirc"]  # in the order they run; MultiRC last, if the budget allows
SEEDS = [0, 1, 2]
BUDGET = ["--epochs", "10", "--patience", "3", "--select", "loss", "--train-rows", "2000", "--validation-rows", "200"]
# Each baseline's rate: a 3-point grid on seed 0's validation gold NLL, the middle point its default;
# CaPT at its default (the step scale, r 0.05), no search.
GRIDS = {
    "deep-prompt": ["0.025", "0.05", "0.1"],  # n 1, the step scale r: the capsule's slot without the instance mean
    "prefix": ["3e-3", "1e-2", "3e-2"],  # P-Tuning v2, n 64, one rate
    "prompt": ["0.1", "0.3", "1.0"],  # prompt tuning, n 100, one rate
    "linear-head": ["3e-4", "1e-3", "3e-3"],
}
METHOD_ARGS = {"capt": [], "deep-prompt": ["--method", "deep-prompt"], "prefix": ["--method", "prefix"],
               "prompt": ["--method", "prompt"], "linear-head": ["--method", "linear-head"]}
SEARCH_LENGTHS = {"prompt": "10,50,100", "prefix": "8,32,64"}  # the training-time claim: RTE, seed 0
ABLATIONS = {  # RTE, seeds 0-2, the program's budget; add is CaPT's own runs
    "prepend": ["--integration", "prepend"],
    "extraction": ["--integration", "extraction"],
    "projection": ["--integration", "projection"],
    "length-2": ["--capsule-length", "2"],
}
# Amendments: variants of a program made at a later commit ("commit") than the program's own ("amends"), RTE, seeds
# 0-2, after the ablations. A driver records each in program.json the first time it starts on the program it amends,
# and the plan reads them from there. The one so far (docs/results.md, "Amended during the RTE ablations"): from
# 57a1e81 on, capt trains extraction's filter and projection's maps at r over their fan-in (capt/stepscale.py
# rate_of), where the pinned commit trained them at r; both variants run again there, and their runs at the pinned
# commit stay as they were made. Every other method computes the same bits at both commits (`same`), so add's runs
# are the amended variants' yardstick too.
AMENDMENTS = [
    {
        "amends": "23d606fd7c6fcd89ddd79657c99b43c5c99e05a6",
        "commit": "57a1e81f8187addb2003f7fc00c936c2571c4704",
        "variants": {"projection-fan-in": ABLATIONS["projection"], "extraction-fan-in": ABLATIONS["extraction"]},
    }
]


def git(code: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=code, capture_output=True, text=True, check=True,
                          timeout=60).stdout.strip()


def code_state(code: Path) -> dict:
    """The commit of the checkout that runs, and whether its capt/ differs from it."""
    dirty = bool(git(code, "status", "--porcelain", "--", "capt"))
    return {"commit": git(code, "rev-parse", "HEAD"), "capt_dirty": dirty}


def processor() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def atomic_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


def read_json(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


RECORDS = ("config.json", "made-at.json", "failed.json", "result.json", "results.json")  # a finished run's, kept


def portable(value):
    """A record's paths as every reader can take them: relative to the repository where they lie inside it, the data
    directory as $CAPT_DATA (where it lies elsewhere); config.json keeps the sha256 of every file a run read. A
    message (failed.json's error) gets the same for each path in it."""
    if isinstance(value, dict):
        return {k: portable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [portable(v) for v in value]
    if not isinstance(value, str):
        return value
    if not value.startswith("/"):  # a message or a command line: each whole path in it
        for base, shown in ((ROOT.resolve(), ""), (DATA.resolve(), "$CAPT_DATA")):
            within = re.escape(str(base))
            value = re.sub(rf"(?<![\w./-]){within}/", f"{shown}/" if shown else "", value)  # a path below it
            value = re.sub(rf"(?<![\w./-]){within}(?![\w./-])", shown or ".", value)  # the directory itself
        return value
    path = Path(value)
    for base, shown in ((ROOT.resolve(), None), (DATA.resolve(), "$CAPT_DATA")):
        if path == base or base in path.parents:
            rest = path.relative_to(base)
            return str(rest) if shown is None else shown + ("" if rest == Path(".") else f"/{rest}")
    return value


def make_portable(d: Path) -> None:
    """A finished run's records with portable paths (capt writes a run's paths absolute, so that it resumes from any
    directory; a finished run does not resume). Each file keeps its indentation; a search's results.md is
    rewritten as a message is."""
    for path in sorted(d.rglob("results.md")):
        text = path.read_text()
        if portable(text) != text:
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(portable(text))
            os.replace(tmp, path)
    for path in sorted(p for name in RECORDS for p in d.rglob(name)):  # a search's runs lie below it
        text = path.read_text()
        obj = json.loads(text)
        shown = portable(obj)
        if shown != obj:
            lines = text.splitlines()
            indent = len(lines[1]) - len(lines[1].lstrip()) if len(lines) > 1 else None
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(json.dumps(shown, indent=indent) + "\n")
            os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# The plan


def best_validation_loss(run: Path) -> float | None:
    test = read_json(run / "test.json")
    return None if test is None else test["best"]["loss"]


def picks(out: Path, task: str) -> dict[str, str | None]:
    """Each baseline's chosen rate on a task: the grid point of seed 0 with the lowest best validation gold NLL
    (ties to the grid's middle, then its lower end); None while a grid run is unfinished."""
    chosen = {}
    for method, grid in GRIDS.items():
        losses = [best_validation_loss(out / task / method / f"lr{lr}" / "seed0") for lr in grid]
        if any(v is None for v in losses):
            chosen[method] = None
            continue
        order = sorted(range(len(grid)), key=lambda i: (losses[i], abs(i - 1), i))
        chosen[method] = grid[order[0]]
    return chosen


def plan(out: Path) -> list[dict]:
    """Every run of the program in the order it runs, as far as it is known now (the seeds 1-2 of a baseline,
    and its length search, are known once its grid is done). Each: name, kind (eval / train / search), dir, the
    capt arguments, and for an amended run (program.json's amendments) the commit that makes it (else the
    program's)."""
    runs = []
    for task in TASKS:
        base = ["--task", task, "--data", str(DATA)]
        runs.append({"name": f"{task}/zero-shot", "kind": "eval", "dir": out / task / "zero-shot",
                     "args": ["eval", "--model", str(WEIGHTS), *base, "--split", "test", "--json"]})
        runs += [train_run(out, task, "capt", None, seed) for seed in SEEDS]
        chosen = picks(out, task)
        for method, grid in GRIDS.items():
            for lr in grid:
                runs.append(train_run(out, task, method, lr, 0))
            if chosen[method] is None:
                continue
            if task == "rte" and method in SEARCH_LENGTHS:
                # right after its grid: the grid run it copies in is then most likely still on this machine
                runs.append(search_run(out, method, chosen[method]))
            # then the pick's other seeds, so that each comparison with CaPT is whole as early as it can be
            runs += [train_run(out, task, method, chosen[method], seed) for seed in SEEDS[1:]]
        if task == "rte":
            for variant, extra in ABLATIONS.items():
                runs += [train_run(out, task, "capt", None, seed, variant, extra) for seed in SEEDS]
            for amendment in (read_json(out / "program.json") or {}).get("amendments", []):
                runs += [{**train_run(out, task, "capt", None, seed, variant, extra), "commit": amendment["commit"]}
                         for variant, extra in amendment["variants"].items() for seed in SEEDS]
    return runs


def search_run(out: Path, method: str, lr: str) -> dict:
    """The training-time claim's length search for a method on RTE, seed 0, at its chosen rate: `capt run --lengths`.
    "reuse": the grid's seed-0 run at that rate, which is the search's run at the grid's length (reuse_grid_run)."""
    return {
        "name": f"rte/search/{method}",
        "kind": "search",
        "dir": out / "rte" / "search" / method,
        "reuse": train_run(out, "rte", method, lr, 0)["dir"],
        "args": ["run", "--model", str(WEIGHTS), "--tasks", "rte", "--data", str(DATA), "--seed-list", "0",
                 "--lengths", SEARCH_LENGTHS[method], "--lr", lr, *METHOD_ARGS[method], *BUDGET],
    }


def train_run(out: Path, task: str, method: str, lr: str | None, seed: int, variant: str | None = None,
              extra: list[str] = ()) -> dict:
    where = out / task / (variant or method) / (f"lr{lr}" if lr is not None else "default") / f"seed{seed}"
    args = [
        "train",
        "--model",
        str(WEIGHTS),
        "--task",
        task,
        "--data",
        str(DATA),
        "--out",
        str(where),
        "--seed",
        str(seed),
        *METHOD_ARGS[method],
        *(["--lr", lr] if lr is not None else []),
        *extra,
        *BUDGET,
    ]
    return {
        "name": f"{task}/{variant or method}/{'lr' + lr if lr else 'default'}/seed{seed}",
        "kind": "train",
        "dir": where,
        "args": args,
    }


def finished(run: dict) -> bool:
    """Done: its result is written, or it failed in a way that running it again would repeat (failed.json)."""
    d = run["dir"]
    if (d / "failed.json").is_file():
        return True
    if run["kind"] == "eval":
        return (d / "result.json").is_file()
    if run["kind"] == "search":
        return (d / "results.json").is_file()
    return (d / "test.json").is_file() and (d / "made-at.json").is_file()


# ---------------------------------------------------------------------------------------------
# Running


def child_env(code: Path) -> dict:
    """A capt process's environment: the code from `code`, two threads unless set, the data only as passed."""
    env = dict(os.environ, PYTHONPATH=str(code), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    env.pop("CAPT_DATA", None)
    return env


def execute(run: dict, code: Path, state: dict) -> int:
    """One run in its own process, from the checkout `code` (of the run's commit); its made-at.json afterwards."""
    d = run["dir"]
    d.mkdir(parents=True, exist_ok=True)
    args = list(run["args"])
    if run["kind"] == "train" and not (d / "state.pt").is_file() and (d / "config.json").is_file():
        # a try whose state.pt did not survive (it stays on the machine that made it, like every run's tensors):
        # the run starts again from nothing, the try's records kept aside in lost-N/ and out of the run's times
        lost = d / f"lost-{len(list(d.glob('lost-*')))}"
        lost.mkdir()
        for f in [f for f in d.iterdir() if not f.name.startswith("lost-")]:
            f.rename(lost / f.name)
    if run["kind"] == "train" and (d / "state.pt").is_file():
        # the run's own settings, continued exactly; where the model and the data are: this machine's places
        args = ["train", "--out", str(d), "--resume", "--model", str(WEIGHTS), "--data", str(DATA)]
    if run["kind"] == "search":
        reuse_grid_run(run)
        args = args + ["--out", str(d)] + (["--resume"] if any(d.rglob("state.pt")) else [])
    env = child_env(code)
    command = [sys.executable, "-m", "capt", *args]
    started, cpu, load = time.time(), children_cpu_seconds(), LoadSampler()
    try:
        with load:
            child, output = _child(command, run, code, env, d)
    finally:  # every process's time counts, a cut-off one's too: the run's wall time is their sum
        segments = (read_json(d / "segments.json") or []) + [
            {"wall_s": round(time.time() - started, 1), "cpu_s": round(children_cpu_seconds() - cpu, 1),
             "load": load.mean(), "ended": time.strftime("%Y-%m-%d %H:%M:%S")}]
        atomic_json(d / "segments.json", segments)
    if child.returncode == 1:  # capt's own one-line error (a diverged run, say): recorded, and the plan goes on
        lines = (d / "log.txt").read_text().strip().splitlines()
        atomic_json(
            d / "failed.json", {**state, "exit": 1, "error": lines[-1] if lines else "", "command": command[2:]}
        )
        make_portable(d)
        return 1
    if child.returncode != 0:  # killed or interrupted: run again next time
        return child.returncode
    if run["kind"] == "eval":
        atomic_json(d / "result.json", json.loads(output))
    atomic_json(d / "made-at.json", {**state, "processor": processor(), "torch": torch_version(),
                                     "python": platform.python_version(), "command": command[2:],
                                     "wall_s": round(sum(seg["wall_s"] for seg in segments), 1),
                                     **cpu_record(segments), "processes": len(segments),
                                     "finished": time.strftime("%Y-%m-%d %H:%M:%S")})
    make_portable(d)
    return 0


def reuse_grid_run(run: dict) -> None:
    """A length search's run at the grid's length (prompt tuning's 100, P-Tuning v2's 64) is the grid's seed-0 run at
    the chosen rate: the same settings, and the same numbers whether trained alone or after the search's other lengths
    (tests/test_evidence.py checks both). Where that run's state.pt is still on this machine it is copied into the
    search, which `capt run --resume` then takes as finished (capt checks that its settings are the search's), instead
    of training it again; reused.json says so, and the table counts that run's CPU time in the search's. Without its
    state.pt the search trains it again."""
    grid, d = run["reuse"], run["dir"]
    config = read_json(grid / "config.json")
    if config is None or not (grid / "state.pt").is_file() or not (grid / "test.json").is_file():
        return
    lengths = [int(x) for x in run["args"][run["args"].index("--lengths") + 1].split(",")]
    target = d / "rte" / f"n{config['n']}" / "seed0"
    if config["n"] not in lengths or target.exists() or (d / "results.json").is_file():
        return
    part = target.with_name(f".{target.name}.part")
    shutil.rmtree(part, ignore_errors=True)
    shutil.copytree(grid, part, ignore=shutil.ignore_patterns("made-at.json", "segments.json", "failed.json", "lost-*"))
    # the record first: a stop between the two leaves a record and no copy, which the next start mends
    atomic_json(d / "reused.json", {"n": config["n"], "from": str(grid.relative_to(d.parents[2]))})
    os.replace(part, target)


def children_cpu_seconds() -> float:
    """User and system CPU seconds of this process's finished children so far (one run's process at a time)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class LoadSampler:
    """The machine's 1-minute load average every LOAD_EVERY seconds while a run's process lives: its mean says whether
    the run had the cores to itself (about its thread count, 2) or shared them (more), which its wall time cannot."""

    def __init__(self):
        self.samples, self._stop = [], threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self):
        while not self._stop.wait(LOAD_EVERY):
            self.samples.append(os.getloadavg()[0])

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.samples.append(os.getloadavg()[0])

    def mean(self) -> float | None:
        return round(sum(self.samples) / len(self.samples), 2) if self.samples else None


LOAD_EVERY = 30.0  # seconds


def cpu_record(segments: list[dict]) -> dict:
    """made-at.json's CPU fields: the CPU seconds over the processes that recorded them, how many did (runs begun
    before the driver counted CPU time have earlier processes without), and the mean load over those."""
    counted = [seg for seg in segments if "cpu_s" in seg]
    loads = [seg["load"] for seg in counted if seg.get("load") is not None]
    return {"cpu_s": round(sum(seg["cpu_s"] for seg in counted), 1), "cpu_processes": len(counted),
            "load": round(sum(loads) / len(loads), 2) if loads else None}


def _child(command: list[str], run: dict, code: Path, env: dict, d: Path):
    """The run's process, to its end; (the finished Popen, its stdout for an eval). A stop reaches it as SIGTERM,
    which capt handles like Ctrl-C (the training state is saved first, exit 130): at once for a SIGTERM to the
    driver; for a Ctrl-C, which at a terminal reaches the run's process itself, after GRACE_S seconds if it is still
    running (a driver started in the background passes its processes an ignored SIGINT)."""
    with open(d / "log.txt", "a") as log:
        log.write(f"\n$ {' '.join(command)}\n")
        log.flush()
        stdout = subprocess.PIPE if run["kind"] == "eval" else log
        child = subprocess.Popen(command, cwd=code, env=env, stdout=stdout, stderr=log, text=True)
        try:
            output, _ = child.communicate()
        except KeyboardInterrupt as stop:
            if isinstance(stop, Terminated) or not _ends(child, GRACE_S):
                child.send_signal(signal.SIGTERM)
            if not _ends(child, 300):  # it did not stop: the run restarts from its last saved state
                child.kill()
                child.wait()
            raise
    return child, output


GRACE_S = 60.0  # a step and a save take seconds; an evaluation is redone on resume


class Terminated(KeyboardInterrupt):
    """SIGTERM to the driver (kill PID, a scheduler's stop): stops it as Ctrl-C does."""


def _terminated(signum, frame):
    raise Terminated


def _ends(child: subprocess.Popen, seconds: float) -> bool:
    try:
        child.wait(timeout=seconds)
        return True
    except subprocess.TimeoutExpired:
        return False


def torch_version() -> str:
    return subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                          text=True, timeout=300).stdout.strip()


def cmd_run(args) -> int:
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    lock = open(out / ".lock", "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        sys.exit(f"another driver is running on {out}")
    codes = [c.resolve() for c in args.code or [ROOT]]
    states = [code_state(c) for c in codes]
    program = read_json(out / "program.json")
    fresh = program is None
    if fresh:
        program = {"commit": states[0]["commit"], "started": time.strftime("%Y-%m-%d %H:%M:%S"), "budget": BUDGET,
                   "grids": GRIDS, "tasks": TASKS, "seeds": SEEDS, "search_lengths": SEARCH_LENGTHS,
                   "ablations": ABLATIONS}
    recorded = program.get("amendments", [])
    added = [{**a, "added": time.strftime("%Y-%m-%d %H:%M:%S")} for a in AMENDMENTS
             if a["amends"] == program["commit"] and a["commit"] not in {r["commit"] for r in recorded}]
    later = [a["commit"] for a in recorded + added]
    for code, state in zip(codes, states):
        if state["capt_dirty"]:
            sys.exit(f"{code}: capt/ has uncommitted changes; every run is made at a commit, as committed")
        if state["commit"] not in (program["commit"], *later):
            sys.exit(f"{code} is at {state['commit'][:12]}, but the program runs at {program['commit'][:12]}"
                     + "".join(f" (and its amended variants at {c[:12]})" for c in later)
                     + f": check that commit out (git worktree add DIR {program['commit'][:12]}) and pass --code DIR")
    if fresh or added:  # an amendment is written down the first time a driver knows of it, before its runs
        atomic_json(out / "program.json", {**program, **({"amendments": recorded + added} if later else {})})
    checkouts = {state["commit"]: code for code, state in zip(codes, states)}
    for run in todo_runs(out):
        if begun(run) and run.get("commit", program["commit"]) not in checkouts:
            print(f"{run['name']} was cut off, and it is made at {run['commit'][:12]}, which no --code here is: it "
                  "waits (its state.pt stays on this machine only)", flush=True)
    previous = signal.signal(signal.SIGTERM, _terminated)  # `kill PID` stops the driver and its run, state saved
    try:
        return run_plan(out, checkouts, program["commit"], args.limit)
    except KeyboardInterrupt:
        print("  stopped; the next start resumes the run", flush=True)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)


def begun(run: dict) -> bool:
    """A run cut off with its state saved (a state.pt in its directory: a search keeps one a length)."""
    return run["dir"].is_dir() and any(run["dir"].rglob("state.pt"))


def todo_runs(out: Path) -> list[dict]:
    """The plan's runs not finished, in the order they run: a begun one first, so that a run cut off is finished
    while its state.pt (which stays on the machine that wrote it) is still here; then the plan's order."""
    todo = [r for r in plan(out) if not finished(r)]
    return sorted(todo, key=lambda r: not begun(r))  # stable: the plan's order otherwise


def run_plan(out: Path, checkouts: dict[str, Path], commit: str, limit: int | None) -> int:
    """The plan's runs not finished, one process at a time, each from the checkout of its commit (`commit`, the
    program's, unless the run names its own), until none is left that a checkout here makes, `limit` runs are done,
    a run stops (its exit code) or three fail (1)."""
    failures = 0
    while True:
        todo = todo_runs(out)
        ready = [r for r in todo if r.get("commit", commit) in checkouts]
        if not ready or (limit is not None and limit <= 0):
            break
        run = ready[0]
        made_at = run.get("commit", commit)
        print(f"{time.strftime('%H:%M:%S')} {run['name']} ({len(todo)} left as known now)", flush=True)
        code_ = execute(run, checkouts[made_at], {"commit": made_at})
        if code_ == 0 and not finished(run):  # it would be run again without end
            atomic_json(run["dir"] / "failed.json", {"commit": made_at, "exit": 0,
                                                     "error": "the run exited 0 without writing its result"})
            make_portable(run["dir"])
            code_ = 1
        if code_ == 1:
            failures += 1
            print(f"  failed, recorded in {run['dir'] / 'failed.json'}", flush=True)
            if failures >= 3:  # something may be wrong with every run, not with one
                print("  three runs failed in this start: stopped; read their failed.json before starting again "
                      "(a run that failed is not run again)", flush=True)
                return 1
            continue
        if code_ != 0:
            print(f"  stopped (exit {code_}); the next start resumes it", flush=True)
            return code_
        if limit is not None:
            limit -= 1
    waiting = [r for r in todo if r.get("commit", commit) not in checkouts]
    if ready:
        print("stopped at --limit", flush=True)
    if waiting:
        commits = sorted({r["commit"][:12] for r in waiting})
        print(f"{len(waiting)} run{'s' if len(waiting) != 1 else ''} wait for a checkout of {', '.join(commits)}: pass "
              f"{'it' if len(commits) == 1 else 'each'} as another --code DIR", flush=True)
    elif not ready:
        print("nothing left to run", flush=True)
    return 0


def wall_seconds(d: Path) -> float:
    """A finished run's wall time over all its processes. Runs finished before the processes were counted
    (made-at.json without "processes") recorded only their last one: for them, at least the training time
    capt measured over all of them (test.json's train_seconds). A run that failed has no made-at.json: the sum
    of its processes' (segments.json)."""
    made = read_json(d / "made-at.json") or {}
    if not made:
        return sum(seg["wall_s"] for seg in read_json(d / "segments.json") or [])
    if "processes" in made:
        return made["wall_s"]
    return max(made.get("wall_s", 0), (read_json(d / "test.json") or {}).get("train_seconds", 0))


def cpu_seconds(d: Path) -> float:
    """A finished run's CPU seconds where the driver counted them (made-at.json; a failed run's segments.json)."""
    made = read_json(d / "made-at.json")
    if made is None:
        return sum(seg.get("cpu_s", 0) for seg in read_json(d / "segments.json") or [])
    return made.get("cpu_s", 0)


def cmd_status(args) -> int:
    out = args.out.resolve()
    runs = plan(out)
    done = [r for r in runs if finished(r)]
    seconds = sum(wall_seconds(r["dir"]) for r in done)
    cpu = sum(cpu_seconds(r["dir"]) for r in done)
    failed = sum((r["dir"] / "failed.json").is_file() for r in done)
    begun_s = sum(seg["wall_s"] for r in runs if not finished(r) for seg in read_json(r["dir"] / "segments.json") or [])
    print(f"{len(done)} of {len(runs)} runs known now are done" + (f" ({failed} failed)" if failed else "")
          + f": {seconds / 3600:.2f} hours of wall time (two cores)"
          + (f" and {cpu / 3600:.2f} CPU hours where counted" if cpu else "")
          + (f"; {begun_s / 3600:.2f} wall hours in runs not finished" if begun_s else ""))
    for r in done:
        print(f"  done  {r['name']}")
    for r in todo_runs(out):  # in the order they run
        print(f"  todo  {r['name']}{begun_note(r['dir'])}")
    return 0


def begun_note(d: Path) -> str:
    """How far a run that is not finished got: its last evaluation's step of the steps planned, and its wall time."""
    metrics = d / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.is_file() else []
    wall = sum(seg["wall_s"] for seg in read_json(d / "segments.json") or [])
    if not lines and not wall:
        return ""
    planned = (read_json(d / "config.json") or {}).get("planned_steps")
    step = json.loads(lines[-1])["step"] if lines else 0
    of = f" of {planned} planned" if planned else ""
    return f"  (begun: evaluated at step {step}{of}; {wall / 3600:.2f} wall h in its processes that ended)"


# Short runs of every method (CB, four steps, an evaluation every two): what `same` compares between two checkouts
SAME_ARGS = ["--seed", "0", "--epochs", "10", "--patience", "3", "--select", "loss", "--train-rows", "24",
             "--validation-rows", "16", "--batch-size", "8", "--max-steps", "4", "--eval-every", "2", "--device", "cpu"]


SAME_DEFAULT = [*METHOD_ARGS, *(v for v, extra in ABLATIONS.items()
                                if all(extra not in a["variants"].values() for a in AMENDMENTS))]


def cmd_same(args) -> int:
    """Whether this checkout computes what the pinned one does: the same short run of each method with both, and
    their test.json, metrics.jsonl (less the times) and best/ files compared bit for bit. Code changed after the pinned
    commit in shape only keeps the program's runs standing for it."""
    out, methods, differ = args.out.resolve(), args.methods.split(","), []
    unknown = [m for m in methods if m not in METHOD_ARGS and m not in ABLATIONS]
    if unknown:
        sys.exit(f"--methods: {unknown[0]} is neither a method ({', '.join(METHOD_ARGS)}) nor an ablation "
                 f"({', '.join(ABLATIONS)})")
    for method in methods:
        made = {}
        for which, code in (("pinned", args.code.resolve()), ("here", ROOT)):
            d = out / which / method
            shutil.rmtree(d, ignore_errors=True)
            d.parent.mkdir(parents=True, exist_ok=True)
            env = child_env(code)
            command = [sys.executable, "-m", "capt", "train", "--model", str(WEIGHTS), "--task", args.task, "--data",
                       str(DATA), "--out", str(d), *METHOD_ARGS.get(method, []), *ABLATIONS.get(method, []), *SAME_ARGS]
            with open(f"{d}.log", "w") as log:  # cwd out: `-m capt` finds the code through PYTHONPATH alone
                if subprocess.run(command, cwd=out, env=env, stdout=log, stderr=log).returncode != 0:
                    sys.exit(f"{which} {method}: the run failed; see {d}.log")
            made[which] = run_bits(d)
        same = [name for name in made["here"] if made["here"][name] == made["pinned"][name]]
        print(f"{method}: {', '.join(f'{n} {n in same}' for n in made['here'])}")
        differ += [method] if len(same) != len(made["here"]) else []
    print("the same bits" if not differ else f"different: {', '.join(differ)}")
    return 0 if not differ else 1


def run_bits(d: Path) -> dict:
    """A finished run's results less its times: test.json, metrics.jsonl, each best/ file's bytes."""
    def timeless(obj):
        if isinstance(obj, dict):
            return {k: timeless(v) for k, v in obj.items() if k != "time" and "seconds" not in k}
        return [timeless(v) for v in obj] if isinstance(obj, list) else obj
    return {"test.json": timeless(read_json(d / "test.json")),
            "metrics.jsonl": [timeless(json.loads(x)) for x in (d / "metrics.jsonl").read_text().splitlines()],
            **{f"best/{f.name}": f.read_bytes() for f in sorted((d / "best").iterdir())}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("run", "status", "table", "same"):
        s = sub.add_parser(name)
        s.add_argument("--out", type=Path, required=True, help="the program's run directory (same: for its runs)")
        if name in ("run", "same"):
            s.add_argument("--code", type=Path, action="append" if name == "run" else "store",
                           default=None if name == "run" else ROOT,
                           help="the checkout of the pinned commit (default: this one); run: once for each commit "
                                "the runs are made at (the program's, an amendment's)")
        if name == "run":
            s.add_argument("--limit", type=int, help="stop after this many runs")
        if name == "same":
            s.add_argument("--methods", default=",".join(SAME_DEFAULT),
                           help="comma-separated methods and ablations (default: all but the amended variants, whose "
                                "arithmetic an amendment changed by design)")
            s.add_argument("--task", default="cb", help="the task of the short runs (default: cb)")
        if name == "table":
            s.add_argument("--results", type=Path, required=True, help="where table.md / table.json go")
    args = p.parse_args(argv)
    if args.command == "table":
        from evidence_table import write_table  # bench/, beside this script

        return write_table(args.out.resolve(), args.results)
    try:
        code = {"run": cmd_run, "status": cmd_status, "same": cmd_same}[args.command](args)
        sys.stdout.flush()
        return code
    except BrokenPipeError:  # `status | head`: the reader has what it wanted; nothing more to write, no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so that the exit's flush is quiet too
        return 0


if __name__ == "__main__":
    sys.exit(main())
