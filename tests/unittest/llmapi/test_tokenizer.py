"""The tokenizer rebuilt from SmolLM2's GGUF metadata, its chat template, and streaming detokenization."""

from __future__ import annotations

import pytest
from hypothesis import given, note
from hypothesis import strategies as st

from tensorrt_llm.llmapi.tokenizer import IncrementalDetokenizer, Tokenizer, UnsupportedTokenizer

CONTROL_TOKENS = (
    "<|endoftext|> <|im_start|> <|im_end|> <repo_name> <reponame> <file_sep> <filename> <gh_stars> <issue_start>"
    " <issue_comment> <issue_closed> <jupyter_start> <jupyter_text> <jupyter_code> <jupyter_output>"
    " <jupyter_script> <empty_output>"
).split()


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer) -> Tokenizer:
    return smollm2_tokenizer


# --------------------------------------------------------------------------- encode / decode


def test_special_ids_come_from_the_metadata(tok):
    assert tok.vocab_size == 49152
    assert tok.eos_token_id == 2 == tok.token_to_id("<|im_end|>")
    assert tok.stop_token_ids == (0, 2)  # <|endoftext|> ends a document, <|im_end|> a turn
    assert not tok.add_bos_token


def test_the_17_control_tokens_are_single_specials(tok):
    for i, text in enumerate(CONTROL_TOKENS):
        assert tok.encode(text) == [i]
        assert tok.decode([i]) == ""  # left out of text by default
        assert tok.decode([i], skip_special_tokens=False) == text
    assert tok.encode("<|im_start|>user\nHi<|im_end|>") == [1, 4093, 198, 26843, 2]


def test_digits_are_split_one_by_one_and_no_bos_is_added(tok):
    ids = tok.encode("In 2024, 365 days.")
    pieces = [tok.id_to_token(i) for i in ids]
    assert pieces[:2] == ["In", "Ġ"] and pieces[2:6] == ["2", "0", "2", "4"]
    assert "3" in pieces and "6" in pieces and "5" in pieces
    assert tok.encode("Hello world!") == [19556, 905, 17]  # no BOS in front


# SmolLM2's vocabulary has no token for six control bytes and for the lead bytes of code points
# above U+3FFFF; like Hugging Face's tokenizer (no unknown token), encoding drops them.
MISSING_BYTES = "\x04\x06\x13\x14\x16\x1d"


@given(st.text(st.characters(max_codepoint=0x3FFFF, exclude_characters=MISSING_BYTES, exclude_categories=["Cs"]), max_size=60))
def test_any_text_round_trips(tok, text):
    ids = tok.encode(text)
    note(f"ids={ids}")
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_bytes_without_a_token_are_dropped(tok):
    assert tok.encode("a\x16b") == tok.encode("a") + tok.encode("b")  # the byte still splits pre-tokens


def test_lone_surrogates_are_refused(tok):
    with pytest.raises(ValueError, match="lone surrogate"):
        tok.encode("a\ud800b")


def test_decode_refuses_ids_outside_the_vocabulary(tok):
    with pytest.raises(ValueError, match=r"token id 49152 is outside the vocabulary \[0, 49152\)"):
        tok.decode([5, 49152])


def test_other_tokenizer_models_are_refused():
    with pytest.raises(UnsupportedTokenizer, match="'llama' is not supported"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(UnsupportedTokenizer, match="pre-tokenizer 'qwen2' is not supported"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2"})


# --------------------------------------------------------------------------- chat template

SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


def test_chat_template_renders_the_models_own_format(tok):
    messages = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(messages) == SYSTEM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == SYSTEM + "<|im_start|>user\nHi<|im_end|>\n"
    own_system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    assert tok.apply_chat_template(own_system) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize(
    "messages, problem",
    [
        ([], "must not be empty"),
        ("hello", "must be a list"),
        ([{"content": "x"}], r"messages\[0\].role must be a non-empty string"),
        ([{"role": "user", "content": 3}], r"messages\[0\].content must be a string"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "only text parts"),
    ],
)
def test_malformed_conversations_are_refused(tok, messages, problem):
    with pytest.raises(ValueError, match=problem):
        tok.apply_chat_template(messages)


def test_template_errors_become_value_errors(tok):
    strict = Tokenizer(
        tok._tokenizer,
        eos_token_id=2,
        chat_template="{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be the user') }}"
        "{% endif %}{{ messages[0]['content'] | tojson }}",
    )
    assert strict.apply_chat_template([{"role": "user", "content": "é"}]) == '"é"'
    with pytest.raises(ValueError, match="first message must be the user"):
        strict.apply_chat_template([{"role": "assistant", "content": "x"}])
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(tok._tokenizer, eos_token_id=2).apply_chat_template([{"role": "user", "content": "x"}])


def test_the_template_runs_sandboxed(tok):
    nosy = Tokenizer(tok._tokenizer, eos_token_id=2, chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(ValueError, match="refused"):
        nosy.apply_chat_template([{"role": "user", "content": "x"}])


# --------------------------------------------------------------------------- streaming


def byte_tokens(tok, text: str) -> list[int]:
    """``text`` as one token per UTF-8 byte (byte-level BPE has a token for every byte)."""
    alphabet = _byte_alphabet()
    return [tok.token_to_id(alphabet[b]) for b in text.encode()]


def _byte_alphabet() -> dict[int, str]:
    # GPT-2's printable stand-ins for the 256 byte values.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b if b in printable else next(extra)) for b in range(256)}


@pytest.mark.parametrize("text", ["😀", "日本語", "a😀b", "naïve 🇫🇷!"])
def test_multibyte_characters_split_over_tokens_come_out_whole(tok, text):
    ids = byte_tokens(tok, text)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.step([i]) for i in ids]
    assert "".join(deltas) + detok.flush() == text
    assert all("\ufffd" not in delta for delta in deltas)
    # each character appears at the step that delivers its last byte, not before
    ends, position = set(), 0
    for char in text:
        position += len(char.encode())
        ends.add(position - 1)
    assert {i for i, delta in enumerate(deltas) if delta} <= ends


def test_an_unfinished_character_is_flushed_as_decode_would(tok):
    ids = tok.encode("ok ") + byte_tokens(tok, "😀")[:2]
    detok = IncrementalDetokenizer(tok)
    assert detok.step(ids) == "ok "
    assert detok.flush() == tok.decode(ids)[len("ok ") :] == "\ufffd"


PIECES = ["hello", " world", "\n", "12", " 😀", "日本", "é", "<|im_end|>", "<|im_start|>", "🇫🇷"]


@st.composite
def id_stream(draw, tok: Tokenizer) -> list[list[int]]:
    """Steps of ids mixing whole words, control tokens, and multi-byte characters cut into single bytes."""
    ids: list[int] = []
    for piece, as_bytes in draw(st.lists(st.tuples(st.sampled_from(PIECES), st.booleans()), max_size=12)):
        ids += byte_tokens(tok, piece) if as_bytes and not piece.startswith("<|") else tok.encode(piece)
    if draw(st.booleans()):  # a control token anywhere, even between the bytes of one character
        ids.insert(draw(st.integers(0, len(ids))), tok.eos_token_id)
    bounds = sorted({0, len(ids), *draw(st.lists(st.integers(0, len(ids)), max_size=6))})
    return [ids[a:b] for a, b in zip(bounds, bounds[1:])]


@given(data=st.data(), skip_special=st.booleans())
def test_deltas_concatenate_to_decode_and_never_end_mid_character(tok, data, skip_special):
    steps = data.draw(id_stream(tok))
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special)
    seen: list[int] = []
    emitted = ""
    for new in steps:
        seen += new
        delta = detok.step(new)
        assert not delta.endswith("\ufffd")
        emitted += delta
        assert tok.decode(seen, skip_special_tokens=skip_special).startswith(emitted)
    emitted += detok.flush()
    assert emitted == tok.decode(seen, skip_special_tokens=skip_special)


# --------------------------------------------------------------------------- padded vocabularies
# A model's vocab_size may exceed its tokenizer's (Qwen2.5: 151,936 rows, 151,665 tokens); the
# extra ids decode to '' as transformers decodes them, and only ids past the model's are errors.

PADDED_VOCAB = 49152 + 64


def test_a_padded_vocabulary_decodes_its_extra_ids_to_nothing(tok):
    padded = tok.for_model(PADDED_VOCAB)
    hello = tok.encode("hello world")
    assert padded.decode([49152, *hello[:1], 49170, 49170, *hello[1:], PADDED_VOCAB - 1]) == "hello world"
    assert padded.decode([49160]) == "" and padded.text_ids([5, 49160, 6]) == [5, 6]
    assert (padded.vocab_size, padded.num_tokens, padded.model_vocab_size, padded.num_padded_ids) == (
        49152, 49152, PADDED_VOCAB, 64)
    with pytest.raises(ValueError, match=rf"token id {PADDED_VOCAB} is outside the vocabulary \[0, {PADDED_VOCAB}\)"):
        padded.decode([5, PADDED_VOCAB])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        padded.decode([-1])
    # the tokenizer it came from is unchanged (a new value, not a field set on a shared one)
    assert tok.model_vocab_size == 49152 and tok.num_padded_ids == 0
    with pytest.raises(ValueError, match="49152"):
        tok.decode([49152])


def test_a_model_vocabulary_smaller_than_the_tokenizer_is_refused(tok):
    assert tok.for_model(49152).num_padded_ids == 0
    with pytest.raises(ValueError, match="the tokenizer has ids up to 49151, the model's vocab_size is only 49000"):
        tok.for_model(49000)


@given(data=st.data(), skip_special=st.booleans())
def test_padded_ids_anywhere_in_a_stream_add_no_text(tok, data, skip_special):
    """Padded ids dropped in anywhere (between the bytes of one character, many in a row, alone
    in a step): the deltas concatenate to ``decode`` of every id, which is the text without them."""
    padded = tok.for_model(PADDED_VOCAB)
    steps = data.draw(id_stream(tok))
    extra = st.lists(st.integers(49152, PADDED_VOCAB - 1), max_size=6)
    steps = [[*data.draw(extra), *step, *data.draw(extra)] for step in steps] + [data.draw(extra)]
    detok = IncrementalDetokenizer(padded, skip_special_tokens=skip_special)
    emitted = "".join(detok.step(step) for step in steps) + detok.flush()
    every = [i for step in steps for i in step]
    assert emitted == padded.decode(every, skip_special_tokens=skip_special)
    assert emitted == tok.decode([i for i in every if i < 49152], skip_special_tokens=skip_special)


def test_a_vocabulary_with_holes_counts_ids_to_its_highest():
    """vocab_size is the highest id + 1 (tokenizers counts tokens), so a token past a gap decodes
    and has bytes; the ids in the gap have no token and decode to ''."""
    from tokenizers import Tokenizer as Pipeline
    from tokenizers import models

    # as a checkpoint that reserves ids 3..8
    holes = Tokenizer(Pipeline(models.WordLevel({"a": 0, "b": 1, "<unk>": 2, "c": 9}, unk_token="<unk>")),
                      eos_token_id=None)
    assert (holes.vocab_size, holes.num_tokens, holes.num_padded_ids) == (10, 4, 6)
    assert holes.decode([0, 5, 9, 1]) == holes.decode([0, 9, 1]) == "a c b"
    assert len(holes.token_bytes()) == 10 and holes.token_bytes()[9] == b"c"


# --------------------------------------------------------------------------- Hugging Face directories
# SmolLM2's tokenizer files written by ``tools/gguf_to_hf --tokenizer-only`` are read by
# ``Tokenizer.from_hf_directory`` and by transformers' ``AutoTokenizer``: both must encode every
# text as the GGUF tokenizer does, and both must render every conversation alike, tools included.

# A template of our own that uses what tool-calling templates use: tools as JSON, an assistant's
# tool_calls (content null) with arguments through tojson, tool results, a namespace, dict(),
# loop controls, the generation tag, reasoning, raise_exception and the special tokens.
TOOL_TEMPLATE = """{{- bos_token -}}
{%- set ns = namespace(tool_turns=0, system=none) -%}
{%- if messages[0].role == 'system' %}{% set ns.system = messages[0].content %}{% endif -%}
<|im_start|>system
{{ ns.system or 'You are helpful.' }}
{%- if tools %}

# Tools
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}
{%- endif %}<|im_end|>
{% for message in messages -%}
{%- if message.role == 'system' %}{% continue %}{% endif -%}
{%- if message.role not in ['user', 'assistant', 'tool'] %}{{ raise_exception('unknown role ' + message.role) }}{% endif -%}
{%- if message.role == 'tool' %}{% set ns.tool_turns = ns.tool_turns + 1 %}<|im_start|>user
<tool_response id="{{ message.tool_call_id }}">{{ message.content }}</tool_response><|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{% generation %}{%- if message.reasoning_content %}<think>{{ message.reasoning_content }}</think>{% endif -%}
{%- if message.content is defined %}{{ message.content }}{% endif -%}
{%- for call in message.tool_calls or [] %}
<tool_call>{{ dict(name=call.function.name, arguments=call.function.arguments) | tojson(sort_keys=true) }}</tool_call>
{%- endfor %}{% endgeneration %}<|im_end|>
{% else %}<|im_start|>user
{{ message.content }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}
{{- '(' ~ ns.tool_turns ~ ' tool turns' ~ (', ' ~ extra if extra is defined else '') ~ ')' -}}"""

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city, in °C",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}},
         {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
             "a": {"type": "integer"}, "b": {"type": "integer"}}}}}]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}],
    [{"role": "user", "content": "Weather in Paris and 2+3?"},
     {"role": "assistant", "content": None, "reasoning_content": "Two calls.", "tool_calls": [
         {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
         {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
     {"role": "tool", "tool_call_id": "call_1", "content": "18 °C, ciel dégagé"},
     {"role": "tool", "tool_call_id": "call_2", "content": "5"},
     {"role": "assistant", "content": "Paris: 18 °C; 2+3 = 5."}],
]


@pytest.fixture(scope="module")
def hf_tokenizer_dir(tmp_path_factory):
    from tools.gguf_to_hf import export

    return export("smollm2-135m-instruct", tmp_path_factory.mktemp("smollm2-tokenizer"), tokenizer_only=True)


@pytest.fixture(scope="module")
def transformers_tokenizer(hf_tokenizer_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(hf_tokenizer_dir)


def corpus() -> list[str]:
    """Real text: the perplexity paragraphs, this project's docs and code, chat-formatted strings."""
    from pathlib import Path

    from benchmarks.model.perplexity import PARAGRAPHS

    root = Path(__file__).resolve().parents[3]
    texts = list(PARAGRAPHS)
    for path in [root / "README.md", *sorted((root / "docs").glob("*.md")), root / "tensorrt_llm" / "llmapi" / "tokenizer.py"]:
        if path.is_file():
            text = path.read_text(encoding="utf-8")
            texts += [text[i:i + 2000] for i in range(0, len(text), 2000)]
    texts += ["<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", "  leading\ttabs\n\n\r\nand 12345 digits",
              "émoji 🚀 中文 naïve 🇫🇷", "<|endoftext|><|endoftext|>x", ""]
    return texts


def test_the_hf_files_encode_every_text_as_the_gguf_tokenizer(tok, hf_tokenizer_dir, transformers_tokenizer):
    ours = Tokenizer.from_hf_directory(hf_tokenizer_dir)
    texts = corpus()
    assert sum(len(t) for t in texts) > 20_000
    for text in texts:
        expected = tok.encode(text)
        assert ours.encode(text) == expected, text[:80]
        assert transformers_tokenizer(text)["input_ids"] == expected, text[:80]
        assert ours.decode(expected) == transformers_tokenizer.decode(expected, skip_special_tokens=True)
    assert (ours.eos_token_id, ours.bos_token_id, ours.add_bos_token) == (tok.eos_token_id, tok.bos_token_id, False)
    assert ours.special_tokens == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>",
                                   "pad_token": "<|im_end|>"}


@given(st.text(st.characters(exclude_categories=["Cs"]), max_size=80))
def test_any_text_encodes_alike_through_transformers(tok, hf_tokenizer_dir, transformers_tokenizer, text):
    assert transformers_tokenizer(text)["input_ids"] == tok.encode(text)


@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["one turn", "system and turns", "tool calls"])
@pytest.mark.parametrize("with_tools", [False, True], ids=["no tools", "tools"])
@pytest.mark.parametrize("template", ["model", "tool"])
def test_chat_templates_render_what_transformers_renders(hf_tokenizer_dir, transformers_tokenizer, conversation,
                                                         with_tools, template):
    ours = Tokenizer.from_hf_directory(hf_tokenizer_dir)
    source = None if template == "model" else TOOL_TEMPLATE
    if template == "model" and any(m.get("tool_calls") or m["role"] == "tool" for m in conversation):
        pytest.skip("SmolLM2's own template concatenates content, which a tool-call message leaves out")
    tools = TOOLS if with_tools else None
    for generation_prompt in (True, False):
        expected = transformers_tokenizer.apply_chat_template(
            conversation, tools=tools, chat_template=source, add_generation_prompt=generation_prompt, tokenize=False)
        got = ours.apply_chat_template(conversation, add_generation_prompt=generation_prompt, tools=tools,
                                       chat_template=source)
        assert got == expected
    extra = transformers_tokenizer.apply_chat_template(conversation, tools=tools, chat_template=TOOL_TEMPLATE,
                                                       add_generation_prompt=True, tokenize=False, extra="kw")
    assert ours.apply_chat_template(conversation, tools=tools, chat_template=TOOL_TEMPLATE, extra="kw") == extra


def test_named_templates_and_the_jinja_file_are_chosen_as_transformers_chooses(hf_tokenizer_dir, tmp_path):
    import json
    import shutil

    transformers = pytest.importorskip("transformers")
    directory = shutil.copytree(hf_tokenizer_dir, tmp_path / "named")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": "plain: {{ messages[0].content }}"},
                               {"name": "tool_use", "template": TOOL_TEMPLATE}]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    ours = Tokenizer.from_hf_directory(directory)
    conversation = CONVERSATIONS[2]
    for tools in (None, TOOLS):
        assert ours.apply_chat_template(conversation, tools=tools) == theirs.apply_chat_template(
            conversation, tools=tools, add_generation_prompt=True, tokenize=False)
    assert ours.chat_template == "plain: {{ messages[0].content }}"
    (directory / "chat_template.jinja").write_text("from the file: {{ messages | length }}")
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    ours = Tokenizer.from_hf_directory(directory)
    assert ours.apply_chat_template(conversation) == theirs.apply_chat_template(
        conversation, add_generation_prompt=True, tokenize=False) == "from the file: 5"


def test_a_namespace_refuses_private_attributes(hf_tokenizer_dir):
    ours = Tokenizer.from_hf_directory(hf_tokenizer_dir)
    with pytest.raises(ValueError, match="underscore-prefixed"):
        ours.apply_chat_template([{"role": "user", "content": "x"}],
                                 chat_template="{% set ns = namespace(_secret=1) %}{{ ns }}")


def sentencepiece_style_tokenizer() -> Tokenizer:
    """A Llama-2/Mistral-style pipeline: Metaspace pre-tokenizer, byte fallback, a decoder that
    strips the space of the first token."""
    from tokenizers import Tokenizer as Pipeline
    from tokenizers import decoders, models, pre_tokenizers

    pieces = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], "▁", "H", "e", "l", "o", "w", "r", "d",
              "▁H", "▁He", "▁Hel", "▁Hell", "▁Hello", "▁w", "▁wo", "▁wor", "▁worl", "▁world"]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    merges = [("▁", "H"), ("▁H", "e"), ("▁He", "l"), ("▁Hel", "l"), ("▁Hell", "o"), ("▁", "w"), ("▁w", "o"),
              ("▁wo", "r"), ("▁wor", "l"), ("▁worl", "d")]
    pipeline = Pipeline(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    pipeline.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    pipeline.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                          decoders.Strip(" ", 1, 0)])
    pipeline.add_special_tokens(["<unk>", "<s>", "</s>"])
    return Tokenizer(pipeline, eos_token_id=2, bos_token_id=1)


@given(st.lists(st.sampled_from(["Hello", "world", "é", "😀", "Hello world", "日"]), max_size=8),
       st.lists(st.integers(1, 4), min_size=1, max_size=8), st.booleans())
def test_streamed_text_keeps_spaces_with_a_sentencepiece_style_decoder(words, steps, bos):
    tok = sentencepiece_style_tokenizer()
    ids = ([1] if bos else []) + tok.encode(" ".join(words))
    expected = tok.decode(ids)
    detok = IncrementalDetokenizer(tok)
    out, start, i = "", 0, 0
    while start < len(ids):
        size = steps[i % len(steps)]
        delta = detok.step(ids[start:start + size])
        assert not delta.endswith("\ufffd")
        out += delta
        start, i = start + size, i + 1
    assert out + detok.flush() == expected


def test_token_bytes_of_a_sentencepiece_style_vocabulary():
    """What a grammar matcher reads: ``▁`` is a space, ``<0xNN>`` its byte, specials their text;
    every id's bytes, concatenated, are the decoded text's."""
    tok = sentencepiece_style_tokenizer()
    table = tok.token_bytes()
    assert table[tok.token_to_id("▁world")] == b" world" and table[tok.token_to_id("<0xC3>")] == b"\xc3"
    assert table[2] == b"</s>"
    ids = tok.encode("Hello world é 😀")
    assert b"".join(table[i] for i in ids) == b" " + "Hello world é 😀".encode()  # the decoder strips that space


def test_a_tokenized_chat_has_the_templates_bos_only(hf_tokenizer_dir, tmp_path, transformers_tokenizer):
    """A tokenizer whose post-processor adds BOS (Llama 3's) and a template that writes it: the ids
    transformers' ``apply_chat_template(tokenize=True)`` gives, one BOS, not two."""
    import json
    import shutil

    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer as Pipeline
    from tokenizers import processors

    directory = shutil.copytree(hf_tokenizer_dir, tmp_path / "with-bos")
    pipeline = Pipeline.from_file(str(directory / "tokenizer.json"))
    pipeline.post_processor = processors.TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
    pipeline.save(str(directory / "tokenizer.json"))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    ours = Tokenizer.from_hf_directory(directory)
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    chat = [{"role": "user", "content": "Hi"}]
    assert ours.add_bos_token and ours.encode("Hi") == theirs("Hi")["input_ids"] == [1, 26843]
    expected = theirs.apply_chat_template(chat, tokenize=True, return_dict=False)
    assert ours.apply_chat_template(chat, tokenize=True) == expected == [1, 26843]
