"""Settings: one object built from flags (and the environment), read everywhere."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path

from lmspd.core.limits import DEFAULT_LIMITS, Limits


@dataclass
class Settings:
    host: str = "127.0.0.1"
    port: int = 8080
    model: str | None = None
    ctx: int = 8192
    threads: int | None = None
    data_dir: Path = field(default_factory=lambda: Path(os.environ.get("LMSPD_DATA_DIR", "~/.lmspd")).expanduser())
    api_keys: list[str] = field(default_factory=list)
    log_level: str = "info"
    limits: Limits = DEFAULT_LIMITS

    @property
    def loopback(self) -> bool:
        if self.host in ("localhost", ""):
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"
