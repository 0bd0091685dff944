"""Load an HF model folder from disk: config.json plus every *.safetensors shard.

Local files only, never the network. Tensor names stay as HF writes them;
``LlamaForCausalLM.load_weights`` maps them onto the model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from radixserve.model.config import ModelConfig


def load_hf_folder(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(config, state dict on CPU) from a folder holding config.json and *.safetensors files."""
    folder = Path(path)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json in {folder}")
    config = ModelConfig.from_hf(json.loads(config_path.read_text()))
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    state_dict: dict[str, torch.Tensor] = {}
    for shard in shards:
        tensors = load_file(str(shard))
        repeated = state_dict.keys() & tensors.keys()
        if repeated:
            raise ValueError(f"{shard.name} repeats tensors already loaded: {sorted(repeated)[:5]}")
        state_dict.update(tensors)
    return config, state_dict
