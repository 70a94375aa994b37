import os

# Triton kernels run on the CPU through its interpreter when there is no GPU (set before import).
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    # Tiny models: one thread is faster than two contending for two cores.
    torch.set_num_threads(1)
except ImportError:  # pragma: no cover
    pass


import pytest  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def weights_cache(tmp_path_factory):
    """capt's cache of weight hashes (load.weights_fingerprint) in a folder of the session's, not ~/.cache."""
    os.environ["CAPT_CACHE"] = str(tmp_path_factory.mktemp("capt-cache"))
    return os.environ["CAPT_CACHE"]


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory):
    """Tiny random Llama and T5 checkpoints with tokenizers, built once for the pipeline tests (read only)."""
    from helpers import tiny_llama, tiny_t5

    root = tmp_path_factory.mktemp("ckpt")
    return {"llama": tiny_llama(root / "llama"), "t5": tiny_t5(root / "t5")}
