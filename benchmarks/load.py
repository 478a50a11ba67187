"""How much faster does the playground answer many visitors with the scheduler than with
today's serial queue, and does any answer change?

One run starts `app.py` twice on loopback, one after the other, each on its own free port:
`serial` (`--max-batch 1 --prefix-cache-mb 0`: one request at a time, every turn prefilled in
full, as the app answered before the scheduler) and `scheduler` (`--max-batch B`, KV reuse
across turns on). Against each, N simulated visitors (one `gradio_client.Client` each, so one
Gradio session each) ask Q questions as conversations (MT-bench turns, greedy, EAGLE-3 with the
app's default head and the tree `--tree`: by default k1 s1 n2, the tree `tune` measured fastest
on the 2-core AVX2 EPYC; the servers start with `--no-tune`), all at once. Per server it reports the total time, answers per
second, p50 / p95 time to first token (the first streamed frame) and per-answer latency; the
server's resident memory (VmRSS) before, during and after, and over `--memory-answers` further
answers; then one visitor's `--turns`-turn conversation alone, with each turn's time to first
token and the prompt tokens it reused. Every greedy answer of the scheduler must equal the same
visitor's answer on the serial server (each there ran alone): no cross-talk.
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


def memory_run(server: Server, conversations: list[list[str]], answers: int,
               max_new_tokens: int, tree: tuple[int, int, int], deadline: float
               ) -> list[dict[str, float]]:
    """Further rounds of all visitors until `answers` more answers (or the deadline): the
    server's RSS after each round."""
    done, rounds = 0, []
    while done < answers and time.perf_counter() < deadline:
        _, got = visitors(server, conversations, max_new_tokens, tree)
        done += sum(len(c) for c in got)
        rounds.append({"answers": done, "rss_mb": server.rss()})
    return rounds


def load_conversations(visitors_n: int, questions: int, turns: int
                       ) -> tuple[list[list[str]], list[str]]:
    rows = [json.loads(line)["turns"] for line in PROMPTS.read_text().splitlines()
            ] if PROMPTS.is_file() else FALLBACK
    convs = [(rows[i % len(rows)] * questions)[:questions] for i in range(visitors_n)]
    long_turns = [t for r in rows[visitors_n:visitors_n + turns] for t in r][:turns]
    return convs, long_turns


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--visitors", type=int, default=8)
    p.add_argument("--questions", type=int, default=2, help="turns per visitor")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--batch", type=int, default=4, help="the scheduler's --max-batch")
    p.add_argument("--tree", default="1,1,2", help="topk,num_steps,num_draft_tokens")
    p.add_argument("--turns", type=int, default=5, help="the lone conversation's turns")
    p.add_argument("--memory-answers", type=int, default=32,
                   help="further answers on the scheduler, RSS after each round")
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--max-seconds", type=float, default=1500, help="bound for the whole run")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if not (1 <= args.visitors <= 32 and 1 <= args.questions <= 4):
        raise SystemExit("--visitors must be in [1, 32] and --questions in [1, 4]")
    deadline = time.perf_counter() + args.max_seconds
    tree = tuple(int(v) for v in args.tree.split(","))
    convs, long_turns = load_conversations(args.visitors, args.questions, args.turns)
    log_dir = Path(os.environ.get("TMPDIR", "/tmp"))
    common = ["--max-len", str(args.max_len), "--single-weights", "--no-tune"]
    modes = {"serial": ["--max-batch", "1", "--prefix-cache-mb", "0"],
             "scheduler": ["--max-batch", str(args.batch)]}
    report: dict[str, Any] = {"args": vars(args) | {"out": str(args.out)},
                              "cpu": os.cpu_count(), "date": time.strftime("%Y-%m-%d")}
    answers: dict[str, list[list[dict[str, Any]]]] = {}
    for name, extra in modes.items():
        server = Server(name, common + extra, log_dir, ready_s=600)
        try:
            rss_idle = server.rss()
            wall, answers[name] = visitors(server, convs, args.max_new_tokens, tree)
            result = summary(wall, answers[name])
            result |= {"start_s": server.start_s, "rss_idle_mb": rss_idle,
                       "rss_peak_mb": max(r for _, r in server.samples),
                       "rss_after_mb": server.rss()}
            result["alone"] = conversation_alone(server, long_turns, args.max_new_tokens, tree)
            if name == "scheduler":
                result["memory"] = memory_run(server, convs, args.memory_answers,
                                              args.max_new_tokens // 2, tree, deadline)
            report[name] = result
        finally:
            server.stop()
        print(json.dumps({name: {k: v for k, v in report[name].items() if k != "alone"}},
                         indent=1), flush=True)
        if time.perf_counter() > deadline:
            raise SystemExit("--max-seconds passed")
    same = [[a["text"] == b["text"] for a, b in zip(sa, ba)]
            for sa, ba in zip(answers["serial"], answers["scheduler"])]
    report["greedy_equal"] = f"{sum(map(sum, same))}/{sum(map(len, same))}"
    report["total_ratio"] = report["scheduler"]["total_s"] / report["serial"]["total_s"]
    report["turn_ttft_s"] = {name: [t["ttft_s"] for t in report[name]["alone"]]
                             for name in modes}
    report["turn_reused"] = {name: [t["reused_tokens"] for t in report[name]["alone"]]
                             for name in modes}
    print(json.dumps({k: report[k] for k in ("greedy_equal", "total_ratio", "turn_ttft_s",
                                             "turn_reused")}, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
