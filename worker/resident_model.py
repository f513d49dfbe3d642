"""The model this worker process holds: load a checkpoint, build, start and warm its engine.

One per process. Start-up (``worker/process_lifecycle.py``) and the model switcher
(``worker/model_switcher.py``) both go through ``load``; the job runner reads ``engine``,
``tokenizer`` and the version labels at claim time. A load replaces the engine only once the
new one warmed up, so a failed load leaves nothing half built behind.

It also stands in for the runtime in ``worker.tensor_parallel.load_sharded`` (which reads
``settings``, ``load_dtype``, ``info``, ``worker_id`` and ``redis``).
"""

from __future__ import annotations

from pathlib import Path

import redis
import structlog
import torch

from scheduler.fleet.checkpoint_context import read_checkpoint_context
from scheduler.fleet.context_limits import ContextLimits
from scheduler.fleet.workers import WorkerInfo
from scheduler.infra.gc_freeze import thaw_heap
from scheduler.infra.settings import Settings
from scheduler.observability.metric_families import set_process_version, version_label
from worker.class_gates import INTERACTIVE_QUEUE, JOINT_QUEUE
from worker.engine.engine import Engine, EngineConfig
from worker.engine_protocol import ServingEngine
from worker.job_handler import ChatTokenizer
from worker.model.checkpoint import LoadedModel, read_config
from worker.model.hf_defaults import GenerationDefaults, resolve_dtype
from worker.model.loader import load_model
from worker.tensor_parallel import load_sharded

log = structlog.get_logger(__name__)


class ResidentModel:
    """The loaded model's engine, tokenizer and labels; see the module docstring."""

    def __init__(self, settings: Settings, *, info: WorkerInfo, worker_id: str, redis_client: redis.Redis,
                 reserve: int) -> None:
        """``reserve``: engine slots held back for interactive jobs (``interactive_reserve``)."""
        self.settings = settings
        self.info = info
        self.worker_id = worker_id
        self.redis = redis_client
        self.reserve = reserve
        self.engine: ServingEngine | None = None
        self.tokenizer: ChatTokenizer | None = None
        self.model_version: str | None = None  # "<folder>@<manifest digest[:12]>", on every job
        self.model_name: str | None = None  # served_model, else the checkpoint folder's name
        self.served_version: str | None = None  # the version of served_model loaded now
        self.joint_decode: str | None = None  # the checkpoint's generation_config.json joint_decode

    def load(self, path: Path) -> LoadedModel:
        """Load (and verify) the checkpoint at ``path``, start and warm up its engine, and make it
        the one jobs run on; returns the loaded checkpoint."""
        settings = self.settings
        loaded: LoadedModel
        if settings.engine.tensor_parallel > 1:  # ranks 1..N-1 in processes of their own
            loaded = load_sharded(self, path)
        else:
            verify = False if settings.model.skip_verify else settings.model.verify_on_load
            loaded = load_model(path, device=settings.model.device, dtype=self.load_dtype(path),
                                verify=verify, weight_dtype=settings.model.weight_dtype,
                                group_size=settings.model.weight_group_size)  # int8/int4: model/quantize.py
        loaded.model.eval()
        self._record_load(loaded)
        engine = Engine(
            loaded.model,
            EngineConfig(max_batch=settings.engine.max_batch,
                         max_tokens_in_flight=settings.engine.max_tokens_in_flight,
                         prefix_cache_bytes=settings.engine.prefix_cache_bytes,
                         prefill_chunk_tokens=settings.engine.prefill_chunk_tokens,
                         token_work_keys=settings.engine.token_work_keys,
                         max_len=self.context_limits(path).sequence_positions,
                         slot_caps={JOINT_QUEUE: settings.engine.joint_slot_cap},
                         reserved_slots=self.reserve, reserved_classes=frozenset({INTERACTIVE_QUEUE})),
            mask_token_id=loaded.tokenizer.mask_token_id,
            eos_token_ids=loaded.tokenizer.eos_token_ids,
            default_block_size=loaded.config.block_size,
        )
        engine.start()
        try:
            engine.warm_up()
        except BaseException:
            engine.stop(drain=False, timeout=30)
            raise
        self.engine, self.tokenizer = engine, loaded.tokenizer
        self.joint_decode = GenerationDefaults.from_dict(loaded.generation_config).joint_decode
        self.model_version = f"{loaded.path.name}@{loaded.manifest_digest[:12]}"
        self.info.model_version = self.model_version
        set_process_version(version_label(self.model_version), self.info.stats.get("lane"))
        return loaded

    def unload(self, *, timeout: float = 60) -> None:
        """Finish what the engine holds, stop it and drop it, so its weights can be freed before
        another version loads (the old model was frozen at start-up: thaw lets it be collected)."""
        if self.engine is not None:
            self.engine.stop(drain=True, timeout=timeout)
        self.engine = None
        thaw_heap()

    def context_limits(self, path: Path) -> ContextLimits:
        """The limits of this deployment on the checkpoint at ``path``, as the API computes them from
        the same folder (``scheduler.fleet.context_limits``): the engine holds no sequence longer
        than the checkpoint's context."""
        checkpoint = read_checkpoint_context(path, dtype=self.settings.model.dtype)
        return ContextLimits.resolve(self.settings, checkpoint)

    def load_dtype(self, path: Path) -> torch.dtype:
        """The dtype to load ``path`` in: CLOVERQ_DTYPE, else its config.json's, else float32."""
        if self.settings.model.dtype:
            return resolve_dtype(None, self.settings.model.dtype)
        return resolve_dtype(read_config(path))

    def decode(self, ids: list[int]) -> str:
        """Committed ids as text (the monitor's progress and event stream)."""
        assert self.tokenizer is not None  # loaded before any job runs
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _record_load(self, loaded: LoadedModel) -> None:
        """What the load cost and chose, in the log and the registry (``stats.model_verify``): the
        manifest check's bytes read against the checkpoint's size shows a quick check's saving."""
        report = loaded.verification
        verify = None if report is None else {
            "mode": report.mode, "files": report.files, "bytes_total": report.bytes_total,
            "bytes_read": report.bytes_read, "seconds": round(report.seconds, 4),
        }
        self.info.set_stats(model_verify=verify)
        dtype = str(next(loaded.model.parameters()).dtype).removeprefix("torch.")
        log.info("worker.model_checked", path=str(loaded.path), dtype=dtype, verify=verify,
                 block_size=loaded.config.block_size, family=loaded.config.family,
                 generation_defaults=GenerationDefaults.from_dict(loaded.generation_config).as_log())

