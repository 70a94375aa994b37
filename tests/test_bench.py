"""bench/bench.py in its CPU mode: every kind of row runs, the JSON holds what docs/bench.md asks for.

The figures of a CPU run mean nothing; what is checked is that the script works and that the
transformers anchors compute the same thing as capt (same weights, same batch, so the same
first loss / scores in fp32): a yardstick that ran a different method would be no yardstick.
"""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
ROW_FIELDS = ["workload", "mode", "dtype", "impl", "batch", "length", "ms_step", "samples_s", "tokens_s", "flops", "flops_executed",
              "mfu", "mfu_executed", "peak_flops", "warmup_s", "peak_gb", "steps", "value", "error"]
MICRO_FIELDS = ["workload", "dtype", "impl", "shape", "h_bytes", "fwd_ms_loop", "bwd_ms_loop", "read_once_ms_at_4_3TBs",
                "read_once_ms_measured", "fwd_vs_read_once", "bwd_vs_read_once", "max_abs_diff_vs_reference", "error"]


def load_bench():
    spec = importlib.util.spec_from_file_location("capt_bench", ROOT / "bench" / "bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    threads, precision = torch.get_num_threads(), torch.get_float32_matmul_precision()
    yield load_bench()
    torch.set_num_threads(threads)
    torch.set_float32_matmul_precision(precision)
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def run(bench, tmp_path_factory):
    """Both families, both modes, capt + both anchors, fp32 (the agreement check needs fp32)."""
    out = tmp_path_factory.mktemp("bench") / "run.json"
    result = bench.main(["--cpu", "--workloads", "t5-base,llama-3.2-1b", "--dtypes", "fp32", "--no-compile", "--out", str(out)])
    return result, json.loads(out.read_text())


def test_rows_and_fields(run):
    _, saved = run
    rows = saved["rows"]
    expected = {(w, m, i) for w in ("t5-base", "llama-3.2-1b") for m in ("train", "eval") for i in ("capt", "hf-plain", "hf-best")}
    assert {(r["workload"], r["mode"], r["impl"]) for r in rows} == expected and len(rows) == len(expected)
    for r in rows:
        assert r["error"] is None, r
        missing = [f for f in ROW_FIELDS if f not in r]
        assert not missing, (r["impl"], missing)
        assert r["dtype"] == "fp32" and r["steps"] == 2 and r["ms_step"] > 0 and r["samples_s"] > 0 and r["flops"] > 0
        assert r["flops_executed"] >= r["flops"]  # an implementation never runs less than the step needs
        assert r["peak_gb"] is None  # no device memory counter on the CPU
        if r["impl"] == "capt":
            for key in ("vs_hf_plain", "vs_hf_best", "warmup_vs_hf_best", "target_vs_hf_plain", "target_vs_hf_best"):
                assert key in r and r[key] is not None, key
    plain_lm = next(r for r in rows if r["workload"] == "llama-3.2-1b" and r["mode"] == "train" and r["impl"] == "hf-plain")
    best_lm = next(r for r in rows if r["workload"] == "llama-3.2-1b" and r["mode"] == "train" and r["impl"] == "hf-best")
    assert plain_lm["flops_executed"] > best_lm["flops_executed"] == best_lm["flops"]  # logits at every position


def test_anchors_compute_the_same_method(run):
    """Same weights and batch: capt and both transformers anchors agree on the first loss / mean score."""
    _, saved = run
    for workload in ("t5-base", "llama-3.2-1b"):
        for mode in ("train", "eval"):
            values = {r["impl"]: r["value"] for r in saved["rows"] if (r["workload"], r["mode"]) == (workload, mode)}
            for impl in ("hf-plain", "hf-best"):
                assert math.isclose(values[impl], values["capt"], rel_tol=1e-4), (workload, mode, values)


def test_metadata_and_micro(run):
    result, saved = run
    env = saved["environment"]
    assert env["cpu_mode"] is True and "mean NOTHING" in env["note"]
    for key in ("date", "git_commit", "torch", "transformers", "device", "driver"):
        assert key in env
    assert set(saved["peaks"]) == {"bf16", "fp32"} and saved["rates"]["copy_bytes_s"] > 0
    assert "790 TFLOP/s" in saved["flop_convention"] and "logits" in saved["flop_convention"]
    micro = saved["micro"]
    assert {(m["workload"], m["impl"]) for m in micro} == {
        (w, i) for w in ("t5-base", "llama-3.2-1b")
        for i in ("fused (capt.fused)", "reference", "reference+compile", "refresh_slots (pool+add+cat)")}
    for m in micro:
        assert m["error"] is None, m
        assert not [f for f in MICRO_FIELDS if f not in m]
        assert m["max_abs_diff_vs_reference"] < 1e-5  # fp32: every implementation computes the reference
    assert saved["rows"] == json.loads(json.dumps(result["rows"]))


def test_mixed_batch_rows(run):
    """Many capsule sets on one model: the mixed batch scores each row as the task-by-task run does
    (fp32: the same numbers), differs from serving every row with one set, and reports its ratios."""
    _, saved = run
    mixed = saved["mixed"]
    assert [(m["workload"], m["dtype"]) for m in mixed] == [("t5-base", "fp32"), ("llama-3.2-1b", "fp32")]
    for m in mixed:
        assert m["error"] is None, m
        assert m["n_sets"] == 16 and 1 <= m["sets_in_batch"] <= m["batch"] and m["steps"] == 2
        assert m["single_task_ms"] > 0 and m["mixed_ms"] > 0 and m["by_task_ms"] > 0
        assert all(len(m["step_ms"][k]) == 2 for k in ("single_task", "mixed", "by_task"))
        assert m["mixed_vs_single"] > 0 and m["by_task_vs_mixed"] > 0 and m["target_mixed_vs_single"] == 1.05
        assert m["max_abs_diff_mixed_vs_by_task"] < 1e-5
        assert m["max_abs_diff_mixed_vs_single"] > 1e-3  # the rows' own sets change the scores


def test_compiled_capt_and_time_limit(bench, run, tmp_path):
    """capt+compile (dynamo only on the CPU) gives the eager value; rows past --time-limit are recorded as skipped."""
    _, saved = run
    out = tmp_path / "compiled.json"
    result = bench.main(["--cpu", "--workloads", "llama-3.2-1b", "--modes", "train", "--dtypes", "fp32", "--compile",
                         "--anchors", "", "--no-micro", "--out", str(out)])
    (row,) = result["rows"]
    assert row["impl"] == "capt+compile" and row["error"] is None and row["compile"]["backend"] == "eager"
    eager = next(r for r in saved["rows"] if (r["workload"], r["mode"], r["impl"]) == ("llama-3.2-1b", "train", "capt"))
    assert math.isclose(row["value"], eager["value"], rel_tol=1e-5)

    skipped = bench.main(["--cpu", "--workloads", "t5-base", "--modes", "eval", "--dtypes", "fp32", "--no-micro",
                          "--time-limit", "0", "--out", str(tmp_path / "skipped.json")])
    assert [r["impl"] for r in skipped["rows"]] == ["capt", "capt+compile", "hf-plain", "hf-best"]
    assert all(r["error"].startswith("skipped") for r in skipped["rows"] + skipped["mixed"]) and len(skipped["mixed"]) == 1


def test_script_as_make_bench_runs_it(tmp_path):
    """`python bench/bench.py` in a fresh process (Triton's interpreter must be chosen before Triton loads)."""
    out = tmp_path / "micro.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "bench.py"), "--cpu", "--micro-only", "--workloads", "llama-3.2-1b",
                           "--dtypes", "bf16", "--out", str(out)], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "mean NOTHING" in done.stdout
    micro = json.loads(out.read_text())["micro"]
    assert len(micro) == 4 and all(m["error"] is None for m in micro), [m["error"] for m in micro]
    assert all(m["max_abs_diff_vs_reference"] < 2e-2 for m in micro)  # bf16 input, fp32 reference
