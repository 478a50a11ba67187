"""Issue 2: `chat.IncrementalDetokenizer` with the real SmolLM2 tokenizer (byte-level BPE, so
emoji and CJK characters are split over several tokens): the deltas concatenate to the full
decode, a partial UTF-8 character is never emitted as U+FFFD, stop strings cut the text exactly
even when they span tokens, and `flush` releases the text held back for a possible stop."""
from __future__ import annotations

import pytest
import torch

from eagle_engine.chat import IncrementalDetokenizer, encode_chat

pytestmark = pytest.mark.usefixtures("torch_single_thread")

REPLACEMENT = "\ufffd"
TEXTS = [
    "Hello  world,  héllo wörld!  tabs\tand\nnewlines ... don't  .",
    "你好，世界。今天天气很好！",
    "emoji 🙂👍🏽 family: 👨‍👩‍👧 flag 🇫🇷 end",
    " leading space, trailing space ",
    "mixed: naïve café — 東京 🚀 x² ∑",
]


def feed(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.add([i]) for i in ids]


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_full_decode(smol_tokenizer: object, text: str) -> None:
    ids = smol_tokenizer.encode(text, add_special_tokens=False)
    assert smol_tokenizer.decode(ids) == text
    detok = IncrementalDetokenizer(smol_tokenizer)
    deltas = feed(detok, ids)
    assert all(REPLACEMENT not in d for d in deltas)
    assert "".join(deltas) == text and detok.flush() == ""
    if any(ord(c) > 0x7FF for c in text):  # some characters really were split over tokens
        assert "" in deltas


@pytest.mark.parametrize("text", TEXTS[1:3])
def test_deltas_are_prompt(smol_tokenizer: object, text: str) -> None:
    """Each character is emitted by the token that completes it, not later."""
    ids = smol_tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(smol_tokenizer)
    for k in range(1, len(ids) + 1):
        delta = detok.add(ids[k - 1:k])
        complete = smol_tokenizer.decode(ids[:k])
        if not complete.endswith(REPLACEMENT):
            assert detok.text == complete, (k, delta)


def test_multi_token_adds(smol_tokenizer: object) -> None:
    text = TEXTS[2] + TEXTS[1]
    ids = smol_tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(smol_tokenizer)
    chunks = [ids[i:i + 3] for i in range(0, len(ids), 3)]
    assert "".join(detok.add(c) for c in chunks) == text


@pytest.mark.parametrize("seed", range(4))
def test_random_token_streams(smol_tokenizer: object, seed: int) -> None:
    """Arbitrary ids (invalid byte sequences, specials): the output is the full decode up to
    any trailing incomplete character, which is held back rather than emitted as U+FFFD."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, len(smol_tokenizer), (300,), generator=g).tolist()
    ids[10:10] = smol_tokenizer.encode("🙂", add_special_tokens=False)[:1]  # a split character
    detok = IncrementalDetokenizer(smol_tokenizer)
    out = "".join(feed(detok, ids)) + detok.flush()
    full = smol_tokenizer.decode(ids, skip_special_tokens=True)
    assert full.startswith(out) and set(full[len(out):]) <= {REPLACEMENT}
    assert len(full) - len(out) <= 3


def test_stream_cut_inside_a_character(smol_tokenizer: object) -> None:
    ids = smol_tokenizer.encode("ab🙂🙂", add_special_tokens=False)
    assert smol_tokenizer.decode(ids[:-1]) == "ab🙂" + REPLACEMENT
    detok = IncrementalDetokenizer(smol_tokenizer)
    out = "".join(feed(detok, ids[:-1])) + detok.flush()
    assert out == "ab🙂"
    assert detok.add(ids[-1:]) == "🙂"


def test_special_tokens_are_skipped(smol_tokenizer: object) -> None:
    ids = smol_tokenizer.encode("hi there", add_special_tokens=False)
    detok = IncrementalDetokenizer(smol_tokenizer)
    stream = [ids[0], smol_tokenizer.eos_token_id, *ids[1:]]
    assert "".join(feed(detok, stream)) == "hi there"


@pytest.mark.parametrize("text, stop, expected", [
    ("Hello world, héllo wörld! again", ("wörld",), "Hello world, héllo "),
    ("你好，世界。再见", ("世界",), "你好，"),
    ("ok 🙂👍🏽 done", ("👍",), "ok 🙂"),
    ("one two three four", ("three", "two"), "one "),
    ("STOP right there", ("STOP",), ""),
    ("a line\n\nnext paragraph", ("\n\n",), "a line"),
])
def test_stop_strings(smol_tokenizer: object, text: str, stop: tuple[str, ...],
                      expected: str) -> None:
    ids = smol_tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(smol_tokenizer, stop)
    deltas = feed(detok, ids)
    assert detok.stopped
    assert "".join(deltas) + detok.flush() == expected
    assert detok.add(ids[:2]) == "" and detok.flush() == ""
    assert all(REPLACEMENT not in d for d in deltas)


def test_stop_prefix_is_held_then_released(smol_tokenizer: object) -> None:
    """Text that could begin a stop string is held back; it is released when it turns out not
    to be the stop, and by `flush` when generation ends first."""
    ids = smol_tokenizer.encode("the cat sat on the ca", add_special_tokens=False)
    detok = IncrementalDetokenizer(smol_tokenizer, ("cab",))
    deltas = feed(detok, ids)
    assert not detok.stopped
    assert "".join(deltas) == "the cat sat on the "
    assert detok.flush() == "ca" and detok.flush() == ""
    text = ""
    for delta, k in zip(deltas, range(1, len(ids) + 1)):
        text += delta
        decoded = smol_tokenizer.decode(ids[:k])
        assert decoded.startswith(text) and len(decoded) - len(text) <= 2  # hold < len(stop)


def test_chat_template_prompt(smol_tokenizer: object) -> None:
    ids = encode_chat(smol_tokenizer, [{"role": "user", "content": "Hi 🙂"}])
    text = smol_tokenizer.decode(ids)
    assert text.rstrip().endswith("assistant") and "Hi 🙂" in text
    assert all(isinstance(i, int) for i in ids)
