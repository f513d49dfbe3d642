"""The model store: verified checkpoint versions under ``<root>/<name>/<version>/``.

Why it exists: weights are large and a worker must never load a half-copied or corrupted
checkpoint. A pull therefore has two stages that can never be confused from the outside:

1. download: every file of the source is copied (or hard-linked) into a hidden temporary folder
   under the root (``.tmp-<uuid>``, same filesystem as the destination) and hashed on the way, once:
   sha256 of every byte plus the sampled hash of ``worker.model.manifest``;
2. publish: the hashes are compared with the source's ``manifest.json`` when it has one (a full
   verification), the version's ``manifest.json`` is written, and only then is the folder renamed
   into ``<root>/<name>/<version>``. ``os.rename`` of a directory is atomic on POSIX, so a reader
   sees either nothing or a complete, verified version.

Any failure (bad checksum, missing file, dropped connection, Ctrl-C) removes the temporary
folder; a crash that kills the process outright leaves only a hidden ``.tmp-*`` folder, which
``list_versions`` ignores and ``remove_stale_temporaries`` deletes. Versions are immutable:
pulling onto an existing version is refused, so switching or rolling back a version changes a
reference and never re-copies weights. A worker loading a version trusts the manifest written
here and only re-checks sizes and sampled chunks (``worker.model.manifest``, quick check).

Sources:

- a local folder or ``file://`` URL with a ``manifest.json``: the files it lists, checked against it;
- a plain Hugging Face folder (what ``save_pretrained`` or ``huggingface-cli download --local-dir``
  writes; no manifest): every non-hidden file, hashed on the way, and the manifest is written;
- a Hugging Face hub cache entry: the snapshot folder (``.../models--org--name/snapshots/<rev>``,
  files that are symlinks into ``../../blobs``) or the repository folder ``models--org--name``
  itself (its ``refs/main`` snapshot); symlinks are followed;
- an ``http(s)://`` URL of a folder served over HTTP: ``manifest.json`` is fetched first (it is
  required: it lists the files), then each file it lists, streamed with httpx.

``link``: ``copy`` copies every byte; ``link`` hard-links the source files into the store (same
filesystem only; no extra disk space; the source files must then never be rewritten in place);
``auto`` (the default) links a hub cache snapshot (its blobs are content-addressed and never
rewritten) when it is on the store's filesystem, and copies anything else.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Literal
from urllib.parse import quote, unquote, urlparse

import httpx

from worker.model import manifest as model_manifest

MANIFEST_NAME = model_manifest.MANIFEST_NAME
TEMP_PREFIX = ".tmp-"
CHUNK_BYTES = 1 << 20  # 1 MiB per read/write
INDEX_NAME = "model.safetensors.index.json"

# Names and versions become path components: keep them boring (no separators, no leading dot,
# so they can never escape the root or collide with the hidden temporary folders).
_COMPONENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$")

ProgressCallback = Callable[[str, int], None]  # (relative file path, bytes just written/hashed)
PlanCallback = Callable[[dict[str, int | None]], None]  # every file to pull -> its size (None: unknown)
LinkMode = Literal["auto", "copy", "link"]


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
    linked_files: int = 0  # of those, hard-linked from the source (pull only)
    source_manifest: bool = True  # the source had a manifest.json that was verified (pull only)


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


def resolve_hub_folder(folder: Path) -> Path:
    """A Hugging Face hub cache repository folder (``models--org--name`` holding ``refs/`` and
    ``snapshots/``) -> the snapshot its ``refs/main`` names (or its only snapshot); any other
    folder as it is."""
    snapshots = folder / "snapshots"
    if not (snapshots.is_dir() and (folder / "refs").is_dir()):
        return folder
    ref = folder / "refs" / "main"
    if ref.is_file():
        target = snapshots / ref.read_text().strip()
        if target.is_dir():
            return target
    found = sorted(p for p in snapshots.iterdir() if p.is_dir())
    if len(found) == 1:
        return found[0]
    names = ", ".join(p.name for p in found) or "none"
    raise ModelStoreError(
        f"{folder} is a Hugging Face cache entry without a usable refs/main; pick one of its snapshots "
        f"({names}): {snapshots}/<revision>"
    )


def is_hub_snapshot(folder: Path) -> bool:
    """``folder`` is ``.../models--org--name/snapshots/<rev>`` of a hub cache (blobs next to it)."""
    return folder.parent.name == "snapshots" and (folder.parent.parent / "blobs").is_dir()


class _LocalSource:
    """A checkpoint folder on a local (or mounted) filesystem."""

    def __init__(self, folder: Path) -> None:
        if not folder.is_dir():
            raise ModelStoreError(f"source folder not found: {folder}")
        self.folder = resolve_hub_folder(folder)
        self.hub_snapshot = is_hub_snapshot(self.folder)

    def read_manifest(self) -> bytes | None:
        path = self.folder / MANIFEST_NAME
        return path.read_bytes() if path.is_file() else None

    def list_files(self) -> dict[str, int | None]:
        """Every checkpoint file of a folder without a manifest (hidden paths skipped)."""
        try:
            names = model_manifest.checkpoint_files(self.folder)
        except model_manifest.ManifestError as exc:
            raise ModelStoreError(str(exc)) from exc
        if not names:
            raise ModelStoreError(f"source folder has no files: {self.folder}")
        listed = {rel: (self.folder / rel).stat().st_size for rel in names}
        _check_complete(self.folder, listed)
        return dict(listed)

    def path(self, relpath: str) -> Path:
        return (self.folder / relpath).resolve()

    def chunks(self, relpath: str) -> Iterator[bytes]:
        path = self.folder / relpath
        if not path.is_file():
            raise VerificationError([f"{relpath}: missing at the source"])
        with path.open("rb") as fh:
            while chunk := fh.read(CHUNK_BYTES):
                yield chunk

    def close(self) -> None:
        """Nothing to release."""


def _check_complete(folder: Path, listed: dict[str, int]) -> None:
    """A folder without a manifest is taken as it is; refuse one that is visibly not a whole
    checkpoint (no config.json, or a weight shard its index names is absent)."""
    if "config.json" not in listed:
        raise ModelStoreError(
            f"{folder} has neither {MANIFEST_NAME} nor config.json: not a checkpoint folder"
        )
    if INDEX_NAME in listed:
        try:
            shards = set(json.loads((folder / INDEX_NAME).read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelStoreError(f"{folder / INDEX_NAME} is unreadable ({exc})") from exc
        absent = sorted(str(s) for s in shards if str(s) not in listed)
        if absent:
            raise ModelStoreError(
                f"{folder}: {INDEX_NAME} names shards that are not there (an incomplete download?): "
                + ", ".join(absent[:5]) + (" ..." if len(absent) > 5 else "")
            )


class _HttpSource:
    """A checkpoint folder served over HTTP(S): ``<base>/manifest.json``, ``<base>/<file>``."""

    hub_snapshot = False

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
        if response.status_code == 404:
            raise ModelStoreError(
                f"{self.base_url} has no {MANIFEST_NAME} (HTTP 404): an http(s) source needs one, it lists "
                "the files to fetch; pull a local folder instead, which writes the manifest"
            )
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


def _listed_entries(manifest_bytes: bytes) -> dict[str, dict[str, Any]]:
    """The entries the manifest lists (``{"files": {path: {"sha256", "size", ...}}}``, see
    ``worker.model.manifest``)."""
    try:
        entries = json.loads(manifest_bytes)["files"]
        listed = {_safe_relpath(str(relpath)): dict(entry) for relpath, entry in entries.items()}
        for entry in listed.values():
            if "size" in entry:
                entry["size"] = int(entry["size"])
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ModelStoreError(f"{MANIFEST_NAME} is unreadable ({type(exc).__name__}: {exc})") from exc
    if not listed:
        raise ModelStoreError(f"{MANIFEST_NAME} lists no files")
    return listed


def _mismatches(relpath: str, got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """How a file hashed at pull differs from the source manifest's entry."""
    problems = []
    if "size" in want and got["size"] != want["size"]:
        problems.append(f"{relpath}: {got['size']} bytes, manifest lists {want['size']}")
    elif want.get("sha256") is not None and got["sha256"] != want["sha256"]:
        problems.append(f"{relpath}: sha256 mismatch")
    elif want.get("sample_sha256") is not None and got["sample_sha256"] != want["sample_sha256"]:
        problems.append(f"{relpath}: sampled sha256 mismatch (the source manifest's sample_sha256 is wrong)")
    return problems


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
) -> dict[str, Any]:
    """Copy one file, hashing it on the way; returns its manifest entry."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    size = expected_size
    if size is None and isinstance(source, _LocalSource):
        size = source.path(relpath).stat().st_size
    digest = model_manifest.FileDigest(size) if size is not None else None
    written = 0
    with dest.open("wb") as fh:
        for chunk in source.chunks(relpath):
            fh.write(chunk)
            written += len(chunk)
            if expected_size is not None and written > expected_size:
                raise VerificationError([f"{relpath}: larger than the {expected_size} bytes listed"])
            if digest is not None:
                digest.update(chunk)
            if on_progress is not None:
                on_progress(relpath, len(chunk))
        fh.flush()
        os.fsync(fh.fileno())
    if expected_size is not None and written != expected_size:
        raise VerificationError([f"{relpath}: {written} bytes, manifest lists {expected_size}"])
    if digest is None or digest.bytes_seen != digest.size:  # size unknown up front, or the file changed
        return model_manifest.digest_file(dest, relpath=relpath)
    return digest.entry()


def _link_file(
    source: _LocalSource, relpath: str, dest: Path, on_progress: ProgressCallback | None
) -> dict[str, Any]:
    """Hard-link one file into the store and hash it (one read); returns its manifest entry."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    target = source.path(relpath)
    if not target.is_file():
        raise VerificationError([f"{relpath}: missing at the source"])
    os.link(target, dest)
    return model_manifest.digest_file(dest, relpath=relpath, on_progress=on_progress)


def _check_servable(folder: Path) -> None:
    """``ModelStoreError`` when the loader would refuse ``folder``'s config (read_config's reason)."""
    # deferred: torch (checkpoint imports it); the model store and the CLI that loads it stay torch-free
    from worker.model.checkpoint import CheckpointError, read_config

    try:
        read_config(folder)
    except CheckpointError as exc:
        raise ModelStoreError(f"not a checkpoint cloverq can serve: {exc}") from exc


def _same_filesystem(a: Path, b: Path) -> bool:
    try:
        return a.stat().st_dev == b.stat().st_dev
    except OSError:
        return False


def pull(
    src: str | Path,
    *,
    name: str,
    version: str,
    root: Path,
    timeout: float = 60.0,
    on_progress: ProgressCallback | None = None,
    on_plan: PlanCallback | None = None,
    link: LinkMode = "auto",
    check_config: bool = True,
) -> ModelVersion:
    """Copy (or link), hash, verify and publish ``src`` as ``<root>/<name>/<version>``.

    Raises ``VersionExistsError`` if the version is already there, ``VerificationError`` if a
    file is missing or does not match the source's manifest, ``ModelStoreError`` for anything
    else (unreachable source, interrupted download, no manifest over HTTP, cross-filesystem
    ``link="link"``). On every failure nothing new is visible. ``on_plan`` gets every file to
    pull with its size before the first byte moves; ``on_progress`` each chunk copied or hashed.
    ``check_config``: refuse a checkpoint whose ``config.json`` cloverq cannot serve (unsupported
    model type or config flag, no mask token) before anything is copied (local sources) or
    published (HTTP sources), with the loader's own message.
    """
    if link not in ("auto", "copy", "link"):
        raise ModelStoreError(f"link must be auto, copy or link, not {link!r}")
    root = Path(root)
    final = version_path(root, name, version)
    if final.exists():
        raise VersionExistsError(f"{name}/{version} is already in the store at {final}")
    source = _open_source(src, timeout=timeout)
    root.mkdir(parents=True, exist_ok=True)
    temp = root / f"{TEMP_PREFIX}{uuid.uuid4().hex}"
    temp.mkdir()
    linked = 0
    try:
        manifest_bytes = source.read_manifest()
        expected = _listed_entries(manifest_bytes) if manifest_bytes is not None else None
        if expected is not None:
            plan: dict[str, int | None] = {rel: entry.get("size") for rel, entry in expected.items()}
        else:
            assert isinstance(source, _LocalSource)  # an HTTP source raised without a manifest
            plan = source.list_files()
        local = source if isinstance(source, _LocalSource) else None
        if link == "link" and local is None:
            raise ModelStoreError("link='link' needs a local source folder")
        if link == "link" and not _same_filesystem(local.folder, root):  # type: ignore[union-attr]
            raise ModelStoreError(f"cannot hard-link {src} into {root}: different filesystems")
        use_link = local is not None and (
            link == "link" or (link == "auto" and local.hub_snapshot and _same_filesystem(local.folder, root))
        )
        if check_config and local is not None and (local.folder / "config.json").is_file():
            _check_servable(local.folder)
        _check_free_space(root, 0 if use_link else sum(size or 0 for size in plan.values()))
        if on_plan is not None:
            on_plan(dict(plan))
        entries: dict[str, dict[str, Any]] = {}
        problems: list[str] = []
        for relpath, size in plan.items():
            dest = temp / relpath
            entry = None
            if use_link and local is not None:
                try:
                    entry = _link_file(local, relpath, dest, on_progress)
                    linked += 1
                except OSError as exc:
                    if link == "link" or exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
                        raise ModelStoreError(f"cannot hard-link {relpath}: {exc}") from exc
            if entry is None:
                entry = _copy_file(source, relpath, dest, size, on_progress)
            if expected is not None:
                problems += _mismatches(relpath, entry, expected[relpath])
            entries[relpath] = entry
        if problems:
            raise VerificationError(problems)
        if check_config and local is None and (temp / "config.json").is_file():
            _check_servable(temp)
        complete = expected is not None and all("sample_sha256" in e for e in expected.values())
        if complete:  # the source's manifest, verified byte for byte: keep it as it is
            (temp / MANIFEST_NAME).write_bytes(manifest_bytes)  # type: ignore[arg-type]
        else:  # none, or written before sampled hashes existed: write ours from the hashes
            (temp / MANIFEST_NAME).write_text(model_manifest.manifest_text(entries))
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
    described = _describe(final, name=name, version=version, files=len(plan))
    return dataclasses.replace(described, linked_files=linked, source_manifest=expected is not None)


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
                files = len(_listed_entries(manifest_path.read_bytes()))
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
