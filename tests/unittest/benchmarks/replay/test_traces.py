"""Trace loaders: the public trace files, token content, malformed input, Trace transforms."""

from __future__ import annotations

import json
import pathlib
import pickle
import re

import pytest

from benchmarks.replay.traces import (
    MOONCAKE_BLOCK_TOKENS,
    Trace,
    TraceFormatError,
    TraceRequest,
    load_trace,
)

SHARED_TRACES = pathlib.Path(__file__).resolve().parents[4].parent / "shared" / "traces"
MOONCAKE_FILE = SHARED_TRACES / "mooncake_synthetic_trace.jsonl"
AZURE_FILE = SHARED_TRACES / "azure_llm_2023_code.csv"


def _shared(path: pathlib.Path) -> pathlib.Path:
    if not path.exists():
        pytest.skip(f"{path} not available")
    return path


def _write(tmp_path: pathlib.Path, name: str, lines: list[str]) -> pathlib.Path:
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _mooncake_line(ts: int, input_len: int, hash_ids: list[int], output_len: int = 8) -> str:
    return json.dumps({"timestamp": ts, "input_length": input_len, "output_length": output_len, "hash_ids": hash_ids})


def _azure_lines(rows: list[tuple[str, int, int]]) -> list[str]:
    return ["TIMESTAMP,ContextTokens,GeneratedTokens"] + [f"{ts},{ctx},{gen}" for ts, ctx, gen in rows]


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _check_trace_shape(trace: Trace) -> None:
    arrivals = [r.arrival_s for r in trace.requests]
    assert arrivals[0] == 0.0
    assert arrivals == sorted(arrivals)
    assert all(r.output_len >= 1 and r.input_len >= 1 for r in trace.requests)


# --- the public trace files -------------------------------------------------------------


def test_mooncake_file_loads_whole():
    path = _shared(MOONCAKE_FILE)
    trace = load_trace(path)
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    assert trace.format == "mooncake"
    assert len(trace.requests) == len(rows) == 3993
    _check_trace_shape(trace)
    for request, row in zip(trace.requests, rows):
        assert request.input_len == row["input_length"]
        assert request.output_len == max(1, row["output_length"])
        assert request.arrival_s == pytest.approx((row["timestamp"] - rows[0]["timestamp"]) / 1000.0)
    assert [r.request_index for r in trace.requests] == list(range(3993))
    for request in trace.requests[:20]:  # a sample; expanding everything is the benchmark's job
        tokens = request.prompt_token_ids()
        assert len(tokens) == request.input_len
        assert all(1 <= t < 32000 for t in tokens)


def test_azure_file_loads_whole():
    path = _shared(AZURE_FILE)
    trace = load_trace(path)
    rows = path.read_text().splitlines()[1:]
    assert trace.format == "azure"
    assert len(trace.requests) == len(rows) == 8819
    _check_trace_shape(trace)
    for request, row in zip(trace.requests, rows):
        _, ctx, gen = row.split(",")
        assert (request.input_len, request.output_len) == (int(ctx), max(1, int(gen)))
    # 2023-11-16 18:17:03.9799600 -> 18:17:04.0319600
    assert trace.requests[1].arrival_s == pytest.approx(0.052, abs=1e-9)


def test_mooncake_file_reuse_is_real():
    path = _shared(MOONCAKE_FILE)
    trace = load_trace(path)
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    by_first_id: dict[int, int] = {}
    pairs = 0
    for i, row in enumerate(rows[:400]):
        j = by_first_id.setdefault(row["hash_ids"][0], i)
        if j == i:
            continue
        shared = _common_prefix_len(rows[i]["hash_ids"], rows[j]["hash_ids"])
        a, b = trace.requests[i].prompt_token_ids(), trace.requests[j].prompt_token_ids()
        expected = min(MOONCAKE_BLOCK_TOKENS * shared, len(a), len(b))
        assert a[:expected] == b[:expected]
        if expected < min(len(a), len(b)):
            assert a[expected] != b[expected]
        pairs += 1
    assert pairs > 10
    assert all(len(r.prompt_token_ids()) == r.input_len for r in trace.requests[:200])


def test_num_requests_keeps_first_rows():
    trace = load_trace(_shared(MOONCAKE_FILE), num_requests=10)
    assert len(trace.requests) == 10
    assert trace.requests[9].input_len == json.loads(MOONCAKE_FILE.read_text().splitlines()[9])["input_length"]


# --- mooncake token content -------------------------------------------------------------


def test_mooncake_shared_hash_ids_share_tokens(tmp_path):
    block = MOONCAKE_BLOCK_TOKENS
    path = _write(tmp_path, "t.jsonl", [
        _mooncake_line(0, 3 * block, [1, 2, 3]),
        _mooncake_line(5, 2 * block + 100, [1, 2, 4]),   # shares 2 ids, then differs
        _mooncake_line(9, block + 7, [1, 2]),            # shares 2 ids, the second one partial
        _mooncake_line(9, 2 * block, [5, 1]),             # id 1 at another position
    ])
    a, b, c, d = (r.prompt_token_ids() for r in load_trace(path).requests)
    assert [len(a), len(b), len(c), len(d)] == [3 * block, 2 * block + 100, block + 7, 2 * block]
    assert _common_prefix_len(a, b) == 2 * block  # identical first 2*512, different right after
    assert _common_prefix_len(a, c) == len(c)  # the partial last block is still the same content
    assert d[block:] == a[:block]  # equal ids give equal tokens at any position
    assert _common_prefix_len(a, d) == 0
    for tokens in (a, b, c, d):
        assert all(1 <= t < 32000 for t in tokens)


def test_mooncake_tokens_respect_vocab_and_are_stable(tmp_path):
    path = _write(tmp_path, "t.jsonl", [_mooncake_line(0, 1000, [7, 8])])
    small = load_trace(path, vocab_size=64).requests[0].prompt_token_ids()
    assert all(1 <= t < 64 for t in small) and len(set(small)) > 50
    first = load_trace(path).requests[0].prompt_token_ids()
    assert first == load_trace(path, seed=123).requests[0].prompt_token_ids()  # ids only, not seed


def test_vocab_size_validated(tmp_path):
    path = _write(tmp_path, "t.jsonl", [_mooncake_line(0, 10, [1])])
    with pytest.raises(ValueError, match="vocab_size"):
        load_trace(path, vocab_size=63)


# --- malformed input --------------------------------------------------------------------

_GOOD = _mooncake_line(0, 600, [1, 2])

MALFORMED_JSONL = {
    "bad JSON": ([_GOOD, "{not json", _GOOD], 2, "bad JSON"),
    "not an object": ([_GOOD, _GOOD, "[1, 2]"], 3, "JSON object"),
    "missing field": ([_GOOD, json.dumps({"timestamp": 1, "input_length": 10, "hash_ids": [1]})], 2, "output_length"),
    "wrong type": ([_GOOD, json.dumps({"timestamp": 1, "input_length": "10", "output_length": 1, "hash_ids": [1]})], 2, "input_length"),
    "zero input": ([_GOOD, _GOOD, _mooncake_line(3, 0, [1])], 3, "input_length"),
    "negative input": ([_mooncake_line(3, -5, [1])], 1, "input_length"),
    "too long for ids": ([_GOOD, _mooncake_line(3, 1025, [1, 2])], 2, "does not match"),
    "too short for ids": ([_GOOD, _mooncake_line(3, 512, [1, 2])], 2, "does not match"),
    "backwards": ([_mooncake_line(10, 600, [1, 2]), _mooncake_line(12, 600, [1, 2]), _mooncake_line(11, 600, [1, 2])], 3, "backwards"),
    "bad hash id": ([_GOOD, _mooncake_line(3, 10, [-1])], 2, "hash_ids"),
    "blank lines keep numbering": ([_GOOD, "", "", "{oops"], 4, "bad JSON"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED_JSONL))
def test_malformed_mooncake_names_file_and_line(tmp_path, case):
    lines, line_no, what = MALFORMED_JSONL[case]
    path = _write(tmp_path, "m.jsonl", lines)
    with pytest.raises(TraceFormatError) as info:
        load_trace(path, "mooncake")
    assert str(info.value).startswith(f"{path}:{line_no}: ")
    assert what in str(info.value)
    assert info.value.line == line_no


MALFORMED_AZURE = {
    "bad timestamp": ([("2023-11-16 18:17:03.1", 10, 1), ("yesterday", 10, 1)], 3, "TIMESTAMP"),
    "bad date": ([("2023-02-30 18:17:03.1", 10, 1)], 2, "TIMESTAMP"),
    "zero context": ([("2023-11-16 18:17:03.1", 10, 1), ("2023-11-16 18:17:04", 0, 1)], 3, "ContextTokens"),
    "negative generated": ([("2023-11-16 18:17:03.1", 10, -1)], 2, "GeneratedTokens"),
    "not an int": ([("2023-11-16 18:17:03.1", 10, 1), ("2023-11-16 18:17:04", "1e3", 1)], 3, "ContextTokens"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED_AZURE))
def test_malformed_azure_names_file_and_line(tmp_path, case):
    rows, line_no, what = MALFORMED_AZURE[case]
    path = _write(tmp_path, "a.csv", _azure_lines(rows))
    with pytest.raises(TraceFormatError, match=rf"^{re.escape(str(path))}:{line_no}: .*{what}"):
        load_trace(path)


def test_malformed_files(tmp_path):
    empty = tmp_path / "e.jsonl"
    empty.write_text("\n \n")
    with pytest.raises(TraceFormatError, match=rf"^{re.escape(str(empty))}:1: empty file"):
        load_trace(empty)
    header_only = _write(tmp_path, "h.csv", _azure_lines([]))
    with pytest.raises(TraceFormatError, match=rf"^{re.escape(str(header_only))}:2: no requests"):
        load_trace(header_only)
    bad_header = _write(tmp_path, "b.csv", ["TIME,Context,Generated", "1,2,3"])
    with pytest.raises(TraceFormatError, match=rf"^{re.escape(str(bad_header))}:1: .*TIMESTAMP"):
        load_trace(bad_header)
    good = _write(tmp_path, "g.jsonl", [_GOOD])
    with pytest.raises(TraceFormatError, match=rf"^{re.escape(str(good))}:1: unknown format 'sharegpt'"):
        load_trace(good, "sharegpt")
    unknown_keys = _write(tmp_path, "u.jsonl", [json.dumps({"a": 1})])
    with pytest.raises(TraceFormatError, match=rf"^{re.escape(str(unknown_keys))}:1: cannot detect"):
        load_trace(unknown_keys)
    missing_prompt = _write(tmp_path, "p.jsonl", [json.dumps({"task_id": 0, "output_tokens": 3, "input_ids": [5]}),
                                                  json.dumps({"task_id": 1, "output_tokens": 3})])
    with pytest.raises(TraceFormatError, match=rf"^{re.escape(str(missing_prompt))}:2: .*input_ids"):
        load_trace(missing_prompt)


def test_error_is_a_value_error_and_picklable(tmp_path):
    err = TraceFormatError("f.jsonl", 3, "bad")
    assert isinstance(err, ValueError) and str(err) == "f.jsonl:3: bad"
    copy = pickle.loads(pickle.dumps(err))
    assert (copy.path, copy.line, copy.what) == ("f.jsonl", 3, "bad")


def test_num_requests_stops_before_bad_rows(tmp_path):
    path = _write(tmp_path, "m.jsonl", [_GOOD, _GOOD, "{broken"])
    assert len(load_trace(path, num_requests=2).requests) == 2
    with pytest.raises(TraceFormatError):
        load_trace(path)


def test_zero_outputs_clamped_and_noted(tmp_path):
    path = _write(tmp_path, "m.jsonl", [_mooncake_line(0, 10, [1], output_len=0), _mooncake_line(1, 10, [2], output_len=0)])
    trace = load_trace(path)
    assert [r.output_len for r in trace.requests] == [1, 1]
    assert "2 rows had output_length=0, clamped to 1" in trace.notes
    azure = _write(tmp_path, "a.csv", _azure_lines([("2023-11-16 18:17:03.9799600", 5, 0)]))
    assert "1 rows had GeneratedTokens=0, clamped to 1" in load_trace(azure).notes


# --- azure --------------------------------------------------------------------------------


def test_azure_timestamps_parsed_to_the_microsecond(tmp_path):
    path = _write(tmp_path, "a.csv", _azure_lines([
        ("2023-11-16 23:59:59.9999999", 10, 1),  # datetime keeps microseconds: .999999
        ("2023-11-17 00:00:01.5", 10, 1),
        ("2023-11-17T00:00:02", 10, 1),
        ("2023-11-17 01:00:03+01:00", 10, 1),  # an offset: the same instant in UTC
    ]))
    arrivals = [r.arrival_s for r in load_trace(path).requests]
    assert arrivals == pytest.approx([0.0, 1.500001, 2.000001, 3.000001], abs=1e-9)


def test_azure_out_of_order_rows_sorted_and_noted(tmp_path):
    path = _write(tmp_path, "a.csv", _azure_lines([("2023-11-16 18:00:02", 10, 1), ("2023-11-16 18:00:01", 20, 1)]))
    trace = load_trace(path)
    assert [(r.request_index, r.input_len, r.arrival_s) for r in trace.requests] == [(1, 20, 0.0), (0, 10, 1.0)]
    assert any("out of timestamp order" in note for note in trace.notes)


def test_azure_system_prompt_shared_prefix(tmp_path):
    sys_len = 100
    path = _write(tmp_path, "a.csv", _azure_lines([
        ("2023-11-16 18:00:00", 300, 1),
        ("2023-11-16 18:00:01", 150, 1),
        ("2023-11-16 18:00:02", 60, 1),   # shorter than the system prompt
        ("2023-11-16 18:00:03", 1, 1),
    ]))
    trace = load_trace(path, system_prompt_len=sys_len, seed=3)
    a, b, short, one = (r.prompt_token_ids() for r in trace.requests)
    assert [len(a), len(b), len(short), len(one)] == [300, 150, 60, 1]
    assert _common_prefix_len(a, b) == sys_len
    assert _common_prefix_len(a, short) == 59  # ContextTokens - 1 tokens of the system prompt
    assert short[59] != a[59]
    assert any(note.startswith(f"synthetic shared system prompt of {sys_len} tokens added to every Azure request")
               for note in trace.notes)
    # without a system prompt every prompt is unique; seed changes content
    plain = load_trace(path, seed=3)
    assert _common_prefix_len(*(r.prompt_token_ids() for r in plain.requests[:2])) == 0
    assert not any("system prompt" in note for note in plain.notes)
    assert load_trace(path, seed=4).requests[0].prompt_token_ids() != plain.requests[0].prompt_token_ids()


def test_system_prompt_ignored_for_other_formats_is_noted(tmp_path):
    path = _write(tmp_path, "m.jsonl", [_GOOD])
    trace = load_trace(path, system_prompt_len=64)
    assert any("ignored" in note for note in trace.notes)


# --- trtllm -------------------------------------------------------------------------------


def test_trtllm_input_ids_and_prompt(tmp_path):
    path = _write(tmp_path, "d.json", [
        json.dumps({"task_id": 0, "input_ids": [5, 6, 7], "output_tokens": 4}),
        json.dumps({"task_id": 1, "prompt": "hé", "output_tokens": 2}),
        json.dumps({"task_id": 2, "input_ids": [40000, 1], "output_tokens": 0}),
    ])
    trace = load_trace(path)
    assert trace.format == "trtllm"
    assert [r.prompt_token_ids().tolist() for r in trace.requests] == [[5, 6, 7], [ord("h") + 1, 0xC3 + 1, 0xA9 + 1], [1 + 40000 % 31999, 1]]
    assert [r.output_len for r in trace.requests] == [4, 2, 1]
    assert [r.arrival_s for r in trace.requests] == [0.0, 0.0, 0.0]
    notes = " | ".join(trace.notes)
    assert "every request arrives at 0.0 unless retimed" in notes
    assert "tokenized byte-level" in notes and "folded" in notes and "clamped" in notes
    with pytest.raises(TraceFormatError, match=r":1: .*input_ids"):
        load_trace(_write(tmp_path, "bad.jsonl", [json.dumps({"task_id": 0, "input_ids": [1, "2"], "output_tokens": 4})]))
    with pytest.raises(TraceFormatError, match=r":1: empty prompt"):
        load_trace(_write(tmp_path, "empty.jsonl", [json.dumps({"task_id": 0, "prompt": "", "output_tokens": 4})]))


def test_auto_detection(tmp_path):
    assert load_trace(_write(tmp_path, "x.jsonl", ["", _GOOD])).format == "mooncake"
    assert load_trace(_write(tmp_path, "y.csv", _azure_lines([("2023-11-16 18:00:00", 3, 1)]))).format == "azure"
    assert load_trace(_write(tmp_path, "z.txt", [_GOOD]), "auto").format == "mooncake"


# --- Trace transforms ----------------------------------------------------------------------


def _toy_trace(n: int = 200) -> Trace:
    requests = tuple(TraceRequest(i, float(i), 10 + i, 5) for i in range(n))
    return Trace("toy", "trtllm", requests, ("original note",))


def test_retimed_is_seeded_poisson_in_order():
    trace = _toy_trace()
    retimed = trace.retimed(4.0, seed=1)
    arrivals = [r.arrival_s for r in retimed.requests]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)
    assert (len(arrivals) - 1) / arrivals[-1] == pytest.approx(4.0)
    assert [r.input_len for r in retimed.requests] == [r.input_len for r in trace.requests]
    assert retimed == trace.retimed(4.0, seed=1)
    assert retimed != trace.retimed(4.0, seed=2)
    assert retimed.notes == ("original note", "arrivals replaced by Poisson arrivals at 4 req/s (seed 1)")


def test_scaled_and_head():
    trace = _toy_trace(10)
    scaled = trace.scaled(0.5)
    assert [r.arrival_s for r in scaled.requests] == [i * 0.5 for i in range(10)]
    assert scaled.notes[-1] == "arrival times scaled by 0.5"
    head = trace.head(3)
    assert [r.request_index for r in head.requests] == [0, 1, 2]
    assert head.notes[-1] == "kept the first 3 of 10 requests"
    assert trace.head(50) is trace
    with pytest.raises(ValueError):
        trace.scaled(-1.0)
    with pytest.raises(ValueError):
        trace.retimed(0.0, seed=0)


def test_transforms_keep_subclass_content(tmp_path):
    path = _write(tmp_path, "m.jsonl", [_mooncake_line(0, 600, [1, 2]), _mooncake_line(1000, 600, [1, 3])])
    trace = load_trace(path)
    moved = trace.scaled(2.0).retimed(1.0, seed=0).head(1)
    assert type(moved.requests[0]) is type(trace.requests[0])
    assert moved.requests[0].prompt_token_ids() == trace.requests[0].prompt_token_ids()


def test_trace_validates_order():
    with pytest.raises(ValueError, match="sorted"):
        Trace("x", "trtllm", (TraceRequest(0, 1.0, 5, 1), TraceRequest(1, 0.5, 5, 1)))
    with pytest.raises(ValueError):
        TraceRequest(0, 0.0, 5, 0)
