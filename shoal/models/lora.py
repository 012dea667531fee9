"""LoRA adapters in PEFT's format: `adapter_config.json` and `adapter_model.safetensors` (or
`adapter_model.bin`) in a folder, as `peft` saves them.

An adapter adds `scaling * B @ A @ x` to some of a layer's projections: A [r, in], B [out, r],
scaling = lora_alpha / r (or / sqrt(r) with rslora). What is read here is checked against the base
model's shapes before anything is served with it, so a wrong adapter is an error at load, not
garbage at run time."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shoal.models.config import ModelConfig

# The projections an adapter may target, by PEFT's (HF's) module names.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")  # not in a mixture of experts' sparse layers
_TENSOR = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")
# Adapter features that change the arithmetic beyond B @ A: refused by name, not run wrongly.
_UNSUPPORTED = {
    "use_dora": "DoRA (use_dora)",
    "modules_to_save": "fully trained modules (modules_to_save)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "fan_in_fan_out": "fan_in_fan_out weights",
}


class AdapterError(ValueError):
    """An adapter that cannot be served with this model (the message says why)."""


@dataclass
class LoRAAdapter:
    """One adapter's weights, float32 on the CPU, by (layer, HF module name): A [r, in] and B
    already multiplied by the scaling, [out, r]."""

    name: str
    path: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each target module in the base model."""
    h, q, kv, i = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def read_config(path: Path) -> dict:
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise AdapterError(f"{path}: no adapter_config.json (a PEFT adapter folder is expected)")
    try:
        config = json.loads(config_file.read_text())
    except ValueError as exc:
        raise AdapterError(f"{config_file}: not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{config_file}: not a JSON object")
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise AdapterError(f"{path}: a {peft_type} adapter; only LoRA is served")
    for key, what in _UNSUPPORTED.items():
        if config.get(key):
            raise AdapterError(f"{path}: {what} is not supported")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{path}: adapters that train biases (bias={config['bias']!r}) are not supported")
    return config


def load_adapter(name: str, path: str | Path, cfg: ModelConfig, max_rank: int) -> LoRAAdapter:
    """Reads and checks an adapter for a base model of config `cfg`."""
    path = Path(path)
    if not path.is_dir():
        raise AdapterError(f"adapter {name!r}: {path} is not a folder")
    config = read_config(path)
    tensors = _read_tensors(path)
    shapes = module_shapes(cfg)
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _TENSOR.search(key)
        if match is None:
            raise AdapterError(f"adapter {name!r}: tensor {key!r} is not a LoRA A/B of a decoder projection")
        layer, module, which = int(match.group(1)), match.group(2), match.group(3)
        if module not in shapes:
            supported = ", ".join(TARGET_MODULES)
            raise AdapterError(f"adapter {name!r}: targets {module!r}; supported: {supported}")
        if not 0 <= layer < cfg.num_layers:
            raise AdapterError(f"adapter {name!r}: layer {layer} (the model has {cfg.num_layers})")
        if module in MLP_MODULES and cfg.is_sparse(layer):
            raise AdapterError(
                f"adapter {name!r}: targets {module} of layer {layer}, a mixture of experts; "
                "adapters on experts are not supported (attention and dense layers are)"
            )
        parts.setdefault((layer, module), {})[which] = tensor
    if not parts:
        raise AdapterError(f"adapter {name!r}: no LoRA weights in {path}")
    rank = int(config.get("r", 8))
    rank_pattern = config.get("rank_pattern") or {}
    alpha = float(config.get("lora_alpha", rank))
    weights = {}
    ranks = set()
    for (layer, module), ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"adapter {name!r}: layer {layer} {module} lacks lora_{'AB'[len(ab) % 2]}")
        a, b = ab["A"].float(), ab["B"].float()
        fan_in, fan_out = shapes[module]
        r = a.shape[0]
        if a.shape != (r, fan_in) or b.shape != (fan_out, r):
            raise AdapterError(
                f"adapter {name!r}: layer {layer} {module} has A {tuple(a.shape)}, B {tuple(b.shape)}; "
                f"this model needs A [r, {fan_in}], B [{fan_out}, r] (was it trained on another model?)"
            )
        if r > max_rank:
            raise AdapterError(f"adapter {name!r}: rank {r} is above --max-lora-rank {max_rank}")
        if r != rank and not rank_pattern:
            raise AdapterError(
                f"adapter {name!r}: layer {layer} {module} has rank {r}; its config says {rank}"
            )
        ranks.add(r)
        scale = alpha / (math.sqrt(r) if config.get("use_rslora") else r)
        weights[(layer, module)] = (a.contiguous(), (b * scale).contiguous())
    return LoRAAdapter(name, str(path), max(ranks), weights)


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    st = path / "adapter_model.safetensors"
    if st.is_file():
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(st))
        except (SafetensorError, OSError, ValueError) as exc:
            raise AdapterError(f"{st}: unreadable ({exc})") from None
    pt = path / "adapter_model.bin"
    if pt.is_file():
        try:
            return torch.load(str(pt), map_location="cpu", weights_only=True)
        except Exception as exc:  # a pickle of anything but tensors is refused by weights_only
            raise AdapterError(f"{pt}: unreadable ({exc})") from None
    raise AdapterError(f"{path}: no adapter_model.safetensors or adapter_model.bin")
