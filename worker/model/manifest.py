"""``manifest.json``: sha256, size and a sampled hash of every file of a checkpoint folder.

Checkpoints are copied between machines and stores; a truncated or flipped byte in a 4 GB shard
would otherwise surface as garbage text much later. The manifest lets ``verify`` name the bad
file up front, and the loader refuses a folder that fails it unless told to skip the check.

Two checks read it:

- **full** (``cloverq model verify DIR``, every pull, ``CLOVERQ_VERIFY_ON_LOAD=full``): every byte
  of every file is hashed and compared with its ``sha256``;
- **quick** (what a worker does at start and at a version switch by default): every file's size,
  plus the ``sample_sha256`` of a few fixed chunks of it (``SAMPLE_CHUNKS`` windows of
  ``SAMPLE_CHUNK_BYTES``, spread evenly from the first byte to the last; the whole file when it
  is smaller than that). For a 4 GB shard that is 512 KiB read instead of 4 GB. It catches a
  missing, truncated, replaced, re-saved or partially copied file; it does not catch one flipped
  byte outside the sampled chunks, which is what the full check is for. The manifest was written
  by a full hash (at pull or by ``cloverq model manifest``), so a quick check trusts that record.
  Modification times are not used: copies and restores change them legitimately and they say
  nothing about the bytes. A file whose entry has no ``sample_sha256`` (a manifest written before
  sampling existed) is hashed in full by the quick check too.

``CheckReport.bytes_read`` counts what a check read, so a caller can show (and a test assert)
how little a quick check costs.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 2
SAMPLE_CHUNK_BYTES = 64 * 1024
SAMPLE_CHUNKS = 8
_CHUNK = 1 << 20

CheckMode = Literal["full", "quick"]
HashProgress = Callable[[str, int], None]  # (relative path, bytes just hashed)


class ManifestError(RuntimeError):
    """A checkpoint folder does not match its manifest (the message names every bad file)."""


class MissingManifestError(ManifestError):
    """The folder has no ``manifest.json`` (the message says how to write one)."""


@dataclass(frozen=True)
class FileProblem:
    path: str
    reason: str  # "missing", "size 12 != 34", "sha256 mismatch", ...

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


@dataclass
class CheckReport:
    """What one check of a folder against its manifest found and cost."""

    mode: CheckMode
    problems: list[FileProblem] = field(default_factory=list)
    files: int = 0
    bytes_total: int = 0  # sizes of the files the manifest lists
    bytes_read: int = 0  # what the check read of them
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def fraction_read(self) -> float:
        return self.bytes_read / self.bytes_total if self.bytes_total else 0.0

    def summary(self) -> str:
        return (
            f"{self.mode} check of {self.files} files: read {_human(self.bytes_read)} of "
            f"{_human(self.bytes_total)} ({100 * self.fraction_read:.3g}%) in {self.seconds:.2f}s"
        )


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"  # unreachable


def missing_manifest_message(folder: Path) -> str:
    return (
        f"{folder} has no {MANIFEST_NAME}: pull it into the store (`cloverq model pull {folder} --name "
        f"NAME --version V`) or write one in place (`cloverq model manifest {folder}`); "
        "CLOVERQ_SKIP_VERIFY=true loads it unchecked"
    )


# --- hashing ------------------------------------------------------------------------------------


def sample_windows(size: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of the chunks a quick check hashes in a file of ``size`` bytes.

    The whole file when it is at most ``SAMPLE_CHUNKS * SAMPLE_CHUNK_BYTES``; otherwise
    ``SAMPLE_CHUNKS`` windows spread evenly, the first at byte 0 and the last ending at the last
    byte. They never overlap (spacing > one window), so their concatenation is well defined.
    """
    if size <= SAMPLE_CHUNKS * SAMPLE_CHUNK_BYTES:
        return [(0, size)] if size else []
    span = size - SAMPLE_CHUNK_BYTES
    return [(i * span // (SAMPLE_CHUNKS - 1), SAMPLE_CHUNK_BYTES) for i in range(SAMPLE_CHUNKS)]


class FileDigest:
    """sha256 of a whole file and of its sample windows, fed in one pass in file order."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._full = hashlib.sha256()
        self._sample = hashlib.sha256()
        self._windows = sample_windows(size)
        self._pos = 0

    def update(self, chunk: bytes | memoryview) -> None:
        self._full.update(chunk)
        start, end = self._pos, self._pos + len(chunk)
        for offset, length in self._windows:
            lo, hi = max(start, offset), min(end, offset + length)
            if lo < hi:
                self._sample.update(chunk[lo - start : hi - start])
        self._pos = end

    @property
    def bytes_seen(self) -> int:
        return self._pos

    def entry(self) -> dict[str, Any]:
        """The manifest entry (valid once exactly ``size`` bytes were fed)."""
        return {"sha256": self._full.hexdigest(), "size": self._pos,
                "sample_sha256": self._sample.hexdigest()}


def digest_file(path: Path, *, relpath: str = "", on_progress: HashProgress | None = None) -> dict[str, Any]:
    """The manifest entry of ``path`` (one read of every byte)."""
    digest = FileDigest(path.stat().st_size)
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            if on_progress is not None:
                on_progress(relpath or path.name, len(chunk))
    return digest.entry()


def sha256_file(path: Path) -> str:
    return str(digest_file(path)["sha256"])


def sampled_sha256(path: Path) -> tuple[str, int]:
    """``(sample_sha256, bytes read)`` of ``path``: only its sample windows are read."""
    digest = hashlib.sha256()
    read = 0
    with path.open("rb") as f:
        for offset, length in sample_windows(path.stat().st_size):
            f.seek(offset)
            data = f.read(length)
            read += len(data)
            digest.update(data)
    return digest.hexdigest(), read


# --- writing ------------------------------------------------------------------------------------


def checkpoint_files(folder: Path) -> list[str]:
    """Relative paths of the files a manifest of ``folder`` lists: every regular file (symlinks
    followed, as in a Hugging Face cache snapshot) except the manifest and hidden paths
    (``.gitattributes``, ``.cache/`` of ``huggingface-cli download --local-dir``, ...)."""
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            path = Path(dirpath) / name
            rel = path.relative_to(folder).as_posix()
            if name.startswith(".") or rel == MANIFEST_NAME:
                continue
            if path.is_symlink() and not path.exists():
                raise ManifestError(f"{path} is a dangling symlink (an incomplete download?)")
            if not path.is_file():
                continue
            found.append(rel)
    return sorted(found)


def manifest_text(entries: dict[str, dict[str, Any]]) -> str:
    """The canonical ``manifest.json`` text of ``{relative path: entry}``."""
    manifest = {
        "version": MANIFEST_VERSION,
        "sample": {"chunk_bytes": SAMPLE_CHUNK_BYTES, "chunks": SAMPLE_CHUNKS},
        "files": dict(sorted(entries.items())),
    }
    return json.dumps(manifest, indent=2, sort_keys=True) + "\n"


def _entries(folder: Path, on_progress: HashProgress | None) -> dict[str, dict[str, Any]]:
    return {rel: digest_file(folder / rel, relpath=rel, on_progress=on_progress)
            for rel in checkpoint_files(folder)}


def build_manifest(folder: Path, *, on_progress: HashProgress | None = None) -> dict[str, object]:
    """The manifest of every checkpoint file under ``folder`` (see ``checkpoint_files``)."""
    return dict(json.loads(manifest_text(_entries(Path(folder), on_progress))))


def write_manifest(folder: Path, *, on_progress: HashProgress | None = None) -> str:
    """Write ``manifest.json`` into ``folder``; returns its digest (the checkpoint's identity)."""
    folder = Path(folder)
    text = manifest_text(_entries(folder, on_progress))
    (folder / MANIFEST_NAME).write_text(text)
    return hashlib.sha256(text.encode()).hexdigest()


def manifest_digest(folder: Path) -> str:
    """sha256 of ``manifest.json`` (identifies the checkpoint version cheaply); '' when absent."""
    path = Path(folder) / MANIFEST_NAME
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""


# --- checking -----------------------------------------------------------------------------------


def read_entries(folder: Path) -> dict[str, dict[str, Any]]:
    """The ``files`` mapping of ``folder``'s manifest; ``MissingManifestError`` when there is none,
    ``ManifestError`` when it is unreadable."""
    path = Path(folder) / MANIFEST_NAME
    if not path.is_file():
        raise MissingManifestError(missing_manifest_message(Path(folder)))
    try:
        entries = json.loads(path.read_text())["files"]
        if not isinstance(entries, dict) or not all(
            isinstance(e, dict) and isinstance(e.get("sha256"), str) and isinstance(e.get("size"), int)
            for e in entries.values()
        ):
            raise TypeError("every entry needs a sha256 string and an integer size")
    except (ValueError, KeyError, TypeError) as exc:
        raise ManifestError(f"{path} is unreadable ({type(exc).__name__}: {exc})") from exc
    return entries


def check(folder: Path, *, mode: CheckMode = "full", on_progress: HashProgress | None = None) -> CheckReport:
    """Check ``folder`` against its manifest in ``mode`` (module docstring); never raises for a
    bad file, a missing or unreadable manifest: each is a problem of the report."""
    folder = Path(folder)
    began = time.perf_counter()
    report = CheckReport(mode=mode)
    try:
        entries = read_entries(folder)
    except ManifestError as exc:
        reason = "missing" if isinstance(exc, MissingManifestError) else str(exc)
        report.problems.append(FileProblem(MANIFEST_NAME, reason))
        return report
    for rel, entry in sorted(entries.items()):
        report.files += 1
        report.bytes_total += int(entry["size"])
        problem = _check_file(folder, rel, entry, mode, report, on_progress)
        if problem is not None:
            report.problems.append(FileProblem(rel, problem))
    report.seconds = time.perf_counter() - began
    return report


def _check_file(
    folder: Path, rel: str, entry: dict[str, Any], mode: CheckMode, report: CheckReport,
    on_progress: HashProgress | None,
) -> str | None:
    file = folder / rel
    if not file.is_file():
        return "missing"
    size = file.stat().st_size
    if size != entry["size"]:
        return f"size {size} != {entry['size']} in manifest"
    sample = entry.get("sample_sha256")
    if mode == "quick" and isinstance(sample, str):
        got, read = sampled_sha256(file)
        report.bytes_read += read
        return None if got == sample else "sampled sha256 mismatch"
    got_entry = digest_file(file, relpath=rel, on_progress=on_progress)
    report.bytes_read += size
    if got_entry["sha256"] != entry["sha256"]:
        return "sha256 mismatch"
    if isinstance(sample, str) and got_entry["sample_sha256"] != sample:
        return "sampled sha256 mismatch (the manifest's sample_sha256 is wrong)"
    return None


def check_manifest(folder: Path, *, mode: CheckMode = "full") -> list[FileProblem]:
    """Every file that is missing or differs from the manifest (empty list: the folder is good)."""
    return check(folder, mode=mode).problems


def verify_manifest(folder: Path, *, mode: CheckMode = "full") -> CheckReport:
    """Raise ``ManifestError`` naming every bad or missing file (``MissingManifestError`` when there
    is no manifest at all); return the report of a folder that passes."""
    folder = Path(folder)
    report = check(folder, mode=mode)
    if report.problems == [FileProblem(MANIFEST_NAME, "missing")]:
        raise MissingManifestError(missing_manifest_message(folder))
    if report.problems:
        listing = "; ".join(str(p) for p in report.problems)
        raise ManifestError(f"checkpoint {folder} fails verification: {listing}")
    return report


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
