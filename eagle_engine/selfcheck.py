"""`python -m eagle_engine selfcheck`: the GPU path's checks and throughput, in one table.

On CUDA it runs the logic of the GPU-only tests (each Triton kernel against its torch reference
on the device, every phase through captured graphs against the eager phase, no host sync inside
the graphed phases and kernels, engine output with graphs against without) and then measures
decode tokens/s, eager vs graphs, for the baseline and for EAGLE on the chosen target. On a
machine without CUDA it lists what it skipped and exits 0. The check functions are shared with
tests/test_kernels.py and tests/test_cuda_graph.py, which run the CPU-capable ones in CI.
Not here: the runners themselves (`cuda_graph.py`) or the kernels (`kernels/`).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from . import kernels
from .accept import commit, extend
from .config import ConfigError, DraftConfig, EngineConfig, SamplingParams, TargetConfig, TreeParams
from .cuda_graph import GraphMode, GraphPhases
from .draft import draft
from .engine import EagleEngine
from .events import RunStats
from .io_struct import EagleDraftExtendInput, EagleDraftInput
from .kernels.checks import kernel_mismatches
from .kv_cache import KVCache, causal_mask
from .models.draft_model import Eagle3Draft
from .models.layers import Rope
from .models.target import TargetModel
from .tree import build_tree
from .verify import run_target

TINY_TARGET = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
               "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
               "eos_token_id": 2}
TINY_DRAFT = {"hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 96, "draft_vocab_size": 64}
TINY_TREE = TreeParams(topk=4, num_steps=4, num_draft_tokens=12)
LLAMA_COMMAND = ("python -m eagle_engine selfcheck --target meta-llama/Llama-3.1-8B-Instruct "
                 "--draft yuhuili/EAGLE3-LLaMA3.1-Instruct-8B --dtype bf16")


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
                max_len: int = 256) -> tuple[TargetModel, Eagle3Draft]:
    """A random 8-layer target and a random EAGLE-3 head with a reduced vocabulary. Weights are
    scaled up so that greedy choices have clear margins over rounding noise."""
    g = torch.Generator().manual_seed(seed)
    target = TargetModel(TargetConfig.from_dict(TINY_TARGET), max_len)
    head = Eagle3Draft(DraftConfig.from_dict(TINY_DRAFT), max_len + 512)
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


def extend_every_padding(head: Eagle3Draft, runners: GraphPhases, caches: tuple[KVCache, KVCache],
                         features: torch.Tensor, seq_len: int, diff: Diff) -> None:
    """Extend with 1..num_steps+1 tokens (and back to 1) on both paths; caches restored after."""
    eager_cache, static_cache = caches
    saved = [t.clone() for c in caches for layer in c.layers for t in layer]
    steps, topk = runners.tree.num_steps, runners.tree.topk
    for T in [*range(1, steps + 2), 1]:
        rows = torch.arange(T, device=features.device) % features.shape[0]
        ext = EagleDraftExtendInput((rows * 7 + 5) % head.cfg.vocab_size, features[rows], seq_len)
        want = extend(head, ext, eager_cache, topk)
        got = runners.extend(head, ext, static_cache, topk)
        diff.exact(f"T={T} top-k ids", want.topk_ids, got.topk_ids)
        diff.exact(f"T={T} root/seq_len", (want.root, want.seq_len), (got.root, got.seq_len))
        diff.close(f"T={T} top-k probs", want.topk_p, got.topk_p)
        diff.close(f"T={T} hidden", want.hidden, got.hidden)
        diff.caches(f"T={T} draft cache", eager_cache, static_cache, seq_len + T)
        for t, copy in zip((t for c in caches for layer in c.layers for t in layer), saved):
            t.copy_(copy)


def phase_parity(target: TargetModel, head: Eagle3Draft, tree: TreeParams, mode: GraphMode,
                 iterations: int = 6, seed: int = 0) -> list[Row]:
    """Each phase through the runners (STATIC: static buffers replayed eagerly; GRAPHS: captured
    CUDA graphs) against the eager phase function on the same inputs, iteration after iteration,
    accepting 0..num_steps drafts in turn; the extend is also checked at every padding. Tokens,
    trees and top-k ids must match exactly, floats to a dtype tolerance."""
    K, S, L = tree.topk, tree.num_steps, target.max_len - 32
    # bf16: attention over the whole cache (static) and over the live rows (eager) rounds
    # probabilities in different blocks, and random models amplify rounding (the tiny test
    # models' bf16 logits differ from their fp32 logits by ~0.5 of the max); a wrong cache row
    # or mask differs at that order, not at 1e-1
    tolerance = 5e-5 if target.dtype == torch.float32 else 1e-1
    aux = head.cfg.resolve_aux_layer_ids(target.cfg)
    t_eager, t_static = target.new_cache(max_len=L), target.new_cache(max_len=L)
    runners = GraphPhases(target, t_static, head, tree, L + K * S)
    if mode is GraphMode.GRAPHS:
        runners.capture()
    d_eager, d_static = head.new_cache(L + K * S), runners.draft_cache
    state = prefill_both(target, head, (t_eager, t_static), (d_eager, d_static), K, seed)
    diffs = {name: Diff(f"{name}: {mode.value} == eager", tolerance) for name in
             ("draft decode", "verify", "commit", "draft extend", "extend paddings")}
    for it in range(iterations):
        state = parity_step(target, head, tree, runners, (t_eager, t_static, d_eager, d_static),
                            state, aux, it, diffs)
    shape = f"K={K}, steps={S}, N={tree.num_draft_tokens}, {iterations} iterations"
    return [d.row(shape) for d in diffs.values()]


def parity_step(target: TargetModel, head: Eagle3Draft, tree: TreeParams, runners: GraphPhases,
                caches: tuple[KVCache, KVCache, KVCache, KVCache], state: EagleDraftInput,
                aux: tuple[int, ...], it: int, diffs: dict[str, Diff]) -> EagleDraftInput:
    """One iteration on both paths from the same draft input; -> the eager path's next input.
    The accepted path is forced to depth `it % (num_steps+1)` (or the deepest node there is),
    so the extend sees every padding across iterations."""
    t_eager, t_static, d_eager, d_static = caches
    drafted = draft(head, state, d_eager, tree)
    got_tree = runners.draft(head, state, d_static, tree)
    d = diffs["draft decode"]
    d.exact("tree tokens", drafted.tokens, got_tree.tokens)
    d.exact("tree parents", drafted.parents, got_tree.parents)
    d.close("path scores", drafted.scores, got_tree.scores)
    vin = build_tree(drafted, state.root, state.seq_len, tree)
    want_t, got_t = run_target(target, vin, t_eager, aux), runners.run_target(target, vin,
                                                                               t_static, aux)
    d = diffs["verify"]
    d.exact("target argmax", want_t.logits.argmax(-1), got_t.logits.argmax(-1))
    d.close("logits", want_t.logits, got_t.logits)
    d.close("features", want_t.features, got_t.features)
    if it == 0:
        extend_every_padding(head, runners, (d_eager, d_static), want_t.features, state.seq_len,
                             diffs["extend paddings"])
    depth = min(it % (tree.num_steps + 1), int(vin.depth.max()))
    node = int((vin.depth == depth).nonzero()[0, 0])
    path = vin.retrieve_indices[node, :depth + 1]
    bonus = int(want_t.logits[node].argmax())
    v_eager = commit(vin, path, bonus, want_t.features, t_eager)
    v_static = commit(vin, path, bonus, got_t.features, t_static)
    diffs["commit"].caches("target cache", t_eager, t_static, state.seq_len + depth + 1)
    want = extend(head, v_eager.extend, d_eager, tree.topk)
    got = runners.extend(head, v_static.extend, d_static, tree.topk)
    d = diffs["draft extend"]
    d.exact("top-k ids", want.topk_ids, got.topk_ids)
    d.exact("root/seq_len", (want.root, want.seq_len), (got.root, got.seq_len))
    d.close("top-k probs", want.topk_p, got.topk_p)
    d.close("hidden", want.hidden, got.hidden)
    d.caches("draft cache", d_eager, d_static, want.seq_len)
    return want


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


@contextlib.contextmanager
def sync_debug(mode: str) -> Iterator[None]:
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def check_no_sync(target: TargetModel, head: Eagle3Draft, tree: TreeParams) -> Row:
    """The graphed phases and the three kernels under set_sync_debug_mode('error'). Outside it:
    `build_tree` (uploads the root id) and the extend's `root` read, both engine glue."""
    K, S, L = tree.topk, tree.num_steps, target.max_len - 32
    t_cache = target.new_cache(max_len=L)
    runners = GraphPhases(target, t_cache, head, tree, L + K * S)
    runners.capture()
    d_cache = runners.draft_cache
    aux = runners.aux_layer_ids
    state = prefill_both(target, head, (t_cache,), (d_cache,), K, seed=1)
    torch.cuda.synchronize()
    try:
        with sync_debug("error"):
            drafted = runners.draft(head, state, d_cache, tree)
        vin = build_tree(drafted, state.root, state.seq_len, tree)
        with sync_debug("error"):
            verified = runners.run_target(target, vin, t_cache, aux)
            kernels.build_tree_from_parents(vin.parents, S)
            best, _ = kernels.verify_tree_greedy(vin.tokens, vin.parents, vin.ancestors, vin.depth,
                                                 verified.logits.argmax(-1))
            path = vin.retrieve_indices.index_select(0, best.view(1))[0]  # [S+1], -1 padded
            kernels.compact_kv(t_cache.layers[0][0], vin.seq_len + path[:1], vin.seq_len)
            ext = EagleDraftExtendInput(vin.tokens[:2], verified.features[:2], state.seq_len)
            extend_runner = runners.runners["extend"][1]
            extend_runner.replay_prepare(ext)
            extend_runner.graph.replay()
    except RuntimeError as e:
        return Row("no host sync in graphed phases + kernels", "FAIL", str(e)[:120], False)
    return Row("no host sync in graphed phases + kernels", "PASS",
               "draft, verify, extend prepare+replay; tree_build, verify_greedy, kv_compact", True)


def decode_rate(stats: RunStats) -> float:
    """Tokens per second after the prefill (whose token is not counted)."""
    spent = stats.elapsed_s - stats.prefill_s
    return (stats.num_tokens - 1) / spent if spent > 0 else 0.0


def throughput(engines: tuple[EagleEngine, EagleEngine], head: str, prompt_ids: list[int],
               tree: TreeParams, max_new_tokens: int, repeats: int) -> list[Row]:
    """Decode tokens/s, eager vs graphs, baseline and EAGLE (greedy, EOS ignored)."""
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    rows, baseline = [], {}
    for label, name in (("baseline", None), ("EAGLE", head)):
        for mode, engine in zip(("eager", "graphs"), engines):
            engine.generate(prompt_ids, params, tree, name)  # warm-up; captures graphs once
            runs = [engine.generate(prompt_ids, params, tree, name).stats for _ in range(repeats)]
            rate = statistics.median(decode_rate(s) for s in runs)
            detail = f"median of {repeats} x {max_new_tokens} tokens"
            if name is None:
                baseline[mode] = rate
            else:
                detail += f", tau {runs[0].tau:.2f}, {rate / baseline[mode]:.2f}x baseline {mode}"
            rows.append(Row(f"tokens/s {label} {mode}", f"{rate:.1f}", detail))
    return rows


def syncs_per_iteration(engine: EagleEngine, head: str, prompt_ids: list[int],
                        tree: TreeParams) -> Row:
    """Host syncs of a whole EAGLE request (set_sync_debug_mode('warn')) per iteration."""
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    with warnings.catch_warnings(record=True) as caught, sync_debug("warn"):
        warnings.simplefilter("always")
        stats = engine.generate(prompt_ids, params, tree, head).stats
    count = sum("synchroniz" in str(w.message) for w in caught)
    return Row("host syncs per EAGLE iteration", f"{count / max(stats.num_steps, 1):.1f}",
               f"{count} in a request of {stats.num_steps} iterations, prefill included")


def model_rows(args: argparse.Namespace) -> list[Row]:
    """Parity, syncs and throughput on the requested target and head."""
    from .cli_args import pick_head, tree_params

    config = EngineConfig(target=args.target, drafts=(args.draft,), dtype=args.dtype,
                          device="cuda", max_len=args.max_len)
    tree = tree_params(args, config.default_tree)
    try:
        loaded = EagleEngine.load(config)
        head = pick_head(loaded, args.draft)
    except (ConfigError, OSError) as e:
        return [Row(f"model {args.target}", "skipped", f"could not load: {e}"[:200])]
    eager = EagleEngine(loaded.target, loaded.tokenizer, loaded.heads,
                        dataclasses.replace(config, cuda_graphs=False))
    engines = (eager, loaded)  # `loaded` has graphs on (the default)
    prompt_ids = loaded.encode(args.prompt)
    rows = engine_parity(engines, head, prompt_ids, tree, args.max_new_tokens,
                         strict=config.dtype == "fp32", label=f"{args.target} {config.dtype}")
    rows.append(syncs_per_iteration(engines[1], head, prompt_ids, tree))
    return rows + throughput(engines, head, prompt_ids, tree, args.max_new_tokens, args.repeats)


def run_checks(args: argparse.Namespace) -> list[Row]:
    dev = torch.device("cuda")
    rows = [verdict(f"kernel {name} == reference (cuda)", failures, f"{count} cases")
            for name, (count, failures) in kernel_mismatches(kernels, dev).items()]
    with torch.inference_mode():
        target, head = tiny_models(dev)
        rows += phase_parity(target, head, TINY_TREE, GraphMode.GRAPHS)
        rows.append(check_no_sync(target, head, TINY_TREE))
        engines = engine_pair(target, IdTokenizer(), {"tiny": head},
                              EngineConfig(dtype="fp32", device="cuda", max_len=192))
        rows += engine_parity(engines, "tiny", list(range(3, 40)), TINY_TREE, 48,
                              label="tiny fp32")
    if args.skip_model:
        return rows + [Row("model checks and tokens/s", "skipped", "--skip-model")]
    return rows + model_rows(args)


def format_table(rows: list[Row]) -> str:
    header = Row("check", "result", "detail")
    widths = [max(len(getattr(r, f)) for r in [header, *rows]) for f in ("check", "result")]
    return "\n".join(f"{r.check:<{widths[0]}}  {r.result:<{widths[1]}}  {r.detail}".rstrip()
                     for r in [header, *rows])


SKIPPED = """selfcheck: no CUDA device here, so nothing ran on a GPU. Skipped:
  - Triton kernels on the device against their torch references
  - every phase replayed as a CUDA graph against the eager phase (all extend paddings)
  - no host sync under torch.cuda.set_sync_debug_mode('error')
  - engine output with graphs against without (tiny model and --target)
  - tokens/s eager vs graphs for the baseline and EAGLE
The CPU side of these checks runs in CI: pytest tests/test_kernels.py tests/test_cuda_graph.py
On a CUDA machine: """


def cmd_selfcheck(args: argparse.Namespace) -> None:
    if not torch.cuda.is_available():
        print(SKIPPED + LLAMA_COMMAND)
        return
    rows = run_checks(args)
    print(format_table(rows))
    if any(r.ok is False for r in rows):
        raise SystemExit(1)


def add_selfcheck_parser(sub: argparse._SubParsersAction) -> None:
    from .cli_args import add_tree_args

    p = sub.add_parser("selfcheck", help="GPU path checks and eager-vs-graphs tokens/s",
                       description=f"Needs CUDA (otherwise lists what it skips). Documented run: "
                                   f"{LLAMA_COMMAND}")
    p.add_argument("--target", default="bundled", help="bundled | HF directory | hub id")
    p.add_argument("--draft", default="bundled", help="bundled | directory | hub id")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per configuration")
    p.add_argument("--prompt", default="Explain how a CPU cache works, step by step.")
    p.add_argument("--skip-model", action="store_true", help="only the tiny-model checks")
    add_tree_args(p)
    p.set_defaults(func=cmd_selfcheck)
