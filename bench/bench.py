"""Speed of capt against the same method written on Hugging Face transformers, in one process.

What runs (docs/bench.md is the protocol):

  workloads  t5-base, t5-large (32 x 256 encoder tokens, 8 decoder tokens), llama-3.2-1b,
             qwen2.5-1.5b (16 x 256 tokens, the answer = the last 8), random weights, frozen
  modes      train: forward + backward + AdamW step on the capsules only
             eval:  forward scoring, no grad (T5: 2 candidate targets per input; decoder-only:
                    each sequence's answer tokens)
  dtypes     bf16 (bf16 weights, fp32 capsules, norms / pooling / loss in fp32) and fp32
             (TF32 matmuls allowed)
  rows       capt            capt's model with capsules, logits only where the loss needs them
             capt+compile    the same loss function under torch.compile
             hf-plain        transformers model (default attention, sdpa; dropout off) with the
                             capsules put on by capt.hf (the library users run: the slot in
                             front of the embeddings, re-formed by forward pre-hooks on the
                             blocks); decoder-only loss via labels= (logits at every
                             position); T5 eval repeats each input per candidate, as evaluation
                             harnesses do
             hf-best         the same, loss function under torch.compile, decoder-only
                             logits_to_keep = the answer positions, T5 eval encodes once
             All rows of a workload share weights and batch, so their first loss / mean score
             (`value`) agree: the anchors run the same method as capt.
  micro      the capsule's pool+add (capt.models.fused Triton kernel, the PyTorch reference, the
             reference under torch.compile, and refresh_slots as the models call it), forward
             and backward, against the time of reading the hidden states once
  mixed      many tasks on one frozen model (--mixed-tasks, default 16 capsule sets), eval: a
             batch whose rows are drawn from the tasks at random, each row served by its own
             set (`tasks=`), against the same batch with one set (single-task, the same shape)
             and against the same rows run task by task, each task's rows as one batch on a
             model holding that task's set; the three are timed in turns, step by step (the
             order rotated), and the ratios are the median of each step's ratio; on the CPU
             by the process's CPU time, so that other jobs on a shared machine count less

Timing: the device is synchronised before every clock read; the first --warmup steps
(compilation included) are timed apart as the warm-up; the figure is the median of --steps
steps; peak memory is torch.cuda.max_memory_allocated, reset before each row's first step
(the row's own weights count, no other model is resident). samples/s counts sequences (T5
eval: inputs, each with its candidates); tokens/s counts input tokens, encoder plus decoder
for T5, the capsule slot not included.

FLOP convention (docs/bench.md). Weight matmuls cost 2 FLOPs per weight per position
forward; a frozen-base train step costs 4 (forward + activation gradients, no weight
gradients). Attention (QK^T and AV, 4 * Tq * Tk * heads * head_dim forward, half of it when
causal) costs 1x forward in eval and 3x in train. Positions include the capsule slot. Counted
weights are the non-embedding matmul weights; the output matrix counts only at the positions
where logits are computed. T5: encoder weights x encoder positions, decoder weights x decoder
positions, plus the cross-attention K/V projections x encoder positions.
  flops          what the step needs (logits at the answer positions only, each input encoded
                 once): the same for every row of a workload, so MFU ratios are speed ratios
  flops_executed what the row's implementation runs (hf-plain: logits at every position and,
                 in T5 eval, the encoder once per candidate; hf T5 eval: the cross-attention
                 K/V once per candidate)
MFU = flops / median step time / peak. Peak: 790 TFLOP/s bf16 on H100/H200 (the dense
8192^3 matmul rate measured on that GPU, not the data sheet's 989) and 395 TFLOP/s for fp32
with TF32 (the data sheet's dense TF32 rate 494.7 scaled by the same 790/989: not measured).
Other devices use the matmul rate this run measures. The run also measures and prints the
8192^3 bf16 / TF32 matmul rates and the device copy bandwidth.

Without a GPU (or with --cpu) the bench runs tiny 2-layer models for a few steps: it proves
the script works, its figures mean nothing. --full-size keeps the workloads' real sizes on the
CPU (one thread), for CPU figures of a model a CPU can run (smollm2-135m).

    python bench/bench.py                            # everything (GPU: allow ~40 min)
    python bench/bench.py --budget 480               # what fits in 8 minutes, in priority order (bench_plan.py)
    python bench/bench.py --budget 480 --dry-run     # the plan and its estimates, nothing run
    python bench/bench.py --budget 300 --merge A.json  # the next parts, added to an earlier run's JSON
    python bench/bench.py --workloads t5-base --modes train --dtypes bf16
    python bench/bench.py --micro-only
    python bench/bench.py --cpu --full-size --workloads smollm2-135m --mixed-only --dtypes fp32 --length 128

Compiled rows are checked against their eager row (value and first capsule gradient, the value
alone on T5: see GRADIENT_UNJUDGED); one that differs beyond VALUE_TOLERANCE is marked INVALID.
capt+compile compiles each block on its own by default (--compile-scope block): the blocks share
one graph, so warm-up costs a few blocks.
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()  # --budget counts from here: the imports below are part of the run

import argparse
import datetime
import gc
import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
if not torch.cuda.is_available() or "--cpu" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run in its interpreter on the CPU
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import transformers  # noqa: E402

import bench_plan  # noqa: E402

from capt.hf import attach_capsules  # noqa: E402
from capt.methods import CapsuleConfig, MethodConfig, attach, capsule_vectors, method_parameters  # noqa: E402
from capt.packed import pack_linears  # noqa: E402
from capt.models.ops import pool_add_reference, refresh_slots  # noqa: E402
from capt.load import build_model  # noqa: E402
from capt.cli.experiment import processor_name  # noqa: E402

CPU_WARNING = ("CPU MODE: tiny random 2-layer models, a few steps. These figures mean NOTHING about speed; "
               "this run only proves the bench works.")

# ---------------------------------------------------------------------------------------------
# Workloads: HF config.json keys, the shapes of docs/bench.md

T5_COMMON = dict(model_type="t5", feed_forward_proj="relu", tie_word_embeddings=True, relative_attention_num_buckets=32,
                 relative_attention_max_distance=128, layer_norm_epsilon=1e-6, dropout_rate=0.0, pad_token_id=0,
                 eos_token_id=1, decoder_start_token_id=0)
LLAMA_32_ROPE = dict(
    rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)

WORKLOADS = {
    "t5-base": dict(batch=32, config=dict(T5_COMMON, vocab_size=32128, d_model=768, d_kv=64, d_ff=3072, num_layers=12,
                                          num_decoder_layers=12, num_heads=12)),
    "t5-large": dict(batch=32, config=dict(T5_COMMON, vocab_size=32128, d_model=1024, d_kv=64, d_ff=4096, num_layers=24,
                                           num_decoder_layers=24, num_heads=16)),
    "llama-3.2-1b": dict(batch=16, config=dict(
        model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_theta=500000.0, rope_scaling=LLAMA_32_ROPE, tie_word_embeddings=True, attention_bias=False, mlp_bias=False,
        hidden_act="silu", bos_token_id=128000, eos_token_id=128001, attention_dropout=0.0)),
    "qwen2.5-1.5b": dict(batch=16, config=dict(
        model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
        num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope_theta=1000000.0, tie_word_embeddings=True, use_sliding_window=False, hidden_act="silu",
        bos_token_id=151643, eos_token_id=151643, attention_dropout=0.0)),
    # SmolLM2-135M-Instruct's shape (the CPU demo's model): not in the default list; with --cpu --full-size, a
    # model a CPU can time at its real size
    "smollm2-135m": dict(batch=16, config=dict(
        model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_theta=100000.0, tie_word_embeddings=True, attention_bias=False, mlp_bias=False, hidden_act="silu",
        bos_token_id=1, eos_token_id=2, attention_dropout=0.0)),
}
DEFAULT_WORKLOADS = ("t5-base", "t5-large", "llama-3.2-1b", "qwen2.5-1.5b")
LENGTH, TARGET_LENGTH, CANDIDATES = 256, 8, 2  # encoder / prompt+answer tokens, answer tokens, T5 eval candidates

# The same families at toy size for the CPU mode: 2 layers, width 64, vocabulary 512.
TINY = {
    "t5-base": dict(vocab_size=512, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4),
    "t5-large": dict(vocab_size=512, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4),
    "llama-3.2-1b": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        rope_scaling=dict(LLAMA_32_ROPE, original_max_position_embeddings=128),
    ),
    "qwen2.5-1.5b": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=1,
    ),
    "smollm2-135m": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
    ),
}
TINY_BATCH, TINY_LENGTH = 2, 32

# bench.md targets for capt, (vs hf-plain, vs hf-best), bf16; eval is the same for every model.
TARGETS = {("t5-base", "train"): (8.0, 2.0), ("t5-large", "train"): (4.0, 1.5), ("llama-3.2-1b", "train"): (2.3, 1.15),
           ("qwen2.5-1.5b", "train"): (2.3, 1.15)}
EVAL_TARGET = (2.0, 1.1)
MIXED_TARGET = 1.05  # a mixed batch costs at most 1.05x a single-task batch of the same shape
MFU_TARGETS = {"t5-base": 0.30, "llama-3.2-1b": 0.70}

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
H100_PEAKS = {"bf16": 790e12, "fp32": 395e12}  # see the docstring
HBM_READ = 4.3e12  # bytes/s: the bench.md yardstick for "reading the hidden states once"

# ---------------------------------------------------------------------------------------------
# Random weights: one generator walk over capt's state_dict, the same values for both models


def random_tensors(config: dict, dtype: torch.dtype, device: torch.device, seed: int):
    """(name, tensor) for every tensor of capt's state_dict, one at a time, in a fixed order.

    Norms 1, embeddings N(0, 1), matrices N(0, 1 / fan_in), biases N(0, 0.02): O(1) activations,
    so that a wrong capsule would show in the outputs that the rows report.
    """
    shapes = {k: t.shape for k, t in build_model(config, "meta").state_dict().items()}
    g = torch.Generator(device=device).manual_seed(seed)
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            yield name, torch.ones(shape, dtype=dtype, device=device)
            continue
        std = 1.0 if "embed" in name or name == "shared.weight" else shape[1] ** -0.5 if len(shape) == 2 else 0.02
        yield name, (torch.randn(shape, generator=g, device=device) * std).to(dtype)


def capsule_values(n_blocks: int, width: int, device, seed: int) -> list[torch.Tensor]:
    """Non-zero fp32 capsules (the method starts from zeros; values do not change the speed)."""
    g = torch.Generator(device=device).manual_seed(seed + 1)
    return [torch.randn(width, generator=g, device=device) * 0.5 for _ in range(n_blocks)]


def build_capt(config: dict, dtype, device, seed: int):
    """capt's model, loaded the way capt.load does it (meta, the linear layers swapped for capt.packed's, then
    assign), capsules on every block; returns it and its capsule parameters."""
    model = pack_linears(build_model(config, "meta"))
    model.load_state_dict(dict(random_tensors(config, dtype, device, seed)), strict=True, assign=True)
    model.init_buffers(device)
    model.eval()
    attach(model, "capt", capsules=CapsuleConfig())  # freezes the base, fp32 zero capsules
    values = capsule_values(len(model.capsule_blocks()), model.capsule_width, device, seed)
    with torch.no_grad():
        for i, p in capsule_vectors(model).items():
            p.copy_(values[i])
    return model, list(method_parameters(model).values())


def build_hf(config: dict, dtype, device, seed: int):
    """The transformers model of the same config with the same weight values, frozen, in eval mode."""
    hf_config = transformers.AutoConfig.for_model(**config)
    cls = {"t5": transformers.T5ForConditionalGeneration, "llama": transformers.LlamaForCausalLM,
           "qwen2": transformers.Qwen2ForCausalLM}[config["model_type"]]
    with torch.device(device):
        hf = cls._from_config(hf_config, dtype=dtype)
    target = hf.state_dict()  # tied matrices appear under several names, one storage
    filled = set()
    with torch.no_grad():
        for name, value in random_tensors(config, dtype, device, seed):  # one tensor at a time: no second copy
            target[name].copy_(value)
            filled.add(target[name].data_ptr())
    missing = [n for n, p in hf.named_parameters() if p.data_ptr() not in filled]
    if missing:
        raise RuntimeError(f"transformers parameters without a capt counterpart: {missing[:3]}")
    hf.eval().requires_grad_(False)
    blocks = hf.encoder.block if config["model_type"] == "t5" else hf.model.layers
    vectors = [
        v.requires_grad_()
        for v in capsule_values(len(blocks), config.get("d_model") or config["hidden_size"], device, seed)
    ]
    attach_capsules(hf, dict(enumerate(vectors)))  # capt.hf: the same tensors train through transformers' forward
    return hf, vectors


# ---------------------------------------------------------------------------------------------
# Batches and the loss / score functions of each row


def make_batch(family: str, batch: int, length: int, target_length: int, vocab: int, device, seed: int) -> dict:
    """Random token ids, no padding (the full length is what is measured)."""
    g = torch.Generator().manual_seed(seed + 2)
    ids = torch.randint(2, vocab, (batch, length), generator=g)
    b = dict(ids=ids, mask=torch.ones(batch, length, dtype=torch.long))
    if family == "t5":
        for name, rows in (("train", 1), ("eval", CANDIDATES)):
            # each input's candidates consecutive
            targets = torch.randint(2, vocab, (batch * rows, target_length), generator=g)
            b[f"{name}_targets"] = targets
            b[f"{name}_dec_in"] = torch.cat([torch.zeros_like(targets[:, :1]), targets[:, :-1]], dim=1)  # start token 0
    else:
        prompt_mask = b["mask"].clone()
        prompt_mask[:, length - target_length:] = 0  # the answer is not pooled into the capsule
        b["prompt_mask"] = prompt_mask
        b["targets"] = ids[:, length - target_length:]  # (B, Ta)
        b["logits_at"] = torch.arange(length - target_length - 1, length - 1).expand(batch, -1)  # token positions
        b["keep"] = torch.arange(length - target_length - 1, length - 1)  # the positions that predict the answer
        labels = torch.full((batch, length), -100)  # transformers shifts them: position t predicts label t + 1
        labels[:, length - target_length:] = b["targets"]
        b["labels"] = labels
    return {k: v.to(device) for k, v in b.items()}


def answer_logprob(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(R, Ta, V), (R, Ta) -> (R,) summed log-probability of the targets."""
    return logits.float().log_softmax(-1).gather(-1, targets[..., None])[..., 0].sum(-1)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def capt_fn(model, family: str, mode: str, batch: int):
    """capt: train -> the mean loss; eval -> the candidates' scores."""
    if family == "t5" and mode == "train":
        return lambda b: cross_entropy(
            model(b["ids"], b["mask"], decoder_input_ids=b["train_dec_in"]), b["train_targets"]
        )
    if family == "t5":
        def score(b):
            states, mask = model.encode(b["ids"], b["mask"])
            logits = model.decode(b["eval_dec_in"], states, mask)  # each encoded input serves its candidates
            return answer_logprob(logits, b["eval_targets"]).view(batch, CANDIDATES)
        return score
    def lm(b):
        logits = model(b["ids"], prompt_mask=b["prompt_mask"], logits_at=b["logits_at"])  # (B, Ta, V)
        return cross_entropy(logits, b["targets"]) if mode == "train" else answer_logprob(logits, b["targets"])
    return lm


def hf_fn(hf, family: str, mode: str, anchor: str, batch: int):
    """transformers with capt.hf's capsules: hf-plain as most users write it, hf-best as a careful user does
    (compiled by the caller)."""
    if family == "t5":
        def t5(b):
            if mode == "train":
                out = hf(input_ids=b["ids"], attention_mask=b["mask"], decoder_input_ids=b["train_dec_in"],
                         labels=b["train_targets"] if anchor == "plain" else None)
                return out.loss if anchor == "plain" else cross_entropy(out.logits, b["train_targets"])
            if anchor == "plain":  # the input repeated for each candidate
                ids, mask = b["ids"].repeat_interleave(CANDIDATES, 0), b["mask"].repeat_interleave(CANDIDATES, 0)
                logits = hf(input_ids=ids, attention_mask=mask, decoder_input_ids=b["eval_dec_in"]).logits
            else:  # encode once (the slot stays in the states), hand the states to every candidate
                states = hf.encoder(input_ids=b["ids"], attention_mask=b["mask"]).last_hidden_state
                logits = hf(
                    encoder_outputs=(states.repeat_interleave(CANDIDATES, 0),),
                    attention_mask=b["mask"].repeat_interleave(CANDIDATES, 0),
                    decoder_input_ids=b["eval_dec_in"],
                ).logits
            return answer_logprob(logits, b["eval_targets"]).view(batch, CANDIDATES)
        return t5

    def lm(b):
        # the capsule summarises the prompt only (prompt_mask, capt.hf's keyword)
        if anchor == "plain" and mode == "train":
            return hf(b["ids"], prompt_mask=b["prompt_mask"], labels=b["labels"]).loss  # logits at every position
        if anchor == "plain":
            logits = hf(b["ids"], prompt_mask=b["prompt_mask"]).logits[:, b["keep"]]
        else:
            logits = hf(b["ids"], prompt_mask=b["prompt_mask"], logits_to_keep=b["keep"]).logits  # (B, Ta, V)
        return cross_entropy(logits, b["targets"]) if mode == "train" else answer_logprob(logits, b["targets"])
    return lm


# ---------------------------------------------------------------------------------------------
# FLOPs (convention in the docstring)


def step_flops(
    config: dict, family: str, mode: str, impl: str, batch: int, length: int, target_length: int
) -> tuple[float, float]:
    """(flops the step needs, flops the implementation runs) for one step."""
    weight_mult, attn_mult = (4, 3) if mode == "train" else (2, 1)
    n = length + 1  # the capsule slot is a position like any other
    plain = impl == "hf-plain"
    if family == "t5":
        d, ff, inner, vocab = (
            config["d_model"],
            config["d_ff"],
            config["num_heads"] * config["d_kv"],
            config["vocab_size"],
        )
        ff_mats = 3 if config["feed_forward_proj"].startswith("gated") else 2
        enc_layer, dec_layer, cross_kv = (
            4 * d * inner + ff_mats * d * ff,
            6 * d * inner + ff_mats * d * ff,
            2 * d * inner,
        )
        le, ld = config["num_layers"], config["num_decoder_layers"]
        rows = batch * (CANDIDATES if mode == "eval" else 1)  # decoder rows

        def total(enc_rows, kv_rows):
            weights = le * enc_layer * enc_rows * n + ld * (dec_layer * rows * target_length + cross_kv * kv_rows * n)
            weights += vocab * d * rows * target_length
            attn = le * enc_rows * 4 * inner * n * n + ld * rows * (
                4 * inner * target_length**2 / 2 + 4 * inner * target_length * n
            )
            return weight_mult * weights + attn_mult * attn

        needed = total(batch, batch)
        executed = total(rows if plain else batch, rows if impl.startswith("hf") else batch)
        return needed, executed
    d, ff, vocab, layers = (
        config["hidden_size"],
        config["intermediate_size"],
        config["vocab_size"],
        config["num_hidden_layers"],
    )
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or d // heads
    layer = 2 * d * heads * head_dim + 2 * d * kv_heads * head_dim + 3 * d * ff
    attn = layers * batch * 4 * heads * head_dim * n * n / 2  # causal

    def total(logit_positions):
        return weight_mult * (layers * layer * batch * n + vocab * d * logit_positions) + attn_mult * attn

    return total(batch * target_length), total(batch * n if plain else batch * target_length)


# ---------------------------------------------------------------------------------------------
# Timing


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory() -> None:
    torch._dynamo.reset()  # compiled graphs hold their model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure(step, warmup: int, steps: int, device) -> tuple[float, list[float], float]:
    """(warm-up seconds, per-step seconds, first step's value); a sync before every clock read."""
    sync(device)
    t0 = time.perf_counter()
    first = float(step().detach().float().mean())  # the first step (compilation included)
    for _ in range(warmup - 1):
        step()
    sync(device)
    warm = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        sync(device)
        t = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - t)
    return warm, times, first


def run_row(name: str, spec: dict, mode: str, dtype_name: str, impl: str, args, device, peak: float) -> dict:
    """One measured row; an error (OOM, compile failure) is recorded in the row, never raised."""
    config, family = spec["config"], spec["config"]["model_type"]
    batch, length = spec["batch"], spec["length"]
    row = dict(
        workload=name,
        mode=mode,
        dtype=dtype_name,
        impl=impl,
        compiled=impl in ("capt+compile", "hf-best"),
        batch=batch,
        length=length,
        target_length=args.target_length,
        candidates=CANDIDATES if family == "t5" and mode == "eval" else 1,
        error=None,
    )
    dtype = DTYPES[dtype_name]
    try:
        free_memory()
        if device.type == "cuda":
            row["resident_gb_before"] = torch.cuda.memory_allocated(device) / 1e9  # ~0 unless an earlier row leaked
        t_build = time.perf_counter()
        if impl.startswith("capt"):
            model, params = build_capt(config, dtype, device, args.seed)
            fn = capt_fn(model, family, mode, batch)
        else:
            model, params = build_hf(config, dtype, device, args.seed)
            fn = hf_fn(model, family, mode, impl.removeprefix("hf-"), batch)
            row["attn_implementation"] = model.config._attn_implementation
        settings = {}  # torch._dynamo.config while the row runs
        if row["compiled"]:
            mode_arg = args.compile_mode if impl == "capt+compile" and args.compile_backend == "inductor" else None
            scope = args.compile_scope if impl == "capt+compile" else "step"
            if scope == "block":
                compile_blocks(model, args.compile_backend, mode_arg)
                settings["allow_unspec_int_on_nn_module"] = True  # a block's index is an input, not a constant
            else:
                fn = torch.compile(fn, backend=args.compile_backend, mode=mode_arg, dynamic=False)
            row["compile"] = dict(backend=args.compile_backend, mode=mode_arg, scope=scope)
        b = make_batch(family, batch, length, args.target_length, config["vocab_size"], device, args.seed)
        row["build_s"] = time.perf_counter() - t_build

        grads = []  # the norm of the first step's capsule gradients
        if mode == "train":
            optimizer = torch.optim.AdamW(params, lr=1e-3)

            def step():
                loss = fn(b)
                loss.backward()
                if not grads:
                    grads.append(
                        torch.linalg.vector_norm(
                            torch.stack([torch.linalg.vector_norm(p.grad.float()) for p in params])
                        )
                    )
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                return loss
        else:
            def step():
                with torch.no_grad():
                    return fn(b)

        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        torch._dynamo.utils.counters.clear()
        with torch._dynamo.config.patch(**settings):
            warm, times, first = measure(step, args.warmup, args.steps, device)
        if row["compiled"]:
            row["compiled_graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        seconds = statistics.median(times)
        flops, executed = step_flops(config, family, mode, impl, batch, length, args.target_length)
        tokens = batch * length + (batch * row["candidates"] * args.target_length if family == "t5" else 0)
        row.update(
            ms_step=1e3 * seconds,
            ms_min=1e3 * min(times),
            ms_max=1e3 * max(times),
            steps=len(times),
            warmup_steps=args.warmup,
            warmup_s=warm,
            samples_s=batch / seconds,
            tokens_s=tokens / seconds,
            flops=flops,
            flops_executed=executed,
            peak_flops=peak,
            mfu=flops / seconds / peak,
            mfu_executed=executed / seconds / peak,
            peak_gb=torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None,
            value=first,  # train: the first loss; eval: the mean score (the same model, so equal across rows)
            grad_norm=float(grads[0]) if grads else None,  # train: the capsules' first gradient, equal across rows too
        )
    except Exception as e:  # noqa: BLE001 - a row that fails is reported, the others still run
        traceback.print_exc()
        row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:400]
    finally:
        model = fn = params = b = step = optimizer = None  # noqa: F841 - drop every reference before freeing
        free_memory()
    return row


def compile_blocks(model, backend: str, mode: str | None) -> None:
    """capt+compile with --compile-scope block: each block compiled on its own. The blocks of a stack
    run the same code, so they share one graph (two: block 0 forms no capsule slot, the others
    re-form it), and compiling costs a few blocks instead of the whole step; embeddings, output
    matrix and loss stay eager."""
    blocks = list(model.encoder.block) + list(model.decoder.block) if model.seq2seq else list(model.model.layers)
    for block in blocks:
        # dynamic=None: the block index becomes symbolic on its first change
        block.compile(backend=backend, mode=mode, dynamic=None)


# Largest relative difference between a compiled row and its eager row (capt+compile vs capt, hf-best vs
# hf-plain) that counts as the same computation: bf16 rounds differently once ops are fused.
VALUE_TOLERANCE = {"fp32": 1e-3, "bf16": 2e-2}
EAGER_OF = {"capt+compile": "capt", "hf-best": "hf-plain"}
# Workloads whose first capsule-gradient norm moves beyond VALUE_TOLERANCE under rounding alone, so the
# check cannot judge a compiled row by it: on random-weight T5, reading every linear product's inputs
# at TF32's precision moves it by 17% (docs/speed.md, bench/grad_rounding_cpu.py). Their rows are judged
# on the value; the gradient's difference is recorded beside it, and the gpu tests check compiled T5's
# gradients against eager in fp32 with TF32 off, where rounding does not move them.
GRADIENT_UNJUDGED = ("t5-base", "t5-large")


def check_values(rows: list[dict]) -> None:
    """Mark each compiled row valid or not: its value (first loss / mean score) and, where rounding
    leaves it well-conditioned, its first capsule-gradient norm must equal its eager row's within
    VALUE_TOLERANCE; a compiled row that computes something else (say, a kernel's writes lost by the
    compiler) is no speed figure."""

    def relative(row, eager, key):
        if row.get(key) is None or eager.get(key) is None:
            return None
        d = abs(row[key] - eager[key]) / max(abs(eager[key]), 1e-6)
        return d if d == d else float("inf")  # NaN: as far off as can be

    for row in rows:
        if row["impl"] not in EAGER_OF or row.get("error"):
            continue
        eager = next(
            (
                r
                for r in rows
                if (r["workload"], r["mode"], r["dtype"], r["impl"])
                == (row["workload"], row["mode"], row["dtype"], EAGER_OF[row["impl"]])
                and not r.get("error")
            ),
            None,
        )
        if eager is None:
            row["valid"] = row["value_vs_eager"] = None
            continue
        row["grad_vs_eager"] = relative(row, eager, "grad_norm")
        judged = [relative(row, eager, "value")]
        if row["workload"] not in GRADIENT_UNJUDGED:
            judged.append(row["grad_vs_eager"])
        row["value_vs_eager"] = max((d for d in judged if d is not None), default=None)
        row["valid"] = None if row["value_vs_eager"] is None else row["value_vs_eager"] <= VALUE_TOLERANCE[row["dtype"]]


def add_ratios(rows: list[dict]) -> None:
    """capt rows: anchor time / our time (>1 = faster), warm-up and memory relative to hf-best, bench.md targets."""
    for row in rows:
        if not row["impl"].startswith("capt") or row.get("error"):
            continue
        group = {
            r["impl"]: r
            for r in rows
            if (r["workload"], r["mode"], r["dtype"]) == (row["workload"], row["mode"], row["dtype"])
            and not r.get("error")
            and "ms_step" in r
        }
        for anchor in ("hf-plain", "hf-best"):
            key = "vs_" + anchor.replace("-", "_")
            row[key] = group[anchor]["ms_step"] / row["ms_step"] if anchor in group else None
        best = group.get("hf-best")
        row["warmup_vs_hf_best"] = row["warmup_s"] / best["warmup_s"] if best else None
        both_gb = best and row["peak_gb"] is not None and best["peak_gb"]
        row["memory_vs_hf_best"] = row["peak_gb"] / best["peak_gb"] if both_gb else None
        target = TARGETS.get((row["workload"], row["mode"]), EVAL_TARGET)
        row["target_vs_hf_plain"], row["target_vs_hf_best"] = target
        row["target_mfu"] = MFU_TARGETS.get(row["workload"]) if row["mode"] == "train" else None


# ---------------------------------------------------------------------------------------------
# Mixed batches: many capsule sets on one model, each row served by its own


def share_backbone(model, config: dict, device):
    """A second capt model on the same backbone tensors (no copy), no method attached."""
    base = set(build_model(config, "meta").state_dict())
    twin = build_model(config, "meta")
    twin.load_state_dict({k: v for k, v in model.state_dict().items() if k in base}, strict=True, assign=True)
    twin.init_buffers(device)
    return twin.eval()


def eval_scores(model, family: str):
    """The eval rows' scores (as capt_fn's) for any batch; tasks: each row's capsule set, or None."""
    if family == "t5":
        def t5(b, tasks=None):
            states, mask = model.encode(b["ids"], b["mask"], tasks)
            logits = model.decode(b["eval_dec_in"], states, mask)  # each encoded input serves its candidates
            return answer_logprob(logits, b["eval_targets"]).view(b["ids"].shape[0], CANDIDATES)
        return t5

    def lm(b, tasks=None):
        logits = model(b["ids"], prompt_mask=b["prompt_mask"], logits_at=b["logits_at"], tasks=tasks)  # (B, Ta, V)
        return answer_logprob(logits, b["targets"])
    return lm


def select_rows(b: dict, rows: torch.Tensor, family: str) -> dict:
    """The batch's rows `rows` as a batch of their own (T5: each input with its candidate rows)."""
    out = {k: b[k][rows] for k in ("ids", "mask", "prompt_mask", "targets", "logits_at") if k in b}
    if family == "t5":
        cand = (rows[:, None] * CANDIDATES + torch.arange(CANDIDATES, device=rows.device)).flatten()
        out["eval_dec_in"], out["eval_targets"] = b["eval_dec_in"][cand], b["eval_targets"][cand]
    return out


def mixed_row(name: str, spec: dict, dtype_name: str, args, device) -> dict:
    """One mixed-batch measurement: the single-task, mixed and task-by-task steps, timed in turns."""
    config, family = spec["config"], spec["config"]["model_type"]
    batch, length, n_sets = spec["batch"], spec["length"], args.mixed_tasks
    row = dict(
        workload=name,
        dtype=dtype_name,
        mode="eval",
        batch=batch,
        length=length,
        target_length=args.target_length,
        n_sets=n_sets,
        error=None,
    )
    model = multi = groups = b = fns = values = None
    try:
        free_memory()
        model, _ = build_capt(config, DTYPES[dtype_name], device, args.seed)  # one capsule set: the single-task batch
        multi = share_backbone(model, config, device)  # every set: row k of each block's table is set k
        attach(multi, MethodConfig("capt", task_capsules={f"task{k:02d}": CapsuleConfig() for k in range(n_sets)}))
        g = torch.Generator(device=device).manual_seed(args.seed + 3)
        with torch.no_grad():
            for table in capsule_vectors(multi).values():
                table.copy_(torch.randn(table.shape, generator=g, device=device) * 0.5)
        b = make_batch(family, batch, length, args.target_length, config["vocab_size"], device, args.seed)
        # (B,)
        tasks = torch.randint(n_sets, (batch,), generator=torch.Generator().manual_seed(args.seed + 4)).to(device)
        # task by task: each task's rows as one batch on a model holding that task's set (the backbone shared)
        groups = []
        for k in sorted(set(tasks.tolist())):
            own = share_backbone(model, config, device)
            attach(own, "capt", capsules=CapsuleConfig())
            with torch.no_grad():
                for layer, p in capsule_vectors(own).items():
                    p.copy_(capsule_vectors(multi)[layer][k])
            rows = (tasks == k).nonzero()[:, 0]
            groups.append((eval_scores(own, family), rows, select_rows(b, rows, family)))
        single, mixed = eval_scores(model, family), eval_scores(multi, family)

        def by_task():
            out = None
            for score, rows, sub in groups:
                got = score(sub)
                out = got.new_empty((batch, *got.shape[1:])) if out is None else out
                out[rows] = got
            return out

        fns = {"single_task": lambda: single(b), "mixed": lambda: mixed(b, tasks), "by_task": by_task}
        keys = list(fns)
        times = {k: [] for k in fns}
        # the CPU: the process's CPU time, which waiting for a core shared with other jobs does not inflate;
        # a GPU: wall time between synchronisations, as every other row
        clock = time.process_time if device.type == "cpu" else time.perf_counter
        with torch.no_grad():
            values = {k: fn() for k, fn in fns.items()}  # the first warm-up step
            for step in range(args.warmup - 1 + args.steps):
                # in turns, the order rotated each step, so that a slow spell of the machine hits all three alike
                for key in keys[step % 3:] + keys[:step % 3]:
                    sync(device)
                    t = clock()
                    fns[key]()
                    sync(device)
                    if step >= args.warmup - 1:
                        times[key].append(clock() - t)
        ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}

        def paired(a: str, b: str) -> float:  # the median of each step's ratio: steps side by side in time
            return statistics.median(x / y for x, y in zip(times[a], times[b]))

        row.update(sets_in_batch=len(groups), steps=args.steps, warmup_steps=args.warmup,
                   clock="process CPU time" if device.type == "cpu" else "wall time, synchronised",
                   single_task_ms=ms["single_task"], mixed_ms=ms["mixed"], by_task_ms=ms["by_task"],
                   step_ms={k: [1e3 * t for t in v] for k, v in times.items()},
                   mixed_vs_single=paired("mixed", "single_task"), by_task_vs_mixed=paired("by_task", "mixed"),
                   target_mixed_vs_single=MIXED_TARGET, samples_s_mixed=1e3 * batch / ms["mixed"],
                   max_abs_diff_mixed_vs_by_task=float((values["mixed"] - values["by_task"]).abs().max()),
                   max_abs_score=float(values["by_task"].abs().max()),  # the scale the differences are read against
                   max_abs_diff_mixed_vs_single=float((values["mixed"] - values["single_task"]).abs().max()))
    except Exception as e:  # noqa: BLE001 - a row that fails is reported, the others still run
        traceback.print_exc()
        row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:400]
    finally:
        model = multi = groups = b = fns = values = None  # noqa: F841 - drop every reference before freeing
        free_memory()
    return row


MIXED_HEADER = (f"{'workload':<13} {'dt':<4} {'B x T':>11} {'sets':>9} {'single ms':>10} {'mixed ms':>10} "
                f"{'by-task ms':>10} "
                f"{'mixed/single':>12} {'by-task/mixed':>13} {'diff':>8} {'of |score|':>10}")


def mixed_line(r: dict) -> str:
    head = f"{r['workload']:<13} {r['dtype']:<4} {r['batch']:>5} x {r['length']:<5}"
    if r.get("error"):
        return f"{head}  ERROR {r['error']}"
    ok = "ok" if r["mixed_vs_single"] <= r["target_mixed_vs_single"] else "MISS"
    return (f"{head} {r['sets_in_batch']:>3} of {r['n_sets']:<3} {r['single_task_ms']:10.2f} {r['mixed_ms']:10.2f} "
            f"{r['by_task_ms']:10.2f} {r['mixed_vs_single']:7.3f} {ok:<4} {r['by_task_vs_mixed']:13.2f} "
            f"{r['max_abs_diff_mixed_vs_by_task']:8.1e} {fmt(r.get('max_abs_score'), '10.1e')}")


# ---------------------------------------------------------------------------------------------
# Device rates: dense matmul and copy bandwidth


def event_time(fn, iters: int, device) -> float:
    """Seconds per call of fn, averaged over iters calls between two synchronised clock reads."""
    fn()
    sync(device)
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - t) / iters


def device_rates(device, cpu: bool) -> dict:
    """Measured dense matmul FLOP/s (bf16, fp32 with TF32) and copy bandwidth (bytes read + written per s)."""
    size, iters = (256, 3) if cpu else (8192, 20)
    rates = {}
    for name, dtype in DTYPES.items():
        a = torch.randn(size, size, device=device, dtype=dtype)
        b = torch.randn(size, size, device=device, dtype=dtype)
        rates[f"matmul_{name}_flops"] = 2 * size**3 / event_time(lambda: a @ b, iters, device)
        a = b = None  # freed
    n_bytes = (64 if cpu else 1024) * 2**20
    src = torch.empty(n_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    rates["copy_bytes_s"] = 2 * n_bytes / event_time(lambda: dst.copy_(src), iters, device)
    rates["matmul_size"], rates["copy_mib"] = size, n_bytes // 2**20
    src = dst = None  # freed (a del would leave the timed lambda a name it cannot find)
    free_memory()
    return rates


def peak_for(device_name: str, dtype_name: str, rates: dict) -> tuple[float, str]:
    if "H100" in device_name or "H200" in device_name:
        return H100_PEAKS[dtype_name], "bench.md (H100/H200)"
    return rates[f"matmul_{dtype_name}_flops"], f"measured {rates['matmul_size']}^3 matmul on this device"


# ---------------------------------------------------------------------------------------------
# Microbenchmark: the capsule's pool+add


def graph_time(fn, device, calls: int = 20, replays: int = 10) -> float:
    """Device seconds per call: `calls` calls captured in one CUDA graph, replayed (no launch overhead)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    except Exception:
        restore_cuda_generator(device)
        raise
    graph.replay()
    sync(device)
    t = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    sync(device)
    return (time.perf_counter() - t) / (replays * calls)


def restore_cuda_generator(device) -> None:
    """A capture that fails ends before torch closes the default CUDA generator's capture, and every
    later random call in the process (a model's init, inductor's pad_mm benchmark, randn_like) then
    raises "Offset increment outside graph capture". Give the generator a fresh state, same seed."""
    generator = torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    fresh = torch.Generator(device=device)
    fresh.manual_seed(generator.initial_seed())
    generator.graphsafe_set_state(fresh)


NOT_INTERPRETED = (
    "skipped: the Triton kernel takes CPU tensors only under TRITON_INTERPRET=1, set before Triton is imported"
)


def pool_add_implementations(args, device) -> dict:
    impls = {}
    try:
        from capt.models.fused import pool_add_fused
        impls["fused (capt.models.fused)"] = pool_add_fused
    except ImportError as e:
        impls["fused (capt.models.fused)"] = e
    # --cpu on a machine with a GPU, Triton compiled for it
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        impls["fused (capt.models.fused)"] = NOT_INTERPRETED
    elif device.type == "cpu" and callable(impls["fused (capt.models.fused)"]):
        from capt.models.fused import interpreter_refusal

        refused = interpreter_refusal()
        if refused is not None:
            impls["fused (capt.models.fused)"] = f"skipped: {refused}"
    impls["reference"] = pool_add_reference
    impls["reference+compile"] = torch.compile(pool_add_reference, backend=args.compile_backend, dynamic=False)
    impls["refresh_slots (pool+add+cat)"] = lambda h, m, p: refresh_slots(h, m, p, "add")  # as the models call it
    return impls


def micro_rows(workloads: dict, dtypes: list[str], args, device, rates: dict) -> list[dict]:
    """Forward and backward time of each pool+add implementation at each workload's (B, 1 + T, d)."""
    rows = []
    cpu = device.type == "cpu"
    iters = 2 if cpu else 100
    impls = pool_add_implementations(args, device)
    for name, spec in workloads.items():
        config = spec["config"]
        d = config.get("d_model") or config["hidden_size"]
        B, N = spec["batch"], spec["length"] + 1
        for dtype_name in dtypes:
            g = torch.Generator(device=device).manual_seed(args.seed)
            h0 = torch.randn(B, N, d, generator=g, device=device).to(DTYPES[dtype_name])
            mask = torch.ones(B, N, device=device)
            if config["model_type"] != "t5":
                mask[:, N - args.target_length:] = 0  # the answer is not pooled
            p0 = torch.randn(d, generator=g, device=device) * 0.02
            h_bytes = h0.numel() * h0.element_size()
            want = pool_add_reference(h0, mask, p0)
            for impl, fn in impls.items():
                row = dict(workload=name, dtype=dtype_name, impl=impl, shape=[B, N, d], h_bytes=h_bytes,
                           read_once_ms_at_4_3TBs=1e3 * h_bytes / HBM_READ,
                           read_once_ms_measured=1e3 * h_bytes / (rates["copy_bytes_s"] / 2), error=None)
                if isinstance(fn, str):
                    rows.append(dict(row, error=fn))
                    print(micro_line(rows[-1]), flush=True)
                    continue
                try:
                    if isinstance(fn, Exception):
                        raise fn
                    h = h0.detach().clone().requires_grad_()
                    p = p0.detach().clone().requires_grad_()
                    out = fn(h, mask, p)
                    got = out[:, 0] if out.dim() == 3 else out
                    row["max_abs_diff_vs_reference"] = float((got.detach().float() - want).abs().max())
                    grad = torch.randn_like(out)
                    with torch.no_grad():
                        row["fwd_ms_loop"] = 1e3 * event_time(lambda: fn(h0, mask, p0), iters, device)
                    row["bwd_ms_loop"] = 1e3 * event_time(
                        lambda: torch.autograd.grad(out, (h, p), grad, retain_graph=True), iters, device)
                    if not cpu:  # device time without launch overhead; the loop figures stand if capture fails
                        try:
                            with torch.no_grad():
                                fwd = graph_time(lambda: fn(h0, mask, p0), device)
                            # leaves of their own: h and p's gradient accumulators, kept alive by `out`,
                            # were made on the default stream, and using them from the capture stream
                            # invalidates the capture (an H200 run: cudaErrorStreamCaptureInvalidated)
                            hg, pg = h0.detach().clone().requires_grad_(), p0.detach().clone().requires_grad_()

                            def fwd_bwd():
                                torch.autograd.grad(fn(hg, mask, pg), (hg, pg), grad)
                            both = graph_time(fwd_bwd, device)
                            row.update(fwd_ms_graph=1e3 * fwd, bwd_ms_graph=1e3 * max(both - fwd, 0.0))
                        except Exception as e:  # noqa: BLE001
                            row["graph_error"] = f"{type(e).__name__}: {e}"[:300]
                    fwd_ms = row.get("fwd_ms_graph", row["fwd_ms_loop"])
                    bwd_ms = row.get("bwd_ms_graph", row["bwd_ms_loop"])
                    row["fwd_vs_read_once"] = fwd_ms / row["read_once_ms_at_4_3TBs"]
                    row["bwd_vs_read_once"] = bwd_ms / row["read_once_ms_at_4_3TBs"]  # the backward writes dh once
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc()
                    row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[
                        :400
                    ]
                rows.append(row)
                print(micro_line(row), flush=True)
            h0 = mask = p0 = want = None  # freed
            free_memory()
    return rows


# ---------------------------------------------------------------------------------------------
# Environment, output


def environment(device, cpu: bool) -> dict:
    def run(cmd):
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=ROOT).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            return None

    commit = run(["git", "rev-parse", "HEAD"])
    if commit and run(["git", "status", "--porcelain", "--untracked-files=no"]):
        commit += "+dirty"
    env = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        git_commit=commit,
        cpu_mode=cpu,
        host_cpu=processor_name() or platform.machine(),
        cpu_count=os.cpu_count(),
        python=platform.python_version(),
        torch=torch.__version__,
        transformers=transformers.__version__,
        cuda=torch.version.cuda,
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        driver=run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        if device.type == "cuda"
        else None,
        command=" ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
    )
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if cpu:
        env["note"] = CPU_WARNING
    return env


def fmt(x, spec: str, scale: float = 1.0) -> str:
    return "-" if x is None else format(x * scale, spec)


def flop_rate(x: float) -> str:
    return f"{x / 1e12:.1f} TFLOP/s" if x >= 1e11 else f"{x / 1e9:.2f} GFLOP/s"


def row_line(r: dict) -> str:
    head = f"{r['workload']:<13} {r['mode']:<5} {r['dtype']:<4} {r['impl']:<12}"
    run = f"  run {r['run']}" if "run" in r else ""  # --merge: which run the row came from
    if r.get("error"):
        return f"{head}  {'' if r['error'].startswith('skipped') else 'ERROR '}{r['error']}{run}"
    invalid = f"  INVALID: differs from its eager row by {r['value_vs_eager']:.1e}" if r.get("valid") is False else ""
    return (f"{head} {r['ms_step']:9.2f} {r['samples_s']:9.1f} {r['tokens_s']:10.0f} {fmt(r['mfu'], '6.1%')} "
            f"{fmt(r['mfu_executed'], '6.1%')} {r['warmup_s']:8.2f} {fmt(r['peak_gb'], '7.2f')} "
            f"{fmt(r.get('vs_hf_plain'), '7.2f')} {fmt(r.get('vs_hf_best'), '7.2f')}{invalid}{run}")


ROW_HEADER = (f"{'workload':<13} {'mode':<5} {'dt':<4} {'impl':<12} {'ms/step':>9} {'samples/s':>9} {'tokens/s':>10} "
              f"{'MFU':>6} {'MFUexe':>6} {'warmup s':>8} {'peak GB':>7} {'x plain':>7} {'x best':>7}")


def micro_line(r: dict) -> str:
    head = f"{r['workload']:<13} {r['dtype']:<4} {r['impl']:<29} {'x'.join(map(str, r['shape'])):>13}"
    if r.get("error"):
        return f"{head}  ERROR {r['error']}"
    return (f"{head} {fmt(r.get('fwd_ms_graph', r['fwd_ms_loop']), '9.4f')} "
            f"{fmt(r.get('bwd_ms_graph', r['bwd_ms_loop']), '9.4f')} "
            f"{r['fwd_ms_loop']:9.4f} {r['bwd_ms_loop']:9.4f} {r['read_once_ms_at_4_3TBs']:9.4f} "
            f"{r['read_once_ms_measured']:9.4f} "
            f"{r['fwd_vs_read_once']:7.2f} {r['bwd_vs_read_once']:7.2f} {r['max_abs_diff_vs_reference']:8.1e}")


MICRO_HEADER = (f"{'workload':<13} {'dt':<4} {'pool+add implementation':<29} {'B x N x d':>13} {'fwd ms':>9} "
                f"{'bwd ms':>9} "
                f"{'fwd loop':>9} {'bwd loop':>9} {'read@4.3':>9} {'read@meas':>9} {'fwd/rd':>7} {'bwd/rd':>7} "
                f"{'max diff':>8}")


def target_lines(rows: list[dict]) -> list[str]:
    """bench.md targets for the capt rows (bf16): ratio >= target, warm-up <= 1/3 and memory <= hf-best's."""
    lines = []
    for r in rows:
        if not r["impl"].startswith("capt") or r.get("error") or r["dtype"] != "bf16":
            continue
        if r.get("valid") is False:
            lines.append(f"{r['workload']} {r['mode']} {r['impl']}: INVALID (its value differs from the eager row's), "
                         "no target checked")
            continue
        checks = []
        for key, label in (("vs_hf_plain", "plain"), ("vs_hf_best", "best")):
            if r.get(key) is not None:
                ok = r[key] >= r[f"target_{key}"]
                checks.append(f"x{r[key]:.2f} {label} (>= {r[f'target_{key}']}: {'ok' if ok else 'MISS'})")
        if r.get("target_mfu") is not None:
            checks.append(f"MFU {r['mfu']:.1%} (>= {r['target_mfu']:.0%}: "
                          f"{'ok' if r['mfu'] >= r['target_mfu'] else 'MISS'})")
        if r.get("warmup_vs_hf_best") is not None:
            checks.append(f"warm-up {r['warmup_vs_hf_best']:.2f} of best (<= 0.33: "
                          f"{'ok' if r['warmup_vs_hf_best'] <= 1 / 3 else 'MISS'})")
        if r.get("memory_vs_hf_best") is not None:
            checks.append(f"memory {r['memory_vs_hf_best']:.2f} of best (<= 1: "
                          f"{'ok' if r['memory_vs_hf_best'] <= 1 else 'MISS'})")
        if checks:
            lines.append(f"{r['workload']} {r['mode']} {r['impl']}: " + ", ".join(checks))
    return lines


def write(out: Path, result: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(out)


# ---------------------------------------------------------------------------------------------
# Main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="capt vs transformers speed (docs/bench.md)")
    p.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS),
                   help="comma list of " + ", ".join(WORKLOADS) + " (default: all but smollm2-135m)")
    p.add_argument("--modes", default="train,eval", help="comma list of train, eval (default: both)")
    p.add_argument("--dtypes", default="bf16,fp32", help="comma list of bf16, fp32 (fp32: TF32 matmuls; default: both)")
    p.add_argument("--batch-size", type=int, default=None, help="override every workload's batch (bench.md: 32 T5, 16 "
                                                                "decoder-only)")
    p.add_argument("--length", type=int, default=None, help=f"encoder / prompt+answer tokens (default {LENGTH}; CPU "
                                                            f"{TINY_LENGTH})")
    p.add_argument("--target-length", type=int, default=TARGET_LENGTH, help="T5 decoder tokens / decoder-only answer "
                                                                            f"tokens (default {TARGET_LENGTH})")
    p.add_argument("--steps", type=int, default=None, help="measured steps, median reported (default 10; CPU 2)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps, compile included, timed apart (default 3; "
                                                            "CPU 1)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="capt rows: --compile only capt+compile, --no-compile only eager capt; default both")
    p.add_argument("--compile-mode", default=None, help="torch.compile mode for capt+compile (e.g. reduce-overhead, "
                                                        "max-autotune)")
    p.add_argument("--compile-backend", default=None, help="torch.compile backend (default inductor; CPU: eager, i.e. "
                                                           "dynamo only)")
    p.add_argument("--compile-cache", action="store_true",
                   help="keep inductor's FX-graph / AOT-autograd caches (off by default: warm-up = a cold compile)")
    p.add_argument("--anchors", default="plain,best", help="comma list of the transformers anchors: plain, best "
                                                           "(default: both; empty: none)")
    p.add_argument("--micro-only", action="store_true", help="only the device rates and the pool+add microbenchmark")
    p.add_argument("--no-micro", action="store_true", help="skip the pool+add microbenchmark")
    p.add_argument("--mixed-tasks", type=int, default=16, metavar="K",
                   help="capsule sets in the mixed-batch rows (eval: rows drawn from K tasks at random; default 16; 0: "
                        "no mixed rows)")
    p.add_argument("--mixed-only", action="store_true", help="only the mixed-batch rows")
    p.add_argument("--full-size", action="store_true", help="with --cpu: the workloads at their real size (one "
                                                            "thread), not tiny models")
    p.add_argument("--cpu", action="store_true", help="tiny models on the CPU (automatic without a GPU); figures mean "
                                                      "nothing")
    p.add_argument("--time-limit", type=float, default=None, help="seconds; rows not started by then are recorded as "
                                                                  "skipped")
    p.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                   help="plan the run to end within SECONDS of its start (imports included): parts in priority order, "
                        "each "
                        "started only if its estimate (bench/bench_plan.py, corrected by what the run measured) fits")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan (parts, estimates, what --budget would skip) for a GPU run of these options, "
                        "run nothing")
    p.add_argument("--merge", type=Path, default=None, metavar="FILE",
                   help="add this run to an earlier JSON: its complete workload groups are not run again, and the "
                        "output "
                        "(default: FILE itself) holds both runs, each row saying which run it came from")
    p.add_argument("--compile-scope", choices=["block", "step"], default="block",
                   help="capt+compile: compile each block on its own, one graph shared by the blocks (block, default), "
                        "or the whole loss function (step)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="JSON file (default bench/results/<date>-<gpu>.json; CPU: "
                                                          "bench/results/cpu.json)")
    args = p.parse_args(argv)

    args.cpu = args.cpu or (not torch.cuda.is_available() and not args.dry_run)  # a dry run plans the GPU run
    args.tiny = args.cpu and not args.full_size  # the CPU's toy models
    if args.mixed_only and args.mixed_tasks < 1:
        p.error("--mixed-only needs --mixed-tasks of at least 1")
    args.steps = args.steps or (2 if args.cpu else 10)
    args.warmup = args.warmup or (1 if args.cpu else 3)
    args.compile_backend = args.compile_backend or ("eager" if args.cpu else "inductor")
    lists = {}
    for key, allowed in (
        ("workloads", WORKLOADS),
        ("modes", ("train", "eval")),
        ("dtypes", DTYPES),
        ("anchors", ("plain", "best")),
    ):
        values = [v for v in getattr(args, key).split(",") if v]
        bad = [v for v in values if v not in allowed]
        if bad:
            p.error(f"--{key}: {', '.join(bad)} not among {', '.join(allowed)}")
        lists[key] = values
    args.workloads, args.modes, args.dtypes, args.anchors = (
        lists["workloads"],
        lists["modes"],
        lists["dtypes"],
        lists["anchors"],
    )
    if args.length is not None and args.length < args.target_length + 2:
        p.error(f"--length {args.length} leaves no prompt before the {args.target_length} answer tokens")
    if args.budget is not None and args.budget <= 0:
        p.error(f"--budget must be a positive number of seconds, got {args.budget:g}")
    args.impls = {None: ["capt", "capt+compile"], True: ["capt+compile"], False: ["capt"]}[args.compile] + [
        f"hf-{a}" for a in args.anchors
    ]
    args.earlier = None
    if args.merge is not None:
        try:
            args.earlier = json.loads(args.merge.read_text())
            if not isinstance(args.earlier, dict) or not isinstance(args.earlier.get("rows", []), list):
                raise ValueError("not a bench result")
        except (OSError, ValueError) as e:
            p.error(f"--merge {args.merge}: {e}")
    return args


def workload_specs(args) -> dict:
    specs = {}
    for name in args.workloads:
        spec = WORKLOADS[name]
        config = dict(spec["config"], **TINY[name]) if args.tiny else dict(spec["config"])
        batch = args.batch_size or (TINY_BATCH if args.tiny else spec["batch"])
        length = args.length or (TINY_LENGTH if args.tiny else LENGTH)
        specs[name] = dict(config=config, batch=batch, length=length)
    return specs


def skipped_rows(part: dict, reason: str) -> list[dict]:
    return [
        dict(workload=part["workload"], mode=part["mode"], dtype=part["dtype"], impl=impl, error=reason)
        for impl in part["rows"]
    ]


def dry_run(args, parts: list[dict], done_groups: set, done_micro: set, done_mixed: set) -> dict:
    """Print the plan of these options, run nothing; return it (for tests)."""
    planned = bench_plan.schedule(parts, args.budget)
    where = "the CPU (tiny models)" if args.cpu else "an H100 / H200 (estimates: bench/bench_plan.py)"
    print(f"dry run on {where}; budget {'none' if args.budget is None else f'{args.budget:g} s'}; "
          f"{args.warmup} warm-up + {args.steps} steps per row; capt+compile compiled per {args.compile_scope}")
    if done_groups or done_micro or done_mixed:
        print(
            f"already in {args.merge}: "
            + ", ".join(
                [f"{d} {m} {w}" for w, m, d in sorted(done_groups)]
                + [f"micro {w}" for w in sorted(done_micro)]
                + [f"mixed {d} {w}" for w, d in sorted(done_mixed)]
            )
        )
    print("\n".join(bench_plan.plan_lines(planned)))
    total = max((t for _, fits, t in planned if fits), default=0.0)
    print(f"planned: {total:.0f} s" + ("" if args.budget is None else f" of {args.budget:g} s"))
    return dict(
        parts=[dict(part, name=bench_plan.part_name(part), planned=fits) for part, fits, _ in planned],
        planned_s=total,
        budget=args.budget,
    )


def main(argv=None) -> dict:
    started = STARTED if argv is None else time.perf_counter()  # from the command line the imports count too
    args = parse_args(argv)
    specs = workload_specs(args)
    earlier = args.earlier
    done_groups = bench_plan.complete_groups(earlier, args.impls) if earlier and not args.micro_only else set()
    done_micro = bench_plan.measured_micro(earlier) if earlier else set()
    done_mixed = bench_plan.measured_mixed(earlier) if earlier and not args.micro_only else set()
    parts = bench_plan.build_plan(args, specs, done_groups, done_micro, done_mixed)
    if args.dry_run:
        return dry_run(args, parts, done_groups, done_micro, done_mixed)

    device = torch.device("cpu" if args.cpu else "cuda")
    if args.cpu:
        torch.set_num_threads(1)  # toy matrices only lose from threading
    else:
        torch.set_float32_matmul_precision("high")  # fp32 rows: TF32 matmuls allowed (bench.md)
    # cold compiles, as on a fresh machine, so warm-ups compare fairly
    if not args.compile_cache and args.compile_backend == "inductor":
        # imports Triton: after TRITON_INTERPRET is settled
        inductor = importlib.import_module("torch._inductor.config")
        functorch = importlib.import_module("torch._functorch.config")
        inductor.fx_graph_cache = False
        if hasattr(functorch, "enable_autograd_cache"):
            functorch.enable_autograd_cache = False
    start = time.perf_counter()
    if args.tiny:
        print(f"\n!!! {CPU_WARNING} !!!\n", flush=True)
    env = environment(device, args.cpu)
    if args.cpu and not args.tiny:
        env["note"] = "CPU, full-size models (--full-size), one thread: CPU figures, not GPU ones"
    slug = "cpu" if args.cpu else env["device"].replace("NVIDIA ", "").replace(" ", "-")
    out = (
        args.out
        or args.merge
        or ROOT / "bench" / "results" / (f"{slug}.json" if args.cpu else f"{env['date'][:10]}-{slug}.json")
    )
    budget = bench_plan.Budget(None if args.budget is None else started + args.budget)
    if args.budget is not None:
        print(f"plan for --budget {args.budget:g} s ({time.perf_counter() - started:.0f} s spent starting):\n"
              + "\n".join(bench_plan.plan_lines(bench_plan.schedule(parts, args.budget))) + "\n", flush=True)

    t = time.perf_counter()
    rates = device_rates(device, args.cpu)
    budget.record("rates", time.perf_counter() - t, parts[1]["estimate"])
    peaks = {name: peak_for(env["device"], name, rates) for name in DTYPES}
    print(f"device {env['device']}  torch {env['torch']}  transformers {env['transformers']}  commit "
          f"{env['git_commit']}")
    print(f"measured: matmul {rates['matmul_size']}^3 bf16 {flop_rate(rates['matmul_bf16_flops'])}, "
          f"fp32/TF32 {flop_rate(rates['matmul_fp32_flops'])}; copy {rates['copy_bytes_s'] / 1e12:.3f} TB/s (read + "
          "write)")
    for name, (value, source) in peaks.items():
        print(f"MFU peak {name}: {flop_rate(value)} ({source})")
    result = dict(
        environment=env,
        options={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "earlier"},
        rates=rates,
        peaks={k: dict(flops=v, source=s) for k, (v, s) in peaks.items()},
        flop_convention=__doc__.split("FLOP convention")[1].split("Without a GPU")[0].strip(),
        workloads=specs,
        micro=[],
        rows=[],
        skipped=[],
        mixed=[],
    )

    def save() -> dict:
        final = bench_plan.merge(earlier, result) if earlier else result
        write(out, final)
        return final

    micro_dtypes = ["bf16"] if "bf16" in args.dtypes else args.dtypes  # the shapes matter, one dtype is enough
    header = {"micro": "\npool+add microbenchmark (ms per call; fwd/bwd = CUDA-graph device time on a GPU, loop = "
                       "eager incl. launch; "
                       f"read = bytes of h at 4.3 TB/s and at the measured copy rate)\n{MICRO_HEADER}",
              "group": f"\nsteps: {args.warmup} warm-up (timed apart) + median of {args.steps}\n{ROW_HEADER}"}
    for part in [] if args.mixed_only else [p for p in parts[2:] if p["part"] != "mixed"]:  # start-up and rates: done
        if part["part"] in header:
            print(header.pop(part["part"]), flush=True)
        estimate, now = budget.part_estimate(part), time.perf_counter()
        if not budget.fits(estimate, now):
            reason = budget.why_not(estimate, now)
            result["skipped"].append(dict(part=bench_plan.part_name(part), reason=reason))
            if part["part"] == "group":
                result["rows"] += skipped_rows(part, reason)
            print(f"{bench_plan.part_name(part)}: {reason}", flush=True)
            save()
            continue
        if part["part"] == "micro":
            t = time.perf_counter()
            result["micro"] += micro_rows(
                {part["workload"]: specs[part["workload"]]}, micro_dtypes, args, device, rates
            )
            budget.record("micro", time.perf_counter() - t, part["estimate"])
            save()
            continue
        name, mode, dtype_name = part["workload"], part["mode"], part["dtype"]
        for impl, row_estimate in part["rows"].items():
            row_estimate *= budget.factor(bench_plan.kind(part, impl))
            t = time.perf_counter()
            if args.time_limit is not None and t - start > args.time_limit:
                row = dict(
                    workload=name,
                    mode=mode,
                    dtype=dtype_name,
                    impl=impl,
                    error=f"skipped: --time-limit {args.time_limit:g} s reached",
                )
            elif not budget.fits(row_estimate, t):
                row = dict(workload=name, mode=mode, dtype=dtype_name, impl=impl, error=budget.why_not(row_estimate, t))
            else:
                row = run_row(name, specs[name], mode, dtype_name, impl, args, device, peaks[dtype_name][0])
                budget.record(bench_plan.kind(part, impl), time.perf_counter() - t, part["rows"][impl])
            result["rows"].append(row)
            check_values(result["rows"])
            add_ratios(result["rows"])
            print(row_line(row), flush=True)
            save()

    if args.mixed_tasks > 0 and not args.micro_only:
        print(f"\nmixed batches, eval: rows drawn from {args.mixed_tasks} capsule sets at random, each served by its "
              "own; "
              f"{args.warmup} warm-up + median of {args.steps}, the three timed in turns (mixed/single: target <= "
              f"{MIXED_TARGET})"
              f"\n{MIXED_HEADER}", flush=True)
        for part in (p for p in parts if p["part"] == "mixed"):
            name, dtype_name, spec = part["workload"], part["dtype"], specs[part["workload"]]
            estimate, now = budget.part_estimate(part), time.perf_counter()
            if args.time_limit is not None and now - start > args.time_limit:
                reason = f"skipped: --time-limit {args.time_limit:g} s reached"
            elif not budget.fits(estimate, now):
                reason = budget.why_not(estimate, now)
            else:
                reason = None
            if reason is not None:
                row = dict(workload=name, dtype=dtype_name, batch=spec["batch"], length=spec["length"], error=reason)
                result["skipped"].append(dict(part=bench_plan.part_name(part), reason=reason))
            else:
                row = mixed_row(name, spec, dtype_name, args, device)
                budget.record("mixed", time.perf_counter() - now, part["estimate"])
            result["mixed"].append(row)
            print(mixed_line(row), flush=True)
            save()

    result["total_s"] = time.perf_counter() - start
    final = save()
    if final["rows"]:
        print("\nx plain / x best: anchor ms / capt ms (> 1: capt is faster). MFU: needed FLOPs; MFUexe: FLOPs the row "
              "runs. "
              "INVALID: a compiled row whose value differs from its eager row's")
        for dtype_name in DTYPES:
            rows = [r for r in final["rows"] if r["dtype"] == dtype_name]
            if rows:
                print(f"\n{dtype_name}\n{ROW_HEADER}")
                print("\n".join(row_line(r) for r in rows))
        targets = target_lines(final["rows"])
        if targets:
            print("\nbench.md targets (bf16):\n" + "\n".join(targets))
    print(f"\nwrote {out} ({result['total_s']:.0f} s{f', merged with {args.merge}' if earlier else ''})")
    if args.tiny:
        print(f"\n!!! {CPU_WARNING} !!!")
    return final


if __name__ == "__main__":
    main()
