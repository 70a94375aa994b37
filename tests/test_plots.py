"""Pictures (capt/plots.py): a run's curves.png and capt compare's compare.png hold the numbers of
metrics.jsonl and of the comparison; without matplotlib both are skipped with one line and
nothing else changes."""

import json
import sys
from pathlib import Path

import pytest
from helpers import write_superglue

from capt.cli.main import main
from capt.errors import CaptError, CaptWarning
from capt.plots import compare_figure, curves_figure, run_curves
from capt.cli.report import compare, compare_markdown, mean_std, read_results
from capt.trainer import TrainConfig, train

ROOT = Path(__file__).resolve().parents[1]
METHODS = ROOT / "results" / "smollm2-135m-cpu-cb-methods"
RUNS = [METHODS / m for m in ("capt", "prompt", "deep-prompt", "prefix", "linear-head", "instance")]
matplotlib = pytest.importorskip("matplotlib", reason="the pictures need matplotlib (make setup installs it)")


@pytest.fixture(scope="module")
def run(ckpts, tmp_path_factory):
    """A finished tiny CB run with four validation evaluations."""
    root = tmp_path_factory.mktemp("plots")
    data = write_superglue(root / "data", {"CB": (40, 12)})
    config = TrainConfig(
        model=str(ckpts["llama"]),
        task="cb",
        out=str(root / "run"),
        data=str(data),
        epochs=2,
        batch_size=8,
        eval_every=2,
        device="cpu",
    )
    train(config, progress=False)
    return root / "run"


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_a_damaged_config_is_said_and_the_curves_drawn_without_it(run, tmp_path):
    copy = tmp_path / "run"
    copy.mkdir()
    (copy / "metrics.jsonl").write_bytes((run / "metrics.jsonl").read_bytes())
    (copy / "config.json").write_text("{not json")
    with pytest.warns(CaptWarning, match="config.json.*drawn without the title and the zero-shot lines"):
        assert run_curves(copy) == copy / "curves.png"
    assert png_size(copy / "curves.png") == (1100, 572)


def test_training_draws_the_curves_of_its_metrics(run):
    assert png_size(run / "curves.png") == (1100, 572)  # 10 x 5.2 inches at 110 dpi
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) >= 4
    config = json.loads((run / "config.json").read_text())
    fig = curves_figure(lines, config)
    loss_ax, score_ax = fig.axes
    train_line, val_line, zero_loss, best_loss = loss_ax.lines
    steps = [m["step"] for m in lines]
    assert list(train_line.get_xdata()) == [m["step"] for m in lines if m["train_loss"] is not None]
    assert list(train_line.get_ydata()) == [m["train_loss"] for m in lines if m["train_loss"] is not None]
    assert list(val_line.get_xdata()) == steps and list(val_line.get_ydata()) == [
        m["validation"]["loss"] for m in lines
    ]
    assert val_line.get_label() == f"validation ({config['examples']['validation']} rows)"
    zero = config["zero_shot_validation"]  # the plain model, before training
    assert list(zero_loss.get_ydata()) == [zero["loss"]] * 2 and zero_loss.get_label().startswith("zero-shot, "
                                                                                                  "validation")
    f1, accuracy, best, zero_f1 = score_ax.lines
    assert list(zero_f1.get_ydata()) == [zero["metrics"]["f1"]] * 2
    assert zero_f1.get_label().startswith("macro-F1, zero-shot, validation")
    assert f1.get_label() == "macro-F1, validation (headline)" and list(f1.get_ydata()) == [
        m["validation"]["f1"] for m in lines
    ]
    assert list(accuracy.get_ydata()) == [m["validation"]["accuracy"] for m in lines]
    chosen = [m for m in lines if m["best"]][-1]
    assert list(best.get_xdata()) == [chosen["step"]] and list(best.get_ydata()) == [chosen["validation"]["f1"]]
    assert list(best_loss.get_ydata()) == [chosen["validation"]["loss"]]  # starred on both panels, with its rule
    assert best_loss.get_label().endswith("chosen by the highest validation headline, ties by the lower NLL")
    by_loss = curves_figure(lines, {**config, "select": "loss"})
    assert by_loss.axes[0].lines[-1].get_label().endswith("chosen by the lowest validation NLL")
    assert "cb · capt · seed 0" in fig.texts[0].get_text()
    for variant, title in (({"integration": "projection"}, "cb · capt (projection) · seed 0"),
                           ({"capsule_length": 2}, "cb · capt (2 capsules) · seed 0"),
                           ({"integration": "extraction", "capsule_length": 2}, "capt (extraction, 2 capsules)")):
        assert title in curves_figure(lines, {**config, **variant}).texts[0].get_text()  # an ablation says which
    for ax in fig.axes:  # the legends sit below the panels
        assert ax.get_legend().get_bbox_to_anchor().y1 < ax.get_window_extent().y0 + 1


def test_a_zero_shot_loss_far_above_the_curves_is_named_not_drawn_to_scale():
    """An untrained model that puts its mass off the answers (RTE's zero-shot validation NLL is 24.73 nats on
    SmolLM2-135M, its runs' below 0.8) would flatten the curves: the panel keeps to them and says where it is."""
    lines = [{"step": s, "train_loss": t, "validation": {"headline": 55.0, "accuracy": 55.0, "loss": v}, "best": False}
             for s, t, v in ((125, 1.68, 0.73), (250, 0.74, 0.70), (375, 0.71, 0.66))]
    far = {"zero_shot_validation": {"loss": 24.73, "metrics": {"accuracy": 49.0}}}
    loss_ax = curves_figure(lines, far).axes[0]
    zero_loss = loss_ax.lines[2]
    assert list(zero_loss.get_ydata()) == [24.73] * 2  # the line is there, with its value in the legend
    assert zero_loss.get_label() == "zero-shot, validation (24.73, above the panel)"
    assert loss_ax.get_ylim() == pytest.approx((0, 1.15 * 1.68))
    assert [t.get_text() for t in loss_ax.texts] == ["zero-shot 24.73 \u2191"]
    near = curves_figure(lines, {"zero_shot_validation": {"loss": 0.9, "metrics": {}}}).axes[0]
    assert near.lines[2].get_label() == "zero-shot, validation (0.90)" and not near.texts
    assert near.get_ylim()[1] > 1.68  # drawn to scale with the curves


def test_curves_of_a_damaged_run_are_one_line(tmp_path):
    with pytest.raises(CaptError, match="no metrics.jsonl"):
        run_curves(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(CaptError, match="line 1: not a metrics record"):
        run_curves(tmp_path)
    # scores without a metric beside the headline and the loss: one line, not a bare StopIteration
    line = {"time": 1.0, "step": 1, "validation": {"headline": 50.0, "loss": 1.0}}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(line) + "\n")
    with pytest.raises(CaptError, match="line 1: not a metrics record .validation is .*not the headline, the loss"):
        run_curves(tmp_path)


def test_compare_draws_each_methods_mean_and_std(tmp_path, capsys):
    table = compare([read_results(r) for r in RUNS])
    fig = compare_figure(table)
    (ax,) = fig.axes
    heights = [round(p.get_height(), 6) for p in ax.patches]
    expected = [table["zero_shot"]["cb"]["value"]] + [row["tasks"]["cb"]["mean"] for row in table["rows"]]
    assert heights == [round(v, 6) for v in expected]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["zero-shot"] + [row["label"] for row in table["rows"]]
    spreads = sorted(round(float(seg[1][1] - seg[0][1]) / 2, 6) for c in ax.containers if getattr(c, "has_yerr", False)
                     for seg in c.lines[2][0].get_segments())
    assert spreads == sorted(round(row["tasks"]["cb"]["std"], 6) for row in table["rows"] if row["tasks"]["cb"]["std"])

    assert main(["compare", *map(str, RUNS), "--out", str(tmp_path)]) == 0
    assert "compare.json and compare.png" in capsys.readouterr().out
    assert png_size(tmp_path / "compare.png")[1] == 528  # 4.8 inches at 110 dpi


def test_compare_names_capsule_variants_and_times_them_against_the_default():
    default = read_results(RUNS[0])
    variants = []
    for settings, seconds in (({"integration": "prepend"}, 2.0), ({"blocks": "odd"}, 0.5), ({"blocks": [0, 2]}, 1.0),
                              ({"capsule_length": 2, "blocks": "odd"}, 3.0), ({"capsule_length": 1}, 4.0)):
        r = json.loads(json.dumps(default))
        r["settings"].update(settings)
        for t in r["tasks"].values():
            t["train_seconds"] *= seconds
        variants.append(r)
    # the default CaPT run is the time reference even when a variant comes first
    table = compare([variants[0], variants[1], default, variants[2], variants[3]])
    labels = [row["label"] for row in table["rows"]]
    assert labels == ["CaPT (prepend)", "CaPT (blocks odd)", "CaPT", "CaPT (blocks 0,2)",
                      "CaPT (blocks odd, 2 capsules)"]
    assert [round(row["time_vs_capt"], 6) for row in table["rows"]] == [2.0, 0.5, 1.0, 1.0, 3.0]
    # without the default, the first CaPT run is the reference
    assert [round(row["time_vs_capt"], 6) for row in compare(variants[1:4])["rows"]] == [1.0, 2.0, 6.0]
    # one capsule written out is the default: it is named "CaPT" and is the reference
    assert [row["label"] for row in compare([variants[3], variants[4]])["rows"]] == [
        "CaPT (blocks odd, 2 capsules)", "CaPT"]
    assert [round(row["time_vs_capt"], 6) for row in compare([variants[3], variants[4]])["rows"]] == [0.75, 1.0]


def test_one_seed_has_no_sample_std():
    assert mean_std([40.0]) == (40.0, None) and mean_std([]) == (None, None)
    assert mean_std([1.0, 3.0]) == (2.0, 2 ** 0.5)
    one = read_results(RUNS[0])
    for t in one["tasks"].values():
        t["std"] = None
    table = compare([one])
    assert (
        f"| {one['tasks']['cb']['mean']:.2f} |" in compare_markdown(table)
        and "±" not in compare_markdown(table).split("| CaPT |")[1].splitlines()[0]
    )
    compare_figure(table)  # no error bar to draw


def test_without_matplotlib_the_pictures_are_skipped_in_one_line(run, tmp_path, monkeypatch, capsys, ckpts):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)  # importing matplotlib now fails
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert run_curves(run) is None
    assert main(["compare", *map(str, RUNS), "--out", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert (tmp_path / "compare.md").is_file() and not (tmp_path / "compare.png").exists()
    assert (
        err.strip()
        == "compare.png skipped: matplotlib is not installed, so no PNG picture is drawn "
        "(pip install 'capt[plots]', or make setup)"
    )
    data = write_superglue(tmp_path / "data", {"CB": (20, 6)})
    config = TrainConfig(
        model=str(ckpts["llama"]),
        task="cb",
        out=str(tmp_path / "run"),
        data=str(data),
        epochs=1,
        batch_size=8,
        max_steps=1,
        device="cpu",
    )
    train(config, progress=True)
    assert "curves.png skipped: matplotlib is not installed" in capsys.readouterr().err
    assert not (tmp_path / "run" / "curves.png").exists() and (tmp_path / "run" / "test.json").is_file()
