import os

# Triton kernels run on the CPU through its interpreter when there is no GPU (set before import).
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    # Tiny models: one thread is faster than two contending for two cores. The processes the tests start get
    # one too, unless the environment says otherwise: their sums then run in the same order as the test's own.
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
except ImportError:  # pragma: no cover
    pass


import pytest  # noqa: E402

# seconds a test may take (bench/gpu.sh sets it); 0: no limit
TEST_TIMEOUT = int(os.environ.get("CAPT_TEST_TIMEOUT") or 0)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """CAPT_TEST_TIMEOUT: a test that runs longer fails with a line that says so (SIGALRM, the main thread), so a
    time-boxed run names the test that hung instead of being cut off whole."""
    if not TEST_TIMEOUT:
        yield
        return
    import signal

    def over(signum, frame):
        raise TimeoutError(f"{item.nodeid} ran past CAPT_TEST_TIMEOUT={TEST_TIMEOUT} s")

    previous = signal.signal(signal.SIGALRM, over)
    signal.alarm(TEST_TIMEOUT)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


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
