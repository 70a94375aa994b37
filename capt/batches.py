"""One training step's loss and an epoch's batches: what the trainer (capt/trainer.py) feeds the model.

The loss is the cross-entropy of the gold target's tokens, summed over the target (its negative
log-likelihood, the quantity rank classification compares), per example; the trainer averages it
over the examples of an optimizer step. Batches are built on the CPU and copied to the model once.
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from .evaluate import Encoded, decoder_inputs, has_linear_head, pad
from .baselines import classify, last_token

CHUNK_BATCHES = 16  # length bucketing: batches are formed from chunks of this many batches


def to_device(device: torch.device, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A batch built on the CPU, on the model's device: on CUDA each tensor is copied once from
    pinned memory without waiting for the copy (the forward that reads it is queued behind it)."""
    if device.type != "cuda":
        return tensors
    return tuple(t.pin_memory().to(device, non_blocking=True) for t in tensors)


def batch_nll(model, data: Encoded, idx: list[int]) -> torch.Tensor:
    """(b,) fp32 negative log-likelihood of each example's gold target, summed over its tokens
    (linear-head: of its gold class). The batch is built on the CPU and copied to the model once."""
    device = next(model.parameters()).device
    prompts = [data.prompts[i] for i in idx]
    # Decoder-only batches are right-padded: padding follows every real token, so causal attention
    # needs no mask (which keeps SDPA's causal path); the mask only locates tokens.
    if has_linear_head(model):  # the classifier reads the prompt's last token; the answer is a class index
        ids, mask = pad(prompts)  # (b, T), right-padded
        labels = torch.tensor([data.examples[i].label for i in idx])
        ids, at, labels = to_device(device, ids, last_token(mask), labels)
        return F.cross_entropy(classify(model, ids, at=at).float(), labels, reduction="none")  # (b,)
    golds = [data.targets[i][data.examples[i].label] for i in idx]
    if data.seq2seq:  # T5: encoder input, decoder teacher-forced on the gold target
        ids, mask = pad(prompts)  # (b, T)
        dec_in = decoder_inputs(model, golds)  # (b, Td)
        target, target_mask = pad(golds)  # (b, Td)
        ids, mask, dec_in, target, target_mask = to_device(device, ids, mask, dec_in, target, target_mask)
        logits = model(ids, attention_mask=mask, decoder_input_ids=dec_in)  # (b, Td, V)
    else:  # decoder-only: prompt + answer; the capsule reads the prompt, logits only where answers are predicted
        ids, _ = pad([p + g for p, g in zip(prompts, golds)])  # (b, L), right-padded
        lengths = torch.tensor([len(p) for p in prompts])
        prompt_mask = torch.arange(ids.shape[1])[None] < lengths[:, None]  # (b, L): the prompt, no padding
        target, target_mask = pad(golds)  # (b, K)
        at = (lengths[:, None] - 1 + torch.arange(target.shape[1])[None]) * target_mask  # (b, K)
        ids, prompt_mask, at, target, target_mask = to_device(device, ids, prompt_mask, at, target, target_mask)
        logits = model(ids, prompt_mask=prompt_mask, logits_at=at)  # (b, K, V)
    nll = F.cross_entropy(logits.float().transpose(1, 2), target, reduction="none")  # (b, K)
    return (nll * target_mask).sum(1)


def bucketed_batches(lengths: list[int], batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """One epoch's batches of example indices: shuffle, sort by length within chunks, shuffle batches."""
    rng = random.Random(f"capt-batches:{seed}:{epoch}")
    order = list(range(len(lengths)))
    rng.shuffle(order)
    chunk = batch_size * CHUNK_BATCHES
    batches = []
    for start in range(0, len(order), chunk):
        part = sorted(order[start:start + chunk], key=lambda i: lengths[i])
        n = -(-len(part) // batch_size)  # a full chunk: batch_size each; the last: its remainder spread
        ends = [len(part) * k // n for k in range(n + 1)]  # sizes differ by at most one
        batches += [part[ends[k]:ends[k + 1]] for k in range(n)]
    rng.shuffle(batches)
    return batches


def lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warm-up to 1 over `warmup` steps, then linear decay to 0 at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    return max(0.0, (total - step) / max(1, total - warmup))
