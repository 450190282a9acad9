"""Per-generated-token attribution of text: one teacher-forced forward, ``target_batch`` targets per backward pass."""

from .attribute import attribute_generation
from .result import GenerationAttribution

__all__ = ["GenerationAttribution", "attribute_generation"]
