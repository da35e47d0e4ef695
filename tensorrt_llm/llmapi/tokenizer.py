"""Text in and out: a byte-level BPE tokenizer and chat template rebuilt from GGUF metadata, and
incremental detokenization for streaming.

A GGUF file carries its tokenizer as metadata (``tokenizer.ggml.*``): the vocabulary, the BPE
merges, each token's type (normal, control, user-defined, ...), the special ids and a
pre-tokenizer name. :meth:`Tokenizer.from_gguf_metadata` rebuilds the equivalent Hugging Face
``tokenizers`` pipeline from them:

    text --(control tokens split out whole)--> pre-tokenizer --> BPE --> ids
    ids  --> tokens --> byte-level decoder (bytes -> UTF-8) --> text

Only byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``) are rebuilt, with the
pre-tokenizers of :data:`PRE_TOKENIZERS`; anything else raises :class:`UnsupportedTokenizer`
(the model can still be served with token ids).

The chat template (``tokenizer.chat_template``) is Jinja, rendered the way Hugging Face renders
it: a sandboxed environment with ``trim_blocks``/``lstrip_blocks``, ``raise_exception`` and
``strftime_now`` helpers and a ``tojson`` filter that leaves non-ASCII text alone.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
from typing import Any, Iterable, Mapping, Sequence

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

# llama.cpp's token types (tokenizer.ggml.token_type)
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4

# Control tokens that end a generation whatever the metadata's eos id says (llama.cpp treats
# the same texts as end-of-generation): an instruct model ends its turn with one of these and a
# base model its document.
_END_OF_GENERATION_TEXTS = frozenset(
    {"<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<EOT>"}
)

_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _smollm() -> pre_tokenizers.PreTokenizer:
    # As in the Hugging Face SmolLM2 tokenizer.json: every digit is its own pre-token.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2()])


def _llama3() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_LLAMA3_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


#: tokenizer.ggml.pre -> the pre-tokenizer it names (llama.cpp's names)
PRE_TOKENIZERS = {"default": _gpt2, "gpt2": _gpt2, "smollm": _smollm, "llama-bpe": _llama3}


class UnsupportedTokenizer(ValueError):
    """The GGUF metadata describes a tokenizer this module does not rebuild."""


class Tokenizer:
    """Byte-level BPE tokenizer with the model's special tokens and chat template.

    ``encode`` turns text into ids (control tokens written in the text, such as ``<|im_start|>``,
    become their ids, as the chat template needs; a BOS id is prepended only if the model asks
    for it); ``decode`` turns ids into text, leaving control tokens out by default.
    """

    def __init__(
        self,
        tokenizer: _HFTokenizer,
        *,
        eos_token_id: int | None,
        stop_token_ids: Iterable[int] = (),
        bos_token_id: int | None = None,
        add_bos_token: bool = False,
        chat_template: str | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.bos_token_id = bos_token_id
        self.add_bos_token = add_bos_token and bos_token_id is not None
        #: every id that ends a generation by default (eos included), in ascending order
        self.stop_token_ids: tuple[int, ...] = tuple(
            sorted({*stop_token_ids, *(() if eos_token_id is None else (eos_token_id,))})
        )
        self.chat_template = chat_template
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)

    # ----------------------------------------------------------------------- construction

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str]) -> "Tokenizer":
        from tensorrt_llm._torch.models.checkpoints.gguf_loader import open_gguf

        return cls.from_gguf_metadata(open_gguf(path).metadata)

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> "Tokenizer":
        kind = metadata.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise UnsupportedTokenizer(
                f"tokenizer.ggml.model {kind!r} is not supported (only byte-level BPE, 'gpt2')"
            )
        pre = metadata.get("tokenizer.ggml.pre", "default")
        if pre not in PRE_TOKENIZERS:
            raise UnsupportedTokenizer(
                f"pre-tokenizer {pre!r} is not supported (supported: {', '.join(sorted(PRE_TOKENIZERS))})"
            )
        tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
        types: list[int] = list(metadata.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens))
        merges = [tuple(merge.split(" ")) for merge in metadata.get("tokenizer.ggml.merges", ())]
        if len(types) != len(tokens) or any(len(merge) != 2 for merge in merges):
            raise UnsupportedTokenizer("tokenizer metadata is inconsistent (token types or merges)")

        bpe = models.BPE(
            vocab={token: i for i, token in enumerate(tokens)},
            merges=merges,
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=pre == "llama-bpe",  # as Llama 3's tokenizer.json
        )
        tokenizer = _HFTokenizer(bpe)
        tokenizer.pre_tokenizer = PRE_TOKENIZERS[pre]()
        tokenizer.decoder = decoders.ByteLevel()
        control = [i for i, kind in enumerate(types) if kind == _CONTROL]
        tokenizer.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in control])
        user_defined = [i for i, kind in enumerate(types) if kind == _USER_DEFINED]
        tokenizer.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in user_defined])

        def token_id(key: str) -> int | None:
            value = metadata.get(f"tokenizer.ggml.{key}")
            return int(value) if value is not None and 0 <= int(value) < len(tokens) else None

        stops = {token_id(key) for key in ("eos_token_id", "eot_token_id", "eom_token_id")} - {None}
        stops |= {i for i in control if tokens[i] in _END_OF_GENERATION_TEXTS}
        return cls(
            tokenizer,
            eos_token_id=token_id("eos_token_id"),
            stop_token_ids=stops,
            bos_token_id=token_id("bos_token_id"),
            add_bos_token=bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
            chat_template=metadata.get("tokenizer.chat_template"),
        )

    # ----------------------------------------------------------------------- text <-> ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` a BOS id is prepended if the model wants one."""
        if not isinstance(text, str):
            raise ValueError(f"encode needs a str, got {type(text).__name__}")
        try:
            ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        except TypeError:  # a lone surrogate (JSON allows "\ud800"), which UTF-8 cannot encode
            raise ValueError("text is not valid Unicode: it contains a lone surrogate code point") from None
        if add_special_tokens and self.add_bos_token:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``. Bytes that do not form whole UTF-8 characters become U+FFFD."""
        ids = list(ids)
        bad = next((i for i in ids if not isinstance(i, int) or not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad!r} is outside the vocabulary [0, {self.vocab_size})")
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def token_bytes(self) -> list[bytes]:
        """Each id's bytes, in id order (what a grammar matcher reasons about): a byte-level BPE
        token's characters mapped back to the bytes they stand for; an added token's own text
        (UTF-8). An id with no token has no bytes."""
        added = {i: token.content for i, token in self._tokenizer.get_added_tokens_decoder().items()}
        to_byte = _byte_level_decoding()
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        out = [b""] * self.vocab_size
        for token, i in vocab.items():
            if i in added:
                out[i] = added[i].encode("utf-8")
            else:
                out[i] = bytes(to_byte[ch] for ch in token)
        return out

    def special_token_ids(self) -> list[int]:
        """The control tokens' ids (never produced by encoding ordinary text)."""
        return sorted(i for i, token in self._tokenizer.get_added_tokens_decoder().items() if token.special)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tokenizer.id_to_token(token_id)

    # ----------------------------------------------------------------------- chat

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, *,
        chat_template: str | None = None, **template_kwargs: Any
    ) -> str:
        """The prompt text for a conversation, rendered with the model's own chat template.

        ``messages`` are OpenAI-style ``{"role": str, "content": str}`` mappings; content may also
        be a list of ``{"type": "text", "text": str}`` parts, which are joined. Raises ValueError
        for a malformed conversation, a model without a template, or a template that refuses the
        conversation (its ``raise_exception``). ``chat_template``: render with this template instead
        of the model's (transformers' meaning).
        """
        import jinja2

        chat_template = chat_template or self.chat_template
        if not chat_template:
            raise ValueError("this model has no chat template (tokenizer.chat_template is missing)")
        conversation = [_chat_message(i, message) for i, message in enumerate(_as_list(messages))]
        if not conversation:
            raise ValueError("messages must not be empty")
        try:
            return _compile_template(chat_template).render(
                messages=conversation,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._token_text(self.bos_token_id),
                eos_token=self._token_text(self.eos_token_id),
                **template_kwargs,
            )
        except jinja2.TemplateError as error:
            raise ValueError(f"the chat template refused the conversation: {error}") from error

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else self._tokenizer.id_to_token(token_id) or ""


@functools.lru_cache(maxsize=1)
def _byte_level_decoding() -> dict[str, int]:
    """Byte-level BPE's alphabet, reversed: the printable character that stands for each byte.
    Printable Latin-1 bytes stand for themselves; the other 68 take the code points from 256 up,
    in byte order (the GPT-2 convention every byte-level vocabulary uses)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {chr(b): b for b in printable}
    extra = 256
    for b in range(256):
        if b not in printable:
            table[chr(extra)] = b
            extra += 1
    return table


def _as_list(messages: Any) -> list:
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise ValueError("messages must be a list of {'role': ..., 'content': ...} objects")
    return list(messages)


def _chat_message(index: int, message: Any) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise ValueError(f"messages[{index}] must be an object with 'role' and 'content'")
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str) or not role:
        raise ValueError(f"messages[{index}].role must be a non-empty string")
    if content is None:
        content = ""
    elif isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(
                    f"messages[{index}].content: only text parts ({{'type': 'text', 'text': ...}}) are supported"
                )
            texts.append(part["text"])
        content = "".join(texts)
    elif not isinstance(content, str):
        raise ValueError(f"messages[{index}].content must be a string or a list of text parts")
    return {**message, "role": role, "content": content}


@functools.lru_cache(maxsize=8)
def _compile_template(source: str):
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    def tojson(value: Any, indent: int | None = None) -> str:
        return json.dumps(value, ensure_ascii=False, indent=indent)

    def strftime_now(fmt: str) -> str:
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except TemplateError as error:
        raise ValueError(f"the model's chat template does not compile: {error}") from error


class IncrementalDetokenizer:
    """Text deltas for a growing sequence of ids, never ending inside a UTF-8 character.

    Byte-level BPE splits a multi-byte character (an emoji, a CJK character) over several
    tokens; decoding ids that stop inside one yields a trailing U+FFFD. ``step`` holds such a
    tail back until the rest of its bytes arrive; ``flush`` (at the end of the stream) releases
    whatever is held, exactly as ``decode`` renders it. Concatenated, the deltas of every
    ``step`` and the final ``flush`` equal ``tokenizer.decode(all ids)``.

    Byte-level decoding is a concatenation of bytes, so text after a character boundary does
    not depend on the ids before it: only the ids since the last boundary are kept and decoded,
    and a step costs O(ids since then), not O(all ids).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._pending: list[int] = []  # ids since the last character boundary
        self._emitted = 0  # characters of decode(_pending) already returned

    def step(self, new_ids: Sequence[int]) -> str:
        """Append ``new_ids``; return the text they complete (possibly empty)."""
        self._pending.extend(new_ids)
        text = self._tokenizer.decode(self._pending, skip_special_tokens=self._skip)
        # A trailing U+FFFD may be a character whose last bytes are still to come; everything
        # before the last complete character is final.
        stable = text.rstrip("\ufffd")
        delta = stable[self._emitted :]
        if len(stable) == len(text):  # ends on a character boundary: start afresh from here
            self._pending.clear()
            self._emitted = 0
        else:
            self._emitted = max(self._emitted, len(stable))
        return delta

    def flush(self) -> str:
        """The text still held back (an unfinished character decodes to U+FFFD); call once, at the end."""
        text = self._tokenizer.decode(self._pending, skip_special_tokens=self._skip)
        delta = text[self._emitted :]
        self._pending.clear()
        self._emitted = 0
        return delta
