"""The model store: verified checkpoint versions under ``<root>/<name>/<version>/``.

Why it exists: weights are large and a worker must never load a half-copied or corrupted
checkpoint. A pull therefore has two stages that can never be confused from the outside:

1. download: every file the source's ``manifest.json`` lists is copied into a hidden temporary
   folder under the root (``.tmp-<uuid>``, same filesystem as the destination);
2. publish: the temporary folder is verified against the manifest and only then renamed into
   ``<root>/<name>/<version>``. ``os.rename`` of a directory is atomic on POSIX, so a reader sees
   either nothing or a complete, verified version.

Any failure (bad checksum, missing file, dropped connection, Ctrl-C) removes the temporary
folder; a crash that kills the process outright leaves only a hidden ``.tmp-*`` folder, which
``list_versions`` ignores and ``remove_stale_temporaries`` deletes. Versions are immutable:
pulling onto an existing version is refused, so switching or rolling back a version changes a
reference and never re-copies weights.

Sources: a local folder, a ``file://`` URL, or an ``http(s)://`` URL of a folder served over
HTTP (``manifest.json`` is fetched first, then each file it lists, streamed with httpx).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from urllib.parse import quote, unquote, urlparse

import httpx

from worker.model import manifest as model_manifest

MANIFEST_NAME = model_manifest.MANIFEST_NAME
TEMP_PREFIX = ".tmp-"
CHUNK_BYTES = 1 << 20  # 1 MiB per read/write

# Names and versions become path components: keep them boring (no separators, no leading dot,
# so they can never escape the root or collide with the hidden temporary folders).
_COMPONENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$")

ProgressCallback = Callable[[str, int], None]  # (relative file path, bytes just written)


class ModelStoreError(Exception):
    """A pull or lookup that cannot be done; the message says why."""


class VersionExistsError(ModelStoreError):
    """The version is already in the store (versions are immutable)."""


class VerificationError(ModelStoreError):
    """The downloaded files do not match the manifest; ``problems`` names every bad file."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("manifest verification failed: " + "; ".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class ModelVersion:
    """One complete, verified version in the store."""

    name: str
    version: str
    path: Path
    files: int  # files listed in its manifest (manifest.json itself excluded)
    size_bytes: int  # bytes on disk, manifest included


def validate_component(value: str, *, what: str) -> str:
    """Refuse a model name or version that is not a single safe path component."""
    if not _COMPONENT.match(value) or value in {".", ".."}:
        raise ModelStoreError(
            f"invalid {what} {value!r}: use letters, digits, '.', '_', '+', '-' (not leading)"
        )
    return value


def version_path(root: Path, name: str, version: str) -> Path:
    """Where ``name``/``version`` lives (or would live) in the store."""
    return (
        Path(root) / validate_component(name, what="model name") / validate_component(version, what="version")
    )


# --- sources ------------------------------------------------------------------------------------


class _LocalSource:
    """A checkpoint folder on a local (or mounted) filesystem."""

    def __init__(self, folder: Path) -> None:
        if not folder.is_dir():
            raise ModelStoreError(f"source folder not found: {folder}")
        self.folder = folder

    def read_manifest(self) -> bytes:
        path = self.folder / MANIFEST_NAME
        if not path.is_file():
            raise ModelStoreError(f"source has no {MANIFEST_NAME}: {self.folder}")
        return path.read_bytes()

    def chunks(self, relpath: str) -> Iterator[bytes]:
        path = self.folder / relpath
        if not path.is_file():
            raise VerificationError([f"{relpath}: missing at the source"])
        with path.open("rb") as fh:
            while chunk := fh.read(CHUNK_BYTES):
                yield chunk

    def close(self) -> None:
        """Nothing to release."""


class _HttpSource:
    """A checkpoint folder served over HTTP(S): ``<base>/manifest.json``, ``<base>/<file>``."""

    def __init__(self, base_url: str, *, timeout: float) -> None:
        self.base_url = base_url if base_url.endswith("/") else base_url + "/"
        self.client = httpx.Client(timeout=timeout, follow_redirects=True)

    def _url(self, relpath: str) -> str:
        return self.base_url + quote(relpath)  # keeps "/" between path components

    def read_manifest(self) -> bytes:
        try:
            response = self.client.get(self._url(MANIFEST_NAME))
        except httpx.HTTPError as exc:
            raise ModelStoreError(f"cannot fetch {MANIFEST_NAME} from {self.base_url}: {exc}") from exc
        if response.status_code != 200:
            raise ModelStoreError(
                f"cannot fetch {MANIFEST_NAME} from {self.base_url}: HTTP {response.status_code}"
            )
        return response.content

    def chunks(self, relpath: str) -> Iterator[bytes]:
        try:
            with self.client.stream("GET", self._url(relpath)) as response:
                if response.status_code == 404:
                    raise VerificationError([f"{relpath}: missing at the source (HTTP 404)"])
                if response.status_code != 200:
                    raise ModelStoreError(f"download of {relpath} failed: HTTP {response.status_code}")
                yield from response.iter_bytes(CHUNK_BYTES)
        except httpx.HTTPError as exc:  # dropped connection, truncated body, timeout
            raise ModelStoreError(f"download of {relpath} interrupted: {exc}") from exc

    def close(self) -> None:
        self.client.close()


def _open_source(src: str | Path, *, timeout: float) -> _LocalSource | _HttpSource:
    text = str(src)
    parsed = urlparse(text)
    if parsed.scheme in {"http", "https"}:
        return _HttpSource(text, timeout=timeout)
    if parsed.scheme == "file":
        if parsed.netloc not in {"", "localhost"}:
            raise ModelStoreError(f"file:// URL with a remote host is not supported: {text}")
        return _LocalSource(Path(unquote(parsed.path)))
    if parsed.scheme and len(parsed.scheme) > 1:  # a one-letter scheme is a Windows drive
        raise ModelStoreError(f"unsupported source scheme {parsed.scheme!r}: {text}")
    return _LocalSource(Path(text).expanduser())


# --- manifest -----------------------------------------------------------------------------------


def _safe_relpath(relpath: str) -> str:
    """Refuse manifest entries that would write outside the version folder."""
    pure = PurePosixPath(relpath)
    if (
        not relpath
        or pure.is_absolute()
        or "\\" in relpath
        or any(part in {"", ".", ".."} for part in relpath.split("/"))
        or relpath == MANIFEST_NAME
    ):
        raise ModelStoreError(f"manifest lists an unsafe path: {relpath!r}")
    return relpath


def _listed_files(manifest_bytes: bytes) -> dict[str, int | None]:
    """The files the manifest lists (``{"files": {path: {"sha256", "size"}}}``, see
    ``worker.model.manifest``), each with its expected size (None if not recorded)."""
    try:
        entries = json.loads(manifest_bytes)["files"]
        listed = {
            _safe_relpath(str(relpath)): (int(entry["size"]) if "size" in entry else None)
            for relpath, entry in entries.items()
        }
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ModelStoreError(f"{MANIFEST_NAME} is unreadable ({type(exc).__name__}: {exc})") from exc
    if not listed:
        raise ModelStoreError(f"{MANIFEST_NAME} lists no files")
    return listed


# --- pull ---------------------------------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in ``path`` durable (best effort on odd filesystems)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        # Some filesystems refuse fsync on a directory; the data files themselves are synced.
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def _check_free_space(root: Path, needed: int) -> None:
    """Refuse before downloading anything if the checkpoint cannot fit (weights are huge)."""
    free = shutil.disk_usage(root).free
    if needed > free:
        raise ModelStoreError(
            f"not enough disk space under {root}: the checkpoint needs {needed / 1e9:.1f} GB, "
            f"{free / 1e9:.1f} GB free"
        )


def _copy_file(
    source: _LocalSource | _HttpSource,
    relpath: str,
    dest: Path,
    expected_size: int | None,
    on_progress: ProgressCallback | None,
) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    written = 0
    with dest.open("wb") as fh:
        for chunk in source.chunks(relpath):
            fh.write(chunk)
            written += len(chunk)
            if expected_size is not None and written > expected_size:
                raise VerificationError([f"{relpath}: larger than the {expected_size} bytes listed"])
            if on_progress is not None:
                on_progress(relpath, len(chunk))
        fh.flush()
        os.fsync(fh.fileno())
    if expected_size is not None and written != expected_size:
        raise VerificationError([f"{relpath}: {written} bytes, manifest lists {expected_size}"])


def pull(
    src: str | Path,
    *,
    name: str,
    version: str,
    root: Path,
    timeout: float = 60.0,
    on_progress: ProgressCallback | None = None,
) -> ModelVersion:
    """Copy, verify and publish ``src`` as ``<root>/<name>/<version>``; return the new version.

    Raises ``VersionExistsError`` if the version is already there, ``VerificationError`` if a
    file is missing or does not match the manifest, ``ModelStoreError`` for anything else
    (unreachable source, interrupted download). On every failure nothing new is visible.
    """
    root = Path(root)
    final = version_path(root, name, version)
    if final.exists():
        raise VersionExistsError(f"{name}/{version} is already in the store at {final}")
    source = _open_source(src, timeout=timeout)
    root.mkdir(parents=True, exist_ok=True)
    temp = root / f"{TEMP_PREFIX}{uuid.uuid4().hex}"
    temp.mkdir()
    try:
        manifest_bytes = source.read_manifest()
        files = _listed_files(manifest_bytes)
        _check_free_space(root, sum(size or 0 for size in files.values()))
        for relpath, size in files.items():
            _copy_file(source, relpath, temp / relpath, size, on_progress)
        (temp / MANIFEST_NAME).write_bytes(manifest_bytes)
        problems = model_manifest.check_manifest(temp)
        if problems:
            raise VerificationError([str(problem) for problem in problems])
        _fsync_dir(temp)
        final.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(temp, final)  # atomic: readers see nothing or the verified version
        except OSError as exc:
            if final.exists():
                raise VersionExistsError(f"{name}/{version} appeared in the store meanwhile") from exc
            raise
        _fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    finally:
        source.close()
    return _describe(final, name=name, version=version, files=len(files))


# --- listing ------------------------------------------------------------------------------------


def _describe(path: Path, *, name: str, version: str, files: int) -> ModelVersion:
    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return ModelVersion(name=name, version=version, path=path, files=files, size_bytes=size)


def list_versions(root: Path, *, name: str | None = None) -> list[ModelVersion]:
    """Every complete version in the store (optionally of one model), sorted by name, version.

    Hidden folders (temporary downloads) and folders without a manifest are not versions.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    found: list[ModelVersion] = []
    if name is not None:
        validate_component(name, what="model name")
    model_dirs = [root / name] if name is not None else sorted(root.iterdir())
    for model_dir in model_dirs:
        if model_dir.name.startswith(".") or not model_dir.is_dir():
            continue
        for version_dir in sorted(model_dir.iterdir()):
            manifest_path = version_dir / MANIFEST_NAME
            if version_dir.name.startswith(".") or not manifest_path.is_file():
                continue
            try:
                files = len(_listed_files(manifest_path.read_bytes()))
            except ModelStoreError:
                continue
            found.append(_describe(version_dir, name=model_dir.name, version=version_dir.name, files=files))
    return found


def remove_stale_temporaries(root: Path, *, older_than_seconds: float = 24 * 3600) -> list[Path]:
    """Delete temporary download folders left by pulls that were killed; return what was removed.

    Only folders older than ``older_than_seconds`` go, so a pull still running is never touched.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    cutoff = time.time() - older_than_seconds
    removed = []
    for path in root.iterdir():
        if path.name.startswith(TEMP_PREFIX) and path.is_dir() and path.stat().st_mtime < cutoff:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
