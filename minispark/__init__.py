"""minispark: a small, hackable PyTorch engine for hybrid speculative decoding."""
from .api import LLM, SPEC_MODES, RequestOutput, SamplingParams
from .drafters import Chain, Drafter, NgramDrafter, SparkDrafter

__all__ = ["LLM", "SPEC_MODES", "RequestOutput", "SamplingParams", "Drafter", "Chain", "NgramDrafter", "SparkDrafter"]
__version__ = "0.1.0"
