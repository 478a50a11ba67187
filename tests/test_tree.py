"""Issue 4: tree construction and greedy acceptance on hand-written inputs.

`tree.build_tree` on the worked example of the internals doc (K=2, S=3, N=5) and on random
candidate sets laid out like `draft()` lays them out; every tree must satisfy the structural
invariants (parents first, depth, ancestors, retrieve indices, positions, N nodes, distinct
siblings in draft order, top-scored closed selection). Also `TreeParams` validation, the masks
built from a tree, and `accept_greedy` / `accept_sampled` on a fixed tree.
"""
from __future__ import annotations

import pytest
import torch

from eagle_engine.config import ConfigError, SamplingParams, TreeParams
from eagle_engine.io_struct import DraftTree, EagleVerifyInput
from eagle_engine.kv_cache import causal_mask, tree_mask
from eagle_engine.tree import build_tree
from tests.helpers import accept_greedy, accept_sampled

pytestmark = pytest.mark.usefixtures("torch_single_thread")

ROOT, SEQ = 7, 30


def worked_example() -> DraftTree:
    """Candidates a, b | aa ab ba bb | aaa aab baa bab (frontier after level 2: aa, ba)."""
    scores = [0.6, 0.25, 0.42, 0.12, 0.15, 0.075, 0.336, 0.042, 0.075, 0.03]
    tokens = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    parents = [-1, -1, 0, 0, 1, 1, 2, 2, 4, 4]
    return DraftTree(torch.tensor(scores), torch.tensor(tokens), torch.tensor(parents))


def test_worked_example() -> None:
    vin = build_tree(worked_example(), ROOT, SEQ, TreeParams(
        topk=2, num_steps=3, num_draft_tokens=5, context_drafts=False))
    # selected candidates {a, b, aa, aaa} -> nodes [root, a, b, aa, aaa]
    assert vin.tokens.tolist() == [ROOT, 10, 11, 12, 16]
    assert vin.parents.tolist() == [-1, 0, 0, 1, 3]
    assert vin.depth.tolist() == [0, 1, 1, 2, 3]
    assert vin.positions.tolist() == [30, 31, 31, 32, 33]
    assert vin.scores.tolist() == pytest.approx([1.0, 0.6, 0.25, 0.42, 0.336])
    assert vin.retrieve_indices.tolist() == [[0, -1, -1, -1], [0, 1, -1, -1], [0, 2, -1, -1],
                                             [0, 1, 3, -1], [0, 1, 3, 4]]
    expected = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0],
                             [1, 1, 0, 1, 0], [1, 1, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(vin.ancestors, expected)
    mask = tree_mask(vin.ancestors, SEQ)
    assert mask.shape == (1, 5, SEQ + 5) and bool(mask[0, :, :SEQ].all())
    assert torch.equal(mask[0, :, SEQ:], expected)


def random_draft_tree(K: int, S: int, g: torch.Generator, vocab: int = 50) -> DraftTree:
    """Candidates in `draft()`'s layout: level 1 = [0, K); each later level expands the K best
    paths of the previous one into K children each, ranked by their (random) draft prob."""
    def children() -> tuple[torch.Tensor, torch.Tensor]:
        p = torch.rand(K, generator=g).sort(descending=True).values
        return p / (p.sum() + torch.rand((), generator=g)), torch.randperm(vocab, generator=g)[:K]

    p, tok = children()
    scores, tokens, parents = [p], [tok], [torch.full((K,), -1)]
    frontier, frontier_score, offset = torch.arange(K), p, K
    for _ in range(S - 1):
        level = [children() for _ in range(K)]
        path = frontier_score[:, None] * torch.stack([c[0] for c in level])
        scores.append(path.flatten())
        tokens.append(torch.cat([c[1] for c in level]))
        parents.append(frontier.repeat_interleave(K))
        frontier_score, best = path.flatten().topk(K)
        frontier, offset = offset + best, offset + K * K
    return DraftTree(torch.cat(scores), torch.cat(tokens), torch.cat(parents))


def root_path(parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


SHAPES = [(1, 1, 2), (1, 6, 7), (2, 3, 11), (3, 4, 12), (4, 1, 5), (4, 6, 32), (5, 5, 64),
          (8, 8, 64), (8, 2, 40), (6, 3, 2)]


@pytest.mark.parametrize("K, S, N", SHAPES)
def test_random_trees_satisfy_invariants(K: int, S: int, N: int) -> None:
    g = torch.Generator().manual_seed(K * 100 + S * 10 + N)
    tree = TreeParams(K, S, N, context_drafts=False)  # the head's own tree, num_steps deep
    for _ in range(5):
        drafted = random_draft_tree(K, S, g)
        assert drafted.tokens.numel() == tree.capacity
        vin = build_tree(drafted, ROOT, SEQ, tree)
        parents, tokens, depth = vin.parents.tolist(), vin.tokens.tolist(), vin.depth.tolist()
        assert len(tokens) == N and tokens[0] == ROOT and parents[0] == -1 and depth[0] == 0
        for i in range(1, N):
            assert 0 <= parents[i] < i
            assert depth[i] == depth[parents[i]] + 1 <= S
        assert torch.equal(vin.positions, SEQ + vin.depth)
        width = min(S + 1, N)  # a path never has more nodes than the tree
        assert vin.retrieve_indices.shape == (N, width)
        for i in range(N):
            path = root_path(parents, i)
            assert vin.retrieve_indices[i].tolist() == path + [-1] * (width - len(path))
            assert [j for j in range(N) if vin.ancestors[i, j]] == sorted(path)
        for i in range(1, N):  # siblings: distinct tokens, ordered by draft probability
            sib = [j for j in range(N) if parents[j] == parents[i]]
            assert len({tokens[j] for j in sib}) == len(sib)
        assert_nodes_map_to_candidates(drafted, vin)


def assert_nodes_map_to_candidates(drafted: DraftTree, vin: EagleVerifyInput) -> None:
    """The nodes are the N-1 best-scored candidates (closed under parents) in candidate order,
    carrying their scores; each node's parent is its candidate's parent, and children come in
    decreasing score."""
    N = vin.tokens.numel()
    selected = sorted(drafted.scores.topk(N - 1).indices.tolist())
    assert all(int(drafted.parents[c]) in selected + [-1] for c in selected)
    cand = [-1] + selected
    assert float(vin.scores[0]) == 1.0
    for i in range(1, N):
        assert int(drafted.tokens[cand[i]]) == int(vin.tokens[i])
        assert int(drafted.parents[cand[i]]) == cand[int(vin.parents[i])]
        assert float(vin.scores[i]) == float(drafted.scores[cand[i]])
    for node in range(N):
        kids = [i for i in range(1, N) if int(vin.parents[i]) == node]
        kid_scores = [float(drafted.scores[cand[i]]) for i in kids]
        assert kid_scores == sorted(kid_scores, reverse=True)


@pytest.mark.parametrize("kwargs, message", [
    (dict(topk=2, num_steps=3, num_draft_tokens=12),
     "num_draft_tokens=12 exceeds what topk=2, num_steps=3 can hold: at most 11"),
    (dict(topk=1, num_steps=5, num_draft_tokens=7), "num_draft_tokens=7 exceeds what topk=1, "
                                                    "num_steps=5 can hold: at most 6"),
    (dict(topk=0), "topk must be a positive integer, got 0"),
    (dict(num_steps=-1), "num_steps must be a positive integer, got -1"),
    (dict(num_draft_tokens=1), "num_draft_tokens must be >= 2"),
    (dict(topk=2.0), "topk must be a positive integer, got 2.0"),
    (dict(min_score=1.0), "min_score must be a number in [0, 1), got 1.0"),
    (dict(min_score=-0.1), "min_score must be a number in [0, 1), got -0.1"),
    (dict(min_score="0.1"), "min_score must be a number in [0, 1), got '0.1'"),
    (dict(min_score=float("nan")), "min_score must be a number in [0, 1), got nan"),
])
def test_tree_params_validation(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        TreeParams(**kwargs)
    assert message in str(e.value)


def test_tree_params_capacity_edges() -> None:
    assert TreeParams(2, 3, 11).capacity == 10
    assert TreeParams(1, 5, 6).capacity == 5
    assert TreeParams(8, 8, 64).capacity == 8 + 7 * 64


def test_causal_mask_with_left_padding() -> None:
    mask = causal_mask(3, 2, "cpu", valid_from=torch.tensor([0, 3]))
    assert mask.shape == (2, 3, 5)
    assert mask[0].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert mask[1].tolist() == [[0, 0, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]]


def one_hot_logits(predict: list[int], vocab: int = 20) -> torch.Tensor:
    logits = torch.zeros(len(predict), vocab)
    logits[torch.arange(len(predict)), torch.tensor(predict)] = 30.0
    return logits


@pytest.mark.parametrize("predict, path, bonus", [
    ([10, 12, 5, 16, 9], [0, 1, 3, 4], 9),  # accept a, aa, aaa; bonus after the leaf
    ([11, 3, 4, 5, 6], [0, 2], 4),  # the second sibling b; b has no children
    ([10, 13, 5, 6, 7], [0, 1], 13),  # a accepted, the target wants ab (not in the tree)
    ([19, 1, 2, 3, 4], [0], 19),  # nothing accepted
])
def test_accept_on_fixed_tree(predict: list[int], path: list[int], bonus: int) -> None:
    vin = build_tree(worked_example(), ROOT, SEQ, TreeParams(2, 3, 5))
    logits = one_hot_logits(predict)
    got_path, got_bonus = accept_greedy(vin, logits)
    assert got_path.tolist() == path and got_bonus == bonus
    # sampling a point mass (temperature 1, logit gap 30) walks the same path
    g = torch.Generator().manual_seed(0)
    got_path, got_bonus = accept_sampled(vin, logits, SamplingParams(temperature=1.0), g)
    assert got_path.tolist() == path and got_bonus == bonus
