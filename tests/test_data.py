"""`make data`: the download path, with the network replaced by a fake."""

import http.client
import io
import urllib.error
import zipfile

import pytest

from capt import CaptError
from capt.cli import data


class FakeResponse(io.BytesIO):
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_download_writes_train_and_val(tmp_path, monkeypatch):
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        z.writestr("CB/train.jsonl", '{"idx": 0}\n')
        z.writestr("CB/val.jsonl", '{"idx": 1}\n')
        z.writestr("CB/test.jsonl", '{"idx": 2}\n')
    seen = []
    monkeypatch.setattr(
        data.urllib.request, "urlopen", lambda url, timeout: seen.append(url) or FakeResponse(buffer.getvalue())
    )
    target = data.download("cb", tmp_path)
    assert seen == ["https://dl.fbaipublicfiles.com/glue/superglue/data/v2/CB.zip"]
    assert (target / "train.jsonl").read_text() == '{"idx": 0}\n' and (
        target / "val.jsonl"
    ).read_text() == '{"idx": 1}\n'
    assert not (target / "test.jsonl").exists()
    data.download("cb", tmp_path)  # present: nothing fetched again
    assert len(seen) == 1


def test_offline_is_one_clear_error(tmp_path, monkeypatch, capsys):
    def offline(url, timeout):
        raise urllib.error.URLError("Name or service not known")

    monkeypatch.setattr(data.urllib.request, "urlopen", offline)
    with pytest.raises(
        CaptError, match=r"cannot download https://\S+/RTE\.zip \(Name or service not known\): this needs a network"
    ):
        data.download("rte", tmp_path)
    assert data.main(["--out", str(tmp_path), "--tasks", "rte"]) == 1
    assert capsys.readouterr().err.startswith("capt: error: cannot download")


@pytest.mark.parametrize(
    "failure", [http.client.IncompleteRead(b"PK\x03", 5000), http.client.RemoteDisconnected("closed")]
)
def test_cut_off_download_is_one_clear_error(tmp_path, monkeypatch, failure):
    class CutOff(FakeResponse):
        def read(self, *args):
            raise failure

    monkeypatch.setattr(data.urllib.request, "urlopen", lambda url, timeout: CutOff())
    with pytest.raises(
        CaptError, match=r"^cannot download https://\S+/CB\.zip \(.+\): this needs a network connection$"
    ):
        data.download("cb", tmp_path)
    assert not (tmp_path / "CB" / "train.jsonl").exists()


def test_a_trickling_download_ends_at_its_deadline(tmp_path, monkeypatch):
    """Each read is bounded by the socket timeout; the whole transfer by the deadline, so a server that sends a
    byte now and then cannot hold the command forever."""
    class Trickle(FakeResponse):
        def read(self, *args):
            return b"P"  # never the end

    monkeypatch.setattr(data.urllib.request, "urlopen", lambda url, timeout: Trickle())
    with pytest.raises(CaptError, match=r"^cannot download https://\S+/CB\.zip: not finished within 0.05 s$"):
        data.download("cb", tmp_path, deadline=0.05)
    assert not (tmp_path / "CB" / "train.jsonl").exists()
