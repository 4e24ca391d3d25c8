"""Loading one layer's attention from a real Qwen3 checkpoint (a Hub id or a local folder)."""

import os

import torch
from transformers import AutoConfig
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3Model

from .hf_compat import dtype_keyword


def load_layer(model: str, layer: int = 0, dtype=torch.float32) -> Qwen3Attention:
    """Layer `layer`'s Qwen3Attention from a Hub id or a local folder (safetensors only).

    Raises ValueError with one line naming the problem when the folder is missing or malformed.
    Remote code is never run: only transformers' own Qwen3 classes are used.
    """
    looks_local = os.path.exists(model) or model.startswith((".", "/", "~", os.sep))
    if looks_local:
        model = os.path.expanduser(model)
        if not os.path.isdir(model):
            raise ValueError(f"model folder not found: {model}")
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise ValueError(f"no config.json in the model folder {model}")
    try:
        config = AutoConfig.from_pretrained(model)
    except Exception as err:  # OSError, ValueError, JSON errors: all mean "not a usable config"
        raise ValueError(f"cannot read a model config from {model}: {first_line(err)}") from None
    if config.model_type != "qwen3":
        raise ValueError(f"{model} is a {config.model_type!r} model, not 'qwen3'")
    if not 0 <= layer < config.num_hidden_layers:
        raise ValueError(
            f"layer {layer} out of range: {model} has {config.num_hidden_layers} layers"
        )
    kwargs = {dtype_keyword(): dtype, "use_safetensors": True, "attn_implementation": "sdpa"}
    try:
        base = Qwen3Model.from_pretrained(model, **kwargs)
    except Exception as err:  # missing or broken safetensors, shape mismatches
        raise ValueError(f"cannot load Qwen3 weights from {model}: {first_line(err)}") from None
    return base.layers[layer].self_attn.eval()


def first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
