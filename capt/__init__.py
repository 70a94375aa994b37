"""capt: Capsule Prompt-Tuning on hand-written T5, Llama and Qwen2 models.

    from capt import load_model, load_tokenizer, CapsuleConfig, save_capsules, count_trainable
"""

from .errors import CaptError
from .load import count_trainable, load_model, save_capsules, trainable_summary
from .methods import CapsuleConfig
from .tokenizer import load_tokenizer

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
