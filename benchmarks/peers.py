"""Our engine against the tools a visitor already has, on the same CPU, in one run.

    PYTHONPATH=. python benchmarks/peers.py --prompts data/prompts/mtbench.jsonl \
        [--limit 3] [--max-new-tokens 128] [--rounds 2] [--temperature 0.7 --top-p 0.95] \
        [--llama-cpp-bin DIR] [--json docs/figures]

Systems: our plain decoding and our EAGLE-3 (default head; each format's default tree: the one
`python -m eagle_engine tune` measured fastest on this machine when cached) for every
target weight format this machine supports (q4; dense fp32; dense bf16 where bf16 is native),
`transformers.generate` with the bundled GGUF loaded directly in fp32 and in bf16, and
llama.cpp's plain decoding of the same GGUF through `llama-cpp-python` when it imports, and,
with `--llama-cpp-bin` (the folder of llama.cpp's own binaries), llama.cpp's `llama-bench`
(decoding alone, no prompt: `-p 0 -n N -fa 1`, once a round) and its EAGLE-3
(`llama-speculative-simple --spec-type draft-eagle3`, a chain of 3 drafts, with the default
head written by `export-llamacpp`), beside our EAGLE-3 on the same chain. Every other system
decodes the same prompt token ids (MT-bench questions, both turns as conversations; the second
turn carries our q4 baseline's first answer) for exactly `--max-new-tokens` tokens, greedy (or
sampled with `--temperature` and `--top-p`, every system without top-k or min-p; llama.cpp's
binaries only greedy), EOS ignored, on the same threads; the rounds alternate the system order.
tokens/s = tokens / time of the whole answer, prefill included (llama-speculative-simple: its
own encode + decode time, not its start-up). Prints a table and writes JSON with its provenance
(`--json docs/figures` for `benchmarks/report.py`), with the mean accepted length (tokens per
target step) of every EAGLE-3 system.

llama.cpp's binaries and llama-cpp-python are benchmark-only peers, never app requirements.
The binaries, from the source llama-cpp-python vendors (~12 min on 2 cores):
    pip download llama-cpp-python==0.3.36 --no-deps --no-binary :all: && tar xzf llama_cpp_python-0.3.36.tar.gz
    cd llama_cpp_python-0.3.36 && cmake -S vendor/llama.cpp -B build -DGGML_NATIVE=ON \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=OFF -DCMAKE_BUILD_TYPE=Release \
        && cmake --build build -j 2 --target llama-bench llama-speculative-simple   # -> build/bin
The binding: CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python   # ~15 min on 2 cores
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import re
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from eagle_engine.config import EngineConfig, SamplingParams, TreeParams
from eagle_engine.engine import DEFAULT_HEAD, EagleEngine
from eagle_engine.hardware import native_bf16
from eagle_engine.models.loader import bundled_gguf_path
from eagle_engine.tools import autotune
from eagle_engine.tools.bench import provenance, write_report
from eagle_engine.tools.export_llamacpp import export_llamacpp

Decode = Callable[[list[int]], tuple[int, float | None]]  # ids -> tokens, seconds (None: wall)
LLAMA_BENCH = "llama.cpp llama-bench, plain"  # `benchmarks/report.py` divides by this row
CHAIN = TreeParams.parse("k=1,s=3,n=4,ctx=off")  # llama.cpp's chain of 3 drafts


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


def ours(engine: EagleEngine, head: str | None, n: int, temperature: float, top_p: float,
         steps: list[tuple[int, int]], tree: TreeParams | None = None) -> Decode:
    """Our decoding; appends each answer's (tokens, target steps) to `steps`."""
    params = SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=temperature,
                            top_p=top_p, seed=0)

    def run(ids: list[int]) -> tuple[int, None]:
        result = engine.generate(ids, params, tree, head)
        steps.append((result.stats.step_tokens, result.stats.num_steps))
        return len(result.token_ids), None
    return run


def transformers_generate(dtype: torch.dtype, n: int, temperature: float, top_p: float
                          ) -> Decode:
    from transformers import AutoModelForCausalLM

    gguf = bundled_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
    model.eval()

    @torch.inference_mode()
    def run(ids: list[int]) -> tuple[int, None]:
        sampling = (dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
                    if temperature > 0 else dict(do_sample=False))
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n,
                             pad_token_id=0, **sampling)
        return out.shape[1] - len(ids), None
    return run


def llama_cpp(n: int, threads: int, temperature: float, top_p: float) -> Decode:
    from llama_cpp import Llama

    llm = Llama(model_path=str(bundled_gguf_path()), n_ctx=4096, n_threads=threads,
                n_threads_batch=threads, verbose=False)

    def run(ids: list[int]) -> tuple[int, None]:
        llm.reset()
        count = 0
        sampling = (dict(top_k=0, top_p=top_p, min_p=0.0, temp=temperature) if temperature > 0
                    else dict(top_k=1, top_p=1.0, temp=0.0))
        for _ in llm.generate(ids, reset=True, **sampling):
            count += 1
            if count == n:
                break
        return count, None
    return run


def llama_bench(bin_dir: Path, n: int, threads: int) -> float:
    """llama.cpp's own decoding speed of the GGUF, tokens/s (no prompt, flash attention on)."""
    out = subprocess.run([str(bin_dir / "llama-bench"), "-m", str(bundled_gguf_path()),
                          "-t", str(threads), "-p", "0", "-n", str(n), "-r", "3", "-fa", "1",
                          "-o", "json"], capture_output=True, text=True, check=True)
    return float(json.loads(out.stdout)[0]["avg_ts"])


def llama_eagle(bin_dir: Path, engine: EagleEngine, head_gguf: Path, n: int, threads: int,
                steps: list[tuple[int, int]]) -> Decode:
    """llama.cpp's EAGLE-3 on the prompt's chat text, a chain of `CHAIN.num_steps` drafts; its
    own encode + decode seconds; appends (tokens, drafts accepted + target steps) to `steps`."""
    def run(ids: list[int]) -> tuple[int, float]:
        with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
            f.write(engine.tokenizer.decode(ids) + "\n")  # -f drops one trailing newline
            f.flush()
            out = subprocess.run(
                [str(bin_dir / "llama-speculative-simple"), "-m", str(bundled_gguf_path()),
                 "-md", str(head_gguf), "--spec-type", "draft-eagle3",
                 "--spec-draft-n-max", str(CHAIN.num_steps), "--spec-draft-n-min", "0",
                 "--spec-draft-p-min", "0", "-t", str(threads), "-tb", str(threads),
                 "-c", "4096", "-n", str(n), "--temp", "0", "--top-k", "1", "--ignore-eos",
                 "-f", f.name], capture_output=True, text=True, check=True)
        log = out.stderr + out.stdout
        seconds = sum(float(x) for x in re.findall(r"(?:en|de)coded +\d+ tokens in +([\d.]+)",
                                                   log))
        tokens = int(re.search(r"decoded +(\d+) tokens", log).group(1))
        accepted = int(re.search(r"n_accept += (\d+)", log).group(1))
        # each target step yields one token of its own plus the drafts it accepted
        steps.append((tokens, tokens - accepted))
        return tokens, seconds
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=Path, required=True, help="JSONL rows with 'turns'")
    ap.add_argument("--limit", type=int, default=3, help="questions (each gives 2 turns)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--llama-cpp-bin", type=Path, default=None,
                    help="folder with llama.cpp's llama-bench and llama-speculative-simple")
    ap.add_argument("--json", type=Path, default=None, help="a file, or a folder (docs/figures)")
    args = ap.parse_args()
    origin = provenance()
    sampling = (args.temperature, args.top_p)
    threads = torch.get_num_threads()
    n = args.max_new_tokens
    rows = [json.loads(x) for x in args.prompts.read_text().splitlines() if x.strip()][:args.limit]

    systems: dict[str, Decode] = {}
    steps: dict[str, list[tuple[int, int]]] = {}  # EAGLE-3 systems: (tokens, target steps)
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
        systems[f"ours plain, {label}"] = ours(engine, None, n, *sampling, [])
        name = f"ours EAGLE-3, {label} ({autotune.tree_label(tree)})"
        systems[name] = ours(engine, DEFAULT_HEAD, n, *sampling, steps.setdefault(name, []))
        if weights == "q4" and args.llama_cpp_bin:
            name = f"ours EAGLE-3, {label}, chain of {CHAIN.num_steps}"
            systems[name] = ours(engine, DEFAULT_HEAD, n, *sampling, steps.setdefault(name, []),
                                 CHAIN)
    for dtype in (torch.float32, torch.bfloat16):
        systems[f"transformers.generate, {str(dtype)[6:]}"] = transformers_generate(
            dtype, n, *sampling)
    if importlib.util.find_spec("llama_cpp") is not None:
        systems["llama.cpp (llama-cpp-python), plain"] = llama_cpp(n, threads, *sampling)
    else:
        print('llama-cpp-python is not installed; for the llama.cpp peer run\n'
              '  CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python   # ~15 min on 2 cores')

    workdir = Path(tempfile.mkdtemp(prefix="peers-"))
    bench_rates: list[float] = []
    if args.llama_cpp_bin and args.temperature == 0:
        name = f"llama.cpp EAGLE-3 (llama-speculative-simple), chain of {CHAIN.num_steps}"
        head_gguf = export_llamacpp(DEFAULT_HEAD, workdir / "head.gguf")
        systems[name] = llama_eagle(args.llama_cpp_bin, engines["q4"], head_gguf, n, threads,
                                    steps.setdefault(name, []))
    elif args.llama_cpp_bin:
        print("llama.cpp's binaries run greedy only; skipped with --temperature > 0")

    prompts = conversations(engines["q4"], rows, n)
    for run in systems.values():  # warm-up: lazy inits, first-call allocations
        run(prompts[0][:64])
    for taken in steps.values():
        taken.clear()
    results: dict[str, list[float]] = {name: [] for name in systems}
    for r in range(args.rounds):
        order = list(systems) if r % 2 == 0 else list(reversed(systems))
        spent = {name: [0, 0.0] for name in systems}
        if args.llama_cpp_bin and args.temperature == 0 and r % 2 == 0:
            bench_rates.append(llama_bench(args.llama_cpp_bin, n, threads))
        for ids in prompts:
            for name in order:
                t0 = time.perf_counter()
                tokens, seconds = systems[name](ids)
                spent[name][0] += tokens
                spent[name][1] += time.perf_counter() - t0 if seconds is None else seconds
        if args.llama_cpp_bin and args.temperature == 0 and r % 2 == 1:
            bench_rates.append(llama_bench(args.llama_cpp_bin, n, threads))
        for name, (tokens, seconds) in spent.items():
            results[name].append(round(tokens / seconds, 2))
        print(f"round {r + 1} done", flush=True)

    if bench_rates:
        results[LLAMA_BENCH] = [round(x, 2) for x in bench_rates]
    llama = results.get(LLAMA_BENCH) or results.get("llama.cpp (llama-cpp-python), plain")
    width = max(len(s) for s in results)
    print(f"\n{'system':<{width}}  " + "  ".join(f"round {r + 1:>2}" for r in range(args.rounds))
          + ("  vs llama.cpp" if llama else ""))
    for name, rates in results.items():
        ratio = f"  {sum(rates) / sum(llama):>11.2f}x" if llama else ""
        print(f"{name:<{width}}  " + "  ".join(f"{x:>8.2f}" for x in rates) + ratio)
    report = {"kind": "peers", "provenance": origin, "torch_threads": threads,
              "prompts": len(prompts),
              "max_new_tokens": n, "temperature": args.temperature, "top_p": args.top_p,
              "tokens_per_s": results,
              "accepted_length": {name: round(sum(t for t, _ in s) / sum(k for _, k in s), 3)
                                  for name, s in steps.items() if s}}
    if args.json:
        print(f"wrote {write_report(args.json, report)}")


if __name__ == "__main__":
    main()
