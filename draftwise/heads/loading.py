"""`load_draft`: the one resolver for a draft, an independent model (`models.loading.load_model`) or an EAGLE head
attached to its target; `is_eagle_spec` tells which a spec names without loading it."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch

from draftwise.errors import DraftwiseError
from draftwise.models import formats, registry
from draftwise.models.head_files import is_eagle_dir
from draftwise.models.loading import (OUTPUT_VOCAB_FILE, LoadedModel, _one_line, load_model, loaded_gguf,
                                      read_output_vocabulary, resolve_path)


def load_draft(
    spec: Any, target: LoadedModel, *, device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None, progress: bool = False,
) -> Any:
    """The one resolver for a draft, used by the API, the CLI and the benchmark.

    Returns a `LoadedModel` (an independent draft) or an `EagleHead` attached to `target`
    (a directory with eagle.json, or a registry name of one). Files load on the target's
    device and in its dtype unless `device` / `dtype` say otherwise.
    """
    from draftwise.heads.eagle import DraftHead
    from draftwise.heads.export import load_head

    if isinstance(dtype, str) and (dtype.lower() == "auto" or formats.entry(dtype) is not None):
        dtype = None  # a draft runs in its target's float type
    target_format = formats.of(target.model)
    if dtype is None and target_format is not None and target_format.codes and isinstance(spec, (str, os.PathLike)) \
            and loaded_gguf(str(spec)) is not None:
        dtype = "auto"  # a target in its GGUF codes: a GGUF draft in its own codes too, same activations
    if isinstance(spec, DraftHead):
        head = spec
    else:
        path = resolve_path(spec) if isinstance(spec, (str, os.PathLike)) else None
        if path is None or not is_eagle_dir(path):
            if isinstance(spec, (str, os.PathLike)):
                loaded = load_model(spec, device=device or target.device, dtype=dtype or target.dtype,
                                    progress=progress)
                vocabulary = registry.draft_vocabulary(str(spec))  # a registry draft's shipped cut, if any
                if vocabulary is None and path is not None and (Path(path) / OUTPUT_VOCAB_FILE).is_file():
                    vocabulary = Path(path) / OUTPUT_VOCAB_FILE
                if vocabulary is not None:
                    loaded = dataclasses.replace(loaded, output_ids=read_output_vocabulary(vocabulary,
                                                                                           loaded.vocab_size))
                return loaded
            return load_model(spec, device=device, dtype=dtype)
        try:
            head = load_head(path)
        except DraftwiseError:
            raise
        except Exception as error:  # noqa: BLE001 - a damaged head file is bad input, reported in one line
            raise DraftwiseError(f"{spec}: cannot read the EAGLE head ({_one_line(error)})") from None
    head.attach(target.model)
    weight = head.fc.weight
    return head if (weight.device, weight.dtype) == (target.device, target.dtype) else head.to(target.device, target.dtype)


def is_eagle_spec(spec: Any) -> bool:
    """Whether `spec` names an EAGLE draft head, decided without loading or converting anything."""
    from draftwise.heads.eagle import DraftHead

    if isinstance(spec, DraftHead):
        return True
    if not isinstance(spec, (str, os.PathLike)):
        return False
    entry = registry.entry(str(spec))
    if entry is not None:
        return entry.role == "eagle"
    path = Path(spec).expanduser()
    return path.is_dir() and is_eagle_dir(path)
