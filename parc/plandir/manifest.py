"""manifest.json of a plan directory: the sha256 of every file, so a tampered or incomplete
directory is refused before anything reads it (DESIGN: the plan directory contract).

Format (`format` "parc.manifest/1"): {"format": ..., "files": {relative posix path: {"sha256":
hex, "bytes": size}}}. Every regular file under the directory except manifest.json itself is
listed; symbolic links, paths leaving the directory and ONNX external data outside it (or not
listed) are refused.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from parc.errors import PlanFormatError

MANIFEST = "manifest.json"
FORMAT = "parc.manifest/1"
_CHUNK = 1 << 20


_ZEROS = bytes(_CHUNK)


def sha256_file(path: Path) -> str:
    """The file's sha256. Holes of a sparse file (weight shards of zoo models, fresh optimizer
    state) are hashed as the zeros they read as, without reading them: the kernel's zero-filled
    reads made a large model's multi-rank manifest slow (benchmarks/LOG.md, 2026-11-22, issue 5)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        fd, size, pos = f.fileno(), os.fstat(f.fileno()).st_size, 0
        while pos < size:
            try:
                data = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError:  # ENXIO: only a hole is left (or SEEK_DATA is unsupported: read all)
                data = size if _has_seek_data(fd) else pos
            for _ in range((data - pos) // _CHUNK):
                h.update(_ZEROS)
            h.update(_ZEROS[:(data - pos) % _CHUNK])
            pos = data
            if pos >= size:
                break
            try:
                end = os.lseek(fd, pos, os.SEEK_HOLE)
            except OSError:
                end = size
            f.seek(pos)
            while pos < end:
                chunk = f.read(min(_CHUNK, end - pos))
                if not chunk:
                    break
                h.update(chunk)
                pos += len(chunk)
    return h.hexdigest()


def _has_seek_data(fd: int) -> bool:
    try:
        os.lseek(fd, 0, os.SEEK_DATA)
        return True
    except OSError as e:
        return e.errno == 6  # ENXIO: supported, the file is one hole


def plan_files(root: Path) -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            path = Path(dirpath) / name
            rel = path.relative_to(root)
            if rel.as_posix() == MANIFEST or name.endswith(".tmp"):
                continue
            if path.is_symlink():
                raise PlanFormatError(f"{root}: {rel.as_posix()} is a symbolic link; a plan directory holds "
                                      f"plain files only")
            out.append(path)
    return out


def write_manifest(plan_dir: str | Path) -> Path:
    """Hash every file of the plan directory into PLAN_DIR/manifest.json (atomically)."""
    from concurrent.futures import ThreadPoolExecutor

    root = Path(plan_dir)
    paths = list(plan_files(root))
    with ThreadPoolExecutor(max(1, min(os.cpu_count() or 1, 8))) as pool:  # hashlib frees the GIL
        digests = list(pool.map(sha256_file, paths))
    files = {p.relative_to(root).as_posix(): {"sha256": d, "bytes": p.stat().st_size}
             for p, d in zip(paths, digests)}
    tmp = root / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"format": FORMAT, "files": files}, indent=1, sort_keys=True) + "\n")
    tmp.replace(root / MANIFEST)
    return root / MANIFEST


def check_manifest(plan_dir: str | Path, *, extra_ok: bool = False) -> dict[str, dict]:
    """The manifest's file table, or PlanFormatError naming the first file that does not match
    (missing, changed, or, unless `extra_ok`, not listed) or what is wrong with the manifest."""
    root = Path(plan_dir)
    path = root / MANIFEST
    if not path.is_file():
        raise PlanFormatError(f"{root}: no {MANIFEST} (was the plan directory written by `parc plan`?)")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PlanFormatError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("files"), dict):
        found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise PlanFormatError(f"{path}: unknown manifest format {found!r} (this parc reads {FORMAT!r})")
    files = doc["files"]
    resolved = root.resolve()
    for rel, entry in sorted(files.items()):
        target = (root / rel).resolve()
        if resolved not in target.parents:
            raise PlanFormatError(f"{path}: entry {rel!r} leaves the plan directory")
        if not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str):
            raise PlanFormatError(f"{path}: entry {rel!r}: expected {{\"sha256\": hex, \"bytes\": size}}")
        if not target.is_file():
            raise PlanFormatError(f"{root}: {rel} is listed in {MANIFEST} but missing")
        if sha256_file(target) != entry["sha256"]:
            raise PlanFormatError(f"{root}: {rel} does not match its sha256 in {MANIFEST} (changed after "
                                  f"`parc plan` wrote it)")
    for p in [] if extra_ok else plan_files(root):
        rel = p.relative_to(root).as_posix()
        if rel not in files:
            raise PlanFormatError(f"{root}: {rel} is not listed in {MANIFEST}")
    for rel in sorted(files):
        if rel.endswith(".onnx"):
            check_external_data(root, rel, files)
    return files


def check_external_data(root: Path, rel: str, files: dict) -> None:
    """Refuse an ONNX file of the plan whose external data lies outside the plan directory or
    is not a file the manifest lists."""
    import onnx

    path = root / rel
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # protobuf raises its own types
        raise PlanFormatError(f"{root}: {rel} is not a readable ONNX model ({e})") from None
    resolved = root.resolve()
    for t in model.graph.initializer:
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        location = next((e.value for e in t.external_data if e.key == "location"), "")
        target = (path.parent / location).resolve()
        if resolved not in target.parents:
            raise PlanFormatError(f"{root}: {rel}: initializer '{t.name}' reads external data from "
                                  f"{location!r}, outside the plan directory")
        if target.relative_to(resolved).as_posix() not in files:
            raise PlanFormatError(f"{root}: {rel}: initializer '{t.name}' reads external data from "
                                  f"{location!r}, which {MANIFEST} does not list")
