"""The small tokenizer the tests (and the README quick start) use: `tests/data/tiny-chat/`, a
byte-level BPE (like Llama 3's or Qwen's) trained here on a few sentences, with BOS added by its
post-processor and a ChatML chat template that writes BOS and uses special tokens. No download.

`python -m tests.support.tiny_tokenizer DIR` rebuilds the files (the shipped ones came from it).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers



TINY_CHAT = Path(__file__).resolve().parents[1] / "data" / "tiny-chat"

SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] | trim + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_CORPUS = [
    "You are a helpful assistant. Answer the question briefly and precisely.",
    "The cache holds key and value blocks for every token of the prompt.",
    "Routing a request to the worker that already holds its prefix saves prefill time.",
    "What is the capital of France? Paris is the capital of France.",
    "Tell me a story about a router, an indexer and two workers sharing a system prompt.",
    "def main(): return 42  # numbers 0 1 2 3 4 5 6 7 8 9 and symbols {} [] () <> = + - * /",
]


def build(out: Path) -> Path:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS * 4, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]),
    ])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True},
              "add_bos_token": True, "model_max_length": 4096, "chat_template": CHATML,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return out


def variants() -> dict[str, Tokenizer]:
    """Other tokenizer shapes the prefix cache must be exact for (or detect it cannot be): SentencePiece-
    style Metaspace (prepending to every piece, or only to the first: not splittable), and a lowercasing
    word-level one."""
    out: dict[str, Tokenizer] = {}
    specials = SPECIALS + ["<unk>"]
    for scheme in ("always", "first"):
        t = Tokenizer(models.BPE(unk_token="<unk>"))
        t.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme=scheme)
        t.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme=scheme)
        t.train_from_iterator(_CORPUS * 2, trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                                                show_progress=False))
        t.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[
            ("<s>", t.token_to_id("<s>")), ("</s>", t.token_to_id("</s>"))])
        out[f"metaspace_{scheme}"] = t
    w = Tokenizer(models.WordLevel(unk_token="<unk>"))
    w.normalizer = normalizers.Lowercase()
    w.pre_tokenizer = pre_tokenizers.Whitespace()
    w.train_from_iterator(_CORPUS, trainers.WordLevelTrainer(special_tokens=specials, show_progress=False))
    out["wordlevel"] = w
    return out


if __name__ == "__main__":
    build(Path(sys.argv[1]) if len(sys.argv) > 1 else TINY_CHAT)
