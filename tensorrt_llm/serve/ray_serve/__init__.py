"""Replicas of ``trtllm-serve``'s OpenAI server under Ray Serve, with a prefix-aware request
router fed by the replicas' KV cache events (docs/scale-out.md, "Replicas under Ray Serve").

``build_app`` (``app``) is what ``serve run tensorrt_llm.serve.ray_serve:build_app`` runs; Ray
(``pip install 'tensorrt-llm-budget[ray]'``) is needed from there on. The routing rule
(``routing``), the prefix index (``prefix_index``), the registry (``registry``) and the metrics
merge (``metrics_merge``) import no Ray.
"""

from __future__ import annotations

__all__ = ["build_app"]


def __getattr__(name: str):
    if name == "build_app":
        try:
            from tensorrt_llm.serve.ray_serve.app import build_app
        except ModuleNotFoundError as error:
            if error.name is not None and error.name.split(".")[0] == "ray":
                raise ModuleNotFoundError("tensorrt_llm.serve.ray_serve.build_app needs Ray Serve:"
                                          " pip install 'tensorrt-llm-budget[ray]'", name="ray") from None
            raise
        return build_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
