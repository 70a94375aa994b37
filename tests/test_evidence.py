"""bench/evidence.py, the evidence program's driver, on a tiny checkpoint and tiny SuperGLUE files with a
shrunken plan: it runs the plan one process at a time, picks each baseline's rate on seed 0's validation,
skips what is done, resumes what was cut off, refuses other code, and its table pairs every method with
CaPT on the same rows."""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import write_superglue

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import evidence  # noqa: E402
from capt import plots, stats  # noqa: E402
import evidence_table  # noqa: E402


@pytest.fixture
def small(monkeypatch, ckpts, tmp_path):
    """The driver with a plan of a minute: RTE, two seeds, one baseline, one search, one step a run (the ablation
    rows are the same train runs with other options)."""
    code = tmp_path / "code"
    shutil.copytree(ROOT / "capt", code / "capt", ignore=shutil.ignore_patterns("__pycache__"))
    for args in (
        ["init", "-q"],
        ["add", "capt"],
        ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "code"],
    ):
        subprocess.run(["git", *args], cwd=code, check=True)
    data = write_superglue(tmp_path / "data", {"RTE": (40, 12)})
    for module in (evidence, evidence_table):
        for name, value in {"TASKS": ["rte"], "SEEDS": [0, 1], "GRIDS": {"prompt": ["0.1", "0.3"]},
                            "ABLATIONS": {}, "AMENDMENTS": []}.items():
            if hasattr(module, name):
                monkeypatch.setattr(module, name, value)
    monkeypatch.setattr(evidence, "SEARCH_LENGTHS", {"prompt": "2,100"})  # 100: the grid runs' length, capt's default
    monkeypatch.setattr(evidence, "WEIGHTS", Path(ckpts["llama"]))
    monkeypatch.setattr(evidence, "DATA", data)
    monkeypatch.setattr(evidence, "METHOD_ARGS", {"capt": [], "prompt": ["--method", "prompt"]})
    monkeypatch.setattr(
        evidence,
        "BUDGET",
        [
            "--epochs",
            "1",
            "--max-steps",
            "1",
            "--batch-size",
            "8",
            "--select",
            "loss",
            "--train-rows",
            "16",
            "--validation-rows",
            "6",
            "--device",
            "cpu",
        ],
    )
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    return code, tmp_path / "out"


def test_the_driver_runs_resumes_and_tabulates(small, tmp_path, capsys):
    code, out = small
    assert evidence.main(["run", "--out", str(out), "--code", str(code), "--limit", "3"]) == 0
    done = [r["name"] for r in evidence.plan(out) if evidence.finished(r)]
    assert done == ["rte/zero-shot", "rte/capt/default/seed0", "rte/capt/default/seed1"]
    program = json.loads((out / "program.json").read_text())
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=code, capture_output=True, text=True).stdout.strip()
    assert program["commit"] == commit
    made = json.loads((out / "rte" / "capt" / "default" / "seed0" / "made-at.json").read_text())
    assert made["commit"] == commit and made["processor"] and made["torch"] and made["command"][:2] == ["capt", "train"]
    # the data directory lies outside the repository: a finished run's records name it $CAPT_DATA
    config = json.loads((out / "rte" / "capt" / "default" / "seed0" / "config.json").read_text())
    assert config["data"] == "$CAPT_DATA" and made["command"][made["command"].index("--data") + 1] == "$CAPT_DATA"
    assert evidence.picks(out, "rte") == {"prompt": None}  # the grid is not done yet
    # a run cut off after its first state: the next start resumes it, not a fresh one
    cut = out / "rte" / "prompt" / "lr0.3" / "seed0"
    before = (out / "rte" / "capt" / "default" / "seed0" / "test.json").stat().st_mtime_ns
    assert evidence.main(["run", "--out", str(out), "--code", str(code)]) == 0
    assert "--resume" not in (cut / "log.txt").read_text()  # it was never cut here; the resumed case is tested below
    # skipped, not redone
    assert (out / "rte" / "capt" / "default" / "seed0" / "test.json").stat().st_mtime_ns == before
    names = [r["name"] for r in evidence.plan(out)]
    assert all(evidence.finished(r) for r in evidence.plan(out))
    chosen = evidence.picks(out, "rte")["prompt"]
    assert f"rte/prompt/lr{chosen}/seed1" in names and "rte/search/prompt" in names
    # the search ran, its length-100 run the grid's own, copied in (test_a_search_reuses_... checks the numbers)
    search = out / "rte" / "search" / "prompt"
    assert not (search / "failed.json").exists(), (search / "failed.json").read_text()
    searched = json.loads((search / "results.json").read_text())
    assert json.loads((search / "reused.json").read_text()) == {"n": 100, "from": f"rte/prompt/lr{chosen}/seed0"}
    grid_test = (out / "rte" / "prompt" / f"lr{chosen}" / "seed0" / "test.json").read_text()
    assert (search / "rte" / "n100" / "seed0" / "test.json").read_text() == grid_test
    assert searched["lengths"] == [2, 100]
    (cut / "test.json").unlink()  # as if cut off after its state.pt: run it again, resumed
    capsys.readouterr()
    assert evidence.main(["status", "--out", str(out)]) == 0
    hours = sum(seg["wall_s"] for seg in json.loads((cut / "segments.json").read_text())) / 3600
    assert (f"todo  rte/prompt/lr0.3/seed0  (begun: evaluated at step 1 of 1 planned; {hours:.2f} wall h in its "
            "processes that ended)") in capsys.readouterr().out
    assert evidence.main(["run", "--out", str(out), "--code", str(code)]) == 0
    assert "--resume" in (cut / "log.txt").read_text()
    segments = json.loads((cut / "segments.json").read_text())  # every process's time counts toward the run's
    made = json.loads((cut / "made-at.json").read_text())
    assert len(segments) == made["processes"] == 2 and made["wall_s"] == round(sum(s["wall_s"] for s in segments), 1)
    assert evidence.wall_seconds(cut) == made["wall_s"]
    # and its CPU time: each process's own (its children's rusage), summed; the load beside it
    assert all(seg["cpu_s"] > 0.5 and seg["load"] >= 0 for seg in segments)
    assert made["cpu_processes"] == 2 and made["cpu_s"] == round(sum(s["cpu_s"] for s in segments), 1)
    assert made["load"] == round(sum(s["load"] for s in segments) / 2, 2)
    assert evidence.main(["table", "--out", str(out), "--results", str(tmp_path / "results")]) == 0
    table = json.loads((tmp_path / "results" / "table.json").read_text())
    rte = table["tasks"]["rte"]
    assert rte["decision"] in ("holds", "refuted", "undecided") and rte["methods"]["capt"]["seeds"] == 2
    vs = rte["methods"]["prompt"]["vs_capt"]
    assert vs["rows"] == 12 and vs["seeds"] == [2, 2] and vs["low"] <= vs["difference"] <= vs["high"]
    text = (tmp_path / "results" / "table.md").read_text()
    assert "## rte (12 test rows, headline accuracy)" in text and "## Training time on RTE" in text
    grid_cpu = json.loads((out / "rte" / "prompt" / f"lr{chosen}" / "seed0" / "made-at.json").read_text())["cpu_s"]
    search_cpu = json.loads((search / "made-at.json").read_text())["cpu_s"]
    assert (f"| prompt tuning (n 100) | 2, 100 (n 100: the grid's run) | {searched['train_seconds']:.0f} | "
            in text.replace("| Prompt tuning |", "| prompt tuning (n 100) |"))
    assert f"| {search_cpu + grid_cpu:.0f} (the grid run's included) | " in text
    # the picture of every paired difference, where matplotlib is installed
    assert (tmp_path / "results" / "table.png").is_file() == plots.available() == ("](table.png)" in text)
    # the budget each run used, seed 0's grids with the pick, the time table's CPU seconds and load
    capt_runs = [json.loads((out / "rte" / "capt" / "default" / f"seed{k}" / "test.json").read_text()) for k in (0, 1)]
    assert f"| 2 | {capt_runs[0]['best']['step']} of {capt_runs[0]['steps']}, " in text
    grid_line = next(x for x in text.splitlines() if x.startswith("- prompt tuning (n 100): "))
    assert f"**{chosen}: " in grid_line
    # the rate passed over, paired with CaPT's seeds on the same rows (outside the rule): the numbers of compare_pair
    other = next(lr for lr in ("0.1", "0.3") if lr != chosen)
    passed = json.loads((out / "rte" / "prompt" / f"lr{other}" / "seed0" / "test.json").read_text())
    c = stats.compare_pair([r["examples"]["prediction"] for r in capt_runs], [passed["examples"]["prediction"]],
                           passed["examples"]["label"], "accuracy")
    assert (f"{other}: {passed['best']['loss']:.3f} ({passed['metrics']['headline']:.2f}; CaPT - it "
            f"{c['difference']:+.2f}, {c['low']:+.2f} to {c['high']:+.2f}, p {c['p']:.2g})") in grid_line
    assert rte["grids"]["prompt"][other]["vs_capt"]["difference"] == c["difference"]
    assert rte["grids"]["prompt"][chosen]["vs_capt"] is None  # the pick's comparison is the table's own
    made = json.loads((out / "rte" / "capt" / "default" / "seed0" / "made-at.json").read_text())
    assert f"Processors (each run's made-at.json): {made['processor']}: " in text  # every run: one machine here
    capt_time = next(x for x in text.splitlines() if x.startswith("| CaPT | - |"))
    assert capt_time.endswith(f"| {made['cpu_s']:.0f} | {made['load']} |")
    assert (tmp_path / "results" / "runs" / "rte" / "capt" / "default" / "seed0" / "test.json").is_file()
    # other code is refused
    (code / "capt" / "stats.py").write_text((code / "capt" / "stats.py").read_text() + "\n# changed\n")
    with pytest.raises(SystemExit, match="capt/ has uncommitted changes; every run is made at a commit"):
        evidence.main(["run", "--out", str(out), "--code", str(code)])


def test_the_runs_order(tmp_path):
    """CaPT's seeds first; each baseline's grid, then (RTE) its search and its pick's other seeds, so that each
    comparison is whole as early as it can be; a run cut off with its state saved goes before all of them."""
    def names():
        return [r["name"] for r in evidence.todo_runs(tmp_path)]

    assert names()[:5] == ["wic/zero-shot", *(f"wic/capt/default/seed{s}" for s in (0, 1, 2)),
                           "wic/deep-prompt/lr0.025/seed0"]
    for lr, loss in zip(evidence.GRIDS["prefix"], (0.8, 0.7, 0.9)):  # RTE's P-Tuning v2 grid done: 1e-2 picked
        d = tmp_path / "rte" / "prefix" / f"lr{lr}" / "seed0"
        d.mkdir(parents=True)
        (d / "test.json").write_text(json.dumps({"best": {"loss": loss}}))
        (d / "made-at.json").write_text("{}")
    after = names()[names().index("rte/deep-prompt/lr0.1/seed0"):]
    assert after[:5] == ["rte/deep-prompt/lr0.1/seed0", "rte/search/prefix", "rte/prefix/lr1e-2/seed1",
                         "rte/prefix/lr1e-2/seed2", "rte/prompt/lr0.1/seed0"]
    cut = tmp_path / "rte" / "prompt" / "lr1.0" / "seed0"
    cut.mkdir(parents=True)
    (cut / "state.pt").write_bytes(b"")
    assert names()[:2] == ["rte/prompt/lr1.0/seed0", "wic/zero-shot"]
    assert len(names()) == len({*names()})


def test_a_search_reuses_the_grid_run_at_its_length(small, tmp_path):
    """The length search's run at the grid's length is the grid's seed-0 run: trained again inside `capt run
    --lengths`, after the search's other length on the same loaded model, it repeats the grid run to the last digit.
    So the driver copies the grid run in where its state.pt is here, and capt takes it as finished."""
    code, out = small
    grid = evidence.train_run(out, "rte", "prompt", "0.3", 0)
    assert evidence.execute(grid, code, {"commit": "c"}) == 0
    search = evidence.search_run(out, "prompt", "0.3")
    (grid["dir"] / "state.pt").rename(tmp_path / "state.pt")  # not here: the search trains every length itself
    assert evidence.execute(search, code, {"commit": "c"}) == 0
    assert not (search["dir"] / "reused.json").exists()
    again = search["dir"] / "rte" / "n100" / "seed0"

    def numbers(d):
        test = json.loads((d / "test.json").read_text())
        evals = [{k: v for k, v in json.loads(x).items() if k != "time"} for x in (d / "metrics.jsonl").open()]
        return test["metrics"], test["loss"], test["best"], test["steps"], test["examples"], evals

    assert numbers(again) == numbers(grid["dir"])  # every test row's prediction and gold log-probability too
    # with the grid run's state.pt here: copied in, not trained again, and counted in the search's time
    shutil.rmtree(search["dir"])
    (tmp_path / "state.pt").rename(grid["dir"] / "state.pt")
    assert evidence.execute(search, code, {"commit": "c"}) == 0
    copied = search["dir"] / "rte" / "n100" / "seed0"
    assert (copied / "metrics.jsonl").read_bytes() == (grid["dir"] / "metrics.jsonl").read_bytes()
    assert not (copied / "made-at.json").exists() and not (copied / "segments.json").exists()
    searched = json.loads((search["dir"] / "results.json").read_text())
    n100 = next(e for e in searched["tasks"]["rte"]["search"]["lengths"] if e["n"] == 100)
    assert n100["train_seconds"] == json.loads((grid["dir"] / "test.json").read_text())["train_seconds"]
    # a grid run with other settings is refused by capt, in one line, rather than taken as the search's
    shutil.rmtree(search["dir"])
    config = json.loads((grid["dir"] / "config.json").read_text())
    (grid["dir"] / "config.json").write_text(json.dumps(dict(config, weight_decay=0.5)))
    assert evidence.execute(search, code, {"commit": "c"}) == 1
    assert "weight_decay" in json.loads((search["dir"] / "failed.json").read_text())["error"]


def test_a_run_that_exits_0_without_its_result_is_not_run_again(small, monkeypatch, capsys):
    """A child that ends well but writes nothing would be planned again without end: the driver records it in
    failed.json and, after three such runs, stops with 1."""
    code, out = small
    calls = []
    monkeypatch.setattr(evidence, "execute", lambda run, code, state: calls.append(run["name"]) or 0)
    assert evidence.main(["run", "--out", str(out), "--code", str(code)]) == 1
    assert len(calls) == 3 and len(set(calls)) == 3  # each once, then the driver gives up, and says so
    assert capsys.readouterr().out.splitlines()[-1].startswith("  three runs failed in this start: stopped; ")
    failed = json.loads((out / calls[0] / "failed.json").read_text())
    assert failed["exit"] == 0 and failed["error"] == "the run exited 0 without writing its result"


# A run's process that stops as capt does: SIGTERM saves (here: writes the marker) and exits 130; SIGINT is ignored,
# as it is for every process of a driver started in the background.
STOPPABLE = """
import signal, sys, time
from pathlib import Path
def stop(*_):
    Path(sys.argv[1]).write_text("saved")
    sys.exit(130)
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, signal.SIG_IGN)
Path(sys.argv[1] + ".up").write_text("")
time.sleep(120)
"""


@pytest.mark.parametrize("sent", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_reaches_the_run_as_sigterm(sent, tmp_path, monkeypatch):
    """SIGTERM to the driver goes on to the run's process at once; a Ctrl-C that did not reach it goes on after
    GRACE_S: either way as SIGTERM, which capt handles like Ctrl-C (its state saved), and the driver stops too."""
    monkeypatch.setattr(evidence, "GRACE_S", 0.5)
    marker = tmp_path / "marker"

    def send():
        while not Path(f"{marker}.up").exists():
            time.sleep(0.05)
        os.kill(os.getpid(), sent)

    previous = signal.signal(signal.SIGTERM, evidence._terminated)
    # Ctrl-C as at a terminal, also where pytest itself was started in the background and inherited SIGINT ignored
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Thread(target=send, daemon=True).start()
        started = time.time()
        with pytest.raises(evidence.Terminated if sent == signal.SIGTERM else KeyboardInterrupt):
            evidence._child([sys.executable, "-c", STOPPABLE, str(marker)], {"kind": "train"}, tmp_path,
                            dict(os.environ), tmp_path)
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)
    assert marker.read_text() == "saved" and time.time() - started < 60  # stopped, not left to its sleep


def test_a_try_whose_state_was_lost_starts_again(tmp_path, monkeypatch):
    """A run directory with a try's records but no state.pt (its machine is gone) cannot resume: the run starts
    again from nothing, and the try's files go to lost-0/, where its wall time no longer counts for the run."""
    d = tmp_path / "rte" / "capt" / "default" / "seed0"
    d.mkdir(parents=True)
    for name in ("config.json", "metrics.jsonl", "log.txt"):
        (d / name).write_text("{}")
    (d / "segments.json").write_text(json.dumps([{"wall_s": 4897.0, "cpu_s": 9728.3, "load": 2.0}]))
    seen = {}

    def child(command, run, code, env, where):
        seen["command"], seen["files"] = command, sorted(f.name for f in where.iterdir())
        return subprocess.CompletedProcess(command, 130), None  # stopped: the driver returns before made-at.json

    monkeypatch.setattr(evidence, "_child", child)
    run = {"name": "rte/capt/default/seed0", "kind": "train", "dir": d, "args": ["train", "--task", "rte"]}
    assert evidence.execute(run, tmp_path, {"commit": "c"}) == 130
    assert "--resume" not in seen["command"] and seen["files"] == ["lost-0"]
    assert sorted(f.name for f in (d / "lost-0").iterdir()) == ["config.json", "log.txt", "metrics.jsonl",
                                                                 "segments.json"]
    assert [s["wall_s"] for s in json.loads((d / "segments.json").read_text())] != [4897.0]  # only this process


def test_status_into_a_closed_pipe_ends_quietly(tmp_path):
    """`status | head`: once the reader has gone, the rest is dropped without a traceback."""
    child = subprocess.Popen([sys.executable, str(ROOT / "bench" / "evidence.py"), "status", "--out", str(tmp_path)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    child.stdout.close()  # before the interpreter has started: every line it writes meets a closed pipe
    _, err = child.communicate(timeout=120)
    assert (child.returncode, err) == (0, "")


def test_a_stopped_driver_says_so_and_exits_130(small, monkeypatch, capsys):
    code, out = small

    def stopped(run, code, state):
        raise evidence.Terminated

    monkeypatch.setattr(evidence, "execute", stopped)
    assert evidence.main(["run", "--out", str(out), "--code", str(code)]) == 130
    assert capsys.readouterr().out.splitlines()[-1] == "  stopped; the next start resumes the run"
    assert signal.getsignal(signal.SIGTERM) is not evidence._terminated  # the driver's handler is gone with it


def test_a_refutation_is_settled_once_its_comparison_is_complete(monkeypatch):
    """The rule's "refuted" needs one method at or above CaPT with the interval excluding a 3-point CaPT lead: once
    that comparison's runs are all in, no later run changes it, so the table says so before the rest runs. "holds"
    needs every comparison, so an incomplete task with CaPT ahead everywhere so far stays incomplete."""
    monkeypatch.setattr(evidence_table, "GRIDS", {"prompt": [], "prefix": []})
    behind = {"difference": -2.72, "low": -7.42, "high": 2.04, "p": 0.26}
    ahead = {"difference": 6.0, "low": 2.0, "high": 10.0, "p": 0.001}
    close = {"difference": -0.84, "low": -4.65, "high": 3.03, "p": 0.69}
    every = {"zero-shot", "capt", "prompt", "prefix"}
    decide = evidence_table.task_decision
    assert decide({"zero-shot": behind, "prompt": ahead}, {"zero-shot", "capt"}).startswith(
        "refuted, settled before every run is in: CaPT against zero-shot,")
    assert decide({"zero-shot": behind, "prompt": ahead}, {"zero-shot", "prompt"}) == "incomplete: runs are missing"
    assert decide({"zero-shot": close, "prompt": behind}, {"zero-shot", "capt"}) == "incomplete: runs are missing"
    assert decide({"zero-shot": ahead, "prompt": ahead}, {"zero-shot", "capt", "prompt"}) == (
        "incomplete: runs are missing")
    assert decide({"zero-shot": ahead, "prompt": ahead, "prefix": ahead}, every) == "holds"
    assert decide({"zero-shot": close, "prompt": ahead, "prefix": ahead}, every) == "undecided"
    assert decide({"zero-shot": behind, "prompt": ahead, "prefix": ahead}, every) == "refuted"


def test_a_finished_runs_records_name_portable_paths(tmp_path, monkeypatch):
    root, data = tmp_path / "repo", tmp_path / "shared" / "superglue"
    monkeypatch.setattr(evidence, "ROOT", root)
    monkeypatch.setattr(evidence, "DATA", data)
    d = root / "runs" / "rte" / "capt" / "default" / "seed0"
    (d / "best").mkdir(parents=True)
    config = {"model": str(root / "weights" / "m"), "out": str(d), "data": str(data), "lr": 0.3,
              "task_file": str(data / "RTE" / "task.json"), "elsewhere": "/opt/m", "neighbour": str(root) + "-old/m"}
    (d / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (d / "made-at.json").write_text(json.dumps({"command": ["capt", "train", "--model", str(root / "weights" / "m"),
                                                            "--data", str(data), "--out", str(d)]}, indent=1) + "\n")
    (d / "best" / "results.json").write_text(json.dumps({"run": str(d)}))  # below the run, on one line
    error = (f"capt: error: the validation scores became NaN; the best capsules so far are kept in {d / 'best'} "
             f"(read from {data / 'RTE'}/train.jsonl in {data}, not {root}-old/m, run in {root})")
    (d / "failed.json").write_text(json.dumps({"exit": 1, "error": error}, indent=1) + "\n")
    summary = f"# A search\n\nModel `{root / 'weights' / 'm'}`, made by `capt run --data {data}`.\n"
    (d / "results.md").write_text(summary)
    evidence.make_portable(d)
    text = (d / "config.json").read_text()
    assert text.startswith('{\n  "model": ') and json.loads(text) == {
        "model": "weights/m", "out": "runs/rte/capt/default/seed0", "data": "$CAPT_DATA", "lr": 0.3,
        "task_file": "$CAPT_DATA/RTE/task.json", "elsewhere": "/opt/m", "neighbour": str(root) + "-old/m"}
    made = (d / "made-at.json").read_text()
    assert made.startswith('{\n "command": ') and json.loads(made)["command"] == [
        "capt", "train", "--model", "weights/m", "--data", "$CAPT_DATA", "--out", "runs/rte/capt/default/seed0"]
    assert (d / "best" / "results.json").read_text() == '{"run": "runs/rte/capt/default/seed0"}\n'
    assert json.loads((d / "failed.json").read_text())["error"] == (  # the paths inside a message as well
        "capt: error: the validation scores became NaN; the best capsules so far are kept in "
        f"runs/rte/capt/default/seed0/best (read from $CAPT_DATA/RTE/train.jsonl in $CAPT_DATA, not {root}-old/m, run "
        "in .)")
    assert (d / "results.md").read_text() == "# A search\n\nModel `weights/m`, made by `capt run --data $CAPT_DATA`.\n"
    before = {p: p.stat().st_mtime_ns for p in d.rglob("*.json")}
    evidence.make_portable(d)  # once is enough: nothing left to rewrite
    assert {p: p.stat().st_mtime_ns for p in d.rglob("*.json")} == before


def test_the_chart_marks_what_refutes(tmp_path):
    pytest.importorskip("matplotlib")
    refuting = {"difference": -1.0, "low": -4.0, "high": 2.0, "p": 0.5, "verdict": "within noise", "seeds": [3, 1]}
    short = {**refuting, "high": 3.5}  # the interval holds a CaPT lead of 3 points: it does not refute
    doc = {"tasks": {"rte": {"rows": 277, "metric": "accuracy", "decision": "refuted: ...",
                             "methods": {"capt": {"vs_capt": None, "complete": True},
                                         "prompt": {"vs_capt": refuting, "complete": True},
                                         "prefix": {"vs_capt": short, "complete": True},
                                         "linear-head": {"vs_capt": {**refuting, "seeds": [3, 2]},
                                                         "complete": False}}}},
           "ablations": {"prepend": {"vs_add": refuting}}}
    fig = evidence_table.chart_figure(doc)
    texts = [[t.get_text() for t in ax.texts if "seeds" in t.get_text()] for ax in fig.axes]
    assert texts == [["-1.00  p 0.50  (3 vs 1 seeds) - refutes", "-1.00  p 0.50  (3 vs 1 seeds)",
                      "-1.00  p 0.50  (3 vs 2 seeds) - refutes so far"],  # a seed still to come can undo it
                     ["-1.00  p 0.50  (3 vs 1 seeds)"]]  # an ablation refutes nothing
    doc["tasks"]["rte"]["methods"]["prompt"]["vs_capt"] = {**refuting, "p": 0.0011}
    texts = [t.get_text() for t in evidence_table.chart_figure(doc).axes[0].texts if "seeds" in t.get_text()]
    assert texts[0] == "-1.00  p 0.001  (3 vs 1 seeds) - refutes"  # not "p 0.00"
    assert evidence_table.chart({"tasks": {}, "ablations": {}}, tmp_path / "none.png") is None  # nothing to draw
    assert evidence_table.chart(doc, tmp_path / "table.png") == tmp_path / "table.png"
    assert (tmp_path / "table.png").read_bytes()[:4] == b"\x89PNG"


def test_same_tells_a_change_of_arithmetic(small, tmp_path, monkeypatch, capsys):
    code, _ = small  # a copy of this checkout's capt, as the pinned one
    monkeypatch.setattr(evidence, "SAME_ARGS", ["--seed", "0", "--select", "loss", "--train-rows", "8",
                                                "--validation-rows", "4", "--batch-size", "4", "--max-steps", "2",
                                                "--eval-every", "1", "--device", "cpu"])
    args = ["same", "--code", str(code), "--out", str(tmp_path / "same"), "--methods", "capt", "--task", "rte"]
    assert evidence.main(args) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "the same bits"
    schedule = code / "capt" / "batches.py"  # the pinned copy's decay a little steeper: other bits
    schedule.write_text(schedule.read_text().replace("(total - step) / max(1, total - warmup)",
                                                     "(total - step) / max(1, total - warmup) * 0.9"))
    assert evidence.main(args) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "different: capt" and "best/capsules.safetensors False" in lines[-2]
    with pytest.raises(SystemExit, match="--methods: nope is neither a method "):
        evidence.main([*args[:-4], "--methods", "capt,nope"])


def test_a_failed_variant_is_counted_not_left_out(tmp_path):
    """A run that failed has no test.json: its variant's row says so, each failure is named below the table, and the
    chart writes "no score" where there is no difference to draw, rather than the variant vanishing."""
    out, labels = tmp_path / "out", [0, 1, 0, 1, 1, 0, 0, 1]
    uids = [f"r{i}" for i in range(len(labels))]

    def tested(folder: str, seed: int, prediction: list[int]):
        d = out / "rte" / folder / "default" / f"seed{seed}"
        d.mkdir(parents=True)
        score = 100 * sum(p == y for p, y in zip(prediction, labels)) / len(labels)
        (d / "test.json").write_text(json.dumps({"metrics": {"headline": score}, "examples": {
            "uid": uids, "group": [None] * len(labels), "label": labels, "prediction": prediction}}))

    for seed, wrong in enumerate((0, 1, 2)):  # add's three seeds, one of them flips row `wrong`
        tested("capt", seed, [1 - y if i == wrong else y for i, y in enumerate(labels)])
    tested("extraction", 0, [0] * len(labels))
    error = ("capt: error: the validation scores became NaN or infinite at step 250 (epoch 2), so training stopped; "
             "the best capsules so far are kept in runs/rte/projection/default/seed{}/best")
    for seed in (0, 2):
        d = out / "rte" / "projection" / "default" / f"seed{seed}"
        d.mkdir(parents=True)
        (d / "failed.json").write_text(json.dumps({"exit": 1, "error": error.format(seed)}))
    (out / "rte" / "projection" / "default" / "seed0" / "segments.json").write_text(json.dumps(
        [{"wall_s": 900.0, "cpu_s": 1600.0, "load": 2.0}, {"wall_s": 900.0, "cpu_s": 2000.0, "load": 2.0}]))
    assert evidence.wall_seconds(out / "rte" / "projection" / "default" / "seed0") == 1800.0  # its time counts too
    assert evidence.cpu_seconds(out / "rte" / "projection" / "default" / "seed0") == 3600.0
    lines, doc = evidence_table.ablation_lines(out)
    add = [json.loads((out / "rte" / "capt" / "default" / f"seed{s}" / "test.json").read_text())["examples"][
        "prediction"] for s in range(3)]
    c = stats.compare_pair([[0] * len(labels)], add, labels, "accuracy")  # the variant - add
    assert doc["extraction"]["vs_add"] == c and doc["extraction"]["failed"] == []
    assert f"| extraction | 1 | 50.00 (one seed) | {c['difference']:+.2f} | " in "\n".join(lines)
    why = "the validation scores became NaN or infinite at step 250 (epoch 2), so training stopped"
    assert doc["projection"] == {"seeds": 0, "test": [], "vs_add": None,
                                 "failed": [{"seed": 0, "error": why}, {"seed": 2, "error": why}]}
    assert "| projection | 0 (2 seeds failed) | - | - | - | - | no score: its seeds so far failed (below) |" in lines
    assert ("- projection seed 2 failed: the validation scores became NaN or infinite at step 250 (epoch 2), so "
            "training stopped.") in lines
    assert "prepend" not in doc and "length-2" not in doc  # neither run nor failed: no row
    if plots.available():
        texts = [t.get_text() for t in evidence_table.chart_figure({"tasks": {}, "ablations": doc}).axes[0].texts]
        assert texts == [f"{c['difference']:+.2f}  p {evidence_table.p_text(c['p'])}  (1 vs 3 seeds)",
                         "no score: 2 seeds failed"]


def test_an_amended_variant_is_made_at_its_own_commit(small, tmp_path, monkeypatch, capsys):
    """An amendment's runs are made from a checkout of its commit, every other run from the program's: a driver with
    the pinned checkout alone makes what it can and says which commit the rest waits for; given both, it makes each
    run from its own; program.json records the amendment once; code at a third commit, or with capt/ changed, is
    refused. The table sets the amended variant against add."""
    code, out = small
    amended = tmp_path / "amended"
    shutil.copytree(code, amended)
    (amended / "capt" / "stats.py").write_text((amended / "capt" / "stats.py").read_text() + "\n# amended\n")
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "amended"], cwd=amended,
                   check=True)
    def head(d):
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=d, capture_output=True, text=True).stdout.strip()

    pinned, later = head(code), head(amended)
    variants = {"projection-fan-in": ["--integration", "projection"]}
    for module in (evidence, evidence_table):
        monkeypatch.setattr(module, "GRIDS", {})
    monkeypatch.setattr(evidence, "AMENDMENTS", [{"amends": pinned, "commit": later, "variants": variants},
                                                 {"amends": "0" * 40, "commit": "1" * 40, "variants": {"x": []}}])
    used = []  # the checkout each run's process was given
    child_env = evidence.child_env
    monkeypatch.setattr(evidence, "child_env", lambda c: used.append(c) or child_env(c))
    assert evidence.main(["run", "--out", str(out), "--code", str(code)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (f"2 runs wait for a checkout of {later[:12]}: pass it as "
                                                        "another --code DIR")
    program = json.loads((out / "program.json").read_text())
    assert program["commit"] == pinned and [a["commit"] for a in program["amendments"]] == [later]  # not the other
    assert program["amendments"][0]["variants"] == variants
    assert [r["name"] for r in evidence.todo_runs(out)] == [f"rte/projection-fan-in/default/seed{s}" for s in (0, 1)]
    assert used == [code.resolve()] * 3  # zero-shot, CaPT's two seeds
    written = (out / "program.json").read_bytes()
    cut = out / "rte" / "projection-fan-in" / "default" / "seed0"  # as if cut off: said at the start, not lost unsaid
    cut.mkdir(parents=True)
    (cut / "state.pt").write_bytes(b"")
    assert evidence.main(["run", "--out", str(out), "--code", str(code)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (f"rte/projection-fan-in/default/seed0 was cut off, and it is "
                                                       f"made at {later[:12]}, which no --code here is: it waits (its "
                                                       "state.pt stays on this machine only)")
    shutil.rmtree(cut)
    assert evidence.main(["run", "--out", str(out), "--code", str(code), "--code", str(amended)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "nothing left to run"
    assert used[3:] == [amended.resolve()] * 2
    assert (out / "program.json").read_bytes() == written  # recorded once
    for folder, commit in (("capt", pinned), ("projection-fan-in", later)):
        for s in (0, 1):
            made = json.loads((out / "rte" / folder / "default" / f"seed{s}" / "made-at.json").read_text())
            assert made["commit"] == commit and made["command"][made["command"].index("--seed") + 1] == str(s)
    lines, doc = evidence_table.ablation_lines(out)
    add = [json.loads((out / "rte" / "capt" / "default" / f"seed{s}" / "test.json").read_text()) for s in (0, 1)]
    variant = [json.loads((out / "rte" / "projection-fan-in" / "default" / f"seed{s}" / "test.json").read_text())
               for s in (0, 1)]
    c = stats.compare_pair([r["examples"]["prediction"] for r in variant], [r["examples"]["prediction"] for r in add],
                           add[0]["examples"]["label"], "accuracy")
    assert doc["projection-fan-in"]["vs_add"] == c
    assert any(x.startswith(f"- projection-fan-in: an amendment's runs, made at commit {later[:12]}") for x in lines)
    assert evidence.main(["table", "--out", str(out), "--results", str(tmp_path / "results")]) == 0
    assert (f"Made at commit {pinned[:12]} (every run, but the amended variants projection-fan-in, made at "
            f"{later[:12]}; bench/evidence.py checks it). ") in (tmp_path / "results" / "table.md").read_text()
    third = tmp_path / "third"
    shutil.copytree(amended, third)
    (third / "capt" / "stats.py").write_text((third / "capt" / "stats.py").read_text() + "\n# third\n")
    with pytest.raises(SystemExit, match="third: capt/ has uncommitted changes; every run is made at a commit"):
        evidence.main(["run", "--out", str(out), "--code", str(code), "--code", str(third)])
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "third"], cwd=third,
                   check=True)
    with pytest.raises(SystemExit, match=f"{head(third)[:12]}, but the program runs at {pinned[:12]} \\(and its "
                                         f"amended variants at {later[:12]}\\): check that commit out"):
        evidence.main(["run", "--out", str(out), "--code", str(code), "--code", str(third)])
    assert (out / "program.json").read_bytes() == written
