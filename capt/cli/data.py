"""`make data`: download the official SuperGLUE release of the six tasks into data/superglue.

    python -m capt.cli.data [--out data/superglue] [--tasks boolq,cb,...]

Each task's zip holds <Task>/train.jsonl, val.jsonl and test.jsonl (test without labels, unused).
Needs a network connection; files already present are kept.
"""

from __future__ import annotations

import argparse
import http.client
import io
import sys
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

from ..errors import CaptError
from ..load import atomic_write
from ..tasks import TASKS, get_task

URL = "https://dl.fbaipublicfiles.com/glue/superglue/data/v2/{name}.zip"


DEADLINE = 1800.0  # seconds for a whole archive: a server that trickles bytes does not hold the command forever


def download(task: str, out: Path, timeout: float = 60.0, deadline: float | None = None) -> Path:
    """Fetch one task's official zip and write its train/val jsonl files under out/<Task>/; timeout bounds each
    read, deadline (default DEADLINE) the whole transfer."""
    dirname = get_task(task).dirname
    target = out / dirname
    if (target / "train.jsonl").is_file() and (target / "val.jsonl").is_file():
        return target
    url = URL.format(name=dirname)
    try:
        seconds = DEADLINE if deadline is None else deadline
        limit, chunks = time.monotonic() + seconds, []
        with urllib.request.urlopen(url, timeout=timeout) as response:
            while chunk := response.read(1 << 20):
                chunks.append(chunk)
                if time.monotonic() > limit:
                    raise CaptError(f"cannot download {url}: not finished within {seconds:g} s")
        payload = b"".join(chunks)
    # HTTPException: a cut-off read (IncompleteRead) too
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        raise CaptError(f"cannot download {url} ({getattr(e, 'reason', e)}): this needs a network connection") from None
    try:
        archive = zipfile.ZipFile(io.BytesIO(payload))
    except zipfile.BadZipFile:
        raise CaptError(f"{url} did not return a zip archive") from None
    for split in ("train", "val"):
        member = next((n for n in archive.namelist() if n.endswith(f"/{split}.jsonl") or n == f"{split}.jsonl"), None)
        if member is None:
            raise CaptError(f"{url} holds no {split}.jsonl")
        data = archive.read(member)
        atomic_write(target / f"{split}.jsonl", lambda tmp: Path(tmp).write_bytes(data))
    return target


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m capt.cli.data", description="Download the official SuperGLUE "
                                                                                 "jsonl files.")
    parser.add_argument("--out", type=Path, default=Path("data/superglue"), help="where the task folders go")
    parser.add_argument("--tasks", default="all", help="comma-separated task names, or all (default)")
    args = parser.parse_args(argv)
    names = list(TASKS) if args.tasks == "all" else [t.strip() for t in args.tasks.split(",") if t.strip()]
    try:
        for name in names:
            print(f"{name}: {download(name, args.out)}")
    except CaptError as e:
        print(f"capt: error: {e}".replace("\n", " "), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
