"""Hugging Face export and import for Llama-family Megatron checkpoints (``megashard convert --to hf``).

:mod:`.mapping` (names, transforms, config), :mod:`.safetensors` (validated reader,
streamed writer), :mod:`.export` (megashard -> HF directory), :mod:`.importer`
(HF directory -> megashard checkpoint of global tensors). Below :mod:`megashard.convert`,
above the readers: tensors move through the slice planner one layer at a time.
"""
from __future__ import annotations

from .mapping import HFMappingError, LlamaSpec

__all__ = ["HFMappingError", "LlamaSpec"]
