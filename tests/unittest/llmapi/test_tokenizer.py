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
