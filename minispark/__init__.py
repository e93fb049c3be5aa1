"""minispark: a small, hackable PyTorch engine for hybrid speculative decoding."""
from .engine import LLM, RequestOutput, SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
