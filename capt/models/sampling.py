"""The next token from a row of logits, for both model families' generate().

check_sampling validates the arguments once, before any work; next_token then takes the argmax
or draws a sample after temperature, top-k and top-p (in that order, as transformers does).
The most likely token always survives the filters, so a draw never meets an empty distribution.
"""

from __future__ import annotations

import numbers

import torch

from ..errors import CaptError


def check_sampling(do_sample: bool, temperature: float, top_k: int | None, top_p: float | None) -> None:
    """CaptError unless temperature > 0 (when sampling), top_k >= 1 and 0 < top_p <= 1 (None: off)."""
    for name, value in (("temperature", temperature), ("top_p", top_p)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
            raise CaptError(f"{name} must be a number, got {value!r}")
    if do_sample and not (isinstance(temperature, (int, float)) and temperature > 0):
        raise CaptError(f"temperature must be > 0 when sampling, got {temperature}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 1):
        raise CaptError(f"top_k must be a whole number >= 1 (or None for no top-k), got {top_k!r}")
    if top_p is not None and not 0 < top_p <= 1:
        raise CaptError(f"top_p must be in (0, 1] (or None for no top-p), got {top_p!r}")


def end_tokens(eos) -> list[int]:
    """generate's end tokens: None (never stops early), one id, or a list of ids."""
    eos = [] if eos is None else [eos] if isinstance(eos, numbers.Integral) and not isinstance(eos, bool) else eos
    if not isinstance(eos, (list, tuple)) or any(
        isinstance(e, bool) or not isinstance(e, numbers.Integral) for e in eos
    ):
        raise CaptError(f"eos_token_id must be a token id, a list of them or None, got {eos!r}")
    return [int(e) for e in eos]


def next_token(logits: torch.Tensor, do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None,
               top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """(B, V) logits -> (B,) token ids: the argmax, or a sample after temperature, top-k and top-p."""
    logits = logits.float()
    if not do_sample:
        return logits.argmax(-1)
    # the top token at 0: no overflow for a small temperature
    logits = (logits - logits.amax(-1, keepdim=True)) / temperature
    if top_k is not None:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        ordered, order = logits.sort(-1, descending=True)
        probs = ordered.softmax(-1)
        drop = probs.cumsum(-1) - probs >= top_p  # outside the smallest set of likeliest tokens holding top_p
        drop[:, 0] = False  # the most likely token always stays
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]
