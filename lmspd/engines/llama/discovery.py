"""The GGUF models already on this machine, found where other tools keep them.

Four layouts, each named the way its own tool names its models:

- ``--models-dir``: any ``*.gguf`` below it; named by file stem
  (``qwen2.5-0.5b-instruct-q4_k_m``), like ``--model /path/file.gguf``.
- the Hugging Face hub cache (``$HF_HUB_CACHE``, ``$HF_HOME/hub`` or
  ``~/.cache/huggingface/hub``): ``models--ORG--REPO/snapshots/REV/FILE``
  (symlinks into ``blobs/``); named ``ORG/REPO/FILE``, also ``ORG/REPO:QUANT``
  as llama.cpp's ``-hf`` does, and ``ORG/REPO`` when it holds one GGUF.
- Ollama (``$OLLAMA_MODELS`` or ``~/.ollama/models``): JSON manifests under
  ``manifests/HOST/NAMESPACE/MODEL/TAG`` whose model layer names a blob
  ``blobs/sha256-…``; named as ``ollama list`` shows them
  (``llama3.2:latest``; ``user/model:tag`` outside the library namespace;
  ``hf.co/org/repo:tag`` for other hosts); ``llama3.2`` means ``:latest``.
- LM Studio (``~/.lmstudio/models``, formerly ``~/.cache/lm-studio/models``):
  ``PUBLISHER/MODEL/FILE.gguf``; named ``PUBLISHER/MODEL/FILE.gguf``, and
  ``PUBLISHER/MODEL`` when the folder holds one GGUF.

Metadata (context length, quantization, chat-template capabilities) comes
from the file's header (:mod:`.gguf`), never from loading it. Walks are
bounded in depth and entries; vision projectors and later parts of split
files are not models and are left out.
"""

from __future__ import annotations

import json
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from .gguf import GGUFError, GGUFInfo, quantization_from_name, read_gguf

MAX_ENTRIES = 20_000  # directory entries looked at per root
MAX_DEPTH = 6
MAX_MANIFEST_BYTES = 1024 * 1024
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
OLLAMA_LIBRARY = ("registry.ollama.ai", "library")
_LATER_SPLIT_PART = re.compile(r"-(\d{5})-of-\d{5}\.gguf$", re.I)
_DIGEST = re.compile(r"^sha256[:-]([0-9a-f]{64})$")


@dataclass(frozen=True)
class Roots:
    """Where to look; ``None`` skips a store."""

    models_dir: Path | None = None
    hf_hub: Path | None = None
    ollama: Path | None = None
    lmstudio: tuple[Path, ...] = ()

    @classmethod
    def default(cls, models_dir: Path | None = None, env: dict[str, str] | None = None) -> "Roots":
        env = dict(os.environ) if env is None else env
        home = Path(env.get("HOME") or Path.home())
        if env.get("HF_HUB_CACHE"):
            hf = Path(env["HF_HUB_CACHE"])
        elif env.get("HF_HOME"):
            hf = Path(env["HF_HOME"]) / "hub"
        else:
            hf = home / ".cache" / "huggingface" / "hub"
        ollama = Path(env["OLLAMA_MODELS"]) if env.get("OLLAMA_MODELS") else home / ".ollama" / "models"
        return cls(models_dir=models_dir, hf_hub=hf, ollama=ollama,
                   lmstudio=(home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models"))


@dataclass(frozen=True)
class FoundModel:
    name: str
    path: Path
    source: str  # models-dir | huggingface | ollama | lmstudio
    size_bytes: int
    aliases: tuple[str, ...] = ()
    architecture: str | None = None
    context_length: int | None = None
    quantization: str | None = None
    capabilities: dict[str, bool] = field(default_factory=dict)
    error: str | None = None  # the header could not be read

    def public(self) -> dict[str, Any]:
        """What an HTTP client may see (no filesystem path)."""
        return {"name": self.name, "aliases": list(self.aliases), "source": self.source,
                "size_bytes": self.size_bytes, "architecture": self.architecture,
                "context_length": self.context_length, "quantization": self.quantization,
                "capabilities": dict(self.capabilities)}


def discover(roots: Roots) -> list[FoundModel]:
    """Every model found, in store order; a name found twice keeps the first."""
    found: list[FoundModel] = []
    seen: set[str] = set()
    for model in _candidates(roots):
        if model.name in seen:
            continue
        seen.add(model.name)
        found.append(model)
    return found


def find(name: str, roots: Roots) -> FoundModel | None:
    """The model ``name`` (or one of its aliases) means, if any store has it."""
    wanted = {name.strip().lower()}
    last = name.rsplit("/", 1)[-1]
    if ":" not in last and not last.lower().endswith(".gguf"):
        wanted.add(name.strip().lower() + ":latest")  # Ollama's default tag
    models = discover(roots)
    for model in models:
        if model.name.lower() in wanted:
            return model
    for model in models:
        if wanted & {a.lower() for a in model.aliases}:
            return model
    return None


def _candidates(roots: Roots) -> Iterator[FoundModel]:
    if roots.models_dir is not None:
        yield from _models_dir(roots.models_dir)
    if roots.ollama is not None:
        yield from _ollama(roots.ollama)
    if roots.hf_hub is not None:
        yield from _hf_hub(roots.hf_hub)
    for root in roots.lmstudio:
        yield from _lmstudio(root)


# -- layouts -----------------------------------------------------------------------


def _models_dir(root: Path) -> Iterator[FoundModel]:
    from .models import served_id_for

    for path in _walk_ggufs(root):
        yield describe(served_id_for(path), path, "models-dir")


def _hf_hub(root: Path) -> Iterator[FoundModel]:
    for repo_dir in _listdir(root):
        if not repo_dir.name.startswith("models--") or not repo_dir.is_dir():
            continue
        repo = repo_dir.name[len("models--"):].replace("--", "/")
        snapshots = _hf_snapshots(repo_dir)
        files: dict[str, Path] = {}
        for snap in snapshots:
            for path in _walk_ggufs(snap, max_depth=3):
                files.setdefault(path.relative_to(snap).as_posix(), path)
        for rel, path in sorted(files.items()):
            aliases = [f"{repo}/{Path(rel).name}"] if "/" in rel else []
            quant = quantization_from_name(Path(rel).name)
            if quant:
                aliases.append(f"{repo}:{quant}")
            if len(files) == 1:
                aliases.append(repo)
            yield describe(f"{repo}/{rel}", path, "huggingface", aliases)


def _hf_snapshots(repo_dir: Path) -> list[Path]:
    """The snapshot refs/main points at first, then the others, newest first."""
    snaps = [p for p in _listdir(repo_dir / "snapshots") if p.is_dir()]
    snaps.sort(key=lambda p: _mtime(p), reverse=True)
    try:
        main = (repo_dir / "refs" / "main").read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return snaps
    return sorted(snaps, key=lambda p: p.name != main)


def _ollama(root: Path) -> Iterator[FoundModel]:
    manifests = root / "manifests"
    # manifests/HOST/NAMESPACE/MODEL/TAG (hf.co models: HOST/ORG/REPO/TAG).
    for host in _listdir(manifests):
        for namespace in _listdir(host):
            for model in _listdir(namespace):
                for tag in _listdir(model):
                    if not tag.is_file():
                        continue
                    blob = _ollama_blob(root, tag)
                    if blob is None:
                        continue
                    if (host.name, namespace.name) == OLLAMA_LIBRARY:
                        name = f"{model.name}:{tag.name}"
                    elif host.name == OLLAMA_LIBRARY[0]:
                        name = f"{namespace.name}/{model.name}:{tag.name}"
                    else:
                        name = f"{host.name}/{namespace.name}/{model.name}:{tag.name}"
                    yield describe(name, blob, "ollama")


def _ollama_blob(root: Path, manifest: Path) -> Path | None:
    try:
        if manifest.stat().st_size > MAX_MANIFEST_BYTES:
            return None
        doc = json.loads(manifest.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    layers = doc.get("layers") if isinstance(doc, dict) else None
    for layer in layers if isinstance(layers, list) else []:
        if not isinstance(layer, dict) or layer.get("mediaType") != OLLAMA_MODEL_LAYER:
            continue
        m = _DIGEST.match(str(layer.get("digest", "")))
        if m is None:
            return None
        blob = root / "blobs" / f"sha256-{m.group(1)}"
        return blob if blob.is_file() else None
    return None


def _lmstudio(root: Path) -> Iterator[FoundModel]:
    for publisher in _listdir(root):
        for model_dir in _listdir(publisher):
            if not model_dir.is_dir():
                continue
            files = list(_walk_ggufs(model_dir, max_depth=2))
            for path in files:
                rel = path.relative_to(root).as_posix()
                aliases = [f"{publisher.name}/{model_dir.name}"] if len(files) == 1 else []
                yield describe(rel, path, "lmstudio", aliases)


# -- files and headers -------------------------------------------------------------


def _walk_ggufs(root: Path, max_depth: int = MAX_DEPTH) -> Iterator[Path]:
    budget = [MAX_ENTRIES]

    def walk(directory: Path, depth: int) -> Iterator[Path]:
        for entry in _listdir(directory):
            budget[0] -= 1
            if budget[0] < 0:
                return
            if entry.name.startswith("."):
                continue
            if entry.is_dir() and depth < max_depth:
                yield from walk(entry, depth + 1)
            elif entry.name.lower().endswith(".gguf") and entry.is_file() and _is_model_file(entry.name):
                yield entry

    yield from walk(root, 0)


def _is_model_file(name: str) -> bool:
    low = name.lower()
    if low.startswith("mmproj") or "-mmproj" in low:
        return False  # a vision projector, loaded beside a model
    m = _LATER_SPLIT_PART.search(low)
    return m is None or m.group(1) == "00001"


def _listdir(directory: Path) -> list[Path]:
    try:
        return sorted(directory.iterdir())[:MAX_ENTRIES]
    except OSError:
        return []


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


_headers: dict[tuple[str, int, int], GGUFInfo | str] = {}
_headers_lock = threading.Lock()
_MAX_CACHED_HEADERS = 1024


def _header(path: Path) -> tuple[GGUFInfo | None, str | None, int]:
    """The file's header, cached by (real path, size, mtime)."""
    try:
        st = path.stat()
    except OSError as exc:
        return None, str(exc.strerror or exc), 0
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
    with _headers_lock:
        hit = _headers.get(key)
    if hit is None:
        try:
            hit = read_gguf(path)
        except GGUFError as exc:
            hit = str(exc)
        with _headers_lock:
            if len(_headers) >= _MAX_CACHED_HEADERS:
                _headers.clear()
            _headers[key] = hit
    if isinstance(hit, str):
        return None, hit, st.st_size
    return hit, None, st.st_size


def describe(name: str, path: Path, source: str, aliases: list[str] | tuple[str, ...] = ()) -> FoundModel:
    info, error, size = _header(path)
    if info is None:
        return FoundModel(name=name, path=path, source=source, size_bytes=size, aliases=tuple(aliases),
                          quantization=quantization_from_name(path.name), error=error)
    return FoundModel(
        name=name, path=path, source=source, size_bytes=size, aliases=tuple(aliases),
        architecture=info.architecture, context_length=info.context_length,
        quantization=info.quantization(path.name), capabilities=info.capabilities,
    )
