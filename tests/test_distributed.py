"""Past one process: torchrun data parallel training and evaluation, FSDP, a rank that dies (CPU, gloo).

Two processes on a tiny Llama against one process with the same global batch and seed: the
trained tensors agree within 1e-5 (fp32; measured gap 1.5e-7, the order of the float
additions differs), the validation and test metrics are equal; the 2-rank runs are started by
torchrun itself (`python -m torch.distributed.run --nproc_per_node 2 -m capt train ...`) and by
processes this file spawns. An interrupted 2-rank run resumed by 2 ranks, and by 1, ends like the
1-process run; so does a run whose rank 1 died, after rank 0 stopped with one RankLost line.
FSDP on both families, fp32 and bf16, gives the loss and gradients of the unsharded model.

The batches (36 training examples, batch 5, 2 batches a step) end with a batch of one example:
one rank's part of it is empty, which the step must handle (under FSDP by a pass at weight 0).
"""

import contextlib
import datetime
import json
import multiprocessing
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import write_superglue
from safetensors.torch import load_file

from capt import distributed
from capt.cli.main import main
from capt.errors import CaptError
from capt.evaluate import candidate_scores, encode_examples
from capt.load import load_model
from capt.methods import attach, method_tensors
from capt.tasks import load_task
from capt.tokenizer import load_tokenizer
from capt.trainer import Interrupted, Trainer, TrainConfig, batch_nll, train

ROOT = Path(__file__).resolve().parents[1]
OPTIONS = dict(task="cb", epochs=3, batch_size=5, grad_accum=2, lr=0.05, patience=100, device="cpu")
FLAGS = [
    "--task",
    "cb",
    "--epochs",
    "3",
    "--batch-size",
    "5",
    "--grad-accum",
    "2",
    "--lr",
    "0.05",
    "--patience",
    "100",
    "--device",
    "cpu",
]
EVAL = ["eval", "--task", "cb", "--batch-size", "3", "--device", "cpu", "--json"]  # 4 batches of the 12 test examples
TOLERANCE = 1e-5  # trained tensors, 2 ranks against 1 (fp32)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_superglue(tmp_path_factory.mktemp("data"), {"CB": (40, 12)})


@pytest.fixture(scope="module")
def reference(ckpts, data, tmp_path_factory):
    """The 1-process run every multi-process run must match."""
    run = tmp_path_factory.mktemp("one") / "run"
    train(TrainConfig(model=str(ckpts["llama"]), out=str(run), data=str(data), **OPTIONS), progress=False)
    return run


def run_files(run: Path) -> dict:
    state = torch.load(run / "state.pt", weights_only=True)
    return {
        "tensors": state["tensors"],
        "best": load_file(run / "best" / "capsules.safetensors"),
        "metrics": [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()],
        "test": json.loads((run / "test.json").read_text()),
        "step": state["train"]["step"],
    }


def assert_same_run(run: Path, reference: Path) -> None:
    """Equal up to the order of float additions: tensors within TOLERANCE, the same metrics."""
    a, b = run_files(run), run_files(reference)
    assert a["step"] == b["step"] == 12
    for key in ("tensors", "best"):
        assert a[key].keys() == b[key].keys()
        for k in a[key]:
            torch.testing.assert_close(a[key][k], b[key][k], atol=TOLERANCE, rtol=0)
    assert [m["step"] for m in a["metrics"]] == [m["step"] for m in b["metrics"]] == [4, 8, 12]
    for x, y in zip(a["metrics"], b["metrics"]):
        assert x["best"] == y["best"]
        assert x["validation"]["headline"] == y["validation"]["headline"]
        assert x["validation"]["loss"] == pytest.approx(y["validation"]["loss"], rel=1e-5)
        assert x["train_loss"] == pytest.approx(y["train_loss"], rel=1e-5)
    assert a["test"]["metrics"] == b["test"]["metrics"] and a["test"]["best"]["step"] == b["test"]["best"]["step"]
    assert a["test"]["loss"] == pytest.approx(b["test"]["loss"], rel=1e-5)


# ---------------------------------------------------------------------------------------------
# One process: the helpers alone


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_every_item_of_a_global_batch_goes_to_exactly_one_rank(size):
    for n in range(0, 11):
        items = list(range(100, 100 + n))
        parts = [distributed.shard_of(items, distributed.World(rank, size)) for rank in range(size)]
        assert sorted(sum(parts, [])) == items  # nothing dropped or repeated
        assert all(p == sorted(p) for p in parts)  # each part in the batch's order
        lengths = [len(p) for p in parts]
        assert max(lengths) - min(lengths) <= 1 and lengths == sorted(lengths, reverse=True)


def test_one_process_without_torchrun(monkeypatch):
    for name in distributed.TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    world = distributed.start("cpu")
    assert world == distributed.World(0, 1, None) and world.lead and distributed.current() == world
    assert distributed.rank_device("cuda:1") == "cuda:1"  # no process group: the device as given
    rows = torch.arange(6.0).view(3, 2)
    assert distributed.gather_rows(rows) is rows
    assert distributed.from_lead(lambda x: x + 1, 1) == 2
    with pytest.raises(CaptError, match="boom"):
        distributed.from_lead(lambda: (_ for _ in ()).throw(CaptError("boom")))
    with pytest.raises(CaptError, match="start capt with torchrun"):
        distributed.shard_model(torch.nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match="not lost"), distributed.collective("x"):  # one process: nothing to lose
        raise RuntimeError("not lost")


def lead_fails(rank: int, folder: Path) -> None:
    """from_lead with a decision that fails on rank 0 with a plain Python error."""
    distributed.from_lead(lambda: {}["missing"])


def test_a_plain_error_on_rank_0_stops_every_rank(tmp_path):
    """Rank 0's own error stays as it is (its traceback is the evidence); the other ranks, instead of waiting for
    a broadcast that never comes, stop at once with one line that names it."""
    assert spawn(tmp_path, target="lead_fails", timeout=60) == [1, 1]
    assert (tmp_path / "rank0.error").read_text() == "KeyError: 'missing'"
    assert (tmp_path / "rank1.error").read_text() == "CaptError: rank 0 failed: KeyError: 'missing'"


def test_a_partial_torchrun_environment_is_one_line(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    for name in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(CaptError, match="start capt with torchrun"):
        distributed.start("cpu")


def test_fsdp_without_torchrun_is_one_line(ckpts, data, tmp_path, capsys, monkeypatch):
    for name in distributed.TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    code = main(
        ["train", "--model", str(ckpts["llama"]), "--data", str(data), "--out", str(tmp_path / "run"), *FLAGS, "--fsdp"]
    )
    err = capsys.readouterr().err
    assert code == 1 and err.strip().splitlines() == [
        "capt: error: --fsdp shards the model across the ranks of a process group: start capt with torchrun"]


# ---------------------------------------------------------------------------------------------
# Two processes


def test_torchrun_train_matches_one_process(ckpts, data, reference, tmp_path):
    run = tmp_path / "two"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "capt"]
    done = subprocess.run(
        torchrun + ["train", "--model", str(ckpts["llama"]), "--data", str(data), "--out", str(run), *FLAGS],
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("run directory:") == 1  # rank 0 alone prints
    assert_same_run(run, reference)
    assert {p.name for p in run.iterdir()} - {"curves.png"} == {
        ".lock",
        "best",
        "config.json",
        "metrics.jsonl",
        "state.pt",
        "test.json",
    }
    config = json.loads((run / "config.json").read_text())
    assert (config["world_size"], config["backend"], config["fsdp"]) == (2, "gloo", False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(folder: Path, *args, timeout: float = 150, target: str = "job") -> list[int | None]:
    """Run target(rank, folder, *args) (job by default) in two fresh processes joined by gloo; their exit codes."""
    context = multiprocessing.get_context("spawn")
    port = free_port()
    ranks = [context.Process(target=rank_main, args=(rank, port, folder, args, target)) for rank in range(2)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout)
    for process in ranks:
        if process.is_alive():  # a hang is a failure, not a stuck test run
            process.kill()
            process.join()
    return [process.exitcode for process in ranks]


def rank_main(rank: int, port: int, folder: Path, args: tuple, target: str = "job") -> None:
    """One rank: the process group started here, as a user of the Python API would (capt's commands
    inside leave it as they found it), with a 30 s timeout."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2"
    )
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    try:
        globals()[target](rank, folder, *args)
        torch.distributed.barrier()
    except BaseException as e:
        (folder / f"rank{rank}.error").write_text(f"{type(e).__name__}: {e}")
        # leave without tearing the group down: gloo can abort (SIGABRT) destroying a group whose
        # peer is gone ("connection reset by peer"), which would hide the status this test checks
        os._exit(1)
    torch.distributed.destroy_process_group()


def job(rank: int, folder: Path, paths: dict, data: str) -> None:
    """In turn: an interrupted run (kept, and copied for a 1-process resume) resumed by both ranks;
    an FSDP run; FSDP's loss and gradients; capt eval with FSDP; a run in which rank 1 dies."""
    # noqa: E731
    config = lambda out, **kw: TrainConfig(model=paths["llama"], out=str(folder / out), data=data, **OPTIONS, **kw)
    with pytest.raises(Interrupted):
        train(config("resumed"), progress=False, stop_after=5)  # mid-epoch 2, after the epoch-1 evaluation
    torch.distributed.barrier()
    if rank == 0:
        shutil.copytree(folder / "resumed", folder / "resumed-by-one")
    torch.distributed.barrier()
    train(config("resumed"), resume=True, progress=False)
    train(config("fsdp", fsdp=True), progress=False)
    fsdp_losses(rank, folder, paths, data)
    (folder / f"share{rank}.json").write_text(json.dumps(scored_rows(paths["llama"], data)))
    with open(folder / f"eval{rank}.json", "w") as out, contextlib.redirect_stdout(out):
        assert (
            main(EVAL + ["--model", paths["llama"], "--data", data, "--adapter", str(folder / "resumed"), "--fsdp"])
            == 0
        )
    ranks_disagree(rank, folder, paths["llama"], data)
    predict_on_two_ranks(rank, folder, paths["llama"], data)
    rank_1_dies(rank, folder, paths["llama"], data)


def ranks_disagree(rank: int, folder: Path, model: str, data: str) -> None:
    """Rank 1 given another --lr, other data (one row changed), another --split: every rank stops, saying so."""
    errors = []
    with pytest.raises(CaptError) as e:
        train(TrainConfig(model=model, out=str(folder / "lr"), data=data, **{**OPTIONS, "lr": 0.05 * (1 + rank)}),
              progress=False)
    errors.append(str(e.value))
    other = Path(data)
    if rank == 1:
        other = folder / "other-data"
        shutil.copytree(data, other)
        rows = (other / "CB" / "train.jsonl").read_text().splitlines()
        row = json.loads(rows[0])
        rows[0] = json.dumps({**row, "premise": row["premise"] + " again"})
        (other / "CB" / "train.jsonl").write_text("\n".join(rows) + "\n")
    with pytest.raises(CaptError) as e:
        train(TrainConfig(model=model, out=str(folder / "data"), data=str(other), **OPTIONS), progress=False)
    errors.append(str(e.value))
    with open(folder / f"split{rank}.err", "w") as err, contextlib.redirect_stderr(err):
        code = main(EVAL + ["--model", model, "--data", data, "--split", "validation" if rank else "test"])
    errors.append(f"{code} {(folder / f'split{rank}.err').read_text()}")
    (folder / f"disagree{rank}.json").write_text(json.dumps(errors))


def predict_on_two_ranks(rank: int, folder: Path, model: str, data: str) -> None:
    """capt predict with each rank given its own --out: the ranks share the batches, rank 0 alone writes and prints."""
    out = folder / f"predictions{rank}.jsonl"
    with open(folder / f"predict{rank}.out", "w") as printed, contextlib.redirect_stdout(printed):
        code = main(["predict", "--model", model, "--task", "cb", "--input", str(Path(data) / "CB" / "val.jsonl"),
                     "--out", str(out), "--batch-size", "3", "--device", "cpu"])
    assert code == 0


def scored_rows(path: str, data: str) -> dict:
    """The CB test scores from candidate_scores in batches of 3, and the rows the model read to make them."""
    model, tokenizer = load_model(path), load_tokenizer(path)
    rows = []
    model.register_forward_pre_hook(lambda module, args: rows.append(args[0].shape[0]))
    scores = candidate_scores(model, encode_examples(load_task("cb", data, "test"), tokenizer, False), batch_size=3)
    return {"scores": scores.tolist(), "rows": sum(rows)}


def fsdp_losses(rank: int, folder: Path, paths: dict, data: str) -> None:
    """The loss and trained tensors' gradients of one global batch, with and without FSDP."""
    world = distributed.current()
    found = {}
    for family, method, dtype in [("llama", "capt", "fp32"), ("llama", "prompt", "fp32"), ("llama", "prefix", "bf16"),
                                  ("t5", "capt", "fp32"), ("t5", "capt", "bf16")]:
        tokenizer = load_tokenizer(paths[family])
        results = []
        for fsdp in (False, True):
            model = load_model(paths[family], dtype)
            if fsdp:
                distributed.shard_model(model)
            with distributed.whole(model):  # prompt tuning draws its rows from the (sharded) embedding
                attach(model, method, generator=torch.Generator().manual_seed(0))
            encoded = encode_examples(load_task("cb", data, "train")[:7], tokenizer, model.seq2seq)
            params = list(method_tensors(model).values())
            mine = distributed.shard_of(list(range(7)), world)
            loss = batch_nll(model, encoded, mine).sum() / 7
            loss.backward()
            loss = float(distributed.sum_gradients(params, loss.detach()))
            results.append((loss, [p.grad.clone() for p in params], distributed.is_sharded(model)))
        (plain, plain_grads, a), (sharded, sharded_grads, b) = results
        found[f"{family} {method} {dtype}"] = {
            "loss": (plain, sharded),
            "sharded": (a, b),
            "gap": max((x - y).abs().max().item() for x, y in zip(plain_grads, sharded_grads)),
        }
    if rank == 0:
        (folder / "fsdp.json").write_text(json.dumps(found))


def rank_1_dies(rank: int, folder: Path, model: str, data: str) -> None:
    """Rank 1 ends abruptly before its sixth step (after the epoch-1 state was saved): rank 0 stops with RankLost."""
    if rank == 1:
        step = Trainer._step

        def dying(self, group):
            if self.state["step"] == 5:
                os._exit(3)
            return step(self, group)

        Trainer._step = dying  # in this spawned process only
    train(TrainConfig(model=model, out=str(folder / "died"), data=data, **OPTIONS), progress=False)


@pytest.fixture(scope="module")
def two_ranks(ckpts, data, tmp_path_factory) -> Path:
    """The folder of job(), run once by two spawned ranks for the tests below: rank 0 ends with
    its error (rank 1 died), rank 1 with status 3."""
    folder = tmp_path_factory.mktemp("two")
    codes = spawn(folder, {k: str(v) for k, v in ckpts.items()}, str(data))
    assert codes == [1, 3], {p.name: p.read_text() for p in folder.glob("rank*.error")}  # not the test's timeout
    return folder


def test_two_ranks_resume_and_fsdp_match_one_process(two_ranks, ckpts, data, reference, tmp_path):
    assert_same_run(two_ranks / "resumed", reference)  # interrupted at step 5, resumed by 2 ranks
    assert_same_run(two_ranks / "fsdp", reference)
    assert json.loads((two_ranks / "fsdp" / "config.json").read_text())["fsdp"] is True
    shutil.copytree(two_ranks / "resumed-by-one", tmp_path / "resumed-by-one")  # the resume below writes
    # the same interrupted run resumed by one process: the data order does not depend on the number of ranks
    assert not (tmp_path / "resumed-by-one" / "test.json").exists()
    assert torch.load(tmp_path / "resumed-by-one" / "state.pt", weights_only=True)["train"]["step"] == 5
    config = TrainConfig(model=str(ckpts["llama"]), out=str(tmp_path / "resumed-by-one"), data=str(data), **OPTIONS)
    train(config, resume=True, progress=False)
    assert_same_run(tmp_path / "resumed-by-one", reference)
    # config.json says how each part ran: two ranks to step 5, then one process
    two = json.loads((two_ranks / "resumed" / "config.json").read_text())
    assert (two["world_size"], two["backend"]) == (2, "gloo") and "world_sizes" not in two
    one = json.loads((tmp_path / "resumed-by-one" / "config.json").read_text())
    assert (one["world_size"], one["backend"]) == (1, None)
    assert one["world_sizes"] == [{"from_step": 0, "world_size": 2, "backend": "gloo"},
                                  {"from_step": 5, "world_size": 1, "backend": None}]
    assert {k: v for k, v in one.items() if k not in ("world_size", "backend", "world_sizes")} == \
        {k: v for k, v in two.items() if k not in ("world_size", "backend")}


def test_fsdp_gives_the_loss_and_gradients_of_the_whole_model(two_ranks):
    found = json.loads((two_ranks / "fsdp.json").read_text())
    assert len(found) == 5
    for case, result in found.items():
        plain, sharded = result["loss"]
        assert result["sharded"] == [False, True]
        bf16 = case.endswith("bf16")
        assert sharded == pytest.approx(plain, rel=1e-3 if bf16 else 1e-6), case  # measured: equal on the CPU
        assert result["gap"] <= (1e-3 if bf16 else 1e-6), case


def test_evaluation_is_shared_by_the_ranks_and_gathered(two_ranks, ckpts, data):
    one = scored_rows(str(ckpts["llama"]), str(data))
    shares = [json.loads((two_ranks / f"share{rank}.json").read_text()) for rank in range(2)]
    assert shares[0]["rows"] == shares[1]["rows"] == one["rows"] // 2  # 4 batches of 3: two for each rank
    # every rank holds all the scores, as one process computes them
    assert shares[0]["scores"] == shares[1]["scores"] == one["scores"]


def test_capt_eval_on_two_ranks_with_fsdp_gives_the_one_process_scores(two_ranks, ckpts, data, capsys):
    assert (two_ranks / "eval1.json").read_text() == ""  # rank 0 alone prints
    two = json.loads((two_ranks / "eval0.json").read_text())
    assert (
        main(EVAL + ["--model", str(ckpts["llama"]), "--data", str(data), "--adapter", str(two_ranks / "resumed")]) == 0
    )
    one = json.loads(capsys.readouterr().out)
    assert two["n"] == one["n"] == 12 and two["metrics"] == one["metrics"]
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-6)


def test_ranks_given_different_settings_or_files_all_stop_and_name_them(two_ranks):
    said = [json.loads((two_ranks / f"disagree{rank}.json").read_text()) for rank in range(2)]
    assert said[0] == said[1]  # both ranks stop, with the same words
    lr, data, split = said[0]
    head = "the ranks were started with other settings or files than rank 0 (rank 1: "
    tail = "): every rank must be given the same command and the same files"
    assert lr == head + "lr" + tail
    assert data == head + "data_files" + tail
    assert split == "1 capt: error: " + head + "rows, split" + tail + "\n"  # other rows: the other split's
    assert not (two_ranks / "lr" / "state.pt").exists() and not (two_ranks / "data" / "state.pt").exists()


def test_predict_on_two_ranks_writes_once_what_one_process_writes(two_ranks, data, ckpts, tmp_path, capsys):
    assert not (two_ranks / "predictions1.jsonl").exists() and (two_ranks / "predict1.out").read_text() == ""
    one = tmp_path / "one.jsonl"
    assert main(["predict", "--model", str(ckpts["llama"]), "--task", "cb", "--input", str(data / "CB" / "val.jsonl"),
                 "--out", str(one), "--batch-size", "3", "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    two = [json.loads(line) for line in (two_ranks / "predictions0.jsonl").read_text().splitlines()]
    assert len(two) == 12
    for a, b in zip(two, (json.loads(line) for line in one.read_text().splitlines())):
        assert (a["row"], a["word"]) == (b["row"], b["word"])
        assert a["scores"] == pytest.approx(b["scores"], abs=1e-5)
    assert (two_ranks / "predict0.out").read_text() == printed.replace(str(one), str(two_ranks / "predictions0.jsonl"))


def test_commands_that_do_not_share_their_work_refuse_several_ranks(ckpts, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    for argv, what in [
        (["eval", "--model", str(ckpts["llama"]), "--task", "cb,rte"], "capt eval of several tasks"),
        (["predict", "--model", str(ckpts["llama"]), "--capsules", "cb=a,rte=b", "--input", "x"],
         "capt predict with several capsule sets"),
        (["compare", str(tmp_path)], "capt compare"),
        (["attention", "--curves", str(tmp_path), "--out", str(tmp_path / "o")], "capt attention"),
    ]:
        code = main(argv)
        assert code == 1 and capsys.readouterr().err == (
            f"capt: error: {what} runs in one process; start it without torchrun (train, run, and eval or predict of "
            "one task share their work among the ranks)\n"
        )


def test_a_rank_that_reaches_a_port_another_program_holds_stops_in_one_line(tmp_path):
    """The port answers but is no rendezvous: torch waits in its handshake with no timeout of its own."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(8)  # connections are taken and never answered
        env = dict(os.environ, RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(holder.getsockname()[1]))
        done = subprocess.run([sys.executable, "-m", "capt", "eval", "--model", str(tmp_path), "--task", "cb",
                               "--dist-timeout", "2"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stderr == (
        f"capt: error: rank 1 could not join the other ranks at 127.0.0.1:{env['MASTER_PORT']} within 2 s "
        "(--dist-timeout): another program may hold the port (choose a free MASTER_PORT), or rank 0 did not start\n"
    )


def test_a_rank_that_dies_stops_the_other_in_one_line_and_the_run_resumes(two_ranks, ckpts, data, reference, tmp_path):
    shutil.copytree(two_ranks / "died", tmp_path / "died")
    error = (two_ranks / "rank0.error").read_text()
    assert len(error.splitlines()) == 1
    assert error.startswith("RankLost: rank 0 of 2 lost the other ranks during the gradient all-reduce")
    run = tmp_path / "died"
    assert torch.load(run / "state.pt", weights_only=True)["train"]["step"] == 4  # the epoch-1 state
    train(TrainConfig(model=str(ckpts["llama"]), out=str(run), data=str(data), **OPTIONS), resume=True, progress=False)
    assert_same_run(run, reference)


def test_a_lost_rank_exits_1_without_tearing_down_the_group(monkeypatch, capsys):
    """After RankLost under torchrun, `capt` prints its line and ends with status 1 at once: tearing
    down a gloo group whose peer is gone can abort the process (SIGABRT), turning 1 into -6."""
    class Exited(BaseException):
        pass

    def exit_now(status):
        raise Exited(status)

    destroyed = []
    monkeypatch.setattr(distributed, "_joined", True)  # as if start() had joined torchrun's group
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(distributed.dist, "destroy_process_group", lambda *a, **k: destroyed.append(True))
    monkeypatch.setattr(os, "_exit", exit_now)

    def lost(args):
        raise distributed.RankLost("rank 0 of 2 lost the other ranks during the gradient all-reduce")

    import capt.cli.main
    monkeypatch.setattr(capt.cli.main, "cmd_eval", lost)
    with pytest.raises(Exited) as exited:
        main(EVAL + ["--model", "unused"])
    assert exited.value.args == (1,) and not destroyed
    assert capsys.readouterr().err == "capt: error: rank 0 of 2 lost the other ranks during the gradient all-reduce\n"
    for raised, status in ((CaptError("a bad row"), 1), (KeyboardInterrupt(), 130), (ZeroDivisionError("x"), 1)):
        def failing(args, raised=raised):  # any other error, peers alive or not: the same exit, no teardown
            raise raised
        monkeypatch.setattr(capt.cli.main, "cmd_eval", failing)
        with pytest.raises(Exited) as exited:
            main(EVAL + ["--model", "unused"])
        assert exited.value.args == (status,) and not destroyed
    monkeypatch.setattr(capt.cli.main, "cmd_eval", lost)
    monkeypatch.setattr(distributed, "_joined", False)  # a group capt did not join is the caller's: a plain return
    assert main(EVAL + ["--model", "unused"]) == 1
