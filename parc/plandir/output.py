"""Writing a plan directory without losing what a user has there.

`-o` may name a new directory, an empty one, or a plan directory parc wrote; a plan is written
into a staging directory beside it and swapped in whole once complete (`replace_dir`), so a
failed plan leaves the old one as it was.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from parc.errors import UsageError
from parc.plandir.manifest import MANIFEST, plan_files


def check_output(out: Path) -> None:
    """Refuse an `-o` that is not new, empty or a plan directory parc wrote (nothing else is
    overwritten)."""
    if not out.exists():
        if not out.parent.resolve().is_dir():
            raise UsageError(f"-o {out}: directory {out.parent} does not exist")
        return
    if not out.is_dir():
        raise UsageError(f"-o {out}: exists and is not a directory; refusing to overwrite it")
    if not any(out.iterdir()):
        return
    manifest = out / MANIFEST
    if not manifest.is_file():
        raise UsageError(f"-o {out}: exists and is not a plan directory (no {MANIFEST}); refusing to overwrite it")
    listed = set(json.loads(manifest.read_text()).get("files", {}))
    extra = [p.relative_to(out).as_posix() for p in plan_files(out) if p.relative_to(out).as_posix() not in listed]
    if extra:
        raise UsageError(f"-o {out}: the plan directory holds {extra[0]}, which parc did not write; "
                         f"move it or plan into another directory")


@contextmanager
def staged(out: Path) -> Iterator[Path]:
    """A fresh staging directory beside `out`; on success it replaces `out` whole, on any error
    it is removed and `out` is left as it was."""
    stage = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    try:
        yield stage
        replace_dir(stage, out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


def replace_dir(new: Path, out: Path) -> None:
    """Put the finished plan directory `new` at `out` (the old plan is removed after the swap)."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(old)
    new.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
