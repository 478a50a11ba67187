"""One request's state: `Run` holds a request's caches, stats, detokenizer, generator and every
token it produced, and the bookkeeping of what the step's one host read brought it: stop rules
(`after_prefill`, `after_readback`, `after_decode`), its events, and whether its next step
would pass the context window. It reads no model and no engine.
Not here: the phases (draft/tree/verify/accept modules), the per-request work the loop does
with the models (prefill, the prompt's extend, acceptance, the prefix cache: `scheduler.py`),
or the UI.
"""
from __future__ import annotations

import time

import torch

from .accept import extend_input
from .chat import IncrementalDetokenizer
from .config import SamplingParams, TreeParams
from .context_draft import ContextIndex
from .events import RunStats, StepEvent, TokenSpan, TreeNode
from .io_struct import (EagleDraftExtendInput, EagleVerifyInput, EagleVerifyOutput, NodeSource,
                        VerifyReadback)
from .kv_cache import KVCache
from .parts import EngineParts
from .verify import TreeLogits


class Run:
    """State of one request. `cache` and `draft_cache` (None for plain decoding) are the caches
    it writes, leased by the scheduler's phase backend (`EagerPhases.lease`): sized to the
    request, or under CUDA graphs the pool rows of `slot`. `parts` is read here, not kept: its
    head (`draft_model`) and the layers that head reads (`aux_ids`), the tokenizer (in the
    detokenizer), the stop ids and the context window."""

    def __init__(self, parts: EngineParts, prompt_ids: list[int], params: SamplingParams,
                 tree: TreeParams, head: str | None, trace: bool, cache: KVCache,
                 draft_cache: KVCache | None, slot: int | None = None) -> None:
        self.prompt, self.params, self.tree = prompt_ids, params, tree
        self.trace, self.head, self.cache = trace, head, cache
        self.draft_cache, self.slot = draft_cache, slot
        self.draft_model = parts.heads[head] if head else None
        self.aux_ids = parts.aux_ids(head)
        self.eos_ids, self.max_len = parts.eos_ids, parts.max_len
        self.generator = None
        if params.seed is not None:
            device = parts.target.device
            self.generator = torch.Generator(device=device).manual_seed(params.seed)
        self.detok = IncrementalDetokenizer(parts.tokenizer, params.stop)
        # per depth up to num_steps, grown when a chain from the context is accepted deeper
        self.stats = RunStats(accepted_per_depth=[0] * tree.num_steps)
        self.context: ContextIndex | None = None  # the suffix index, with context drafts
        self.tokens = list(prompt_ids)  # the prompt and every token generated (past a stop too)
        self.draft_rows = 0  # draft cache rows holding committed tokens
        self.t_start = time.perf_counter()
        self.cpu_start, self.t_last = time.process_time(), self.t_start
        self.step = 0

    def _emit(self, tokens: list[int], kinds: list[str], depths: list[int],
              sources: list[str] | None = None) -> tuple[list[TokenSpan], str | None]:
        """Apply stop rules to emitted tokens; returns kept spans and a finish reason."""
        self.tokens += tokens
        spans, finished = [], None
        for tok, kind, depth, source in zip(tokens, kinds, depths, sources or [""] * len(tokens)):
            if tok in self.eos_ids and not self.params.ignore_eos:
                finished = "eos"
                break
            spans.append(TokenSpan(tok, self.detok.add([tok]), kind, depth, source))
            self.stats.num_tokens += 1
            if self.detok.stopped:
                finished = "stop"
                break
            if self.stats.num_tokens >= self.params.max_new_tokens:
                finished = "length"
                break
        if finished and spans:
            spans[-1].text += self.detok.flush()
        return spans, finished

    def event(self, spans: list[TokenSpan], finished: str | None, timings: dict[str, float],
              **extra) -> StepEvent:
        now = time.perf_counter()
        self.stats.elapsed_s = now - self.t_start
        self.stats.cpu_s = time.process_time() - self.cpu_start
        self.stats.core_s += (now - self.t_last) * torch.get_num_threads()
        self.t_last = now
        for k, v in timings.items():
            self.stats.phase_s[k] = self.stats.phase_s.get(k, 0.0) + v / 1000
        # text held back for a possible stop string belongs to earlier spans; release it when the
        # run ends (EOS or the context limit can end it with no span this step to carry it)
        tail = self.detok.flush() if finished else ""
        ev = StepEvent(step=self.step, mode="eagle" if self.draft_model else "ar", tokens=spans,
                       text="".join(s.text for s in spans) + tail, timings_ms=timings,
                       stats=self.stats.to_dict(), finished=finished, **extra)
        self.step += 1
        return ev

    def after_prefill(self, root: int) -> tuple[list[TokenSpan], str | None]:
        spans, finished = self._emit([root], ["target"], [0])
        self.stats.prefill_s = time.perf_counter() - self.t_start
        return spans, finished

    def context_full(self, seq_len: int) -> bool:
        """Whether the next step would write past the context window."""
        width = self.tree.max_rows if self.draft_model else 1
        return seq_len + width + (1 if self.draft_model else 0) > self.max_len

    def after_readback(self, got: VerifyReadback, vin: EagleVerifyInput,
                       vout: EagleVerifyOutput, tl: TreeLogits
                       ) -> tuple[list[TokenSpan], str | None, EagleDraftExtendInput | None]:
        """Stats and stop rules for an iteration's read-back -> (spans, finish reason, the draft
        extend's input, None when finished)."""
        n_acc = got.num_accepted
        if self.context is not None:
            self.context.extend(got.emitted)
        self.stats.num_steps += 1
        self.stats.step_tokens += n_acc + 1
        depths = self.stats.accepted_per_depth
        depths += [0] * (n_acc - len(depths))
        for d in range(n_acc):
            depths[d] += 1
        sources = [NodeSource(s) for s in got.accepted_sources[1:]]
        kinds = ["context" if s is NodeSource.CONTEXT else "accepted" for s in sources]
        self.stats.context_tokens += kinds.count("context")
        spans, finished = self._emit(got.emitted, kinds + ["bonus"],
                                     list(range(1, n_acc + 1)) + [0],
                                     [s.label for s in sources] + [""])
        ext = None if finished else extend_input(vin, vout, n_acc, tl.features)
        return spans, finished, ext

    def after_decode(self, token: int) -> tuple[list[TokenSpan], str | None]:
        """Stats and stop rules for a plain decode step's token."""
        self.stats.num_steps += 1
        self.stats.step_tokens += 1
        return self._emit([token], ["target"], [0])

    def iteration_event(self, got: VerifyReadback, spans: list[TokenSpan],
                        finished: str | None, timings: dict[str, float],
                        **extra) -> StepEvent:
        detail = {"rejected": self._rejected(got), "tree": self._tree_nodes(got)
                  } if self.trace else {}
        return self.event(spans, finished, timings, **detail, **extra)

    def _token_text(self, tok: int) -> str:
        return self.detok.tokenizer.decode([tok])

    def _rejected(self, got: VerifyReadback) -> list[TokenSpan]:
        """The draft's own best continuation below the last accepted node (first children)."""
        parents, tokens = got.tree_parents, got.tree_tokens
        node, out = got.accepted_nodes[-1], []
        while True:
            children = [c for c in range(len(parents)) if parents[c] == node]
            if not children:
                return out
            node = children[0]
            out.append(TokenSpan(tokens[node], self._token_text(tokens[node]), "rejected",
                                 got.tree_depth[node], NodeSource(got.tree_sources[node]).label))

    def _tree_nodes(self, got: VerifyReadback) -> list[TreeNode]:
        on_path = set(got.accepted_nodes)
        return [TreeNode(t, self._token_text(t), p, d, i in on_path, s, NodeSource(src).label)
                for i, (t, p, d, s, src) in enumerate(zip(
                    got.tree_tokens, got.tree_parents, got.tree_depth, got.tree_scores,
                    got.tree_sources))]
