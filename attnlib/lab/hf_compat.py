"""transformers-version shims: the few places where transformers 4.51+ and 5.x differ.

Each is picked by inspecting a signature, never by parsing a version string.
"""

import inspect

from transformers import PretrainedConfig, Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention


def _parameters(function) -> set:
    return set(inspect.signature(function).parameters)


def dtype_keyword() -> str:
    """from_pretrained's dtype keyword: `dtype` (transformers 5 and 4.56+), else `torch_dtype`."""
    return "dtype" if "dtype" in _parameters(PretrainedConfig.__init__) else "torch_dtype"


def cache_keyword() -> str:
    """Qwen3Attention.forward's cache keyword: `cache` in transformers 5,
    `past_key_values` or `past_key_value` before."""
    params = _parameters(Qwen3Attention.forward)
    names = ("cache", "past_key_values", "past_key_value")
    return next(name for name in names if name in params)


def rope_keywords(theta: float) -> dict:
    """Qwen3Config's RoPE keywords: v5 `rope_parameters`, v4 `rope_theta`."""
    if "rope_parameters" in _parameters(Qwen3Config.__init__):  # transformers 5
        return {"rope_parameters": {"rope_type": "default", "rope_theta": theta}}
    return {"rope_theta": theta}  # transformers 4.x


def rope_theta(config) -> float:
    """The RoPE base of a Qwen3 config (v5 `rope_parameters`, v4 `rope_theta`); plain RoPE only."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise ValueError(f"the manual pass implements plain RoPE only, this model uses {kind!r}")
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def rope_fields(rule: str, theta: float, params: dict) -> dict:
    """Config keywords for a RoPE rule with Hugging Face's parameter names (`factor`, ...):
    v5 one dict `rope_parameters`, v4 `rope_theta` and a `rope_scaling` dict (None for plain)."""
    if "rope_parameters" in _parameters(Qwen3Config.__init__):  # transformers 5
        return {"rope_parameters": {"rope_type": rule, "rope_theta": theta, **params}}
    scaling = None if rule == "default" else {"rope_type": rule, **params}
    return {"rope_theta": theta, "rope_scaling": scaling}  # transformers 4.x
