"""How much faster does the playground answer many visitors with the scheduler than with
today's serial queue, and does any answer change?

One run starts `app.py` twice on loopback, each on its own free port: `serial`
(`--max-batch 1 --prefix-cache-mb 0`: one request at a time, every turn prefilled in full, as
the app answered before the scheduler) and `scheduler` (`--max-batch B`, KV reuse across turns
on). Both stay up (an idle server costs no CPU) and take turns, `--rounds` times in alternating
order, so that load from elsewhere on a shared machine falls on both alike. In a round, N
simulated visitors (one `gradio_client.Client` each, so one Gradio session each) ask Q
questions as conversations, all at once (MT-bench turns, a different slice of questions each
round, so no round reuses another's cached rows; greedy, EAGLE-3 with the app's default head
and the tree `--tree`: by default k1 s1 n2, the tree `tune` measured fastest on the 2-core
AVX2 EPYC; the servers start with `--no-tune`). Per server it reports the total time, answers
per second, p50 / p95 time to first token (the first streamed frame) and per-answer latency,
and its resident memory (VmRSS); then, per server, one visitor's `--turns`-turn conversation
alone, with each turn's time to first token and the prompt tokens it reused; last, the
scheduler's RSS over `--memory-answers` further answers. Every greedy answer of the scheduler
must equal the same visitor's answer on the serial server (each there ran alone): no
cross-talk.
Bounded: N <= 32 visitors, Q <= 4 questions, and `--max-seconds` for the whole run.

    PYTHONPATH=. python benchmarks/load.py --visitors 8 --questions 2 --batch 4 --out load.json
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from eagle_engine.config import TreeParams

REPO = Path(__file__).resolve().parent.parent
PROMPTS = REPO.parent / "shared" / "data" / "prompts" / "mtbench.jsonl"
CHAT_OUT = {"chat": 1, "status": 2, "run": 8}  # indices of /chat's outputs (tests/test_app_api)
FALLBACK = [["Write a haiku about the sea.", "Now make it about a mountain."],
            ["What is the capital of France?", "And of Italy?"],
            ["Give me three tips for staying productive.", "Explain the second tip more."],
            ["Write a Python function that reverses a string.", "Add a docstring to it."]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Server:
    """`python app.py` on a loopback port, with a thread sampling its resident memory."""

    def __init__(self, name: str, args: list[str], log_dir: Path, ready_s: float) -> None:
        self.name, self.port = name, free_port()
        self.log = log_dir / f"app_{name}.log"
        env = {**os.environ, "GRADIO_SERVER_NAME": "127.0.0.1",
               "GRADIO_SERVER_PORT": str(self.port), "GRADIO_ANALYTICS_ENABLED": "False"}
        with self.log.open("w") as out:
            self.proc = subprocess.Popen([sys.executable, str(REPO / "app.py"), *args], cwd=REPO,
                                         env=env, stdout=out, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}/"
        t0 = time.perf_counter()
        while not self._ready():
            if self.proc.poll() is not None or time.perf_counter() - t0 > ready_s:
                self.stop()
                raise SystemExit(f"{name}: app.py did not start; see {self.log}")
            time.sleep(0.5)
        self.start_s = time.perf_counter() - t0
        self.samples: list[tuple[float, float]] = []  # (time, VmRSS MB)
        self._sampling = True
        threading.Thread(target=self._sample, daemon=True).start()

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.url, timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def _sample(self) -> None:
        while self._sampling and self.proc.poll() is None:
            self.samples.append((time.perf_counter(), rss_mb(self.proc.pid)))
            time.sleep(0.25)

    def rss(self) -> float:
        return rss_mb(self.proc.pid)

    def client(self) -> Any:
        from gradio_client import Client

        return Client(self.url, analytics_enabled=False, verbose=False)

    def stop(self) -> None:
        self._sampling = False
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def ask(client: Any, question: str, max_new_tokens: int, tree: tuple[int, int, int]
        ) -> dict[str, Any]:
    """One chat turn, streamed: time to the first frame, to the last, and the answer."""
    t0 = time.perf_counter()
    job = client.submit(question, max_new_tokens=max_new_tokens, temperature=0.0,
                        topk=tree[0], num_steps=tree[1], num_draft_tokens=tree[2],
                        api_name="/chat")
    ttft = None
    for _ in job:  # each streamed frame
        if ttft is None:
            ttft = time.perf_counter() - t0
    final = job.result()
    latency = time.perf_counter() - t0
    run = final[CHAT_OUT["run"]]
    stats = run["stats"]
    return {"ttft_s": ttft if ttft is not None else latency, "latency_s": latency,
            "text": run["text"], "tokens": stats["num_tokens"],
            "reused_tokens": stats.get("reused_tokens", 0), "prefill_s": stats["prefill_s"],
            "status": final[CHAT_OUT["status"]]}


def visitors(server: Server, conversations: list[list[str]], max_new_tokens: int,
             tree: tuple[int, int, int]) -> tuple[float, list[list[dict[str, Any]]]]:
    """All visitors at once, each its conversation turn by turn -> (wall time, answers)."""
    clients = [server.client() for _ in conversations]
    answers: list[list[dict[str, Any]]] = [[] for _ in conversations]
    errors: list[BaseException] = []

    def visit(i: int) -> None:
        try:
            for question in conversations[i]:
                answers[i].append(ask(clients[i], question, max_new_tokens, tree))
        except BaseException as e:  # noqa: BLE001 - reported after the run
            errors.append(e)
    threads = [threading.Thread(target=visit, args=(i,)) for i in range(len(conversations))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t0, answers


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


def summary(wall: float, answers: list[list[dict[str, Any]]]) -> dict[str, Any]:
    flat = [a for conv in answers for a in conv]
    ttft, latency = [a["ttft_s"] for a in flat], [a["latency_s"] for a in flat]
    return {"answers": len(flat), "total_s": wall, "answers_per_s": len(flat) / wall,
            "tokens": sum(a["tokens"] for a in flat),
            "ttft_p50_s": statistics.median(ttft), "ttft_p95_s": percentile(ttft, 0.95),
            "latency_p50_s": statistics.median(latency),
            "latency_p95_s": percentile(latency, 0.95),
            "batched_status": sum("shared by up to" in a["status"] for a in flat)}


def conversation_alone(server: Server, turns: list[str], max_new_tokens: int,
                       tree: tuple[int, int, int]) -> list[dict[str, Any]]:
    client = server.client()
    return [{k: a[k] for k in ("ttft_s", "latency_s", "reused_tokens", "prefill_s", "tokens")}
            for a in (ask(client, q, max_new_tokens, tree) for q in turns)]


def memory_run(server: Server, rows: list[list[str]], visitors_n: int, questions: int,
               offset: int, answers: int, max_new_tokens: int, tree: tuple[int, int, int],
               deadline: float) -> list[dict[str, float]]:
    """Further rounds of all visitors, new questions each round (so the prefix cache fills
    and evicts), until `answers` more answers or the deadline: the server's RSS after each."""
    done, rounds = 0, []
    while done < answers and time.perf_counter() < deadline:
        convs = load_conversations(rows, visitors_n, questions, offset + len(rounds) * visitors_n)
        _, got = visitors(server, convs, max_new_tokens, tree)
        done += sum(len(c) for c in got)
        rounds.append({"answers": done, "rss_mb": server.rss()})
    return rounds


def load_conversations(rows: list[list[str]], visitors_n: int, questions: int, offset: int
                       ) -> list[list[str]]:
    return [(rows[(offset + i) % len(rows)] * questions)[:questions] for i in range(visitors_n)]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--visitors", type=int, default=8)
    p.add_argument("--questions", type=int, default=2, help="turns per visitor")
    p.add_argument("--rounds", type=int, default=2, help="rounds per server, alternating")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--batch", type=int, default=4, help="the scheduler's --max-batch")
    p.add_argument("--tree", default="k=1,s=1,n=2", help="the tree's k, s and n (TreeParams.parse)")
    p.add_argument("--turns", type=int, default=5, help="the lone conversation's turns")
    p.add_argument("--memory-answers", type=int, default=48,
                   help="further answers on the scheduler, RSS after each round")
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--max-seconds", type=float, default=1800, help="bound for the whole run")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if not (1 <= args.visitors <= 32 and 1 <= args.questions <= 4 and 1 <= args.rounds <= 4):
        raise SystemExit("--visitors must be in [1, 32], --questions in [1, 4], --rounds in "
                         "[1, 4]")
    deadline = time.perf_counter() + args.max_seconds
    parsed = TreeParams.parse(args.tree)
    tree = (parsed.topk, parsed.num_steps, parsed.num_draft_tokens)  # the app's sliders
    rows = [json.loads(line)["turns"] for line in PROMPTS.read_text().splitlines()
            ] if PROMPTS.is_file() else FALLBACK
    log_dir = Path(os.environ.get("TMPDIR", "/tmp"))
    common = ["--max-len", str(args.max_len), "--single-weights", "--no-tune"]
    modes = {"serial": ["--max-batch", "1", "--prefix-cache-mb", "0"],
             "scheduler": ["--max-batch", str(args.batch)]}
    report: dict[str, Any] = {"args": vars(args) | {"out": str(args.out)},
                              "cpu": os.cpu_count(), "date": time.strftime("%Y-%m-%d")}
    servers = {}
    try:
        for name, extra in modes.items():
            servers[name] = Server(name, common + extra, log_dir, ready_s=600)
        report["rss_idle_mb"] = {name: s.rss() for name, s in servers.items()}
        rounds: dict[str, list] = {name: [] for name in modes}
        same, total = 0, 0
        for r in range(args.rounds):
            convs = load_conversations(rows, args.visitors, args.questions, r * args.visitors)
            answers = {}
            for name in (list(modes) if r % 2 == 0 else list(modes)[::-1]):
                wall, answers[name] = visitors(servers[name], convs, args.max_new_tokens, tree)
                rounds[name].append(summary(wall, answers[name]))
                print(json.dumps({f"round {r} {name}": rounds[name][-1]}), flush=True)
                if time.perf_counter() > deadline:
                    raise SystemExit("--max-seconds passed")
            pairs = [(a["text"], b["text"]) for sa, ba in zip(answers["serial"],
                                                              answers["scheduler"])
                     for a, b in zip(sa, ba)]
            same += sum(a == b for a, b in pairs)
            total += len(pairs)
        for name in modes:
            flat = rounds[name]
            report[name] = {"rounds": flat, "total_s": sum(x["total_s"] for x in flat),
                            "answers": sum(x["answers"] for x in flat),
                            "ttft_p95_s": [x["ttft_p95_s"] for x in flat],
                            "start_s": servers[name].start_s,
                            "rss_peak_mb": max(v for _, v in servers[name].samples),
                            "rss_after_mb": servers[name].rss()}
        lone = rows[(args.rounds * args.visitors) % len(rows):][:args.turns]
        lone_turns = [t for pair in lone for t in pair][:args.turns]
        for name in modes:
            report[name]["alone"] = conversation_alone(servers[name], lone_turns,
                                                       args.max_new_tokens, tree)
        report["scheduler"]["memory"] = memory_run(
            servers["scheduler"], rows, args.visitors, args.questions,
            args.rounds * args.visitors + args.turns, args.memory_answers,
            args.max_new_tokens // 2, tree, deadline)
    finally:
        for server in servers.values():
            server.stop()
    report["greedy_equal"] = f"{same}/{total}"
    report["total_ratio"] = report["scheduler"]["total_s"] / report["serial"]["total_s"]
    report["turn_ttft_s"] = {name: [t["ttft_s"] for t in report[name]["alone"]]
                             for name in modes}
    report["turn_reused"] = {name: [t["reused_tokens"] for t in report[name]["alone"]]
                             for name in modes}
    keys = ("greedy_equal", "total_ratio", "turn_ttft_s", "turn_reused", "rss_idle_mb")
    print(json.dumps({k: report[k] for k in keys} | {
        name: {k: v for k, v in report[name].items() if k not in ("rounds", "alone")}
        for name in modes}, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
