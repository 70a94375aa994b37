"""The run directory: what a training run writes, and reading it back to resume.

    config.json     the resolved settings: model path, the sha256 of its config.json and weights, task, the sha256 of
                    its data files, method, every hyperparameter, seed, capt version (resume checks them)
    metrics.jsonl   one line per validation evaluation: epoch, step, train loss, validation metrics, time
    best/           the method's tensors at the best validation evaluation (capt: capsules.safetensors +
                    capsules.json; the others: adapter.safetensors + adapter.json, see capt.load.save_method)
    state.pt        everything needed to continue: the method's tensors, optimizer, scheduler, RNG states,
                    position, early-stopping state
    test.json       the best tensors' test metrics and the run's training wall time (train_seconds), written at the end
    curves.png      the training and validation losses and the validation scores against steps (capt/plots.py),
                    at the end

Every file is written to a temporary name and renamed (load.atomic_write), so a crash never
leaves half a file. A run exists once its first state.pt is written (config.json comes just
before it: a directory with config.json and no state.pt is started afresh).
"""

from __future__ import annotations

import fcntl
import hashlib
import math
import json
import os
import pickle
import random
import shutil
import warnings
from pathlib import Path

import torch

from .checks import check_values, is_finite, is_whole, parse_json, read_json, shown
from .errors import CaptError, CaptWarning
from .hub import resolve_model
from .load import atomic_write, config_hash, remove_stale_tmp, save_method, weights_fingerprint
from .methods import method_tensors
from .stepscale import fits
from .tasks import resolve_data_dir, task_dir, task_files

STATE_VERSION = 2  # 1: capsules only, as {block index: vector}
STATE_KEYS = ("version", "task", "tensors", "optimizer", "scheduler", "rng", "train")  # what a state.pt holds
# Settings a resumed run may change: where things are and how fast, not what is computed.
RESUMABLE_CHANGES = ("model", "data", "out", "device", "eval_batch_size", "fsdp", "any_base", "deterministic")


def make_directory(path) -> None:
    """Create the output directory `path` (and its parents), or say in one line why it cannot be."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise CaptError(f"--out {path} is a file, not a directory; choose another --out")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CaptError(f"cannot create the output directory {path}: {e.strerror or e}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise CaptError(f"cannot write in the output directory {path}: permission denied")


def _real(path) -> Path:
    return Path(os.path.realpath(path))  # symlinks followed: a link to the checkpoint is the checkpoint


def check_out(out, inputs: list[tuple[str, object]], option: str = "--out") -> None:
    """Refuse an output that could write over an input, before anything is written: `out` may not be
    an input file, nor be or lie inside an input directory, nor (as a directory) hold an input.
    inputs: (what the input is, in words; its path or None when absent)."""
    mine = _real(out)
    for what, path in inputs:
        if path is None:
            continue
        theirs = _real(path)
        # a hard link too
        if mine == theirs or (mine.is_file() and theirs.is_file() and os.path.samefile(mine, theirs)):
            problem = f"is {what} {path}"
        elif theirs.is_dir() and theirs in mine.parents:
            problem = f"lies inside {what} {path}"
        elif mine in theirs.parents:
            problem = f"holds {what} {path}"
        else:
            continue
        raise CaptError(f"{option} {out} {problem}: writing there could replace what it reads; choose an {option} of "
                        "its own")


def task_inputs(task, data=None) -> list[tuple[str, Path]]:
    """The files a task reads, for check_out: a task file and its data files; a SuperGLUE task's
    directory (data: the SuperGLUE directory as given, None: CAPT_DATA, then data/superglue)."""
    if task.file is None:
        return [("the task's data directory", task_dir(task, resolve_data_dir(data)))]
    return [
        (f"the task's {label}" if label == "task file" else f"the task's {label} file", file)
        for label, file in task_files(task).items()
    ]


def run_inputs(model, task, data=None) -> list[tuple[str, Path]]:
    """What a training run reads, for check_out: the model directory and the task's data (task_inputs)."""
    return [("the model directory", resolve_model(model))] + task_inputs(task, data)


def lock_run(run: Path):
    """An exclusive lock on the directory `run` for as long as the returned file stays open: one
    writer at a time (fcntl.flock on RUN/.lock, which holds the holder's pid). A second writer is
    refused in one line. Stale temporary files of an interrupted write are removed once it is held."""
    file = open(Path(run) / ".lock", "a+")
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        file.seek(0)
        holder = file.read().strip() or "unknown"
        file.close()
        raise CaptError(f"{run} is in use by another capt process (pid {holder}); wait for it to end or choose another "
                        "--out") from None
    file.seek(0)
    file.truncate()
    file.write(f"{os.getpid()}\n")
    file.flush()
    for directory in (Path(run), Path(run) / "best"):
        remove_stale_tmp(directory)
    return file


LOST_CONFIG = ("{run} holds a run's state.pt but no config.json (deleted or lost), so it can neither be resumed nor "
               "started afresh there; move {run} away or choose another --out")


def read_run_config(run) -> dict:
    """RUN/config.json of an existing run, with a clear error when there is none."""
    file = Path(run) / "config.json"
    if not file.is_file():
        if (Path(run) / "state.pt").exists():
            raise CaptError(LOST_CONFIG.format(run=run))
        raise CaptError(f"nothing to resume in {run}: it has no config.json (start a run there without --resume)")
    return read_json(file, "a run's settings")


def metrics_lines(file: Path) -> list[bytes]:
    """The lines of a metrics.jsonl as bytes (each decoded by metrics_line), [] when there is none."""
    try:
        return file.read_bytes().splitlines() if file.is_file() else []
    except OSError as e:
        raise CaptError(f"cannot read {file}: {e.strerror or e}") from None


def metrics_flaw(line) -> str | None:
    """What keeps a decoded metrics.jsonl line from being a metrics record, None when nothing does."""
    if not isinstance(line, dict):
        return f"it is {shown(line)}"
    scores = line.get("validation")
    if not is_finite(line.get("time")):
        return f"time is {shown(line.get('time'))}"
    if not is_whole(line.get("step")):
        return f"step is {shown(line.get('step'))}"
    if not isinstance(scores, dict) or not {"headline", "loss"} < set(scores):
        return f"validation is {shown(scores)}, not the headline, the loss and the metrics"
    bad = next((k for k, v in scores.items() if not is_finite(v)), None)
    if bad is not None:
        return f"validation.{bad} is {shown(scores[bad])}"
    if line.get("train_loss") is not None and not is_finite(line["train_loss"]):
        return f"train_loss is {shown(line['train_loss'])}"
    return None


def metrics_line(file: Path, number: int, text: bytes | str) -> dict:
    """Line `number` (from 1) of a metrics.jsonl, refused in one line when it is not a metrics record."""
    line = parse_json(text, file, number)
    why = metrics_flaw(line)
    if why:
        raise CaptError(f"{file} line {number}: not a metrics record ({why}; a JSON object with the step, the time and "
                        "the finite validation scores of an evaluation)")
    return line


def check_resume(saved: dict, config, run: Path) -> None:
    """Refuse to resume a run from another model or task, or with other result-changing settings."""
    sha = config_hash(config.model)
    if saved.get("model_config_sha256") != sha:
        raise CaptError(
            f"{run} was trained on a different model ({saved.get('model')}, config sha256 "
            f"{str(saved.get('model_config_sha256'))[:12]}), not {config.model} ({sha[:12]}); use a new --out"
        )
    weights, before = weights_fingerprint(config.model), saved.get("model_weights_sha256")
    # a run started before the weights' hash was recorded is bound by its config's
    if before is not None and before != weights:
        what = (f"{run} was trained on weights with sha256 {str(before)[:12]}, but those of {config.model} have "
                f"{weights[:12]} "
                "(the same config.json)")
        if not config.any_base:
            raise CaptError(f"{what}; pass --any-base to continue it on these weights on purpose, or use a new --out")
        warnings.warn(CaptWarning(f"{what}; continued on them anyway, as asked"))
    if saved.get("task") != config.task:
        raise CaptError(f"{run} is a {saved.get('task')} run, not {config.task}; use a new --out")
    mine = config.to_dict()
    differ = [k for k in mine if k not in RESUMABLE_CHANGES and k in saved and saved[k] != mine[k]]
    if differ:
        detail = ", ".join(f"{k} {shown(saved[k])} (given {shown(mine[k])})" for k in differ)
        why = " (max_steps is the length of the learning-rate schedule)" if "max_steps" in differ else ""
        raise CaptError(f"{run} was trained with other settings: {detail}{why}; resume with the run's settings or use "
                        "a new --out")


def check_task_file(saved: dict, record: dict | None, run: Path) -> None:
    """Refuse to resume a run on a task file that changed since it started (template, labels or file names).

    record: tasks.task_file_record of the task now; saved: the run's config.json."""
    before = saved.get("task_file")
    if before is not None and not isinstance(before, dict):
        raise CaptError(f"{run / 'config.json'}: task_file is {shown(before)}, not the record of a task file; use a "
                        "new --out")
    if before and record and before.get("sha256") != record["sha256"]:
        raise CaptError(f"{run} was trained on the task file {before.get('path')} with sha256 "
                        f"{str(before.get('sha256'))[:12]}, "
                        f"but it now has {record['sha256'][:12]}; restore the file or use a new --out")


def data_hashes(task, data_dir=None) -> dict[str, str]:
    """sha256 of each file the task reads, by its label in tasks.task_files (SuperGLUE's train.jsonl and
    val.jsonl; a task file and its train, validation and test files): what a run records to be resumed."""
    hashes = {}
    for label, file in task_files(task, data_dir).items():
        try:
            hashes[label] = hashlib.sha256(Path(file).read_bytes()).hexdigest()
        except OSError as e:
            raise CaptError(f"cannot read {file}: {e.strerror or e}") from None
    return hashes


def check_data(saved: dict, hashes: dict[str, str], task, data_dir, run: Path) -> None:
    """Refuse to resume a run whose data files changed since it started (its config.json's data_files;
    a run started before they were recorded has none): it would go on with other rows as one run."""
    before = saved.get("data_files")
    if not isinstance(before, dict):
        return
    files = task_files(task, data_dir)
    for label, digest in before.items():
        if hashes.get(label) != digest:
            raise CaptError(f"{run} was trained on {files.get(label, label)} ({label}) with sha256 {str(digest)[:12]}, "
                            "but it now has "
                            f"{str(hashes.get(label))[:12]}; the run would go on with other rows: restore the file or "
                            "use a new --out")


def write_json(path: Path, obj) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(obj, indent=2) + "\n"))


def method_values(model) -> dict[str, torch.Tensor]:
    """A copy of the attached method's tensors on the CPU, by their file names (methods.method_tensors)."""
    return {k: p.detach().cpu().clone() for k, p in method_tensors(model).items()}


def rng_states() -> dict:
    """The generators' states; CUDA's only once CUDA is in use (asking would start it on a CPU run)."""
    return {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [],
    }


def restore_cuda_rng(states: list) -> None:
    """Restore saved CUDA generator states on the GPUs this machine has (it may have fewer than the saver).

    Training draws nothing from them (dropout is absent, random initial values come from a CPU
    generator), so a state left out changes no result."""
    if not states or not torch.cuda.is_available():
        return
    for index in range(min(len(states), torch.cuda.device_count())):
        torch.cuda.set_rng_state(states[index], index)


def set_method(model, values: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for k, p in method_tensors(model).items():
            p.copy_(values[k])


def upgrade_state(state: dict) -> dict:
    """A version-1 state.pt (capsules as {block index: vector}) in the version-2 form (tensors by file name)."""
    if state.get("version") == 1 and "capsules" in state:
        state["tensors"] = {f"layers.{i}": v for i, v in state.pop("capsules").items()}
        best = state["train"].get("best")
        if best is not None:
            best["tensors"] = {f"layers.{i}": v for i, v in best.pop("capsules").items()}
        state["version"] = STATE_VERSION
    return state


def write_state(run: Path, state: dict) -> None:
    atomic_write(run / "state.pt", lambda tmp: torch.save(state, tmp))


def tensor_flaw(saved, tensors: dict) -> str | None:
    """What keeps `saved` from holding a finite float tensor of each name and shape of `tensors` (the method's)
    and nothing else; None when nothing does."""
    if not isinstance(saved, dict):
        return f"the tensors are {shown(saved)}, not a dict"
    for k in sorted(set(tensors) - set(saved)):
        return f"tensor {k} is missing"
    for k in sorted(set(saved) - set(tensors)):
        return f"tensor {shown(k)} is not one of this run's method"
    for k, t in saved.items():
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            return f"tensor {k} is {shown(getattr(t, 'dtype', t))}, not a float tensor"
        if tuple(t.shape) != tuple(tensors[k].shape):
            return f"tensor {k} has shape {tuple(t.shape)}, but this run's has {tuple(tensors[k].shape)}"
        if not bool(torch.isfinite(t).all()):
            return f"tensor {k} holds NaN or infinite values"
    return None


def _tensors_fit(saved, tensors: dict) -> bool:
    """saved holds a finite float tensor of each name and shape of `tensors` (the method's), and nothing else."""
    return tensor_flaw(saved, tensors) is None


def check_position(train: dict, tensors: dict, limits: tuple[int, int, int], file: Path) -> None:
    """A state's position and early-stopping record hold what the trainer writes, within this run's plan:
    limits (planned steps, epochs, steps per epoch). A state.pt edited by hand is refused in one line."""
    steps, epochs, per_epoch = limits
    bounds = {"step": steps, "epoch": epochs, "pos": per_epoch}
    for key in ("step", "epoch", "pos", "n_evals", "bad", "loss_n", "last_eval_step"):
        least = -1 if key == "last_eval_step" else 0
        if not is_whole(train[key], least) or train[key] > bounds.get(
            key, train["step"] if key == "last_eval_step" else math.inf
        ):
            raise CaptError(f"{file}: train.{key} is {shown(train[key])}, not a position of this run (a whole "
                            f"number from {least} to {bounds.get(key, 'the step')}); the state was not written by capt")
    for key in ("loss_sum", "elapsed"):
        if not is_finite(train[key]) or (key == "elapsed" and train[key] < 0):
            raise CaptError(f"{file}: train.{key} is {shown(train[key])}, not a finite number; the state was not "
                            "written by capt")
    if not isinstance(train["finished"], bool) or train["stopped"] not in (
        None,
        "early_stopping",
        "epochs",
        "max_steps",
    ):
        raise CaptError(f"{file}: train.finished / train.stopped are {shown(train['finished'])} / "
                        f"{shown(train['stopped'])}; the state was not written by capt")
    best = train["best"]
    if best is not None and not (
        isinstance(best, dict)
        and is_finite(best.get("headline"))
        and is_finite(best.get("loss"))
        and is_whole(best.get("step"))
        and best["step"] <= train["step"]
        and is_finite(best.get("epoch"))
        and isinstance(best.get("validation"), dict)
        and _tensors_fit(best.get("tensors"), tensors)
    ):
        raise CaptError(f"{file}: train.best is not the record of a validation evaluation with this run's tensors "
                        "(finite, of their shapes); the state was not written by capt")


def read_state(run: Path, task: str, tensors: dict, train_keys, limits: tuple[int, int, int]) -> dict:
    """RUN/state.pt, checked to be a complete training state of this task with the names and shapes of
    these tensors (the method's), its position within limits (check_position) (weights_only: a
    pickle payload never runs)."""
    file = run / "state.pt"
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        # torch names a refused class or function a GLOBAL; else it is no pickle at all
        if "global" not in str(e).lower():
            raise CaptError(f"{file} cannot be read (it is not a saved training state)") from None
        # weights_only refused an object: the file was not written by capt
        raise CaptError(f"{file} holds objects other than tensors and plain values; it was not written by capt "
                        "and was refused without running anything in it") from None
    except Exception as e:  # torch raises several types for a damaged file
        raise CaptError(f"{file} cannot be read ({type(e).__name__}: {e})".replace("\n", " ")[:300]) from None
    if not isinstance(state, dict):
        raise CaptError(f"{file} is not a training state: it holds a {type(state).__name__}, not a dict")
    try:
        state = upgrade_state(state)
    except (KeyError, TypeError, AttributeError) as e:
        raise CaptError(f"{file} is a damaged version-1 training state ({type(e).__name__}: {e})") from None
    missing = [k for k in STATE_KEYS if k not in state]
    if not missing:
        train = state["train"] if isinstance(state["train"], dict) else {}
        missing = [f"train.{k}" for k in train_keys if k not in train]
    if missing:
        raise CaptError(f"{file} is not a complete training state: it lacks {', '.join(missing)}")
    if state["version"] != STATE_VERSION or state["task"] != task:
        raise CaptError(f"{file} is not a training state for this run: version {shown(state['version'])} of task "
                        f"{shown(state['task'])}, where this run writes version {STATE_VERSION} of {task}")
    flaw = tensor_flaw(state["tensors"], tensors)
    if flaw:
        raise CaptError(f"{file} holds other tensors than this run's method has (names, shapes, or NaN values): "
                        f"{flaw}")
    check_position(state["train"], tensors, limits, file)
    return state


HYPERPARAMETERS = ("betas", "eps", "weight_decay", "amsgrad", "maximize")  # AdamW's, fixed by the run's settings


def _upgrade_moments(optimizer, saved: dict) -> None:
    """A state.pt written while a capsule was a (d,) parameter (it is now its block's (1, d) table) holds AdamW
    moments of shape (d,): they are the same numbers, viewed as the table's row."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    states = saved.get("state") if isinstance(saved, dict) else None
    if not isinstance(states, dict):
        return
    for index, p in enumerate(params):
        entry = states.get(index)
        for key in ("exp_avg", "exp_avg_sq"):
            m = entry.get(key) if isinstance(entry, dict) else None
            if isinstance(m, torch.Tensor) and m.dim() == 1 and tuple(p.shape) == (1, m.shape[0]):
                entry[key] = m[None]


def load_optimizer(optimizer, scheduler, state: dict, file: Path) -> None:
    """Load a saved optimizer and schedule into this run's fresh ones, then check them against what the
    run's settings make: the same hyperparameters and base rates, the schedule at the saved step, finite
    rates, moments of the tensors' shapes and finite. A state.pt edited by hand is refused in one line."""
    fresh = [tuple(group.get(k) for k in HYPERPARAMETERS) for group in optimizer.param_groups], list(scheduler.base_lrs)
    _upgrade_moments(optimizer, state["optimizer"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    loaded = (
        [tuple(group.get(k) for k in HYPERPARAMETERS) for group in optimizer.param_groups],
        list(scheduler.base_lrs),
    )
    moments = [optimizer.state.get(p, {}).get(key) for group in optimizer.param_groups for p in group["params"]
               for key in ("exp_avg", "exp_avg_sq")]
    shapes = [p.shape for group in optimizer.param_groups for p in group["params"] for _ in (0, 1)]
    if loaded[0] == fresh[0] and len(loaded[1]) == len(fresh[1]) and all(map(is_finite, loaded[1])) and (
        loaded[1] != fresh[1]
    ):
        raise CaptError(f"{file}: the run's saved learning rates are not the ones this capt gives its settings "
                        "(how capt sets a tensor's rate has changed since the run began: the extraction filter and "
                        "the projection maps train at r / fan-in now); resume it with the capt that began it, or use "
                        "a new --out")
    if (
        loaded != fresh
        or scheduler.last_epoch != state["train"]["step"]
        or not all(is_finite(g["lr"]) for g in optimizer.param_groups)
        or not all(
            m is None or (isinstance(m, torch.Tensor) and m.shape == shape and bool(torch.isfinite(m).all()))
            for m, shape in zip(moments, shapes)
        )
    ):
        raise CaptError(f"{file}: the optimizer's state or the learning-rate schedule is not this run's at step "
                        f"{state['train']['step']}; the state was not written by capt (or with other settings)")


def write_metrics(run: Path, lines: list[dict]) -> None:
    text = "".join(json.dumps(m) + "\n" for m in lines)
    atomic_write(run / "metrics.jsonl", lambda tmp: Path(tmp).write_text(text))


def read_metrics(run: Path, n_evals: int) -> list[dict]:
    """The first n_evals lines of RUN/metrics.jsonl (those the state counts; later ones are redone)."""
    log = run / "metrics.jsonl"
    lines = metrics_lines(log)
    if len(lines) < n_evals:
        raise CaptError(f"{log} has {len(lines)} lines, but {run / 'state.pt'} counts {n_evals} evaluations")
    return [metrics_line(log, i + 1, line) for i, line in enumerate(lines[:n_evals])]


def logged_seconds(run: Path) -> float | None:
    """Training time of a run that did not finish, from its last metrics line (None without one)."""
    file = run / "metrics.jsonl"
    lines = metrics_lines(file)
    return metrics_line(file, len(lines), lines[-1])["time"] if lines else None


def write_best(run: Path, model, best: dict | None) -> None:
    """RUN/best/ from the best tensors in the state (removed when there are none yet)."""
    if best is None:
        shutil.rmtree(run / "best", ignore_errors=True)
        return
    current = method_values(model)
    set_method(model, best["tensors"])
    save_method(model, run / "best")
    set_method(model, current)


def open_run(config, run: Path, resume: bool) -> dict | None:
    """Check the run directory before anything is loaded: a run to resume (its saved settings,
    which must match config) or room for a new one (created). Rank 0 alone calls it."""
    if resume:
        saved = read_run_config(run)
        if "step_scale" not in saved:  # before the step scale, the answer cue and the even batches
            raise CaptError(f"{run} was started by an earlier capt, whose batches, inputs and steps differ from this "
                            "one's; "
                            "it cannot be continued exactly: use a new --out")
        # edited by hand: one line naming it
        check_values(saved, type(config), run / "config.json", unbounded=("seed",))
        scales = saved.get("step_scales")
        if scales is not None and not fits(
            scales, saved.get("method"), len(scales) if isinstance(scales, list) else -1
        ):
            what = "pairs of positive numbers (key, value)" if saved.get("method") == "prefix" else "positive numbers"
            raise CaptError(f"{run / 'config.json'}: step_scales is {shown(scales)}, not a list of {what}; use a new "
                            "--out")
        if config.lr is None:
            config.lr = saved.get("lr")
        if config.answer_cue is None:
            config.answer_cue = saved.get("answer_cue")
        check_resume(saved, config, run)
        if not (run / "state.pt").is_file():  # its start was cut short before the first state
            raise CaptError(f"nothing to resume in {run}: it has no state.pt (start the run again without --resume)")
        return saved
    if (run / "state.pt").exists():  # state.pt, written last at the start, is what makes a run
        if not (run / "config.json").is_file():
            raise CaptError(LOST_CONFIG.format(run=run))
        raise CaptError(f"{run} already holds a run; pass --resume to continue it or choose another --out")
    make_directory(run)
    return None


def test_flaw(test) -> str | None:
    """What keeps a decoded test.json from being a run's test results, None when nothing does."""
    if not isinstance(test, dict):
        return f"it is {shown(test)}"
    metrics, best = test.get("metrics"), test.get("best")
    if not isinstance(metrics, dict) or not is_finite(metrics.get("headline")):
        return f"metrics is {shown(metrics)}"
    bad = next((k for k, v in metrics.items() if not is_finite(v)), None)
    if bad is not None:
        return f"metrics.{bad} is {shown(metrics[bad])}"
    for key, ok in (("n", is_whole(test.get("n"), 1)), ("loss", is_finite(test.get("loss"))),
                    ("steps", is_whole(test.get("steps")))):
        if not ok:
            return f"{key} is {shown(test.get(key))}"
    if not isinstance(best, dict) or not is_whole(best.get("step")) or not isinstance(best.get("validation"), dict):
        return f"best is {shown(best)}"
    return None


def finished_test(run: Path) -> dict | None:
    """A finished run's test.json (what a resumed finished run returns, as its test did), or None when it has none
    yet."""
    file = run / "test.json"
    if not file.is_file():
        return None
    test = read_json(file, "a run's test results")
    flaw = test_flaw(test)
    if flaw:
        raise CaptError(f"{file} is not the test results of a capt run (metrics, n, loss, steps, best): {flaw}; "
                        "remove it and resume the run to test its best tensors again")
    return test
