"""The training pipeline end to end in its --quick configuration (a test of the pipeline, not
of head quality): data, features, vocab, TTT training, export in the HF EAGLE-3 format, and the
exported head loads into the engine and keeps greedy parity with the baseline."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from eagle_engine.cli import main
from eagle_engine.config import EngineConfig, SamplingParams, TreeParams
from eagle_engine.engine import EagleEngine
from eagle_engine.train.trainer import ttt_attention

DATA = Path(__file__).parent / "data" / "prompts_small.jsonl"


def test_quick_pipeline(tmp_path: Path) -> None:
    out, work = tmp_path / "head", tmp_path / "work"
    assert main(["train", "--quick", "--prompts", str(DATA), "--out", str(out),
                 "--work-dir", str(work)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["draft_vocab_size"] == 512 and cfg["eagle_config"]["use_aux_hidden_state"]
    assert (out / "training.png").stat().st_size > 1000
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert log and all(len(r["step_acc"]) == 3 for r in log)
    rows = (work / "responses.jsonl").read_text().splitlines()
    assert len(rows) == 6
    engine = EagleEngine.load(EngineConfig(drafts=(str(out),), dtype="fp32", max_len=512))
    prompt = engine.encode("Name three colors.")
    params = SamplingParams(max_new_tokens=16)
    base = engine.generate(prompt, params)
    spec = engine.generate(prompt, params, TreeParams(4, 3, 8), head="head")
    assert spec.token_ids == base.token_ids


def test_ttt_attention_matches_explicit_mask() -> None:
    """The TTT attention equals plain attention over [causal step-0 keys | own chain keys]."""
    torch.manual_seed(0)
    B, H, KVH, T, d = 2, 4, 2, 5, 8
    q = torch.randn(B, H, T, d)
    keys = [torch.randn(B, KVH, T, d) for _ in range(3)]
    values = [torch.randn(B, KVH, T, d) for _ in range(3)]
    out = ttt_attention(q, keys, values)
    g = H // KVH
    for b in range(B):
        for h in range(H):
            for t in range(T):
                ks = torch.cat([keys[0][b, h // g, :t + 1]] + [k[b, h // g, t:t + 1]
                                                             for k in keys[1:]])
                vs = torch.cat([values[0][b, h // g, :t + 1]] + [v[b, h // g, t:t + 1]
                                                               for v in values[1:]])
                w = torch.softmax(ks @ q[b, h, t] / d ** 0.5, 0)
                torch.testing.assert_close(out[b, h, t], w @ vs, rtol=1e-5, atol=1e-5)
