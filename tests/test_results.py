"""The committed analyses come from the committed adapters: `capt attention` with the RTE capsules and
the deep prompt under results/smollm2-135m-cpu-attention gives the first example's maps recorded in
their attention.json. Needs the real checkpoint (`make weights`) and RTE (CAPT_DATA); skips without."""

import json
import os
from pathlib import Path

import pytest
import torch

from capt.cli.main import main

REPO = Path(__file__).resolve().parents[1]
CKPT = REPO / "weights" / "smollm2-135m-instruct"
RESULTS = REPO / "results" / "smollm2-135m-cpu-attention"
DATA = os.environ.get("CAPT_DATA")
pytestmark = pytest.mark.skipif(
    not (CKPT / "config.json").is_file() or not DATA or not (Path(DATA) / "RTE" / "train.jsonl").is_file(),
    reason="needs weights/smollm2-135m-instruct (make weights) and CAPT_DATA with RTE",
)


@pytest.mark.parametrize(
    "name, method",
    [
        ("capt-1-epoch", ["--capsules", "rte-capsules"]),
        ("deep-prompt-1-epoch", ["--method", "deep-prompt", "--adapter", "rte-deep-prompt"]),
    ],
)
def test_committed_attention_maps_reproduce(name, method, tmp_path, capsys):
    committed = json.loads((RESULTS / name / "attention.json").read_text())
    argv = [a if not a.startswith("rte-") else str(RESULTS / a) for a in method]
    code = main(
        [
            "attention",
            "--model",
            str(CKPT),
            "--task",
            "rte",
            *argv,
            "--limit",
            "1",
            "--max-length",
            "128",
            "--no-answer-cue",
            "--device",
            "cpu",
            "--data",
            DATA,
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0, capsys.readouterr().err
    mine = json.loads((tmp_path / "attention.json").read_text())
    assert (
        mine["data_files"] == committed["data_files"]
        and mine["model_config_sha256"] == committed["model_config_sha256"]
    )
    assert mine["examples"]["0"]["keys"] == committed["examples"]["0"]["keys"]
    for layer, rows in committed["examples"]["0"]["layers"].items():  # kept to 5 decimals
        torch.testing.assert_close(
            torch.tensor(mine["examples"]["0"]["layers"][layer]), torch.tensor(rows), atol=1e-4, rtol=0
        )
    # and the maps differ between the two adapters, so the comparison can tell them apart
    other = "deep-prompt-1-epoch" if name == "capt-1-epoch" else "capt-1-epoch"
    theirs, ours = (
        json.loads((RESULTS / other / "attention.json").read_text())["examples"]["0"]["layers"]["15"],
        mine["examples"]["0"]["layers"]["15"],
    )
    assert len(theirs) != len(ours) or (torch.tensor(theirs) - torch.tensor(ours)).abs().max() > 0.05


POOLED = REPO / "results" / "smollm2-135m-cpu-pooled"


@pytest.mark.parametrize(
    "name, adapter",
    [("copa-pooled-1", []), ("copa-deep-prompt-pooled-2", ["--adapter", str(POOLED / "copa-deep-prompt")])],
)
def test_committed_pooled_scores_reproduce(name, adapter, capsys):
    committed = json.loads((POOLED / f"{name}.json").read_text())
    code = main(
        [
            "eval",
            "--model",
            str(CKPT),
            "--task",
            "copa",
            "--method",
            "pooled",
            "--n",
            str(committed["pooled"]),
            *adapter,
            "--max-length",
            "128",
            "--no-answer-cue",
            "--device",
            "cpu",
            "--data",
            DATA,
            "--json",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    mine = json.loads(out)
    assert mine["n"] == committed["n"] == 100 and mine["metrics"] == pytest.approx(committed["metrics"])
    assert mine["loss"] == pytest.approx(committed["loss"], rel=1e-4)
