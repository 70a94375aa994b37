"""capt: Capsule Prompt-Tuning on hand-written T5, Llama and Qwen2 models.

    from capt import load_model, load_tokenizer, CapsuleConfig, save_capsules, count_trainable
"""

import importlib.util
import sys

_missing = [name for name in ("torch", "safetensors", "tokenizers") if importlib.util.find_spec(name) is None]
if _missing:  # `python3 -m capt` with a Python that lacks them: one line, not a traceback
    raise SystemExit(f"capt: error: {', '.join(_missing)} not installed for {sys.executable}; run `make setup` and use "
                     ".venv/bin/capt (or `source .venv/bin/activate`)")

from .errors import CaptError  # noqa: E402
from .load import count_trainable, load_model, save_capsules, trainable_summary  # noqa: E402
from .methods import CapsuleConfig  # noqa: E402
from .tokenizer import load_tokenizer  # noqa: E402

__all__ = [
    "CaptError",
    "CapsuleConfig",
    "count_trainable",
    "load_model",
    "load_tokenizer",
    "save_capsules",
    "trainable_summary",
]
__version__ = "0.1.0"
