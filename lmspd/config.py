"""Settings: one object built from flags (and the environment), read everywhere."""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

from lmspd.core.conversation import SamplingDefaults
from lmspd.core.limits import DEFAULT_LEASE_S, DEFAULT_LIMITS, Limits, Retention

# The window ``--ctx auto`` gives a model trained on less (lmspd.engines.llama.fit
# AUTO_MIN_WINDOW; a longer trained length is kept, memory allowing). Codex's first request is ~9k tokens in the
# bundled model's tokens (its developer prompt and tool schemas) and grows
# with every turn; 8192 refused it. The KV costs 2 (K, V) x layers x KV heads
# x head dim x 2 bytes per token and per sequence: 22.5 KiB for SmolLM2-135M
# (30 x 3 x 64), so 720 MiB per sequence at 32768 (llama.cpp allocates it
# up front). The bundled model was trained on 8192; past that it still runs
# (RoPE extrapolates), answers get worse long before the window is full.
DEFAULT_CTX = 32768


@dataclass
class Settings:
    host: str = "127.0.0.1"
    port: int = 8080
    model: str | None = None
    # Searched for GGUFs besides the Hugging Face, Ollama and LM Studio stores.
    models_dir: Path | None = None
    # More local models (--model repeated): all load on first use (lmspd.engines.registry).
    extra_models: list[str] = field(default_factory=list)
    models_max_mem_mb: int | None = None
    models_idle_s: float | None = None
    # Tokens per sequence: None is --ctx auto (fitted to memory at load), 0 the trained length.
    ctx: int | None = None
    threads: int | None = None
    # Sequences of the llama context decoded together (--parallel); None: 4, lowered to fit.
    parallel: int | None = None
    # Where a local model runs (lmspd.engines.llama.placement): layers on the
    # GPU (None: all that fit), flash attention (auto: on with a GPU), KV type.
    gpu_layers: int | None = None
    flash_attn: str = "auto"
    kv_type: str = "f16"
    # YaRN over a window past the trained length: "auto" or "none" (placement.rope_scaling).
    rope_scaling: str = "auto"
    data_dir: Path = field(default_factory=lambda: Path(os.environ.get("LMSPD_DATA_DIR", "~/.lmspd")).expanduser())
    api_keys: list[str] = field(default_factory=list)
    # Web origins (besides loopback ones and the server's own) whose pages
    # may use the server: --allowed-origins, env LMSPD_ORIGINS (lmspd.origins).
    allowed_origins: list[str] = field(default_factory=lambda: [os.environ.get("LMSPD_ORIGINS", "")])
    log_level: str = "info"
    limits: Limits = DEFAULT_LIMITS
    # Which engine serves the model the flags name (lmspd.engines.specs):
    # "llama" serves --model; "upstream" a Chat Completions provider.
    engine: str = "llama"
    served_model: str | None = None
    upstream_urls: list[str] = field(default_factory=list)
    upstream_model: str | None = None
    upstream_profile: str = "generic"
    upstream_idle_timeout_s: float | None = None
    upstream_progress_timeout_s: float | None = None
    # None: what the provider says at start (lmspd.engines.upstream.window).
    upstream_context_window: int | None = None
    # How several --upstream-url endpoints share requests (upstream/routing.py).
    upstream_routing: str = "affinity"
    # A TOML/JSON file mapping served model ids to engines, instead of the above.
    config_file: Path | None = None
    # A Jinja chat template file to use instead of the GGUF's own.
    chat_template: str | None = None
    # The continuation KV cache (lmspd.cache): RAM sessions and disk checkpoints.
    prefix_cache: bool = True
    kv_disk_dir: Path | None = None  # default: <data_dir>/kv
    kv_disk_space_mb: int = 4096
    kv_ram_mb: int = 1024
    kv_checkpoint_every: int = 2048
    # Full-size KV for sliding-window layers (see CacheSettings.swa_full).
    swa_full: bool = False
    # Speculative decoding of local models (--speculative: auto or off).
    speculative: str = "auto"
    # What a request leaves unset is sampled with, over each local model's own
    # settings (--temperature, --top-p, --top-k, --min-p).
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)
    # Cache-killer repairs (README: "Cache repairs").
    strip_billing_header: bool = True
    canonical_tool_order: bool = True
    # How long and how much the store keeps (responses, tasks, event logs).
    retention: Retention = field(default_factory=Retention)
    prune_interval_s: float = 60.0
    # Where that state lives: None is <data_dir>/lmspd.sqlite3; a
    # postgresql:// URL is a database several instances share.
    store: str | None = field(default_factory=lambda: os.environ.get("LMSPD_STORE") or None)
    # How long an instance's running tasks count as alive without its
    # heartbeat (shared store: a survivor fails them after that).
    store_lease_s: float = DEFAULT_LEASE_S

    @property
    def loopback(self) -> bool:
        """Whether every address ``host`` binds is a loopback one. ``""`` (and
        ``0.0.0.0``, ``::``) bind every interface; a name counts only if all
        it resolves to is loopback; one that does not resolve does not count."""
        if not self.host:
            return False
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            pass
        try:
            infos = socket.getaddrinfo(self.host, None, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            return False
        addresses = {info[4][0] for info in infos}
        return bool(addresses) and all(ipaddress.ip_address(str(a).split("%", 1)[0]).is_loopback for a in addresses)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"
