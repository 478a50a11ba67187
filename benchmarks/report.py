"""Renders the current figures, per machine class, from the JSON the benchmarks write.

    PYTHONPATH=. python benchmarks/report.py            # rewrite docs/benchmarks.md, README table
    PYTHONPATH=. python benchmarks/report.py --check    # exit 1 when either is out of date

Reads every `docs/figures/*.json`: `python -m eagle_engine bench --json docs/figures` (kind
"bench") and `benchmarks/peers.py --json docs/figures` (kind "peers") name their file by kind
and CPU class, so a re-run replaces its figure. Each carries its provenance (class, CPU,
torch, commit, date, command). Writes `docs/benchmarks.md` (every figure, with its command)
and the block between the README's `figures` markers (per class: the peers' tok/s and EAGLE-3
against plain decoding on the full MT-bench).
Not here: measuring (`peers.py`, `eagle_engine/tools/bench.py`).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.peers import LLAMA_BENCH

ROOT = Path(__file__).resolve().parent.parent
FIGURES = ROOT / "docs" / "figures"
BENCHMARKS_MD = ROOT / "docs" / "benchmarks.md"
README = ROOT / "README.md"
START, END = "<!-- figures:start -->", "<!-- figures:end -->"


def load(folder: Path) -> dict[str, dict[str, dict]]:
    """class -> kind -> report."""
    out: dict[str, dict[str, dict]] = {}
    for path in sorted(folder.glob("*.json")):
        report = json.loads(path.read_text())
        out.setdefault(report["provenance"]["class"], {})[report["kind"]] = report
    return out


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def source(report: dict) -> str:
    p = report["provenance"]
    return f"{p['commit']}, {p['date']}, {p['cpu']}, torch {p['torch']}"


def peers_rows(report: dict) -> list[tuple[str, float, str]]:
    """(system, mean tok/s, ratio to llama.cpp's binary or '') fastest first."""
    rates = {name: mean(r) for name, r in report["tokens_per_s"].items()}
    ref = rates.get(LLAMA_BENCH)
    return [(name, rate, f"{rate / ref:.2f}x" if ref else "")
            for name, rate in sorted(rates.items(), key=lambda kv: -kv[1])]


def peers_table(report: dict) -> list[str]:
    rounds = len(next(iter(report["tokens_per_s"].values())))
    head = "| system | tok/s (" + " / ".join(f"round {i + 1}" for i in range(rounds)) + ")"
    lines = [head + " | vs llama.cpp |", "|---|---|---|"]
    for name, _, ratio in peers_rows(report):
        rates = " / ".join(f"{x:.1f}" for x in report["tokens_per_s"][name])
        lines.append(f"| {name} | {rates} | {ratio} |")
    extra = report.get("accepted_length", {})
    if extra:
        lines.append("")
        lines += [f"- {name}: mean accepted length {value:.2f}" for name, value in extra.items()]
    return lines


def mode_name(label: str) -> str:
    """`bench`'s labels ("ar", "eagle[HEAD TREE]", with a weights suffix) as a reader's."""
    if label.startswith("ar"):
        return "plain decoding" + label[2:]
    head, _, tree = label[label.index("[") + 1:-1].partition(" ")
    return f"EAGLE-3{label[5:label.index('[')]}, {head}, {tree}"


def bench_table(report: dict) -> list[str]:
    lines = ["| mode | tok/s | tau | vs plain | same as plain |", "|---|---|---|---|---|"]
    for name, m in report["modes"].items():
        speedup = m.get("speedup_vs_ar")
        lines.append(f"| {mode_name(name)} | {m['tokens_per_s']:.1f} | {m['tau']:.3f} | "
                     f"{'' if speedup is None else f'{speedup:.3f}x'} | "
                     f"{m.get('greedy_same_as_baseline', '')} |")
    return lines


def soak_table(report: dict) -> list[str]:
    c = report["counts"]
    start, peak = report["startup_rss_mb"], report["peak_rss_mb"]
    low, high = report["second_half_rss_mb"]
    return ["| answers | greedy checked / wrong / failed | cancelled / sampled | resident memory, "
            "MB: start-up / peak / second half |", "|---|---|---|---|",
            f"| {c['done']:,} in {report['seconds']:.0f} s | {c['checked']:,} / {c['wrong']} / "
            f"{c['failed']} | {c['cancelled']:,} / {c['sampled']:,} | {start:.0f} / {peak:.0f} "
            f"(start-up + {peak - start:.0f}) / {low:.0f}-{high:.0f} |"]


def host_time_table(report: dict) -> list[str]:
    lines = ["| mode | iterations | us per iteration | phases, us | rest, us |",
             "|---|---|---|---|---|"]
    for mode in [k for k, v in report.items() if isinstance(v, dict) and "wall_us" in v]:
        m = report[mode]
        phases = ", ".join(f"{k} {v:.0f}" for k, v in m["phases_us"].items())
        lines.append(f"| {mode} | {m['iterations']} | {m['wall_us']:.0f} | {phases} | "
                     f"{m['rest_us']:.0f} |")
    return lines


def estimate_table(report: dict) -> list[str]:
    lines = ["| load | prompt | tokens | estimate | measured | error |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['load']} | {r['prompt']} | {r['tokens']} | {r['estimate']:.2f}x | "
              f"{r['measured']:.2f}x | {100 * r['error']:+.1f}% |" for r in report["rows"]]
    lines += ["", "| load | mean error | largest error |", "|---|---|---|"]
    lines += [f"| {load} | {100 * s['mean_abs_error']:.1f}% | {100 * s['max_abs_error']:.1f}% |"
              for load, s in report["summary"].items()]
    return lines


def contention_table(report: dict) -> list[str]:
    """Per system, its median tok/s under each load, with its share of its quiet median and
    its lowest round's share."""
    loads = list(report["loads"])
    lines = ["| system | " + " | ".join(loads) + " |", "|---" * (len(loads) + 1) + "|"]
    for name in report["loads"][loads[0]]:
        cells = []
        for load in loads:
            r = report["loads"][load][name]
            cells.append(f"{r['median']:.1f}" if load == loads[0] else
                         f"{r['median']:.1f} ({r['median_share']:.2f}; lowest "
                         f"{r['lowest_share']:.2f})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def cost_model_table(report: dict) -> list[str]:
    lines = ["| build | one-token forward | its read bound | verify 4 / 8 / 16 rows | "
             "a row past 8 | of the int8 peak | draft step (warm) | extend (warm) |",
             "|---|---|---|---|---|---|---|---|"]
    for build, b in report["builds"].items():
        v = b["verify_vs_1"]
        lines.append(
            f"| {build} | {b['forward_ms']:.2f} ms | {100 * b['bound_share']:.0f}% | "
            f"{v['4']:.2f} / {v['8']:.2f} / {v['16']:.2f} | {b['row_ms']:.2f} ms, "
            f"{b['row_gmacs']:.0f} GMAC/s | {100 * b['row_peak_share']:.0f}% | "
            f"{b['draft_step_vs_1']:.3f} ({b['draft_step_warm_vs_1']:.3f}) | "
            f"{b['extend_vs_1']:.3f} ({b['extend_warm_vs_1']:.3f}) |")
    return lines


def describe(report: dict) -> str:
    kind = report["kind"]
    if kind == "cost_model":
        return (f"the q4 target at {report['context']} tokens of context and head "
                f"{report['head']}, medians of {report['rounds']} interleaved rounds; the read "
                f"bound streams the forward's {report['bytes_mb']} MB in "
                f"{report['bound_ms']} ms; the int8 peak is {report['peak_gmacs']} GMAC/s, a row "
                f"{report['row_macs_m']}M multiply-adds; verify, draft step and extend in "
                "one-token forwards, draft and extend right after a target forward (warm: back "
                "to back); each build's row names the compiler flags it adds")
    if kind == "peers":
        sampling = ("greedy" if report["temperature"] == 0 else
                    f"temperature {report['temperature']}, top-p {report['top_p']}")
        return (f"{report['prompts']} MT-bench turns, {report['max_new_tokens']} tokens each, "
                f"{sampling}; ours and transformers time whole answers with their prefill, "
                "llama-bench times decoding alone")
    if kind.startswith("soak"):
        a = report["args"]
        return (f"`app.py` with {' '.join(a['app_args']) or 'its defaults'}; {a['visitors']} "
                f"visitors, each answer from a new session, {a['max_new_tokens']} tokens")
    if kind == "host_time":
        return (f"a tiny random target and head on one CPU thread, {report['tokens']} tokens, "
                f"EAGLE-3 tree {report['tree']}: the host's time per iteration, on the graph "
                "path with free replays (a GPU's host work) and on the eager path")
    if kind == "contention":
        quiet = next(iter(report["loads"].values()))
        rounds = len(next(iter(quiet.values()))["rounds"])
        return (f"decoding tokens/s of {report['tokens']}-token answers on "
                f"{report['threads']} threads while other processes spin on the cores, the "
                f"median of {rounds} rounds (its share of the quiet median; the lowest "
                "round's share); ours with the thread governor and without it (every step on "
                f"every thread), EAGLE-3 with tree {report['tree']}")
    if kind == "speedup_estimate":
        return (f"the app's speedup estimate against the speedup its race measured, "
                f"{report['weights']} weights, tree {report['tree']}, {report['tokens']} tokens, "
                "greedy; loads: none, a busy process per core (busy), headless Chromium on the "
                "page (browser)")
    s = report["sampling"]
    sampling = "greedy" if s["temperature"] == 0 else f"temperature {s['temperature']}"
    return (f"{report['rows']} MT-bench questions, both turns, {report['max_new_tokens']} tokens, "
            f"{sampling}, {report['weights']} weights")


KINDS = {  # kind (or its first word) -> title, table; in this order
    "peers": ("Against the tools a visitor already has", peers_table),
    "bench": ("EAGLE-3 against our own plain decoding", bench_table),
    "soak": ("Memory through many visitors", soak_table),
    "cost_model": ("Where an iteration's time goes", cost_model_table),
    "host_time": ("The host's time per iteration", host_time_table),
    "speedup_estimate": ("The speedup estimate against the measured speedup", estimate_table),
    "contention": ("Under load: other processes on the cores", contention_table),
}


def kind_of(kind: str) -> str:
    return kind.split()[0]


def benchmarks_md(figures: dict[str, dict[str, dict]]) -> str:
    lines = ["# Current figures", "",
             "Generated by `PYTHONPATH=. python benchmarks/report.py` from `docs/figures/*.json`;",
             "each figure names the command that measures it again. Findings of earlier runs, and",
             "what was tried and dropped, are in `docs/history.md`.", ""]
    for cls in sorted(figures):
        lines += [f"## {cls}", ""]
        for kind in sorted(figures[cls], key=lambda k: (list(KINDS).index(kind_of(k)), k)):
            report = figures[cls][kind]
            title, table = KINDS[kind_of(kind)]
            lines += [f"### {title}", "", f"{describe(report)}. {source(report)}.", "",
                      "```bash", report["provenance"]["command"], "```", "", *table(report), ""]
    return "\n".join(lines).rstrip() + "\n"


def in_readme(system: str) -> bool:
    """The README's peers table keeps our q4 rows and every peer's; the dense rows are in
    docs/benchmarks.md."""
    return not system.startswith("ours") or ", q4" in system


def readme_block(figures: dict[str, dict[str, dict]]) -> str:
    """Per class, one table: the peers' tok/s, then EAGLE-3 against plain on the full set."""
    lines = []
    for cls in sorted(figures):
        kinds = figures[cls]
        lines += [f"**{cls}**", ""]
        if "peers" in kinds:
            p = kinds["peers"]
            lines += [f"{describe(p)} ({p['provenance']['commit']}, {p['provenance']['date']}):",
                      "", "```bash", p["provenance"]["command"], "```", "",
                      "| system | tok/s | vs llama.cpp |", "|---|---|---|"]
            lines += [f"| {name} | {rate:.1f} | {ratio} |" for name, rate, ratio in peers_rows(p)
                      if in_readme(name)]
            lines.append("")
        if "bench" in kinds:
            b = kinds["bench"]
            lines += [f"{describe(b)} ({b['provenance']['commit']}, {b['provenance']['date']}):",
                      "", "```bash", b["provenance"]["command"], "```", "", *bench_table(b), ""]
        if "contention" in kinds:
            c = kinds["contention"]
            lines += [f"Under load: {describe(c)} ({c['provenance']['commit']}, "
                      f"{c['provenance']['date']}):", "", "```bash",
                      c["provenance"]["command"], "```", "", *contention_table(c), ""]
    return "\n".join(lines).rstrip()


def with_block(readme: str, block: str) -> str:
    if START not in readme or END not in readme:
        raise SystemExit(f"README.md has no {START} ... {END} block")
    head, rest = readme.split(START, 1)
    return f"{head}{START}\n{block}\n{END}{rest.split(END, 1)[1]}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 when a file is out of date")
    p.add_argument("--figures", type=Path, default=FIGURES)
    args = p.parse_args(argv)
    figures = load(args.figures)
    wanted = {BENCHMARKS_MD: benchmarks_md(figures),
              README: with_block(README.read_text(), readme_block(figures))}
    stale = [path for path, text in wanted.items()
             if not path.is_file() or path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"{path.relative_to(ROOT)} is out of date: run benchmarks/report.py",
                  file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.write_text(wanted[path])
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
