"""Text side of the engine: chat prompts, prompt files and an incremental detokenizer.

`encode_chat` applies the tokenizer's own chat template; `load_rows` reads a prompt file (JSONL
rows with `turns`, as MT-bench's); `IncrementalDetokenizer` turns a growing list of token ids
into text deltas that never split a UTF-8 character or drop the spaces that SentencePiece/BPE
encode inside tokens, and finds stop strings. Not here: token generation.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .config import ConfigError


def load_rows(path: Path, limit: int | None) -> list[dict]:
    """The first `limit` rows (all with None or 0) of the JSONL file `path`."""
    if not path.is_file():
        raise ConfigError(f"prompt file {path} does not exist")
    rows = [json.loads(line) for line in path.read_text().split("\n") if line.strip()]
    return rows[:limit] if limit else rows


def stop_token_ids(config_eos: tuple[int, ...], tokenizer: Any) -> tuple[int, ...]:
    """End-of-sequence ids: the model config's plus the tokenizer's own (sorted, unique)."""
    eos = set(config_eos)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        eos.add(int(tokenizer.eos_token_id))
    return tuple(sorted(eos))


def encode_chat(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool = True
                ) -> list[int]:
    """Messages [{'role', 'content'}] -> prompt ids ending with the assistant header (without it:
    a whole conversation as the template writes it)."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                        tokenize=True)
    if hasattr(out, "keys"):
        out = out["input_ids"]
    return [int(t) for t in out]


class IncrementalDetokenizer:
    """Feed token ids, get only the new text. Decodes a short window of recent tokens so the
    cost per step stays constant and tokenizer-level space handling stays correct."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the decode window
        self.read_offset = 0  # tokens before this are already emitted
        self.text = ""  # all decoded text (stop strings removed)
        self.emitted = 0  # characters of `text` already returned
        self.stop = stop
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, new_ids: list[int]) -> str:
        """Append ids; return the new text (possibly empty). Stops at the first stop string."""
        if self.stopped:
            return ""
        self.ids.extend(new_ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._emit(delta)

    def _emit(self, delta: str) -> str:
        """Append decoded text; hold back a tail that could still become a stop string."""
        self.text += delta
        for s in self.stop:
            pos = self.text.find(s, max(0, self.emitted - len(s)))
            if pos >= 0:
                self.text, self.stopped = self.text[:pos], True
        hold = 0
        if not self.stopped:
            for s in self.stop:
                for k in range(min(len(s) - 1, len(self.text)), 0, -1):
                    if self.text.endswith(s[:k]):
                        hold = max(hold, k)
                        break
        out = self.text[self.emitted:len(self.text) - hold]
        self.emitted += len(out)
        return out

    def flush(self) -> str:
        """Text held back for a possible stop string, once generation has ended."""
        out = self.text[self.emitted:]
        self.emitted = len(self.text)
        return out
