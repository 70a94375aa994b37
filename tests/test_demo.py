"""`make demo` end to end on a tiny random model (the real run uses SmolLM2; see the README)."""

import json

from capt.cli import demo
from helpers import tiny_llama, write_superglue, write_task


def test_demo_prints_zero_shot_and_capt_side_by_side(tmp_path, capsys):
    model = tiny_llama(tmp_path / "model")
    data = write_superglue(tmp_path / "data", {"CB": (40, 12)})
    out = tmp_path / "run"
    argv = [
        "--model",
        str(model),
        "--task",
        "cb",
        "--data",
        str(data),
        "--out",
        str(out),
        "--epochs",
        "1",
        "--max-length",
        "48",
        "--device",
        "cpu",
    ]
    assert demo.main(argv) == 0
    text = capsys.readouterr().out
    assert "cb test set (12 examples, seed 0)" in text
    for row in ("f1", "accuracy", "gold NLL"):
        assert any(line.split()[:1] == [row.split()[0]] for line in text.splitlines()), row
    best = json.loads((out / "test.json").read_text())["best"]
    # the best evaluation is chosen by the headline (f1 for CB), not by the gold NLL printed beside it
    assert (f"best capsules: step 3 of 3, chosen by validation f1 {best['validation']['f1']:.2f} "
            f"(gold NLL {best['loss']:.3f}): {out / 'best'}") in text
    lines = text.splitlines()
    header = lines[next(i for i, line in enumerate(lines) if line.startswith("cb test set")) + 1]
    assert header.split() == ["zero-shot", "zero", "capsule", "CaPT"]
    assert "How to read it: zero-shot is the frozen model alone" in text
    versus = ", ".join(f"{n} {'at or above' if trained_metric >= zero_metric else 'below'} zero-shot"
                       for n, zero_metric, trained_metric in zero_and_trained(text))
    assert f"end with {versus}." in text  # each metric compared with zero-shot's, read off the printed table
    assert "What it can show: 3 steps on a 135M model" in text
    assert (out / "best" / "capsules.safetensors").is_file()
    assert demo.main(argv) == 0  # a second demo replaces the first


def zero_and_trained(text: str):
    """(metric, zero-shot, CaPT) for each metric row of the demo's table."""
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[0] in ("f1", "accuracy"):
            yield parts[0], float(parts[1]), float(parts[3])


def test_demo_takes_a_task_file_and_defaults_to_the_shipped_one(tmp_path, capsys):
    """The demo trains on a task file (its name heads the table, its own data is read, --data is not
    needed); without --task it uses examples/cb-yes-no.json, which ships with the repository."""
    model = tiny_llama(tmp_path / "model")
    task = write_task(tmp_path / "task", (40, 0, 12))
    out = tmp_path / "run"
    assert (
        demo.main(
            [
                "--model",
                str(model),
                "--task",
                str(task),
                "--out",
                str(out),
                "--epochs",
                "1",
                "--max-length",
                "48",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "capt demo: reviews with" in text and "reviews test set (12 examples, seed 0)" in text
    assert json.loads((out / "config.json").read_text())["task"] == str(task)
    assert demo.build_parser().parse_args([]).task is None and demo.DEMO_TASK.is_file()
    assert demo.DEMO_TASK == demo.Path(__file__).resolve().parents[1] / "examples" / "cb-yes-no.json"


def test_demo_without_weights_says_how_to_get_them(tmp_path, capsys):
    assert demo.main(["--model", str(tmp_path / "none"), "--data", str(tmp_path)]) == 1
    assert (
        capsys.readouterr().err.strip()
        == f"capt: error: no checkpoint in {tmp_path / 'none'}: `make weights` builds SmolLM2-135M-Instruct there"
    )


def test_demo_never_deletes_what_it_did_not_write(tmp_path, capsys):
    model = tiny_llama(tmp_path / "model")
    data = write_superglue(tmp_path / "data", {"CB": (20, 6)})
    argv = [
        "--model",
        str(model),
        "--task",
        "cb",
        "--data",
        str(data),
        "--epochs",
        "1",
        "--max-length",
        "48",
        "--device",
        "cpu",
    ]
    assert demo.main(argv + ["--out", str(model)]) == 1  # a checkpoint directory (it has a config.json)
    assert "holds something other than a capt run" in capsys.readouterr().err
    assert (model / "model.safetensors").is_file()
