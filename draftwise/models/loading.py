"""`load_model`: one entry point from whatever the user has to a `LoadedModel`.

A spec may be a `LoadedModel`, a transformers `PreTrainedModel` (tests build tiny
random ones in-process), a local Hugging Face directory, a GGUF file, a registry
name of the default models, or a hub id. Hub ids work only where the hub is
reachable; offline they fail fast, naming the offline alternatives.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from draftwise.errors import DraftwiseError, ModelNotAvailableError, did_you_mean
from draftwise.models import formats, qkernel, registry

_DTYPES = {
    "fp32": torch.float32, "float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
}


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase | None = None
    name: str = "model"
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)
    # A draft's restricted output vocabulary (sorted token ids, from its `output-vocab.json`); None: all tokens
    output_ids: torch.Tensor | None = None

    @property
    def weights(self) -> str:
        """The format the forward runs: 'bf16', or e.g. 'gguf (q4_1 210, q8_0 1) with bf16 activations'."""
        return weights_description(self.model)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def vocab_size(self) -> int:
        """Rows of the output layer: the size of every distribution this model returns."""
        head = self.model.get_output_embeddings()
        if head is not None and hasattr(head, "out_features"):
            return int(head.out_features)
        return int(self.model.config.vocab_size)

    @property
    def context_window(self) -> int | None:
        config = self.model.config
        for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
            value = getattr(config, key, None)
            if isinstance(value, int) and value > 0:
                return value
        return None


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: bf16 matmuls run natively (otherwise they are converted and slower than fp32)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return any(flag in flags.split() for flag in ("avx512_bf16", "amx_bf16"))


# Beside the float types, every weight format of the registry (`formats.FORMATS`: gguf, a GGUF file's own
# quantisation kept; int8, weight-only per output channel, quantised at load; dequantize, float weights); the
# activations then run in the 'auto' float type. The help names the formats registered when it is imported.
FLOAT_CHOICES = ("auto", "bf16", "fp16", "fp32")
DTYPE_HELP = ("auto (default): a GGUF's own quantisation on CPU, else bf16 where the CPU or GPU runs it natively, "
              "else fp32; or bf16, fp16, fp32, "
              + ", ".join(f"{e.name} ({e.help})" if e.help else e.name for e in formats.FORMATS.values()))


def resolve_dtype(dtype: str | torch.dtype | None, device: str | torch.device | None = None) -> torch.dtype | None:
    """The float type of the activations (and of float weights): 'auto' (and every weight format) is bf16 on
    CUDA and on CPUs with native bf16, fp32 elsewhere."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if str(dtype).lower() == "auto" or formats.entry(dtype) is not None:
        on_cuda = device is not None and torch.device(device).type == "cuda"
        return torch.bfloat16 if on_cuda or cpu_has_native_bf16() else torch.float32
    try:
        return _DTYPES[str(dtype).lower()]
    except KeyError:
        raise DraftwiseError(f"unknown dtype {dtype!r}; choose one of "
                             f"{', '.join((*FLOAT_CHOICES, *formats.FORMATS))}") from None


def weight_format(dtype: str | torch.dtype | None, *, gguf: bool, device: torch.device) -> str | None:
    """What `dtype` asks of the weights: a registered format's name (`formats.FORMATS`), or None (float weights),
    refused in one line where the format cannot serve the model. 'auto' keeps a GGUF file's own quantisation on a
    CPU where draftwise's codes kernel is built (models/qkernel.py), or failing that where the CPU has native bf16
    (PyTorch's int4 CPU kernel is fast with bf16 activations only); an explicit float type or 'dequantize' never
    does."""
    chosen = formats.entry(dtype)
    if chosen is not None:
        if chosen.format is None:
            return None
        why = chosen.format.refuse(gguf=gguf, device=device)
        if why is not None:
            raise DraftwiseError(why)
        return chosen.name
    name = str(dtype).lower() if isinstance(dtype, str) else None
    if name in ("auto", None) and gguf and device.type == "cpu" and (cpu_has_native_bf16() or qkernel.available()):
        return "gguf"
    return None


def weights_description(model) -> str:
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.").replace("bfloat16", "bf16") \
        .replace("float32", "fp32").replace("float16", "fp16")
    attached = formats.of(model)
    if attached is None:
        return dtype
    text = f"{attached.format.describe()} with {dtype} activations"
    if getattr(attached.format, "blocks", False) and dtype == "bf16":
        if qkernel.prompt_bf16():
            text += "; prompts run the weights rounded to bf16 (bmm16)"
    return text


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cpu")
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DraftwiseError(f"device {str(device)!r} asked for, but CUDA is not available here; use 'cpu' or 'auto'")
    return device


def load_model(
    spec: object,
    *,
    tokenizer: PreTrainedTokenizerBase | str | os.PathLike | None = None,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    progress: bool = False,
) -> LoadedModel:
    """Load `spec` for decoding. CPU unless `device` says otherwise ('cuda', 'auto').

    dtype: 'auto' (and None for files) picks the fastest format that keeps the weights: a GGUF file's own
    quantisation (on CPU), else bf16 where the CPU or GPU runs it natively and fp32 elsewhere. 'bf16' /
    'fp16' / 'fp32' choose a float type; 'int8' quantises weights per output channel; 'gguf' insists on the
    file's quantisation; 'dequantize' is the float type 'auto' would pick, from dequantised weights.
    None keeps an in-memory model as it is. Weight formats run on the fast forward (Llama, Mistral, Qwen2).
    progress: show transformers' weight-loading bars (off by default).
    An EAGLE draft head is not a model: give it as `draft=` (see `heads.loading.load_draft`).
    """
    if not isinstance(spec, (str, os.PathLike)) and isinstance(dtype, str) and dtype.lower() == "auto":
        dtype = None  # a model built in memory keeps the type it was built in
    torch_dtype = resolve_dtype(dtype, device)
    if isinstance(spec, LoadedModel):
        loaded = spec
        if tokenizer is not None:
            loaded.tokenizer = _load_tokenizer(tokenizer)
    elif isinstance(spec, PreTrainedModel):
        loaded = LoadedModel(model=spec, tokenizer=_load_tokenizer(tokenizer), name=type(spec).__name__)
    elif isinstance(spec, (str, os.PathLike)):
        target_device = resolve_device(device)
        if torch_dtype is None:
            torch_dtype = resolve_dtype("auto", target_device)
        _not_a_model(str(spec))
        chosen = weight_format(dtype, gguf=loaded_gguf(str(spec)) is not None, device=target_device)
        if chosen == "gguf" and not qkernel.available():  # PyTorch's int4 kernel is fast with bf16 activations
            torch_dtype = torch.bfloat16  # only (fp32 runs 40x slower); draftwise's kernel takes either
        loaded = _load_codes(str(spec), torch_dtype) if chosen == "gguf" else None
        if loaded is None:
            with _progress_bars(progress):
                loaded = _load_from_string(str(spec), torch_dtype)
        if tokenizer is not None:
            loaded.tokenizer = _load_tokenizer(tokenizer)
    else:
        raise DraftwiseError(
            f"cannot load a model from {type(spec).__name__}; pass a PreTrainedModel, a local directory, "
            "a .gguf file, a registry name or a hub id"
        )
    if device is not None:
        loaded.model.to(resolve_device(device))
    if torch_dtype is not None and loaded.dtype != torch_dtype:
        loaded.model.to(torch_dtype)
    if loaded.model.training:  # a model already in eval mode (a loaded one handed back) is not walked again
        loaded.model.eval()
    asked = formats.entry(dtype)
    if isinstance(spec, (str, os.PathLike)):
        _attach_formats(loaded, chosen, loaded_gguf(str(spec)), explicit=asked is not None)
    elif asked is not None and asked.format is not None:
        _attach_formats(loaded, weight_format(dtype, gguf=False, device=loaded.device), None, explicit=True)
    loaded.eos_token_ids = frozenset(loaded.eos_token_ids) | _eos_ids(loaded)  # keep ids a caller set
    return loaded


def loaded_gguf(spec: str) -> Path | None:
    """The GGUF file a model spec is loaded from (a .gguf path, a folder with one, or a registry entry converted
    from one), else None."""
    entry = registry.entry(spec)
    if entry is not None:
        return entry.gguf() if entry.gguf is not None else None
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        return ggufs[0] if len(ggufs) == 1 else None
    return None


def _load_codes(spec: str, dtype: torch.dtype) -> LoadedModel | None:
    """A GGUF file (or registry entry) loaded straight into its codes (models/gguf_codes.py); None where that
    path does not serve it (the dequantising loader then runs)."""
    from draftwise.models import gguf_codes

    path = loaded_gguf(spec)
    if path is None:
        return None
    name = spec if registry.entry(spec) is not None else Path(spec).stem
    if registry.entry(spec) is None:  # a registry file's hash covers it (entry.gguf checked it)
        check_header_once(path)
    with _load_errors(path, "the GGUF file"):
        try:
            model, tokenizer = gguf_codes.load(path, dtype, name=name)
        except gguf_codes.Unsupported:  # caught inside: _load_errors would make it a "damaged file" error
            return None
    formats.attach(model, formats.ModelFormat("gguf", formats.CodesFormats(model), codes=True))
    return LoadedModel(model=model, tokenizer=tokenizer, name=name)


def _attach_formats(loaded: LoadedModel, name: str | None, gguf: Path | None, *, explicit: bool) -> None:
    """Give the model the weight format `name` (a `formats.FORMATS` entry; None: float weights) its fast forward
    runs. Where 'auto' chose a GGUF's quantisation and the fast forward cannot run the model, or the file holds no
    Q4_0 / Q4_1 / Q8_0 tensor, the model runs its float weights; an explicit format says why it cannot."""
    from draftwise.models.fast import supports

    model = loaded.model
    attached = formats.of(model)
    formats.attach(model, None)
    if attached is not None and attached.codes:  # loaded in its codes: nothing to build
        formats.attach(model, formats.ModelFormat(attached.name, formats.CodesFormats(model), codes=True))
        return
    if name is None:
        return
    why = supports(model)
    if why is not None:
        if not explicit:
            return
        raise DraftwiseError(f"weight format {name!r} runs on the fast forward, which cannot run this model "
                             f"({why}); choose a float dtype")
    try:
        state = formats.FORMATS[name].format.build(model, gguf=gguf, dtype=loaded.dtype)
    except formats.NotApplicable:
        if explicit:
            raise
        return
    formats.attach(model, formats.ModelFormat(name, state))


OUTPUT_VOCAB_FILE = "output-vocab.json"  # next to a draft's config.json: its restricted output vocabulary


def read_output_vocabulary(path: Path, vocab_size: int) -> torch.Tensor:
    """The sorted token ids of a draft's `output-vocab.json` ({"ids": [...]}), checked."""
    try:
        ids = json.loads(Path(path).read_text())["ids"]
        assert isinstance(ids, list) and ids and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
    except (OSError, ValueError, KeyError, TypeError, AssertionError):
        raise DraftwiseError(f"{path}: not an output vocabulary (a JSON object with a non-empty 'ids' list of "
                             "token ids)") from None
    if len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) >= vocab_size:
        raise DraftwiseError(f"{path}: token ids must be distinct and in [0, {vocab_size})")
    return torch.tensor(sorted(ids), dtype=torch.long)


def write_output_vocabulary(directory: Path, ids: torch.Tensor, **meta: Any) -> Path:
    """Write `output-vocab.json` atomically."""
    from draftwise.atomic import write_json

    path = Path(directory) / OUTPUT_VOCAB_FILE
    write_json({**meta, "ids": sorted(int(i) for i in ids)}, path)
    return path


def resolve_path(spec: str | os.PathLike) -> Path | None:
    """A registry name or an existing path -> its local directory/file (None for anything else)."""
    spec = str(spec)
    if spec in registry.names():
        entry = registry.entry(spec)
        if entry.gguf is not None:  # a GGUF entry without its float copy: its file (no copy is made to answer
            converted = entry.converted() if entry.converted is not None else entry.cached() == "ready"
            if not converted:  # what the spec is)
                return entry.gguf()
        return registry.resolve(spec)
    path = Path(spec).expanduser()
    return path if path.exists() else None


def _load_tokenizer(tokenizer: object) -> PreTrainedTokenizerBase | None:
    if tokenizer is None or isinstance(tokenizer, PreTrainedTokenizerBase):
        return tokenizer
    return AutoTokenizer.from_pretrained(str(tokenizer))


def _eos_ids(loaded: LoadedModel) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(loaded.model, "generation_config", None), loaded.model.config, loaded.tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return frozenset(ids)


@contextlib.contextmanager
def _progress_bars(show: bool) -> Iterator[None]:
    """transformers' loading bars on or off for one load; the caller's setting is restored after."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if show else hf_logging.disable_progress_bar)()
    try:
        yield
    finally:
        (hf_logging.enable_progress_bar if was_on else hf_logging.disable_progress_bar)()


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")


def _not_a_model(spec: str) -> None:
    from draftwise.models.head_files import is_eagle_dir

    entry = registry.entry(spec)
    path = Path(spec).expanduser()
    if (entry is not None and entry.role == "eagle") or (entry is None and path.is_dir() and is_eagle_dir(path)):
        raise DraftwiseError(
            f"{spec} is an EAGLE draft head, not a model: it drafts from a target's features, so pass it as "
            "draft=... (--draft) with its target, or load it with draftwise.load_draft(spec, target)"
        )


def check_model_spec(spec: object) -> None:
    """What `load_model` checks of a target named by a string before it reads any weight, done now (cheap): a
    registry name, a .gguf file that starts with GGUF's magic bytes, a directory with config.json or one .gguf
    file, or a hub id. `plan` asks it before a method's needs, so a wrong path is reported as itself."""
    if not isinstance(spec, (str, os.PathLike)):
        return
    spec = str(spec)
    _not_a_model(spec)
    if spec in registry.names():
        return
    path = Path(spec).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise DraftwiseError(f"{spec}: a model file must be a .gguf file; for safetensors pass its directory")
        try:
            with open(path, "rb") as f:
                magic = f.read(4)
        except OSError as error:
            raise DraftwiseError(f"{spec}: cannot read it ({error.strerror or error})") from None
        if magic != b"GGUF":
            raise DraftwiseError(f"{spec}: not a GGUF file (it does not start with GGUF's magic bytes)")
        return
    if path.is_dir():
        if not (path / "config.json").exists() and len(list(path.glob("*.gguf"))) != 1:
            raise DraftwiseError(f"{spec}: directory has no config.json (and not exactly one .gguf file)")
        return
    if not _looks_like_hub_id(spec):
        raise DraftwiseError(f"{spec!r} is not a local directory, a .gguf file, a registry name ({_registry_list()}) "
                             f"or a hub id (org/name){did_you_mean(spec, registry.names())}")


def _load_from_string(spec: str, dtype: torch.dtype) -> LoadedModel:
    check_model_spec(spec)
    if spec in registry.names():
        return _load_directory(registry.resolve(spec), dtype, name=spec)
    path = Path(spec).expanduser()
    if path.is_file():
        return _load_gguf(path, dtype)
    if path.is_dir():
        if (path / "config.json").exists():
            return _load_directory(path, dtype, name=path.name)
        return _load_gguf(next(path.glob("*.gguf")), dtype)
    return _load_from_hub(spec, dtype)


@contextlib.contextmanager
def _load_errors(path: Path, what: str) -> Iterator[None]:
    """A damaged or foreign file (truncated safetensors, bad config, ...) becomes one line, not a traceback."""
    try:
        yield
    except (DraftwiseError, MemoryError):
        raise
    except Exception as error:  # noqa: BLE001 - any failure to read user files is reported the same way
        raise DraftwiseError(f"{path}: cannot load {what} ({_one_line(error)}); is the file complete?") from None


def _load_directory(path: Path, dtype: torch.dtype, *, name: str) -> LoadedModel:
    with _load_errors(path, "the model"):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    with _load_errors(path, "the tokenizer"):
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True) if _has_tokenizer(path) else None
    return LoadedModel(model=model, tokenizer=tokenizer, name=name)


GGUF_MAGIC = b"GGUF"


def _load_gguf(path: Path, dtype: torch.dtype) -> LoadedModel:
    """Dequantise once into the draftwise cache (like the registry's model); later loads read that folder."""
    from draftwise.models.cache import ensure_entry, gguf_cache_name

    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise DraftwiseError(f"{path} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})")
    check_header_once(path)
    name, key = gguf_cache_name(path)
    with _load_errors(path, "the GGUF file"):
        directory = ensure_entry(
            name, lambda out: registry.convert_gguf(path, out, expected_sha256=None), source_sha256=key,
            supersedes=name[: -len(key[:12])], source=str(path.resolve()))
    return _load_directory(directory, dtype, name=path.stem)


_HEADERS_CHECKED: set[tuple] = set()  # (path, size, mtime_ns) of GGUF headers checked in this process


def check_header_once(path: Path) -> None:
    """integrity.check_header, once a process for a file as it is (a changed file is checked again)."""
    from draftwise.models.integrity import check_header

    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _HEADERS_CHECKED:
        check_header(path)
        _HEADERS_CHECKED.add(key)


def _has_tokenizer(path: Path) -> bool:
    return any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model"))


def _looks_like_hub_id(spec: str) -> bool:
    parts = spec.split("/")
    return len(parts) == 2 and all(parts) and not spec.startswith((".", "/", "~"))


def _registry_list() -> str:
    return ", ".join(registry.names()) or "none yet"


def _hub_reachable(timeout_s: float = 2.0) -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return False
    from huggingface_hub import constants

    host = urlparse(constants.ENDPOINT).hostname or ""
    try:
        with socket.create_connection((host, 443), timeout=timeout_s):
            return True
    except OSError:
        return False


def _load_from_hub(spec: str, dtype: torch.dtype) -> LoadedModel:
    try:  # already in the local Hugging Face cache: no network needed
        model = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(spec, local_files_only=True)
        return LoadedModel(model=model, tokenizer=tokenizer, name=spec)
    except (OSError, ValueError):
        pass
    if not _hub_reachable():
        raise ModelNotAvailableError(
            f"{spec!r} looks like a model-hub id, but the hub cannot be reached from this machine and the model is "
            "not in the local Hugging Face cache. Offline alternatives: a registry name "
            f"({_registry_list()}; see `draftwise models`), a local Hugging Face directory, or a .gguf file."
        )
    model = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(spec)
    return LoadedModel(model=model, tokenizer=tokenizer, name=spec)
