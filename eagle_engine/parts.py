"""`EngineParts`: what the scheduler and its requests use of a loaded engine, handed down to
them so that neither reaches back up into the engine.

It holds the target and heads, the tokenizer and the stop ids, the step ops, the prefix cache,
the context window and the default tree (which `autotune` may replace), and checks a request
against them (`check_request`). Not here: loading (`engine.py`), the loop (`scheduler.py`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .config import ConfigError, TreeParams
from .kernels import StepOps
from .models.draft_model import Eagle3Draft
from .models.target import TargetModel
from .prefix_cache import PrefixCache


@dataclass
class EngineParts:
    target: TargetModel
    heads: dict[str, Eagle3Draft]
    tokenizer: Any
    eos_ids: tuple[int, ...]  # tokens that end an answer
    ops: StepOps  # the step backend (`kernels.step_ops`)
    prefix_cache: PrefixCache
    max_len: int  # the context window
    default_tree: TreeParams  # a request's tree when it names none

    def aux_ids(self, head: str | None) -> tuple[int, ...]:
        """The target layers whose inputs `head` reads (ascending), () without aux states."""
        model = self.heads[head] if head else None
        if model is None or not model.cfg.use_aux_hidden_state:
            return ()
        return model.cfg.resolve_aux_layer_ids(self.target.cfg)

    def check_request(self, prompt_ids: list[int], tree: TreeParams | None,
                      head: str | None) -> None:
        """Raises `ConfigError` naming what a request gets wrong, and its values."""
        if not prompt_ids:
            raise ConfigError("the prompt is empty")
        if head is not None and head not in self.heads:
            raise ConfigError(f"unknown draft head {head!r}; loaded: {sorted(self.heads)}")
        room = self.max_len - (tree.max_rows if tree and head else 1)
        if len(prompt_ids) >= room:
            raise ConfigError(f"prompt has {len(prompt_ids)} tokens but the context window is "
                              f"{self.max_len} (room for at most {room - 1} prompt tokens)")
        bad = [t for t in prompt_ids if not 0 <= t < self.target.cfg.vocab_size]
        if bad:
            raise ConfigError(f"token ids {bad[:5]} are outside the vocabulary "
                              f"(size {self.target.cfg.vocab_size})")
