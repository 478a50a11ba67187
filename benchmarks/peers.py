"""Our engine against the tools a visitor already has, on the same CPU, in one run.

    PYTHONPATH=. python benchmarks/peers.py --prompts data/prompts/mtbench.jsonl \
        [--limit 3] [--max-new-tokens 128] [--rounds 2] [--temperature 0.7 --top-p 0.95] \
        [--json out.json]

Systems: our plain decoding and our EAGLE-3 (default head; each format's default tree: the one
`python -m eagle_engine tune` measured fastest on this machine when cached) for every
target weight format this machine supports (q4; dense fp32; dense bf16 where bf16 is native),
`transformers.generate` with the bundled GGUF loaded directly in fp32 and in bf16, and
llama.cpp's plain decoding of the same GGUF through `llama-cpp-python` when it imports. Every
system decodes the same prompt token ids (MT-bench questions, both turns as conversations; the
second turn carries our q4 baseline's first answer) for exactly `--max-new-tokens` tokens,
greedy (or sampled with `--temperature` and `--top-p`, every system without top-k or min-p),
EOS ignored, on the same threads; the rounds alternate the system order. tokens/s =
tokens / wall time of the whole answer, prefill included. Prints a table and writes JSON naming
the CPU model and its vector flags.

llama-cpp-python is a benchmark-only peer, never an app requirement:
    CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python   # ~15 min on 2 cores
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from eagle_engine import autotune
from eagle_engine.config import EngineConfig, SamplingParams
from eagle_engine.bench import provenance, write_report
from eagle_engine.hardware import native_bf16
from eagle_engine.engine import DEFAULT_HEAD, EagleEngine
from eagle_engine.models.loader import bundled_gguf_path

Decode = Callable[[list[int]], int]  # prompt ids -> tokens decoded


def conversations(engine: EagleEngine, rows: list[dict], n: int) -> list[list[int]]:
    """Prompt ids of every turn; later turns carry the engine's greedy answer to earlier ones."""
    out = []
    for row in rows:
        messages: list[dict[str, str]] = []
        for turn in row["turns"]:
            messages.append({"role": "user", "content": turn})
            ids = engine.encode(messages)
            out.append(ids)
            answer = engine.generate(ids, SamplingParams(max_new_tokens=n)).text
            messages.append({"role": "assistant", "content": answer})
    return out


def ours(engine: EagleEngine, head: str | None, n: int, temperature: float, top_p: float
         ) -> Decode:
    params = SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=temperature,
                            top_p=top_p, seed=0)

    def run(ids: list[int]) -> int:
        return len(engine.generate(ids, params, None, head).token_ids)
    return run


def transformers_generate(dtype: torch.dtype, n: int, temperature: float, top_p: float
                          ) -> Decode:
    from transformers import AutoModelForCausalLM

    gguf = bundled_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
    model.eval()

    @torch.inference_mode()
    def run(ids: list[int]) -> int:
        sampling = (dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
                    if temperature > 0 else dict(do_sample=False))
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n,
                             pad_token_id=0, **sampling)
        return out.shape[1] - len(ids)
    return run


def llama_cpp(n: int, threads: int, temperature: float, top_p: float) -> Decode:
    from llama_cpp import Llama

    llm = Llama(model_path=str(bundled_gguf_path()), n_ctx=4096, n_threads=threads,
                n_threads_batch=threads, verbose=False)

    def run(ids: list[int]) -> int:
        llm.reset()
        count = 0
        sampling = (dict(top_k=0, top_p=top_p, min_p=0.0, temp=temperature) if temperature > 0
                    else dict(top_k=1, top_p=1.0, temp=0.0))
        for _ in llm.generate(ids, reset=True, **sampling):
            count += 1
            if count == n:
                break
        return count
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=Path, required=True, help="JSONL rows with 'turns'")
    ap.add_argument("--limit", type=int, default=3, help="questions (each gives 2 turns)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    sampling = (args.temperature, args.top_p)
    threads = torch.get_num_threads()
    n = args.max_new_tokens
    rows = [json.loads(x) for x in args.prompts.read_text().splitlines() if x.strip()][:args.limit]

    systems: dict[str, Decode] = {}
    formats = [("q4", "fp32"), ("dense", "fp32")] + ([("dense", "bf16")] if native_bf16("cpu")
                                                       else [])
    engines = {}
    for weights, dtype in formats:
        engine = EagleEngine.load(EngineConfig(drafts=(DEFAULT_HEAD,), weights=weights,
                                               dtype=dtype))
        label = engine.config.weights_label
        engines[label] = engine
        autotune.use_cached(engine, DEFAULT_HEAD)  # the tree `tune` measured fastest here
        tree = engine.default_tree
        systems[f"ours plain, {label}"] = ours(engine, None, n, *sampling)
        systems[f"ours EAGLE-3, {label} ({autotune.tree_label(tree)})"] = ours(
            engine, DEFAULT_HEAD, n, *sampling)
    for dtype in (torch.float32, torch.bfloat16):
        systems[f"transformers.generate, {str(dtype)[6:]}"] = transformers_generate(
            dtype, n, *sampling)
    if importlib.util.find_spec("llama_cpp") is not None:
        systems["llama.cpp (llama-cpp-python), plain"] = llama_cpp(n, threads, *sampling)
    else:
        print('llama-cpp-python is not installed; for the llama.cpp peer run\n'
              '  CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python   # ~15 min on 2 cores')

    prompts = conversations(engines["q4"], rows, n)
    for run in systems.values():  # warm-up: lazy inits, first-call allocations
        run(prompts[0][:64])
    results: dict[str, list[float]] = {name: [] for name in systems}
    for r in range(args.rounds):
        order = list(systems) if r % 2 == 0 else list(reversed(systems))
        spent = {name: [0, 0.0] for name in systems}
        for ids in prompts:
            for name in order:
                t0 = time.perf_counter()
                tokens = systems[name](ids)
                spent[name][0] += tokens
                spent[name][1] += time.perf_counter() - t0
        for name, (tokens, seconds) in spent.items():
            results[name].append(round(tokens / seconds, 2))
        print(f"round {r + 1} done", flush=True)

    llama = results.get("llama.cpp (llama-cpp-python), plain")
    width = max(len(s) for s in results)
    print(f"\n{'system':<{width}}  " + "  ".join(f"round {r + 1:>2}" for r in range(args.rounds))
          + ("  vs llama.cpp" if llama else ""))
    for name, rates in results.items():
        ratio = f"  {sum(rates) / sum(llama):>11.2f}x" if llama else ""
        print(f"{name:<{width}}  " + "  ".join(f"{x:>8.2f}" for x in rates) + ratio)
    report = {"kind": "peers", "provenance": provenance(
                  f"PYTHONPATH=. python benchmarks/peers.py {shlex.join(sys.argv[1:])}"),
              "torch_threads": threads, "prompts": len(prompts),
              "max_new_tokens": n, "temperature": args.temperature, "top_p": args.top_p,
              "tokens_per_s": results}
    if args.json:
        print(f"wrote {write_report(args.json, report)}")


if __name__ == "__main__":
    main()
