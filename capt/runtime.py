"""What a training process sets around its loop: Ctrl-C and SIGTERM wait until an optimizer step and its
bookkeeping are done and then stop the run with its state saved (capt/trainer.py: Interrupted); torch's
deterministic kernels while a run trains, on request (TrainConfig.deterministic).
"""

from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager

import torch


def _interrupt(signum, frame):
    raise KeyboardInterrupt


@contextmanager
def terminate_as_interrupt():
    """SIGTERM (kill, a job scheduler's stop) is handled like Ctrl-C while training: the state is saved first."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def hold_interrupt():
    """Delay Ctrl-C (and SIGTERM while training) until the block ends, so an optimizer step and its
    bookkeeping are never split."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    previous = {s: signal.signal(s, lambda *_: caught.append(True)) for s in (signal.SIGINT, signal.SIGTERM)
                if signal.getsignal(s) in (signal.default_int_handler, _interrupt)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if caught:
        raise KeyboardInterrupt


@contextmanager
def deterministic_kernels(on: bool):
    """config.deterministic: while it trains, torch takes a deterministic kernel wherever it has one
    and raises where it has none (torch.use_deterministic_algorithms), cuDNN does not search for the
    fastest (and possibly different) algorithm, and cuBLAS gets the fixed workspace it needs to repeat
    itself. Without it a GPU run need not repeat: CB's fp32 capsules on an H200 chose another
    checkpoint on a second run (docs/results.md). The settings are restored afterwards."""
    if not on:
        yield
        return
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.backends.cudnn.benchmark)
    # read when cuBLAS makes its handles: a process that ran a CUDA matmul before this point keeps its own
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.benchmark = before[2]
