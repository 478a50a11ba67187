"""What the engine streams to its callers (CLI, app, bench): one `StepEvent` per iteration, in
both EAGLE and baseline modes, plus the running statistics. Plain data, no tensors, so events
serialize to JSON as they are. Not here: how the numbers are produced (`run.py`, `scheduler.py`)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields


@dataclass(slots=True)
class TokenSpan:
    token_id: int
    text: str  # exact text this token added to the answer ("" while a character is incomplete)
    kind: str  # "accepted" (the head's draft token, accepted) | "context" (a draft token only
    # the context's suffix match proposed, accepted) | "bonus" (the target's own token after the
    # accepted path) | "target" (baseline/prefill token) | "rejected" (draft, discarded)
    depth: int  # tree depth of an accepted token; 0 for bonus/target tokens
    source: str = ""  # who drafted it: "head" | "context" | "both"; "" for the target's tokens


@dataclass(slots=True)
class TreeNode:
    token_id: int
    text: str
    parent: int  # node index, -1 for the root
    depth: int
    accepted: bool
    score: float  # the draft's probability of the path to this node (1 for the root)
    source: str = "head"  # who proposed it: "head" | "context" | "both" (the root: "head")


@dataclass(slots=True)
class RunStats:
    num_tokens: int = 0
    num_steps: int = 0  # target forwards after prefill (verify steps in EAGLE mode)
    step_tokens: int = 0  # tokens those forwards produced (accepted drafts + bonus)
    accepted_per_depth: list[int] = field(default_factory=list)  # steps accepting >= d drafts
    context_tokens: int = 0  # accepted drafts that only the context proposed
    elapsed_s: float = 0.0  # the engine's time on the request (not the caller's between events)
    prefill_s: float = 0.0
    reused_tokens: int = 0  # prompt tokens restored from the prefix cache instead of prefilled
    phase_s: dict[str, float] = field(default_factory=dict)  # draft / verify / extend / decode
    cpu_s: float = 0.0  # the process's CPU time over `elapsed_s` (every thread's, any work's)
    core_s: float = 0.0  # `elapsed_s` x the engine's threads at the time: the CPU time it asked
    thinned: bool = False  # some steps ran on fewer threads: the machine was busy (`cpu_share`)

    @property
    def tau(self) -> float:
        """Mean accepted length: tokens per target forward (accepted drafts + the bonus)."""
        return self.step_tokens / self.num_steps if self.num_steps else 0.0

    @property
    def cpu_share(self) -> float:
        """The CPU time the process got over what the engine's threads asked for (1.0 with
        nothing measured): well below 1, other work took the cores."""
        return self.cpu_s / self.core_s if self.core_s > 0 else 1.0

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.elapsed_s if self.elapsed_s else 0.0

    def acceptance_per_depth(self) -> list[float]:
        return [a / self.num_steps for a in self.accepted_per_depth] if self.num_steps else []

    def to_dict(self) -> dict:
        """The fields (the list and dict copied) and the derived figures. Built field by field:
        every event carries one, and `asdict`'s recursive deep copy takes 13 us (this: 2 us)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d.update(accepted_per_depth=list(self.accepted_per_depth), phase_s=dict(self.phase_s),
                 tau=self.tau, tokens_per_s=self.tokens_per_s, cpu_share=self.cpu_share,
                 acceptance_per_depth=self.acceptance_per_depth())
        return d


@dataclass(slots=True)
class StepEvent:
    step: int
    mode: str  # "eagle" | "ar"
    tokens: list[TokenSpan]  # emitted this step, in order
    text: str  # text delta (concatenation of the spans' text)
    rejected: list[TokenSpan] = field(default_factory=list)  # draft's continuation past the path
    tree: list[TreeNode] = field(default_factory=list)  # the verified tree, root first
    timings_ms: dict[str, float] = field(default_factory=dict)
    stats: dict = field(default_factory=dict)  # RunStats.to_dict() after this step
    finished: str | None = None  # "eos" | "length" | "stop" | "context" when this is the last
    batch: int = 1  # requests that shared this engine step (the scheduler's batch; 1 alone)

    def to_dict(self) -> dict:
        return asdict(self)
