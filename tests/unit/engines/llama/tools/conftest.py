"""Fixtures for the tool and grammar tests (the helpers live in
``support.grammar_rig``: a second module named ``conftest`` would shadow
``tests/conftest.py`` for ``from support.server import MODEL``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from support.grammar_rig import GrammarRig


@pytest.fixture(scope="session")
def rig() -> GrammarRig:
    return GrammarRig()


@pytest.fixture
def call_ids() -> Callable[[], str]:
    counter = iter(range(1_000_000))
    return lambda: f"call_{next(counter)}"
