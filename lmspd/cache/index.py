"""An index over the RAM tier's states, so that planning a request examines
only the states that share something worth reusing with it.

The planner (lmspd.cache.planner) once scanned every RAM state of a
request's owner — a token prefix comparison, two text prefix tests and the
alignment points of each — on the scheduler thread, before every admission:
~50 ms a plan against 1,600 states, while every running stream waited. Most
of those states cannot matter: they share nothing with the request, or only
what another state shares as well (every Codex session shares ~10k tokens
of instructions).

Per owner, two radix trees over what the planner's rules compare:

- the **token tree** holds each state's tokens. One walk of the request's
  tokens gives every state's common token prefix with it at once: the
  states under the node where the walk stops share the most, those under
  its parent the next most, and so on (``levels``). Each node keeps the
  states below it in the order RAM keeps them (``Node.below``), so that
  the first acceptable one of many equal states is found without looking
  at the others. Nodes also sit at every alignment point's token count.
- the **text tree** holds each state's visible transcript and KV text
  (a state whose text starts the request's: ``text_prefixes``) and the
  prompt text of its alignment points (``aligned_branches``). An alignment
  point whose text starts the request's matters only when the request's
  tokens part from the state's before the point (a sampled turn); points
  are filed under the token node of their prefix, so the points of many
  states that hold the same tokens there (sessions that copied the same
  instructions) are passed over as one.

A state's tokens, texts and alignment points never change while it is in
RAM (every ``SessionState`` is built whole, from copies of a sequence's
tokens, and only its ``kv``, ``floor`` and ``boundary`` are set again, right
before ``Tiers.remember`` files it anew); the index reads ``floor`` and
``boundary`` live. ``RamStates`` keeps the index in step with the RAM
tier: it is the tier's only container, and every change goes through it.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Collection, Hashable, Iterable, Iterator, KeysView, Mapping, Sequence, ValuesView
from dataclasses import fields, is_dataclass
from typing import Any

from .state import SessionState, common_prefix


def kind(state: SessionState) -> Hashable:
    """What the diagnosis ranks states of an equal prefix by (the planner's
    ``_longest_remembered``): their signature (states of one kind have
    equal signatures) and whether they know their items."""
    sig = state.signature
    if is_dataclass(sig) and not isinstance(sig, type):
        # A dataclass's == compares its fields, in a class of its own.
        likeness: Hashable = (type(sig), *(getattr(sig, f.name) for f in fields(sig)))
    else:
        likeness = (type(sig), sig)
    try:
        hash(likeness)
    except TypeError:
        likeness = ("each its own", id(sig))
    return likeness, bool(state.items)


class Node:
    """A radix tree node: the prefix of every sequence below it ends here,
    ``depth`` symbols from the root; ``label`` is the edge from its parent."""

    __slots__ = ("label", "depth", "parent", "children", "refs", "ends", "below", "kinds", "points")

    def __init__(self, label: Any, depth: int, parent: Node | None) -> None:
        self.label = label  # a slice of what was filed: a token list or a str
        self.depth = depth
        self.parent = parent
        self.children: dict[Any, Node] = {}
        # How many filings hold the node (a node nothing holds is pruned).
        self.refs = 0
        # States a sequence of which ends exactly here.
        self.ends: dict[str, SessionState] = {}
        # Token tree: every state below (its tokens start with this prefix),
        # in RAM order; and the same by ``kind`` (each kind in RAM order).
        self.below: dict[str, SessionState] = {}
        self.kinds: dict[Hashable, dict[str, SessionState]] = {}
        # Text tree: alignment points whose text ends here, by the token
        # node of their tokens (None: more tokens than the state has).
        self.points: dict[Node | None, dict[str, SessionState]] = {}


class PrefixTree:
    """A radix tree over token lists or strings; nodes are created where a
    filing asks for one and pruned (or merged into their only child) when
    nothing holds them, so a walk meets only nodes that hold something."""

    def __init__(self) -> None:
        self.root = Node((), 0, None)

    def nodes_at(self, seq: Sequence[Any], depths: Iterable[int]) -> list[Node]:
        """The nodes at ``depths`` (ascending) along ``seq``, each held once
        more; created, splitting an edge, where there is none. One descent:
        the cost is ``seq``'s length, however many depths."""
        node, d, out = self.root, 0, []
        for n in depths:
            while d < n:
                child = node.children.get(seq[d])
                if child is None:
                    child = Node(seq[d:n], n, node)
                    node.children[seq[d]] = child
                else:
                    label = child.label
                    m = common_prefix(label, seq[d:min(n, d + len(label))])
                    if m < len(label):
                        # Split the edge: the new node has what was below the child.
                        mid = Node(label[:m], d + m, node)
                        mid.below = dict(child.below)
                        mid.kinds = {k: dict(same) for k, same in child.kinds.items()}
                        child.label, child.parent = label[m:], mid
                        mid.children[label[m]] = child
                        node.children[seq[d]] = mid
                        child = mid
                node, d = child, child.depth
            node.refs += 1
            out.append(node)
        return out

    def release(self, node: Node) -> None:
        """One filing less holds ``node``: prune what nothing holds."""
        node.refs -= 1
        while node.parent is not None and node.refs == 0:
            parent = node.parent
            if not node.children:
                del parent.children[node.label[0]]
                node = parent
            elif len(node.children) == 1:
                # Merge into the only child (whose identity points may hold).
                (child,) = node.children.values()
                child.label = node.label + child.label
                child.parent = parent
                parent.children[node.label[0]] = child
                return
            else:
                return

    def walk(self, query: Sequence[Any]) -> tuple[list[Node], Node | None, int]:
        """The nodes whose whole prefix starts ``query`` (root first), and the
        child the walk stopped inside with how deep it got there (None, 0:
        it stopped at a node)."""
        node, d, path = self.root, 0, [self.root]
        while d < len(query):
            child = node.children.get(query[d])
            if child is None:
                break
            label = child.label
            part = query[d:d + len(label)]
            if part != label:
                return path, child, d + common_prefix(label, part)
            node, d = child, child.depth
            path.append(node)
        return path, None, 0


class OwnerIndex:
    """One owner's states in a token tree and a text tree, and the nodes
    each state holds (to take it out again)."""

    def __init__(self) -> None:
        self.tokens = PrefixTree()
        self.texts = PrefixTree()
        self.held: dict[str, list[tuple[PrefixTree, Node]]] = {}
        self.ends: dict[str, Node] = {}  # the token node each state ends at
        self.kind: dict[str, Hashable] = {}  # each state's ``kind`` when it was filed
        self.by_response: dict[str, dict[str, SessionState]] = {}

    def add(self, key: str, state: SessionState) -> None:
        tokens, n = state.tokens, len(state.tokens)
        points = [(t, c) for t, c in state.aligned]
        # Token nodes at its end and at every point it has the tokens of.
        depths = sorted({n, *(t for t, _ in points if t <= n)})
        at = dict(zip(depths, self.tokens.nodes_at(tokens, depths), strict=True))
        held = [(self.tokens, node) for node in at.values()]
        end = at[n]
        end.ends[key] = state
        # Text nodes at the end of its KV text and of its visible transcript
        # (an empty one matches nothing), and at every point's text.
        for text in {state.kv_text, *([state.visible] if state.visible else [])}:
            (text_end,) = self.texts.nodes_at(text, [len(text)])
            text_end.ends[key] = state
            held.append((self.texts, text_end))
        aligned_text = state.aligned_text
        chars = sorted({min(c, len(aligned_text)) for _, c in points})
        text_at = dict(zip(chars, self.texts.nodes_at(aligned_text, chars), strict=True))
        held += [(self.texts, node) for node in text_at.values()]
        for t, c in points:
            group = text_at[min(c, len(aligned_text))].points.setdefault(at.get(t) if t <= n else None, {})
            group[key] = state
        # Below every node of its token path, last in RAM order (the path's
        # nodes are all there now).
        alike = kind(state)
        node: Node | None = end
        while node is not None:
            node.below[key] = state
            node.kinds.setdefault(alike, {})[key] = state
            node = node.parent
        self.held[key], self.ends[key], self.kind[key] = held, end, alike
        if state.response_id is not None:
            self.by_response.setdefault(state.response_id, {})[key] = state

    def remove(self, key: str, state: SessionState) -> None:
        node: Node | None = self.ends.pop(key)
        alike = self.kind.pop(key)
        while node is not None:
            node.below.pop(key, None)
            same = node.kinds.get(alike)
            if same is not None:
                same.pop(key, None)
                if not same:
                    del node.kinds[alike]
            node = node.parent
        for tree, held in self.held.pop(key):
            held.ends.pop(key, None)
            if held.points:
                for group in held.points.values():
                    group.pop(key, None)
                held.points = {at: group for at, group in held.points.items() if group}
            tree.release(held)
        if state.response_id is not None:
            same = self.by_response[state.response_id]
            same.pop(key, None)
            if not same:
                del self.by_response[state.response_id]

    def __len__(self) -> int:
        return len(self.held)


class RamIndex:
    """The RAM states by owner, in a token tree and a text tree each, and
    the order they were kept in (the planner's tie-break among equals)."""

    def __init__(self, states: Mapping[str, SessionState] | None = None) -> None:
        self.owners: dict[str, OwnerIndex] = {}
        self.order: dict[str, int] = {}  # key -> when it was kept (ascending: RAM order)
        self._stamps = itertools.count()
        for key, state in (states or {}).items():
            self.add(key, state)

    def add(self, key: str, state: SessionState) -> None:
        """File ``state`` (under ``key``: its key) as the most recently kept."""
        self.owners.setdefault(state.owner, OwnerIndex()).add(key, state)
        self.order[key] = next(self._stamps)

    def touch(self, key: str, state: SessionState) -> None:
        """``state``, filed under ``key`` already, becomes the most recently
        kept: a new stamp, and the last place in the maps along its token
        path that keep RAM order (its tokens, texts and points are as they
        were filed: nothing else moves). Placement keeps a state captured
        ahead again this way, on the path to the request's first token."""
        self.order[key] = next(self._stamps)
        owner = self.owners[state.owner]
        alike = owner.kind[key]
        node: Node | None = owner.ends[key]
        while node is not None:
            node.below[key] = node.below.pop(key)
            same = node.kinds[alike]
            same[key] = same.pop(key)
            node = node.parent

    def remove(self, key: str, state: SessionState) -> None:
        owner = self.owners[state.owner]
        owner.remove(key, state)
        del self.order[key]
        if not len(owner):
            del self.owners[state.owner]

    def in_order(self, states: Mapping[str, SessionState]) -> list[SessionState]:
        """``states`` (by key) in RAM order, least recently kept first."""
        return [states[key] for key in sorted(states, key=self.order.__getitem__)]

    # -- queries -----------------------------------------------------------------

    def levels(self, owner: str, tokens: Sequence[int]) -> Iterator[tuple[int, Node]]:
        """The owner's states by common token prefix with ``tokens``, longest
        first: (prefix length, the node whose ``below`` are the states whose
        prefix with ``tokens`` is at least that). A level repeats the states
        of the levels before it."""
        index = self.owners.get(owner)
        if index is None:
            return
        path, inside, depth = index.tokens.walk(tokens)
        if inside is not None:
            yield depth, inside
        for node in reversed(path):
            yield node.depth, node

    def text_prefixes(self, owner: str, text: str) -> dict[str, SessionState]:
        """The owner's states whose visible transcript or KV text starts ``text``."""
        index = self.owners.get(owner)
        found: dict[str, SessionState] = {}
        if index is not None:
            for node in index.texts.walk(text)[0]:
                found.update(node.ends)
        return found

    def aligned_branches(self, owner: str, text: str, tokens: Sequence[int],
                         min_tokens: int) -> dict[str, SessionState]:
        """The owner's states with an alignment point of at least
        ``min_tokens`` tokens whose text starts ``text`` while its tokens do
        not start ``tokens``: those a branch may keep more of through the
        point than through their common token prefix. The points of states
        that hold the same tokens there are passed over together."""
        index = self.owners.get(owner)
        found: dict[str, SessionState] = {}
        if index is None:
            return found
        on_path = set(index.tokens.walk(tokens)[0])
        for node in index.texts.walk(text)[0]:
            for at, group in node.points.items():
                if at is None or (at not in on_path and at.depth >= min_tokens):
                    found.update(group)
        return found

    def by_response(self, owner: str, response_id: str) -> list[SessionState]:
        """The owner's states of response ``response_id``, in RAM order."""
        index = self.owners.get(owner)
        return self.in_order(index.by_response.get(response_id, {}) if index is not None else {})

    def end_depths(self, owner: str, tokens: Sequence[int]) -> set[int]:
        """The lengths of the owner's states that are prefixes of ``tokens``."""
        index = self.owners.get(owner)
        if index is None:
            return set()
        return {node.depth for node in index.tokens.walk(tokens)[0] if node.ends}


class RamStates(Mapping[str, SessionState]):
    """The RAM tier's states by key, least recently kept first, with their
    index (``RamIndex``): the one container of the tier, so the index is
    changed with it or not at all."""

    def __init__(self) -> None:
        self._states: OrderedDict[str, SessionState] = OrderedDict()
        self.index = RamIndex()
        # Each state's bytes as it was kept, and their sum: the budget is
        # checked at every capture, and summing every state's is linear.
        self._sizes: dict[str, int] = {}
        self.nbytes = 0
        # The same by owner: the budget is shared fairly among them (``Tiers``).
        self.owner_bytes: dict[str, int] = {}

    def keep(self, state: SessionState) -> None:
        """``state`` under its key, the most recently kept (replacing any
        state under that key)."""
        key = state.key
        old = self._states.pop(key, None)
        self._states[key] = state
        if old is state:
            self.index.touch(key, state)
            self._count(state.owner, -self._sizes[key])
        else:
            if old is not None:
                self._forget(key, old)
            self.index.add(key, state)
        self._sizes[key] = size = state.nbytes
        self._count(state.owner, size)

    def pop_oldest(self, owners: Collection[str] | None = None) -> SessionState:
        """The least recently kept state (of one of ``owners``, when given), removed."""
        if owners is None:
            key, state = self._states.popitem(last=False)
        else:
            key, state = next((k, s) for k, s in self._states.items() if s.owner in owners)
            del self._states[key]
        self._forget(key, state)
        return state

    def drop(self, key: str) -> None:
        self._forget(key, self._states.pop(key))

    def _forget(self, key: str, state: SessionState) -> None:
        self.index.remove(key, state)
        self._count(state.owner, -self._sizes.pop(key))

    def _count(self, owner: str, nbytes: int) -> None:
        self.nbytes += nbytes
        held = self.owner_bytes.get(owner, 0) + nbytes
        if held:
            self.owner_bytes[owner] = held
        else:
            self.owner_bytes.pop(owner, None)

    def __getitem__(self, key: str) -> SessionState:
        return self._states[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._states)

    def __len__(self) -> int:
        return len(self._states)

    # The ordered dict's own views: they can be reversed (newest first).
    def keys(self) -> KeysView[str]:
        return self._states.keys()

    def values(self) -> ValuesView[SessionState]:
        return self._states.values()

    def newest_first(self) -> list[SessionState]:
        return list(reversed(self._states.values()))
