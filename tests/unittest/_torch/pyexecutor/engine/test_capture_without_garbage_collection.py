"""A CUDA graph is captured with Python's garbage collector paused (``cuda_graph_runner``): a
collection inside a capture finalises unreachable CUDA objects (another executor's graphs, a
Triton kernel's module), calls a capture does not permit, and the capture fails at its end.
The pause itself is plain Python, checked here; the captures are the CUDA tests'."""

from __future__ import annotations

import gc

from tensorrt_llm._torch.pyexecutor.engine.cuda_graph_runner import garbage_collection_paused


class _Finalised:
    """Records when it is finalised; made unreachable in a reference cycle, as a dropped executor's graphs are."""

    log: list[str] = []

    def __init__(self) -> None:
        self.cycle = self

    def __del__(self) -> None:
        _Finalised.log.append("finalised")


def test_garbage_is_finalised_before_the_capture_and_never_inside_it():
    assert gc.isenabled()
    _Finalised.log.clear()
    _Finalised()  # unreachable now, freed only by a collection
    with garbage_collection_paused():
        assert _Finalised.log == ["finalised"], "collected on entry, before anything is captured"
        assert not gc.isenabled()
        _Finalised()
        with garbage_collection_paused():  # captures in a row: no collection in between
            assert _Finalised.log == ["finalised"]
        assert not gc.isenabled()
        assert _Finalised.log == ["finalised"]
    assert gc.isenabled()
    gc.collect()
    assert _Finalised.log == ["finalised", "finalised"]


def test_a_collector_disabled_before_stays_disabled():
    gc.disable()
    try:
        with garbage_collection_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
