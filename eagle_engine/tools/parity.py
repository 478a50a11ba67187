"""The parity harness the GPU-path checks and the tests share: tiny random models, the graphed
phases against the eager phases request by request (`phase_parity`), and engines with and
without graphs answering alike (`engine_parity`, `batch_parity`). `selfcheck` runs it on a GPU
with captured graphs; tests/test_cuda_graph.py runs it on a CPU in GraphMode.STATIC.
Not here: the runners (`cuda_graph.py`) or the report (`selfcheck.py`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..accept import commit, extend, extend_input
from ..config import (
    DraftConfig,
    EngineConfig,
    SamplingParams,
    TargetConfig,
    TreeParams,
)
from ..cuda_graph import GraphMode, GraphPhases
from ..draft import draft
from ..engine import EagleEngine
from ..io_struct import EagleDraftExtendInput, EagleDraftInput
from ..kv_cache import KVCache, causal_mask
from ..models.draft_model import Eagle3Draft
from ..models.layers import Rope
from ..models.target import TargetModel
from ..tree import build_tree
from ..verify import accepted_path, decode, run_target

TINY_TARGET = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
               "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
               "eos_token_id": 2}
TINY_DRAFT = {"hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 96, "draft_vocab_size": 64}
TINY_TREE = TreeParams(topk=4, num_steps=4, num_draft_tokens=12)
EAGLE31 = {"fc_norm": True, "norm_output": True}  # the default head's recipe (EAGLE-3.1)


@dataclass(slots=True)
class Row:
    check: str
    result: str  # PASS / FAIL, a measurement, or "skipped"
    detail: str = ""
    ok: bool | None = None  # None for measurements and skips


def verdict(check: str, failures: list[str], detail: str) -> Row:
    if failures:
        return Row(check, "FAIL", "; ".join(failures[:3]), False)
    return Row(check, "PASS", detail, True)


# ---------------------------------------------------------------- phases: runners vs eager

def tiny_models(device: torch.device | str, dtype: torch.dtype = torch.float32, seed: int = 0,
                max_len: int = 256, recipe: dict[str, bool] | None = None
                ) -> tuple[TargetModel, Eagle3Draft]:
    """A random 8-layer target and a random EAGLE-3 head with a reduced vocabulary (`recipe`:
    head config keys on top, e.g. `EAGLE31`). Weights are scaled up so that greedy choices have
    clear margins over rounding noise."""
    g = torch.Generator().manual_seed(seed)
    target = TargetModel(TargetConfig.from_dict(TINY_TARGET), max_len)
    head = Eagle3Draft(DraftConfig.from_dict({**TINY_DRAFT, **(recipe or {})}), max_len + 512)
    with torch.no_grad():
        for model in (target, head):
            for name, p in model.named_parameters():
                noise = torch.randn(p.shape, generator=g)
                p.copy_(1 + 0.1 * noise if "norm" in name else noise * 3 / p.shape[-1] ** 0.5)
        vocab, draft_vocab = TINY_DRAFT["vocab_size"], TINY_DRAFT["draft_vocab_size"]
        hot = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
        head.d2t.copy_(hot - torch.arange(draft_vocab))
    for model in (target, head):
        model.to(device=device, dtype=dtype)
        c = model.cfg
        model.rope = Rope(c.head_dim, model.max_len, c.rope_theta, c.rope_scaling).to(device)
    return target.eval(), head.eval()


@dataclass(slots=True)
class Diff:
    """Discrete mismatches and the worst float difference of one phase over a run. Floats are
    compared relative to the tensor's largest magnitude: the residual stream reaches hundreds,
    and attending over more (masked) keys reorders fp32 sums at the 1e-7 level."""

    check: str
    tolerance: float
    max_rel: float = 0.0
    failures: list[str] = dataclasses.field(default_factory=list)

    def exact(self, what: str, a: torch.Tensor | int, b: torch.Tensor | int) -> None:
        same = torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
        if not same:
            self.failures.append(f"{what} differs")

    def close(self, what: str, a: torch.Tensor, b: torch.Tensor) -> None:
        if a.shape != b.shape:
            self.failures.append(f"{what} shape {tuple(a.shape)} != {tuple(b.shape)}")
            return
        a, b = a.float(), b.float()
        scale = max(1.0, b.abs().max().item()) if b.numel() else 1.0
        rel = (a - b).abs().max().item() / scale if b.numel() else 0.0
        self.max_rel = max(self.max_rel, rel)
        if not rel <= self.tolerance:  # also catches NaN
            self.failures.append(f"{what} differs by {rel:.1e} (relative to max)")

    def caches(self, what: str, a: KVCache, b: KVCache, rows: int) -> None:
        for (ka, va), (kb, vb) in zip(a.layers, b.layers):
            self.close(f"{what} keys", ka[:, :, :rows], kb[:, :, :rows])
            self.close(f"{what} values", va[:, :, :rows], vb[:, :, :rows])

    def row(self, detail: str) -> Row:
        return verdict(self.check, self.failures, f"{detail}; max rel. diff {self.max_rel:.0e}")


def prefill_both(target: TargetModel, head: Eagle3Draft, target_caches: tuple[KVCache, ...],
                 draft_caches: tuple[KVCache, ...], topk: int, seed: int) -> EagleDraftInput:
    """Prefill a random prompt into every cache with the eager path; -> the first draft input."""
    g = torch.Generator().manual_seed(seed)
    dev, n = target.device, 24
    prompt = torch.randint(3, target.cfg.vocab_size, (n,), generator=g).to(dev)
    aux = head.cfg.resolve_aux_layer_ids(target.cfg)
    for cache in target_caches:
        out = target(prompt[None], torch.arange(n, device=dev)[None], cache, 0,
                     causal_mask(n, 0, dev), aux, last_only=True)
    root = out.logits[0, -1].argmax()[None]
    ext = EagleDraftExtendInput(torch.cat([prompt[1:], root]), out.aux_hidden[0], 0)
    states = [extend(head, ext, cache, topk) for cache in draft_caches]
    return states[0]


@dataclass(slots=True)
class Seat:
    """What the phase backends read of a request (`run.Run`'s fields of the same names)."""

    head: str
    tree: TreeParams
    aux_ids: tuple[int, ...]
    cache: KVCache
    draft_cache: KVCache
    slot: int | None = None


@dataclass(slots=True)
class ParityPair:
    """One request on both paths: its own eager caches, and a slot of the graph backend's."""

    eager: Seat
    graph: Seat
    state: EagleDraftInput  # the next draft's input (the eager path's)


def graph_backend(target: TargetModel, head: Eagle3Draft, tree: TreeParams, mode: GraphMode,
                  batch: int, seed: int, max_batch: int | None = None
                  ) -> tuple[GraphPhases, list[ParityPair]]:
    """A `GraphPhases` for `max_batch` (default `batch`) requests of `head`, and `batch` random
    prompts prefilled into both paths' caches."""
    K, S, L = tree.topk, tree.num_steps, target.max_len - 32
    aux = head.cfg.resolve_aux_layer_ids(target.cfg)
    backend = GraphPhases(target, {"head": head}, L, max_batch or batch, mode)
    pairs = []
    for b in range(batch):
        slot, t_cache, d_cache = backend.lease(24, SamplingParams(), tree, "head")
        eager = Seat("head", tree, aux, target.new_cache(max_len=L), head.new_cache(L + K * S))
        graph = Seat("head", tree, aux, t_cache, d_cache, slot)
        state = prefill_both(target, head, (eager.cache, t_cache), (eager.draft_cache, d_cache),
                             K, seed + b)
        pairs.append(ParityPair(eager, graph, state))
    return backend, pairs


def extend_every_padding(head: Eagle3Draft, backend: GraphPhases, pairs: list[ParityPair],
                         features: list[torch.Tensor], diff: Diff) -> None:
    """Extend every request with 1..max_depth+1 tokens (and back to 1) on both paths, each
    request its own length; caches restored after."""
    caches = [c for p in pairs for c in (p.eager.draft_cache, p.graph.draft_cache)]
    saved = [t.clone() for c in caches for layer in c.layers for t in layer]
    tree = pairs[0].eager.tree
    T_max = tree.max_depth + 1
    for T in [*range(1, T_max + 1), 1]:
        exts = []
        for b, (p, f) in enumerate(zip(pairs, features)):
            n = (T + b - 1) % T_max + 1  # the requests at different paddings
            rows = torch.arange(n, device=f.device) % f.shape[0]
            exts.append(EagleDraftExtendInput((rows * 7 + 5 + b) % head.cfg.vocab_size, f[rows],
                                              p.state.seq_len))
        got = backend.extend(head, [p.graph for p in pairs], exts)
        for p, ext, g in zip(pairs, exts, got):
            want = extend(head, ext, p.eager.draft_cache, tree.topk)
            n = ext.tokens.numel()
            diff.exact(f"T={n} top-k ids", want.topk_ids, g.topk_ids)
            diff.exact(f"T={n} root", want.root, g.root)
            diff.exact(f"T={n} seq_len", want.seq_len, g.seq_len)
            diff.close(f"T={n} top-k probs", want.topk_p, g.topk_p)
            diff.close(f"T={n} hidden", want.hidden, g.hidden)
            diff.caches(f"T={n} draft cache", p.eager.draft_cache, p.graph.draft_cache,
                        ext.seq_len + n)
        for t, copy in zip((t for c in caches for layer in c.layers for t in layer), saved):
            t.copy_(copy)


def phase_parity(target: TargetModel, head: Eagle3Draft, tree: TreeParams, mode: GraphMode,
                 iterations: int = 6, seed: int = 0, batch: int = 1,
                 max_batch: int | None = None) -> list[Row]:
    """Each phase for `batch` requests at once through `GraphPhases` (STATIC: the static
    functions run eagerly; GRAPHS: captured CUDA graphs, padded to the batch's bucket) against
    each request's eager phase function alone on the same inputs, iteration after iteration,
    accepting 0..num_steps drafts in turn; the extend is also checked at every padding, and
    plain decoding's step after the iterations. Tokens, trees and top-k ids must match exactly,
    floats to a dtype tolerance. A phase that no graph served fails its row."""
    # bf16: attention over the whole cache (static) and over the live rows (eager) rounds
    # probabilities in different blocks, and random models amplify rounding (the tiny test
    # models' bf16 logits differ from their fp32 logits by ~0.5 of the max); a wrong cache row
    # or mask differs at that order, not at 1e-1
    tolerance = 5e-5 if target.dtype == torch.float32 else 1e-1
    backend, pairs = graph_backend(target, head, tree, mode, batch, seed, max_batch)
    diffs = {name: Diff(f"{name}: {mode.value} == eager", tolerance) for name in
             ("draft decode", "verify", "commit", "draft extend", "extend paddings", "decode")}
    for it in range(iterations):
        parity_step(target, head, backend, pairs, it, diffs)
    decode_parity(target, backend, pairs, diffs["decode"])
    served = {key[0] for key, runner in backend.runners.items() if runner is not None}
    wanted = {"verify", "extend", "decode"} | ({"draft"} if tree.num_steps > 1 else set())
    if served != wanted:
        diffs["verify"].failures.append(f"graphs served {sorted(served)}, not {sorted(wanted)}")
    shape = (f"K={tree.topk}, steps={tree.num_steps}, N={tree.num_draft_tokens}, {batch} of "
             f"{backend.max_batch} slots, {iterations} iterations")
    return [d.row(shape) for d in diffs.values()]


def parity_step(target: TargetModel, head: Eagle3Draft, backend: GraphPhases,
                pairs: list[ParityPair], it: int, diffs: dict[str, Diff]) -> None:
    """One iteration of every request on both paths from the same draft input; each pair's
    state moves to the eager path's next input. Request b's accepted path is forced to depth
    `(it + b) % (num_steps+1)` (or the deepest node there is), so the extend sees every padding
    across iterations and the batch mixes them."""
    tree = pairs[0].eager.tree
    seats = [p.graph for p in pairs]
    drafted = [draft(head, p.state, p.eager.draft_cache, tree) for p in pairs]
    got_trees = backend.draft(head, seats, [p.state for p in pairs])
    d = diffs["draft decode"]
    for want, got in zip(drafted, got_trees):
        d.exact("tree tokens", want.tokens, got.tokens)
        d.exact("tree parents", want.parents, got.parents)
        d.close("path scores", want.scores, got.scores)
    vins = [build_tree(t, p.state.root, p.state.seq_len, tree) for t, p in zip(drafted, pairs)]
    wants = [run_target(target, vin, p.eager.cache, p.eager.aux_ids)
             for vin, p in zip(vins, pairs)]
    gots = backend.verify(target, seats, vins, [], [], [])
    d = diffs["verify"]
    for want, got in zip(wants, gots):
        d.exact("target argmax", want.logits.argmax(-1), got.logits.argmax(-1))
        d.close("logits", want.logits, got.logits)
        d.close("features", want.features, got.features)
    if it == 0:
        extend_every_padding(head, backend, pairs, [w.features for w in wants],
                             diffs["extend paddings"])
    exts_eager, exts_graph = [], []
    for b, (p, vin, want, got) in enumerate(zip(pairs, vins, wants, gots)):
        depth = min((it + b) % (tree.num_steps + 1), int(vin.depth.max()))
        node = (vin.depth == depth).nonzero()[0]  # [1] the first node at that depth
        vout = accepted_path(vin, node, want.logits[node].argmax(-1))
        for cache in (p.eager.cache, p.graph.cache):
            commit(vin, vout, cache)
        diffs["commit"].caches("target cache", p.eager.cache, p.graph.cache,
                               p.state.seq_len + depth + 1)
        exts_eager.append(extend_input(vin, vout, depth, want.features))
        exts_graph.append(extend_input(vin, vout, depth, got.features))
    got_states = backend.extend(head, seats, exts_graph)
    d = diffs["draft extend"]
    for p, ext, got in zip(pairs, exts_eager, got_states):
        want = extend(head, ext, p.eager.draft_cache, tree.topk)
        d.exact("top-k ids", want.topk_ids, got.topk_ids)
        d.exact("root", want.root, got.root)
        d.exact("seq_len", want.seq_len, got.seq_len)
        d.close("top-k probs", want.topk_p, got.topk_p)
        d.close("hidden", want.hidden, got.hidden)
        d.caches("draft cache", p.eager.draft_cache, p.graph.draft_cache, want.seq_len)
        p.state = want


def decode_parity(target: TargetModel, backend: GraphPhases, pairs: list[ParityPair],
                  diff: Diff, steps: int = 3) -> None:
    """Plain decoding's step for every request at once through the backend against
    `verify.decode` alone, from each request's committed rows."""
    tokens = [p.state.root for p in pairs]
    seq_lens = [p.state.seq_len for p in pairs]
    for _ in range(steps):
        wants = [decode(target, tok, n, p.eager.cache)
                 for tok, n, p in zip(tokens, seq_lens, pairs)]
        gots = backend.verify(target, [], [], [p.graph for p in pairs], tokens, seq_lens)
        for want, got, n, p in zip(wants, gots, seq_lens, pairs):
            if target.dtype == torch.float32:
                diff.exact("argmax", want.argmax(-1), got.logits.argmax(-1))
            else:  # a near-tie may round either way: the graph's pick scores the max, to rounding
                diff.close("argmax's logit", want.amax(-1),
                           want.gather(-1, got.logits.argmax(-1, keepdim=True))[:, 0])
            diff.close("logits", want, got.logits)
            diff.caches("target cache", p.eager.cache, p.graph.cache, n + 1)
        tokens = [w.argmax(-1) for w in wants]
        seq_lens = [n + 1 for n in seq_lens]


# ---------------------------------------------------------------- engine, syncs, throughput

class IdTokenizer:
    """Stand-in tokenizer for the tiny models: token i decodes to '<i>'."""

    eos_token_id = 2

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"<{i}>" for i in ids)


def engine_pair(target: TargetModel, tokenizer: object, heads: dict[str, Eagle3Draft],
                config: EngineConfig) -> tuple[EagleEngine, EagleEngine]:
    """Two engines over the same weights: graphs off, and the default (graphs on CUDA)."""
    eager = dataclasses.replace(config, cuda_graphs=False)
    return (EagleEngine(target, tokenizer, heads, eager),
            EagleEngine(target, tokenizer, heads, dataclasses.replace(config, cuda_graphs=True)))


def engine_parity(engines: tuple[EagleEngine, EagleEngine], head: str, prompt_ids: list[int],
                  tree: TreeParams, max_new_tokens: int, strict: bool = True,
                  label: str = "") -> list[Row]:
    """Greedy output of the graphed engine against the eager one, baseline and EAGLE. With
    `strict=False` (bf16 real models, where near-ties may flip) a divergence is reported only."""
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    rows = []
    for mode, name in (("baseline", None), ("EAGLE", head)):
        want, got = (e.generate(prompt_ids, params, tree, name).token_ids for e in engines)
        first = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), None)
        check = f"engine {mode} {label}: graphs == eager"
        if first is None and len(want) == len(got):
            rows.append(Row(check, "PASS", f"{len(want)} tokens", True))
        else:
            detail = f"diverges at token {first} of {len(want)}"
            rows.append(Row(check, "FAIL" if strict else "differs", detail,
                            False if strict else None))
    return rows


def batch_parity(engines: tuple[EagleEngine, EagleEngine], head: str,
                 prompts: list[list[int]], tree: TreeParams, max_new_tokens: int) -> list[Row]:
    """Greedy answers of `len(prompts)` requests stepped together by each engine's scheduler
    (as the app's visitors are), EAGLE-3 and plain, graphed engine against eager."""
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    answers = []
    for e in engines:
        handles = [e.scheduler.submit(p, params, tree, h, trace=False)
                   for p in prompts for h in (head, None)]
        e.scheduler.run_until_idle()
        answers.append([[t.token_id for ev in hd.events() for t in ev.tokens] for hd in handles])
    same = sum(a == b for a, b in zip(*answers))
    return [Row(f"engine batch of {len(answers[0])}: graphs == eager",
                "PASS" if same == len(answers[0]) else "FAIL",
                f"{same}/{len(answers[0])} answers equal", same == len(answers[0]))]
