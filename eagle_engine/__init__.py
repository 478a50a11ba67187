"""EAGLE-3 speculative decoding engine: a compact Llama-family target, EAGLE-3 heads, the
draft / verify / extend loop and the pipeline that trains heads."""
from .config import EngineConfig, SamplingParams, TreeParams
from .engine import EagleEngine

__all__ = ["EagleEngine", "EngineConfig", "SamplingParams", "TreeParams"]
