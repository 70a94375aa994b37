"""Every kind of bad input through the `capt` command: one line naming the problem, the right exit
status, never a traceback, and never the last-resort "internal error" line (each known bad input
has its own message). Checkpoints, method files, data, option values and run directories; then
the failures that need more than one call: a held lock, a full disk, SIGTERM, stale temporary
files; then random configs and random bytes (hypothesis)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import write_superglue, write_task
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import capt.load as load_module
from capt.checks import check_ids, check_mask, check_positions
from capt.cli.main import main
from capt.errors import CaptError, CaptWarning
from capt import trainer as trainer_module
from capt.trainer import TrainConfig, default_lr, train
from capt.load import load_method, load_model, save_capsules, weights_fingerprint
from capt.evaluate import NonFiniteScores, evaluate, evaluate_tasks
from capt.baselines import set_pooled
from capt.methods import attach
from capt.predict import predict as predict_rows
from capt.rundir import lock_run, read_state
from capt.tasks import load_task
from capt.tokenizer import load_tokenizer

FAST = ["--batch-size", "8", "--device", "cpu"]


@pytest.fixture(scope="module")
def base(tmp_path_factory, ckpts):
    """Good inputs to break: the tiny Llama and T5, SuperGLUE files, a one-step capt run and a prompt run."""
    root = tmp_path_factory.mktemp("bad")
    data = write_superglue(root / "data", {"CB": (40, 12), "COPA": (30, 10)})
    for method, run in (("capt", "run"), ("prompt", "prompt-run")):
        code = main(
            [
                "train",
                "--model",
                str(ckpts["llama"]),
                "--task",
                "cb",
                "--data",
                str(data),
                "--out",
                str(root / run),
                "--max-steps",
                "1",
                "--method",
                method,
                *(["--n", "2"] if method == "prompt" else []),
                *FAST,
            ]
        )
        assert code == 0
    return {"root": root, "llama": Path(ckpts["llama"]), "t5": Path(ckpts["t5"]), "data": data,
            "run": root / "run", "prompt": root / "prompt-run"}


class Case:
    """A scratch area for one case: copies of the good inputs, to be broken."""

    def __init__(self, base, tmp: Path):
        self.base, self.tmp = base, tmp

    def model(self, family="llama") -> Path:
        target = self.tmp / f"model-{family}"
        if not target.exists():
            shutil.copytree(self.base[family], target)
        return target

    def config(self, family="llama", **changes) -> Path:
        model = self.model(family)
        config = json.loads((model / "config.json").read_text())
        config.update(changes)
        (model / "config.json").write_text(json.dumps(config))
        return model

    def weights(self, edit, family="llama") -> Path:
        model = self.model(family)
        state = load_file(model / "model.safetensors")
        edit(state)
        save_file(state, model / "model.safetensors")
        return model

    def copy(self, name: str) -> Path:
        target = self.tmp / name
        if not target.exists():
            shutil.copytree(self.base[name], target)
        return target

    def data(self, task_dir="CB", file="train.jsonl", content: bytes | None = None) -> Path:
        target = self.tmp / "data"
        if not target.exists():
            shutil.copytree(self.base["data"], target)
        if content is not None:
            (target / task_dir / file).write_bytes(content)
        return target

    def eval(self, model=None, *extra) -> list:
        return [
            "eval",
            "--model",
            model or self.base["llama"],
            "--task",
            "cb",
            "--data",
            self.base["data"],
            "--device",
            "cpu",
            *extra,
        ]

    def train(self, *extra, model=None, data=None, out=None) -> list:
        return ["train", "--model", model or self.base["llama"], "--task", "cb", "--data", data or self.base["data"],
                "--out", out or self.tmp / "out", "--max-steps", "1", *FAST, *extra]


def with_value(argv: list, option: str, value) -> list:
    """argv with `option`'s value replaced."""
    argv = list(argv)
    argv[argv.index(option) + 1] = value
    return argv


def first_row(case) -> dict:
    return json.loads((case.base["data"] / "CB" / "train.jsonl").read_text().splitlines()[0])


def capsule_edit(case, edit, name="run") -> Path:
    run = case.copy(name)
    best = run / "best"
    stem = "capsules" if (best / "capsules.json").exists() else "adapter"
    tensors = load_file(best / f"{stem}.safetensors")
    edit(tensors)
    save_file(tensors, best / f"{stem}.safetensors")
    return best


def json_edit(path: Path, edit) -> None:
    value = json.loads(path.read_text())
    path.write_text(json.dumps(edit(value)))


def index_with(case, names) -> Path:
    """The tiny Llama split in two shards, its index naming `names` for the second shard's tensors."""
    model = case.model()
    state = load_file(model / "model.safetensors")
    keys = sorted(state)
    save_file({k: state[k] for k in keys[:3]}, model / "a.safetensors")
    save_file({k: state[k] for k in keys[3:]}, model / "b.safetensors")
    (model / "model.safetensors").unlink()
    weight_map = {k: "a.safetensors" for k in keys[:3]} | {k: names for k in keys[3:]}
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return model


def set_tensor(name, value):
    def edit(state):
        state[name] = value(state[name])
    return edit


NORM = "model.norm.weight"
NAN = float("nan")

# (id, argv built from a Case, exit status, words the one line must hold)
CASES = [
    # --- checkpoint config.json: types, ranges, structure ------------------------------------
    (
        "config hidden_size text",
        lambda c: c.eval(c.config(hidden_size="abc")),
        1,
        "hidden_size is 'abc' (str), but it must be int",
    ),
    (
        "config heads as text",
        lambda c: c.eval(c.config(num_attention_heads="4")),
        1,
        "num_attention_heads is '4' (str)",
    ),
    (
        "config heads as float",
        lambda c: c.eval(c.config(num_attention_heads=4.0)),
        1,
        "num_attention_heads is 4.0 (float)",
    ),
    ("config vocab bool", lambda c: c.eval(c.config(vocab_size=True)), 1, "vocab_size is True (bool)"),
    (
        "config is a list",
        lambda c: c.eval(write(c.model() / "config.json", b"[1, 2]")),
        1,
        "holds a JSON list, not an object",
    ),
    (
        "config not json",
        lambda c: c.eval(write(c.model() / "config.json", b"{model_type: llama")),
        1,
        "config.json is not valid JSON",
    ),
    ("config absent", lambda c: c.eval(remove(c.model() / "config.json")), 1, "no config.json in"),
    ("model dir absent", lambda c: c.eval(c.tmp / "nowhere"), 1, "model directory not found"),
    (
        "max positions 1e11",
        lambda c: c.eval(c.config(max_position_embeddings=10**11)),
        1,
        "max_position_embeddings is 100000000000, above 2,147,483,647",
    ),
    (
        "max positions float",
        lambda c: c.eval(c.config(max_position_embeddings=1e11)),
        1,
        "max_position_embeddings is 100000000000.0 (float)",
    ),
    ("rope_theta 0", lambda c: c.eval(c.config(rope_theta=0)), 1, "rope_theta is 0, but it must be above 0"),
    (
        "rope_theta negative",
        lambda c: c.eval(c.config(rope_theta=-5.0)),
        1,
        "rope_theta is -5.0, but it must be above 0",
    ),
    (
        "rope_parameters theta 0",
        lambda c: c.eval(c.config(rope_parameters={"rope_theta": 0})),
        1,
        "rope_theta is 0, but it must be a positive",
    ),
    ("rms_norm_eps 0", lambda c: c.eval(c.config(rms_norm_eps=0)), 1, "rms_norm_eps is 0, but it must be above 0"),
    (
        "tie flag as text",
        lambda c: c.eval(c.config(tie_word_embeddings="yes")),
        1,
        "tie_word_embeddings is 'yes' (str), but it must be bool",
    ),
    (
        "kv heads not dividing",
        lambda c: c.eval(c.config(num_key_value_heads=3)),
        1,
        "is not a multiple of num_key_value_heads 3",
    ),
    (
        "kv heads zero",
        lambda c: c.eval(c.config(num_key_value_heads=0)),
        1,
        "num_key_value_heads is 0, but it must be above 0",
    ),
    (
        "odd head_dim",
        lambda c: c.eval(c.config(head_dim=7)),
        1,
        "the head dimension is 7, but rope needs an even number",
    ),
    # the message names the checkpoint's config.json, not only the field
    ("hidden_act gelu", lambda c: c.eval(c.config(hidden_act="gelu")), 1, "config.json: hidden_act 'gelu' is not"),
    ("model_type bert", lambda c: c.eval(c.config(model_type="bert")), 1, "model_type 'bert' is not supported"),
    (
        "rope scaling lacks factor",
        lambda c: c.eval(c.config(rope_parameters={"rope_theta": 1e4, "rope_type": "linear"})),
        1,
        "linear rope scaling lacks factor",
    ),
    (
        "rope factor as text",
        lambda c: c.eval(c.config(rope_parameters={"rope_type": "linear", "factor": "2"})),
        1,
        "needs positive numbers",
    ),
    (
        "rope type yarn",
        lambda c: c.eval(c.config(rope_parameters={"rope_type": "yarn", "factor": 2.0})),
        1,
        "rope type 'yarn' is not supported",
    ),
    ("eos id negative", lambda c: c.eval(c.config(eos_token_id=-1)), 1, "eos_token_id is -1, but it must be 0 or more"),
    ("eos ids with text", lambda c: c.eval(c.config(eos_token_id=[1, "2"])), 1, "eos_token_id is [1, '2'] (list)"),
    (
        "sliding window",
        lambda c: c.eval(c.config(use_sliding_window=True)),
        1,
        "sliding-window attention is not implemented",
    ),
    ("t5 d_model text", lambda c: c.eval(c.config("t5", d_model="x")), 1, "d_model is 'x' (str)"),
    ("t5 heads zero", lambda c: c.eval(c.config("t5", num_heads=0)), 1, "num_heads is 0, but it must be above 0"),
    (
        "t5 feed forward swish",
        lambda c: c.eval(c.config("t5", feed_forward_proj="swish")),
        1,
        "feed_forward_proj 'swish' is not one of",
    ),
    (
        "t5 eps text",
        lambda c: c.eval(c.config("t5", layer_norm_epsilon="1e-6")),
        1,
        "layer_norm_epsilon is '1e-6' (str)",
    ),
    # --- checkpoint weights --------------------------------------------------------------------
    (
        "nan weight",
        lambda c: c.eval(c.weights(set_tensor(NORM, lambda t: t * NAN))),
        1,
        f"tensor {NORM} holds NaN or infinite values",
    ),
    (
        "inf weight",
        lambda c: c.eval(c.weights(set_tensor(NORM, lambda t: t / 0))),
        1,
        "holds NaN or infinite values; the checkpoint is damaged",
    ),
    (
        "int8 tensor",
        lambda c: c.eval(c.weights(set_tensor(NORM, lambda t: t.to(torch.int8)))),
        1,
        "is int8; capt reads float32",
    ),
    ("wrong shape", lambda c: c.eval(c.weights(set_tensor(NORM, lambda t: t[:-1]))), 1, f"tensor {NORM} has shape"),
    (
        "extra tensor",
        lambda c: c.eval(c.weights(lambda s: s.update(extra=torch.zeros(2)))),
        1,
        "checkpoint tensor extra is not part",
    ),
    ("missing tensor", lambda c: c.eval(c.weights(lambda s: s.pop(NORM))), 1, f"lacks tensor {NORM}"),
    (
        "truncated safetensors",
        lambda c: c.eval(truncate(c.model() / "model.safetensors")),
        1,
        "is corrupt or truncated",
    ),
    (
        "no safetensors",
        lambda c: c.eval(remove(c.model() / "model.safetensors")),
        1,
        "no model.safetensors or model.safetensors.index.json",
    ),
    (
        "shard outside",
        lambda c: c.eval(index_with(c, "../outside.safetensors")),
        1,
        "names the shard '../outside.safetensors', which is outside",
    ),
    (
        "shard absolute",
        lambda c: c.eval(index_with(c, "/etc/passwd")),
        1,
        "names the shard '/etc/passwd', which is outside",
    ),
    (
        "shard deep escape",
        lambda c: c.eval(index_with(c, "x/../../../../etc/passwd")),
        1,
        "which is outside the checkpoint directory",
    ),
    ("shard missing", lambda c: c.eval(index_with(c, "c.safetensors")), 1, "missing shard c.safetensors"),
    (
        "weight_map list",
        lambda c: c.eval(write(index_with(c, "b.safetensors") / "model.safetensors.index.json", b'{"weight_map": []}')),
        1,
        "weight_map must map tensor names to shard file names",
    ),
    (
        "weight_map numbers",
        lambda c: c.eval(
            write(index_with(c, "b.safetensors") / "model.safetensors.index.json", b'{"weight_map": {"a": 1}}')
        ),
        1,
        "weight_map must map tensor names",
    ),
    (
        "index not json",
        lambda c: c.eval(write(index_with(c, "b.safetensors") / "model.safetensors.index.json", b"{")),
        1,
        "is not valid JSON",
    ),
    # --- capsule and adapter files ---------------------------------------------------------------
    (
        "nan capsule",
        lambda c: c.eval(None, "--capsules", capsule_edit(c, set_tensor("layers.0", lambda t: t * NAN))),
        1,
        "layers.0 holds NaN or infinite values",
    ),
    (
        "inf capsule",
        lambda c: c.eval(None, "--capsules", capsule_edit(c, set_tensor("layers.1", lambda t: t + float("inf")))),
        1,
        "layers.1 holds NaN or infinite values",
    ),
    (
        "int capsule",
        lambda c: c.eval(None, "--capsules", capsule_edit(c, set_tensor("layers.1", lambda t: t.long()))),
        1,
        "or is not a float tensor",
    ),
    (
        "capsule shape",
        lambda c: c.eval(None, "--capsules", capsule_edit(c, set_tensor("layers.1", lambda t: t[:-1]))),
        1,
        "layers.1 has shape",
    ),
    (
        "capsule missing",
        lambda c: c.eval(None, "--capsules", capsule_edit(c, lambda s: s.pop("layers.1"))),
        1,
        "missing ['layers.1']",
    ),
    (
        "nan adapter",
        lambda c: c.eval(None, "--adapter", capsule_edit(c, set_tensor("prompt", lambda t: t * NAN), "prompt")),
        1,
        "prompt holds NaN or infinite values",
    ),
    (
        "capsules.json broken",
        lambda c: c.eval(None, "--capsules", write(c.copy("run") / "best" / "capsules.json", b"{")),
        1,
        "capsules.json is not valid JSON",
    ),
    (
        "capsules.json misspelt setting",  # would load as the default integration and change the results
        lambda c: c.eval(None, "--capsules", edit_meta(c, lambda m: m["capsule_config"].update(integraton="prepend"))),
        1,
        "capsules.json: unknown capsule setting 'integraton' (known: blocks, init, integration, length)",
    ),
    (
        "capsules.json list",
        lambda c: c.eval(None, "--capsules", write(c.copy("run") / "best" / "capsules.json", b"[]")),
        1,
        "holds a JSON list, not an object",
    ),
    (
        "capsule integration",
        lambda c: c.eval(None, "--capsules", edit_meta(c, lambda m: m["capsule_config"].update(integration="mix"))),
        1,
        "capsule integration 'mix' is not one of add, prepend",
    ),
    (
        "capsules of another base",
        lambda c: c.eval(c.config(rms_norm_eps=1e-5), "--capsules", c.copy("run") / "best"),
        1,
        "were made for a different base model",
    ),
    (
        "adapter and capsules",
        lambda c: c.eval(None, "--adapter", both_files(c)),
        1,
        "holds both capsules.json and adapter.json",
    ),
    (
        "adapter tensors missing",
        lambda c: c.eval(None, "--adapter", remove(c.copy("prompt") / "best" / "adapter.safetensors")),
        1,
        "no adapter.safetensors in",
    ),
    ("not a method dir", lambda c: c.eval(None, "--adapter", c.tmp), 1, "no capsules.json or adapter.json in"),
    # --- data --------------------------------------------------------------------------------------
    (
        "non utf-8 byte",
        lambda c: c.train(data=c.data(content=json.dumps(first_row(c)).encode() + b'\n{"premise": "caf\xe9"}\n')),
        1,
        "train.jsonl line 2: not UTF-8 text (byte 0xe9",
    ),
    (
        "malformed json",
        lambda c: c.train(data=c.data(content=b'{"premise": \n')),
        1,
        "train.jsonl line 1: not valid JSON",
    ),
    ("json list row", lambda c: c.train(data=c.data(content=b"[1]\n")), 1, "line 1: expected a JSON object, got list"),
    (
        "missing field",
        lambda c: c.train(data=c.data(content=b'{"premise": "a", "label": "neutral"}\n')),
        1,
        "missing field 'hypothesis'",
    ),
    (
        "field not text",
        lambda c: c.train(data=c.data(content=b'{"premise": 5, "hypothesis": "b", "label": "neutral"}\n')),
        1,
        "train.jsonl line 1: field 'premise' should be text, got 5",
    ),
    (
        "unknown label",
        lambda c: c.train(data=c.data(content=b'{"premise": "a", "hypothesis": "b", "label": "maybe"}\n')),
        1,
        "maybe",
    ),
    ("empty file", lambda c: c.train(data=c.data(content=b"\n\n")), 1, "no examples (the file is empty)"),
    ("deep nesting", lambda c: c.train(data=c.data(content=b"[" * 100000 + b"\n")), 1, "line 1: not valid JSON"),
    (
        "row too long",
        lambda c: c.train("--max-length", "20"),
        1,
        "tokens even with its premise cut to nothing, over the max length 20",
    ),
    (
        "missing val file",
        lambda c: c.train(data=remove(c.data() / "CB" / "val.jsonl").parent),
        1,
        "the test split needs the official val file, which is missing",
    ),
    (
        "missing task dir",
        lambda c: ["eval", "--model", c.base["llama"], "--task", "rte", "--data", c.base["data"]],
        1,
        "task rte: no RTE directory",
    ),
    ("unknown task", lambda c: c.train() + ["--task", "nli"], 1, "unknown task 'nli'"),
    ("data dir absent", lambda c: c.train(data=c.tmp / "none"), 1, "SuperGLUE data not found"),
    # --- option values -------------------------------------------------------------------------
    ("lr inf", lambda c: c.train("--lr", "inf"), 2, "must be a finite number"),
    ("lr nan", lambda c: c.train("--lr", "nan"), 2, "must be a finite number"),
    ("lr zero", lambda c: c.train("--lr", "0"), 2, "must be above 0"),
    ("weight decay inf", lambda c: c.train("--weight-decay", "inf"), 2, "must be a finite number"),
    ("warmup inf", lambda c: c.train("--warmup", "inf"), 2, "must be a finite number"),
    ("seed 2**70", lambda c: c.train("--seed", str(2**70)), 2, "must be below 2**63"),
    ("seed negative", lambda c: c.train("--seed", "-1"), 2, "must be at least 0"),
    (
        "seed list 2**70",
        lambda c: ["run", "--model", c.base["llama"], "--out", c.tmp / "o", "--seed-list", f"0,{2**70}"],
        2,
        "must be below 2**63",
    ),
    ("batch size zero", lambda c: c.train("--batch-size", "0"), 2, "must be at least 1"),
    ("max length text", lambda c: c.train("--max-length", "long"), 2, "'long' is not an integer"),
    ("dtype int8", lambda c: c.train("--dtype", "int8"), 2, "invalid choice: 'int8'"),
    ("device mps", lambda c: c.train("--device", "mps"), 1, "device 'mps' is not supported: capt runs on cpu or cuda"),
    ("device meta", lambda c: c.train("--device", "meta"), 1, "device 'meta' is not supported"),
    ("device nonsense", lambda c: c.train("--device", "gpu0"), 1, "device 'gpu0' is not a torch device"),
    ("device cpu:1", lambda c: c.eval(None, "--device", "cpu:1"), 1, "device 'cpu:1': the CPU is one device"),
    ("out empty", lambda c: with_value(c.train(), "--out", ""), 2, "argument --out: is empty: give a path"),
    ("model empty", lambda c: with_value(c.eval(), "--model", ""), 2, "argument --model: is empty: give a path"),
    ("capsules empty", lambda c: c.eval(None, "--capsules", " "), 2, "argument --adapter/--capsules: is empty"),
    (
        "input empty",
        lambda c: ["predict", "--model", c.base["llama"], "--task", "cb", "--input", ""],
        2,
        "argument --input: is empty: give a path",
    ),
    ("attention out empty", lambda c: ["attention", "--curves", "x", "--out", ""], 2, "argument --out: is empty"),
    (
        "seed list repeated",
        lambda c: ["run", "--model", c.base["llama"], "--out", c.tmp / "o", "--seed-list", "1,1"],
        2,
        "argument --seed-list: 1 listed more than once",
    ),
    (
        "lengths repeated",
        lambda c: ["run", "--model", c.base["llama"], "--out", c.tmp / "o", "--method", "prompt", "--lengths", "4,8,4"],
        2,
        "argument --lengths: 4 listed more than once",
    ),
    ("device cuda absent", lambda c: c.eval(None, "--device", "cuda:3"), 1, "device cuda:3 requested but"),
    ("warmup 1.5", lambda c: c.train("--warmup", "1.5"), 1, "warmup 1.5 is neither a fraction"),
    (
        "n for capt",
        lambda c: c.train("--n", "3"),
        1,
        "n (vectors per place) is for prompt, deep-prompt, prefix, not capt",
    ),
    (
        "blocks for prompt",
        lambda c: c.train("--method", "prompt", "--blocks", "odd"),
        1,
        "integration and blocks are capt's options",
    ),
    (
        "block out of range",
        lambda c: c.train("--blocks", "0,9"),
        1,
        "capsule blocks [9] are outside the model's 2 blocks",
    ),
    (
        "linear head on t5",
        lambda c: c.train("--method", "linear-head", model=c.base["t5"]),
        1,
        "linear-head is for decoder-only models",
    ),
    ("eval prompt no adapter", lambda c: c.eval(None, "--method", "prompt"), 1, "needs --adapter DIR"),
    ("out is a file", lambda c: c.train(out=write(c.tmp / "f", b"x")), 1, "is a file, not a directory"),
    # --- run directories ---------------------------------------------------------------------------
    ("resume nothing", lambda c: ["train", "--out", c.tmp / "empty", "--resume"], 1, "nothing to resume in"),
    (
        "resume other settings",
        lambda c: ["train", "--out", c.copy("run"), "--resume", "--lr", "0.01"],
        1,
        f"was trained with other settings: lr {default_lr('capt', 'rms'):g} (given 0.01)",
    ),
    (
        "resume other model",
        lambda c: ["train", "--out", c.copy("run"), "--resume", "--model", c.base["t5"]],
        1,
        "was trained on a different model",
    ),
    (
        "state pickle payload",
        lambda c: ["train", "--out", pickled_state(c), "--resume"],
        1,
        "holds objects other than tensors and plain values; it was not written by capt",
    ),
    (
        "state garbage",
        lambda c: ["train", "--out", write(unfinish(c) / "state.pt", b"garbage").parent, "--resume"],
        1,
        "state.pt cannot be read",
    ),
    (
        "metrics garbage",
        lambda c: ["train", "--out", write(unfinish(c) / "metrics.jsonl", b"{\n").parent, "--resume"],
        1,
        "metrics.jsonl line 1: not valid JSON",
    ),
    (
        "run config list",
        lambda c: ["train", "--out", write(c.copy("run") / "config.json", b"[]"), "--resume"],
        1,
        "is not a run's settings: it holds a JSON list",
    ),
    (
        "compare broken json",
        lambda c: ["compare", write(c.tmp / "results.json", b"{")],
        1,
        "results.json is not valid JSON",
    ),
    (
        "compare not results",
        lambda c: ["compare", write(c.tmp / "results.json", b"{}")],
        1,
        "is not a `capt run` results file",
    ),
]


HUGE = b"1" * 5000  # more digits than Python converts to an int (4,300)
DEEP = b"[" * 100000  # deeper than Python's JSON parser goes
LONE = b'"\\ud800"'  # valid JSON: a lone UTF-16 surrogate, which no tokenizer or UTF-8 writer takes
SHA = "0" * 64

# Every JSON file capt reads, broken the ways Python's json module cannot take: one line naming the file (and line).
JSON_CASES = [
    (
        "config huge integer",
        lambda c: c.eval(write(c.model() / "config.json", b'{"model_type": "llama", "vocab_size": ' + HUGE + b"}")),
        1,
        "config.json is not JSON capt can read (Exceeds the limit (4300 digits)",
    ),
    (
        "config nested deep",
        lambda c: c.eval(write(c.model() / "config.json", b'{"model_type": ' + DEEP)),
        1,
        "config.json is not valid JSON (nested too deeply",
    ),
    (
        "config not utf-8",
        lambda c: c.eval(write(c.model() / "config.json", b'{"model_type": "llam\xe9"}')),
        1,
        "config.json is not UTF-8 text (byte 0xe9 at byte 21)",
    ),
    (
        "config lone surrogate",
        lambda c: c.eval(write(c.model() / "config.json", b'{"model_type": ' + LONE + b"}")),
        1,
        "config.json is not text capt can use: a string holds the lone surrogate escape \\ud800",
    ),
    (
        "config empty",
        lambda c: c.eval(write(c.model() / "config.json", b"")),
        1,
        "config.json is not valid JSON (the file is empty)",
    ),
    (
        "index huge integer",
        lambda c: c.eval(
            write(index_with(c, "b.safetensors") / "model.safetensors.index.json", b'{"weight_map": ' + HUGE + b"}")
        ),
        1,
        "index.json is not JSON capt can read",
    ),
    (
        "capsules.json huge integer",
        lambda c: c.eval(
            None, "--capsules", write(c.copy("run") / "best" / "capsules.json", b'{"capsule_config": ' + HUGE + b"}")
        ),
        1,
        "capsules.json is not JSON capt can read",
    ),
    (
        "capsules.json nested deep",
        lambda c: c.eval(None, "--capsules", write(c.copy("run") / "best" / "capsules.json", DEEP)),
        1,
        "capsules.json is not valid JSON (nested too deeply",
    ),
    (
        "capsules.json not utf-8",
        lambda c: c.eval(None, "--capsules", write(c.copy("run") / "best" / "capsules.json", b"\xff{}")),
        1,
        "capsules.json is not UTF-8 text",
    ),
    (
        "adapter.json lone surrogate",
        lambda c: c.eval(
            None,
            "--adapter",
            write(c.copy("prompt") / "best" / "adapter.json", b'{"method_config": {"method": ' + LONE + b"}}").parent,
        ),
        1,
        "adapter.json is not text capt can use",
    ),
    (
        "tokenizer config not utf-8",
        lambda c: c.eval(write(c.model() / "tokenizer_config.json", b"\xfe\xff{}").parent),
        1,
        "tokenizer_config.json is not UTF-8 text",
    ),
    (
        "tokenizer config list",
        lambda c: c.eval(write(c.model() / "tokenizer_config.json", b"[]").parent),
        1,
        "tokenizer_config.json is not a tokenizer_config.json: it holds a JSON list, not an object",
    ),
    (
        "tokenizer config bos 1",
        lambda c: c.eval(write(c.model() / "tokenizer_config.json", b'{"bos_token": 1}').parent),
        1,
        "tokenizer_config.json: bos_token is 1, but it must be a token's text",
    ),
    (
        "tokenizer config pad list",
        lambda c: c.eval(write(c.model() / "tokenizer_config.json", b'{"pad_token": ["<pad>"]}').parent),
        1,
        "pad_token is ['<pad>'], but it must be a token's text",
    ),
    (
        "tokenizer config add_bos text",
        lambda c: c.eval(write(c.model() / "tokenizer_config.json", b'{"add_bos_token": "yes"}').parent),
        1,
        "add_bos_token is 'yes', but it must be true, false or null",
    ),
    (
        "tokenizer config surrogate",
        lambda c: c.eval(write(c.model() / "tokenizer_config.json", b'{"eos_token": ' + LONE + b"}").parent),
        1,
        "tokenizer_config.json is not text capt can use",
    ),
    (
        "tokenizer config huge int",
        lambda c: c.eval(write(c.model() / "tokenizer_config.json", b'{"model_max_length": ' + HUGE + b"}").parent),
        1,
        "tokenizer_config.json is not JSON capt can read",
    ),
    (
        "task file huge integer",
        lambda c: c.train("--task", task_file(c, labels={"1": "yes", "0": "no"}, raw=b'"x": ' + HUGE)),
        1,
        "reviews.json is not JSON capt can read",
    ),
    (
        "task file nested deep",
        lambda c: c.train("--task", write(c.tmp / "deep.json", DEEP)),
        1,
        "deep.json is not valid JSON (nested too deeply",
    ),
    (
        "task file not utf-8",
        lambda c: c.train("--task", write(c.tmp / "t.json", b'{"name": "r\xe9views"}')),
        1,
        "t.json is not UTF-8 text",
    ),
    (
        "task file lone surrogate",
        lambda c: c.train("--task", task_file(c, template="\ud800 {review}")),
        1,
        "reviews.json is not text capt can use",
    ),
    (
        "row lone surrogate",
        lambda c: c.train(data=c.data(content=b'{"premise": ' + LONE + b', "hypothesis": "b", "label": "neutral"}\n')),
        1,
        "train.jsonl line 1: not text capt can use: a string holds the lone surrogate escape \\ud800",
    ),
    (
        "row low surrogate alone",
        lambda c: c.train(
            data=c.data(content=good_rows(c) + b'{"premise": "a\\udc00b", "hypothesis": "b", "label": 1}\n')
        ),
        1,
        "train.jsonl line 6: not text capt can use",
    ),
    (
        "row huge integer",
        lambda c: c.train(data=c.data(content=good_rows(c) + b'{"idx": ' + HUGE + b"}\n")),
        1,
        "train.jsonl line 6: not JSON capt can read",
    ),
    (
        "task file row surrogate",
        lambda c: c.train("--task", task_file(c, rows=b'{"review": ' + LONE + b', "stars": 1, "label": 1}\n')),
        1,
        "train.jsonl line 1: not text capt can use",
    ),
    (
        "run config not utf-8",
        lambda c: ["train", "--out", write(c.copy("run") / "config.json", b"\xff\xfe"), "--resume"],
        1,
        "config.json is not UTF-8 text",
    ),
    (
        "run config huge int",
        lambda c: ["train", "--out", write(c.copy("run") / "config.json", b'{"seed": ' + HUGE + b"}"), "--resume"],
        1,
        "config.json is not JSON capt can read",
    ),
    (
        "metrics not utf-8",
        lambda c: ["train", "--out", write(unfinish(c) / "metrics.jsonl", b"\xff\n").parent, "--resume"],
        1,
        "metrics.jsonl line 1: not UTF-8 text",
    ),
    (
        "test.json broken",
        lambda c: ["train", "--out", write(c.copy("run") / "test.json", b"{").parent, "--resume"],
        1,
        "test.json is not valid JSON",
    ),
    (
        "test.json without metrics",
        lambda c: ["train", "--out", write(c.copy("run") / "test.json", b'{"n": 12}').parent, "--resume"],
        1,
        "test.json is not the test results of a capt run (metrics, n, loss, steps, best): metrics is None; remove it "
        "and resume the run",
    ),
    (
        "test.json steps -5",
        lambda c: ["train", "--out", edit_test_json(c, steps=-5), "--resume"],
        1,
        "test.json is not the test results of a capt run (metrics, n, loss, steps, best): steps is -5;",
    ),
    (
        "results tasks text",
        lambda c: ["compare", write(c.tmp / "results.json", results_json(tasks="cb"))],
        1,
        "results.json: tasks is 'cb', not what `capt run` writes there",
    ),
    (
        "results empty task",
        lambda c: ["compare", write(c.tmp / "results.json", results_json(tasks={"cb": {}}))],
        1,
        "results.json: tasks.cb has no valid 'metric'",
    ),
    (
        "results no settings",
        lambda c: ["compare", write(c.tmp / "results.json", results_json(settings=None))],
        1,
        "results.json: settings is None, not what `capt run` writes there",
    ),
    (
        "results zero shot missing",
        lambda c: ["compare", write(c.tmp / "results.json", results_json(zero_shot={}))],
        1,
        "tasks.cb has no valid 'zero_shot.f1'",
    ),
    (
        "results method unknown",
        lambda c: ["compare", write(c.tmp / "results.json", results_json(method="lora"))],
        1,
        "method is 'lora'",
    ),
    (
        "results not utf-8",
        lambda c: ["compare", write(c.tmp / "results.json", b"\xff")],
        1,
        "results.json is not UTF-8 text",
    ),
    (
        "results environment text",
        lambda c: ["compare", write(c.tmp / "results.json", results_json(environment="gpu"))],
        1,
        "results.json: environment is 'gpu', not what `capt run` writes there",
    ),
    (
        "results lengths text",
        lambda c: ["compare", write(c.tmp / "results.json", results_json(lengths="2,3"))],
        1,
        "lengths is '2,3'",
    ),
    (
        "attention json deep",
        lambda c: ["attention", "--curves", write(c.tmp / "attention.json", DEEP), "--out", c.tmp / "o"],
        1,
        "attention.json is not valid JSON (nested too deeply",
    ),
    (
        "attention json absent",
        lambda c: ["attention", "--curves", c.tmp / "none", "--out", c.tmp / "o"],
        1,
        "no attention.json at",
    ),
    (
        "attention json front only",
        lambda c: ["attention", "--curves", write(c.tmp / "attention.json", b'{"front": {}}'), "--out", c.tmp / "o"],
        1,
        "is not an attention.json written by capt attention (it lacks what its curves are drawn from)",
    ),
    (
        "attention json no layers",
        lambda c: [
            "attention",
            "--curves",
            write(
                c.tmp / "attention.json",
                json.dumps(
                    {
                        "front": {"slots": 1, "rows": 0, "prefix_columns": 0},
                        "what": "x",
                        "task": "cb",
                        "split": "test",
                        "model_config_sha256": SHA,
                        "self": {"layer": {"first": [0.5]}},
                    }
                ).encode(),
            ),
            "--out",
            c.tmp / "o",
        ],
        1,
        "is not an attention.json written by capt attention",
    ),
]


# Outputs that would write over an input: refused before anything is written.
OUTPUT_CASES = [
    ("train out is the model", lambda c: c.train(model=c.model(), out=c.model()), 1, "is the model directory"),
    (
        "train out in the model",
        lambda c: c.train(model=c.model(), out=c.model() / "run"),
        1,
        "lies inside the model directory",
    ),
    ("train out holds the model", lambda c: c.train(model=c.model(), out=c.tmp), 1, "holds the model directory"),
    (
        "train out links to the model",
        lambda c: c.train(model=c.model(), out=link(c.model(), c.tmp / "link")),
        1,
        "is the model directory",
    ),
    ("train out is the data", lambda c: c.train(data=c.data(), out=c.data() / "CB"), 1, "is the task's data directory"),
    (
        "train out in the data",
        lambda c: c.train(data=c.data(), out=c.data() / "CB" / "run"),
        1,
        "lies inside the task's data directory",
    ),
    (
        "train out holds the task file",
        lambda c: c.train("--task", task_file(c), out=c.tmp / "task"),
        1,
        "holds the task's task file",
    ),
    (
        "train out holds its train file",
        lambda c: c.train("--task", task_file(c), out=c.tmp / "task" / "data"),
        1,
        "holds the task's train file",
    ),
    (
        "run out in the model",
        lambda c: ["run", "--model", c.model(), "--tasks", "cb", "--data", c.base["data"], "--out", c.model() / "r"],
        1,
        "lies inside the model directory",
    ),
    ("predict out is the input", lambda c: predict(c, out=rows(c)), 1, "is the --input file"),
    (
        "predict out links to the input",
        lambda c: predict(c, out=hard_link(rows(c), c.tmp / "same.jsonl")),
        1,
        "is the --input file",
    ),
    (
        "predict out is a config",
        lambda c: predict(c, model=c.model(), out=c.model() / "config.json"),
        1,
        "lies inside the model directory",
    ),
    (
        "predict out in the capsules",
        lambda c: predict(c, "--capsules", c.copy("run") / "best", out=c.copy("run") / "best" / "capsules.json"),
        1,
        "lies inside the adapter directory",
    ),
    (
        "predict out is the task file",
        lambda c: predict(
            c,
            "--task",
            task_file(c),
            "--input",
            c.tmp / "task" / "data" / "train.jsonl",
            out=c.tmp / "task" / "reviews.json",
        ),
        1,
        "is the task's task file",
    ),
    (
        "predict out in the run",
        lambda c: predict(c, "--capsules", c.copy("run"), out=c.copy("run") / "config.json"),
        1,
        "lies inside the run directory",
    ),
    (
        "predict several out is input",
        lambda c: predict(c, "--capsules", f"cb={c.base['run']}", "--input", tagged_rows(c), out=tagged_rows(c)),
        1,
        "is the --input file",
    ),
    (
        "attention out is the model",
        lambda c: ["attention", "--model", c.model(), "--task", "cb", "--data", c.base["data"], "--out", c.model()],
        1,
        "is the model directory",
    ),
]

# Saved tensors and runs are bound to the base model's weights and to the data they were trained on.
BASE_CASES = [
    (
        "capsules on other weights",
        lambda c: c.eval(halved(c), "--capsules", c.base["run"]),
        1,
        "were made for a different base model (weights_sha256 ",
    ),
    (
        "capsules on other weights say how",
        lambda c: c.eval(halved(c), "--capsules", c.base["run"]),
        1,
        "pass --any-base (any_base=True) to use them on this base on purpose",
    ),
    (
        "capsule set on other weights",
        lambda c: [
            "eval",
            "--model",
            halved(c),
            "--task",
            "cb",
            "--data",
            c.base["data"],
            "--capsules",
            f"cb={c.base['run']}",
        ],
        1,
        "capsules 'cb' in",
    ),
    (
        "adapter on other weights",
        lambda c: c.eval(halved(c), "--adapter", c.base["prompt"]),
        1,
        "the prompt tensors in",
    ),
    (
        "predict on other weights",
        lambda c: predict(c, "--capsules", c.base["run"], model=halved(c), out=c.tmp / "p.jsonl"),
        1,
        "weights_sha256",
    ),
    (
        "any-base keeps the sizes",
        lambda c: c.eval(c.base["t5"], "--capsules", c.base["run"], "--any-base"),
        1,
        "(model_type 'llama' vs 't5', config_sha256 ",
    ),
    (
        "resume on other weights",
        lambda c: ["train", "--out", c.copy("run"), "--resume", "--model", halved(c)],
        1,
        "was trained on weights with sha256 ",
    ),
    (
        "resume on other weights says how",
        lambda c: ["train", "--out", c.copy("run"), "--resume", "--model", halved(c)],
        1,
        "pass --any-base to continue it on these weights on purpose",
    ),
    (
        "resume after train rows changed",
        lambda c: ["train", "--out", c.copy("run"), "--resume", "--data", c.data(content=good_rows(c, 39))],
        1,
        "train.jsonl (train.jsonl) with sha256 ",
    ),
    (
        "resume after val rows changed",
        lambda c: [
            "train",
            "--out",
            c.copy("run"),
            "--resume",
            "--data",
            c.data(
                file="val.jsonl",
                content=b"\n".join((c.base["data"] / "CB" / "val.jsonl").read_bytes().split(b"\n")[::-1]),
            ),
        ],
        1,
        "the run would go on with other rows",
    ),
    (
        "resume after task data changed",
        lambda c: ["train", "--out", task_run(c, "test.jsonl"), "--resume"],
        1,
        "test.jsonl (test) with sha256",
    ),
    (
        "resume after the task file changed",
        lambda c: ["train", "--out", task_run(c, None, spec={"metric": "macro-f1"}), "--resume"],
        1,
        "was trained on the task file",
    ),
    (
        "resume with a task file record text",
        lambda c: ["train", "--out", task_run(c, None, task_file="reviews.json"), "--resume"],
        1,
        "config.json: task_file is 'reviews.json', not the record of a task file",
    ),
    (
        "compare other weights",
        lambda c: [
            "compare",
            write(c.tmp / "a.json", results_json(weights="a" * 64)),
            write(c.tmp / "b.json", results_json(weights="b" * 64)),
        ],
        1,
        "was made on other weights than",
    ),
]

# A run directory edited by hand: its saved settings and its state are checked before they are used.
RUN_CASES = [
    (
        "run max_steps text",
        lambda c: resume(c, settings={"max_steps": "1"}),
        1,
        "config.json: max_steps is '1' (str), but it must be int | None",
    ),
    (
        "run seed float",
        lambda c: resume(c, settings={"seed": 0.5}),
        1,
        "config.json: seed is 0.5 (float), but it must be int",
    ),
    (
        "run epochs huge",
        lambda c: resume(c, settings={"epochs": 10**20}),
        1,
        "config.json: epochs is 100000000000000000000, above 2,147,483,647",
    ),
    (
        "run blocks dict",
        lambda c: resume(c, settings={"blocks": {"a": 1}}),
        1,
        "blocks is {'a': 1} (dict), but it must be str | list[int]",
    ),
    (
        "run lr 1e300",
        lambda c: resume(c, settings={"lr": 1e300}),
        1,
        "the learning rate must be a positive number below 3.4e+37",
    ),
    (
        "run step scales text",
        lambda c: resume(c, settings={"step_scales": ["a", 1.0]}),
        1,
        "step_scales is ['a', 1.0], not a list of positive",
    ),
    (
        "run step scales negative",
        lambda c: resume(c, settings={"step_scales": [-1.0, 1.0]}),
        1,
        "not a list of positive numbers",
    ),
    (
        "state step -5",
        lambda c: resume(c, state={"step": -5}),
        1,
        "state.pt: train.step is -5, not a position of this run",
    ),
    (
        "state step beyond the plan",
        lambda c: resume(c, state={"step": 99}),
        1,
        "train.step is 99, not a position of this run (a whole number from 0 to 1)",
    ),
    ("state epoch text", lambda c: resume(c, state={"epoch": "0"}), 1, "train.epoch is '0', not a position"),
    ("state pos huge", lambda c: resume(c, state={"pos": 10**6}), 1, "train.pos is 1000000"),
    ("state last eval ahead", lambda c: resume(c, state={"last_eval_step": 5}), 1, "train.last_eval_step is 5"),
    ("state loss nan", lambda c: resume(c, state={"loss_sum": NAN}), 1, "train.loss_sum is nan, not a finite number"),
    (
        "state finished text",
        lambda c: resume(c, state={"finished": "yes"}),
        1,
        "train.finished / train.stopped are 'yes' / ",
    ),
    ("state stopped unknown", lambda c: resume(c, state={"stopped": "tired"}), 1, "train.finished / train.stopped are"),
    (
        "state best step ahead",
        lambda c: resume(c, best={"step": 7}),
        1,
        "train.best is not the record of a validation evaluation",
    ),
    (
        "state best nan tensor",
        lambda c: resume(c, best={"tensors": {"layers.0": torch.full((32,), NAN), "layers.1": torch.zeros(32)}}),
        1,
        "train.best is not the record of a validation evaluation with this run's tensors",
    ),
    (
        "state best wrong shape",
        lambda c: resume(c, best={"tensors": {"layers.0": torch.zeros(3), "layers.1": torch.zeros(32)}}),
        1,
        "(finite, of their shapes)",
    ),
    (
        "state tensors nan",
        lambda c: resume(c, tensors={"layers.0": torch.full((32,), NAN), "layers.1": torch.zeros(32)}),
        1,
        "holds other tensors than this run's method has (names, shapes, or NaN values): tensor layers.0 holds NaN",
    ),
    (
        "state tensors int",
        lambda c: resume(c, tensors={"layers.0": torch.zeros(32, dtype=torch.long), "layers.1": torch.zeros(32)}),
        1,
        "holds other tensors than this run's method has (names, shapes, or NaN values): tensor layers.0 is "
        "torch.int64, not a float tensor",
    ),
    (
        "state schedule ahead",
        lambda c: resume(c, edit=lambda s: s["scheduler"].update(last_epoch=7)),
        1,
        "state.pt: the optimizer's state or the learning-rate schedule is not this run's at step 1",
    ),
    (
        "state schedule text",
        lambda c: resume(c, edit=lambda s: s["scheduler"].update(last_epoch="x")),
        1,
        "the learning-rate schedule is not",
    ),
    (
        "state base rates text",
        lambda c: resume(c, edit=lambda s: s["scheduler"].update(base_lrs=["x", 1.0])),
        1,
        "is not this run's",
    ),
    (
        "state base rates of another capt",
        lambda c: resume(c, edit=lambda s: s["scheduler"].update(base_lrs=[r * 8 for r in s["scheduler"]["base_lrs"]])),
        1,
        "state.pt: the run's saved learning rates are not the ones this capt gives its settings (how capt sets a "
        "tensor's rate has changed since the run began",
    ),
    (
        "state rate text",
        lambda c: resume(c, edit=lambda s: s["optimizer"]["param_groups"][0].update(lr="x")),
        1,
        "is not this run's",
    ),
    (
        "state betas",
        lambda c: resume(c, edit=lambda s: s["optimizer"]["param_groups"][0].update(betas=(0.5, 0.5))),
        1,
        "is not this run's",
    ),
    (
        "state moments shape",
        lambda c: resume(
            c, edit=lambda s: [v.update(exp_avg=torch.zeros(3)) for v in s["optimizer"]["state"].values()]
        ),
        1,
        "the optimizer's state or the learning-rate schedule",
    ),
    (
        "state moments nan",
        lambda c: resume(
            c, edit=lambda s: [v.update(exp_avg_sq=v["exp_avg_sq"] * NAN) for v in s["optimizer"]["state"].values()]
        ),
        1,
        "the optimizer's state or the learning-rate schedule",
    ),
    (
        "state rng text",
        lambda c: resume(c, edit=lambda s: s["rng"].update(python="x")),
        1,
        "state.pt is a damaged training state (ValueError",
    ),
    (
        "state rng negative",
        lambda c: resume(c, edit=lambda s: s["rng"].update(python=(3, (-5,) + s["rng"]["python"][1][1:], None))),
        1,
        "state.pt is a damaged training state (OverflowError",
    ),
    (
        "metrics line without scores",
        lambda c: [
            "train",
            "--out",
            write(unfinish(c) / "metrics.jsonl", b'{"time": 1.0, "step": 1}\n').parent,
            "--resume",
        ],
        1,
        "metrics.jsonl line 1: not a metrics record (validation is None, not the headline, the loss and the metrics;",
    ),
    (
        "metrics line nan loss",
        lambda c: ["train", "--out", metrics_edit(c, lambda m: m["validation"].update(loss=NAN)), "--resume"],
        1,
        "metrics.jsonl line 1: not a metrics record (validation.loss is nan;",
    ),
]


def resume(
    case,
    settings: dict | None = None,
    state: dict | None = None,
    best: dict | None = None,
    tensors: dict | None = None,
    edit=None,
) -> list:
    """`capt train --resume` on a copy of the one-step run, its config.json's settings, its state's position (train),
    best record or tensors changed, or the state edited by `edit`."""
    run = unfinish(case)
    if settings:
        json_edit(run / "config.json", lambda c: {**c, **settings})
    saved = torch.load(run / "state.pt", weights_only=True)
    saved["train"].update(state or {})
    saved["train"]["best"].update(best or {})
    saved["tensors"] = tensors or saved["tensors"]
    if edit is not None:
        edit(saved)
    torch.save(saved, run / "state.pt")
    return ["train", "--out", run, "--resume"]

# Commands whose numbers or files could not work: refused before anything is allocated or written.
COMMAND_CASES = [
    (
        "attention layers beyond",
        lambda c: [
            "attention",
            "--model",
            c.base["llama"],
            "--task",
            "cb",
            "--data",
            c.base["data"],
            "--out",
            c.tmp / "a",
            "--layers",
            "7",
            "--limit",
            "2",
        ],
        1,
        "--layers 7: the model has 2 layers (0..1)",
    ),
    (
        "attention t5 layers beyond",
        lambda c: [
            "attention",
            "--model",
            c.base["t5"],
            "--task",
            "cb",
            "--data",
            c.base["data"],
            "--out",
            c.tmp / "a",
            "--layers",
            "0,2",
            "--limit",
            "2",
        ],
        1,
        "--layers 0,2: the model has 2 layers",
    ),
    (
        "lr 1e300",
        lambda c: c.train("--lr", "1e300", "--step-scale", "none"),
        1,
        "the learning rate must be a positive number below 3.4e+37",
    ),
    (
        "prompt n 1e9 llama",
        lambda c: c.train("--method", "prompt", "--n", "1000000000"),
        1,
        "its rows take positions 0..999,999,999 in front of every input, but the model has "
        "max_position_embeddings 1,024",
    ),
    (
        "prompt n 1e9 t5",
        lambda c: c.train("--method", "prompt", "--n", "1000000000", model=c.base["t5"]),
        1,
        "prompt with n 1,000,000,000 trains 32,000,000,000 values, 476.8 GiB with their gradients and AdamW's moments, "
        "more than",
    ),
    (
        "prefix n 1e9 t5",
        lambda c: c.train("--method", "prefix", "--n", "1000000000", model=c.base["t5"]),
        1,
        "GiB free on cpu",
    ),
    (
        "deep prompt n 5000",
        lambda c: c.train("--method", "deep-prompt", "--n", "5000"),
        1,
        "max_position_embeddings 1,024",
    ),
    (
        "adapter n 1e9",
        lambda c: c.eval(None, "--adapter", edit_adapter(c, n=10**9)),
        1,
        "its rows take positions 0..999,999,999",
    ),
    (
        "pooled k 1e9",
        lambda c: c.eval(None, "--method", "pooled", "--n", "1000000000"),
        1,
        "pooled instance tokens: k is 1000000000",
    ),
    (
        "seeds 1e30",
        lambda c: ["run", "--model", c.base["llama"], "--out", c.tmp / "o", "--seeds", str(10**30)],
        2,
        "must be at most 10,000",
    ),
    (
        "epochs 1e30",
        lambda c: c.train("--epochs", str(10**30)),
        1,
        "training settings: epochs is 1000000000000000000000000000000, above",
    ),
    (
        "max steps 1e30",
        lambda c: c.train("--max-steps", str(10**30)),
        1,
        "max_steps is 1000000000000000000000000000000, above",
    ),
    (
        "batch 1e30",
        lambda c: c.train("--batch-size", str(10**30)),
        1,
        "batch_size is 1000000000000000000000000000000, above",
    ),
    (
        "blocks 1e30",
        lambda c: c.train("--blocks", str(10**30)),
        1,
        "blocks is [1000000000000000000000000000000], above",
    ),
    (
        "lengths 1e30",
        lambda c: [
            "run",
            "--model",
            c.base["llama"],
            "--tasks",
            "cb",
            "--data",
            c.base["data"],
            "--out",
            c.tmp / "o",
            "--method",
            "prompt",
            "--lengths",
            str(10**30),
        ],
        1,
        "n is 1000000000000000000000000000000, above",
    ),
    (
        "t5 labels alike after normalisation",
        lambda c: c.eval(c.base["t5"], "--task", task_file(c, labels={"0": "fine", "1": "\ufb01ne", "2": "bad"})),
        1,
        "the label words 'fine' and '\ufb01ne' tokenize alike (",
    ),
    (
        "t5 labels alike by spaces",
        lambda c: c.eval(
            c.base["t5"], "--task", task_file(c, labels={"0": "very good", "1": "very  good", "2": "bad"})
        ),
        1,
        "so rank classification could never tell them apart",
    ),
    (
        "t5 labels alike in training",
        lambda c: c.train(
            "--task", task_file(c, labels={"0": "fine", "1": "\ufb01ne", "2": "bad"}), model=c.base["t5"]
        ),
        1,
        "tokenize alike",
    ),
    ("vocab below the tokenizer", lambda c: c.eval(small_vocab(c)), 1, "the tokenizer gives token ids up to 3"),
    (
        "vocab below the tokenizer says why",
        lambda c: c.eval(small_vocab(c)),
        1,
        "the tokenizer files and the checkpoint do not belong together",
    ),
    (
        "vocab below the tokenizer in training",
        lambda c: c.train(model=small_vocab(c)),
        1,
        "but the model's embedding has 300 rows",
    ),
    (
        "vocab below the tokenizer in predict",
        lambda c: predict(c, model=small_vocab(c), out=c.tmp / "p.jsonl"),
        1,
        "has 300 rows",
    ),
    (
        "pad id beyond the vocab",
        lambda c: c.eval(c.config(pad_token_id=5000)),
        1,
        "config.json: pad_token_id is 5000, but the embedding has vocab_size 360 rows",
    ),
    (
        "eos ids beyond the vocab",
        lambda c: c.eval(c.config(eos_token_id=[2, 360])),
        1,
        "eos_token_id is [2, 360], but the embedding",
    ),
    (
        "t5 start id beyond the vocab",
        lambda c: c.eval(c.config("t5", decoder_start_token_id=400)),
        1,
        "decoder_start_token_id is 400",
    ),
]


def small_vocab(case) -> Path:
    """The tiny Llama cut to 300 embedding rows (config.json and the tensor agree): its tokenizer's ids reach 359."""
    case.config(vocab_size=300)
    return case.weights(set_tensor("model.embed_tokens.weight", lambda t: t[:300].clone()))


def edit_adapter(case, **changes) -> Path:
    best = case.copy("prompt") / "best"
    json_edit(best / "adapter.json", lambda m: (m["method_config"].update(changes), m)[1])
    return best


def metrics_edit(case, edit) -> Path:
    run = unfinish(case)
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    edit(lines[0])
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return run


def halved(case) -> Path:
    """The tiny Llama with every weight halved and a byte-identical config.json."""
    return case.weights(lambda state: state.update({k: v / 2 for k, v in state.items()}))


def task_run(case, changed: str | None, spec: dict | None = None, **settings) -> Path:
    """A one-step run on a task file, then one of its files (a name under task/data) given a line more (its second,
    again), the task file's keys or the run's config.json's settings changed."""
    task = task_file(case)
    out = case.tmp / "task-run"
    assert main([str(a) for a in case.train("--task", task, out=out)]) == 0
    if changed is not None:
        file = case.tmp / "task" / "data" / changed
        file.write_bytes(file.read_bytes().splitlines(keepends=True)[1] + file.read_bytes())
    json_edit(out / "config.json", lambda c: {**c, **settings})
    if spec:
        json_edit(case.tmp / "task" / "reviews.json", lambda t: {**t, **spec})
    return out


def link(target: Path, path: Path) -> Path:
    path.symlink_to(target)
    return path


def hard_link(target: Path, path: Path) -> Path:
    os.link(target, path)
    return path


def rows(case) -> Path:
    """A file of CB rows to predict, in the case's scratch area."""
    path = case.tmp / "rows.jsonl"
    if not path.exists():
        path.write_bytes(good_rows(case, 3))
    return path


def tagged_rows(case) -> Path:
    """CB rows naming their capsule set in a "task" field (capt predict with several sets)."""
    path = case.tmp / "tagged.jsonl"
    if not path.exists():
        path.write_text(
            "".join(
                json.dumps({**json.loads(line), "task": "cb"}) + "\n"
                for line in good_rows(case, 3).decode().splitlines()
            )
        )
    return path


def predict(case, *extra, model=None, out) -> list:
    return [
        "predict",
        "--model",
        model or case.base["llama"],
        "--task",
        "cb",
        "--input",
        rows(case),
        "--out",
        out,
        "--device",
        "cpu",
        *extra,
    ]


def edit_test_json(case, **changes) -> Path:
    run = case.copy("run")
    json_edit(run / "test.json", lambda t: {**t, **changes})
    return run


def good_rows(case, n=5) -> bytes:
    """The first n rows of the good CB train file, as bytes ending in a newline."""
    return b"".join(line + b"\n" for line in (case.base["data"] / "CB" / "train.jsonl").read_bytes().split(b"\n")[:n])


def task_file(case, rows: bytes | None = None, raw: bytes | None = None, **spec) -> Path:
    """A task file in the case's scratch area (helpers.write_task); rows: its train file's bytes; raw: JSON text put
    into the task file as its first key."""
    path = write_task(case.tmp / "task", **spec)
    if rows is not None:
        (case.tmp / "task" / "data" / "train.jsonl").write_bytes(rows)
    if raw is not None:
        path.write_bytes(b"{" + raw + b", " + path.read_bytes().lstrip()[1:])
    return path


def results_json(tasks=None, settings: dict | None = {}, zero_shot=None, method="capt", weights=None, **more) -> bytes:
    """A results.json as `capt run` writes it (one CB task), with one part replaced."""
    task = {"metric": "f1", "mean": 50.0, "std": None, "n": None, "trainable_parameters": 64, "train_seconds": 1.0,
            "zero_shot": {"f1": 30.0} if zero_shot is None else zero_shot}
    results = {
        "method": method,
        "model_config_sha256": SHA,
        "base_parameters": 1000,
        "train_seconds": 1.0,
        "seeds": [0],
        "settings": settings,
        "tasks": {"cb": task} if tasks is None else tasks,
        "model_weights_sha256": weights,
        **more,
    }
    return json.dumps(results).encode()


def write(path: Path, content: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return path.parent if path.name in ("config.json", "model.safetensors.index.json", "capsules.json") else path


def remove(path: Path) -> Path:
    path.unlink()
    return path.parent


def truncate(path: Path) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path.parent


def edit_meta(case, edit) -> Path:
    best = case.copy("run") / "best"
    json_edit(best / "capsules.json", lambda m: (edit(m), m)[1])
    return best


def both_files(case) -> Path:
    best = case.copy("prompt") / "best"
    for name in ("capsules.json", "capsules.safetensors"):
        shutil.copy(case.base["run"] / "best" / name, best / name)
    return best


def unfinish(case) -> Path:
    """The one-step run with its state marked unfinished, so that --resume reads its files."""
    run = case.copy("run")
    state = torch.load(run / "state.pt", weights_only=True)
    state["train"]["finished"] = False
    torch.save(state, run / "state.pt")
    return run


class Payload:
    def __reduce__(self):
        return (os.system, ("echo pwned > /tmp/capt-pwned",))


def pickled_state(case) -> Path:
    run = case.copy("run")
    torch.save({"version": 2, "payload": Payload()}, run / "state.pt")
    return run


ALL_CASES = CASES + JSON_CASES + OUTPUT_CASES + BASE_CASES + RUN_CASES + COMMAND_CASES


def test_there_are_many_cases():
    assert len(CASES) >= 60 and len({c[0] for c in ALL_CASES}) == len(ALL_CASES)


@pytest.mark.parametrize("name, argv, status, words", ALL_CASES, ids=[c[0] for c in ALL_CASES])
def test_bad_input_is_one_line(base, tmp_path, capsys, name, argv, status, words):
    case = Case(base, tmp_path)
    args = [str(a) for a in argv(case)]
    capsys.readouterr()
    if status == 2:
        with pytest.raises(SystemExit) as e:
            main(args)
        code = e.value.code
    else:
        code = main(args)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == status, (name, err)
    if status == 2:  # argparse: usage line, then the one error line
        assert lines[-1].startswith("capt") and "error:" in lines[-1] and words in lines[-1], err
    else:  # progress lines may come first; the error is the last line, and the only one
        errors = [line for line in lines if line.startswith("capt:")]
        assert len(errors) == 1 and lines[-1] == errors[0] and errors[0].startswith("capt: error: "), err
        assert words in errors[0], (words, errors[0])
    assert "Traceback" not in err and "internal error" not in err
    assert not Path("/tmp/capt-pwned").exists()


# ---------------------------------------------------------------------------------------------
# Failures that need more than one call


def test_an_output_over_an_input_leaves_every_file_as_it_was(base, tmp_path, capsys):
    """The two data-loss cases: `train --out` the checkpoint, `predict --out` its own input."""
    case = Case(base, tmp_path)
    model = case.model()
    before = {f.name: f.read_bytes() for f in model.iterdir()}
    for argv in (
        case.train(model=model, out=model),
        ["run", "--model", model, "--tasks", "cb", "--data", base["data"], "--out", model],
        predict(case, model=model, out=model / "config.json"),
    ):
        assert main([str(a) for a in argv]) == 1
    assert {f.name: f.read_bytes() for f in model.iterdir()} == before
    load_model(model)
    text = rows(case).read_bytes()
    assert main([str(a) for a in predict(case, out=rows(case))]) == 1 and rows(case).read_bytes() == text
    capsys.readouterr()


def test_any_base_uses_the_tensors_with_one_warning(base, tmp_path, capsys):
    case = Case(base, tmp_path)
    for argv in (
        case.eval(halved(case), "--capsules", base["run"], "--any-base"),
        [
            "eval",
            "--model",
            halved(case),
            "--task",
            "cb",
            "--data",
            base["data"],
            "--capsules",
            f"cb={base['run']}",
            "--any-base",
        ],
    ):
        assert main([str(a) for a in argv]) == 0
        warned = [line for line in capsys.readouterr().err.splitlines() if line.startswith("capt:")]
        assert len(warned) == 1 and warned[0].startswith("capt: warning: capsules") and "weights_sha256" in warned[0], (
            warned
        )
    with pytest.warns(CaptWarning, match="used anyway, as asked"):
        load_model(halved(case), capsules=base["run"] / "best", any_base=True)


def test_files_made_before_the_weights_hash_still_load_and_resume(base, tmp_path, capsys):
    """capsules.json without weights_sha256 and a run's config.json without model_weights_sha256 or data_files."""
    run = unfinish(Case(base, tmp_path))
    json_edit(run / "best" / "capsules.json", lambda m: (m["base_model"].pop("weights_sha256"), m)[1])
    json_edit(
        run / "config.json", lambda c: {k: v for k, v in c.items() if k not in ("model_weights_sha256", "data_files")}
    )
    assert load_model(base["llama"], capsules=run / "best").method.method == "capt"
    assert main(["train", "--out", str(run), "--resume"]) == 0
    capsys.readouterr()


def test_a_byte_order_mark_opening_a_json_file_is_read(base, tmp_path):
    """Some editors write one first: config.json, a task file and a JSONL file's first line take it."""
    case = Case(base, tmp_path)
    model = case.model()
    (model / "config.json").write_bytes(b"\xef\xbb\xbf" + (model / "config.json").read_bytes())
    load_model(model)
    data = case.data(content=b"\xef\xbb\xbf" + good_rows(case))
    assert (
        len(load_task("cb", data, "test")) == 12
        and len(load_task("cb", data, "train")) + len(load_task("cb", data, "validation")) == 5
    )
    path = task_file(case)
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    assert len(load_task(str(path), None, "test")) == 12


def test_the_weights_fingerprint_is_the_files_sha256_and_is_remembered(base, tmp_path, monkeypatch):
    model = Case(base, tmp_path).model()
    file = model / "model.safetensors"
    assert weights_fingerprint(model) == hashlib.sha256(file.read_bytes()).hexdigest()  # what sha256sum prints
    monkeypatch.setenv("CAPT_CACHE", str(tmp_path / "cache"))
    old = time.time_ns() - 10**10  # a file changed just now is not remembered (its mtime may not tell a rewrite)
    os.utime(file, ns=(old, old))
    first = weights_fingerprint(model)
    assert (tmp_path / "cache" / "weights-sha256.json").is_file()
    reads = []
    real_open = open
    monkeypatch.setattr("builtins.open", lambda f, *a, **k: (reads.append(str(f)), real_open(f, *a, **k))[1])
    assert weights_fingerprint(model) == first and not [r for r in reads if r.endswith(".safetensors")]
    monkeypatch.undo()
    monkeypatch.setenv("CAPT_CACHE", str(tmp_path / "cache"))
    inode, size = file.stat().st_ino, file.stat().st_size
    with open(file, "r+b") as f:  # rewritten in place: the same inode and size, the old mtime set back
        f.seek(size - 1)
        last = f.read(1)
        f.seek(size - 1)
        f.write(bytes([last[0] ^ 1]))
    os.utime(file, ns=(old, old))
    assert (file.stat().st_ino, file.stat().st_size, file.stat().st_mtime_ns) == (inode, size, old)
    assert weights_fingerprint(model) == hashlib.sha256(file.read_bytes()).hexdigest() != first  # ctime told it
    halved(Case(base, tmp_path))  # rewritten: another size, mtime or inode, hashed again
    assert weights_fingerprint(model) != first
    (tmp_path / "cache" / "weights-sha256.json").write_text("[damaged")
    assert weights_fingerprint(model) == hashlib.sha256(file.read_bytes()).hexdigest()
    shards = index_with(Case(base, tmp_path / "shards"), "b.safetensors")
    lines = "".join(
        f"{hashlib.sha256((shards / n).read_bytes()).hexdigest()}  {n}\n" for n in ("a.safetensors", "b.safetensors")
    )
    assert weights_fingerprint(shards) == hashlib.sha256(lines.encode()).hexdigest()


def test_an_unwritable_cache_only_costs_the_reading(base, tmp_path, monkeypatch):
    monkeypatch.setenv("CAPT_CACHE", str(write(tmp_path / "file", b"not a directory")))
    model = Case(base, tmp_path).model()
    assert weights_fingerprint(model) == hashlib.sha256((model / "model.safetensors").read_bytes()).hexdigest()


def test_nan_tensors_are_never_saved(base, tmp_path):
    model = load_model(base["llama"], capsules=base["run"] / "best")
    with torch.no_grad():
        model.model.layers[1].capsule.fill_(float("nan"))
    with pytest.raises(
        CaptError,
        match=r"^layers.1 holds NaN or infinite values, so it is not written to .*out; the tensors have diverged$",
    ):
        save_capsules(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_held_run_directory_is_refused_with_the_holders_pid(base, tmp_path, capsys):
    run = Case(base, tmp_path).copy("run")
    holder = lock_run(run)
    try:
        code = main(["train", "--out", str(run), "--resume"])
        err = capsys.readouterr().err
        assert (
            code == 1 and f"is in use by another capt process (pid {os.getpid()})" in err and len(err.splitlines()) == 1
        )
        code = main(
            [
                "run",
                "--model",
                str(base["llama"]),
                "--tasks",
                "cb",
                "--data",
                str(base["data"]),
                "--out",
                str(run),
                *FAST,
            ]
        )
        assert code == 1 and "is in use by another capt process" in capsys.readouterr().err
    finally:
        holder.close()
    assert main(["train", "--out", str(run), "--resume"]) == 0  # released: the finished run is reused


def test_two_processes_on_one_out(base, tmp_path):
    """The second of two concurrent `capt train` on one --out stops at once with one line, the first
    one's files untouched; SIGTERM then stops the first, which saves its state."""
    out = tmp_path / "out"
    argv = [
        sys.executable,
        "-m",
        "capt",
        "train",
        "--model",
        str(base["llama"]),
        "--task",
        "cb",
        "--data",
        str(base["data"]),
        "--out",
        str(out),
        "--epochs",
        "500",
        "--patience",
        "500",
        *FAST,
    ]
    first = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while not (out / "state.pt").exists() and time.time() < deadline:
            time.sleep(0.05)
        second = subprocess.run(argv[:-6] + ["--epochs", "2", *FAST], capture_output=True, text=True, timeout=60)
        assert first.poll() is None, "the first run ended before the second tried"
        assert second.returncode == 1 and f"in use by another capt process (pid {first.pid})" in second.stderr
        assert len([line for line in second.stderr.splitlines() if line.strip()]) == 1
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=60)
    finally:
        first.kill()
    assert first.returncode == 130, err
    assert json.loads((out / "config.json").read_text())["epochs"] == 500  # the first run's settings, not the second's


def test_sigterm_saves_the_state_and_the_run_resumes(base, tmp_path):
    out = tmp_path / "out"
    argv = [
        sys.executable,
        "-m",
        "capt",
        "train",
        "--model",
        str(base["llama"]),
        "--task",
        "cb",
        "--data",
        str(base["data"]),
        "--out",
        str(out),
        "--epochs",
        "12",
        "--patience",
        "12",
        *FAST,
    ]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not (out / "metrics.jsonl").exists() and time.time() < deadline:  # training is under way
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    last = [line for line in err.splitlines() if line.strip()][-1]
    assert "interrupted at step" in last and f"continue with: capt train --out {out} --resume" in last
    state = torch.load(out / "state.pt", weights_only=True)
    assert not state["train"]["finished"] and state["train"]["step"] > 0
    # settings are kept
    assert main(["train", "--out", str(out), "--resume", "--max-steps", str(state["train"]["step"])]) == 1
    assert main(["train", "--out", str(out), "--resume"]) == 0
    assert json.loads((out / "test.json").read_text())["steps"] > state["train"]["step"]


def test_a_full_disk_is_one_line_and_keeps_the_previous_file(tmp_path, monkeypatch):
    target = tmp_path / "state.pt"
    target.write_bytes(b"previous")

    def no_space(tmp):  # torch.save's own words when the disk fills
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0")

    monkeypatch.setattr(load_module, "_free_bytes", lambda directory: 0)
    with pytest.raises(
        CaptError, match=r"^could not write .*state.pt: the disk is full; the previous state.pt, if any, is kept$"
    ):
        load_module.atomic_write(target, no_space)
    monkeypatch.undo()

    def enospc(tmp):
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(CaptError, match="the disk is full"):
        load_module.atomic_write(target, enospc)
    # no temporary file left
    assert target.read_bytes() == b"previous" and [p.name for p in tmp_path.iterdir()] == ["state.pt"]
    with pytest.raises(RuntimeError, match="a bug"):  # other errors are not disguised as a full disk
        load_module.atomic_write(target, lambda tmp: (_ for _ in ()).throw(RuntimeError("a bug")))


def test_stale_temporary_files_are_removed_on_the_next_start(base, tmp_path):
    run = Case(base, tmp_path).copy("run")
    stale = [run / ".state.pt.k2j3h4.tmp", run / "best" / ".capsules.safetensors.abc.tmp"]
    for file in stale:
        file.write_bytes(b"half")
    keep = run / "notes.tmp"
    keep.write_bytes(b"mine")
    assert main(["train", "--out", str(run), "--resume"]) == 0
    assert not any(f.exists() for f in stale) and keep.exists()


def test_mixed_dtypes_need_a_dtype(base, tmp_path):
    model = Case(base, tmp_path).weights(set_tensor(NORM, lambda t: t.half()))
    with pytest.raises(
        CaptError,
        match=r"mixes tensor dtypes: float32 .*float16 \(model.norm.weight\); load it with dtype fp32 or bf16",
    ):
        load_model(model)
    assert load_model(model, dtype="fp32").model.norm.weight.dtype == torch.float32  # the CLI always gives one
    with pytest.raises(CaptError, match="dtype torch.int8 is not one capt computes in"):
        load_model(model, dtype=torch.int8)
    with pytest.raises(CaptError, match="device 'mps' is not supported"):
        load_model(model, dtype="fp32", device="mps")


def test_permission_denied_says_so(base, tmp_path, monkeypatch):
    """Root reads every file, so the refusal is simulated: the words must be "permission denied", not "no such file"."""
    model = Case(base, tmp_path).model()
    real = os.access
    monkeypatch.setattr(
        os, "access", lambda path, mode: False if str(path).endswith(".safetensors") else real(path, mode)
    )
    with pytest.raises(CaptError, match=r"^cannot read .*model.safetensors: permission denied$"):
        load_model(model)
    monkeypatch.undo()
    real_read = Path.read_bytes

    def refuse(self):
        if self.name == "config.json":
            raise PermissionError(13, "Permission denied", str(self))
        return real_read(self)

    monkeypatch.setattr(Path, "read_bytes", refuse)
    with pytest.raises(CaptError, match=r"^cannot read .*config.json: permission denied$"):
        load_model(model)


def test_the_last_resort_is_one_line(monkeypatch, capsys):
    def broken(args):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr("capt.cli.main.cmd_compare", broken)
    monkeypatch.delenv("CAPT_DEBUG", raising=False)
    assert main(["compare", "x"]) == 1
    err = capsys.readouterr().err
    assert (
        err.strip()
        == "capt: internal error: ZeroDivisionError: division by zero (set CAPT_DEBUG=1 to see the traceback)"
    )
    monkeypatch.setenv("CAPT_DEBUG", "1")
    with pytest.raises(ZeroDivisionError):
        main(["compare", "x"])


def test_a_nan_evaluation_is_an_error_not_a_score(base, tmp_path, capsys):
    best = capsule_edit(Case(base, tmp_path), set_tensor("layers.0", lambda t: t * 0))
    model = load_model(base["llama"], capsules=best)
    with torch.no_grad():
        model.model.layers[0].capsule.fill_(float("nan"))  # in memory: the file check cannot see this
    with pytest.raises(NonFiniteScores, match="scores are NaN or infinite for 12 of 12 examples"):
        evaluate(model, load_tokenizer(base["llama"]), load_task("cb", base["data"], "test"))


def test_a_diverging_run_never_keeps_a_nan_best(base, tmp_path, capsys, monkeypatch):
    """A step that makes the capsules NaN (as a rate far too large does) ends the run in one line, and best/
    holds the last finite capsules. (A large --lr alone no longer gets there: rates that overflow fp32 are
    refused up front, and Adam moves a tensor by at most about the rate per step.)"""
    step, calls = torch.optim.AdamW.step, []

    def poisoned(self, *args, **kwargs):
        out = step(self, *args, **kwargs)
        calls.append(1)
        if len(calls) >= 7:  # after the first validation (5 steps an epoch)
            for group in self.param_groups:
                for p in group["params"]:
                    p.data.fill_(float("nan"))
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", poisoned)
    out = tmp_path / "out"
    code = main(["train", "--model", str(base["llama"]), "--task", "cb", "--data", str(base["data"]), "--out", str(out),
                 "--epochs", "3", *FAST])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("capt:")][-1]
    assert code == 1 and ("training loss became" in err or "validation scores became NaN or infinite" in err), err
    tensors = load_file(out / "best" / "capsules.safetensors")
    assert all(bool(torch.isfinite(t).all()) for t in tensors.values())


def test_a_rate_beyond_fp32_is_refused_before_training(base, tmp_path, capsys, monkeypatch):
    code = main(["train", "--model", str(base["llama"]), "--task", "cb", "--data", str(base["data"]), "--out",
                 str(tmp_path / "plain"), "--lr", "1e300", "--step-scale", "none", "--epochs", "1", *FAST])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 1 and "the learning rate must be a positive number below 3.4e+37, got 1e+300" in err, err
    # under the step scale the largest block rate counts: a model whose blocks measure 1e30 takes no r of 1e8
    monkeypatch.setattr(trainer_module, "block_input_rms", lambda model, batches: [1e30] * len(model.capsule_blocks()))
    code = main(["train", "--model", str(base["llama"]), "--task", "cb", "--data", str(base["data"]), "--out",
                 str(tmp_path / "rms"), "--lr", "1e8", "--epochs", "1", *FAST])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 1 and "the learning rate 1e+08 times the largest step scale 1e+30 is above 3.4e+37" in err, err


# ---------------------------------------------------------------------------------------------
# The Python API: every argument a caller can get wrong is one CaptError line naming it


@pytest.fixture(scope="module")
def api(base):
    return {"llama": load_model(base["llama"]), "t5": load_model(base["t5"]), "run": base["run"], "path": base["llama"],
            "tokenizer": load_tokenizer(base["llama"]), "examples": load_task("cb", base["data"], "test")[:2]}


IDS = torch.tensor([[1, 5, 7, 9], [1, 4, 4, 2]])  # (2, 4) ids the tiny models know (vocabularies of 360 and 400)
DEC = torch.tensor([[0, 5], [0, 6]])
L, T5 = (lambda a: a["llama"]), (lambda a: a["t5"])

# (id, call on the `api` fixture, words the one line must hold)
API_CASES = [
    (
        "mask shape",
        lambda a: L(a)(IDS, attention_mask=torch.ones(2, 3)),
        "attention_mask has shape (2, 3), but the ids give (2, 4)",
    ),
    (
        "prompt mask shape",
        lambda a: L(a)(IDS, prompt_mask=torch.ones(3, 4)),
        "prompt_mask has shape (3, 4), but the ids give (2, 4)",
    ),
    (
        "mask a list",
        lambda a: L(a)(IDS, attention_mask=[[1] * 4] * 2),
        "attention_mask must be a torch tensor of shape (2, 4), not list",
    ),
    (
        "mask complex",
        lambda a: L(a)(IDS, attention_mask=torch.ones(2, 4, dtype=torch.complex64)),
        "attention_mask holds complex values",
    ),
    (
        "logits_at beyond",
        lambda a: L(a)(IDS, logits_at=torch.tensor([[4], [0]])),
        "logits_at holds positions from 0 to 4, but the sequence has 0..3",
    ),
    (
        "logits_at negative",
        lambda a: L(a)(IDS, logits_at=torch.tensor([[-1], [0]])),
        "logits_at holds positions from -1 to 0",
    ),
    (
        "logits_at float",
        lambda a: L(a)(IDS, logits_at=torch.tensor([[1.0], [0.0]])),
        "logits_at holds float32 values; positions are integers",
    ),
    (
        "logits_at 1-D",
        lambda a: L(a)(IDS, logits_at=torch.tensor([1, 0])),
        "logits_at has shape (2,); it must be (2, K)",
    ),
    (
        "logits_at other batch",
        lambda a: L(a)(IDS, logits_at=torch.zeros(3, 1, dtype=torch.long)),
        "logits_at has shape (3, 1); it must be (2, K)",
    ),
    (
        "hidden_at beyond",
        lambda a: L(a).features(IDS, hidden_at=torch.tensor([[9], [0]])),
        "hidden_at holds positions from 0 to 9",
    ),
    (
        "ids beyond the vocab",
        lambda a: L(a)(torch.tensor([[1, 999]])),
        "input_ids holds ids from 1 to 999, but the vocabulary has ids 0..359",
    ),
    ("ids negative", lambda a: L(a)(torch.tensor([[-3, 1]])), "input_ids holds ids from -3 to 1"),
    ("ids float", lambda a: L(a)(IDS.float()), "input_ids holds float32 values; token ids are integers (torch.long)"),
    ("ids bool", lambda a: L(a)(IDS > 3), "input_ids holds bool values"),
    (
        "ids 1-D",
        lambda a: L(a)(IDS[0]),
        "input_ids has shape (4,); it must be (batch, tokens): a 1-D sequence is ids[None]",
    ),
    ("ids 3-D", lambda a: L(a)(IDS[None]), "input_ids has shape (1, 2, 4)"),
    ("ids a list", lambda a: L(a)([[1, 2]]), "input_ids must be a torch tensor of token ids (B, T), not list"),
    (
        "cache of other rows",
        lambda a: L(a)(IDS, cache=L(a).new_cache(3, 10)),
        "the cache holds 3 rows, but input_ids has 2",
    ),
    (
        "generate 2.5 tokens",
        lambda a: L(a).generate(IDS, max_new_tokens=2.5),
        "max_new_tokens must be a whole number from 0, got 2.5",
    ),
    (
        "generate True tokens",
        lambda a: L(a).generate(IDS, max_new_tokens=True),
        "max_new_tokens must be a whole number from 0, got True",
    ),
    ("generate -1 tokens", lambda a: L(a).generate(IDS, max_new_tokens=-1), "got -1"),
    ("generate text tokens", lambda a: L(a).generate(IDS, max_new_tokens="3"), "got '3'"),
    (
        "generate mask shape",
        lambda a: L(a).generate(IDS, attention_mask=torch.ones(2, 5)),
        "attention_mask has shape (2, 5)",
    ),
    ("generate float ids", lambda a: L(a).generate(IDS.double()), "input_ids holds float64 values"),
    (
        "t5 decoder ids beyond",
        lambda a: T5(a)(IDS, decoder_input_ids=torch.tensor([[0, 999], [0, 1]])),
        "decoder_input_ids holds ids from 0 to 999, but the vocabulary has ids 0..399",
    ),
    (
        "t5 decoder ids float",
        lambda a: T5(a)(IDS, decoder_input_ids=DEC.float()),
        "decoder_input_ids holds float32 values",
    ),
    (
        "t5 decoder mask shape",
        lambda a: T5(a)(IDS, decoder_input_ids=DEC, decoder_attention_mask=torch.ones(2, 3)),
        "decoder_attention_mask has shape (2, 3), but the ids give (2, 2)",
    ),
    (
        "t5 mask shape",
        lambda a: T5(a)(IDS, attention_mask=torch.ones(2, 5), decoder_input_ids=DEC),
        "attention_mask has shape (2, 5)",
    ),
    (
        "t5 logits_at beyond",
        lambda a: T5(a)(IDS, decoder_input_ids=DEC, logits_at=torch.tensor([[2], [0]])),
        "logits_at holds positions from 0 to 2",
    ),
    (
        "t5 ids beyond",
        lambda a: T5(a).encode(torch.tensor([[400]])),
        "input_ids holds ids from 400 to 400, but the vocabulary has ids 0..399",
    ),
    ("t5 ids 1-D", lambda a: T5(a).encode(IDS[0]), "input_ids has shape (4,)"),
    (
        "t5 generate 2.5",
        lambda a: T5(a).generate(IDS, max_new_tokens=2.5),
        "max_new_tokens must be a whole number from 0, got 2.5",
    ),
    (
        "load_model None",
        lambda a: load_model(None),
        "load_model: path must be a checkpoint directory or a hub id ORG/NAME, not NoneType",
    ),
    (
        "load_model capsules 123",
        lambda a: load_model(a["path"], capsules=123),
        "capsules must be a CapsuleConfig, a directory of saved",
    ),
    ("load_model capsules list", lambda a: load_model(a["path"], capsules=[a["run"]]), "not list"),
    (
        "load_method None",
        lambda a: load_method(L(a), None),
        "a saved method is a directory (str or path), not NoneType",
    ),
    (
        "capsule set 5",
        lambda a: load_model(a["path"], capsules={"cb": 5}),
        "capsule set 'cb': give a directory written by save_capsules",
    ),
    ("pooled k -1", lambda a: set_pooled(L(a), -1), "pooled instance tokens: k is -1"),
    ("pooled k 2.5", lambda a: set_pooled(L(a), 2.5), "k is 2.5, but it must be a whole number"),
    (
        "train settings text",
        lambda a: TrainConfig(model=str(a["path"]), task="cb", out="o", max_steps="1"),
        "training settings: max_steps is '1' (str), but it must be int | None",
    ),
    (
        "train settings bool seed",
        lambda a: TrainConfig(model=str(a["path"]), task="cb", out="o", seed=True),
        "seed is True (bool)",
    ),
    (
        "train settings float epochs",
        lambda a: TrainConfig(model=str(a["path"]), task="cb", out="o", epochs=2.5),
        "epochs is 2.5 (float)",
    ),
    (
        "empty batch",
        lambda a: T5(a)(IDS[:0], decoder_input_ids=DEC[:0]),
        "input_ids has shape (0, 4): a batch of no rows",
    ),
    (
        "generate temperature none",
        lambda a: L(a).generate(IDS, do_sample=True, temperature=None),
        "temperature",
    ),
    (
        "generate temperature text",
        lambda a: L(a).generate(IDS, do_sample=True, temperature="hot"),
        "temperature must be a number, got 'hot'",
    ),
    ("generate top_p text", lambda a: T5(a).generate(IDS, top_p="x"), "top_p must be a number, got 'x'"),
    (
        "generate eos text",
        lambda a: L(a).generate(IDS, eos_token_id="</s>"),
        "eos_token_id must be a token id, a list of them or None",
    ),
    (
        "evaluate a string",
        lambda a: evaluate(L(a), a["tokenizer"], "cb"),
        "examples must be a list of capt.tasks.Example",
    ),
    (
        "evaluate batch 2.5",
        lambda a: evaluate(L(a), a["tokenizer"], a["examples"], batch_size=2.5),
        "batch_size must be a whole number from 1, got 2.5",
    ),
    (
        "evaluate max_length text",
        lambda a: evaluate(L(a), a["tokenizer"], a["examples"], max_length="64"),
        "max_length must be a whole number from 1, got '64'",
    ),
    (
        "evaluate cue text",
        lambda a: evaluate(L(a), a["tokenizer"], a["examples"], answer_cue="yes"),
        "answer_cue must be True, False or None",
    ),
    (
        "predict batch 0",
        lambda a: predict_rows(L(a), a["tokenizer"], a["examples"], batch_size=0),
        "batch_size must be a whole number from 1",
    ),
    (
        "evaluate tasks a string",
        lambda a: evaluate_tasks(L(a), a["tokenizer"], "cb"),
        "examples of several tasks are {name: list of Examples}",
    ),
    (
        "attach n text",
        lambda a: attach(load_model(a["path"]), "prompt", n="x"),
        "prompt's n (vectors per place) must be a whole number from 1, got 'x'",
    ),
    ("attach n 2.5", lambda a: attach(load_model(a["path"]), "prefix", n=2.5), "got 2.5"),
    (
        "attach classes text",
        lambda a: attach(load_model(a["path"]), "linear-head", num_classes="3"),
        "num_classes must be a whole number from 2",
    ),
    (
        "attach capsules text",
        lambda a: attach(load_model(a["path"]), "capt", capsules="odd"),
        "capsule must be a CapsuleConfig (or its dict), not str",
    ),
    (
        "stop_after text",
        lambda a: train(TrainConfig(model=str(a["path"]), task="cb", out="o"), stop_after="2"),
        "stop_after must be a whole number from 0, got '2'",
    ),
    (
        "tokenizer None",
        lambda a: load_tokenizer(None),
        "the model must be a checkpoint directory or a hub id ORG/NAME (a string or path), not NoneType",
    ),
    ("data dir 5", lambda a: load_task("cb", 5), "the data directory must be a path (str or path), not int"),
]


@pytest.mark.parametrize("name, call, words", API_CASES, ids=[c[0] for c in API_CASES])
def test_bad_api_arguments_are_one_line(api, name, call, words):
    with pytest.raises(CaptError) as e:
        call(api)
    assert words in str(e.value) and "\n" not in str(e.value), (words, str(e.value))


def test_good_api_calls_still_work(api):
    assert L(api)(IDS, attention_mask=torch.ones(2, 4, dtype=torch.long), logits_at=torch.tensor([[3], [0]])).shape == (
        2,
        1,
        360,
    )
    assert L(api)(IDS, attention_mask=torch.ones(2, 4)).shape == (2, 4, 360)  # float masks, as transformers takes them
    assert L(api)(IDS.int()).shape == (2, 4, 360) and L(api).generate(IDS, max_new_tokens=0).shape == (2, 4)
    assert T5(api)(IDS, decoder_input_ids=DEC, logits_at=torch.tensor([[1], [0]])).shape == (2, 1, 400)
    assert T5(api).generate(IDS, max_new_tokens=2).shape[0] == 2


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    shape=st.lists(st.integers(0, 3), min_size=0, max_size=3),
    dtype=st.sampled_from([torch.long, torch.int32, torch.float32, torch.bool]),
    low=st.integers(-5, 400),
    mask=st.none() | st.lists(st.integers(0, 3), min_size=1, max_size=3),
    at=st.none() | st.lists(st.integers(-2, 5), min_size=1, max_size=4),
    family=st.sampled_from(["llama", "t5"]),
    new=st.none() | st.integers(-2, 3) | st.floats(0, 3),
)
def test_random_api_arguments_work_or_fail_in_one_line(api, shape, dtype, low, mask, at, family, new):
    ids = (torch.arange(int(torch.tensor(shape).prod())) + low).reshape(shape).to(dtype)
    attention = None if mask is None else torch.ones(mask)
    positions = None if at is None else torch.tensor(at)[None].expand(ids.shape[0] if ids.dim() else 1, -1)
    model = api[family]
    try:
        with torch.no_grad():
            if new is not None:
                model.generate(ids, attention_mask=attention, max_new_tokens=new)
            elif family == "llama":
                model(ids, attention_mask=attention, logits_at=positions)
            else:
                model(ids, attention_mask=attention, decoder_input_ids=ids, logits_at=positions)
    except CaptError as e:
        assert "\n" not in str(e)


# ---------------------------------------------------------------------------------------------
# Random configs and random bytes


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=5,
)
LLAMA_KEYS = [
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "tie_word_embeddings",
    "attention_bias",
    "eos_token_id",
    "model_type",
    "hidden_act",
]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(changes=st.dictionaries(st.sampled_from(LLAMA_KEYS), JSON | st.integers(0, 4096), min_size=1, max_size=3))
def test_random_config_values_load_or_fail_in_one_line(base, tmp_path_factory, changes):
    model = tmp_path_factory.mktemp("cfg") / "m"
    shutil.copytree(base["llama"], model)
    config = json.loads((model / "config.json").read_text())
    config.update(changes)
    try:
        text = json.dumps(config)
    except ValueError:
        return
    (model / "config.json").write_text(text)
    try:
        load_model(model)
    except CaptError as e:
        assert "\n" not in str(e)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(st.binary(max_size=60) | JSON.map(lambda v: json.dumps(v).encode()), min_size=1, max_size=4))
def test_random_bytes_in_data_rows_load_or_fail_in_one_line(base, tmp_path_factory, rows):
    data = tmp_path_factory.mktemp("rows")
    shutil.copytree(base["data"], data, dirs_exist_ok=True)
    good = (base["data"] / "CB" / "train.jsonl").read_bytes().split(b"\n")[:5]
    (data / "CB" / "train.jsonl").write_bytes(b"\n".join(good + [r.replace(b"\n", b" ") for r in rows]))
    try:
        load_task("cb", data, "train")
    except CaptError as e:
        assert "\n" not in str(e)


# Every JSON file capt reads, with random values where it reads them (surrogate halves and huge integers included):
# it loads, or it fails in one CaptError line; never a raw exception.
VALUES = JSON | st.just("\ud800") | st.integers(-2**200, 2**200) | st.just(10**5000 - 1)


def dumped(value: dict) -> bytes:
    """value as JSON bytes; an integer over Python's 4,300-digit limit written out as another program would."""
    huge = {}

    def mark(v):
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > 10**4000:
            huge[f"@{len(huge)}@"] = b"9" * 5000
            return f"@{len(huge) - 1}@"
        if isinstance(v, dict):
            return {k: mark(x) for k, x in v.items()}
        return [mark(x) for x in v] if isinstance(v, list) else v

    text = json.dumps(mark(value)).encode()
    for name, digits in huge.items():
        text = text.replace(json.dumps(name).encode(), digits)
    return text


def loads_or_one_line(call) -> None:
    try:
        call()
    except CaptError as e:
        assert "\n" not in str(e) and str(e)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    part=st.sampled_from(["capsule_config", "base_model", "inputs", None]),
    key=st.text(max_size=4)
    | st.sampled_from(
        [
            "integration",
            "blocks",
            "init",
            "model_type",
            "hidden_size",
            "num_layers",
            "config_sha256",
            "weights_sha256",
            "max_length",
            "answer_cue",
        ]
    ),
    value=VALUES,
)
def test_random_capsules_json_loads_or_fails_in_one_line(base, tmp_path_factory, part, key, value):
    best = tmp_path_factory.mktemp("caps") / "best"
    shutil.copytree(base["run"] / "best", best)
    meta = json.loads((best / "capsules.json").read_text())
    if part is None:
        meta[key] = value
    elif isinstance(meta.get(part), dict):
        meta[part][key] = value
    else:
        meta[part] = value
    (best / "capsules.json").write_bytes(dumped(meta))
    loads_or_one_line(lambda: load_model(base["llama"], capsules=best))
    loads_or_one_line(lambda: load_model(base["llama"], capsules={"cb": best}))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    changes=st.dictionaries(
        st.sampled_from(
            ["name", "train", "validation", "test", "template", "label_field", "labels", "metric", "shorten"]
        ),
        VALUES,
        min_size=1,
        max_size=2,
    )
)
def test_random_task_files_load_or_fail_in_one_line(base, tmp_path_factory, changes):
    path = write_task(tmp_path_factory.mktemp("task"))
    path.write_bytes(dumped({**json.loads(path.read_text()), **changes}))
    loads_or_one_line(lambda: [load_task(str(path), None, split) for split in ("train", "validation", "test")])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    key=st.sampled_from(
        ["bos_token", "eos_token", "pad_token", "add_bos_token", "add_eos_token", "chat_template", "other"]
    ),
    value=VALUES,
)
def test_random_tokenizer_configs_load_or_fail_in_one_line(base, tmp_path_factory, key, value):
    model = tmp_path_factory.mktemp("tok") / "m"
    shutil.copytree(base["llama"], model)
    (model / "tokenizer_config.json").write_bytes(
        dumped({**json.loads((model / "tokenizer_config.json").read_text()), key: value})
    )
    loads_or_one_line(lambda: load_tokenizer(model).encode("cb hypothesis: the man fell."))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    changes=st.dictionaries(
        st.sampled_from(
            [
                "step",
                "epoch",
                "pos",
                "n_evals",
                "bad",
                "loss_n",
                "last_eval_step",
                "loss_sum",
                "elapsed",
                "finished",
                "stopped",
                "best",
            ]
        ),
        VALUES | st.integers(-3, 3) | st.floats(allow_nan=True),
        min_size=1,
        max_size=3,
    )
)
def test_random_training_states_are_read_or_refused_in_one_line(base, tmp_path_factory, changes):
    run = tmp_path_factory.mktemp("state")
    state = torch.load(base["run"] / "state.pt", weights_only=True)
    state["train"].update(changes)
    torch.save(state, run / "state.pt")
    tensors = {k: torch.zeros(32) for k in ("layers.0", "layers.1")}
    loads_or_one_line(lambda: read_state(run, "cb", tensors, state["train"], (1, 50, 5)))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    changes=st.dictionaries(
        st.sampled_from(
            [
                "epochs",
                "batch_size",
                "lr",
                "warmup",
                "max_steps",
                "seed",
                "blocks",
                "method",
                "n",
                "step_scale",
                "answer_cue",
                "step_scales",
                "data_files",
                "model_weights_sha256",
                "max_length",
                "dtype",
            ]
        ),
        VALUES,
        min_size=1,
        max_size=2,
    )
)
def test_random_run_settings_resume_or_fail_in_one_line(base, tmp_path_factory, changes, capsys):
    run = tmp_path_factory.mktemp("settings") / "run"
    shutil.copytree(base["run"], run)
    (run / "config.json").write_bytes(dumped({**json.loads((run / "config.json").read_text()), **changes}))
    main(["train", "--out", str(run), "--resume"])
    err = capsys.readouterr().err
    assert "internal error" not in err and "Traceback" not in err, err


def test_the_argument_checks_read_no_values_off_the_cpu_or_under_compile():
    """On a GPU a value read would wait for the device (a sync in every step): the checks read values only on the
    CPU and only outside torch.compile (a read would break its graph). A meta tensor stands in for a GPU one here;
    tests/test_gpu.py checks CUDA itself."""
    ids = torch.full((2, 4), 10**6, dtype=torch.long, device="meta")  # out of range, but unread
    check_ids(ids, "input_ids", 360)
    check_mask(torch.ones(2, 4, device="meta"), "attention_mask", (2, 4))
    check_positions(torch.full((2, 1), 99, device="meta", dtype=torch.long), "logits_at", 2, 4)
    with pytest.raises(CaptError, match="input_ids holds float32 values"):  # shapes and dtypes are checked everywhere
        check_ids(ids.float(), "input_ids", 360)

    def checked(ids, at):
        check_ids(ids, "input_ids", 360)
        check_positions(at, "logits_at", 2, 4)
        return ids + at

    compiled = torch.compile(checked, backend="eager", fullgraph=True)  # fullgraph: a value read would fail here
    assert compiled(torch.full((2, 4), 10**6), torch.full((2, 1), 99)).shape == (2, 4)


def test_a_bad_local_rank_is_one_line(monkeypatch):
    """torchrun sets LOCAL_RANK; a hand-set one that is not a whole number is named, not a bare ValueError."""
    from capt import distributed

    assert distributed.local_rank("3") == 3
    for bad in ("x", "-1", "1.5", ""):
        with pytest.raises(CaptError, match=rf"^LOCAL_RANK is '{bad}', not a whole number from 0"):
            distributed.local_rank(bad)


def test_capsules_without_a_block_are_one_line(base, tmp_path):
    """capt.hf counts a capsules file's blocks from its tensors when capsules.json has no num_layers: a file with
    no layers.I tensor is refused by name, not with a bare max() of nothing."""
    pytest.importorskip("transformers")
    from capt.hf import read_capsules

    best = tmp_path / "best"
    shutil.copytree(base["run"] / "best", best)
    json_edit(best / "capsules.json", lambda m: (m["base_model"].pop("num_layers", None), m)[1])
    save_file({"other": torch.zeros(2)}, best / "capsules.safetensors")
    with pytest.raises(CaptError, match=r"capsules.safetensors holds no capsule \(no layers.I tensor\)"):
        read_capsules(best)
