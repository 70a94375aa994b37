"""`make demo` end to end on a tiny random model (the real run uses SmolLM2; see the README)."""

import json
import re

import pytest

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
    assert f"end with {versus}" in text  # each metric compared with zero-shot's, read off the printed table
    # the paired comparison: one line per metric, its difference the table's, inside its own interval
    assert "CaPT - zero-shot, paired on the same 12 rows" in text
    for name, zero_metric, trained_metric in zero_and_trained(text):
        line = next(x for x in lines if x.split()[:1] == [name] and "points" in x)
        difference, low, high = (float(v) for v in re.findall(r"[+-]\d+\.\d+", line)[:3])
        assert abs(difference - (trained_metric - zero_metric)) < 0.011 and low <= difference <= high
        assert line.endswith(("within noise", "CaPT ahead", "zero-shot ahead"))
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


def test_the_paired_comparison_is_capts_rows_against_zero_shots():
    """against_zero_shot reads the two evaluations' per-example records row by row: the same predictions are
    level and within noise; CaPT right on all 56 rows where zero-shot is wrong on all is ahead, with McNemar's exact
    p = 2 / 2**56; MultiRC's questions (groups) go through as the resampled units."""
    labels = [0, 1, 2, 1] * 14

    def records(predictions, groups=None):
        return {"examples": {"uid": list(range(56)), "group": groups or [None] * 56, "label": labels,
                             "prediction": predictions}}

    same = demo.against_zero_shot(records(labels), records(labels), ["f1", "accuracy"])
    assert list(same) == ["f1", "accuracy"]
    assert all(c["difference"] == 0 and c["p"] == 1 and c["verdict"] == "within noise" for c in same.values())
    wrong = [(y + 1) % 3 for y in labels]
    ahead = demo.against_zero_shot(records(wrong), records(labels), ["accuracy", "em"])  # em: not resampled
    assert list(ahead) == ["accuracy"]
    c = ahead["accuracy"]
    assert (c["difference"], c["wins"], c["losses"], c["verdict"]) == (100.0, 56, 0, "A ahead")
    assert c["p"] == pytest.approx(2 * 0.5**56, rel=1e-12)
    grouped = demo.against_zero_shot(records(wrong, [f"{i // 4}:0" for i in range(56)]), records(labels),
                                     ["accuracy"])
    assert grouped["accuracy"]["units"] == 14
