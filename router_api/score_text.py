"""`/score` (and `EmbeddedIndexer.score`) for a `prompt` or chat `messages` instead of token ids:
the one rule for which input a request carries and how text becomes the ids that are scored
(router_api/tokenization.py does the tokenizing). The answer echoes the token count."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import threading

import msgspec

from router_api.score_plan import answer_limit
from router_api.tokenization import TokenizerError, TokenizerSet
from schemas.api import MAX_QUERY_TOKENS, ScoreResponse, TextScoreResponse


_json = msgspec.json.Encoder()
_msgpack = msgspec.msgpack.Encoder()


class TextInputError(Exception):
    """A request whose input cannot be scored; `status` / `reason` as the HTTP front answers and counts it."""

    def __init__(self, status: int, message: str, reason: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.reason = reason


def is_text(token_ids: Any, prompt: str | None, messages: Any) -> bool:
    """Whether the request is a text one; TextInputError unless exactly one input is given."""
    given = (token_ids is not None) + (prompt is not None) + (messages is not None)
    if given != 1:
        raise TextInputError(422, "give exactly one of token_ids, prompt or messages"
                             + (f" (got {given})" if given else ""), "invalid")
    return token_ids is None


def text_tokens(tokenizers: TokenizerSet | None, model: str, prompt: str | None,
                messages: Sequence[Mapping[str, Any]] | None, *, add_generation_prompt: bool = True,
                add_special_tokens: bool | None = None, slots: threading.Semaphore | None = None) -> list[int]:
    """The ids the engine makes of this prompt (completions) or chat: 400 for messages the template
    refuses, 422 for a model with no tokenizer configured, 413 past MAX_QUERY_TOKENS. `slots`: the
    tokenizations allowed at once (router_api/offload.py); none free: 503."""
    if tokenizers is None or model not in tokenizers:
        have = ", ".join(sorted(tokenizers.by_model)) if tokenizers else "none"
        raise TextInputError(422, f"no tokenizer configured for model {model!r} (configured: {have}): start the "
                                  "indexer with --tokenizer MODEL=DIR, or send token_ids", "no_tokenizer")
    tok = tokenizers.get(model)
    if slots is not None and not slots.acquire(blocking=False):
        raise TextInputError(503, "busy: text requests are already being tokenized; retry, or send token_ids",
                             "tokenizer_busy")
    try:
        if prompt is not None:
            ids = tok.encode_prompt(prompt, add_special_tokens=True if add_special_tokens is None else add_special_tokens)
        else:
            assert messages is not None
            ids = tok.encode_chat(messages, add_generation_prompt=add_generation_prompt,
                                  add_special_tokens=bool(add_special_tokens))
    except TokenizerError as exc:
        raise TextInputError(400, str(exc), "bad_text") from None
    finally:
        if slots is not None:
            slots.release()
    if len(ids) > MAX_QUERY_TOKENS:  # the same cap as token_ids
        raise TextInputError(413, f"the text is {len(ids)} tokens, over the {MAX_QUERY_TOKENS}-token limit", "too_long")
    return ids


def text_response(res: ScoreResponse, n_tokens: int) -> TextScoreResponse:
    return TextScoreResponse(**msgspec.structs.asdict(res), prompt_tokens=n_tokens)


def text_answer(service: Any, model: str, req: Any, msgpack: bool, slots: threading.Semaphore | None = None) -> bytes:
    """The encoded answer to a text /score request (`req`: a ScoreRequest with prompt or messages)."""
    ids = text_tokens(service.config.tokenizers, model, req.prompt, req.messages,
                      add_generation_prompt=req.add_generation_prompt, add_special_tokens=req.add_special_tokens,
                      slots=slots)
    limit = None
    if req.answer is not None or req.top_k is not None:
        try:
            limit = answer_limit(req.answer, req.top_k, 0)
        except ValueError as exc:
            raise TextInputError(422, str(exc), "bad_answer_form") from None
    res = text_response(service.score(model, ids, req.lora_name, req.cache_salt, limit), len(ids))
    return (_msgpack if msgpack else _json).encode(res)
