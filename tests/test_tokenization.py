"""router_api.tokenization: the chat template rendered like transformers' apply_chat_template, text
encoded like the engines (BOS from the post-processor for prompts, none added after a template),
and the segment cache exact against whole-text encoding."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st
from tokenizers import Tokenizer

from router_api.tokenization import ChatTokenizer, TokenizerError, parse_tokenizer_specs
from support.tiny_tokenizer import TINY_CHAT, variants

RAW = Tokenizer.from_file(str(TINY_CHAT / "tokenizer.json"))


@pytest.fixture(scope="module")
def tok() -> ChatTokenizer:
    return ChatTokenizer.from_dir(TINY_CHAT)


def test_template_renders_bos_specials_and_generation_prompt(tok: ChatTokenizer) -> None:
    msgs = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hi"}]
    text = tok.render_chat(msgs)
    assert text == ("<s><|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert not tok.render_chat(msgs, add_generation_prompt=False).endswith("assistant\n")


def test_chat_ids_are_the_rendered_text_without_added_specials(tok: ChatTokenizer) -> None:
    msgs = [{"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "Paris?"}]}]
    ids = tok.encode_chat(msgs)
    text = tok.render_chat(msgs)
    assert "What is\nParis?" in text  # text parts joined by newlines, as vLLM does for string templates
    assert ids == RAW.encode(text, add_special_tokens=False).ids
    bos = RAW.token_to_id("<s>")
    assert ids[0] == bos and ids[1] != bos  # the template's BOS, exactly once
    assert ids[1] == RAW.token_to_id("<|im_start|>")


def test_prompt_gets_the_post_processor_bos(tok: ChatTokenizer) -> None:
    ids = tok.encode_prompt("The cache holds key and value blocks")
    assert ids == RAW.encode("The cache holds key and value blocks", add_special_tokens=True).ids
    assert ids[0] == RAW.token_to_id("<s>")
    assert tok.encode_prompt("x", add_special_tokens=False) == RAW.encode("x", add_special_tokens=False).ids


def test_template_errors_are_clear(tok: ChatTokenizer, tmp_path) -> None:
    (tmp_path / "tokenizer.json").write_text((TINY_CHAT / "tokenizer.json").read_text())
    cfg = {"bos_token": "<s>", "chat_template": "{% if messages[0]['role'] != 'user' %}"
           "{{ raise_exception('first message must be user') }}{% endif %}{{ messages | tojson }}"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = ChatTokenizer.from_dir(tmp_path)
    with pytest.raises(TokenizerError, match="first message must be user"):
        t.render_chat([{"role": "system", "content": "x"}])
    # transformers' tojson: no HTML escaping, non-ASCII kept
    assert t.render_chat([{"role": "user", "content": "<é>"}]) == '[{"role": "user", "content": "<é>"}]'
    with pytest.raises(TokenizerError, match="role"):
        tok.render_chat([{"content": "no role"}])
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        ChatTokenizer.from_dir(tmp_path / "missing")


def test_generation_tag_and_chat_template_jinja_file(tmp_path) -> None:
    (tmp_path / "tokenizer.json").write_text((TINY_CHAT / "tokenizer.json").read_text())
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}")
    t = ChatTokenizer.from_dir(tmp_path)
    assert t.render_chat([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]) == "ab"


def test_specs() -> None:
    assert parse_tokenizer_specs(["m1=/a", "/b"], "dflt") == {"m1": "/a", "dflt": "/b"}
    with pytest.raises(ValueError):
        parse_tokenizer_specs(["m=/a", "m=/b"])


_WORDS = st.sampled_from(["You", " are", " a", " helpful", "assistant", ".", "\n", " ", "  ", "Paris", "é", "日本",
                          "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|im_start", "im_end|>", "42", "\t"])


@settings(max_examples=300, deadline=None)
@given(st.lists(_WORDS, max_size=40), st.booleans())
def test_segment_cache_equals_whole_text_encoding(words: list[str], specials: bool) -> None:
    """Encoding piece by piece (split on special tokens, pieces cached) equals the tokenizer on the whole text."""
    t = ChatTokenizer(RAW, {}, cache_entries=16)
    assert t.segmentable
    text = "".join(words)
    for _ in range(2):  # cold, then from the cache
        assert t.encode_text(text, add_special_tokens=specials) == RAW.encode(text, add_special_tokens=specials).ids


VARIANTS = variants()


def test_split_check_detects_a_tokenizer_that_cannot_be_split() -> None:
    assert not ChatTokenizer(VARIANTS["metaspace_first"], {}).segmentable  # prepends to the first piece only
    assert ChatTokenizer(VARIANTS["metaspace_always"], {}).segmentable
    assert ChatTokenizer(VARIANTS["wordlevel"], {}).segmentable


@pytest.mark.parametrize("name", sorted(VARIANTS))
@settings(max_examples=150, deadline=None)
@given(words=st.lists(_WORDS, max_size=30), specials=st.booleans())
def test_every_tokenizer_shape_encodes_like_the_library(name: str, words: list[str], specials: bool) -> None:
    raw = VARIANTS[name]
    t = ChatTokenizer(raw, {}, cache_entries=8)
    text = "".join(words)
    for _ in range(2):
        assert t.encode_text(text, add_special_tokens=specials) == raw.encode(text, add_special_tokens=specials).ids


def test_cache_reuses_a_shared_system_prompt(tok: ChatTokenizer) -> None:
    t = ChatTokenizer(RAW, {"bos_token": "<s>", "chat_template": tok.chat_template_source})
    system = {"role": "system", "content": "You are a helpful assistant. " * 20}
    t.encode_chat([system, {"role": "user", "content": "first question"}])
    before = t.cache_stats()["hits"]
    ids = t.encode_chat([system, {"role": "user", "content": "second question"}])
    assert t.cache_stats()["hits"] > before
    assert ids == RAW.encode(t.render_chat([system, {"role": "user", "content": "second question"}]),
                             add_special_tokens=False).ids
