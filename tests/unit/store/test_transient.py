"""Which store errors a write is tried again after (``transient``): those
that pass. A permanent one retried "until it lands" would hold a finished
task in_progress until shutdown, warning every two seconds."""

from __future__ import annotations

import sqlite3

import psycopg
import psycopg.errors
import psycopg_pool
import pytest

from lmspd.store.calls import transient


@pytest.mark.parametrize("error,passes", [
    (sqlite3.OperationalError("database is locked"), True),
    (sqlite3.OperationalError("database table is locked: tasks"), True),
    (sqlite3.OperationalError("disk I/O error"), True),
    (sqlite3.OperationalError("database or disk is full"), True),
    (sqlite3.OperationalError("no such table: responses"), False),
    (sqlite3.OperationalError("attempt to write a readonly database"), False),
    (sqlite3.OperationalError("too many SQL variables"), False),
    (sqlite3.IntegrityError("UNIQUE constraint failed: responses.id"), False),
    (psycopg.OperationalError("server closed the connection unexpectedly"), True),
    (psycopg_pool.PoolTimeout("couldn't get a connection after 30.00 sec"), True),
    (psycopg.errors.lookup("40001")("could not serialize access"), True),
    (psycopg.errors.lookup("40P01")("deadlock detected"), True),
    (psycopg.errors.lookup("53100")("could not extend file: No space left on device"), True),
    (psycopg.errors.lookup("57P01")("terminating connection due to administrator command"), True),
    (psycopg.errors.lookup("54000")("program limit exceeded"), False),
    (psycopg.errors.lookup("23505")("duplicate key value"), False),
    (ValueError("a bug"), False),
])
def test_only_errors_that_pass_are_tried_again(error, passes) -> None:
    assert transient(error) is passes
