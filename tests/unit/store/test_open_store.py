"""``open_store``'s target: a PostgreSQL URL, or a path to the SQLite file.
A URL of any other scheme became a SQLite file named after it (in the
working directory, the URL's password in its path)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmspd.store import open_store, postgres_dsn


@pytest.mark.parametrize("target", [
    "postgresql+pg8000://lmspd:s3cret@db.internal/lmspd",
    "mysql://lmspd:s3cret@db.internal/lmspd",
    "sqlite:///var/lib/lmspd:s3cret.db",
    "file:///tmp/lmspd:s3cret",
    "lmspd:s3cret@db.internal://x",
])
def test_a_url_of_another_scheme_is_refused_without_its_password(target: str, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as refused:
        open_store(target)
    message = str(refused.value)
    assert "postgresql://, postgres://, postgresql+psycopg://" in message, message
    assert "s3cret" not in message and "db.internal" not in message, message
    assert list(tmp_path.iterdir()) == [], "a file was created"


def test_postgres_urls_and_paths() -> None:
    assert postgres_dsn("postgresql://u:p@h/db") == "postgresql://u:p@h/db"
    assert postgres_dsn("postgres://u:p@h/db") == "postgres://u:p@h/db"
    # SQLAlchemy's spelling: psycopg takes the libpq URL without the driver.
    assert postgres_dsn("postgresql+psycopg://u:p@h:5433/db?sslmode=require") == \
        "postgresql://u:p@h:5433/db?sslmode=require"
    assert postgres_dsn("state/lmspd.sqlite3") is None
    assert postgres_dsn(Path("/var/lib/lmspd/lmspd.sqlite3")) is None


def test_a_path_is_still_the_sqlite_file(tmp_path: Path) -> None:
    store = open_store(tmp_path / "lmspd.sqlite3")
    try:
        assert type(store).__name__ == "SQLiteStore"
    finally:
        store.close()
    assert (tmp_path / "lmspd.sqlite3").exists()
