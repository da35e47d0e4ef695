"""Text in and out: a tokenizer and chat template from a Hugging Face checkpoint directory or rebuilt
from GGUF metadata, and incremental detokenization for streaming.

From a Hugging Face directory (:meth:`Tokenizer.from_hf_directory`), as upstream and vLLM read one:

==========================  ================================================================
``tokenizer.json``          the whole pipeline, run by ``tokenizers`` as written (its
                            post-processor adds BOS/EOS where the checkpoint says so)
``tokenizer_config.json``   the named special tokens (``bos_token``, ``eos_token``, ...: the
                            chat template sees them), ``chat_template`` (a string, or named
                            templates), ``add_bos_token`` / ``add_eos_token`` (see below)
``chat_template.jinja``     the chat template, over ``tokenizer_config.json``'s (as transformers)
==========================  ================================================================

``add_bos_token`` / ``add_eos_token`` decide only where ``tokenizer.json`` has no post-processor
(transformers 5 ignores them beside a ``tokenizer.json``; its own post-processor decides).

A GGUF file carries its tokenizer as metadata (``tokenizer.ggml.*``): the vocabulary, the BPE
merges, each token's type (normal, control, user-defined, ...), the special ids and a
pre-tokenizer name. :meth:`Tokenizer.from_gguf_metadata` rebuilds the equivalent Hugging Face
``tokenizers`` pipeline from them:

    text --(control tokens split out whole)--> pre-tokenizer --> BPE --> ids
    ids  --> tokens --> byte-level decoder (bytes -> UTF-8) --> text

Only byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``) are rebuilt, with the
pre-tokenizers of :data:`PRE_TOKENIZERS`; anything else raises :class:`UnsupportedTokenizer`
(the model can still be served with token ids).

A model's vocabulary may be larger than its tokenizer's (a padded vocabulary: Qwen2.5's
151,936 rows for 151,665 tokens). :meth:`Tokenizer.for_model` gives the tokenizer that serves
such a model: an id below the model's ``vocab_size`` that has no token decodes to ``''``, as
transformers decodes it, so a legal sampling step never fails a request.

The chat template is Jinja, rendered exactly as transformers' ``apply_chat_template`` renders
it (:meth:`Tokenizer.apply_chat_template`, tools included): a sandboxed environment with
``trim_blocks``/``lstrip_blocks``, loop controls, the ``{% generation %}`` tag, ``raise_exception``,
``strftime_now``, a ``tojson`` filter that leaves non-ASCII text alone, and transformers' guarded
``dict`` and ``namespace``.
"""

from __future__ import annotations

import copy
import datetime
import functools
import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as _HFTokenizer

logger = logging.getLogger(__name__)

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte-fallback tokens

#: The named special tokens a chat template sees (transformers' SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"

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
    """A ``tokenizers`` pipeline with the model's special tokens and chat template.

    ``encode`` turns text into ids (control tokens written in the text, such as ``<|im_start|>``,
    become their ids, as the chat template needs; BOS/EOS are added only as the model asks: the
    Hugging Face post-processor, or ``add_bos_token`` for a GGUF file); ``decode`` turns ids into
    text, leaving control tokens out by default.

    ``chat_template``: the default template; ``chat_templates``: every named one (a checkpoint may
    ship several, e.g. ``tool_use``). ``special_tokens``: the named special tokens' texts the
    templates see (default: ``bos_token`` and ``eos_token`` from their ids).
    ``post_processor_adds_specials``: ``encode(add_special_tokens=True)`` runs the tokenizer's own
    post-processor (a Hugging Face ``tokenizer.json``) instead of prepending BOS by ``add_bos_token``.
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
        chat_templates: Mapping[str, str] | None = None,
        special_tokens: Mapping[str, str] | None = None,
        post_processor_adds_specials: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.bos_token_id = bos_token_id
        self._post_processor = post_processor_adds_specials
        if post_processor_adds_specials:  # what the post-processor puts in front, for the record
            first = tokenizer.encode("", add_special_tokens=True).ids[:1]
            add_bos_token = bos_token_id is not None and first == [bos_token_id]
        self.add_bos_token = add_bos_token and bos_token_id is not None
        #: every id that ends a generation by default (eos included), in ascending order
        self.stop_token_ids: tuple[int, ...] = tuple(
            sorted({*stop_token_ids, *(() if eos_token_id is None else (eos_token_id,))})
        )
        self.chat_templates: dict[str, str] = dict(chat_templates or {})
        if chat_template is None:
            chat_template = self.chat_templates.get("default")
        elif "default" not in self.chat_templates:
            self.chat_templates["default"] = chat_template
        self.chat_template = chat_template
        ids = tokenizer.get_vocab(with_added_tokens=True).values()
        #: ids [0, vocab_size) are the tokenizer's (its highest id + 1: a vocabulary may have holes)
        self.vocab_size: int = max(ids, default=-1) + 1
        #: ids that have a token (vocab_size less the holes)
        self.num_tokens: int = len(ids)
        #: ids ``decode`` accepts: the model's vocabulary (:meth:`for_model`), by default the tokenizer's
        self.model_vocab_size: int = self.vocab_size
        if special_tokens is None:
            special_tokens = {name: text for name, text in (("bos_token", self._token_text(bos_token_id)),
                                                            ("eos_token", self._token_text(eos_token_id))) if text}
        self.special_tokens: dict[str, str] = dict(special_tokens)

    # ----------------------------------------------------------------------- construction

    @classmethod
    def from_hf_directory(
        cls, directory: str | os.PathLike[str], *, eos_token_ids: Sequence[int] = (), bos_token_id: int | None = None
    ) -> "Tokenizer":
        """The tokenizer of a Hugging Face checkpoint directory (module docstring).

        ``eos_token_ids``: the ids that end a generation besides the tokenizer's ``eos_token``
        (``generation_config.json``'s, else ``config.json``'s); ``bos_token_id``: the model's, used
        when ``tokenizer_config.json`` names no ``bos_token``. Raises :class:`UnsupportedTokenizer`
        without a ``tokenizer.json``, ValueError for malformed files."""
        directory = Path(directory)
        path = directory / TOKENIZER_FILE
        if not path.is_file():
            present = ", ".join(sorted(p.name for p in directory.glob("tokenizer*"))) or "none"
            raise UnsupportedTokenizer(f"{directory}: no {TOKENIZER_FILE} (tokenizer files present: {present})")
        try:
            tokenizer = _HFTokenizer.from_file(str(path))
        except Exception as error:  # tokenizers raises its own Exception type for a malformed file
            raise ValueError(f"{path}: not a tokenizers file ({error})") from error
        config = _read_tokenizer_config(directory / TOKENIZER_CONFIG_FILE)
        special = {name: text for name in SPECIAL_TOKEN_NAMES if (text := _token_content(config.get(name))) is not None}
        _add_missing_tokens(tokenizer, config, special, path)
        if tokenizer.post_processor is None and (config.get("add_bos_token") or config.get("add_eos_token")):
            tokenizer.post_processor = _template_processing(tokenizer, special, config)
        if config.get("clean_up_tokenization_spaces"):
            logger.warning("%s: clean_up_tokenization_spaces is not applied: decoded text keeps the spaces the "
                           "tokens hold", directory / TOKENIZER_CONFIG_FILE)

        def token_id(name: str) -> int | None:
            text = special.get(name)
            return None if text is None else tokenizer.token_to_id(text)

        eos = token_id("eos_token")
        if eos is None and eos_token_ids:
            eos = eos_token_ids[0]
        bos = token_id("bos_token")
        return cls(
            tokenizer,
            eos_token_id=eos,
            stop_token_ids=eos_token_ids,
            bos_token_id=bos if bos is not None else bos_token_id,
            chat_templates=_chat_templates(directory, config),
            special_tokens=special,
            post_processor_adds_specials=True,
        )

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

    def for_model(self, vocab_size: int) -> "Tokenizer":
        """This tokenizer serving a model whose logits have ``vocab_size`` rows (``config.json``'s
        ``vocab_size``), which may exceed the tokenizer's ids: checkpoints pad their vocabulary
        (Qwen2.5: 151,936 rows for 151,665 tokens; a multiple of 64 or 128 suits the GEMMs), and
        a model may sample a padded id. Such an id has no token: it decodes to ``''`` (as
        transformers decodes it) and generation goes on. An id at or above ``vocab_size`` stays
        an error (no model row produces it). Raises ValueError when the tokenizer has ids the
        model cannot produce (``vocab_size`` below the tokenizer's)."""
        if vocab_size < self.vocab_size:
            raise ValueError(f"the tokenizer has ids up to {self.vocab_size - 1}, the model's vocab_size is only {vocab_size}")
        padded = copy.copy(self)
        padded.model_vocab_size = vocab_size
        return padded

    @property
    def num_padded_ids(self) -> int:
        """Ids below ``model_vocab_size`` without a token (padding and holes): they decode to ``''``."""
        return self.model_vocab_size - self.num_tokens

    # ----------------------------------------------------------------------- text <-> ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` a BOS id is prepended if the model wants one."""
        if not isinstance(text, str):
            raise ValueError(f"encode needs a str, got {type(text).__name__}")
        try:
            ids = self._tokenizer.encode(text, add_special_tokens=add_special_tokens and self._post_processor).ids
        except TypeError:  # a lone surrogate (JSON allows "\ud800"), which UTF-8 cannot encode
            raise ValueError("text is not valid Unicode: it contains a lone surrogate code point") from None
        if add_special_tokens and self.add_bos_token and not self._post_processor:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``. Bytes that do not form whole UTF-8 characters become U+FFFD; an id
        without a token (a padded one, see :meth:`for_model`) adds nothing. ValueError for an id
        outside ``[0, model_vocab_size)``."""
        return self._tokenizer.decode(self.text_ids(ids), skip_special_tokens=skip_special_tokens)

    def text_ids(self, ids: Sequence[int]) -> list[int]:
        """``ids`` less those at or above the tokenizer's ``vocab_size`` (a padded vocabulary's
        extra ids: they have no text). ValueError naming the first id outside
        ``[0, model_vocab_size)``: no model row produces it, so it is a bug, never padding."""
        ids = list(ids)
        bad = next((i for i in ids if not isinstance(i, int) or not 0 <= i < self.model_vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad!r} is outside the vocabulary [0, {self.model_vocab_size})")
        if self.model_vocab_size > self.vocab_size:
            ids = [i for i in ids if i < self.vocab_size]
        return ids

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def token_bytes(self) -> list[bytes]:
        """Each id's bytes, in id order (what a grammar matcher reasons about): a byte-level BPE
        token's characters mapped back to the bytes they stand for; a SentencePiece-style token's
        text with ``▁`` as a space, or the byte a ``<0xNN>`` fallback token stands for; an added
        token's own text (UTF-8). An id with no token has no bytes."""
        added = {i: token.content for i, token in self._tokenizer.get_added_tokens_decoder().items()}
        byte_level = b'"ByteLevel"' in (self._tokenizer.decoder.__getstate__() if self._tokenizer.decoder else b"")
        to_byte = _byte_level_decoding()
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        out = [b""] * self.vocab_size
        for token, i in vocab.items():
            if i in added:
                out[i] = added[i].encode("utf-8")
            elif byte_level:
                out[i] = bytes(to_byte[ch] for ch in token)
            elif (fallback := _BYTE_FALLBACK.fullmatch(token)) is not None:
                out[i] = bytes([int(fallback.group(1), 16)])
            else:
                out[i] = token.replace("\u2581", " ").encode("utf-8")
        return out

    def special_token_ids(self) -> list[int]:
        """The control tokens' ids (never produced by encoding ordinary text)."""
        return sorted(i for i, token in self._tokenizer.get_added_tokens_decoder().items() if token.special)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tokenizer.id_to_token(token_id)

    # ----------------------------------------------------------------------- chat

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        chat_template: str | None = None,
        tokenize: bool = False,
        **template_kwargs: Any,
    ) -> str | list[int]:
        """The prompt text for a conversation: exactly what transformers' ``apply_chat_template``
        renders (``tokenize=False``) for the same arguments, tools included. With ``tokenize``, its
        token ids instead, encoded as transformers encodes them: without adding special tokens (the
        template writes its own BOS; encoding the text with ``encode`` would add a second one where
        the tokenizer adds BOS, as Llama 3's does).

        ``messages`` are OpenAI-style mappings: ``role`` (a non-empty string) and ``content`` (a
        string, None, or a list of ``{"type": "text", "text": str}`` parts, joined into one string
        first, as vLLM does for templates that take text), plus whatever else the template reads
        (an assistant's ``tool_calls``, a tool message's ``tool_call_id``, ``reasoning_content``...).
        As transformers does, keys whose value is None are dropped, and a message's reasoning
        (``reasoning_content``, ``thinking`` or ``reasoning``) is offered under the first two names.
        ``tools``: JSON schemas (mappings), passed to the template as ``tools``.
        ``chat_template``: a template, or the name of one of :attr:`chat_templates` (default: the
        ``tool_use`` template when there are tools and the model has one, else the default).
        ``template_kwargs`` reach the template beside the named special tokens (over them).

        Raises ValueError for a malformed conversation, a model without a template, or a template
        that refuses the conversation (its ``raise_exception``).
        """
        import jinja2

        source = self._template_for(chat_template, tools)
        conversation = [_chat_message(i, message) for i, message in enumerate(_as_list(messages))]
        if not conversation:
            raise ValueError("messages must not be empty")
        if tools is not None:
            tools = _as_list(tools, "tools")
            bad = next((i for i, tool in enumerate(tools) if not isinstance(tool, Mapping)), None)
            if bad is not None:
                raise ValueError(f"tools[{bad}] must be a JSON schema object")
            tools = _plain(tools)
        try:
            text = _compile_template(source).render(
                messages=conversation,
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **{**self.special_tokens, **_plain(template_kwargs)},
            )
        except jinja2.TemplateError as error:
            raise ValueError(f"the chat template refused the conversation: {error}") from error
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _template_for(self, chat_template: str | None, tools: Sequence[Any] | None) -> str:
        """transformers' choice: a name among the model's templates or a template itself; else
        ``tool_use`` with tools where there is one; else the default."""
        if chat_template is not None:
            return self.chat_templates.get(chat_template, chat_template)
        if tools is not None and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        if not self.chat_template:
            raise ValueError("this model has no chat template (tokenizer.chat_template is missing)")
        return self.chat_template

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


def _as_list(messages: Any, what: str = "messages") -> list:
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        if what == "messages":
            raise ValueError("messages must be a list of {'role': ..., 'content': ...} objects")
        raise ValueError(f"{what} must be a list")
    return list(messages)


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _plain(value: Any) -> Any:
    """Plain JSON-like data for the sandbox: mappings become dicts, lists and tuples are copied
    through, scalars stay (transformers hands templates the same)."""
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    return value


def _chat_message(index: int, message: Any) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise ValueError(f"messages[{index}] must be an object with 'role' and 'content'")
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str) or not role:
        raise ValueError(f"messages[{index}].role must be a non-empty string")
    if content is None:
        pass
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
    # transformers drops the keys whose value is None (content included) before rendering
    plain = {key: value for key, value in _plain({**message, "role": role, "content": content}).items()
             if value is not None}
    reasoning = next((plain[key] for key in _REASONING_FIELDS if plain.get(key) is not None), None)
    if reasoning is not None:  # offered under the names templates read (transformers' aliasing)
        plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
    return plain


@functools.lru_cache(maxsize=8)
def _compile_template(source: str):
    """The template compiled in transformers' environment (``utils/chat_template_utils``): the same
    sandbox options, extensions, filters and globals, so it renders the same text."""
    import jinja2
    from jinja2.exceptions import SecurityError, TemplateError
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """``{% generation %}...{% endgeneration %}`` (transformers marks assistant text with it): the body, as is."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message: str):
        raise TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
               sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.datetime.now().strftime(fmt)

    class TemplateDict:
        """``dict(...)`` without the class itself (no attribute access to break out through)."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        """``namespace(...)`` that refuses underscore-prefixed attributes."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise SecurityError(f"chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    try:
        return env.from_string(source)
    except TemplateError as error:
        raise ValueError(f"the model's chat template does not compile: {error}") from error


# --------------------------------------------------------------------------- Hugging Face files


def _read_tokenizer_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ValueError(f"{path}: not readable JSON ({error})") from error
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return config


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken's fields."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _add_missing_tokens(tokenizer: _HFTokenizer, config: Mapping[str, Any], special: Mapping[str, str],
                        path: Path) -> None:
    """The tokens tokenizer_config.json declares that tokenizer.json lacks, added as transformers adds
    them (``added_tokens_decoder`` with their flags, then the named special tokens)."""
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    missing = []
    for token_id, fields in sorted((config.get("added_tokens_decoder") or {}).items(), key=lambda kv: int(kv[0])):
        content = _token_content(fields)
        if content is None or content in vocab:
            continue
        missing.append(AddedToken(content, special=bool(fields.get("special", True)),
                                  single_word=bool(fields.get("single_word", False)),
                                  lstrip=bool(fields.get("lstrip", False)), rstrip=bool(fields.get("rstrip", False)),
                                  normalized=bool(fields.get("normalized", False))))
    missing += [AddedToken(text, special=True, normalized=False) for text in special.values()
                if text not in vocab and all(text != token.content for token in missing)]
    if missing:
        logger.warning("%s lacks %d tokens that tokenizer_config.json declares; added at the end of the vocabulary: %s",
                       path, len(missing), ", ".join(token.content for token in missing[:5]))
        tokenizer.add_tokens(missing)


def _template_processing(tokenizer: _HFTokenizer, special: Mapping[str, str], config: Mapping[str, Any]):
    """transformers' post-processor for a tokenizer.json without one: BOS / EOS per the flags."""
    pieces, tokens = ["$A:0"], []
    for name, flag, at_start in (("bos_token", "add_bos_token", True), ("eos_token", "add_eos_token", False)):
        text = special.get(name)
        token_id = None if text is None else tokenizer.token_to_id(text)
        if config.get(flag) and token_id is not None:
            pieces.insert(0 if at_start else len(pieces), f"{text}:0")
            tokens.append((text, token_id))
    return processors.TemplateProcessing(single=" ".join(pieces), special_tokens=tokens)


def _chat_templates(directory: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """Named templates: ``chat_template.jinja`` (the default, over the config's), else
    tokenizer_config.json's ``chat_template`` (a string, or a list of ``{name, template}``)."""
    file = directory / CHAT_TEMPLATE_FILE
    if file.is_file():
        return {"default": file.read_text(encoding="utf-8")}
    value = config.get("chat_template")
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list) and all(isinstance(t, Mapping) and isinstance(t.get("name"), str)
                                       and isinstance(t.get("template"), str) for t in value):
        return {t["name"]: t["template"] for t in value}
    raise ValueError(f"{directory / TOKENIZER_CONFIG_FILE}: chat_template must be a string or a list of"
                     " {name, template} objects")


class IncrementalDetokenizer:
    """Text deltas for a growing sequence of ids, never ending inside a UTF-8 character.

    A multi-byte character (an emoji, a CJK character) may be split over several tokens (byte-level
    BPE, or SentencePiece's byte fallback); decoding ids that stop inside one yields a trailing
    U+FFFD. ``step`` holds such a tail back until the rest of its bytes arrive; ``flush`` (at the end
    of the stream) releases whatever is held, exactly as ``decode`` renders it. Concatenated, the
    deltas of every ``step`` and the final ``flush`` equal ``tokenizer.decode(all ids)``.

    Only the ids since the last character boundary are decoded, behind a few ids of context
    (:data:`CONTEXT_IDS`) whose own text is then cut off: a byte-level decoder does not need them
    (bytes concatenate), but a SentencePiece-style one (Llama 2, Mistral) strips the space of the
    *first* token it decodes, which the context absorbs as ``decode`` of the whole sequence would.
    A step costs O(ids since the boundary), not O(all ids).
    """

    CONTEXT_IDS = 4

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._context: list[int] = []  # the last ids before the boundary
        self._context_text = ""  # decode(_context)
        self._pending: list[int] = []  # ids since the last character boundary
        self._emitted = 0  # characters of the pending ids' text already returned

    def _pending_text(self) -> str:
        text = self._tokenizer.decode(self._context + self._pending, skip_special_tokens=self._skip)
        return text[len(self._context_text):] if text.startswith(self._context_text) else text

    def step(self, new_ids: Sequence[int]) -> str:
        """Append ``new_ids``; return the text they complete (possibly empty: a padded id, see
        :meth:`Tokenizer.for_model`, adds no text and is not kept as context, so the context ids
        stay ones with text)."""
        self._pending.extend(self._tokenizer.text_ids(new_ids))
        text = self._pending_text()
        # A trailing U+FFFD may be a character whose last bytes are still to come; everything
        # before the last complete character is final.
        stable = text.rstrip("\ufffd")
        delta = stable[self._emitted :]
        if len(stable) == len(text):  # ends on a character boundary: start afresh from here
            self._context = (self._context + self._pending)[-self.CONTEXT_IDS:]
            self._context_text = self._tokenizer.decode(self._context, skip_special_tokens=self._skip)
            self._pending.clear()
            self._emitted = 0
        else:
            self._emitted = max(self._emitted, len(stable))
        return delta

    def flush(self) -> str:
        """The text still held back (an unfinished character decodes to U+FFFD); call once, at the end."""
        delta = self._pending_text()[self._emitted :]
        self._pending.clear()
        self._emitted = 0
        return delta
