"""`make demo` end to end on a tiny random model (the real run uses SmolLM2; see the README)."""

import json

from capt import demo
from helpers import tiny_llama, write_superglue


def test_demo_prints_zero_shot_and_capt_side_by_side(tmp_path, capsys):
    model = tiny_llama(tmp_path / "model")
    data = write_superglue(tmp_path / "data", {"CB": (40, 12)})
    out = tmp_path / "run"
    argv = ["--model", str(model), "--data", str(data), "--out", str(out), "--epochs", "1", "--max-length", "48", "--device", "cpu"]
    assert demo.main(argv) == 0
    text = capsys.readouterr().out
    assert "cb test set (12 examples, seed 0)" in text
    for row in ("f1", "accuracy", "gold NLL"):
        assert any(line.split()[:1] == [row.split()[0]] for line in text.splitlines()), row
    best = json.loads((out / "test.json").read_text())["best"]
    assert f"best capsules: step 3 of 3, validation gold NLL {best['loss']:.3f}: {out / 'best'}" in text
    lines = text.splitlines()
    header = lines[next(i for i, line in enumerate(lines) if line.startswith("cb test set")) + 1]
    assert header.split() == ["zero-shot", "zero", "capsule", "CaPT"]
    assert "How to read it: zero-shot is the frozen model alone" in text
    assert (out / "best" / "capsules.safetensors").is_file()
    assert demo.main(argv) == 0  # a second demo replaces the first


def test_demo_without_weights_says_how_to_get_them(tmp_path, capsys):
    assert demo.main(["--model", str(tmp_path / "none"), "--data", str(tmp_path)]) == 1
    assert capsys.readouterr().err.strip() == f"capt: error: no checkpoint in {tmp_path / 'none'}: `make weights` builds SmolLM2-135M-Instruct there"


def test_demo_never_deletes_what_it_did_not_write(tmp_path, capsys):
    model = tiny_llama(tmp_path / "model")
    data = write_superglue(tmp_path / "data", {"CB": (20, 6)})
    argv = ["--model", str(model), "--data", str(data), "--epochs", "1", "--max-length", "48", "--device", "cpu"]
    assert demo.main(argv + ["--out", str(model)]) == 1  # a checkpoint directory (it has a config.json)
    assert "holds something other than a capt run" in capsys.readouterr().err
    assert (model / "model.safetensors").is_file()
