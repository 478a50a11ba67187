"""`export-llamacpp` writes what llama.cpp's own converter writes for the default head: the
same metadata (keys, types, values; the tokenizer's arrays by digest) and the same tensors
(names, types, shapes, bytes), against `tests/data/llamacpp_eagle3_head.json`, which describes
the file llama.cpp's converter wrote (the command is in the fixture). A head llama.cpp's
EAGLE-3 cannot run is refused, naming its values. Regenerate the fixture with that command
and `describe` when the default head's weights change."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from eagle_engine.config import ConfigError
from eagle_engine.engine import DEFAULT_HEAD
from eagle_engine.tools.export_llamacpp import export_llamacpp, rope_order

FIXTURE = Path(__file__).parent / "data" / "llamacpp_eagle3_head.json"
NAMING = ("general.name", "general.finetune", "general.basename", "general.size_label")
ROOT = Path(__file__).resolve().parent.parent


def describe(path: Path) -> dict:
    """A GGUF's metadata (values longer than 200 characters of JSON as their sha256) and its
    tensors (type, shape in GGUF order, sha256 of the bytes)."""
    r = GGUFReader(path)
    keys = {}
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k in NAMING:
            continue
        value = f.contents()
        text = json.dumps(value)
        keys[k] = {"types": [t.name for t in f.types],
                   "value": value if len(text) <= 200 else
                   "sha256:" + hashlib.sha256(text.encode()).hexdigest()}
    tensors = {t.name: {"type": t.tensor_type.name, "shape": [int(x) for x in t.shape],
                        "sha256": hashlib.sha256(np.asarray(t.data).tobytes()).hexdigest()}
               for t in r.tensors}
    return {"keys": keys, "tensors": tensors}


def test_the_default_head_exports_as_llama_cpps_converter_writes_it(tmp_path: Path) -> None:
    theirs = json.loads(FIXTURE.read_text())
    ours = describe(export_llamacpp(DEFAULT_HEAD, tmp_path / "head.gguf"))
    assert ours["tensors"] == theirs["tensors"]
    missing = sorted(set(theirs["keys"]) - set(ours["keys"]))
    assert not missing, f"keys llama.cpp's converter writes and we do not: {missing}"
    differ = {k: (ours["keys"][k], v) for k, v in theirs["keys"].items() if ours["keys"][k] != v}
    assert not differ, differ
    extra = set(ours["keys"]) - set(theirs["keys"])
    assert all(k.startswith("tokenizer.") for k in extra), extra  # the target GGUF's own


def test_rope_order_interleaves_each_heads_halves() -> None:
    import torch

    w = torch.arange(2 * 8, dtype=torch.float32).view(8, 2)  # 2 heads of 4 rows, one column pair
    out = rope_order(w, 2)
    # per head, rows [0, 1, 2, 3] (halves [0, 1] and [2, 3]) become [0, 2, 1, 3]
    assert out[:, 0].tolist() == [0, 4, 2, 6, 8, 12, 10, 14]


@pytest.mark.parametrize("head, named", [
    ("assets/heads-eagle3.1/eagle3.1-aux-1layer", ["fc_norm=True", "norm_output=True"]),
    ("eagle3-noaux-1layer", ["use_aux_hidden_state=False"]),
    ("eagle3-aux-2layer", ["num_hidden_layers=2"]),
])
def test_heads_llama_cpp_cannot_run_are_refused_by_name(tmp_path: Path, head: str,
                                                        named: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        export_llamacpp(str(ROOT / head) if "/" in head else head, tmp_path / "x.gguf")
    assert all(n in str(err.value) for n in named), str(err.value)
    assert not (tmp_path / "x.gguf").exists()


def test_a_target_without_a_gguf_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="needs 'bundled' or a .gguf"):
        export_llamacpp(DEFAULT_HEAD, tmp_path / "x.gguf", target=str(tmp_path))
