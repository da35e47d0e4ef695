"""The peer benchmark's numbers, one table: sampled against ``temperature: 0`` per level, the
server (GuideLLM) against the engine in-process, and ratios to published figures where the
settings are comparable.

    python -m benchmarks.gpu.peer_summary OUT_OR_TARBALL [...] [--out summary.md]
    python -m benchmarks.gpu.peer_summary --figures        # the published figures, as a table

Inputs: directories or ``PHASE.tar.gz`` files holding what ``peer_serving`` writes
(``peer_auto.json``, ``peer_fp8.json``, ``engine_auto.json``, ``engine_fp8.json``); the first of
each name found wins. The published figures are ``peer_figures.json`` beside this file.

Every level is summed up alike (:func:`level_summary`), from GuideLLM's JSON for the server
(:func:`summarize_guidellm`) and from the token arrival times ``peer_engine`` records:

``completed`` / ``incomplete`` / ``errored``
    requests that finished / were cut at the level's end (their tokens so far count) / failed.
``output_tokens_per_s``
    output tokens of every request (completed and cut) over the level's duration.
``ttft_ms``, ``itl_ms`` (p50, p99)
    as GuideLLM defines them: TTFT from the request's start to its first token; ITL per request
    (last token - first token) / (tokens - 1), weighted by tokens - 1 across requests; over
    completed and cut requests together (a 1024-token answer at 128 concurrent streams outlasts
    a short level).
``decode_tokens_per_s``
    concurrency x 1000 / ITL p50: the steady decode rate the level's ITL implies.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tarfile
from pathlib import Path
from typing import Iterable, Sequence

FIGURES = Path(__file__).with_name("peer_figures.json")
RECORDS = ("peer_auto.json", "peer_fp8.json", "engine_auto.json", "engine_fp8.json")
SAMPLINGS = ("sampled", "greedy")  # GuideLLM's defaults (temperature omitted); temperature 0


# ------------------------------------------------------------------------------ statistics


def weighted_quantile(pairs: Iterable[tuple[float, float]], q: float) -> float | None:
    """The ``q`` quantile of values weighted by their weights (zero weights ignored)."""
    pairs = sorted((v, w) for v, w in pairs if w > 0)
    total = sum(w for _, w in pairs)
    if not pairs:
        return None
    running = 0.0
    for value, weight in pairs:
        running += weight
        if running >= q * total:
            return value
    return pairs[-1][0]


def request_figures(start: float, token_times: Sequence[float]) -> dict:
    """One request's TTFT and ITL (ms) from its start and its tokens' arrival times, as GuideLLM
    computes them; None where undefined."""
    ttft = 1000 * (token_times[0] - start) if token_times else None
    itl = (1000 * (token_times[-1] - token_times[0]) / (len(token_times) - 1)) if len(token_times) > 1 else None
    return {"tokens": len(token_times), "ttft_ms": ttft, "itl_ms": itl}


def level_summary(concurrency: int, duration_s: float, requests: Sequence[dict]) -> dict:
    """One level from its requests, each ``{"status": "completed" | "incomplete" | "errored",
    "tokens", "ttft_ms", "itl_ms"}`` (module docstring)."""
    counted = [r for r in requests if r["status"] != "errored"]
    tokens = sum(r["tokens"] or 0 for r in counted)
    ttft = [(r["ttft_ms"], 1.0) for r in counted if r["ttft_ms"] is not None]
    itl = [(r["itl_ms"], r["tokens"] - 1) for r in counted if r["itl_ms"] is not None]
    itl_p50 = weighted_quantile(itl, 0.5)
    return {
        "concurrency": concurrency, "duration_s": duration_s,
        **{status: sum(r["status"] == status for r in requests) for status in ("completed", "incomplete", "errored")},
        "output_tokens": tokens, "output_tokens_per_s": tokens / duration_s if duration_s else None,
        "ttft_ms": {"p50": weighted_quantile(ttft, 0.5), "p99": weighted_quantile(ttft, 0.99)},
        "itl_ms": {"p50": itl_p50, "p99": weighted_quantile(itl, 0.99)},
        "decode_tokens_per_s": concurrency * 1000 / itl_p50 if itl_p50 else None,
    }


_GUIDELLM_STATUS = {"successful": "completed", "incomplete": "incomplete", "errored": "errored"}


def summarize_guidellm(report: dict) -> list[dict]:
    """One level per benchmark (concurrency level) of a GuideLLM JSON report, from its
    per-request records (every request is kept: ``sample_size`` unset), with what the request
    bodies said about temperature (``body_temperature``: the value, or "omitted")."""
    levels = []
    for benchmark in report.get("benchmarks", []):
        strategy = benchmark.get("config", {}).get("strategy", {})
        requests, temperatures, cached = [], set(), []
        for key, status in _GUIDELLM_STATUS.items():
            for record in benchmark.get("requests", {}).get(key, []):
                timings = record.get("info", {}).get("timings", {})
                first, last = timings.get("first_token_iteration"), timings.get("last_token_iteration")
                tokens = record.get("output_tokens") or 0
                start = timings.get("request_start")
                requests.append({
                    "status": status, "tokens": tokens,
                    "ttft_ms": 1000 * (first - start) if first is not None and start is not None else None,
                    "itl_ms": 1000 * (last - first) / (tokens - 1) if first is not None and last is not None
                    and tokens > 1 else None,
                })
                body = json.loads(record.get("request_args") or "{}").get("body") or {}
                temperatures.add(str(body.get("temperature", "omitted")))
                cached.append(record.get("cached_tokens") or 0)
        level = level_summary(strategy.get("streams") or strategy.get("max_concurrency"),
                              benchmark.get("duration") or 0.0, requests)
        level["body_temperature"] = ",".join(sorted(temperatures)) or None
        # prompt tokens the server reported cached (usage.prompt_tokens_details): near 0 unless a
        # run re-sends prompts it already served
        level["cached_tokens_mean"] = sum(cached) / len(cached) if cached else None
        level["guidellm_totals"] = benchmark.get("metrics", {}).get("request_totals")
        levels.append(level)
    return levels


# ------------------------------------------------------------------------------ reading results


def load_records(paths: Sequence[str | Path]) -> dict[str, dict]:
    """``RECORDS`` found in directories or tarballs (the first of each name wins)."""
    found: dict[str, dict] = {}
    for path in map(Path, paths):
        if path.is_dir():
            for name in RECORDS:
                candidate = next(iter(sorted(path.rglob(name))), None)
                if candidate is not None and name not in found:
                    found[name] = json.loads(candidate.read_text())
        elif path.is_file() and path.name.endswith((".tar.gz", ".tgz")):
            with tarfile.open(path) as tar:
                for member in tar.getmembers():
                    name = Path(member.name).name
                    if name in RECORDS and name not in found:
                        found[name] = json.loads(tar.extractfile(member).read())
        elif path.is_file() and path.name in RECORDS:
            found.setdefault(path.name, json.loads(path.read_text()))
    return found


def _level(record: dict | None, shape: str, sampling: str, concurrency: int) -> dict | None:
    run = (record or {}).get("runs", {}).get(shape, {}).get(sampling) or {}
    return next((level for level in run.get("levels") or [] if level.get("concurrency") == concurrency), None)


def _fmt(value, digits: int = 1) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}" if isinstance(value, float) else f"{value:,}"


def _ratio(a, b) -> str:
    return f"{a / b:.2f}" if a is not None and b not in (None, 0) else "-"


def comparison_rows(records: dict[str, dict]) -> list[dict]:
    """One row per (KV dtype, shape, concurrency) with both samplings, server and engine."""
    rows = []
    for kv in ("auto", "fp8"):
        serve, engine = records.get(f"peer_{kv}.json"), records.get(f"engine_{kv}.json")
        if serve is None and engine is None:
            continue
        shapes = list(dict.fromkeys([*(serve or {}).get("runs", {}), *(engine or {}).get("runs", {})]))
        for shape in shapes:
            levels = sorted({level["concurrency"] for record in (serve, engine) if record
                             for run in record.get("runs", {}).get(shape, {}).values() if run
                             for level in run.get("levels") or []})
            for concurrency in levels:
                row = {"kv": kv, "shape": shape, "concurrency": concurrency}
                for sampling in SAMPLINGS:
                    row[f"http_{sampling}"] = _level(serve, shape, sampling, concurrency)
                    row[f"engine_{sampling}"] = _level(engine, shape, sampling, concurrency)
                rows.append(row)
    return rows


def _get(level: dict | None, *keys):
    value = level
    for key in keys:
        value = None if value is None else value.get(key)
    return value


def render_table(rows: list[dict]) -> str:
    """The comparison as markdown: per level, sampled (S) and temperature 0 (G) over HTTP, their
    ratios S/G, and the engine's output rate with HTTP / engine."""
    head = ("| KV | ISL/OSL | conc. | errors S / G | done+cut S / G | ITL p50 ms S / G (S/G) | TTFT p50 ms S / G (S/G)"
            " | out tok/s S / G (S/G) | engine out tok/s S / G | HTTP/engine S / G |")
    lines = [head, "|" + "---|" * 10]
    for row in rows:
        s, g, es, eg = row["http_sampled"], row["http_greedy"], row["engine_sampled"], row["engine_greedy"]

        def pair(key, *sub, digits=1):
            a, b = _get(s, key, *sub), _get(g, key, *sub)
            return f"{_fmt(a, digits)} / {_fmt(b, digits)} ({_ratio(a, b)})"

        done = " / ".join("-" if level is None else f"{level['completed']}+{level['incomplete']}" for level in (s, g))
        errors = " / ".join("-" if level is None else str(level["errored"]) for level in (s, g))
        engine = " / ".join(_fmt(_get(level, "output_tokens_per_s"), 0) for level in (es, eg))
        http_over_engine = " / ".join(_ratio(_get(h, "output_tokens_per_s"), _get(e, "output_tokens_per_s"))
                                      for h, e in ((s, es), (g, eg)))
        lines.append(f"| {row['kv']} | {row['shape']} | {row['concurrency']} | {errors} | {done} | "
                     f"{pair('itl_ms', 'p50', digits=2)} | {pair('ttft_ms', 'p50')} | "
                     f"{pair('output_tokens_per_s', digits=0)} | {engine} | {http_over_engine} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ published figures


def load_figures(path: Path = FIGURES) -> list[dict]:
    return json.loads(path.read_text())["figures"]


def render_figures(figures: list[dict]) -> str:
    lines = ["| engine | source (date) | GPU | weights / KV | setting | metric | value | comparable to |",
             "|---|---|---|---|---|---|---|---|"]
    for f in figures:
        comparable = f.get("comparable_to")
        target = (f"{comparable['shape']} c={comparable['concurrency']} ({comparable['what']})" if comparable
                  else f"no: {f['not_comparable_because']}")
        lines.append(f"| {f['engine']} | [{f['source']}]({f['url']}) ({f['date']}) | {f['gpu']} | {f['precision']} | "
                     f"{f['setting']} | {f['metric']} | {f['value']:,} | {target} |")
    return "\n".join(lines)


def figure_ratios(records: dict[str, dict], figures: list[dict]) -> list[dict]:
    """Our value / the published one, for each figure whose settings are comparable: our
    ``comparable_to`` level (``concurrency: "max"``: the highest measured), both samplings and
    KV dtypes, the metric named."""
    out = []
    for figure in figures:
        target = figure.get("comparable_to")
        if not target:
            continue
        for kv in ("auto", "fp8"):
            record = records.get(f"{target.get('record', 'peer')}_{kv}.json")
            runs = (record or {}).get("runs", {}).get(target["shape"], {})
            for sampling in SAMPLINGS:
                levels = (runs.get(sampling) or {}).get("levels") or []
                if not levels:
                    continue
                level = (max(levels, key=lambda lv: lv["concurrency"]) if target["concurrency"] == "max"
                         else next((lv for lv in levels if lv["concurrency"] == target["concurrency"]), None))
                ours = _get(level, *target["metric"].split("."))
                if ours is not None:
                    out.append({"figure": figure["id"], "kv": kv, "sampling": sampling,
                                "concurrency": level["concurrency"], "ours": ours, "theirs": figure["value"],
                                "ratio": ours / figure["value"], "caveats": figure.get("caveats", "")})
    return out


def render_ratios(ratios: list[dict]) -> str:
    if not ratios:
        return "No comparable published figure has a measured counterpart in these results."
    lines = ["| figure | KV | sampling | our level | ours | theirs | ours / theirs | caveats |", "|---|---|---|---|---|---|---|---|"]
    for r in ratios:
        lines.append(f"| {r['figure']} | {r['kv']} | {r['sampling']} | c={r['concurrency']} | {_fmt(r['ours'], 0)} | "
                     f"{_fmt(r['theirs'], 0)} | {r['ratio']:.2f} | {r['caveats']} |")
    return "\n".join(lines)


def report(records: dict[str, dict], figures: list[dict]) -> str:
    out = io.StringIO()
    out.write("## Sampled (GuideLLM's defaults) against temperature 0, per level\n\n")
    for name in RECORDS:
        record = records.get(name)
        if record is None:
            continue
        out.write(f"- `{name}`: {record.get('device', '?')}; {record.get('start_up_line') or ''}\n")
        for key in ("vocab", "warmup", "skipped"):
            if record.get(key):
                out.write(f"  - {key}: `{json.dumps(record[key], default=str)}`\n")
    out.write("\n" + render_table(comparison_rows(records)) + "\n\n")
    out.write("S: sampled (temperature omitted, the server's 1.0); G: temperature 0; done+cut: requests that\n"
              "finished + requests cut at the level's end (their tokens count). Ratios are S / G and HTTP / engine.\n\n")
    out.write("## Against published figures (comparable settings only)\n\n")
    out.write(render_ratios(figure_ratios(records, figures)) + "\n")
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="*", help="OUT directories or PHASE.tar.gz files")
    parser.add_argument("--out", type=Path, help="also write the report here (markdown)")
    parser.add_argument("--figures", action="store_true", help="print the published figures as a table")
    args = parser.parse_args(argv)
    figures = load_figures()
    if args.figures:
        print(render_figures(figures) + "\n\nNot found:\n")
        for entry in json.loads(FIGURES.read_text())["not_found"]:
            print(f"- {entry['engine']}: {entry['what']}")
        return 0
    if not args.inputs:
        parser.error("give OUT directories or tarballs (or --figures)")
    records = load_records(args.inputs)
    if not records:
        print(f"no {', '.join(RECORDS)} in {args.inputs}", file=sys.stderr)
        return 2
    text = report(records, figures)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
