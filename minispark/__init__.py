"""minispark: a small, hackable PyTorch engine for hybrid speculative decoding."""
from .api import LLM, SPEC_MODES
from .drafters import Chain, Drafter, NgramDrafter, SparkDrafter
from .requests import RequestOutput, SamplingParams

__all__ = ["LLM", "SPEC_MODES", "RequestOutput", "SamplingParams", "Drafter", "Chain", "NgramDrafter", "SparkDrafter"]
__version__ = "0.1.0"
