"""The base models' linear layers on oneDNN's packed weights on the CPU, swapped in by loading.

The model files build plain nn.Linear layers. capt.load.load_model then replaces every one of
them (pack_linears) with a PackedLinear holding the same parameters (the same checkpoint keys):
the base model is frozen, so its weights can be reordered once into oneDNN's blocked layout,
which PyTorch's CPU build carries, and larger products run faster there than on F.linear
(docs/speed.md has the measurements). A model built by hand, or one whose layers were not
swapped, computes on F.linear throughout.

The packed copy is made on first use and kept beside the plain weight (state_dict reads the plain
one), so on the CPU the linear weights take twice their memory. Outputs equal F.linear's up to
float rounding (the sums run in another order), so a training run's steps differ from an unpacked
run's by that rounding: CAPT_CPU_PACK=0 gives F.linear everywhere.
"""

from __future__ import annotations

import os
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

# CAPT_CPU_PACK=0 (or setting this to False) keeps every product on F.linear.
PACK_ON_CPU = os.environ.get("CAPT_CPU_PACK", "1") != "0"
# Fewer rows than this (a decoding step, a small batch) stay on F.linear: there the packed call's
# fixed cost was as large as the product (bench/packed_linear_cpu.py).
PACK_MIN_ROWS = 128
_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
# Linear -> (weight it was packed from, version, packed)
_PACKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _PackedFrozen(torch.autograd.Function):
    """x W^T + b on the packed weight, for a frozen W and b: the gradient reaches x only, as grad @ W,
    the product F.linear's own backward runs for x. Nothing of x is kept for the backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, packed):
        ctx.save_for_backward(weight)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        return grad.matmul(weight), None, None, None


class PackedLinear(nn.Linear):
    """nn.Linear (the same parameters and checkpoint keys) that runs on oneDNN's packed weights where that
    serves: a frozen weight and bias (in training the gradient flows through x alone, as grad @ W, with
    F.linear's product), fp32 on the CPU, inputs of PACK_MIN_ROWS rows or more, outside torch.compile
    (which packs by itself) and outside torch.distributed (FSDP refills the weights on every step);
    everything else is F.linear. A weight changed in place (copy_, load_state_dict) or replaced (.to) is
    packed again; a change made through `.data` is not seen: turn packing off around it.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.packs(x):
            return F.linear(x, self.weight, self.bias)
        if torch.is_grad_enabled() and x.requires_grad:
            return _PackedFrozen.apply(x, self.weight, self.bias, self.packed_weight())
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight(), self.bias, "none", [], "")

    def packs(self, x: torch.Tensor) -> bool:
        """Whether this call runs on the packed weight."""
        w, b = self.weight, self.bias
        trains_weight = torch.is_grad_enabled() and (w.requires_grad or (b is not None and b.requires_grad))
        return (
            PACK_ON_CPU
            and _ONEDNN
            and not trains_weight
            and x.device.type == "cpu"
            and x.dtype == w.dtype == torch.float32
            and x.dim() > 0
            and x.numel() >= PACK_MIN_ROWS * max(x.shape[-1], 1)
            and not torch.compiler.is_compiling()
            and not (dist.is_available() and dist.is_initialized())
        )

    def packed_weight(self) -> torch.Tensor:
        w = self.weight
        held = _PACKED.get(self)
        # the entry holds the weight it was packed from, so its memory cannot be reused by another tensor
        if held is None or held[0].data_ptr() != w.data_ptr() or held[0].shape != w.shape or held[1] != w._version:
            held = (w.detach(), w._version, torch.ops.mkldnn._reorder_linear_weight(w.detach()))
            _PACKED[self] = held
        return held[2]


def pack_linears(model: nn.Module) -> nn.Module:
    """Replace every plain nn.Linear of `model` by a PackedLinear holding the same parameters (in place, on
    any device, the meta device included: nothing is copied). Returns the model."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                packed = PackedLinear(child.in_features, child.out_features, bias=child.bias is not None, device="meta")
                packed.weight, packed.bias = child.weight, child.bias
                setattr(parent, name, packed)
    return model
