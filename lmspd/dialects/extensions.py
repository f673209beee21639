"""``extensions`` (LMSP §9.1): namespaced keys; unknown namespaces are
ignored, lmspd's own are validated."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import Field, ValidationError

from lmspd.core.conversation import Sampling
from lmspd.core.errors import invalid
from lmspd.streaming.session import ResponseState

from .responses_items import Strict, validation_error


class SamplingExtension(Strict):
    seed: int | None = Field(default=None, ge=0, le=2**32 - 1)
    # Over the model's own settings (its GGUF's); 0 turns each off.
    top_k: int | None = Field(default=None, ge=0, le=1_000_000)
    min_p: float | None = Field(default=None, ge=0, le=1)


class CacheExtension(Strict):
    # Opt out of prefix reuse for this request (e.g. to measure a cold run).
    reuse: bool = True


@dataclass
class Extensions:
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    cache_reuse: bool = True
    # False: no speculative decoding for this request.
    speculative: bool = True

    def sampling(self, *, temperature: float | None, top_p: float | None, seed: int | None = None,
                 top_k: int | None = None, stop: list[str] | None = None) -> Sampling:
        """A request's sampling: its dialect's own fields (a ``seed`` or
        ``top_k`` of its own over the extension's), with the extension's
        top-k and min-p."""
        return Sampling(temperature=temperature, top_p=top_p, seed=self.seed if seed is None else seed,
                        stop=stop or [], top_k=self.top_k if top_k is None else top_k, min_p=self.min_p)


_KNOWN: dict[str, type[Strict]] = {"lmspd.sampling": SamplingExtension, "lmspd.cache": CacheExtension}
# A bare flag: ``{"lmspd.speculative": false}``.
SPECULATIVE = "lmspd.speculative"


def decode_extensions(raw: dict[str, Any] | None) -> Extensions:
    out = Extensions()
    if not raw:
        return out
    if not isinstance(raw, dict):
        raise invalid("'extensions' must be an object.", "extensions")
    for key, value in raw.items():
        if key == SPECULATIVE:
            if not isinstance(value, bool):
                raise invalid(f"'extensions.{SPECULATIVE}' must be true or false.", f"extensions.{key}")
            out.speculative = value
            continue
        if key.startswith("lmspd.") and key not in _KNOWN:
            known = ", ".join(sorted([*_KNOWN, SPECULATIVE]))
            raise invalid(f"Unknown lmspd extension {key!r}; known: {known}.", f"extensions.{key}")
        model = _KNOWN.get(key)
        if model is None:
            continue  # another vendor's namespace: not ours to judge
        try:
            parsed = model.model_validate(value)
        except ValidationError as exc:
            raise validation_error(exc, f"extensions.{key}") from None
        if isinstance(parsed, SamplingExtension):
            out.seed, out.top_k, out.min_p = parsed.seed, parsed.top_k, parsed.min_p
        elif isinstance(parsed, CacheExtension):
            out.cache_reuse = parsed.reuse
    return out


def response_extensions(state: ResponseState) -> dict[str, Any] | None:
    """The ``extensions`` a finished response carries, in both Responses
    dialects (an OpenAI SDK keeps unknown fields): ``lmspd.cache``, what the
    prompt reused and, when it reused less than the cache remembers, why
    (lmspd.cache.diagnostics); ``lmspd.decode``, speculative decoding's
    drafted and accepted tokens by source."""
    out: dict[str, Any] = dict(state.recorded_extensions or {})
    usage = state.usage
    if usage is None:
        return out or None
    if usage.cache_report is not None:
        out["lmspd.cache"] = usage.cache_report.as_json()
    if usage.decode_report is not None:
        out["lmspd.decode"] = usage.decode_report.as_json()
    return out or None
