"""`python -m eagle_engine train`: the end-to-end head training pipeline.

    prompts.jsonl -> data (self-distillation) -> features -> vocab -> TTT training -> head dirs

Features are cached on disk (the CPU default) or computed per training batch (`--online`, the
GPU path); `--heads` trains several heads (aux on/off, layer counts, recipe options: see
`head_specs`) on the same batches, and `--holdout` / `--eval-every` keep each head's best state
by held-out accuracy. Stages cache their outputs in `--work-dir` (outside git) and resume, also
after `--stop-after-minutes` ends an invocation; each head is written in the standard HF
EAGLE-3 format with a model card, the training log and a loss/accuracy plot. `--quick` is a tiny
configuration that exercises every stage in CI time (not a quality run).
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import ConfigError, DraftConfig
from ..models.draft_io import normalize_names, save_draft, weight_files
from ..models.draft_model import Eagle3Draft
from ..models.loader import load_target, load_tokenizer, read_tensors, resolve_target
from .data import (answer_ids, copy_responses, generate_responses, select_prompt_files,
                   teacher_rows)
from .features import extract, load_samples, read_rows, row_ids
from .online import online_batch
from .trainer import (Batch, Head, Recipe, TrainParams, collate, new_head, train,
                      train_dtype)
from .vocab import carry_rows, coverage_table, select_vocab, token_counts

log = logging.getLogger(__name__)
VOCAB_SIZES = [1024, 2048, 4096, 8192, 16384, 32768]
MAX_TOKENS = 1024  # conversation tokens a training sample keeps


def add_train_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train EAGLE-3 heads for a target (end to end)")
    p.add_argument("--prompts", type=Path, action="append", default=None,
                   help="prompt JSONL (id, source, turns), plain or .gz; repeat for several "
                        "files (each drawn from with its own --limit). Without it, --no-generate "
                        "trains on every answer of --responses")
    p.add_argument("--out", type=Path, required=True,
                   help="head directory to write (with --heads: the parent of the heads)")
    p.add_argument("--heads", default=None,
                   help="several heads on the same batches: "
                        "NAME:LAYERS:aux|auxnorm|noaux[:OPT+OPT...],... "
                        "(auxnorm: aux with an RMSNorm per aux chunk before fc; options: "
                        "tv=W adds W * total variation to the loss, noise=S adds Gaussian noise "
                        "of S * RMS to the input features in training, nomask also scores "
                        "targets outside the draft vocabulary, normout recycles the normed "
                        "hidden, e.g. b:1:aux:tv=0.5+normout) "
                        "(default: one head from --num-layers / --no-aux)")
    p.add_argument("--work-dir", type=Path, default=Path("runs/train"),
                   help="cache for responses, features and checkpoints (outside git)")
    p.add_argument("--target", default="bundled")
    p.add_argument("--device", default="cpu", help="cpu | cuda (generation and training)")
    p.add_argument("--online", action="store_true",
                   help="compute target features per training batch instead of caching them "
                        "(the fast path on a GPU)")
    p.add_argument("--limit", type=int, action="append", default=None,
                   help="prompts drawn from each --prompts file: one value for every file, or "
                        "one per file in their order (default 2200)")
    p.add_argument("--max-new-tokens", type=int, default=320)
    p.add_argument("--batch-size", type=int, default=48, help="generation batch size")
    p.add_argument("--sampled-share", type=float, default=0.15)
    p.add_argument("--samples-per-prompt", type=int, default=2,
                   help="answers per prompt; all but the first are sampled")
    p.add_argument("--samples-per-source", default="",
                   help="per-source answers per prompt, e.g. self_instruct_user=16,alpaca_eval=0 "
                        "(0: no answers to that source)")
    p.add_argument("--num-layers", type=int, default=1)
    p.add_argument("--no-aux", action="store_true", help="EAGLE-1/2 style input (final hidden)")
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--epochs", type=float, default=3.0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--ttt-length", type=int, default=6)
    p.add_argument("--tokens-per-batch", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--holdout", type=int, default=0,
                   help="conversations held out of training (drawn by --seed): each head's "
                        "held-out accuracy is logged and its best state is the one written")
    p.add_argument("--eval-every", type=int, default=0,
                   help="steps between held-out evaluations (0: only at the end; "
                        "needs --holdout)")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="training time budget (the LR schedule is fitted to it)")
    p.add_argument("--stop-after-minutes", type=float, default=None,
                   help="end this invocation cleanly after so many minutes (checkpoint and "
                        "heads written); the same command again resumes the schedule")
    p.add_argument("--responses", type=Path, action="append", default=None,
                   help="answers to start from (JSONL, or .jsonl.gz as in data/answers/; "
                        "repeatable): copied into --work-dir when it holds none, so that "
                        "generation only adds the answers they lack")
    p.add_argument("--no-generate", action="store_true",
                   help="train on the responses already in --work-dir (skip generation)")
    p.add_argument("--teacher-forced", type=Path, default=None,
                   help="also train on these conversations' own text (JSONL or .jsonl.gz with "
                        "'messages', as data/corpus/build.py writes): target features and soft "
                        "labels over answers nobody generated here")
    p.add_argument("--teacher-limit", type=int, default=1000,
                   help="conversations taken from --teacher-forced")
    p.add_argument("--init-from", type=Path, default=None,
                   help="start from a trained head (matching tensors are copied)")
    p.add_argument("--quick", action="store_true", help="tiny CI configuration")
    p.set_defaults(func=run_pipeline)


@dataclass(frozen=True)
class HeadSpec:
    out: Path
    num_layers: int
    use_aux: bool
    fc_norm: bool = False  # RMSNorm on each aux chunk before `fc` (EAGLE 3.1's fc_norm)
    norm_output: bool = False  # the recycled hidden is norm(h) (in training and in the config)
    recipe: Recipe = field(default_factory=Recipe)


HEAD_OPTIONS = "tv=FLOAT, noise=FLOAT, nomask, normout, joined by +"


def head_options(item: str, text: str) -> tuple[Recipe, bool]:
    """The `OPT+OPT...` of `--heads` item `item` -> (recipe, norm_output): `tv=W` sets
    `Recipe.tv_weight`, `noise=S` `Recipe.feature_noise` (W, S >= 0), `nomask` clears
    `Recipe.mask_outside_vocab`, `normout` sets the head's `norm_output`."""
    fields: dict[str, float | bool] = {}
    norm_output, seen = False, set()
    for opt in text.split("+"):
        name, eq, value = opt.partition("=")
        if name in seen:
            raise ConfigError(f"--heads item {item!r} repeats option {name!r}")
        seen.add(name)
        if name in ("tv", "noise") and eq:
            try:
                x = float(value)
            except ValueError:
                x = math.nan
            if not (math.isfinite(x) and x >= 0):
                raise ConfigError(f"--heads item {item!r}: option {opt!r} needs a number >= 0")
            fields["tv_weight" if name == "tv" else "feature_noise"] = x
        elif opt == "nomask":
            fields["mask_outside_vocab"] = False
        elif opt == "normout":
            norm_output = True
        else:
            raise ConfigError(f"--heads item {item!r}: unknown option {opt!r} "
                              f"(options: {HEAD_OPTIONS})")
    return Recipe(**fields), norm_output


def head_specs(args: argparse.Namespace) -> list[HeadSpec]:
    """`--heads NAME:LAYERS:aux|auxnorm|noaux[:OPT+OPT...],...` under `--out` (options:
    `head_options`), or the one head `--out`."""
    if not args.heads:
        return [HeadSpec(args.out, args.num_layers, not args.no_aux)]
    specs = []
    for item in args.heads.split(","):
        parts = item.split(":")
        if len(parts) not in (3, 4) or not parts[1].isdigit() or int(parts[1]) < 1 \
                or parts[2] not in ("aux", "auxnorm", "noaux"):
            raise ConfigError(f"--heads item {item!r} is not NAME:LAYERS:aux|auxnorm|noaux"
                              "[:OPT+OPT...] (e.g. eagle3-aux-1layer:1:aux:tv=0.5+normout)")
        recipe, norm_output = head_options(item, parts[3]) if len(parts) == 4 \
            else (Recipe(), False)
        specs.append(HeadSpec(args.out / parts[0], int(parts[1]), parts[2] != "noaux",
                              parts[2] == "auxnorm", norm_output, recipe))
    if len({s.out.name for s in specs}) != len(specs):
        raise ConfigError(f"--heads names repeat: {args.heads!r}")
    return specs


def samples_by_source(args: argparse.Namespace) -> Callable[[str], int]:
    """`--samples-per-source a=12,b=4` over the `--samples-per-prompt` default; `a=0` leaves
    source `a` out (an evaluation set among the prompts)."""
    table = {}
    for item in filter(None, args.samples_per_source.split(",")):
        name, _, n = item.partition("=")
        if not name or not n.isdigit():
            raise ConfigError(f"--samples-per-source item {item!r} is not SOURCE=N (N >= 0)")
        table[name] = int(n)
    return lambda source: table.get(source, args.samples_per_prompt)


def prompt_files(args: argparse.Namespace) -> list[tuple[Path, int]]:
    """`--prompts` files paired with their `--limit`: one limit for every file, or one each.
    None (no `--prompts`) is allowed only for training on saved answers alone."""
    if args.prompts is None:
        if not (args.no_generate and (args.responses or args.teacher_forced)):
            raise ConfigError("train needs --prompts FILE (the prompts to answer), or "
                              "--no-generate with --responses / --teacher-forced (train on "
                              "every saved answer)")
        return []
    limits = args.limit or [2200]
    if len(limits) == 1:
        limits = limits * len(args.prompts)
    if len(limits) != len(args.prompts):
        raise ConfigError(f"{len(args.prompts)} --prompts files but {len(limits)} --limit "
                          f"values {limits}: give one for every file or one per file")
    if any(n < 1 for n in limits):
        raise ConfigError(f"--limit {limits}: each must be >= 1")
    return list(zip(args.prompts, limits))


def quick_overrides(args: argparse.Namespace) -> None:
    """The tiny CI configuration: at most 6 prompts a file, short answers, a small head."""
    args.limit = [min(n, 6) for n in args.limit or [6]]
    args.max_new_tokens, args.batch_size = 12, 6
    args.draft_vocab, args.epochs, args.ttt_length, args.tokens_per_batch = 512, 1.0, 3, 1024


def draft_config(target_cfg, num_layers: int, use_aux: bool, vocab: int,  # noqa: ANN001
                 fc_norm: bool = False, norm_output: bool = False) -> DraftConfig:
    """Our head's shape: one target-sized decoder layer (or more) and a reduced vocabulary."""
    t = target_cfg
    return DraftConfig.from_dict({
        "hidden_size": t.hidden_size, "intermediate_size": t.intermediate_size,
        "num_attention_heads": t.num_heads, "num_key_value_heads": t.num_kv_heads,
        "head_dim": t.head_dim, "num_hidden_layers": num_layers, "rms_norm_eps": t.rms_norm_eps,
        "rope_theta": t.rope_theta, "vocab_size": t.vocab_size, "draft_vocab_size": vocab,
        "target_hidden_size": t.hidden_size, "fc_norm": fc_norm, "norm_output": norm_output,
        "eagle_config": {"use_aux_hidden_state": use_aux}})


def source_vocab(src: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """A trained head's draft vocabulary (target ids of its lm_head rows), from its tensors."""
    rows = src.get("lm_head.weight")
    if rows is None:
        return None
    d2t = src.get("d2t")
    offsets = d2t.long() if d2t is not None and d2t.numel() == rows.shape[0] else 0
    return torch.arange(rows.shape[0]) + offsets


def inherited_vocab(init_from: Path, counts: Counter, size: int, vocab_size: int
                    ) -> torch.Tensor:
    """A warm start's draft vocabulary: the trained head's ids (all when `size` holds them),
    then the data's most frequent others (`select_vocab`)."""
    keep = source_vocab(normalize_names(read_tensors(weight_files(init_from,
                                                                  allow_pickle=False))))
    if keep is not None:
        log.info("keeping the %d ids of %s's draft vocabulary in %d", min(keep.numel(), size),
                 init_from, size)
    return select_vocab(counts, size, vocab_size, keep)


@torch.no_grad()
def init_head(model: Eagle3Draft, target, hot: torch.Tensor, init_from: Path | None) -> None:  # noqa: ANN001
    """lm_head rows and final norm start as the target's own (so the head starts in the target's
    output space), residual branches of extra layers start at zero (identity), and `init_from`
    copies every tensor of a trained head whose name and shape match; lm_head rows are indexed by
    draft id, so they are carried over id by id (`carry_rows`), new ids mapped from the target's."""
    model.d2t.copy_(hot - torch.arange(hot.numel()))
    model.lm_head.weight.copy_(target.lm_head.weight[hot.to(target.device)].float())
    model.norm.weight.copy_(target.norm.weight.float())
    for layer in list(model.layers)[1:]:
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    if init_from is None:
        return
    own = model.state_dict()
    src = normalize_names(read_tensors(weight_files(init_from, allow_pickle=False)))
    src_hot = source_vocab(src)
    if src_hot is not None:
        rows = carry_rows(src.pop("lm_head.weight"), src_hot, hot, target.lm_head.weight.cpu())
        model.lm_head.weight.copy_(rows)
    src.pop("d2t", None)
    for name, t in src.items():
        if name in own and own[name].shape == t.shape:
            own[name].copy_(t.float())


def build_head(spec: HeadSpec, target, hot: torch.Tensor, init_from: Path | None,  # noqa: ANN001
               params: TrainParams, device: str, seed: int) -> Head:
    """The head `spec` describes, ready to train: fp32 master weights on `device`, started by
    `init_head` after seeding with `seed`, its draft vocabulary `hot` [Vd], reading the target's
    embedding (shared, frozen, and not saved in the head)."""
    torch.manual_seed(seed)
    model = Eagle3Draft(draft_config(target.cfg, spec.num_layers, spec.use_aux, hot.numel(),
                                     spec.fc_norm, spec.norm_output), 2048 + 64).float()
    init_head(model, target, hot, init_from)
    model.to(device)
    model.share_embedding(target.embed_tokens)
    model.embed_tokens.weight.requires_grad_(False)
    return new_head(spec.out.name, model, target.lm_head.weight.detach(), params, spec.recipe)


def run_pipeline(args: argparse.Namespace) -> None:
    if args.quick:
        quick_overrides(args)
    if args.device == "cpu" and "jemalloc" not in os.environ.get("LD_PRELOAD", ""):
        log.info("CPU training spends much of its time in page faults with glibc's allocator: "
                 "preloading jemalloc about halves it (README, 'Training')")
    deadline = time.time() + 60 * args.stop_after_minutes if args.stop_after_minutes else None
    specs = head_specs(args)
    files = prompt_files(args)
    if args.holdout < 0 or args.eval_every < 0:
        raise ConfigError(f"--holdout {args.holdout} / --eval-every {args.eval_every}: "
                          "must be >= 0")
    if args.eval_every and not args.holdout:
        raise ConfigError("--eval-every needs --holdout N > 0 (held-out conversations)")
    samples = samples_by_source(args)
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    directory = resolve_target(args.target)
    # bf16 where native, else float32 (AVX2: a bf16 forward costs 2.4x float32's)
    target = load_target(directory, train_dtype(torch.device(args.device)), args.device, 2048)
    tokenizer = load_tokenizer(directory)
    responses = work / "responses.jsonl"
    if args.responses is not None and not responses.exists():
        missing = [str(f) for f in args.responses if not f.is_file()]
        if missing:
            raise ConfigError(f"--responses {', '.join(missing)}: no such file")
        copy_responses(args.responses, responses)
    if args.teacher_forced is not None and not args.teacher_forced.is_file():
        raise ConfigError(f"--teacher-forced {args.teacher_forced}: no such file")
    prompts = select_prompt_files(files, args.seed)
    skip = args.no_generate and (responses.exists() or args.teacher_forced is not None)
    if not skip and not generate_responses(
            target, tokenizer, prompts, responses, args.max_new_tokens, args.batch_size,
            args.sampled_share, args.seed, samples, deadline=deadline):
        log.info("stopped at the time limit while generating: the same command resumes")
        return
    rows = read_rows(responses) if responses.exists() else []
    if files:  # the answers to the prompts drawn; without --prompts every saved answer
        wanted = set(answer_ids(prompts, samples))
        rows = [r for r in rows if r["id"] in wanted]
    if args.teacher_forced is not None:
        rows += teacher_rows(args.teacher_forced, tokenizer, args.teacher_limit, args.seed,
                             max_tokens=MAX_TOKENS)
    if not rows:
        raise ConfigError(f"nothing to train on: no answers in {responses} for the {len(prompts)} "
                          "prompts selected, and no --teacher-forced conversations")
    log.info("%d training rows, ready in %.1f min", len(rows), (time.perf_counter() - t0) / 60)
    aux_ids = target.cfg.default_aux_layer_ids()
    counts = token_counts([r["response_ids"] for r in rows])
    coverage = coverage_table(counts, VOCAB_SIZES)
    hot = (select_vocab(counts, args.draft_vocab, target.cfg.vocab_size)
           if args.init_from is None else
           inherited_vocab(args.init_from, counts, args.draft_vocab, target.cfg.vocab_size))
    params = TrainParams(epochs=args.epochs, lr=args.lr, warmup_steps=args.warmup_steps,
                         ttt_length=args.ttt_length, tokens_per_batch=args.tokens_per_batch,
                         seed=args.seed, max_minutes=args.max_minutes,
                         holdout=args.holdout, eval_every=args.eval_every)
    heads = [build_head(spec, target, hot, args.init_from, params, args.device, args.seed)
             for spec in specs]
    in_vocab = torch.zeros(target.cfg.vocab_size, dtype=torch.bool, device=args.device)
    in_vocab[hot.to(args.device)] = True
    if args.online:
        lengths = [len(row_ids(r, MAX_TOKENS)) for r in rows]

        def make_batch(group: list[int]) -> Batch:
            return online_batch(target, rows, group, aux_ids, in_vocab, MAX_TOKENS)
    else:
        cached = load_samples(extract(target, rows, aux_ids, work / "features",
                                      max_tokens=MAX_TOKENS))
        lengths = [s.ids.numel() for s in cached]

        def make_batch(group: list[int]) -> Batch:
            return collate(cached, group, in_vocab)
    run_dir = work / ("run-" + "+".join(s.out.name for s in specs))
    done = train(heads, lengths, make_batch, run_dir, params, deadline)
    wall = time.perf_counter() - t0
    for spec, head in zip(specs, heads):  # with --holdout, `train` left the best states
        save_draft(head.model, target.cfg, spec.out, 8192)
        write_card(args, spec, head.log, coverage, rows, wall, head.best_step)
        plot_log(head.log, spec.out / "training.png")
        (spec.out / "train_log.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in head.log))
        print(f"wrote {spec.out} (weights, config.json, card README.md, training.png, "
              f"train_log.jsonl) after {len(head.log)} steps")
    if not done:
        print(f"stopped at the time limit: the same command resumes from {run_dir}")
    target = "" if args.target == "bundled" else f" --target {args.target}"
    print(f"try it: python -m eagle_engine generate{target} --draft {specs[0].out} --prompt "
          f"\"...\"; python -m eagle_engine eval-head{target} --draft {specs[0].out} "
          "--prompts FILE")


def recipe_text(spec: HeadSpec) -> str:
    """The card's line for a head's recipe options (`head_options`)."""
    r = spec.recipe
    parts = ["soft cross-entropy" + (f" + {r.tv_weight} * total variation" if r.tv_weight
                                     else "")]
    if r.feature_noise:
        parts.append(f"input feature noise {r.feature_noise} * RMS (per token and aux chunk)")
    parts.append("targets outside the draft vocabulary masked" if r.mask_outside_vocab
                 else "targets outside the draft vocabulary scored too")
    if spec.norm_output:
        parts.append("recycled hidden normed (norm_output)")
    return ", ".join(parts)


def write_card(args: argparse.Namespace, spec: HeadSpec, log: list[dict],
               coverage: dict[int, float], rows: list[dict], wall_s: float,
               best_step: int = 0) -> None:
    """`best_step` > 0: the weights are those of that step (best held-out accuracy)."""
    last = log[-1] if log else {}
    best = next((r for r in log if r["step"] == best_step), {})
    stopping = (f"weights of step {best_step} of {len(log)}: best 0.8^k-weighted held-out "
                f"accuracy {best.get('heldout_score', float('nan')):.3f} on {args.holdout} "
                f"held-out conversations, evaluated "
                f"{f'every {args.eval_every} steps and ' if args.eval_every else ''}at the end"
                if best_step else "none (weights of the last step)")
    n_tokens = sum(len(r["prompt_ids"]) + len(r["response_ids"]) for r in rows)
    resp_tokens = sum(len(r["response_ids"]) for r in rows)
    cov = ", ".join(f"{k}: {v:.3f}" for k, v in coverage.items())
    epoch = last.get("epoch", 0) + 1
    budget = f" (schedule fitted to --max-minutes {args.max_minutes})" if args.max_minutes else ""
    online = ", features per batch" if args.online else ""
    card = f"""# {spec.out.name}

EAGLE-3 head for SmolLM2-135M-Instruct (bundled GGUF, dequantized), trained by
`python -m eagle_engine train` in this repository.

| | |
|---|---|
| input | {"aux hidden states (inputs of target layers 2, 15, 27)" if spec.use_aux else "target final hidden (aux off)"}{", each RMS-normed before fc (fc_norm)" if spec.fc_norm else ""} |
| draft layers | {spec.num_layers} |
| draft vocabulary | {args.draft_vocab} most frequent response tokens |
| data | {data_line(args, rows)} ({n_tokens} tokens, {resp_tokens} response tokens) |
| training | {len(log)} steps of ~{args.tokens_per_batch} tokens, reaching epoch {epoch} of {args.epochs}{budget}, TTT length {args.ttt_length}, lr {args.lr} |
| recipe | {recipe_text(spec)} |
| final loss / step-0 accuracy | {last.get("loss", float("nan")):.3f} / {last.get("step_acc", [float("nan")])[0]:.3f} |
| early stopping | {stopping} |
| wall time (whole pipeline run, device `{args.device}`{online}) | {wall_s / 60:.1f} min |

Draft-vocabulary coverage of response tokens by size: {cov}.

Acceptance (tau) per dataset: `python -m eagle_engine bench --draft DIR`.
"""
    (spec.out / "README.md").write_text(card)


def file_names(paths: list[Path]) -> str:
    return " and ".join(f"`{p.name}`" for p in paths)


def data_line(args: argparse.Namespace, rows: list[dict]) -> str:
    taught = sum("temperature" in r and r["temperature"] is None for r in rows)
    if args.prompts:
        where = f"to prompts of {file_names(args.prompts)}"
    elif args.responses:
        where = f"saved in {file_names(args.responses)}"
    else:  # no --prompts, no --responses: the answers a work directory already held
        where = "of the work directory"
    parts = [f"{len(rows) - taught} self-distilled responses {where}"] if len(rows) > taught else []
    if taught:
        parts.append(f"{taught} teacher-forced conversations of `{args.teacher_forced.name}`")
    return ", ".join(parts)


def plot_log(log: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not log:
        return
    steps = [r["step"] for r in log]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
    a.plot(steps, [r["loss"] for r in log])
    a.set(title="weighted TTT loss", xlabel="step")
    for k in range(len(log[0]["step_acc"])):
        b.plot(steps, [r["step_acc"][k] for r in log], label=f"step {k}")
    b.set(title="top-1 accuracy vs target", xlabel="step")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
