"""Upstream's module name for the sampler, which lives in :mod:`.sampling.sampler`."""

from tensorrt_llm._torch.pyexecutor.sampling.sampler import Sampler, TorchSampler

__all__ = ["Sampler", "TorchSampler"]
