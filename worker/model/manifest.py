"""``manifest.json``: sha256 and size of every file of a checkpoint folder.

Checkpoints are copied between machines and stores; a truncated or flipped byte in a 4 GB shard
would otherwise surface as garbage text much later. The manifest lets ``verify`` name the bad
file up front, and the loader refuses a folder that fails it unless told to skip the check.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

MANIFEST_NAME = "manifest.json"
_CHUNK = 1 << 20


class ManifestError(RuntimeError):
    """A checkpoint folder does not match its manifest (the message names every bad file)."""


@dataclass(frozen=True)
class FileProblem:
    path: str
    reason: str  # "missing", "size 12 != 34", "sha256 mismatch", ...

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def build_manifest(folder: Path) -> dict[str, object]:
    """The manifest of every regular file under ``folder`` except the manifest itself."""
    files = {
        p.relative_to(folder).as_posix(): {"sha256": sha256_file(p), "size": p.stat().st_size}
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p != folder / MANIFEST_NAME
    }
    return {"version": 1, "files": files}


def write_manifest(folder: Path) -> str:
    """Write ``manifest.json`` into ``folder``; returns its digest (the checkpoint's identity)."""
    text = json.dumps(build_manifest(folder), indent=2, sort_keys=True) + "\n"
    (folder / MANIFEST_NAME).write_text(text)
    return hashlib.sha256(text.encode()).hexdigest()


def manifest_digest(folder: Path) -> str:
    """sha256 of ``manifest.json`` (identifies the checkpoint version cheaply); '' when absent."""
    path = Path(folder) / MANIFEST_NAME
    return sha256_file(path) if path.is_file() else ""


def check_manifest(folder: Path) -> list[FileProblem]:
    """Every file that is missing or differs from the manifest (empty list: the folder is good)."""
    folder = Path(folder)
    path = folder / MANIFEST_NAME
    if not path.is_file():
        return [FileProblem(MANIFEST_NAME, "missing")]
    try:
        entries = json.loads(path.read_text())["files"]
    except (ValueError, KeyError, TypeError) as exc:
        return [FileProblem(MANIFEST_NAME, f"unreadable ({exc})")]
    problems: list[FileProblem] = []
    for rel, entry in sorted(entries.items()):
        file = folder / rel
        if not file.is_file():
            problems.append(FileProblem(rel, "missing"))
            continue
        size = file.stat().st_size
        if size != entry["size"]:
            problems.append(FileProblem(rel, f"size {size} != {entry['size']} in manifest"))
        elif sha256_file(file) != entry["sha256"]:
            problems.append(FileProblem(rel, "sha256 mismatch"))
    return problems


def verify_manifest(folder: Path) -> None:
    """Raise ``ManifestError`` naming every bad or missing file."""
    problems = check_manifest(folder)
    if problems:
        listing = "; ".join(str(p) for p in problems)
        raise ManifestError(f"checkpoint {folder} fails verification: {listing}")


def manifest_entries(manifest: dict[str, object]) -> dict[str, int | None]:
    """``relative path -> size`` (None when not recorded) of a parsed manifest."""
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise ManifestError("manifest has no 'files' mapping")
    return {
        str(rel): (int(entry["size"]) if isinstance(entry, dict) and "size" in entry else None)
        for rel, entry in files.items()
    }


def verify_dir(folder: Path) -> list[str]:
    """Every problem of ``folder`` against its manifest as ``"path: reason"`` strings."""
    return [str(p) for p in check_manifest(folder)]
