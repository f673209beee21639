"""``lmspd serve``, ``lmspd models``, ``lmspd config set-key|clear-key`` and ``lmspd launch``."""

from __future__ import annotations

import argparse
import sys
import typing
from dataclasses import replace
from pathlib import Path

from lmspd import __version__
from lmspd.config import DEFAULT_CTX, Settings
from lmspd.core.limits import DEFAULT_LIMITS
from lmspd.engines.upstream.window import DEFAULT_CONTEXT_WINDOW


def main(argv: list[str] | None = None) -> int:
    from lmspd.engines.llama.models import DEFAULT_MODEL_ID

    parser = argparse.ArgumentParser(prog="lmspd", description="A local model service (LMSP 1.0 and OpenAI Responses).")
    parser.add_argument("--version", action="version", version=f"lmspd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve a model over HTTP")
    serve.add_argument("--host", default=Settings.host,
                       help="the address to listen on (default %(default)s; any address that is not loopback "
                            "needs --api-key)")
    serve.add_argument("--port", type=_port, default=Settings.port, help="default %(default)s; 0 picks a free port")
    serve.add_argument("--model", action="append", default=[], dest="models",
                       help="repeatable (several models load on first use); a bundled model id, a path to a .gguf file, or a name `lmspd models` lists "
                            f"(Hugging Face cache, Ollama, LM Studio, --models-dir); default: {DEFAULT_MODEL_ID}")
    serve.add_argument("--models-dir", type=Path, default=None, metavar="DIR",
                       help="also look for .gguf files below DIR")
    serve.add_argument("--models-max-mem", type=int, default=None, metavar="MB", dest="models_max_mem_mb",
                       help="memory for loaded models (file + KV); the least recently used idle one is "
                            "unloaded to make room (models then load on first use)")
    serve.add_argument("--models-idle-s", type=float, default=None, metavar="SECONDS",
                       help="unload a model unused this long (models then load on first use)")
    serve.add_argument("--ctx", default="auto", metavar="N|auto",
                       help="context window per sequence in tokens (default auto: the model's trained length, or "
                            f"{DEFAULT_CTX} where it was trained shorter (room for Codex's ~9k-token first request), "
                            "fitted to the memory free at load; 0 = the trained length)")
    serve.add_argument("--threads", type=int, default=None, metavar="N",
                       help="CPU threads a local model decodes with (default: one per physical core this process "
                            "may run on, performance cores only on a hybrid CPU, within its cgroup CPU quota; "
                            "the start-up log says how many)")
    serve.add_argument("--parallel", type=int, default=None, metavar="N",
                       help="sequences of a local model decoded together, each with the full --ctx (default 4, "
                            "lowered where that does not fit memory)")
    serve.add_argument("--gpu-layers", default="all", metavar="N|all",
                       help="layers of a local model offloaded to the GPU (default all: every layer that fits "
                            "device memory; 0 = CPU only)")
    serve.add_argument("--flash-attn", default="auto", choices=["auto", "on", "off"],
                       help="flash attention (default auto: on where layers are offloaded to a GPU or --kv-type "
                            "is quantized, else off)")
    serve.add_argument("--kv-type", default="f16", choices=["f16", "q8_0", "q4_0"],
                       help="K and V cache type (default f16); q8_0 and q4_0 need flash attention")
    serve.add_argument("--rope-scaling", default=Settings.rope_scaling, choices=["auto", "none"],
                       help="a window longer than the model was trained on (default auto: stretched with YaRN, "
                            "unless the model scales on its own; none: unscaled, as llama.cpp runs it)")
    serve.add_argument("--data-dir", type=Path, default=None, metavar="DIR",
                       help="stored responses and tasks, KV checkpoints, the reasoning key, saved provider keys "
                            "(default: env LMSPD_DATA_DIR, else ~/.lmspd)")
    serve.add_argument("--api-key", action="append", default=[], dest="api_keys", metavar="KEY[:SCOPES]",
                       help="accept this bearer token (repeatable); required when not bound to loopback. "
                            "KEY:responses:read,tasks:read limits it to those scopes (default: all)")
    serve.add_argument("--api-keys-file", type=Path, default=None, metavar="FILE",
                       help="more keys, one per line: KEY [scope,scope...]; # at the start or after a space starts a comment")
    serve.add_argument("--allowed-origins", action="append", default=None, metavar="ORIGIN[,ORIGIN...]",
                       help="web origins (https://app.example, or *) whose pages may use the server besides "
                            "loopback ones and its own (default: env LMSPD_ORIGINS); their hosts are also "
                            "accepted as Host when bound to loopback")
    serve.add_argument("--log-level", default=Settings.log_level, choices=["debug", "info", "warning", "error"],
                       help="default %(default)s; llama.cpp's own lines go to the same log (its info and debug "
                            "lines at debug)")
    serve.add_argument("--max-queue", type=int, default=None,
                       help="requests that may wait for a busy model before 503 (default 32)")
    serve.add_argument("--max-output-tokens-default", type=int, default=None, metavar="N",
                       help="a local generation without max_output_tokens runs up to the context, but at most "
                            f"N tokens (default {DEFAULT_LIMITS.request.max_output_tokens_default}; "
                            "0 = no cap but the context)")
    serve.add_argument("--repetition-window", type=int, default=None, metavar="N",
                       help="end a local generation whose last N tokens repeat a short cycle (default "
                            f"{DEFAULT_LIMITS.request.repetition_window}; 0 turns the repetition guard off)")
    serve.add_argument("--websocket-max-age-s", type=float, default=None, metavar="SECONDS",
                       help="close Responses WebSocket connections after this long (default 3600, as OpenAI)")
    _engine_flags(serve)
    _cache_flags(serve)
    _sampling_flags(serve)
    store = serve.add_argument_group("stored state (responses, conversations, tasks and their events)")
    store.add_argument("--response-retention-s", type=float, default=None,
                       help="keep stored responses this long (default 30 days)")
    store.add_argument("--task-retention-s", type=float, default=None,
                       help="keep finished tasks and their results this long (default 7 days)")
    store.add_argument("--event-retention-s", type=float, default=None,
                       help="keep a finished task's events for resuming this long (default 1 day)")
    store.add_argument("--max-response-mib", type=float, default=None,
                       help="total size of stored responses before the oldest go (default 512)")
    store.add_argument("--max-event-mib", type=float, default=None,
                       help="total size of task event logs before the oldest go (default 256)")
    store.add_argument("--prune-interval-s", type=float, default=None,
                       help="how often expired state is removed (default 60)")
    store.add_argument("--store", default=None, metavar="URL",
                       help="postgresql://... to share state between lmspd instances "
                            "(default: <data-dir>/lmspd.sqlite3; env LMSPD_STORE)")
    store.add_argument("--store-lease-s", type=float, default=None, metavar="SECONDS",
                       help="a shared store fails the running tasks of an instance silent this long "
                            "(default 15)")

    models = sub.add_parser("models", help="list the models lmspd can serve (found on this machine)")
    models.add_argument("--models-dir", type=Path, default=None, metavar="DIR",
                        help="also look for .gguf files below DIR")
    models.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _config_parser(sub)
    from lmspd.launch.command import add_parser as _launch_parser

    _launch_parser(sub)
    from lmspd.render import add_parser as _render_parser

    _render_parser(sub)

    argv = list(sys.argv[1:] if argv is None else argv)
    # ``lmspd launch CLIENT [flags] -- CLIENT_ARGS``: what follows ``--`` is
    # the client's, whatever it looks like (argparse's subparsers mishandle it).
    client_args: list[str] = []
    if argv[:1] == ["launch"] and "--" in argv:
        cut = argv.index("--")
        argv, client_args = argv[:cut], argv[cut + 1:]
    args = parser.parse_args(argv)
    if args.command == "models":
        return _models(args.models_dir, as_json=args.json)
    if args.command == "config":
        return _config(args)
    if args.command == "render":
        from lmspd.render import run as render

        return render(args)
    if args.command == "launch":
        from lmspd.launch.command import run as launch

        return launch(args, client_args)
    settings = Settings(
        host=args.host, port=args.port, model=args.models[0] if args.models else None,
        threads=args.threads, parallel=args.parallel, api_keys=args.api_keys, log_level=args.log_level,
    )
    if args.parallel is not None and not 1 <= args.parallel <= 64:
        parser.error("--parallel must be between 1 and 64")
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be >= 1 (leave it out for one per usable physical core)")
    _apply_placement(parser, args, settings)
    if args.data_dir is not None:
        settings.data_dir = args.data_dir.expanduser()
    _apply_keys(parser, args, settings)
    _apply_origins(parser, args, settings)
    if args.models_dir is not None:
        settings.models_dir = args.models_dir.expanduser()
    settings.extra_models = list(args.models[1:])
    for flag in ("models_max_mem_mb", "models_idle_s"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            parser.error(f"--{flag.removesuffix('_mb').replace('_', '-')} must be > 0")
    settings.models_max_mem_mb = args.models_max_mem_mb
    settings.models_idle_s = args.models_idle_s
    if args.max_queue is not None:
        if args.max_queue < 0:
            parser.error("--max-queue must be >= 0")
        settings.limits = replace(settings.limits, queue=replace(settings.limits.queue, max_pending=args.max_queue))
    if args.max_output_tokens_default is not None:
        if args.max_output_tokens_default < 0:
            parser.error("--max-output-tokens-default must be >= 0")
        settings.limits = replace(settings.limits, request=replace(
            settings.limits.request, max_output_tokens_default=args.max_output_tokens_default))
    if args.repetition_window is not None:
        if args.repetition_window < 0:
            parser.error("--repetition-window must be >= 0")
        settings.limits = replace(settings.limits, request=replace(
            settings.limits.request, repetition_window=args.repetition_window))
    if args.websocket_max_age_s is not None:
        if args.websocket_max_age_s <= 0:
            parser.error("--websocket-max-age-s must be > 0")
        settings.limits = replace(settings.limits, websocket_max_age_s=args.websocket_max_age_s)
    _apply_retention(parser, args, settings)
    if args.store is not None:
        settings.store = args.store
    if args.store_lease_s is not None:
        if args.store_lease_s <= 0:
            parser.error("--store-lease-s must be > 0")
        settings.store_lease_s = args.store_lease_s
    _apply_engine(parser, args, settings, serve)
    _apply_cache(parser, args, settings)
    from lmspd.server import serve as run_server

    return run_server(settings)


def _apply_placement(parser: argparse.ArgumentParser, args: argparse.Namespace, settings: Settings) -> None:
    from lmspd.engines.llama.amx import setting as amx_setting
    from lmspd.engines.specs import check_kv_type, parse_ctx, parse_gpu_layers

    try:
        settings.ctx = parse_ctx(args.ctx)
        settings.gpu_layers = parse_gpu_layers(args.gpu_layers)
        check_kv_type(args.kv_type, args.flash_attn, args.rope_scaling)
        amx_setting()
    except ValueError as exc:
        parser.error(str(exc))
    settings.flash_attn = args.flash_attn
    settings.kv_type = args.kv_type
    settings.rope_scaling = args.rope_scaling


def _apply_keys(parser: argparse.ArgumentParser, args: argparse.Namespace, settings: Settings) -> None:
    from lmspd.auth import parse_key, read_keys_file

    try:
        for spec in settings.api_keys:
            parse_key(spec)
        if args.api_keys_file is not None:
            settings.api_keys = [*settings.api_keys, *read_keys_file(args.api_keys_file.expanduser())]
    except (OSError, ValueError) as exc:
        # The message names the file and line, never the key.
        parser.error(f"--api-key/--api-keys-file: {exc}")


def _apply_origins(parser: argparse.ArgumentParser, args: argparse.Namespace, settings: Settings) -> None:
    from lmspd.origins import split_origins

    if args.allowed_origins is not None:
        settings.allowed_origins = list(args.allowed_origins)
    try:
        split_origins(settings.allowed_origins)
    except ValueError as exc:
        parser.error(f"--allowed-origins/LMSPD_ORIGINS: {exc}")


def _apply_retention(parser: argparse.ArgumentParser, args: argparse.Namespace, settings: Settings) -> None:
    changes: dict[str, typing.Any] = {}
    for flag, field, scale in (("response_retention_s", "response_ttl_s", 1), ("task_retention_s", "task_ttl_s", 1),
                               ("event_retention_s", "event_ttl_s", 1),
                               ("max_response_mib", "max_response_bytes", 1024 * 1024),
                               ("max_event_mib", "max_event_bytes", 1024 * 1024)):
        value = getattr(args, flag)
        if value is None:
            continue
        if value <= 0:
            parser.error(f"--{flag.replace('_', '-')} must be > 0")
        changes[field] = int(value * scale) if scale != 1 else value
    settings.retention = replace(settings.retention, **changes)
    if args.prune_interval_s is not None:
        if args.prune_interval_s <= 0:
            parser.error("--prune-interval-s must be > 0")
        settings.prune_interval_s = args.prune_interval_s


def _engine_flags(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("engines (what serves the model)")
    group.add_argument("--engine", choices=["llama", "upstream"], default="llama",
                       help="llama: a local GGUF (--model); upstream: a Chat Completions provider")
    group.add_argument("--upstream-url", action="append", default=[], dest="upstream_urls", metavar="URL",
                       help="the provider's API base, e.g. http://127.0.0.1:8000/v1 (repeatable: several "
                            "endpoints, health-checked and load-balanced)")
    group.add_argument("--upstream-model", default=None, metavar="NAME", help="the provider's name for the model")
    group.add_argument("--served-model", default=None, metavar="ID",
                       help="the model id clients use (default: --upstream-model, or the GGUF's id)")
    group.add_argument("--upstream-profile", default="generic", choices=["generic", "openai", "llama-cpp-python"],
                       help="provider dialect quirks (default generic: vLLM, SGLang, llama-server, Ollama)")
    group.add_argument("--upstream-idle-timeout", type=float, default=None, metavar="SECONDS",
                       help="fail a provider stream that sends nothing for this long (default 120)")
    group.add_argument("--upstream-progress-timeout", type=float, default=None, metavar="SECONDS",
                       help="fail a provider stream that sends no output (text, reasoning, tool calls, usage, a "
                            "finish) for this long, keep-alives or not (default "
                            f"{DEFAULT_LIMITS.upstream.progress_timeout_s:g})")
    group.add_argument("--upstream-context-window", type=int, default=None, metavar="TOKENS",
                       help="the provider's context window, as reported to clients (default: what the provider "
                            "says at start: vLLM's and SGLang's max_model_len, llama.cpp server's n_ctx; else "
                            f"{DEFAULT_CONTEXT_WINDOW})")
    group.add_argument("--upstream-routing", default="affinity", choices=["affinity", "least-loaded", "round-robin"],
                       help="how several --upstream-url endpoints share requests (default affinity: the endpoint "
                            "that has the conversation's prefix cached, bounded by load)")
    group.add_argument("--config", type=Path, default=None, dest="config_file", metavar="FILE",
                       help="a TOML/JSON file mapping served model ids to engines and their settings, instead "
                            f"of {', '.join(flag for flag, _, _ in _PER_MODEL_FLAGS)} (its keys: "
                            "lmspd/engines/specs.py)")


def _cache_flags(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("continuation KV cache (local models)")
    group.add_argument("--chat-template", default=None, metavar="FILE",
                       help="a Jinja chat template to use instead of the GGUF's own")
    group.add_argument("--no-prefix-cache", action="store_true",
                       help="never reuse KV state between requests (for comparison)")
    group.add_argument("--kv-disk-dir", type=Path, default=None, metavar="DIR",
                       help="where KV checkpoints live (default: <data-dir>/kv)")
    group.add_argument("--kv-disk-space-mb", type=int, default=Settings.kv_disk_space_mb, metavar="MB",
                       help="size budget of the checkpoint directory, least recently used go first (default "
                            "%(default)s; 0 turns the disk tier off)")
    group.add_argument("--kv-ram-mb", type=int, default=Settings.kv_ram_mb, metavar="MB",
                       help="KV sessions kept in RAM so agents used in turn continue without the disk (default "
                            "%(default)s)")
    group.add_argument("--kv-checkpoint-every", type=int, default=Settings.kv_checkpoint_every, metavar="TOKENS",
                       help="checkpoint a long prefill every this many tokens (default %(default)s; 0: never)")
    group.add_argument("--speculative", choices=["auto", "off"], default="auto",
                       help="speculative decoding from the grammar's forced tokens and the sequence's own text, "
                            "drafted only where it pays (default auto; off on a KV that cannot be trimmed)")
    group.add_argument("--swa-full", action="store_true",
                       help="keep every KV cell of sliding-window layers (Gemma 3, gpt-oss): trimmable like plain "
                            "attention, at n_ctx cells per layer; default: the last window only, with exact-state "
                            "checkpoints at turn boundaries")
    group.add_argument("--keep-billing-header", action="store_true",
                       help="render Claude Code's per-request 'x-anthropic-billing-header: ...cch=...' system line "
                            "(stripped by default: it changes every request and defeats the cache)")
    group.add_argument("--keep-tool-order", action="store_true",
                       help="render tools in the order the client sent them (default: sorted by name, so that a "
                            "reordered tool list keeps the cached prompt)")


def _sampling_flags(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("sampling where a request sets none (local models; a provider has its own)")
    group.add_argument("--temperature", type=float, default=None, metavar="T",
                       help="sampling for a request that sets none (Codex sends no temperature), over the GGUF's "
                            "own general.sampling.temp (default: the model's, else 1.0)")
    group.add_argument("--top-p", type=float, default=None, metavar="P", help="likewise top-p (1: off)")
    group.add_argument("--top-k", type=int, default=None, metavar="K", help="likewise top-k (0: off)")
    group.add_argument("--min-p", type=float, default=None, metavar="P", help="likewise min-p (0: off)")


def _apply_cache(parser: argparse.ArgumentParser, args: argparse.Namespace, settings: Settings) -> None:
    for flag in ("kv_disk_space_mb", "kv_ram_mb", "kv_checkpoint_every"):
        if getattr(args, flag) < 0:
            parser.error(f"--{flag.replace('_', '-')} must be >= 0")
    settings.chat_template = args.chat_template
    settings.prefix_cache = not args.no_prefix_cache
    settings.kv_disk_dir = args.kv_disk_dir.expanduser() if args.kv_disk_dir else None
    settings.kv_disk_space_mb = args.kv_disk_space_mb
    settings.kv_ram_mb = args.kv_ram_mb
    settings.kv_checkpoint_every = args.kv_checkpoint_every
    settings.swa_full = args.swa_full
    settings.speculative = args.speculative
    from lmspd.engines.specs import parse_sampling

    try:
        settings.sampling = parse_sampling(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                           min_p=args.min_p)
    except ValueError as exc:
        parser.error(str(exc))
    if args.engine == "upstream" and any(v is not None for v in (args.temperature, args.top_p, args.top_k, args.min_p)):
        parser.error("--temperature, --top-p, --top-k and --min-p are for local models: a provider samples a "
                     "request that sets none with its own defaults")
    settings.strip_billing_header = not args.keep_billing_header
    settings.canonical_tool_order = not args.keep_tool_order


def _apply_engine(parser: argparse.ArgumentParser, args: argparse.Namespace, settings: Settings,
                  serve: argparse.ArgumentParser) -> None:
    settings.engine = args.engine
    if args.served_model is not None:
        from lmspd.engines.specs import ConfigError, check_served_id

        try:
            check_served_id(args.served_model, "--served-model")
        except ConfigError as exc:
            parser.error(str(exc))
    settings.served_model = args.served_model
    settings.upstream_urls = list(args.upstream_urls)
    settings.upstream_model = args.upstream_model
    settings.upstream_profile = args.upstream_profile
    settings.upstream_routing = args.upstream_routing
    if args.upstream_idle_timeout is not None:
        if args.upstream_idle_timeout <= 0:
            parser.error("--upstream-idle-timeout must be > 0")
        settings.upstream_idle_timeout_s = args.upstream_idle_timeout
    if args.upstream_progress_timeout is not None:
        if not args.upstream_progress_timeout > 0:
            parser.error("--upstream-progress-timeout must be > 0")
        settings.upstream_progress_timeout_s = args.upstream_progress_timeout
    if args.upstream_context_window is not None:
        if args.upstream_context_window < 1:
            parser.error("--upstream-context-window must be >= 1")
        settings.upstream_context_window = args.upstream_context_window
    if args.config_file is not None:
        given = [(flag, key) for flag, key, dest in _PER_MODEL_FLAGS
                 if getattr(args, dest) != serve.get_default(dest)]
        if given:
            # Each model's entry in the file says these; a flag beside it would be ignored.
            parser.error(f"--config names every model and its settings: drop {', '.join(f for f, _ in given)} "
                         f"(in the file, each model's entry: {', '.join(k for _, k in given)})")
        settings.config_file = args.config_file.expanduser()
    elif args.engine == "upstream" and (not args.upstream_urls or not args.upstream_model):
        parser.error("--engine upstream needs --upstream-url and --upstream-model")
    elif args.engine == "upstream" and (local := [flag for flag, dest in _LOCAL_FLAGS
                                                  if getattr(args, dest) != serve.get_default(dest)]):
        # The provider runs the model: these would be ignored without a word.
        parser.error(f"{', '.join(local)}: for local models (--engine llama); --engine upstream serves the "
                     "provider's model, drop them")
    elif args.engine == "llama" and (args.upstream_urls or args.upstream_model
                                     or args.upstream_context_window is not None):
        parser.error("--upstream-url/--upstream-model/--upstream-context-window need --engine upstream")


# The flags that set one model's engine, which a --config file's entries set
# instead: (flag, the entry's key, argparse dest). The sampling flags are not
# here: under --config they still apply, beneath each entry's own.
_PER_MODEL_FLAGS = (
    ("--model", "model", "models"),
    ("--served-model", "the entry's name ([models.ID])", "served_model"),
    ("--engine", "engine", "engine"),
    ("--ctx", "ctx", "ctx"),
    ("--threads", "threads", "threads"),
    ("--parallel", "parallel", "parallel"),
    ("--gpu-layers", "gpu_layers", "gpu_layers"),
    ("--flash-attn", "flash_attn", "flash_attn"),
    ("--kv-type", "kv_type", "kv_type"),
    ("--rope-scaling", "rope_scaling", "rope_scaling"),
    ("--chat-template", "chat_template", "chat_template"),
    ("--upstream-url", "url or urls", "upstream_urls"),
    ("--upstream-model", "upstream_model", "upstream_model"),
    ("--upstream-profile", "profile", "upstream_profile"),
    ("--upstream-idle-timeout", "idle_timeout_s", "upstream_idle_timeout"),
    ("--upstream-progress-timeout", "progress_timeout_s", "upstream_progress_timeout"),
    ("--upstream-routing", "routing", "upstream_routing"),
    ("--upstream-context-window", "context_window", "upstream_context_window"),
)


# The flags that only a local model (--engine llama) reads: (flag, argparse
# dest). Not --models-dir: /v1/models lists the GGUFs found there whatever
# the engine.
_LOCAL_FLAGS = (
    ("--model", "models"),
    ("--ctx", "ctx"),
    ("--threads", "threads"),
    ("--parallel", "parallel"),
    ("--gpu-layers", "gpu_layers"),
    ("--flash-attn", "flash_attn"),
    ("--kv-type", "kv_type"),
    ("--rope-scaling", "rope_scaling"),
    ("--chat-template", "chat_template"),
    ("--models-max-mem", "models_max_mem_mb"),
    ("--models-idle-s", "models_idle_s"),
    ("--max-output-tokens-default", "max_output_tokens_default"),
    ("--repetition-window", "repetition_window"),
    ("--no-prefix-cache", "no_prefix_cache"),
    ("--kv-disk-dir", "kv_disk_dir"),
    ("--kv-disk-space-mb", "kv_disk_space_mb"),
    ("--kv-ram-mb", "kv_ram_mb"),
    ("--kv-checkpoint-every", "kv_checkpoint_every"),
    ("--speculative", "speculative"),
    ("--swa-full", "swa_full"),
    ("--keep-billing-header", "keep_billing_header"),
    ("--keep-tool-order", "keep_tool_order"),
)


def _port(text: str) -> int:
    # Checked here: out of range, uvicorn failed with a traceback after the model had loaded.
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be a number from 0 to 65535, not {text!r}")
    return port


def _config_parser(sub: argparse._SubParsersAction) -> None:
    config = sub.add_parser("config", help="manage saved settings (the upstream provider key)")
    actions = config.add_subparsers(dest="action", required=True)
    for name, text in (("set-key", "save the upstream provider key (read from stdin, never from the command line)"),
                       ("clear-key", "remove a saved upstream provider key")):
        action = actions.add_parser(name, help=text)
        action.add_argument("--data-dir", type=Path, default=None)
        action.add_argument("--name", default="default", help="a name, for several providers (default: default)")


def _config(args: argparse.Namespace) -> int:
    from lmspd.engines.upstream.credentials import CredentialError, clear_key, save_key

    data_dir = (args.data_dir or Settings().data_dir).expanduser()
    try:
        if args.action == "clear-key":
            print("removed" if clear_key(data_dir, args.name) else "no saved key", file=sys.stderr)
            return 0
        if sys.stdin.isatty():
            import getpass

            value = getpass.getpass("upstream API key: ")
        else:
            value = sys.stdin.readline()
        path = save_key(data_dir, value, args.name)
    except CredentialError as exc:
        print(f"lmspd: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # --data-dir names a file, or one not ours to write
        print(f"lmspd: {exc.filename}: {exc.strerror}" if exc.filename else f"lmspd: {exc}", file=sys.stderr)
        return 2
    print(f"saved to {path} (readable by you only)", file=sys.stderr)
    return 0


def _models(models_dir: Path | None, *, as_json: bool = False) -> int:
    import json

    from lmspd.engines.llama.models import catalog

    rows = catalog(models_dir.expanduser() if models_dir else None)
    if as_json:
        print(json.dumps([{**r.public(), "path": str(r.path), "error": r.error} for r in rows], indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Models lmspd can serve (lmspd serve --model NAME)")
    table.add_column("name", no_wrap=True)
    # What the chat template renders natively (lmspd adds tool calls to any model by grammar).
    for column in ("source", "size", "context", "quant", "native tools", "reasoning"):
        table.add_column(column, no_wrap=True)
    table.add_column("path", overflow="fold")
    for r in rows:
        yes = {True: "yes", False: "-"}
        table.add_row(r.name, r.source, _size(r.size_bytes), str(r.context_length or "?"), r.quantization or "?",
                      yes[r.capabilities.get("tools", False)], yes[r.capabilities.get("reasoning", False)],
                      str(r.path) if r.error is None else f"{r.path} ({r.error})")
    # Piped output is not cut to 80 columns: names and paths stay whole.
    Console(width=None if sys.stdout.isatty() else 200).print(table)
    print("Any other GGUF file can be served with: lmspd serve --model /path/to/model.gguf")
    return 0


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


if __name__ == "__main__":
    sys.exit(main())
