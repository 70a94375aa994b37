"""Hugging Face hub ids: `load_model("ORG/NAME")` and `--model ORG/NAME` through huggingface_hub.

A model string that is not an existing directory, has the form ORG/NAME, and whose ORG is not a
local directory either (so `weights/smollm2-135m-instruct` before `make weights` stays a missing
directory) is a hub id. It resolves to the snapshot folder that huggingface_hub keeps in its
cache (HF_HOME, HF_HUB_CACHE: the client's own rules), first from the cache alone, without a
network; only a model missing from the cache is downloaded, and only the files capt reads
(config.json, safetensors, the tokenizer files). HF_HUB_OFFLINE=1 forbids the download. A model
that is neither cached nor downloadable is one CaptError line saying so and how to get it.

huggingface_hub is optional (`pip install 'capt[hub]'`); without it a hub id is refused in one
line, and local directories need nothing from it.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from .errors import CaptError

# What capt reads from a checkpoint directory (capt/load.py, capt/tokenizer.py); pytorch_model.bin is never read.
FILES = [
    "config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "spiece.model",
]
REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
INSTALL = "pip install 'capt[hub]'"


def is_hub_id(model: str | os.PathLike) -> bool:
    """True when `model` (a string; a Path is always local) names a hub model rather than a local directory."""
    text = str(model)
    if isinstance(model, Path) or not REPO_ID.fullmatch(text) or ".." in text:
        return False
    return not Path(text).exists() and not Path(text.split("/")[0]).is_dir()


def model_reference(model: str | os.PathLike) -> str:
    """How a run records its model: a hub id as given, a directory as an absolute path."""
    return str(model) if is_hub_id(model) else str(Path(model).absolute())


def resolve_model(model: str | os.PathLike) -> Path:
    """The local directory of `model`: itself, or a hub id's snapshot folder (cached, else downloaded)."""
    if not isinstance(model, (str, os.PathLike)):
        raise CaptError("the model must be a checkpoint directory or a hub id ORG/NAME (a string or path), not "
                        f"{type(model).__name__}")
    if not is_hub_id(model):
        return Path(model)
    repo = str(model)
    try:
        # optional dependency: imported only when a hub id is used (it also costs import time)
        import huggingface_hub
        from huggingface_hub import constants
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        raise CaptError(f"{repo} is not a directory; to load it as a Hugging Face hub id, install huggingface_hub "
                        f"({INSTALL})") from None
    try:
        folder = huggingface_hub.snapshot_download(repo, local_files_only=True, allow_patterns=FILES)
    except LocalEntryNotFoundError:  # not in the cache, or an incomplete snapshot
        folder = None
    cache = constants.HF_HUB_CACHE
    if folder is None:
        if constants.HF_HUB_OFFLINE:
            raise CaptError(f"hub model {repo} is not in the local cache ({cache}) and HF_HUB_OFFLINE is set, so it is "
                            "not "
                            "downloaded; unset HF_HUB_OFFLINE on a machine with a network, or pass a checkpoint "
                            "directory")
        # said before the download starts: it may take long, and waits for another process fetching the same files
        print(f"capt: downloading {repo} from the Hugging Face hub into {cache} (HF_HUB_OFFLINE=1: never)",
              file=sys.stderr)
        try:
            folder = huggingface_hub.snapshot_download(repo, allow_patterns=FILES)
        except LocalEntryNotFoundError:  # no network, or the hub is down
            raise CaptError(f"hub model {repo} is not in the local cache ({cache}) and the hub cannot be reached to "
                            "download it; "
                            f"run once with a network connection (or `hf download {repo}`), or pass a checkpoint "
                            "directory") from None
        except Exception as e:  # the client's own errors: no such repository, gated, private, disk full ...
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise CaptError(f"hub model {repo} cannot be downloaded: {type(e).__name__}: {reason}") from None
    return Path(folder)
