"""The requests real clients sent and the replies they got, as
../shared/clients/*/captured holds them, copied into tests/fixtures/clients
so that the suite needs nothing outside the repository."""

from __future__ import annotations

from pathlib import Path

CLIENTS = Path(__file__).resolve().parents[1] / "fixtures" / "clients"
CODEX_CAPTURES = CLIENTS / "codex-cli" / "captured"
