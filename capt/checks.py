"""Checks of values that come from files: each config.json field has its annotated type and a
sane range, so a bad checkpoint config ends in one line that names the field, never deep in
PyTorch. Used by the models' Config dataclasses (built from config.json)."""

from __future__ import annotations

import dataclasses
import math

from .errors import CaptError

MAX_POSITIONS = 1 << 21  # max_position_embeddings allowed: rope tables of this many rows are allocated on load
MAX_INT = (1 << 31) - 1  # an integer field's largest value: a size or token id beyond it is no real model's


def _is(value, kind: str) -> bool:
    """Whether value is of an annotated kind: None, bool, int, float, str, dict, list[int]."""
    if kind == "None":
        return value is None
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "float":  # a JSON number: an int counts, bool does not, and it must be finite
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if kind == "list[int]":
        return isinstance(value, list) and all(_is(v, "int") for v in value)
    return type(value).__name__ == kind  # str, dict


def check_fields(config, where: str, positive: tuple[str, ...] = (), at_least_zero: tuple[str, ...] = ()) -> None:
    """Every field of the dataclass `config` holds its annotated type (as a string: "int | None");
    the fields named in `positive` are > 0 and those in `at_least_zero` >= 0 where they are set."""
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if not any(_is(value, kind.strip()) for kind in field.type.split("|")):
            raise CaptError(f"{where}: {field.name} is {value!r} ({type(value).__name__}), but it must be {field.type}")
        values = value if isinstance(value, list) else [value]
        if any(_is(v, "int") and abs(v) > MAX_INT for v in values):
            raise CaptError(f"{where}: {field.name} is {value!r}, above {MAX_INT:,}, which no model's sizes or token ids reach")
        if field.name in positive and any(v is not None and v <= 0 for v in values):
            raise CaptError(f"{where}: {field.name} is {value!r}, but it must be above 0")
        if field.name in at_least_zero and any(v is not None and v < 0 for v in values):
            raise CaptError(f"{where}: {field.name} is {value!r}, but it must be 0 or more")
