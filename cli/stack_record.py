"""The record ``cloverq up`` leaves for the CLI: where the running embedded stack answers and
where its state (the dev key) lives, so ``cloverq submit`` / ``jobs`` / ``top`` work from any
folder, not only the one ``up`` was started in (issue 33).

One small JSON file per user (``client.stack_file``, default
``$XDG_STATE_HOME/cloverq/stack.json``): ``{"api_url", "admin_url", "ops_url", "data_dir", "pid",
"redis_port", "external_database"}`` (the admin and ops URLs differ from ``api_url`` when ``up``
split the API's planes; ``redis_port``: its embedded Redis, null when it used ``CLOVERQ_REDIS_URL``;
``external_database``: it used ``CLOVERQ_DATABASE_URL``, not the SQLite under ``data_dir``). It holds
no secret: the dev key stays in ``data_dir/dev_api_key`` (mode 0600), read from there, and a
database URL (which may hold a password) is never written. ``up`` removes the record when it stops;
a record whose process is gone (a killed ``up``) is ignored.

The operator commands that act on the stack's own state (keys, tenants, model versions, canary,
golden results) take its data dir and Redis from the record too (:func:`stack_settings`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import click

from scheduler.infra.settings import Settings, get_settings

RECORD_NAME = "stack.json"


@dataclass(frozen=True)
class StackRecord:
    """What one running ``cloverq up`` recorded."""

    api_url: str
    data_dir: Path
    pid: int
    admin_url: str | None = None
    ops_url: str | None = None
    redis_port: int | None = None  # its embedded Redis (None: an external one, or a record before it)
    external_database: bool = False
    external_redis: bool = False
    model_root: Path | None = None  # its model store, where up was given one (a path, no secret)
    started: str | None = None  # its process's start (``process_start``): a reused pid is not it


def record_path(settings: Settings) -> Path:
    """``client.stack_file``, else ``$XDG_STATE_HOME/cloverq/stack.json`` (the XDG default of
    ``~/.local/state`` when the variable is unset or not absolute, as the spec says)."""
    if settings.client.stack_file is not None:
        return settings.client.stack_file.expanduser()
    state_home = os.environ.get("XDG_STATE_HOME", "")
    default = Path.home() / ".local" / "state"
    base = Path(state_home) if state_home and Path(state_home).is_absolute() else default
    return base / "cloverq" / RECORD_NAME


def write_record(settings: Settings, *, api_url: str, data_dir: Path, admin_url: str | None = None,
                 ops_url: str | None = None) -> Path:
    """Record this process as the running stack (replacing an earlier record); returns the path."""
    path = record_path(settings)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"api_url": api_url, "admin_url": admin_url or api_url, "ops_url": ops_url or api_url,
            "data_dir": str(data_dir.resolve()), "pid": os.getpid(), "started": process_start(os.getpid()),
            "redis_port": None if settings.redis.url else settings.redis.embedded_port,
            "external_database": bool(settings.database.url), "external_redis": bool(settings.redis.url),
            "model_root": str(settings.resolved_model_root) if settings.model.root is not None else None}
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(body) + "\n")
    temporary.replace(path)  # a reader never sees half a record
    return path


def remove_record(settings: Settings) -> None:
    """Remove the record if it is this process's (a later ``up`` may have replaced it)."""
    path = record_path(settings)
    record = _parse(path)
    if record is not None and record.pid == os.getpid():
        path.unlink(missing_ok=True)


def read_record(settings: Settings) -> StackRecord | None:
    """The running stack's record, or None (none written, unreadable, or its ``up`` is gone)."""
    record = _parse(record_path(settings))
    return record if record is not None and _alive(record.pid, record.started) else None


def _parse(path: Path) -> StackRecord | None:
    try:
        body = json.loads(path.read_text())
        port, root = body.get("redis_port"), body.get("model_root")
        return StackRecord(api_url=str(body["api_url"]), data_dir=Path(body["data_dir"]),
                           pid=int(body["pid"]), admin_url=body.get("admin_url"), ops_url=body.get("ops_url"),
                           redis_port=int(port) if port is not None else None,
                           external_database=bool(body.get("external_database", False)),
                           external_redis=bool(body.get("external_redis", False)),
                           model_root=Path(root) if root is not None else None,
                           started=str(body["started"]) if body.get("started") is not None else None)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def process_start(pid: int) -> str | None:
    """When process ``pid`` started, as this boot's id and its start time in clock ticks
    (``/proc/<pid>/stat`` field 22), or None where ``/proc`` does not say (not Linux). A pid is
    reused after its process ends; this pair is not."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        stat = Path(f"/proc/{pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2:].split()  # past "pid (comm) ": the comm may hold spaces
        return f"{boot}:{fields[19]}"  # field 22 of the whole line is the 20th after the comm
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid: int, started: str | None = None) -> bool:
    """Whether the recorded ``up`` still runs: its pid exists and, where the record has its
    start, started then (a record left by a crash or a reboot can name a pid in use again)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive, though not ours
        pass
    return started is None or process_start(pid) in (None, started)


def stack_settings(settings: Settings | None = None) -> Settings:
    """``settings`` (None: the process's) for a command that acts on the running stack's own state
    (its database, Redis and model store): the data dir, embedded Redis and model store ``cloverq
    up`` recorded, where this process was given none of its own. Without it, ``cloverq keys
    create`` run from another folder created a fresh SQLite database there, and the running stack
    refused its key.

    Closer state wins, as for the dev key (``cli.api_client.resolve_target``): a data dir or a
    database URL given, or a ``./.cloverq`` holding a database of its own (a stack run by hand in
    this folder), keeps ``settings``. A stack on an external database or Redis (a URL given to
    ``up``, never recorded: it may hold a password) needs the same URL here; without it the
    command is refused, not run on a database or Redis the stack does not use. The state used is
    named on stderr, so a command never changes another folder's stack unannounced."""
    settings = settings if settings is not None else get_settings()
    if "data_dir" in settings.model_fields_set:
        return settings
    record = read_record(settings)
    if record is None:
        return settings
    if settings.database.url and not record.external_database:
        return settings  # the caller named a database: theirs, not the stack's
    own = settings.data_dir.resolve()
    if own != record.data_dir and (own / "cloverq.db").is_file():
        return settings
    needed = (("database", record.external_database, settings.database.url, "CLOVERQ_DATABASE_URL"),
              ("Redis", record.external_redis, settings.redis.url, "CLOVERQ_REDIS_URL"))
    for what, external, given, variable in needed:
        if external and not given:
            raise click.ClickException(
                f"the running `cloverq up` ({record_path(settings)}) uses a {what} of its own URL; set "
                f"{variable} to it (or CLOVERQ_DATA_DIR to act on another folder's state)"
            )
    update: dict[str, object] = {"data_dir": record.data_dir}
    if record.redis_port is not None and not settings.redis.url:
        update["redis"] = settings.redis.model_copy(update={"embedded_port": record.redis_port})
    if record.model_root is not None and settings.model.root is None:
        update["model"] = settings.model.model_copy(update={"root": record.model_root})
    if own != record.data_dir:
        click.echo(f"(the running stack's state: {record.data_dir})", err=True)
    return settings.model_copy(update=update)
