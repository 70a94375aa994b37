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
