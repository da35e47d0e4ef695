"""Where an engine's time goes, from what the executor and the profiler record: ``engine_fp8``'s
iteration summary and ``decode_profile``'s kernel breakdown, on records built by hand (the GPU runs
feed them the same fields)."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from benchmarks.gpu.decode_profile import kernel_breakdown
from benchmarks.gpu.engine_fp8 import drive_levels, iteration_summary


@dataclass
class Stat:  # the fields of an IterationStats the summary reads
    start_time: float
    end_time: float
    num_context_requests: int
    busy: bool


def test_iterations_split_into_mixed_decode_and_idle_from_the_level_start():
    stats = [
        Stat(0.0, 0.5, 1, True),  # before the level: left out
        Stat(1.0, 1.010, 2, True), Stat(1.010, 1.040, 1, True),  # mixed: 10 and 30 ms
        Stat(1.040, 1.045, 0, True), Stat(1.045, 1.050, 0, True), Stat(1.050, 1.056, 0, True),  # decode: 5, 5, 6 ms
        Stat(1.056, 1.057, 0, False),  # idle: 1 ms
        Stat(1.057, 0.0, 0, True),  # still running (no end time): left out
    ]
    summary = iteration_summary(stats, since=1.0)
    assert summary["mixed"]["n"] == 2 and summary["mixed"]["median_ms"] == pytest.approx(20.0)
    assert summary["mixed"]["max_ms"] == pytest.approx(30.0) and summary["mixed"]["sum_ms"] == pytest.approx(40.0)
    assert summary["decode"]["n"] == 3 and summary["decode"]["median_ms"] == pytest.approx(5.0)
    assert summary["decode"]["max_ms"] == pytest.approx(6.0)
    assert summary["idle"] == {"n": 1, "sum_ms": pytest.approx(1.0), "median_ms": pytest.approx(1.0),
                               "max_ms": pytest.approx(1.0)}


@dataclass
class Span:
    start: float
    end: float

    def elapsed_us(self) -> float:
        return self.end - self.start


@dataclass
class Event:  # the fields of a profiler event the breakdown reads
    name: str
    start: float
    end: float
    device_type: torch.autograd.DeviceType = torch.autograd.DeviceType.CUDA

    @property
    def time_range(self) -> Span:
        return Span(self.start, self.end)


def test_kernels_are_summed_per_step_by_group_and_name_and_gaps_count_as_idle():
    events = [
        Event("nvjet_gemm_a", 0, 40), Event("_fp8_scores_kernel", 40, 60), Event("_combine_kernel", 70, 75),
        Event("nvjet_gemm_a", 100, 140), Event("_fp8_scores_kernel", 135, 160),  # overlaps the GEMM by 5 us
        Event("aten::mm", 0, 200, torch.autograd.DeviceType.CPU),  # a host op: not a kernel
    ]
    out = kernel_breakdown(events, steps=2)
    assert out["kernels_per_step"] == 2.5
    assert out["kernel_us_per_step"] == pytest.approx((40 + 20 + 5 + 40 + 25) / 2)
    assert out["groups_us_per_step"] == {"gemm": pytest.approx(40.0), "attention": pytest.approx(25.0)}
    assert out["span_us_per_step"] == pytest.approx(80.0)
    # covered: [0, 60) + [70, 75) + [100, 160) = 125 us of 160; idle 35 us over 2 steps
    assert out["idle_us_per_step"] == pytest.approx(17.5)
    assert [k["name"] for k in out["top_kernels"]] == ["nvjet_gemm_a", "_fp8_scores_kernel", "_combine_kernel"]
    assert out["top_kernels"][1] == {"name": "_fp8_scores_kernel", "us_per_step": 22.5, "calls_per_step": 1.0}


def test_a_window_without_kernels_reports_zeros():
    out = kernel_breakdown([], steps=0)
    assert out["kernel_us_per_step"] == 0 and out["idle_us_per_step"] == 0 and out["top_kernels"] == []


class WaveEngine:
    """An engine stand-in whose requests each take ``seconds``, however many run at once."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.iteration_stats, self.prompts, self.lock = seconds, [], [], threading.Lock()

    def generate(self, prompt, params):
        with self.lock:
            self.prompts.append(len(prompt))
        time.sleep(self.seconds)
        return SimpleNamespace(outputs=[SimpleNamespace(token_ids=[0] * params.max_tokens)])


def test_a_fixed_number_of_requests_per_worker_is_the_same_work_whatever_the_window():
    engine = WaveEngine(0.05)
    level, = drive_levels(engine, 8, 4, [3], seconds=0.0, rng=random.Random(0), vocab=100, label="fixed",
                          requests_per_worker=2)
    assert level["requests"] == 6 and level["output_tokens"] == 24 and level["requests_per_worker"] == 2
    assert engine.prompts == [8] * 6
    # two waves of 50 ms: about 24 tokens over 0.1 s, whatever the window would have cut
    assert 0.1 <= level["wall_s"] < 1.0


def test_a_window_finishes_every_request_it_started():
    engine = WaveEngine(0.05)
    level, = drive_levels(engine, 8, 4, [2], seconds=0.12, rng=random.Random(0), vocab=100, label="window")
    assert level["requests"] >= 4 and level["output_tokens"] == 4 * level["requests"]
    assert level["requests_per_worker"] is None
