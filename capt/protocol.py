"""What methods (capt.methods) and loading (capt.load) rely on in a model: the contract that
capt.t5.Model and capt.llama.Model both keep, written down for a reader and for a new family;
tests check both families against it.

Method slots: None until capt.methods.attach fills them (detach empties them), declared the same
way in both families (register_parameter(name, None), or `= None` for modules):

    model.method                        the attached method's record (methods.MethodConfig); the
                                        forward reads only its `integration` (None, "add", "prepend")
                                        and `tasks` (model.tasks: the names of several capsule sets)
    model.prompt                        (n, d)         rows in front of the input embeddings
    block.capsule                       (d,)           p_l, for each block of capsule_blocks();
                                        (K, d)         with several capsule sets, row k for set k
    block.capsule_active                (K,) bool      the sets that hold this block, when not all (a buffer)
    block.deep_prompt                   (n, d)         rows replaced at each block's input
    attention.prefix_k / .prefix_v      (Hkv, n, Dh)   columns in front of each prefix attention's keys
    model.linear_head                   Linear(d, C)   decoder-only models; read by methods.classify
    model.pooled_tokens / block.pooled_before   int   k training-free instance tokens in front (methods.set_pooled)
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
    prompt: nn.Parameter | None
    linear_head: nn.Module | None
    tasks: list[str] | None  # the capsule sets' names when the model holds several (method.tasks), else None

    def capsule_blocks(self) -> nn.ModuleList: ...  # the stack that carries capsules (T5: the encoder's blocks)

    def prefix_attentions(self) -> list[nn.Module]: ...  # the attention modules that take prefix keys/values

    def prefix_shape(self) -> tuple[int, int]: ...  # (key/value heads, head dim) of one prefix

    def prefix_key_values(self, i: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...  # layer i's keys, values for its input h

    def input_embedding(self) -> nn.Embedding: ...  # the token embedding the stack reads

    def checkpoint_aliases(self) -> dict[str, str]: ...  # checkpoint keys that copy a model tensor (tied output)

    def checkpoint_unused(self) -> set[str]: ...  # checkpoint keys the model never reads

    def init_buffers(self, device: torch.device | str) -> None: ...  # rope tables etc., after the weights are assigned
