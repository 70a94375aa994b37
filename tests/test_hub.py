"""Hugging Face hub ids (capt/hub.py): a model in a hub cache laid out as huggingface_hub lays it out
loads by its id offline, through load_model, load_tokenizer and the command line, with the same
logits as its directory; what is not cached while offline, a failed download and a missing client
are each one line; local paths are never taken for hub ids."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import hub_cache, write_superglue

import capt.hub as hub
from capt import load_model
from capt.cli.main import main
from capt.errors import CaptError

huggingface_hub = pytest.importorskip("huggingface_hub")
LocalEntryNotFoundError = pytest.importorskip("huggingface_hub.errors").LocalEntryNotFoundError
ROOT = Path(__file__).resolve().parents[1]
REPO = "capt-tests/tiny-llama"


@pytest.fixture(scope="module")
def cache(ckpts, tmp_path_factory):
    """HF_HOME with REPO in its hub cache (HF_HOME/hub), holding the tiny Llama checkpoint's files."""
    home = tmp_path_factory.mktemp("hf_home")
    hub_cache(home / "hub", REPO, ckpts["llama"])
    return home


def offline_env(home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_"))}
    return {**env, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


def test_the_cache_is_laid_out_as_the_client_reads_it(cache, ckpts):
    info = huggingface_hub.scan_cache_dir(cache / "hub")
    (repo,) = info.repos
    assert repo.repo_id == REPO and repo.repo_type == "model"
    (revision,) = repo.revisions
    assert revision.refs == frozenset({"main"})
    assert {f.file_name for f in revision.files} == {p.name for p in Path(ckpts["llama"]).iterdir()}


def test_a_cached_hub_id_loads_offline_like_its_directory(cache, ckpts, tmp_path):
    """In a fresh process with HF_HOME and HF_HUB_OFFLINE=1 set, as a user would: the API and the CLI."""
    data = write_superglue(tmp_path / "data", {"CB": (0, 6)})
    script = f"""
import json, torch
from capt import load_model, load_tokenizer
from capt.cli.main import main
hub_model, local = load_model({REPO!r}), load_model({str(ckpts["llama"])!r})
ids = torch.tensor([load_tokenizer({REPO!r}).encode("cb hypothesis: it rained premise: the man said it rained.")])
text = "cb hypothesis: it rained premise: the man said it rained."
assert ids.tolist() == [load_tokenizer({str(ckpts["llama"])!r}).encode(text)]
print(json.dumps({{"equal": torch.equal(hub_model(ids), local(ids)), "source": hub_model.source["path"]}}))
main(["eval", "--model", {REPO!r}, "--task", "cb", "--data", {str(data)!r}, "--device", "cpu", "--json"])
main(["eval", "--model", {str(ckpts["llama"])!r}, "--task", "cb", "--data", {str(data)!r}, "--device", "cpu", "--json"])
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=offline_env(cache), cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    loaded, by_id, by_dir = [json.loads(line) for line in result.stdout.splitlines()]
    assert loaded["equal"] is True
    assert loaded["source"].startswith(str(cache / "hub" / "models--capt-tests--tiny-llama" / "snapshots"))
    assert by_id["metrics"] == by_dir["metrics"] and by_id["loss"] == by_dir["loss"]


def test_not_cached_while_offline_is_one_line(cache, tmp_path):
    data = write_superglue(tmp_path / "data", {"CB": (0, 6)})
    result = subprocess.run(
        [sys.executable, "-m", "capt", "eval", "--model", "capt-tests/not-cached", "--task", "cb", "--data", data],
        capture_output=True,
        text=True,
        env=offline_env(cache),
        cwd=tmp_path,
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert lines[0].startswith("capt: error: hub model capt-tests/not-cached is not in the local cache")
    assert "HF_HUB_OFFLINE" in lines[0] and str(cache / "hub") in lines[0]


class FakeClient:
    """snapshot_download as the client behaves: cache misses raise LocalEntryNotFoundError; records every call."""

    def __init__(self, folder=None, download_error=None):
        self.calls, self.folder, self.download_error = [], folder, download_error

    def __call__(self, repo_id, **kwargs):
        self.calls.append((repo_id, kwargs))
        if kwargs.get("local_files_only"):
            raise LocalEntryNotFoundError("not cached")
        if self.download_error is not None:
            raise self.download_error
        return str(self.folder)


@pytest.fixture
def online(monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)


def test_a_model_missing_from_the_cache_is_downloaded_when_allowed(ckpts, monkeypatch, online):
    client = FakeClient(folder=ckpts["llama"])
    monkeypatch.setattr(huggingface_hub, "snapshot_download", client)
    assert hub.resolve_model("some-org/some-model") == Path(ckpts["llama"])
    (first, cache_only), (second, download) = client.calls
    assert first == second == "some-org/some-model"
    assert cache_only["local_files_only"] is True and not download.get("local_files_only")
    assert download["allow_patterns"] == hub.FILES and "*.safetensors" in hub.FILES and "config.json" in hub.FILES


@pytest.mark.parametrize("error,fragment", [
    (LocalEntryNotFoundError("connection refused"), "the hub cannot be reached to download it"),
    (RuntimeError("401 Client Error\nRepository Not Found"), "cannot be downloaded: RuntimeError: 401 Client Error"),
])
def test_a_failed_download_is_one_line(monkeypatch, online, error, fragment):
    monkeypatch.setattr(huggingface_hub, "snapshot_download", FakeClient(download_error=error))
    with pytest.raises(CaptError) as e:
        hub.resolve_model("some-org/some-model")
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_offline_never_downloads(monkeypatch):
    client = FakeClient()
    monkeypatch.setattr(huggingface_hub, "snapshot_download", client)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(CaptError, match="HF_HUB_OFFLINE is set"):
        hub.resolve_model("some-org/some-model")
    assert [kwargs["local_files_only"] for _, kwargs in client.calls] == [True]


def test_without_the_client_a_hub_id_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import huggingface_hub now fails
    with pytest.raises(CaptError, match=r"some-org/some-model is not a directory; .*pip install 'capt\[hub\]'"):
        hub.resolve_model("some-org/some-model")


def test_local_paths_are_never_hub_ids(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "weights").mkdir()
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert hub.is_hub_id("some-org/some-model")
    assert not hub.is_hub_id("weights/smollm2-135m-instruct")  # its ORG is a local directory: a missing checkpoint
    assert not hub.is_hub_id("org/name")  # an existing directory
    for path in ("/abs/model", "./org/x", "../org/x", "a/b/c", "model", "org/", "~/x", "org/.."):
        assert not hub.is_hub_id(path), path
    assert not hub.is_hub_id(Path("some-org/some-model"))  # a Path is a path
    assert hub.model_reference("some-org/some-model") == "some-org/some-model"
    assert hub.model_reference("org/name") == str(tmp_path / "org" / "name")
    with pytest.raises(CaptError, match="model directory not found: weights/smollm2"):
        load_model("weights/smollm2-135m-instruct")


def test_a_run_on_a_hub_id_records_the_id(ckpts, tmp_path, monkeypatch, capsys):
    """config.json keeps the id, not a path, so --resume finds the model again (through the cache) elsewhere."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo_id, **kwargs: str(ckpts["llama"]))  # "cached"
    data = write_superglue(tmp_path / "data", {"CB": (20, 6)})
    argv = [
        "train",
        "--model",
        "some-org/some-model",
        "--task",
        "cb",
        "--out",
        "run",
        "--data",
        str(data),
        "--epochs",
        "1",
        "--batch-size",
        "8",
        "--max-steps",
        "1",
        "--device",
        "cpu",
    ]
    assert main(argv) == 0
    assert json.loads((tmp_path / "run" / "config.json").read_text())["model"] == "some-org/some-model"
    assert main(["train", "--out", "run", "--resume"]) == 0  # the model comes from the run's config.json: the id
    assert capsys.readouterr().out.count("cb test (6 examples)") == 2
