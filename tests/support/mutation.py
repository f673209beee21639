"""Valid request bodies with one part replaced by any JSON value, for the
property tests that decoders answer every input with a result or a 4xx."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import strategies as st

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)


def paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every place in ``value`` (the whole of it first), as keys and indexes."""
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += paths(v, (*prefix, i))
    return out


def replaced(body: Any, path: tuple, new: Any) -> Any:
    """A copy of ``body`` with ``new`` at ``path``."""
    if not path:
        return new
    body = copy.deepcopy(body)
    node = body
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = new
    return body
