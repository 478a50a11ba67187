"""One request's state and the per-request halves of each phase of the engine's one loop.

`Run` holds a request's caches, stats, detokenizer, generator and every token it produced, and
the parts of each phase that belong to one request: `prefill` (after restoring the rows its
prompt shares with an earlier request from the prefix cache), `read_prompt` (the context's
suffix index and the head's draft extend over the prompt), `tree_input` (the drafted candidates,
with the context's chain, as the tree to verify), `accept` (acceptance and the KV commit, on the
device), `after_readback` / `after_decode` (stats and stop rules on what the step's one host read
brought), the events, and `keep_prefix` (a clean end leaves its rows in the prefix cache).
Not here: the order of the phases and which requests share a forward (`scheduler.py`, the only
loop), the phases' tensor math (draft/tree/verify/accept modules) or the UI.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from .accept import commit, extend, extend_input
from .chat import IncrementalDetokenizer
from .config import SamplingParams, TreeParams
from .context_draft import ContextIndex
from .events import RunStats, StepEvent, TokenSpan, TreeNode
from .io_struct import (DraftTree, EagleDraftExtendInput, EagleDraftInput, EagleVerifyInput,
                        EagleVerifyOutput, NodeSource, VerifyReadback)
from .kv_cache import KVCache, causal_mask
from .sampling import next_token
from .tree import tree_input
from .verify import TreeLogits, greedy_acceptance, sampled_acceptance

if TYPE_CHECKING:
    from .engine import EagleEngine


class Run:
    """State of one request. `cache` and `draft_cache` (None for plain decoding) are the caches
    it writes, leased by the scheduler's phase backend (`EagerPhases.lease`): sized to the
    request, or under CUDA graphs the pool rows of `slot`."""

    def __init__(self, engine: EagleEngine, prompt_ids: list[int], params: SamplingParams,
                 tree: TreeParams, head: str | None, trace: bool, cache: KVCache,
                 draft_cache: KVCache | None, slot: int | None = None) -> None:
        self.e, self.prompt, self.params, self.tree = engine, prompt_ids, params, tree
        self.trace, self.head, self.cache = trace, head, cache
        self.draft_cache, self.slot = draft_cache, slot
        self.draft_model = engine.heads[head] if head else None
        self.aux_ids: tuple[int, ...] = ()
        if self.draft_model is not None and self.draft_model.cfg.use_aux_hidden_state:
            self.aux_ids = self.draft_model.cfg.resolve_aux_layer_ids(engine.target.cfg)
        dev = engine.target.device
        self.generator = None
        if params.seed is not None:
            self.generator = torch.Generator(device=dev).manual_seed(params.seed)
        self.detok = IncrementalDetokenizer(engine.tokenizer, params.stop)
        # per depth up to num_steps, grown when a chain from the context is accepted deeper
        self.stats = RunStats(accepted_per_depth=[0] * tree.num_steps)
        self.context: ContextIndex | None = None  # the suffix index, with context drafts
        self.tokens = list(prompt_ids)  # the prompt and every token generated (past a stop too)
        self.draft_rows = 0  # draft cache rows holding committed tokens
        self.t_start = time.perf_counter()
        self.step = 0

    def _features(self, out) -> torch.Tensor:
        return out.aux_hidden if self.aux_ids else out.final_hidden

    def _emit(self, tokens: list[int], kinds: list[str], depths: list[int],
              sources: list[str] | None = None) -> tuple[list[TokenSpan], str | None]:
        """Apply stop rules to emitted tokens; returns kept spans and a finish reason."""
        self.tokens += tokens
        spans, finished = [], None
        for tok, kind, depth, source in zip(tokens, kinds, depths, sources or [""] * len(tokens)):
            if tok in self.e.eos_ids and not self.params.ignore_eos:
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
        self.stats.elapsed_s = time.perf_counter() - self.t_start
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

    def prefill(self) -> tuple[torch.Tensor, EagleDraftExtendInput]:
        """-> (the first generated token [1], on the device; the draft extend's input after the
        prompt: its tokens shifted by one, that token last, with the prompt's features).
        Rows the prompt shares with an earlier request come from the prefix cache; the target
        runs from the first row not restored."""
        target, dev = self.e.target, self.e.target.device
        n = len(self.prompt)
        hit = self.e.prefix_cache.lookup(self.prompt, self.head)
        r = hit.rows if hit else 0
        if hit:
            self.e.prefix_cache.restore(hit, self.cache, self.draft_cache)
        self.stats.reused_tokens = r
        ids = torch.tensor(self.prompt[r:], device=dev)  # [n - r]
        out = target(ids[None], torch.arange(r, n, device=dev)[None], self.cache, r,
                     causal_mask(n - r, r, dev), self.aux_ids, last_only=True)
        root = next_token(out.logits[0, -1:], self.params, self.generator, self.e.ops)  # [1]
        return root, EagleDraftExtendInput(torch.cat([ids[1:], root]), self._features(out)[0], r)

    def after_prefill(self, root: int) -> tuple[list[TokenSpan], str | None]:
        spans, finished = self._emit([root], ["target"], [0])
        self.stats.prefill_s = time.perf_counter() - self.t_start
        return spans, finished

    def read_prompt(self, ext: EagleDraftExtendInput) -> EagleDraftInput:
        """Once the first token is out: the context's suffix index over the prompt and that
        token (with context drafts), and the head's draft extend over the prompt -> the first
        draft's input. Also after a one-token answer, so that the prefix cache keeps the
        head's rows for the next turn. The extend runs eagerly: a prompt is wider than the
        extend's CUDA graph."""
        if self.tree.context_drafts:
            self.context = ContextIndex(self.tokens)
        state = extend(self.draft_model, ext, self.draft_cache, self.tree.topk)
        self.draft_rows = state.seq_len
        return state

    def context_full(self, seq_len: int) -> bool:
        """Whether the next step would write past the context window."""
        width = self.tree.max_rows if self.draft_model else 1
        return seq_len + width + (1 if self.draft_model else 0) > self.e.config.max_len

    def keep_prefix(self) -> None:
        """Leave this request's committed rows in the prefix cache (after a clean end)."""
        rows = len(self.tokens) - 1  # the last token produced is in no cache yet
        self.e.prefix_cache.store(self.tokens[:rows], self.cache, self.head, self.draft_cache,
                                  self.draft_rows)

    def accept(self, vin: EagleVerifyInput, tl: TreeLogits) -> EagleVerifyOutput:
        """Acceptance on the device and the KV commit of the accepted path."""
        if self.params.greedy:
            vout = greedy_acceptance(vin, tl.logits, self.e.ops)
        else:
            vout = sampled_acceptance(vin, tl.logits, self.params, self.generator, self.e.ops)
        commit(vin, vout, self.cache, self.e.ops)
        return vout

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

    def tree_input(self, drafted: DraftTree, state: EagleDraftInput) -> EagleVerifyInput:
        """The head's candidates, with the context's chain merged in when there is one, as the
        tree to verify."""
        ctx = self.context.propose(self.tree.chain_len) if self.context else None
        return tree_input(drafted, ctx, state.root, state.seq_len, self.tree, self.e.ops)

    def _token_text(self, tok: int) -> str:
        return self.e.tokenizer.decode([tok])

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
