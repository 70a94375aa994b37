"""Several capsule sets on one frozen model, each row of a batch served by its own set.

The yardstick everywhere: a row of a mixed batch gives what its own single-set model gives for
that row alone (fp32, 1e-5), in the forward, in rank classification and in cached generation,
for add and prepend, T5 and Llama, with padding. The three sets differ in depth: "cb" holds every
block, "copa" only block 0 (so block 1 must pass its slot through), "rte" only block 1 (no p_0).
"""

import json

import pytest
import torch
from helpers import write_superglue

from capt import CaptError, CapsuleConfig, load_model, load_tokenizer, save_capsules
from capt.cli.main import main
from capt.evaluate import evaluate, evaluate_tasks
from capt.methods import MethodConfig, capsule_vectors
from capt.tasks import load_task

DEPTHS = {"cb": "all", "copa": [0], "rte": [1]}  # the tiny checkpoints have 2 blocks


@pytest.fixture(scope="module")
def capsule_dirs(ckpts, tmp_path_factory):
    """{(family, integration): {task: directory}}: random non-zero capsules saved by save_capsules."""
    root = tmp_path_factory.mktemp("sets")
    dirs = {}
    for family in ("llama", "t5"):
        for integration in ("add", "prepend"):
            for k, (task, blocks) in enumerate(DEPTHS.items()):
                model = load_model(
                    ckpts[family], dtype="fp32", capsules=CapsuleConfig(integration=integration, blocks=blocks)
                )
                g = torch.Generator().manual_seed(10 * k + len(integration))
                with torch.no_grad():
                    for p in capsule_vectors(model).values():
                        p.copy_(torch.randn(p.shape, generator=g) * 0.8)
                dirs.setdefault((family, integration), {})[task] = save_capsules(
                    model, root / f"{family}-{integration}-{task}"
                )
    return dirs


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_superglue(tmp_path_factory.mktemp("data"), {"CB": (0, 9), "COPA": (0, 7), "RTE": (0, 8)}, seed=3)


def models(ckpts, capsule_dirs, family, integration):
    """The mixed model and each set's own single-set model."""
    dirs = capsule_dirs[(family, integration)]
    mixed = load_model(ckpts[family], dtype="fp32", capsules=dirs)
    return mixed, {task: load_model(ckpts[family], dtype="fp32", capsules=d) for task, d in dirs.items()}


def padded_batch(rows: list[list[int]], left: bool):
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        span = slice(width - len(r), width) if left else slice(0, len(r))
        ids[i, span], mask[i, span] = torch.tensor(r), 1
    return ids, mask


ROWS = [[5, 9, 14, 3, 22, 8, 40], [7, 7, 31], [12, 50, 6, 19, 4], [44, 2, 9, 9, 13, 21, 6, 17, 30], [3, 8]]
ROW_TASKS = ["cb", "copa", "rte", "copa", "cb"]


@pytest.mark.parametrize("integration", ["add", "prepend"])
def test_llama_mixed_batch_equals_each_row_alone(ckpts, capsule_dirs, integration):
    mixed, single = models(ckpts, capsule_dirs, "llama", integration)
    index = torch.tensor([mixed.tasks.index(t) for t in ROW_TASKS])
    for left in (True, False):
        ids, mask = padded_batch(ROWS, left)
        prompt = mask.clone()
        prompt[0, -2:] = 0 if left else prompt[0, -2:]  # row 0 (left-padded): its last two tokens are answer tokens
        with torch.no_grad():
            got = mixed(ids, attention_mask=mask, prompt_mask=prompt, tasks=ROW_TASKS)  # (B, T, V)
            by_index = mixed(ids, attention_mask=mask, prompt_mask=prompt, tasks=index)
            assert torch.equal(got, by_index)
            for r, task in enumerate(ROW_TASKS):
                real = mask[r].bool()
                alone = single[task](ids[r, real][None], prompt_mask=prompt[r, real][None])[0]
                torch.testing.assert_close(got[r, real], alone, atol=1e-5, rtol=0)
        # the sets really differ: serving every row with one set changes the outputs
        with torch.no_grad():
            assert (mixed(ids, attention_mask=mask, tasks="cb") - got).abs().max() > 1e-2


@pytest.mark.parametrize("integration", ["add", "prepend"])
def test_t5_mixed_batch_equals_each_row_alone(ckpts, capsule_dirs, integration):
    mixed, single = models(ckpts, capsule_dirs, "t5", integration)
    ids, mask = padded_batch(ROWS, left=False)
    dec = torch.tensor([[0, 5, 9, 3]] * len(ROWS))
    with torch.no_grad():
        got = mixed(ids, mask, decoder_input_ids=dec, tasks=ROW_TASKS)  # (B, 4, V)
        states, enc_mask = mixed.encode(ids, mask, tasks=ROW_TASKS)
        for r, task in enumerate(ROW_TASKS):
            real = mask[r].bool()
            alone = single[task](ids[r, real][None], decoder_input_ids=dec[r:r + 1])[0]
            torch.testing.assert_close(got[r], alone, atol=1e-5, rtol=0)
            alone_states, _ = single[task].encode(ids[r, real][None])
            n = alone_states.shape[1]  # slot(s) + real tokens, right-padded: the same columns lead
            torch.testing.assert_close(states[r, :n], alone_states[0], atol=1e-5, rtol=0)
        assert (mixed(ids, mask, decoder_input_ids=dec, tasks="rte") - got).abs().max() > 1e-2


@pytest.mark.parametrize("family", ["llama", "t5"])
@pytest.mark.parametrize("integration", ["add", "prepend"])
def test_rank_classification_across_tasks_equals_separate_runs(ckpts, capsule_dirs, data, family, integration):
    mixed, single = models(ckpts, capsule_dirs, family, integration)
    tok = load_tokenizer(ckpts[family])
    examples = {task: load_task(task, data, "test") for task in DEPTHS}
    # 24 examples: batches mix the tasks and candidate counts
    together = evaluate_tasks(mixed, tok, examples, batch_size=4)
    for task, exs in examples.items():
        alone = evaluate(single[task], tok, exs, batch_size=3)
        torch.testing.assert_close(together[task]["scores"], alone["scores"], atol=1e-5, rtol=0)
        assert together[task]["scores"].shape == (len(exs), 3 if task == "cb" else 2)
        assert together[task]["predictions"] == alone["predictions"]
        assert together[task]["metrics"] == alone["metrics"] and together[task]["n"] == alone["n"]
        assert abs(together[task]["loss"] - alone["loss"]) < 1e-5


@pytest.mark.parametrize("family", ["llama", "t5"])
def test_cached_generation_keeps_each_rows_slot(ckpts, capsule_dirs, family):
    mixed, single = models(ckpts, capsule_dirs, family, "prepend" if family == "llama" else "add")
    ids, mask = padded_batch(ROWS, left=family == "llama")  # generate wants left-padded prompts (decoder-only)
    out = mixed.generate(ids, attention_mask=mask, max_new_tokens=6, eos_token_id=[], tasks=ROW_TASKS)
    for r, task in enumerate(ROW_TASKS):
        real = mask[r].bool()
        alone = single[task].generate(ids[r, real][None], max_new_tokens=6, eos_token_id=[])
        new = out[r, ids.shape[1]:] if family == "llama" else out[r]
        assert torch.equal(new, alone[0, real.sum():] if family == "llama" else alone[0]), (r, task)


def test_gradients_reach_each_rows_own_set(ckpts, capsule_dirs):
    """Training through a mixed batch: table row k gets what set k's own model gets from its rows."""
    mixed, single = models(ckpts, capsule_dirs, "llama", "add")
    ids, mask = padded_batch(ROWS, left=False)
    mixed(ids, attention_mask=mask, tasks=ROW_TASKS).float().logsumexp(-1)[mask.bool()].sum().backward()
    for k, task in enumerate(mixed.tasks):
        rows = [r for r, t in enumerate(ROW_TASKS) if t == task]
        single[task](ids[rows], attention_mask=mask[rows]).float().logsumexp(-1)[mask[rows].bool()].sum().backward()
        for layer, p in capsule_vectors(single[task]).items():
            torch.testing.assert_close(
                mixed.model.layers[layer].capsule.grad[k],
                single[task].model.layers[layer].capsule.grad[0],
                atol=1e-4,
                rtol=1e-4,
            )
        for layer in set(range(2)) - set(capsule_vectors(single[task])):  # a block outside the set: no gradient
            assert mixed.model.layers[layer].capsule.grad[k].abs().max() == 0


def test_bad_sets_and_task_names_fail_with_one_line(ckpts, capsule_dirs):
    dirs = capsule_dirs[("llama", "add")]
    with pytest.raises(
        CaptError, match=r"^capsules 'cb' in .* were made for a different base model \(model_type 'llama' vs 't5'"
    ):
        load_model(ckpts["t5"], capsules={"cb": dirs["cb"]})
    with pytest.raises(
        CaptError, match=r"capsule sets served together must share one integration .*cb add, rte prepend"
    ):
        load_model(ckpts["llama"], capsules={"cb": dirs["cb"], "rte": capsule_dirs[("llama", "prepend")]["rte"]})
    with pytest.raises(
        CaptError, match=r"^capsule set 'cb': give a directory written by save_capsules or a CapsuleConfig, not int$"
    ):
        load_model(ckpts["llama"], capsules={"cb": 5})
    with pytest.raises(CaptError, match=r"^capsules=\{\}: name at least one capsule set"):
        load_model(ckpts["llama"], capsules={})
    mixed = load_model(ckpts["llama"], capsules=dirs)
    assert mixed.tasks == ["cb", "copa", "rte"] and mixed.method.tasks == mixed.tasks
    ids = torch.tensor([[5, 9, 14], [7, 7, 31]])
    cases = [
        (["cb", "wic"], r"^capsule set 'wic' is not loaded: this model holds cb, copa, rte$"),
        (None, r"^this model holds the capsule sets cb, copa, rte: pass tasks="),
        (["cb"], r"^tasks has 1 entries for a batch of 2 rows"),
        (torch.tensor([0, 3]), r"^tasks holds indices outside 0\.\.2"),
        (torch.tensor([0.0, 1.0]), r"^tasks as a tensor holds integer indices"),
    ]
    for tasks, message in cases:
        with pytest.raises(CaptError, match=message):
            mixed(ids, tasks=tasks)
    with pytest.raises(CaptError, match=r"^capsule set 'wic' is not loaded"):
        evaluate_tasks(mixed, None, {"wic": []})
    with pytest.raises(
        CaptError, match=r"^tasks= picks each row's capsule set, but this model holds a single set or none"
    ):
        load_model(ckpts["llama"], capsules=dirs["cb"])(ids, tasks=["cb", "cb"])
    with pytest.raises(
        CaptError,
        match=r"^this model holds 3 capsule sets \(cb, copa, rte\); save_capsules writes a model with one set",
    ):
        save_capsules(mixed, ckpts["llama"].parent / "never")
    assert not (ckpts["llama"].parent / "never").exists()


def test_cli_evaluates_tasks_in_one_pass_as_separate_runs_print_them(ckpts, capsule_dirs, data, capsys):
    dirs = capsule_dirs[("t5", "add")]
    common = ["--model", ckpts["t5"], "--data", data, "--device", "cpu", "--batch-size", "4"]
    separate = []
    for task in ("cb", "copa", "rte"):
        assert main([str(a) for a in ["eval", "--task", task, "--capsules", dirs[task], *common]]) == 0
        separate.append(capsys.readouterr().out.strip())
    sets = ",".join(f"{task}={dirs[task]}" for task in ("cb", "copa", "rte"))
    assert main([str(a) for a in ["eval", "--task", "cb,copa,rte", "--capsules", sets, *common]]) == 0
    assert capsys.readouterr().out.strip().splitlines() == separate
    assert main([str(a) for a in ["eval", "--task", "rte,cb", "--capsules", sets.replace("copa=", "x="), *common]]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["capt: error: --capsules names cb, x, rte but --task names rte, cb: give one capsule set per task"]
    assert (
        main(
            [
                str(a)
                for a in [
                    "eval",
                    "--task",
                    "cb,rte",
                    "--capsules",
                    f"cb={dirs['cb']},rte={capsule_dirs[('llama', 'add')]['rte']}",
                    *common,
                ]
            ]
        )
        == 1
    )
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("capt: error: capsules 'rte' in ") and "made for a different base model" in line
    assert main([str(a) for a in ["eval", "--task", "cb,rte", "--capsules", dirs["cb"], *common]]) == 1
    assert (
        capsys.readouterr().err.strip()
        == "capt: error: several tasks take one capsule set each: --capsules cb=DIR,rte=DIR"
    )
    # zero-shot, several tasks: one JSON object per task, as --json prints one run
    assert main([str(a) for a in ["eval", "--task", "copa,cb", "--json", *common]]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["task"] for r in lines] == ["copa", "cb"] and all(r["method"] is None for r in lines)


def test_the_record_lists_the_sets_in_order(ckpts, capsule_dirs):
    """One record on the model: the names in table order with their CapsuleConfigs; it round-trips
    through a dict; a CapsuleConfig among the sets gives a fresh zero row."""
    dirs = capsule_dirs[("llama", "prepend")]
    model = load_model(
        ckpts["llama"],
        capsules={"rte": dirs["rte"], "fresh": CapsuleConfig(integration="prepend", blocks=[0]), "cb": dirs["cb"]},
    )
    record = model.method
    assert model.tasks == ["rte", "fresh", "cb"] and record.integration == "prepend"
    assert record.task_capsules["rte"].blocks == [1] and record.task_capsules["fresh"].blocks == [0]
    assert MethodConfig.from_dict(json.loads(json.dumps(record.to_dict()))) == record
    first, second = (block.capsule for block in model.capsule_blocks())
    assert first.shape == second.shape == (3, model.capsule_width)
    assert first[0].abs().max() == 0 and first[1].abs().max() == 0 and first[2].abs().max() > 0  # rte lacks block 0
    assert second[1].abs().max() == 0 and second[0].abs().max() > 0  # fresh: zeros; rte: its saved block 1
    assert model.capsule_blocks()[0].capsule_active.tolist() == [False, True, True]
    assert model.capsule_blocks()[1].capsule_active.tolist() == [True, False, True]


def test_predict_serves_each_row_with_the_capsules_its_task_field_names(ckpts, capsule_dirs, data, tmp_path, capsys):
    """capt predict --capsules cb=DIR,copa=DIR,rte=DIR over one file whose rows carry a "task" field:
    each row's record equals the one a separate single-task predict gives it, in the input's order."""
    dirs = capsule_dirs[("llama", "add")]
    common = ["--model", ckpts["llama"], "--device", "cpu", "--batch-size", "4"]
    rows, separate = [], {}
    for task, folder in (("rte", "RTE"), ("cb", "CB"), ("copa", "COPA")):
        lines = (data / folder / "val.jsonl").read_text().splitlines()[:3]
        single = tmp_path / f"{task}.jsonl"
        single.write_text("\n".join(lines) + "\n")
        out = tmp_path / f"{task}-out.jsonl"
        assert (
            main(
                [
                    str(a)
                    for a in [
                        "predict",
                        "--task",
                        task,
                        "--capsules",
                        dirs[task],
                        "--input",
                        single,
                        "--out",
                        out,
                        *common,
                    ]
                ]
            )
            == 0
        )
        separate[task] = [json.loads(line) for line in out.read_text().splitlines()]
        rows += [dict(json.loads(line), task=task) for line in lines]
    mixed_in = tmp_path / "mixed.jsonl"
    order = [1, 4, 7, 0, 3, 6, 2, 5, 8]  # the tasks interleaved
    mixed_in.write_text("".join(json.dumps(rows[i]) + "\n" for i in order))
    out = tmp_path / "mixed-out.jsonl"
    sets = ",".join(f"{task}={dirs[task]}" for task in ("cb", "copa", "rte"))
    capsys.readouterr()
    assert main([str(a) for a in ["predict", "--capsules", sets, "--input", mixed_in, "--out", out, *common]]) == 0
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["row"] for r in got] == list(range(9))
    for record, i in zip(got, order):
        task, k = rows[i]["task"], i % 3
        want = separate[task][k]
        assert record["task"] == task and record["word"] == want["word"] and record["gold"] == want["gold"]
        for word, value in want["scores"].items():
            assert abs(record["scores"][word] - value) < 1e-5
    capsys.readouterr()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(dict(rows[0], task="boolq")) + "\n")
    assert main([str(a) for a in ["predict", "--capsules", sets, "--input", bad, "--out", out, *common]]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert (
        line.startswith("capt: error: ")
        and "bad.jsonl line 1: its \"task\" field is 'boolq'; each row must name one of" in line
    )
