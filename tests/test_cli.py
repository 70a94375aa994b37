"""The command line on tiny random checkpoints: help, train + eval, run, and each bad input's one-line error.

`capt train` + `capt eval` on real CB data reads the CB files that ship in data/superglue, as a new
user's commands do (CAPT_DATA unset); everything else uses small synthetic files in the official format.
"""

import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import capt, one_line_error, write_superglue

import capt.load as load_module
import capt.trainer as train_module
from capt.cli.main import main
from capt.cli.experiment import processor_name
from capt.errors import CaptError
from capt.trainer import default_lr

FAST = ["--batch-size", "8", "--device", "cpu"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """CB and COPA complete, BoolQ with its val file only (as in the real data), the rest absent."""
    root = write_superglue(tmp_path_factory.mktemp("data"), {"CB": (40, 12), "COPA": (30, 10), "BoolQ": (0, 10)})
    return root




def test_help_of_every_subcommand(capsys):
    for command, options in {
        "train": [
            "--model",
            "--task",
            "--out",
            "--data",
            "--epochs",
            "--batch-size",
            "--grad-accum",
            "--lr",
            "--seed",
            "--max-steps",
            "--dtype",
            "--max-length",
            "--patience",
            "--warmup",
            "--device",
            "--resume",
            "--deterministic",
            "--method",
            "--n",
        ],
        "eval": [
            "--model",
            "--capsules",
            "--adapter",
            "--method",
            "--n",
            "--task",
            "--data",
            "--split",
            "--batch-size",
            "--dtype",
            "--device",
        ],
        "run": [
            "--model",
            "--tasks",
            "--seeds",
            "--seed-list",
            "--out",
            "--epochs",
            "--lr",
            "--max-steps",
            "--resume",
            "--method",
            "--n",
            "--lengths",
        ],
        "predict": [
            "--model",
            "--adapter",
            "--capsules",
            "--method",
            "--task",
            "--input",
            "--out",
            "--batch-size",
            "--max-length",
            "--dtype",
            "--device",
            "--normalize",
        ],
        "compare": ["OUT", "--out"],
        "attention": [
            "--model",
            "--capsules",
            "--adapter",
            "--method",
            "--task",
            "--split",
            "--limit",
            "--layers",
            "--curves",
            "--out",
        ],
    }.items():
        with pytest.raises(SystemExit) as e:
            main([command, "--help"])
        assert e.value.code == 0
        out = capsys.readouterr().out
        for option in options:
            assert option in out, (command, option)
    result = subprocess.run([sys.executable, "-m", "capt", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "{train,eval,predict,run,compare,attention}" in result.stdout


def test_usage_errors_exit_2(capsys):
    for argv in (
        ["train", "--model", "m", "--task", "cb"],
        ["eval", "--task", "cb"],
        ["train", "--out", "x", "--batch-size", "0"],
    ):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
    capsys.readouterr()
    assert main([]) == 2


def test_train_then_eval_on_real_cb(ckpts, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("CAPT_DATA", raising=False)
    monkeypatch.chdir(Path(__file__).resolve().parents[1])  # the repository: its data/superglue holds CB
    model, run = ckpts["llama"], tmp_path / "run"
    code, out, err = capt(
        "train", "--model", model, "--task", "cb", "--out", run, "--max-steps", 4, "--epochs", 2, *FAST, capsys=capsys
    )
    assert code == 0, err
    test = json.loads((run / "test.json").read_text())
    assert test["n"] == 56 and test["steps"] == 4 and test["stopped"] == "max_steps"
    assert f"f1 {test['metrics']['f1']:.2f}  accuracy {test['metrics']['accuracy']:.2f}" in out
    config = json.loads((run / "config.json").read_text())
    assert config["examples"] == {"train": 225, "validation": 25, "test": 56} and config["max_steps"] == 4

    for capsules in (run / "best", run):  # the capsule directory, or the run directory
        code, out, err = capt(
            "eval", "--model", model, "--task", "cb", "--capsules", capsules, "--json", "--device", "cpu", capsys=capsys
        )
        assert code == 0, err
        assert json.loads(out)["metrics"] == test["metrics"]
    code, out, err = capt(
        "eval", "--model", model, "--task", "cb", "--split", "validation", "--device", "cpu", capsys=capsys
    )
    assert code == 0 and out.startswith("cb validation (25 examples), zero-shot (no capsules): f1 ")

    # --resume keeps the run's max_steps (the length of its schedule): the finished run gives the same test, not
    # tested again
    with monkeypatch.context() as m:
        m.setattr(train_module.Trainer, "test", lambda self: pytest.fail("a finished run was tested again"))
        code, out, err = capt("train", "--out", run, "--resume", "--device", "cpu", capsys=capsys)
    assert code == 0, err
    assert json.loads((run / "test.json").read_text()) == test
    code, _, err = capt("train", "--out", run, "--resume", "--max-steps", 6, "--device", "cpu", capsys=capsys)
    one_line_error(code, err, "other settings: max_steps 4 (given 6)", "length of the learning-rate schedule")

    # --deterministic is kept by a resumed run unless given, and may change (it chooses kernels, not the result)
    configs = []
    with monkeypatch.context() as m:
        m.setattr("capt.cli.main.train", lambda config, resume: configs.append(config) or test)
        config = json.loads((run / "config.json").read_text())
        (run / "config.json").write_text(json.dumps(dict(config, deterministic=True)))
        for given in ([], ["--no-deterministic"]):
            code, _, err = capt("train", "--out", run, "--resume", "--device", "cpu", *given, capsys=capsys)
            assert code == 0, err
    assert [c.deterministic for c in configs] == [True, False]


def test_run_tasks_and_seeds(ckpts, data, tmp_path, capsys, monkeypatch):
    out_dir = tmp_path / "out"
    code, out, err = capt(
        "run",
        "--model",
        ckpts["llama"],
        "--tasks",
        "all",
        "--seeds",
        2,
        "--out",
        out_dir,
        "--data",
        data,
        "--max-steps",
        3,
        "--lr",
        0.05,
        "--warmup",
        0,
        *FAST,
        capsys=capsys,
    )
    assert code == 0, err
    results = json.loads((out_dir / "results.json").read_text())
    assert results["seeds"] == [0, 1] and results["average"] is None
    env = results["environment"]  # what reproducing the table needs
    assert env["torch"] == torch.__version__ and env["device"].endswith("CPU, 1 threads") and env["wall_seconds"] > 0
    assert env["processor"] == processor_name() and (env["processor"] is None or len(env["processor"]) > 0)
    assert (
        "Made by `" in (out_dir / "results.md").read_text()
        and (env["processor"] or "torch") in (out_dir / "results.md").read_text()
    )
    assert results["settings"]["data"] == str(data)  # as given
    for name, folder in (("cb", "CB"), ("copa", "COPA")):  # the files themselves, by hash
        for split in ("train.jsonl", "val.jsonl"):
            assert (
                results["data_files"][name][split] == hashlib.sha256((data / folder / split).read_bytes()).hexdigest()
            )
    assert set(results["data_files"]) == {"cb", "copa"}
    tasks = results["tasks"]
    assert set(tasks) == {"boolq", "cb", "copa", "multirc", "rte", "wic"}
    assert "train.jsonl" in tasks["boolq"]["skipped"] and "no MultiRC directory" in tasks["multirc"]["skipped"]
    for name in ("cb", "copa"):
        t = tasks[name]
        assert [r["seed"] for r in t["runs"]] == [0, 1] and all(r["steps"] == 3 for r in t["runs"])
        heads = [r["test"]["headline"] for r in t["runs"]]
        assert t["mean"] == pytest.approx(sum(heads) / 2) and t["std"] >= 0
        assert "headline" in t["zero_shot"]
        for seed in (0, 1):
            run = out_dir / name / f"seed{seed}"
            assert json.loads((run / "test.json").read_text())["metrics"] == t["runs"][seed]["test"]
    md = (out_dir / "results.md").read_text()
    assert md == out[: len(md)]
    rows = {line.split(" | ")[0].strip("| "): line for line in md.splitlines() if line.startswith("| ")}
    assert "skipped: no official train.jsonl" in rows["boolq"] and "±" in rows["cb"] and "±" in rows["copa"]
    assert "No six-task average" in md

    # --resume reuses the finished runs (they are not tested again): same table
    with monkeypatch.context() as m:
        m.setattr(train_module.Trainer, "test", lambda self: pytest.fail("a finished run was tested again"))
        code, out2, err = capt(
            "run",
            "--model",
            ckpts["llama"],
            "--tasks",
            "all",
            "--seeds",
            2,
            "--out",
            out_dir,
            "--data",
            data,
            "--max-steps",
            3,
            "--lr",
            0.05,
            "--warmup",
            0,
            "--resume",
            *FAST,
            capsys=capsys,
        )
    assert code == 0, err
    assert json.loads((out_dir / "results.json").read_text())["tasks"] == tasks

    # data from CAPT_DATA is recorded as such, not as this machine's path
    with monkeypatch.context() as m:
        m.setenv("CAPT_DATA", str(data))
        code, _, err = capt("run", "--model", ckpts["llama"], "--tasks", "cb", "--seeds", 1, "--out", tmp_path / "o3",
                            "--max-steps", 1, *FAST, capsys=capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "o3" / "results.json").read_text())["settings"]["data"] == "$CAPT_DATA"

    # a named task whose data is missing is an error, not a skip
    code, _, err = capt(
        "run", "--model", ckpts["llama"], "--tasks", "cb,boolq", "--out", tmp_path / "o2", "--data", data, capsys=capsys
    )
    one_line_error(code, err, "task boolq: no official train.jsonl")


def test_run_six_tasks_gives_the_average(ckpts, tmp_path, capsys):
    sizes = {name: (12, 4) for name in ("BoolQ", "CB", "COPA", "RTE", "WiC")}
    sizes["MultiRC"] = (6, 2)
    data = write_superglue(tmp_path / "data", sizes)
    code, out, err = capt(
        "run",
        "--model",
        ckpts["t5"],
        "--tasks",
        "all",
        "--seed-list",
        "3",
        "--out",
        tmp_path / "out",
        "--data",
        data,
        "--max-steps",
        1,
        *FAST,
        capsys=capsys,
    )
    assert code == 0, err
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    heads = [results["tasks"][t]["mean"] for t in ("boolq", "cb", "copa", "multirc", "rte", "wic")]
    assert results["seeds"] == [3] and results["average"]["mean"] == pytest.approx(sum(heads) / 6)
    assert "| **average (6 tasks)** |" in out


def bad_data(root: Path, task: str, train: str | None, val: str | None = None) -> Path:
    folder = root / task
    folder.mkdir(parents=True)
    for name, text in (("train.jsonl", train), ("val.jsonl", val)):
        if text is not None:
            (folder / name).write_text(text)
    return root


CB_ROW = {"premise": "It rained.", "hypothesis": "it rained", "label": "entailment", "idx": 0}


@pytest.mark.parametrize("case", ["unknown task", "missing data directory", "missing split file", "malformed line",
                                  "missing field", "unknown label", "empty split"])
def test_bad_input_is_one_line(ckpts, tmp_path, capsys, case):
    good = json.dumps(CB_ROW) + "\n"
    root = tmp_path / "data"
    argv = ["eval", "--model", ckpts["llama"], "--task", "cb", "--device", "cpu", "--data", root]
    expected = {
        "unknown task": "unknown task 'nope'; known tasks: boolq, cb",
        "missing data directory": "SuperGLUE data not found: --data",
        "missing split file": "split needs the official",
        "malformed line": "val.jsonl line 2: not valid JSON",
        "missing field": "val.jsonl line 1: missing field 'premise'",
        "unknown label": "val.jsonl line 1: unknown label \"maybe\"",
        "empty split": "val.jsonl: no examples (the file is empty)",
    }[case]
    if case == "unknown task":
        argv[4] = "nope"
        root.mkdir()
    elif case == "missing split file":
        bad_data(root, "CB", good)
    elif case == "malformed line":
        bad_data(root, "CB", good, good + "{not json\n")
    elif case == "missing field":
        bad_data(root, "CB", good, json.dumps({k: v for k, v in CB_ROW.items() if k != "premise"}) + "\n")
    elif case == "unknown label":
        bad_data(root, "CB", good, json.dumps(dict(CB_ROW, label="maybe")) + "\n")
    elif case == "empty split":
        bad_data(root, "CB", good, "")
    code, _, err = capt(*argv, capsys=capsys)
    one_line_error(code, err, expected)
    if case != "missing data directory":  # the same errors from capt train
        train = [
            "train",
            "--model",
            ckpts["llama"],
            "--task",
            argv[4],
            "--out",
            tmp_path / "run",
            "--data",
            root,
            "--device",
            "cpu",
        ]
        if case in ("missing split file", "malformed line", "missing field", "unknown label", "empty split"):
            (root / "CB" / "train.jsonl").write_text(
                (root / "CB" / "val.jsonl").read_text() if (root / "CB" / "val.jsonl").exists() else ""
            )
            expected = expected.replace("val.jsonl", "train.jsonl").replace(
                "CB test split needs the official val file", "CB train split needs the official train file"
            )
            if case == "missing split file":
                (root / "CB" / "train.jsonl").unlink()
        code, _, err = capt(*train, capsys=capsys)
        one_line_error(code, err, expected)


def test_resume_and_capsules_from_another_model_or_task(ckpts, data, tmp_path, capsys):
    run = tmp_path / "run"
    code, _, err = capt(
        "train",
        "--model",
        ckpts["llama"],
        "--task",
        "cb",
        "--out",
        run,
        "--data",
        data,
        "--max-steps",
        1,
        *FAST,
        capsys=capsys,
    )
    assert code == 0, err
    # the random tiny model, one step: the zero-shot line, then the note a run that has not learnt gets
    zero = json.loads((run / "config.json").read_text())["zero_shot_validation"]
    assert f"zero-shot validation f1 {zero['metrics']['f1']:.2f}, accuracy " in err
    best = json.loads((run / "test.json").read_text())["best"]["loss"]
    assert best > math.log(3) and (f"note: the best validation gold NLL, {best:.3f}, is not below ln 3 = 1.099 by 0.1 "
                                   "nats") in err and "docs/your-data.md#when-a-run-does-not-learn" in err
    code, _, err = capt(
        "train", "--model", ckpts["t5"], "--task", "cb", "--out", run, "--data", data, "--resume", capsys=capsys
    )
    one_line_error(code, err, "was trained on a different model", "use a new --out")
    code, _, err = capt("train", "--task", "copa", "--out", run, "--resume", capsys=capsys)
    one_line_error(code, err, "is a cb run, not copa")
    code, _, err = capt("train", "--out", run, "--resume", "--lr", "0.5", capsys=capsys)
    one_line_error(code, err, f"other settings: lr {default_lr('capt', 'rms'):g} (given 0.5)")
    code, _, err = capt("train", "--out", run, "--resume", "--max-steps", "2", capsys=capsys)
    one_line_error(code, err, "other settings: max_steps 1 (given 2) (max_steps is the length of the learning-rate "
                              "schedule)",
                   "resume with the run's settings or use a new --out")
    # takes the run's max_steps
    code, out, err = capt("train", "--out", run, "--resume", "--device", "cpu", capsys=capsys)
    assert code == 0, err
    assert json.loads((run / "test.json").read_text())["steps"] == 1 and "best capsules from step 1" in out
    code, _, err = capt("train", "--model", ckpts["llama"], "--task", "cb", "--out", run, "--data", data, capsys=capsys)
    one_line_error(code, err, "already holds a run; pass --resume")
    code, _, err = capt("train", "--out", tmp_path / "nothing", "--resume", capsys=capsys)
    one_line_error(code, err, "nothing to resume")
    code, _, err = capt(
        "eval",
        "--model",
        ckpts["t5"],
        "--task",
        "cb",
        "--data",
        data,
        "--capsules",
        run / "best",
        "--device",
        "cpu",
        capsys=capsys,
    )
    one_line_error(code, err, "were made for a different base model", "model_type 'llama' vs 't5'")


@pytest.fixture
def no_loading(monkeypatch):
    """Fail if a model is loaded: the errors below must come before it."""
    def refuse(*args, **kwargs):
        pytest.fail("the model was loaded before the error")

    monkeypatch.setattr(load_module, "load_model", refuse)
    monkeypatch.setattr(train_module, "load_model", refuse)


@pytest.mark.parametrize("command", ["train", "run"])
def test_an_unusable_out_is_one_line_before_loading(ckpts, data, tmp_path, capsys, no_loading, command):
    taken = tmp_path / "file"
    taken.write_text("not a directory\n")
    argv = (
        ["train", "--model", ckpts["llama"], "--task", "cb"]
        if command == "train"
        else ["run", "--model", ckpts["llama"], "--tasks", "cb"]
    )
    code, _, err = capt(*argv, "--out", taken, "--data", data, *FAST, capsys=capsys)
    one_line_error(code, err, f"--out {taken} is a file, not a directory; choose another --out")
    code, _, err = capt(*argv, "--out", taken / "run", "--data", data, *FAST, capsys=capsys)
    one_line_error(code, err, f"cannot create the output directory {taken / 'run'}: Not a directory")
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        code, _, err = capt(*argv, "--out", locked, "--data", data, *FAST, capsys=capsys)
        one_line_error(code, err, f"cannot write in the output directory {locked}: permission denied")


def test_an_unusable_device_is_one_line_before_loading(ckpts, data, tmp_path, capsys, no_loading, monkeypatch):
    model = ckpts["llama"]
    train = ["train", "--model", model, "--task", "cb", "--out", tmp_path / "run", "--data", data]
    evaluate = ["eval", "--model", model, "--task", "cb", "--data", data]
    for argv in (train, evaluate):
        code, _, err = capt(*argv, "--device", "foo", capsys=capsys)
        one_line_error(code, err, "device 'foo' is not a torch device (use cpu, cuda or cuda:N)")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv in (
        train,
        evaluate,
        ["run", "--model", model, "--tasks", "cb", "--out", tmp_path / "out", "--data", data],
    ):
        code, _, err = capt(*argv, "--device", "cuda", capsys=capsys)
        one_line_error(code, err, "device cuda requested but no CUDA GPU is available")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    code, _, err = capt(*evaluate, "--device", "cuda:1", capsys=capsys)
    one_line_error(code, err, "device cuda:1 requested but this machine has 1 CUDA GPU(s): cuda:0 .. cuda:0")
    assert not (tmp_path / "run").exists() and not (tmp_path / "out").exists()


def test_os_errors_are_one_line(monkeypatch, capsys):
    def unreadable(args):
        raise PermissionError(13, "Permission denied", "/runs/a/state.pt")

    monkeypatch.setattr("capt.cli.main.cmd_train", unreadable)
    code, _, err = capt("train", "--out", "x", capsys=capsys)
    one_line_error(code, err, "capt: error: [Errno 13] Permission denied: '/runs/a/state.pt'")


def test_warmup_must_be_a_fraction_or_whole_steps(ckpts, data, tmp_path, capsys):
    code, _, err = capt("train", "--model", ckpts["llama"], "--task", "cb", "--out", tmp_path / "run", "--data", data,
                        "--warmup", 1.5, *FAST, capsys=capsys)
    one_line_error(code, err, "warmup 1.5 is neither a fraction of the planned steps (below 1) nor a whole number of "
                              "steps")


def test_eval_of_a_run_takes_its_max_length_and_dtype(ckpts, data, tmp_path, capsys):
    """capt eval --adapter RUN evaluates as the run's test did (its --max-length and --dtype) unless told otherwise."""
    model, run = ckpts["llama"], tmp_path / "run"
    code, _, err = capt("train", "--model", model, "--task", "cb", "--out", run, "--data", data, "--max-steps", 1,
                        "--max-length", 48, "--dtype", "bf16", *FAST, capsys=capsys)
    assert code == 0, err
    test = json.loads((run / "test.json").read_text())

    def loss(*options):
        code, out, err = capt(
            "eval",
            "--model",
            model,
            "--task",
            "cb",
            "--data",
            data,
            "--json",
            "--device",
            "cpu",
            *options,
            capsys=capsys,
        )
        assert code == 0, err
        return json.loads(out)["loss"]

    for where in (run, run / "best"):
        assert loss("--adapter", where) == test["loss"]
    assert loss("--adapter", run, "--dtype", "bf16") == test["loss"]  # --max-length from the run
    assert loss("--adapter", run, "--max-length", 48) == test["loss"]  # --dtype from the run
    assert loss("--adapter", run, "--max-length", 256) != test["loss"]  # the run's max_length matters here
    assert loss("--adapter", run, "--dtype", "fp32") != test["loss"]
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert (
        "--max-length N input token budget (default: the run's with --adapter RUN_DIR or RUN_DIR/best, else 256)"
        in help_text
    )
    assert (
        "--dtype {fp32,bf16} backbone weights (default: the run's with --adapter RUN_DIR or RUN_DIR/best, else fp32)"
        in help_text
    )


def test_messages_say_a_way_out(ckpts, data, tmp_path, capsys, monkeypatch):
    """A run whose config.json is gone: resume and a fresh start both say to move it away (neither sends to the
    other); a run with no best/ yet, given as the adapter, says so instead of asking for --adapter."""
    run = tmp_path / "run"
    code, _, err = capt(
        "train",
        "--model",
        ckpts["llama"],
        "--task",
        "cb",
        "--out",
        run,
        "--data",
        data,
        "--max-steps",
        1,
        *FAST,
        capsys=capsys,
    )
    assert code == 0, err
    (run / "config.json").unlink()
    for extra in (["--resume"], ["--model", ckpts["llama"], "--task", "cb", "--data", data]):
        code, _, err = capt("train", "--out", run, *extra, *FAST, capsys=capsys)
        one_line_error(code, err, "holds a run's state.pt but no config.json", "move")
        assert "pass --resume" not in err and "without --resume" not in err
    fresh = tmp_path / "fresh"
    from capt.trainer import Interrupted, TrainConfig, train
    with pytest.raises(Interrupted):
        train(
            TrainConfig(
                model=str(ckpts["llama"]), task="cb", out=str(fresh), data=str(data), batch_size=8, device="cpu"
            ),
            progress=False,
            stop_after=0,
        )
    assert not (fresh / "best").exists()
    code, _, err = capt(
        "eval", "--model", ckpts["llama"], "--adapter", fresh, "--data", data, "--device", "cpu", capsys=capsys
    )
    one_line_error(code, err, "is a run directory with no best/ yet")


def test_predict_writes_under_runs_by_default(ckpts, data, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rows = tmp_path / "rows.jsonl"
    rows.write_text((data / "CB" / "val.jsonl").read_text())
    code, out, err = capt(
        "predict", "--model", ckpts["llama"], "--task", "cb", "--input", rows, "--device", "cpu", capsys=capsys
    )
    assert code == 0, err
    assert (tmp_path / "runs" / "predictions.jsonl").is_file() and "written: runs/predictions.jsonl" in out


def test_run_tasks_counts_each_seed_and_length_once(ckpts, tmp_path):
    """Given twice, a seed would be trained (or, resumed, found) twice and counted twice in the mean."""
    from capt.cli.experiment import run_tasks

    with pytest.raises(CaptError, match=r"^each seed must be given once, got \[1, 1\]$"):
        run_tasks(str(ckpts["llama"]), "cb", [1, 1], str(tmp_path / "out"), resume=True)
    with pytest.raises(CaptError, match=r"^each length must be given once, got \[2, 2\]$"):
        run_tasks(str(ckpts["llama"]), "cb", [0], str(tmp_path / "out"), lengths=[2, 2], method="prompt")
    assert not (tmp_path / "out").exists()
