"""Hugging Face folders as they are downloaded: manifests written and checked cheaply, hub cache
snapshots pulled by hard link, chat templates and dtypes read from where transformers writes them,
unsupported config flags refused by name, and every CLI refusal one line (no traceback)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from cli.main import cli
from scheduler.infra.settings import Settings
from worker import model_store
from worker.model import manifest
from worker.model.checkpoint import load_checkpoint
from worker.model.config import REFUSED_FLAGS, ConfigError, ModelConfig
from worker.model.hf_defaults import GenerationDefaults, resolve_dtype
from worker.model.tokenizer import Tokenizer, TokenizerError, find_chat_template


@pytest.fixture
def folder(sdar_checkpoint: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny SDAR demo, as downloaded: no manifest."""
    copy = Path(shutil.copytree(sdar_checkpoint, tmp_path / "download"))
    (copy / "manifest.json").unlink()
    return copy


def _invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.output


# --- manifest: full and quick checks ------------------------------------------------------------


def test_quick_check_reads_sampled_chunks_and_catches_what_it_samples(tmp_path: Path) -> None:
    big = tmp_path / "model.safetensors"
    big.write_bytes(os.urandom(4 << 20))  # 4 MiB: 8 windows of 64 KiB are sampled
    (tmp_path / "config.json").write_text("{}")
    manifest.write_manifest(tmp_path)
    quick = manifest.check(tmp_path, mode="quick")
    assert quick.ok and quick.bytes_total == (4 << 20) + 2
    assert quick.bytes_read == manifest.SAMPLE_CHUNKS * manifest.SAMPLE_CHUNK_BYTES + 2
    assert manifest.check(tmp_path, mode="full").bytes_read == quick.bytes_total

    data = bytearray(big.read_bytes())
    data[-1] ^= 1  # the last window is always sampled
    big.write_bytes(bytes(data))
    assert [str(p) for p in manifest.check_manifest(tmp_path, mode="quick")] == [
        "model.safetensors: sampled sha256 mismatch"
    ]
    data[-1] ^= 1
    data[100_000] ^= 1  # between two windows: only the full check sees it (documented)
    big.write_bytes(bytes(data))
    assert manifest.check(tmp_path, mode="quick").ok
    assert [p.reason for p in manifest.check_manifest(tmp_path)] == ["sha256 mismatch"]
    big.write_bytes(bytes(data[:-10]))  # truncated
    assert manifest.check_manifest(tmp_path, mode="quick")[0].reason.startswith("size ")


def test_an_old_manifest_without_samples_is_checked_in_full(folder: Path) -> None:
    entries = {rel: {"sha256": manifest.sha256_file(folder / rel), "size": (folder / rel).stat().st_size}
               for rel in manifest.checkpoint_files(folder)}
    (folder / "manifest.json").write_text(json.dumps({"version": 1, "files": entries}))
    report = manifest.check(folder, mode="quick")
    assert report.ok and report.bytes_read == report.bytes_total


def test_missing_manifest_says_how_to_write_one(folder: Path) -> None:
    with pytest.raises(manifest.MissingManifestError, match="cloverq model manifest"):
        load_checkpoint(folder)
    code, out = _invoke("model", "verify", str(folder))
    assert code == 1 and "has no manifest.json" in out and "Traceback" not in out
    code, out = _invoke("generate", "--model", str(folder), "--prompt", "hi")
    assert code == 1 and len(out.strip().splitlines()) == 1 and "cloverq model manifest" in out


def test_cli_manifest_then_verify(folder: Path) -> None:
    code, out = _invoke("model", "manifest", str(folder))
    assert code == 0 and "wrote" in out and "MB/s" in out, out
    assert manifest.check_manifest(folder) == []
    code, out = _invoke("model", "manifest", str(folder))
    assert code == 1 and "--force" in out
    assert _invoke("model", "manifest", "--force", str(folder))[0] == 0
    code, out = _invoke("model", "verify", "--quick", str(folder))
    assert code == 0 and "quick check" in out
    assert load_checkpoint(folder, verify="quick").verification.mode == "quick"  # type: ignore[union-attr]


@pytest.mark.parametrize("command", [
    ["model", "verify"], ["model", "manifest"], ["model", "plan", "--config"],
    ["generate", "--prompt", "hi", "--model"],
])  # fmt: skip
def test_a_missing_folder_is_one_line(command: list[str], tmp_path: Path) -> None:
    code, out = _invoke(*command, str(tmp_path / "nowhere"))
    assert code == 1
    assert out.strip().splitlines() == [f"Error: checkpoint folder {tmp_path / 'nowhere'} does not exist"]


def test_a_bad_manifest_is_one_line(folder: Path) -> None:
    (folder / "manifest.json").write_text("{not json")
    code, out = _invoke("model", "verify", str(folder))
    assert code == 1 and "Traceback" not in out and "manifest.json" in out
    code, out = _invoke("generate", "--model", str(folder), "--prompt", "hi")
    assert code == 1 and len(out.strip().splitlines()) == 1 and "unreadable" in out


# --- pull: plain folders and hub cache snapshots ------------------------------------------------


def _hub_cache(folder: Path, cache: Path) -> Path:
    """``folder`` laid out as huggingface_hub's cache: blobs, a snapshot of symlinks, refs/main."""
    repo = cache / "models--cloverq--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for rel in manifest.checkpoint_files(folder):
        blob = repo / "blobs" / manifest.sha256_file(folder / rel)
        shutil.copyfile(folder / rel, blob)
        (snapshot / rel).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    return repo


def test_pull_a_plain_folder_writes_the_manifest(folder: Path, tmp_path: Path) -> None:
    (folder / ".gitattributes").write_text("*.safetensors filter=lfs\n")  # hidden: not part of it
    plans: list[dict[str, int | None]] = []
    store = tmp_path / "store"
    pulled = model_store.pull(folder, name="m", version="v1", root=store, on_plan=plans.append)
    assert not pulled.source_manifest and pulled.linked_files == 0
    assert ".gitattributes" not in plans[0] and "config.json" in plans[0]
    assert manifest.check(pulled.path).ok
    loaded = load_checkpoint(pulled.path, verify="quick")
    assert loaded.verification is not None and loaded.verification.fraction_read <= 1.0


@pytest.mark.parametrize("via", ["repo", "snapshot"])
def test_pull_a_hub_cache_entry_hard_links_its_blobs(via: str, folder: Path, tmp_path: Path) -> None:
    repo = _hub_cache(folder, tmp_path / "hub")
    src = repo if via == "repo" else repo / "snapshots" / "0123abcd"
    pulled = model_store.pull(src, name="m", version="v1", root=tmp_path / "store")
    weights = pulled.path / "model.safetensors"
    assert pulled.linked_files == pulled.files and not weights.is_symlink()
    blob = (repo / "snapshots" / "0123abcd" / "model.safetensors").resolve()
    assert weights.stat().st_ino == blob.stat().st_ino
    assert manifest.check(pulled.path).ok
    copied = model_store.pull(src, name="m", version="v2", root=tmp_path / "store", link="copy")
    assert copied.linked_files == 0
    assert (copied.path / "model.safetensors").stat().st_ino != weights.stat().st_ino


def test_incomplete_downloads_are_refused(folder: Path, tmp_path: Path) -> None:
    repo = _hub_cache(folder, tmp_path / "hub")
    snapshot = repo / "snapshots" / "0123abcd"
    os.unlink(os.path.realpath(snapshot / "tokenizer.json"))
    with pytest.raises(model_store.ModelStoreError, match="dangling symlink"):
        model_store.pull(repo, name="m", version="v1", root=tmp_path / "store")
    index = {"weight_map": {"a": "model-2.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(model_store.ModelStoreError, match=r"model-2\.safetensors"):
        model_store.pull(folder, name="m", version="v1", root=tmp_path / "store")
    code, out = _invoke("model", "pull", str(folder), "--name", "m", "--version", "v1",
                        "--root", str(tmp_path / "store"))
    assert code == 1 and len(out.strip().splitlines()) == 1 and "incomplete download" in out


# --- config, template, dtype, generation defaults -----------------------------------------------


def _sdar_dict(folder: Path) -> dict[str, object]:
    return dict(json.loads((folder / "config.json").read_text()))


@pytest.mark.parametrize(("key", "value"), [
    ("use_sliding_window", True), ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}), ("mlp_bias", True),
    ("qk_layernorm", False), ("partial_rotary_factor", 0.5), ("final_logit_softcapping", 30.0),
])  # fmt: skip
def test_unsupported_flags_are_refused_by_name(key: str, value: object, folder: Path) -> None:
    d = {**_sdar_dict(folder), key: value}
    with pytest.raises(ConfigError, match=f"unsupported config: {key}="):
        ModelConfig.from_hf_dict(d)
    (folder / "config.json").write_text(json.dumps(d))
    code, out = _invoke("model", "plan", "--config", str(folder))
    assert code == 1 and out.startswith(f"Error: {folder / 'config.json'}: unsupported config: {key}=")
    assert len(out.strip().splitlines()) == 1


def test_harmless_values_of_those_flags_load() -> None:
    assert {flag.key for flag in REFUSED_FLAGS} >= {"use_sliding_window", "rope_scaling", "mlp_bias"}
    base = {"model_type": "qwen3_moe", "vocab_size": 32, "hidden_size": 16, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 8}
    ModelConfig.from_hf_dict({**base, "use_sliding_window": False, "sliding_window": 4096,
                              "rope_scaling": None, "mlp_bias": False, "attention_bias": True})


def test_chat_template_sources_in_transformers_order(folder: Path) -> None:
    config = json.loads((folder / "tokenizer_config.json").read_text())
    legacy = config.pop("chat_template")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert find_chat_template(folder) is None
    with pytest.raises(TokenizerError, match=r"chat_template\.jinja"):
        Tokenizer.from_dir(folder).render_chat([{"role": "user", "content": "x"}], enable_thinking=False)
    template = "json:{{ messages[0].content }}"
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    assert find_chat_template(folder) == template
    (folder / "chat_template.jinja").write_text(legacy)
    tok = Tokenizer.from_dir(folder)
    assert tok.render_chat([{"role": "user", "content": "hi"}], enable_thinking=False).startswith(
        "<|im_start|>user\nhi<|im_end|>"
    )


def test_dtype_from_the_config_unless_overridden(folder: Path) -> None:
    d = _sdar_dict(folder)
    d.pop("dtype", None)
    assert resolve_dtype(ModelConfig.from_hf_dict(d)) == torch.float32
    assert resolve_dtype(ModelConfig.from_hf_dict({**d, "torch_dtype": "bfloat16"})) == torch.bfloat16
    assert resolve_dtype(ModelConfig.from_hf_dict({**d, "dtype": "bfloat16"}), "float16") == torch.float16
    with pytest.raises(ConfigError, match="CLOVERQ_DTYPE"):
        resolve_dtype(ModelConfig.from_hf_dict({**d, "dtype": "float8_e4m3fn"}))
    (folder / "config.json").write_text(json.dumps({**d, "dtype": "bfloat16"}))
    assert next(load_checkpoint(folder, verify=False, dtype=None).model.parameters()).dtype == torch.bfloat16
    assert Settings().model.dtype is None  # CLOVERQ_DTYPE is optional: the checkpoint's by default


def test_generation_defaults() -> None:
    sampled = GenerationDefaults.from_dict({"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                            "repetition_penalty": 1.05, "max_new_tokens": 512})
    assert (sampled.temperature, sampled.top_p, sampled.top_k, sampled.max_new_tokens) == (0.6, 0.95, 20, 512)
    assert sampled.unsupported == {"repetition_penalty": 1.05}
    assert GenerationDefaults.from_dict({"do_sample": False, "temperature": 0.7}).temperature == 0.0
    assert GenerationDefaults.from_dict({"top_p": 1.0, "top_k": 0}).as_log() == {}
    assert GenerationDefaults.from_dict({"joint_decode": "one_pass"}).as_log() == {"joint_decode": "one_pass"}
    assert GenerationDefaults.from_dict({"joint_decode": "sideways"}).joint_decode is None  # not a decode


def test_default_model_paths_follow_the_data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings(data_dir=Path("state"))
    monkeypatch.chdir(tmp_path)
    model_dir, root = settings.resolved_model_dir, settings.resolved_model_root
    assert model_dir == tmp_path / "state" / "models" / "demo" and model_dir.is_absolute()
    assert root == tmp_path / "state" / "model-store"
    explicit = Settings(data_dir=tmp_path, model_dir=tmp_path / "m", model_root=tmp_path / "r")
    assert (explicit.resolved_model_dir, explicit.resolved_model_root) == (tmp_path / "m", tmp_path / "r")


def test_pull_refuses_a_config_it_cannot_serve_before_copying(folder: Path, tmp_path: Path) -> None:
    (folder / "config.json").write_text(json.dumps({**_sdar_dict(folder), "use_sliding_window": True}))
    code, out = _invoke("model", "pull", str(folder), "--name", "m", "--version", "v1",
                        "--root", str(tmp_path / "store"))
    assert code == 1 and len(out.strip().splitlines()) == 1
    assert "not a checkpoint cloverq can serve" in out and "use_sliding_window=true" in out
    assert not (tmp_path / "store" / "m").exists()
    pulled = model_store.pull(folder, name="m", version="v1", root=tmp_path / "store", check_config=False)
    assert pulled.files > 0
