"""What methods (capt.methods) and loading (capt.load) rely on in a model: the contract that
capt.models.t5.Model and capt.models.llama.Model both keep, written down for a reader and for a new family;
tests check both families against it.

The capsule and the method record, None until capt.methods.attach fills them (detach empties them):

    model.method             the attached method's record (methods.MethodConfig); the forward reads
                             only its `integration` (None, "add", "prepend") and `tasks` (model.tasks:
                             the names of several capsule sets)
    block.capsule            (K, d)     p_l for each block of capsule_blocks() in S, row k for capsule
                                        set k (K = 1 for one set); the forward adds it inline
    block.capsule_active     (K,) bool  the sets that hold this block, when not all (a buffer)

The seams, None until a method of capt/baselines.py puts a module there; each acts on the call
that begins a sequence:

    model.front              module (x (B, T, d), mask (B, T)) -> rows (B, F, d) put in front of the
                             input embeddings before block 0; .length = F
    block.entry              module x (B, N, d) -> x: a change to the block's input
    attention.prefix         module (k, v) (B, Hkv, T, Dh) -> (k, v) with n columns in front;
                             .length = n, the same in every attention of prefix_attentions()
    attention.attend         ops.Attend, the attention core (capt/cli/analysis.py swaps it to keep the weights)
    model.linear_head        Linear(d, C) over features() (decoder-only models; baselines.classify)
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.nn as nn


@runtime_checkable
class CaptModel(Protocol):
    config: object  # the family's Config dataclass (config.json keys)
    seq2seq: bool  # True for encoder-decoder models (T5): targets are scored by the decoder
    capsule_width: int  # d, the width of a capsule vector
    method: object | None  # the method record: anything with `integration` and `tasks` attributes
    front: nn.Module | None
    linear_head: nn.Module | None
    tasks: list[str] | None  # the capsule sets' names when the model holds several (method.tasks), else None

    def capsule_blocks(self) -> nn.ModuleList: ...  # the stack that carries capsules (T5: the encoder's blocks)

    def prefix_attentions(self) -> list[nn.Module]: ...  # the attention modules that take prefix keys/values

    def prefix_shape(self) -> tuple[int, int]: ...  # (key/value heads, head dim) of one prefix

    # layer i's keys, values for its input h
    def prefix_key_values(self, i: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def input_embedding(self) -> nn.Embedding: ...  # the token embedding the stack reads

    def checkpoint_aliases(self) -> dict[str, str]: ...  # checkpoint keys that copy a model tensor (tied output)

    def checkpoint_unused(self) -> set[str]: ...  # checkpoint keys the model never reads

    def init_buffers(self, device: torch.device | str) -> None: ...  # rope tables etc., after the weights are assigned
