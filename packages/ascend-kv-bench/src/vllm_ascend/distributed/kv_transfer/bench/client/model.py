# SPDX-License-Identifier: Apache-2.0
"""The model ``bench client`` serves: ``bench serve``'s random Llama.

Its tokenizer's words are token ids (vLLM's random dataset keeps its lengths through it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["TOKENIZER_STAMP", "make_served_model", "word", "write_tokenizer"]
#: Letters and digits: the words of the tokenizer are ids written in base 62.
_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
#: Which tokenizer a model directory holds (rewritten when this changes).
TOKENIZER_STAMP = ".bench-client-tokenizer"


def word(i: int) -> str:
    """Id ``i`` in base 62 (``0``..``Z``, ``10``, ...): at most 3 characters below 238,328."""
    out = ""
    while True:
        i, r = divmod(i, len(_DIGITS))
        out = _DIGITS[r] + out
        if i == 0:
            return out


def write_tokenizer(path: Path, vocab_size: int) -> Path:
    """A word-level tokenizer over ``vocab_size`` ids (``<unk> <s> </s>``, then each id in
    base 62): a random prompt's text decodes and encodes back to exactly its ids, so vLLM's
    random dataset gets the lengths it asks for; and a token takes at most 4 characters with
    its space, below the 5 characters a token vLLM's API server allows before it tokenizes
    (its prompt check: ``5 * max_model_len`` characters)."""
    stamp = path / TOKENIZER_STAMP
    want = f"base62 {vocab_size}"
    if (path / "tokenizer.json").exists() and stamp.exists() and stamp.read_text() == want:
        return path
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{word(i): i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)
    stamp.write_text(want)
    return path


def make_served_model(path: Path, spec: dict[str, Any]) -> Path:
    """The random Llama of ``bench serve`` with a tokenizer (the API server wants one)."""
    from ..serve.scenarios import make_model

    make_model(path, spec, "float32")
    return write_tokenizer(path, int(spec["vocab_size"]))
