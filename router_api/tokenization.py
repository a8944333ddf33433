"""Prompt text and chat messages to token ids, the way vLLM's and SGLang's OpenAI servers make them
(docs/openai.md, "Tokenization"). No torch, no transformers: `tokenizers` + jinja2 over a model
directory holding `tokenizer.json` and `tokenizer_config.json` (a Hugging Face snapshot).

- Completions (`prompt`): `encode(text)` with `add_special_tokens=True`, i.e. the tokenizer's own
  post-processor (BOS, ...), as `tokenizer(prompt)` does in the engines.
- Chat (`messages`): the model's chat template rendered like transformers' `apply_chat_template`
  (a sandboxed jinja2 environment with trim_blocks / lstrip_blocks, `raise_exception`, `tojson`,
  `strftime_now`; the special-token strings and `add_generation_prompt` as variables), then encoded
  with `add_special_tokens=False`: the template writes BOS itself, so the engines add nothing.

Prefix caching: the tokenizer splits text on its special tokens before anything else and encodes
each piece on its own, so a rendered chat is the concatenation of its pieces' encodings. Pieces
are cached (LRU): the system prompt a router sees again and again is encoded once. Whether that
split is exact for a tokenizer is checked when it is loaded (`segmentable`); when it is not (e.g. a
Metaspace pre-tokenizer that prepends only to the first piece) whole texts are cached instead.
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from datetime import datetime
from pathlib import Path
from typing import Any, Mapping, Sequence

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

__all__ = ["ChatTokenizer", "TokenizerError", "TokenizerSet", "load_tokenizer_specs", "parse_tokenizer_specs"]

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# A check text for the split's exactness (words, spaces, punctuation, a newline, non-ASCII).
_PROBE = ("Hello world, this is a check.\n  Two  spaces and\ttabs: x=1; é ü 日本", "system\nyou are", " ", "\n\n")


# Texts longer than this are encoded with the GIL released (`encode` holds it throughout: a 1M-token
# prompt stalls every other thread for seconds); shorter ones skip the batch call's overhead.
GIL_FREE_CHARS = 16_384
# Pieces this short are cached in a plain dict (cleared when it holds MAX_SHORT_PIECES).
SHORT_PIECE_CHARS = 16
MAX_SHORT_PIECES = 4096


class TokenizerError(ValueError):
    """Bad tokenizer files, a template that refuses the messages, or messages of a wrong shape."""


class _Generation(Extension):
    """transformers' `{% generation %}...{% endgeneration %}` (assistant-mask markers): rendered as its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # transformers' own filter: jinja's built-in one HTML-escapes, which a prompt must not.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or a serialized AddedToken."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _pick_template(value: Any, name: str | None) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):  # [{"name": "default", "template": "..."}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        return named.get(name or "default") or (None if name else next(iter(named.values()), None))
    raise TokenizerError(f"chat_template has an unexpected shape: {type(value).__name__}")


def _text_content(content: Any) -> Any:
    """OpenAI content parts as the engines hand them to a string-content template: the text parts
    joined by newlines (vLLM's "string" content format). Other shapes are passed through."""
    if isinstance(content, list) and all(isinstance(p, Mapping) and p.get("type") == "text" for p in content):
        return "\n".join(str(p.get("text", "")) for p in content)
    return content


class _Lru:
    """A bounded map, least recently used out first; thread-safe (the router and the indexer call it
    from the event loop and from worker threads)."""

    __slots__ = ("max_entries", "max_tokens", "_d", "_tokens", "_lock", "hits", "misses")

    def __init__(self, max_entries: int, max_tokens: int) -> None:
        self.max_entries = max_entries
        self.max_tokens = max_tokens
        self._d: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: str) -> tuple[int, ...] | None:
        with self._lock:
            v = self._d.get(key)
            if v is None:
                self.misses += 1
                return None
            self._d.move_to_end(key)
            self.hits += 1
            return v

    def put(self, key: str, ids: tuple[int, ...]) -> None:
        if len(ids) > self.max_tokens:
            return
        with self._lock:
            old = self._d.pop(key, None)
            if old is not None:
                self._tokens -= len(old)
            self._d[key] = ids
            self._tokens += len(ids)
            while len(self._d) > self.max_entries or self._tokens > self.max_tokens:
                _, gone = self._d.popitem(last=False)
                self._tokens -= len(gone)

    def __len__(self) -> int:
        return len(self._d)


class ChatTokenizer:
    """One model's tokenizer and chat template. `encode_prompt` / `encode_chat` are safe from any thread."""

    def __init__(self, tokenizer: Tokenizer, config: Mapping[str, Any], *, chat_template: str | None = None,
                 name: str = "", cache_entries: int = 4096, cache_tokens: int = 4_000_000) -> None:
        self.name = name
        self.tokenizer = tokenizer
        self.config = dict(config)
        self.special: dict[str, str] = {}
        for key in _SPECIAL_KEYS:
            text = _token_text(self.config.get(key))
            if text is not None:
                self.special[key] = text
        extra = self.config.get("additional_special_tokens") or []
        self.additional_special = [t for t in (_token_text(x) for x in extra) if t is not None]
        source = chat_template if chat_template is not None else _pick_template(self.config.get("chat_template"), None)
        self.chat_template_source = source
        self._template = compile_template(source) if source else None
        self._cache = _Lru(cache_entries, cache_tokens)
        # pieces of at most SHORT_PIECE_CHARS (the template's glue between special tokens): their
        # encodings, kept apart from the LRU (a dict look-up costs far less than an encode)
        self._short: dict[str, tuple[int, ...]] = {}
        # The special tokens the tokenizer splits on first (added tokens marked special, no strip rules).
        splitters = [t.content for t in tokenizer.get_added_tokens_decoder().values()
                     if t.special and not t.lstrip and not t.rstrip and not t.single_word and t.content]
        self._split_re = re.compile("(" + "|".join(re.escape(s) for s in sorted(splitters, key=len, reverse=True))
                                    + ")") if splitters else None
        self._specials = set(splitters)
        self._pre, self._post = self._post_processor_ends()
        self.segmentable = self._split_re is not None and self._check_segmentable()

    # -- loading -----------------------------------------------------------------------------
    @classmethod
    def from_dir(cls, path: str | Path, *, name: str = "", chat_template: str | None = None,
                 **kw: Any) -> "ChatTokenizer":
        """From a model directory (a Hugging Face snapshot): tokenizer.json, tokenizer_config.json and,
        when present, chat_template.jinja / chat_template.json (newer snapshots keep the template there)."""
        d = Path(path)
        tj = d / "tokenizer.json"
        if not tj.is_file():
            raise TokenizerError(f"{d}: no tokenizer.json (a Hugging Face model directory is expected)")
        try:
            tok = Tokenizer.from_file(str(tj))
        except Exception as exc:  # the Rust loader's own exception type
            raise TokenizerError(f"{tj}: cannot load: {exc}") from None
        config: dict[str, Any] = {}
        tc = d / "tokenizer_config.json"
        if tc.is_file():
            try:
                config = json.loads(tc.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise TokenizerError(f"{tc}: {exc}") from None
        if chat_template is None:
            if (d / "chat_template.jinja").is_file():
                chat_template = (d / "chat_template.jinja").read_text(encoding="utf-8")
            elif (d / "chat_template.json").is_file():
                try:
                    chat_template = _pick_template(
                        json.loads((d / "chat_template.json").read_text(encoding="utf-8")).get("chat_template"), None)
                except (OSError, ValueError, AttributeError) as exc:
                    raise TokenizerError(f"{d / 'chat_template.json'}: {exc}") from None
        try:
            return cls(tok, config, chat_template=chat_template, name=name or d.name, **kw)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise TokenizerError(f"{d}: chat template does not compile: {exc}") from None

    def _post_processor_ends(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The ids the post-processor puts before and after a single sequence (e.g. BOS), found by
        encoding a probe with and without it."""
        probe = "a"
        bare = self.tokenizer.encode(probe, add_special_tokens=False).ids
        full = self.tokenizer.encode(probe, add_special_tokens=True).ids
        n = len(bare)
        for i in range(len(full) - n + 1):
            if full[i:i + n] == bare:
                return tuple(full[:i]), tuple(full[i + n:])
        raise TokenizerError("cannot locate the post-processor's special tokens around a probe")

    def _check_segmentable(self) -> bool:
        specials = sorted(self._specials)
        for a in _PROBE:
            for b in _PROBE:
                for s in specials[:4]:
                    text = a + s + b + s + a
                    if list(self._segments_encode(text)) != self.tokenizer.encode(text, add_special_tokens=False).ids:
                        return False
        return True

    # -- encoding ----------------------------------------------------------------------------
    def _raw(self, text: str) -> tuple[int, ...]:
        if len(text) > GIL_FREE_CHARS:  # `encode_batch` tokenizes without the GIL: the loop keeps serving
            return tuple(self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids)
        return tuple(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def _segments_encode(self, text: str) -> list[int]:
        assert self._split_re is not None
        out: list[int] = []
        short = self._short
        for piece in self._split_re.split(text):
            if not piece:
                continue
            if len(piece) <= SHORT_PIECE_CHARS:  # a special token, "\n", "assistant\n": a dict, no lock
                ids = short.get(piece)
                if ids is None:
                    ids = self._raw(piece)
                    if len(short) >= MAX_SHORT_PIECES:
                        short.clear()
                    short[piece] = ids
            else:
                ids = self._cache.get(piece)
                if ids is None:
                    ids = self._raw(piece)
                    self._cache.put(piece, ids)
            out.extend(ids)
        return out

    def encode_text(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """`tokenizer(text, add_special_tokens=...)["input_ids"]`, through the prefix cache."""
        if self.segmentable:
            ids = self._segments_encode(text)
        else:
            cached = self._cache.get(text)
            if cached is None:
                cached = self._raw(text)
                self._cache.put(text, cached)
            ids = list(cached)
        if add_special_tokens and (self._pre or self._post):
            return [*self._pre, *ids, *self._post]
        return ids

    def encode_prompt(self, prompt: str, *, add_special_tokens: bool = True) -> list[int]:
        """A completions `prompt` (text), as the engines tokenize it (BOS etc. by default)."""
        return self.encode_text(prompt, add_special_tokens=add_special_tokens)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, tools: Any = None, documents: Any = None,
                    template_kwargs: Mapping[str, Any] | None = None) -> str:
        """The prompt text of a chat: `apply_chat_template(messages, tokenize=False, ...)`."""
        if self._template is None:
            raise TokenizerError(f"model {self.name!r} has no chat template (tokenizer_config.json "
                                 "'chat_template' or chat_template.jinja)")
        if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not all(
                isinstance(m, Mapping) and isinstance(m.get("role"), str) for m in messages):
            raise TokenizerError("messages must be a list of objects with a string 'role'")
        msgs = [{**m, "content": _text_content(m.get("content"))} if "content" in m else dict(m) for m in messages]
        variables: dict[str, Any] = {**self.special, "additional_special_tokens": self.additional_special,
                                     **(template_kwargs or {})}
        try:
            return self._template.render(messages=msgs, tools=tools, documents=documents,
                                         add_generation_prompt=add_generation_prompt,
                                         continue_final_message=continue_final_message, **variables)
        except jinja2.exceptions.TemplateError as exc:
            raise TokenizerError(f"chat template refused the messages: {exc}") from None
        except (TypeError, KeyError, AttributeError, IndexError, ValueError) as exc:
            raise TokenizerError(f"chat template failed on the messages: {type(exc).__name__}: {exc}") from None

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                    add_special_tokens: bool = False, **kw: Any) -> list[int]:
        """A chat's token ids as the engines' /v1/chat/completions make them (the template writes
        BOS; `add_special_tokens` stays False unless the request asks otherwise)."""
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt, **kw)
        return self.encode_text(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def cache_stats(self) -> dict[str, int]:
        return {"entries": len(self._cache), "hits": self._cache.hits, "misses": self._cache.misses}


class TokenizerSet:
    """Per-model tokenizers (model name -> ChatTokenizer); `get` raises a clear error for a model without one."""

    __slots__ = ("by_model",)

    def __init__(self, by_model: Mapping[str, ChatTokenizer] | None = None) -> None:
        self.by_model = dict(by_model or {})

    def get(self, model: str) -> ChatTokenizer:
        tok = self.by_model.get(model)
        if tok is None:
            have = ", ".join(sorted(self.by_model)) or "none"
            raise TokenizerError(f"no tokenizer configured for model {model!r} (configured: {have}); "
                                 "start with --tokenizer MODEL=DIR, or send token_ids")
        return tok

    def __contains__(self, model: str) -> bool:
        return model in self.by_model

    def __bool__(self) -> bool:
        return bool(self.by_model)


def parse_tokenizer_specs(specs: Sequence[str], default_model: str = "default") -> dict[str, str]:
    """`MODEL=DIR` (or a bare `DIR` for `default_model`) -> {model: dir}; ValueError on a bad spec."""
    out: dict[str, str] = {}
    for spec in specs:
        model, sep, path = spec.partition("=")
        if not sep:
            model, path = default_model, spec
        model, path = model.strip(), path.strip()
        if not model or not path:
            raise ValueError(f"tokenizer {spec!r}: expected MODEL=DIR")
        if model in out:
            raise ValueError(f"tokenizer for model {model!r} given twice")
        out[model] = path
    return out


def load_tokenizer_specs(specs: Sequence[str], default_model: str = "default") -> TokenizerSet:
    """`--tokenizer` values to a TokenizerSet; ValueError / TokenizerError with the offending spec."""
    return TokenizerSet({m: ChatTokenizer.from_dir(p, name=m)
                         for m, p in parse_tokenizer_specs(specs, default_model).items()})
