"""Which engine serves which model id: from flags, or from a config file.

A config file (``lmspd serve --config FILE``: TOML, or JSON by its ``.json``
suffix) maps served model ids to engines, so that one lmspd serves a local
GGUF and upstream models side by side::

    [models.smollm2]                     # the id clients use
    engine = "llama"
    model = "smollm2-135m-instruct"
    ctx = 4096

    [models.qwen]
    engine = "upstream"
    urls = ["http://10.0.0.1:8000/v1", "http://10.0.0.2:8000/v1"]
    upstream_model = "Qwen/Qwen3-8B"
    api_key_env = "VLLM_API_KEY"         # optional; never the key itself

This docstring is the reference for the keys; a key not listed is refused.
Each entry is one model; the table key is its served id. An id is given once:
TOML refuses a repeated table, and so does lmspd a JSON object's repeated key.

A served id (a table key, ``--served-model``, or the name ``--model`` gives)
is 1-256 characters: letters, digits and ``. _ - : @ +``, in parts split by
``/`` none of which is empty or starts with ``.`` (``llama3.2:latest``,
``Qwen/Qwen3-8B``; not ``""``, ``/tmp``, ``../x``). Two models served under one
id are refused at start, naming both. A local model's KV checkpoints live in
``<kv-disk-dir>/<id>``, each ``/`` of the id written ``%2F``, a long id cut
and ended with a hash (``kv_folder``); an earlier version's nested folder
moves there once (``kv_dir``).

Paths in an entry (``model`` when it ends in ``.gguf``, any case, and
``chat_template``) are relative to the config file's folder; ``~`` is the
home folder.

Every entry: ``engine``: ``"llama"`` (default) or ``"upstream"``.

``engine = "llama"`` (the same settings as ``serve``'s flags of those names):

    model           a bundled id, a path to a .gguf (relative to the file), or a
                    name ``lmspd models`` lists; default the bundled SmolLM2
    ctx             tokens per sequence, ``"auto"`` (default: fitted to memory,
                    fit.py) or 0 (the trained length)
    threads         decoding threads, >= 1; default one per usable physical core
                    (cpus.py)
    parallel        sequences decoded together, 1-64; default 4, lowered to fit
    gpu_layers      layers on the GPU, or ``"all"`` (default: all that fit)
    flash_attn      ``"auto"`` (default), ``"on"``, ``"off"``
    kv_type         ``"f16"`` (default), ``"q8_0"``, ``"q4_0"``
    rope_scaling    ``"auto"`` (default: YaRN over a window past the trained
                    length), ``"none"``
    chat_template   a Jinja template file instead of the GGUF's own (relative to
                    the file); default none
    temperature, top_p, top_k, min_p
                    what a request leaves unset is sampled with, over the flags
                    ``--temperature`` & co. and the GGUF's own; default unset

``engine = "upstream"``:

    url, urls       the provider's base URL(s), ``http(s)://host:port/v1``; required
    upstream_model  the provider's name for the model (not empty); required
    profile         ``"generic"`` (default), ``"openai"``, ``"llama-cpp-python"``
    api_key_env     a variable holding the key (must be set); default none
    key_name        a key saved with ``lmspd config set-key --name``; default none
                    (credentials.py: the variable, then this key, then
                    LMSPD_UPSTREAM_API_KEY, then the key saved as "default")
    context_window  tokens, as reported to clients; default what the provider
                    says at start, else 131072 (upstream/window.py)
    idle_timeout_s  a stream silent this long fails; default 120
    progress_timeout_s  a stream without output (text, reasoning, tool calls,
                    usage, a finish) this long fails, keep-alives or not; default 600
    connect_timeout_s  default 10
    max_concurrency requests in flight to the provider; default 256
    health_interval_s  probe of each endpoint with several; default 10 (0: none)
    routing         ``"affinity"`` (default), ``"least-loaded"``, ``"round-robin"``
                    (upstream/routing.py)
    affinity_slack  in-flight imbalance past which a preferred endpoint sheds; default 4
    prefix_threshold  share of a prompt an endpoint's prefix index must match; default 0.5

With ``--config``, the flags that set one model (``--model``, ``--served-model``,
``--engine``, ``--ctx``, ``--threads``, ``--parallel``, ``--gpu-layers``,
``--flash-attn``, ``--kv-type``, ``--rope-scaling``, ``--chat-template``,
``--upstream-*``: cli.py's ``_PER_MODEL_FLAGS``) are refused; the others
(the sampling flags, the KV cache's, the store's) apply to every model the
file names.

Keys are never in this file: ``api_key_env`` names a variable, ``key_name``
a key saved with ``lmspd config set-key --name``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from lmspd.core.conversation import SamplingDefaults
from lmspd.engines.llama.placement import check_kv_type
from lmspd.engines.upstream.engine import UpstreamSpec

log = logging.getLogger("lmspd.models")

__all__ = ["ConfigError", "LlamaSpec", "EngineSpec", "build_engine", "check_served_id", "kv_folder",
           "load_config_file", "spec_sources", "specs_from_settings"]


class ConfigError(ValueError):
    pass


@dataclass
class LlamaSpec:
    # None: the id the model resolves to (the bundled model's own id).
    served_model: str | None = None
    model: str | None = None
    # Tokens per sequence; None: auto (fitted to memory, lmspd.engines.llama.fit);
    # 0: the model's trained length.
    ctx: int | None = None
    threads: int | None = None
    # Sequences decoded together (continuous batching), each with the full ctx;
    # None: 4, lowered where that does not fit.
    parallel: int | None = None
    # A Jinja chat template file used instead of the GGUF's own.
    chat_template: str | None = None
    # Layers offloaded to the GPU; None: all that fit.
    gpu_layers: int | None = None
    flash_attn: str = "auto"  # "auto" (on with a GPU), "on", "off"
    kv_type: str = "f16"  # K and V cache type: "f16", "q8_0", "q4_0"
    rope_scaling: str = "auto"  # "auto" (YaRN past the trained length), "none"
    # What a request leaves unset is sampled with, over the model's own
    # settings (and over --temperature & co.).
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)


EngineSpec = Union[LlamaSpec, UpstreamSpec]

# Field name -> accepted types, per engine (served_model comes from the table key).
_LLAMA_FIELDS: dict[str, tuple[type, ...]] = {"model": (str,), "ctx": (int, str), "threads": (int,), "parallel": (int,),
                                              "chat_template": (str,), "gpu_layers": (int, str), "flash_attn": (str,),
                                              "kv_type": (str,), "rope_scaling": (str,), "temperature": (int, float),
                                              "top_p": (int, float), "top_k": (int,), "min_p": (int, float)}
_UPSTREAM_FIELDS: dict[str, tuple[type, ...]] = {
    "url": (str,), "urls": (list,), "upstream_model": (str,), "profile": (str,), "api_key_env": (str,),
    "key_name": (str,), "idle_timeout_s": (int, float), "progress_timeout_s": (int, float),
    "connect_timeout_s": (int, float), "max_concurrency": (int,), "context_window": (int,),
    "health_interval_s": (int, float),
    "affinity_slack": (int,), "routing": (str,), "prefix_threshold": (int, float),
}


# A served id: what clients send as "model", and (through kv_folder) the name
# of a local model's KV checkpoint folder. Parts split by "/" (Qwen/Qwen3-8B,
# hf.co/org/repo:Q4_K_M), none empty or starting with "." (no "..", no
# absolute path, no hidden folder); no whitespace or control characters.
# Hugging Face cache names run past 128 (org/repo-…-GGUF/…-Q4_K_M).
MAX_SERVED_ID = 256
_ID_PART = r"[A-Za-z0-9_:@+-][A-Za-z0-9._:@+-]*"
_SERVED_ID = re.compile(rf"{_ID_PART}(?:/{_ID_PART})*")
SERVED_ID_RULE = (f"1-{MAX_SERVED_ID} letters, digits and . _ - : @ +, in parts split by '/' none of which is "
                  "empty or starts with '.' (e.g. llama3.2:latest, Qwen/Qwen3-8B)")


def check_served_id(served: object, where: str) -> str:
    """``served`` if it is a valid served model id, else a ConfigError that
    says ``where`` it came from and what an id may be."""
    if not isinstance(served, str) or len(served) > MAX_SERVED_ID or _SERVED_ID.fullmatch(served) is None:
        raise ConfigError(f"{where}: {served!r} is not a valid served model id: {SERVED_ID_RULE}")
    return served


# A folder name is at most 255 bytes on the common file systems.
_MAX_FOLDER = 200


def kv_folder(served: str) -> str:
    """The KV checkpoint folder's name for a served id (one folder under the
    KV directory: each "/" written "%2F", which no id contains; a long id is
    cut and ends with a hash of the whole, so two ids never share one)."""
    name = check_served_id(served, "the KV checkpoint folder").replace("/", "%2F")
    if len(name) > _MAX_FOLDER:
        name = name[:_MAX_FOLDER - 17] + "-" + hashlib.sha256(served.encode()).hexdigest()[:16]
    return name


def kv_dir(disk_dir: Path, served: str) -> Path:
    """``disk_dir / kv_folder(served)``. Before served ids were checked, an
    id with "/" was a nested folder (``kv/Qwen/Qwen3-8B``): found there,
    its checkpoints move to the new folder once, so that an upgrade neither
    starts cold nor leaves them unpruned beside it."""
    folder = disk_dir / kv_folder(served)
    if "/" in served and not folder.exists():
        old = disk_dir.joinpath(*served.split("/"))
        if old.is_dir():
            try:
                folder.parent.mkdir(parents=True, exist_ok=True)
                old.rename(folder)
            except OSError as exc:
                log.warning("could not move KV checkpoints from %s to %s: %s", old, folder, exc)
                return folder
            log.info("moved KV checkpoints from %s to %s", old, folder)
            for parent in old.parents:  # the folders the old id nested in, if now empty
                if parent == disk_dir or disk_dir not in parent.parents:
                    break
                with contextlib.suppress(OSError):
                    parent.rmdir()
    return folder


class _DuplicateKey(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json.loads's object_pairs_hook: a repeated key is refused, not the last one kept."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def load_config_file(path: Path) -> list[EngineSpec]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    try:
        # TOML refuses a repeated key (or table) itself.
        raw = (json.loads(text, object_pairs_hook=_no_duplicates) if path.suffix.lower() == ".json"
               else tomllib.loads(text))
    except _DuplicateKey as exc:
        raise ConfigError(f"{path}: the key {exc.args[0]!r} is given twice in one object (two models.{exc.args[0]} "
                          "entries, or one setting given twice): give each model its own id, each setting once") from None
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        kind = "JSON" if path.suffix.lower() == ".json" else "TOML"
        raise ConfigError(f"{path} is not valid {kind}: {exc}") from None
    if not isinstance(raw, dict) or set(raw) != {"models"} or not isinstance(raw["models"], dict) or not raw["models"]:
        raise ConfigError(f"{path} must have one table 'models' mapping model ids to engines")
    return [_spec(model_id, entry, path) for model_id, entry in raw["models"].items()]


def _relative_to(path: Path, value: str) -> str:
    """A path written in the config file at ``path``: relative to its folder."""
    given = Path(value).expanduser()
    return str(given if given.is_absolute() else (path.parent / given).resolve())


def _check_threads(threads: Any, where: str) -> None:
    if threads is not None and threads < 1:
        raise ConfigError(f"{where} must be >= 1 (leave it out for one per usable physical core), not {threads}")


def _check_urls(urls: list[str], where: str) -> None:
    from lmspd.engines.upstream.pool import normalize_base_url

    for url in urls:
        try:
            normalize_base_url(url)
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from None


def _spec(model_id: str, entry: Any, path: Path) -> EngineSpec:
    where = f"{path}: models.{model_id}"
    check_served_id(model_id, f"{path}: the entry [models.{json.dumps(model_id)}]")
    if not isinstance(entry, dict):
        raise ConfigError(f"{where} must be a table")
    entry = dict(entry)
    engine = entry.pop("engine", "llama")
    allowed = {"llama": _LLAMA_FIELDS, "upstream": _UPSTREAM_FIELDS}.get(engine) if isinstance(engine, str) else None
    if allowed is None:
        raise ConfigError(f"{where}.engine must be 'llama' or 'upstream', not {engine!r}")
    for key, value in entry.items():
        if key not in allowed:
            hint = " (keys never go in this file: use api_key_env or key_name)" if "key" in key else ""
            raise ConfigError(f"{where}: unknown setting {key!r}{hint}")
        if isinstance(value, bool) or not isinstance(value, allowed[key]):
            raise ConfigError(f"{where}.{key} has the wrong type")
        if key in ("upstream_model", "api_key_env", "key_name") and isinstance(value, str) and not value.strip():
            raise ConfigError(f"{where}.{key} must not be empty")
    if engine == "llama":
        if not 1 <= entry.get("parallel", 4) <= 64:
            raise ConfigError(f"{where}.parallel must be between 1 and 64")
        _check_threads(entry.get("threads"), f"{where}.threads")
        model = entry.get("model")
        if model is not None and model.lower().endswith(".gguf"):
            model = _relative_to(path, model)
        chat_template = entry.get("chat_template")
        if chat_template is not None:
            chat_template = _relative_to(path, chat_template)
        for key, word in (("ctx", "auto"), ("gpu_layers", "all")):
            if isinstance(entry.get(key), str) and entry[key] != word:
                raise ConfigError(f"{where}.{key} has the wrong type (a number, or {word!r})")
        try:
            ctx = parse_ctx(entry.get("ctx", "auto"))
            gpu_layers = parse_gpu_layers(entry.get("gpu_layers", "all"))
            check_kv_type(entry.get("kv_type", "f16"), entry.get("flash_attn", "auto"),
                          entry.get("rope_scaling", "auto"))
            sampling = parse_sampling(**{k: entry.get(k) for k in ("temperature", "top_p", "top_k", "min_p")})
        except ValueError as exc:
            raise ConfigError(f"{where}: {str(exc).replace('--', '').replace('-', '_')}") from None
        return LlamaSpec(served_model=model_id, model=model, ctx=ctx, threads=entry.get("threads"),
                         parallel=entry.get("parallel"), chat_template=chat_template,
                         gpu_layers=gpu_layers, flash_attn=entry.get("flash_attn", "auto"),
                         kv_type=entry.get("kv_type", "f16"), rope_scaling=entry.get("rope_scaling", "auto"),
                         sampling=sampling)
    urls = entry.pop("urls", None) or []
    if "url" in entry:
        urls = [entry.pop("url"), *urls]
    if not urls or not all(isinstance(u, str) for u in urls):
        raise ConfigError(f"{where}: give the provider's base URL as url = \"http://host:port/v1\" (or urls = [...])")
    if "upstream_model" not in entry:
        raise ConfigError(f"{where}: upstream_model (the provider's name for the model) is required")
    _check_urls(urls, where)
    try:
        return UpstreamSpec(served_model=model_id, urls=list(urls), **entry)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None


def specs_from_settings(settings: Any) -> list[EngineSpec]:
    """The models to serve: the config file's, or the one the flags name."""
    if settings.config_file is not None:
        return load_config_file(Path(settings.config_file))
    if settings.served_model is not None:
        check_served_id(settings.served_model, "--served-model")
    if settings.engine == "upstream":
        if not settings.upstream_urls or not settings.upstream_model:
            raise ConfigError("--engine upstream needs --upstream-url and --upstream-model")
        if settings.served_model is None:
            check_served_id(settings.upstream_model, "--upstream-model, the served id without --served-model "
                                                     "(give one with --served-model)")
        _check_urls(list(settings.upstream_urls), "--upstream-url")
        try:
            return [UpstreamSpec(
                served_model=settings.served_model or settings.upstream_model,
                upstream_model=settings.upstream_model,
                urls=list(settings.upstream_urls),
                profile=settings.upstream_profile,
                idle_timeout_s=settings.upstream_idle_timeout_s,
                progress_timeout_s=getattr(settings, "upstream_progress_timeout_s", None),
                routing=settings.upstream_routing,
                context_window=getattr(settings, "upstream_context_window", None),
            )]
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    placement: dict[str, Any] = {"gpu_layers": getattr(settings, "gpu_layers", None),
                                 "flash_attn": getattr(settings, "flash_attn", "auto"),
                                 "kv_type": getattr(settings, "kv_type", "f16"),
                                 "rope_scaling": getattr(settings, "rope_scaling", "auto")}
    _check_threads(settings.threads, "--threads")
    first = LlamaSpec(served_model=settings.served_model, model=settings.model, ctx=settings.ctx,
                      threads=settings.threads, parallel=settings.parallel, chat_template=settings.chat_template,
                      **placement)
    more = [LlamaSpec(model=m, ctx=settings.ctx, threads=settings.threads, parallel=settings.parallel,
                      chat_template=settings.chat_template, **placement)
            for m in getattr(settings, "extra_models", [])]
    return [first, *more]


def spec_sources(settings: Any, specs: list[EngineSpec]) -> list[str]:
    """Where each of ``specs`` (``specs_from_settings(settings)``) was given,
    for messages: a config file's entry, or a flag and its position."""
    if settings.config_file is not None:
        return [f"{settings.config_file}: models.{spec.served_model}" for spec in specs]
    if settings.engine == "upstream":
        return [f"--served-model {settings.served_model}" if settings.served_model
                else f"--upstream-model {settings.upstream_model}"]
    models = [settings.model, *getattr(settings, "extra_models", [])]
    out = [f"--model #{n} ({model})" if model is not None else "the default model (no --model)"
           for n, model in enumerate(models, 1)]
    if settings.served_model:
        out[0] = f"--served-model {settings.served_model} (for {out[0]})"
    return out[:len(specs)]


def parse_sampling(*, temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                   min_p: float | None = None) -> SamplingDefaults:
    """``--temperature``, ``--top-p``, ``--top-k``, ``--min-p`` (or a config
    file's keys), each within its range (NaN is in none)."""
    for flag, value, high in (("--temperature", temperature, 2), ("--top-p", top_p, 1),
                              ("--top-k", top_k, 1_000_000), ("--min-p", min_p, 1)):
        if value is not None and not 0 <= value <= high:
            raise ValueError(f"{flag} must be between 0 and {high}")
    return SamplingDefaults(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)


def parse_ctx(value: int | str) -> int | None:
    """``--ctx``: ``auto`` (None), 0 (the trained length) or a number of tokens."""
    return _word_or_count("--ctx", value, "auto", "a number of tokens", top=1 << 24,
                          bounds="between 0 (the trained length) and 16777216")


def parse_gpu_layers(value: int | str) -> int | None:
    """``--gpu-layers``: ``all`` (None: every layer that fits) or a number of layers."""
    return _word_or_count("--gpu-layers", value, "all", "a number of layers", bounds=">= 0 (or 'all')")


def _word_or_count(flag: str, value: int | str, word: str, count: str, *, bounds: str,
                   top: int | None = None) -> int | None:
    """``word`` (None: lmspd decides) or a whole number from 0 to ``top``;
    the same words for a flag and for a config file's key."""
    if value == word:
        return None
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{flag} must be {word!r} or {count}, not {value!r}") from None
    if n < 0 or (top is not None and n > top):
        raise ValueError(f"{flag} must be {bounds}")
    return n


def plan_llama(spec: LlamaSpec, path: Path, settings: Any, budget: int | None = None) -> Any:
    """Where and with which window ``spec``'s model runs (fitted to memory)."""
    from lmspd.engines.llama.placement import FitError, plan

    try:
        return plan(path, ctx=spec.ctx, parallel=spec.parallel, gpu_layers=spec.gpu_layers,
                    flash_attn=spec.flash_attn, kv_type=spec.kv_type, swa_full=getattr(settings, "swa_full", False),
                    budget=budget, rope=spec.rope_scaling)
    except FitError as exc:
        raise ConfigError(f"model {spec.served_model or spec.model or path.name}: {exc}") from None


def build_engine(spec: EngineSpec, settings: Any, placement: Any = None) -> Any:
    """The engine for ``spec``; a local model runs as ``placement`` says
    (``placement.RuntimeConfig``), planned now when not given."""
    if isinstance(spec, UpstreamSpec):
        from lmspd.engines.upstream.credentials import CredentialError, resolve_key
        from lmspd.engines.upstream.engine import UpstreamEngine

        try:
            key = resolve_key(settings.data_dir, env=spec.api_key_env, name=spec.key_name)
        except CredentialError as exc:
            raise ConfigError(f"model {spec.served_model!r}: {exc}") from None
        for url in spec.urls:
            if key is not None and url.startswith("http://") and not _is_loopback_url(url):
                import logging

                logging.getLogger("lmspd.upstream").warning(
                    "model %s sends its provider key over plain http to a non-loopback host", spec.served_model)
        spec = _upstream_window(spec, key, settings)
        try:
            return UpstreamEngine(spec, key=key, limits=settings.limits.upstream)
        except ValueError as exc:
            raise ConfigError(f"model {spec.served_model!r}: {exc}") from None

    from lmspd.engines.llama.discovery import Roots
    from lmspd.engines.llama.engine import CacheSettings, LlamaEngine
    from lmspd.engines.llama.models import resolve_model

    model_id, path = resolve_model(spec.model, Roots.default(getattr(settings, "models_dir", None)))
    served = check_served_id(spec.served_model or model_id,
                             f"model {spec.model or model_id}: its id (give another with --served-model or a "
                             "config entry's name)")
    disk_dir = settings.kv_disk_dir or Path(settings.data_dir) / "kv"
    cache = CacheSettings(
        enabled=settings.prefix_cache,
        ram_budget_bytes=settings.kv_ram_mb << 20,
        # One directory per served model: checkpoints never cross models.
        disk_dir=kv_dir(disk_dir, served) if settings.kv_disk_space_mb > 0 else None,
        disk_budget_bytes=settings.kv_disk_space_mb << 20,
        checkpoint_every=settings.kv_checkpoint_every,
        swa_full=getattr(settings, "swa_full", False),
        strip_billing_header=getattr(settings, "strip_billing_header", True),
        canonical_tool_order=getattr(settings, "canonical_tool_order", True),
    )
    from lmspd.core.sealing import Sealer

    template = None
    if spec.chat_template:
        from lmspd.engines.llama.template import read_template_file

        try:
            template = read_template_file(spec.chat_template)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    return LlamaEngine(served, path, n_threads=spec.threads, cache=cache, limits=settings.limits.request,
                       chat_template=template, sealer=Sealer.from_data_dir(Path(settings.data_dir)),
                       placement=placement or plan_llama(spec, path, settings),
                       speculative=getattr(settings, "speculative", "auto"),
                       sampling=spec_sampling(spec, settings))


def _upstream_window(spec: UpstreamSpec, key: Any, settings: Any) -> UpstreamSpec:
    """``spec`` with its context window: the one given, else what its provider
    says, else ``DEFAULT_CONTEXT_WINDOW``; the log says which (window.py)."""
    import dataclasses
    import logging

    from lmspd.engines.upstream.window import DEFAULT_CONTEXT_WINDOW, discover_window

    if spec.context_window is not None:
        given = ("context_window in " + str(settings.config_file) if getattr(settings, "config_file", None)
                 else "--upstream-context-window")
        window, source = spec.context_window, f"given: {given}"
    elif (found := discover_window(spec.urls, spec.upstream_model, key)) is not None:
        window, source = found.tokens, found.source
    else:
        window, source = DEFAULT_CONTEXT_WINDOW, ("the default: the provider did not say (give it with "
                                                  "--upstream-context-window or a config entry's context_window)")
    logging.getLogger("lmspd.upstream").info("model %s: context window %d (%s)", spec.served_model, window, source)
    return dataclasses.replace(spec, context_window=window)


def spec_sampling(spec: LlamaSpec, settings: Any) -> SamplingDefaults:
    """The operator's sampling for ``spec``'s model: its config entry's over
    the flags' (the model's own settings go under both, at load)."""
    return getattr(settings, "sampling", SamplingDefaults()).under(spec.sampling)


def _is_loopback_url(url: str) -> bool:
    import ipaddress
    from urllib.parse import urlsplit

    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
