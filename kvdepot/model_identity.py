"""Which weights an engine runs: what its namespaces name instead of a path.

Two engines may share KV blocks only if their weights are the same. The path
vLLM was given says nothing about that: two models under one path (a
container's fixed mount point, weights rewritten in place) must not share,
and one model given by a relative and an absolute path must. So:

- `model_id` in the engine's kvdepot settings (vLLM's kv_connector_extra_config,
  SGLang's hicache-storage-backend-extra-config): the operator names the weights;
  engines with the same model_id share, whatever their paths.
- A local folder: a fingerprint of its weight files and its config.json.
  Per weight file its path inside the folder, size, modification time, and
  SHA-256 over sampled byte ranges (the head, where safetensors keeps its
  header, the tail, and SAMPLES ranges spread between), so that it costs a
  few MiB of reads per file however large: a 70B model is read for about
  100 MiB. Any change that rewrites a file (new time, new size, or bytes
  that differ in the samples, as new weights do everywhere) changes it.
- A hub model id: the commit of the snapshot vLLM loaded from the local hub
  cache (a branch like "main" moves; a commit does not), or, where no
  snapshot can be found, the revision as given.

`load_format="dummy"` (random weights from a fixed seed) names the config only.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
from dataclasses import dataclass
from functools import lru_cache

log = logging.getLogger("kvdepot.connector")

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".npz")
# Files whose whole content is part of the fingerprint: what shapes the model.
CONFIG_FILES = ("config.json", "params.json")
HEAD_BYTES = 1 << 20
TAIL_BYTES = 1 << 20
SAMPLES = 16
SAMPLE_BYTES = 64 << 10


@dataclass(frozen=True)
class ModelIdentity:
    # Readable: the operator's model_id, the hub id, or the folder's name.
    label: str
    # What tells these weights apart: "", a hub commit or revision, or "w" and
    # 16 hex digits of a folder's fingerprint.
    revision: str
    # For the log: where the identity came from.
    source: str


def model_identity(
    model: str,
    revision: str | None,
    load_format: str,
    model_id: str | None = None,
    setting: str = "kv_connector_extra_config.model_id",
) -> ModelIdentity:
    """`setting`: where the engine's operator sets model_id, for the log and warnings."""
    if model_id:
        return ModelIdentity(model_id, "", setting)
    if os.path.isdir(model):
        folder = os.path.realpath(model)
        digest, _ = folder_fingerprint(folder, weights=load_format != "dummy")
        return ModelIdentity(os.path.basename(folder) or folder, "w" + digest[:16], f"the files in {folder}")
    commit = _hub_commit(model, revision)
    if commit:
        return ModelIdentity(model, commit, "the hub snapshot vLLM loaded")
    log.warning(
        "kvdepot: no local snapshot of %s found; its blocks are named after revision %r, which can move: "
        "set %s to name the weights",
        model,
        revision or "main",
        setting,
    )
    return ModelIdentity(model, revision or "main", "the revision as given")


@lru_cache(maxsize=8)
def folder_fingerprint(folder: str, weights: bool = True) -> tuple[str, int]:
    """(SHA-256 hex of the folder's weights and config, bytes read for it)."""
    digest = hashlib.sha256(b"kvdepot-weights-v1\0")
    read = 0
    for relative, path in _files(folder):
        name = os.path.basename(relative)
        if name in CONFIG_FILES:
            with open(path, "rb") as f:
                data = f.read()
            read += len(data)
            digest.update(b"c" + relative.encode() + b"\0" + hashlib.sha256(data).digest())
        elif weights and name.endswith(WEIGHT_SUFFIXES):
            info = os.stat(path)
            digest.update(b"w" + relative.encode() + b"\0" + f"{info.st_size}:{info.st_mtime_ns}".encode())
            sampled, n = _sampled(path, info.st_size)
            digest.update(sampled)
            read += n
    if not weights:
        digest.update(b"dummy")
    return digest.hexdigest(), read


def _files(folder: str) -> list[tuple[str, str]]:
    """(path inside the folder, full path) of its regular files, links followed, sorted; hidden ones left out."""
    found = []
    for root, dirs, files in os.walk(folder, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in files:
            if name.startswith("."):
                continue
            path = os.path.join(root, name)
            try:
                if stat.S_ISREG(os.stat(path).st_mode):
                    found.append((os.path.relpath(path, folder), path))
            except OSError:
                continue  # a dangling link
    return sorted(found)


def _sampled(path: str, size: int) -> tuple[bytes, int]:
    """SHA-256 of the head, the tail and SAMPLES ranges between; the bytes read."""
    ranges = [(0, min(size, HEAD_BYTES)), (max(0, size - TAIL_BYTES), size)]
    middle = size - HEAD_BYTES - TAIL_BYTES
    if middle > SAMPLE_BYTES:
        step = middle // (SAMPLES + 1)
        ranges += [(HEAD_BYTES + step * (i + 1), HEAD_BYTES + step * (i + 1) + SAMPLE_BYTES) for i in range(SAMPLES)]
    digest = hashlib.sha256()
    read = 0
    with open(path, "rb") as f:
        for start, end in ranges:
            f.seek(start)
            data = f.read(end - start)
            read += len(data)
            digest.update(data)
    return digest.digest(), read


def _hub_commit(repo_id: str, revision: str | None) -> str | None:
    """The commit of the local hub cache's snapshot of repo_id at revision, if there is one."""
    try:
        from huggingface_hub import snapshot_download

        folder = snapshot_download(repo_id, revision=revision, local_files_only=True)
    except Exception:  # not cached, not a hub id, or no huggingface_hub: the caller says so
        return None
    return os.path.basename(os.path.normpath(folder))
