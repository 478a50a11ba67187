"""Tree bookkeeping kernels: Triton on CUDA when available, the torch references otherwise."""
from .reference import build_tree_from_parents, compact_kv, verify_tree_greedy

__all__ = ["build_tree_from_parents", "compact_kv", "verify_tree_greedy"]
