"""`draftwise bench`: every method on the same prompts, in a fixed order, after a warm-up.

Methods are draftwise's own (`draftwise methods`) plus two external references run
through transformers' `generate`: `hf-assisted` (assisted generation with an
independent draft, `assistant_model=`) and `prompt-lookup-hf` (its prompt lookup
decoding), with the same gamma and sampling settings. Every run is timed the same
way: wall-clock around the whole call, after a warm-up, repeats interleaved
method by method so drift hits every method alike.
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from draftwise.api import generate
from draftwise.errors import DraftwiseError, did_you_mean
from draftwise.methods import METHODS
from draftwise.heads.eagle import DraftHead
from draftwise.heads.loading import is_eagle_spec, load_draft
from draftwise.models.loading import LoadedModel, load_model
from draftwise.engine.sampling import SamplingConfig
from draftwise.bench.datasets import Prompt, load_prompts
from draftwise.bench.labels import DRAFT_ONLY, HF_METHODS, parse_label, run_options
from draftwise.bench.energy import find_meter
from draftwise.bench.metrics import RunRecord, report
from draftwise.bench.quality import target_score

@dataclass(frozen=True)
class BenchConfig:
    target: str
    draft: str | None = None
    hf_draft: str | None = None
    methods: tuple[str, ...] = ("ar", "sd", "prompt-lookup")
    dataset: str = "spec-bench"
    categories: tuple[str, ...] = ()
    num_prompts: int = 32
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    gamma: int = 4
    repeats: int = 3
    warmup: int = 1
    dtype: str = "auto"  # bf16 where the CPU runs it natively (or CUDA), else fp32
    device: str = "cpu"
    seed: int = 0
    threads: int = 0  # 0 = torch's default
    method_options: dict[str, dict[str, Any]] = field(default_factory=dict)  # by method name or label
    quality: bool = False  # quality fields for every method (always on when a lossy method runs)
    prefix_fraction: float = 0.0  # > 0: continue the first fraction of each prompt's words, no chat template
    compare_to: str | None = None  # a method whose outputs every other is compared with (ROUGE, win-tie, speed)
    save_outputs: bool = False  # keep every run's output text and token ids in the results (re-score later)
    batch_sizes: tuple[int, ...] = ()  # non-empty: the batched bench (bench.batched) at these max batch sizes
    advice: bool = True  # with ar and another method: time a verification and name the fastest exact method


def check_methods(methods: tuple[str, ...]) -> None:
    if not methods:
        raise DraftwiseError("no methods given")
    valid = list(METHODS) + list(HF_METHODS) + [DRAFT_ONLY]
    unknown = [m for m in methods if m.partition("/")[0].partition(":")[0].partition("@")[0] not in valid]
    if unknown:
        hints = "".join(did_you_mean(m.partition("/")[0].partition(":")[0].partition("@")[0], valid) for m in unknown)
        raise DraftwiseError(f"unknown method(s) {', '.join(unknown)}{hints}; valid: {', '.join(valid)}")
    for label in methods:
        parse_label(label)
    if len(set(methods)) != len(methods):
        raise DraftwiseError(f"a method is listed twice in {', '.join(methods)}")


CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")


def machine_description(device: torch.device, *, detail: bool = False) -> dict[str, Any]:
    """Platform, CPU, library versions and threads of this run; with `detail`, also what `lscpu` says of the CPU
    (vendor, family, hypervisor, L3 cache, the instruction sets in CPU_FLAGS), the memory and the load average."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    info = {
        "platform": platform.platform(), "python": platform.python_version(), "cpu": cpu,
        "cpu_count": os.cpu_count(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "device": str(device),
    }
    import transformers

    info["transformers"] = transformers.__version__
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info | cpu_details() if detail else info


def cpu_details() -> dict[str, Any]:
    """lscpu's view of the CPU, the memory in GiB and the load average now (Linux; what cannot be read is left out,
    or named in `lscpu_error`)."""
    import subprocess

    info: dict[str, Any] = {"load_average_at_start": list(os.getloadavg())}
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30).stdout
        fields = {k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in lscpu.splitlines())}
        flags = set(fields.get("Flags", "").split())
        if fields.get("Model name"):
            info["cpu"] = fields["Model name"]
        info.update(cpu_vendor=fields.get("Vendor ID"), cpu_family=fields.get("CPU family"),
                    hypervisor=fields.get("Hypervisor vendor"), flags={f: f in flags for f in CPU_FLAGS},
                    l3_cache=fields.get("L3 cache"))
    except (OSError, subprocess.TimeoutExpired) as error:
        info["lscpu_error"] = f"{type(error).__name__}: {error}"[:400]
    try:
        with open("/proc/meminfo") as f:
            info["memory_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
    except (OSError, IndexError, ValueError):
        pass
    return info


def encode_bench_prompt(model: LoadedModel, prompt: Prompt, prefix_fraction: float = 0.0) -> list[int]:
    """The chat-formatted prompt; or, with `prefix_fraction`, the first fraction of its words as raw
    text to continue (SPRINTER §4's "30% prefixes")."""
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise DraftwiseError("the benchmark needs a target with a tokenizer")
    if prefix_fraction:
        words = prompt.text.split()
        return tokenizer(" ".join(words[: max(1, round(prefix_fraction * len(words)))]))["input_ids"]
    if getattr(tokenizer, "chat_template", None):
        encoded = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt.text}], add_generation_prompt=True, tokenize=True
        )
        return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
    return tokenizer(prompt.text)["input_ids"]


class _CallCounter:
    """Counts forward calls of a transformers model (for the HF reference methods)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls = 0
        self._handle = model.register_forward_pre_hook(self._hook)

    def _hook(self, module, args) -> None:
        self.calls += 1

    def close(self) -> None:
        self._handle.remove()


def _hf_run(
    method: str, target: LoadedModel, hf_draft: LoadedModel | None, ids: list[int], config: BenchConfig, seed: int
) -> dict[str, Any]:
    sampling = SamplingConfig(config.temperature, config.top_k, config.top_p)
    kwargs: dict[str, Any] = dict(max_new_tokens=config.max_new_tokens, do_sample=not sampling.greedy)
    if sampling.greedy:
        kwargs.update(temperature=None, top_k=None, top_p=None)
    else:
        kwargs.update(temperature=config.temperature, top_k=config.top_k or None, top_p=config.top_p)
    if method == "hf-assisted":
        assert hf_draft is not None
        # transformers reads the draft length and early-exit threshold from the *assistant's*
        # generation config (defaults: 20 tokens, heuristic schedule, confidence 0.4); kwargs
        # to generate() do not reach it. Set them there: exactly gamma tokens every step.
        assistant_config = hf_draft.model.generation_config
        assistant_config.num_assistant_tokens = config.gamma
        assistant_config.num_assistant_tokens_schedule = "constant"
        assistant_config.assistant_confidence_threshold = 0.0
        kwargs.update(assistant_model=hf_draft.model)
    else:
        kwargs.update(prompt_lookup_num_tokens=config.gamma)
    input_ids = torch.tensor([ids], device=target.device)
    target_counter = _CallCounter(target.model)
    draft_counter = _CallCounter(hf_draft.model) if method == "hf-assisted" else None
    torch.manual_seed(seed)
    try:
        start = time.perf_counter()
        with torch.inference_mode():
            out = target.model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), pad_token_id=_pad_id(target),
                eos_token_id=sorted(target.eos_token_ids) or None, **kwargs,  # the same stop tokens as draftwise
            )
        wall = time.perf_counter() - start
    finally:
        target_counter.close()
        if draft_counter:
            draft_counter.close()
    new = out[0, len(ids):].tolist()
    return dict(
        new_tokens=len(new), wall_time_s=wall, target_calls=target_counter.calls,
        draft_calls=draft_counter.calls if draft_counter else 0, token_ids=new,
    )


def _pad_id(model: LoadedModel) -> int:
    if model.tokenizer is not None and model.tokenizer.pad_token_id is not None:
        return model.tokenizer.pad_token_id
    return min(model.eos_token_ids) if model.eos_token_ids else 0


def _draftwise_run(
    label: str, target: LoadedModel, draft: LoadedModel | None, ids: list[int], config: BenchConfig, seed: int
) -> dict[str, Any]:
    name, options = run_options(label, config.method_options, config.gamma)
    if name == DRAFT_ONLY:
        target, draft, name = draft, None, "ar"
    spec = METHODS[name]
    start = time.perf_counter()
    g = generate(
        target, ids, draft=draft if spec.needs_draft else None, method=name,
        max_new_tokens=config.max_new_tokens, temperature=config.temperature, top_k=config.top_k,
        top_p=config.top_p, seed=seed, **options,
    )
    wall = time.perf_counter() - start
    s = g.stats
    return dict(
        new_tokens=s["new_tokens"], wall_time_s=wall, target_calls=s["target_calls"], draft_calls=s["draft_calls"],
        drafted=s["drafted"], accepted=s["accepted"], accepted_per_position=s["accepted_per_position"],
        drafted_per_position=s["drafted_per_position"], token_ids=g.token_ids,
        verifier_calls=s.get("verifier_calls", 0), verifier_accepted=s.get("verifier_accepted", 0),
    )


def _load_bench_draft(spec: str, target: LoadedModel, config: BenchConfig) -> LoadedModel | DraftHead:
    return load_draft(spec, target, device=config.device, dtype=config.dtype)


def plan_drafts(config: BenchConfig) -> dict[str, str | None]:
    """Method label -> the draft it runs with (None: none), every method checked before any model loads.

    `--draft` serves every method that can use it; without it each method gets the registry's best
    draft for a registry target (the EAGLE head where the method drafts with one, else the
    independent draft). `draft-only` and `hf-assisted` need an independent draft model.
    """
    from draftwise.plan import EAGLE_METHODS, check_options, default_draft
    from draftwise.models import registry

    check_methods(config.methods)
    if config.batch_sizes:
        _check_batched(config)
    independent = registry.default_draft_for(config.target, eagle_ok=False) if config.target in registry.names() \
        else None
    hint = f" (for {config.target}: {independent})" if independent else ""
    drafts: dict[str, str | None] = {}
    for label in config.methods:
        name, options = run_options(label, config.method_options, config.gamma)
        if name in (DRAFT_ONLY, "hf-assisted"):
            given = config.draft
            if name == "hf-assisted":  # --draft serves it unless it is a head (then the registry's independent one)
                given = config.hf_draft or (config.draft if config.draft and not is_eagle_spec(config.draft) else None)
            flag = "--hf-draft or --draft" if name == "hf-assisted" else "--draft"
            if given is not None and is_eagle_spec(given):
                raise DraftwiseError(f"method {label}: {given} is an EAGLE draft head, which cannot decode on its "
                                     f"own; {name} needs an independent draft model ({flag}){hint}")
            drafts[label] = given or independent
            if drafts[label] is None:
                raise DraftwiseError(f"method {label} needs an independent draft model: pass {flag}")
            continue
        if name in HF_METHODS:
            drafts[label] = None
            continue
        spec = METHODS[name]
        draft = config.draft if spec.needs_draft else None
        try:
            check_options(method=name, max_new_tokens=config.max_new_tokens, temperature=config.temperature,
                          top_k=config.top_k, top_p=config.top_p, seed=config.seed, stop=None,
                          ignore_eos=False, draft_given=draft is not None, target=config.target, draft=draft,
                          **options)
        except DraftwiseError as error:
            raise DraftwiseError(f"method {label}: {error}") from None
        if spec.needs_draft and draft is None:
            draft = default_draft(config.target, name, config.temperature)
        if draft is not None and is_eagle_spec(draft) and name not in EAGLE_METHODS:  # noqa: SIM102
            raise DraftwiseError(f"method {label}: an EAGLE draft head cannot draft for it; give an independent "
                                 f"draft model{hint}")
        drafts[label] = draft
    return drafts


def _check_batched(config: BenchConfig) -> None:
    """Before any draft is chosen: the batched bench runs only what `generate` batches."""
    if config.quality or config.compare_to or config.save_outputs:
        raise DraftwiseError("--batch-sizes reports speed only: drop --quality, --compare-to and --save-outputs")
    for label in config.methods:
        name, fixed = parse_label(label)
        if name in HF_METHODS:
            raise DraftwiseError(f"--batch-sizes: {name} runs transformers' generate one prompt at a time; "
                                 f"leave it out of --methods")


def reference_text(prompt: Prompt) -> str | None:
    """The first turn's reference as one string: some Spec-Bench items (rag) hold a list of acceptable
    answers there, joined with "; "."""
    if not prompt.references:
        return None
    ref = prompt.references[0]
    if isinstance(ref, (list, tuple)):
        ref = "; ".join(str(r) for r in ref)
    return ref if isinstance(ref, str) and ref else None


def _score(record: RunRecord, target: LoadedModel, ids: list[int], prompt: Prompt) -> None:
    """Fill a record's quality fields (see `quality`): one target forward over prompt + output."""
    score = target_score(target.model, ids, record.token_ids, target.vocab_size)
    record.nll, record.scored_tokens, record.agree = score.nll, score.tokens, score.agree
    if target.tokenizer is not None:
        record.text = target.tokenizer.decode(record.token_ids, skip_special_tokens=True).strip()
        record.reference = reference_text(prompt)


def _advice(results: dict[str, Any], config: BenchConfig, target: LoadedModel,
            draft_of: dict[str, Any]) -> dict[str, Any] | None:
    """The fastest exact method of the run and why (`bench.advice`): the target's forward of gamma + 1 tokens
    against one, and one token of the draft model the run used (sd's where it ran), timed after the runs."""
    from draftwise.advice_record import machine_signature
    from draftwise.bench.advice import advise
    from draftwise.bench.verify import verify_costs

    used = draft_of["sd"] if "sd" in draft_of else next((d for d in draft_of.values() if d is not None), None)
    draft = used if isinstance(used, LoadedModel) else None  # an EAGLE head's step is not a model forward
    windows = [m.context_window or 512 for m in (target, draft) if m is not None]
    context = min(256, min(windows) // 2)
    costs = verify_costs(target, draft, config.gamma + 1, context=context)
    return advise(results, costs, machine_signature(target.device, torch.get_num_threads()))


def resolve_drafts(config: BenchConfig) -> BenchConfig:
    """Fill in the registry's default drafts for a registry target when none were given."""
    from draftwise.models import registry

    draft = config.draft or registry.default_draft(config.target)
    hf_draft = config.hf_draft or registry.default_independent_draft(config.target)
    if draft == config.draft and hf_draft == config.hf_draft:
        return config
    return BenchConfig(**{**asdict(config), "draft": draft, "hf_draft": hf_draft})


def run_bench(config: BenchConfig, *, progress: Callable[[int], Any] | None = None,
              loaded: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run the benchmark; returns {"config", "machine", "energy", "methods", "advice"} (see `metrics.report`,
    `bench.advice`), or with `batch_sizes` {"config", "machine", "energy", "batched"} (see `batched.batched_report`).
    `loaded` maps model specs (the target's, drafts') to models already loaded with this config's device and
    format, which the run uses instead of loading them again (`make demo`)."""
    drafts = plan_drafts(config)  # every method checked, and its draft chosen, before any model loads
    labels = {m: parse_label(m)[0] for m in config.methods}
    prompts = load_prompts(config.dataset, categories=list(config.categories) or None, num_prompts=config.num_prompts)
    if config.threads:
        torch.set_num_threads(config.threads)

    from draftwise.models.load_times import timed_load

    given = dict(loaded or {})
    target = given.get(config.target) or timed_load(
        config.target, lambda: load_model(config.target, device=config.device, dtype=config.dtype),
        dtype=config.dtype, device=config.device, role="target")
    loaded = {spec: given.get(spec) or timed_load(spec, lambda spec=spec: _load_bench_draft(spec, target, config),
                                                  dtype=config.dtype, device=config.device, role="draft")
              for spec in dict.fromkeys(drafts.values()) if spec}
    draft_of = {label: loaded[spec] if spec else None for label, spec in drafts.items()}
    hf_draft = draft_of.get("hf-assisted")
    encoded = [(p, encode_bench_prompt(target, p, config.prefix_fraction)) for p in prompts]
    # Quality fields (perplexity, agreement, ROUGE-2 / BLEU where Spec-Bench has references)
    # whenever a lossy method runs, or on request; then for every method, `ar` being the reference.
    score_quality = config.quality or bool(config.compare_to) or any(
        labels[m] == DRAFT_ONLY or (labels[m] in METHODS and not METHODS[labels[m]].exact) for m in config.methods)

    meter, energy_reason = find_meter(target.device)
    if config.batch_sizes:
        from draftwise.bench.batched import run_batched

        return {
            "config": {**asdict(config), "prompts": [p.question_id for p in prompts], "drafts": drafts},
            "machine": machine_description(target.device) | {"dtype": str(target.dtype)},
            "energy": {"available": True, "source": meter.source} if meter else {"available": False,
                                                                                  "reason": energy_reason},
            "batched": run_batched(config, target, draft_of, [ids for _, ids in encoded], meter=meter,
                                   progress=progress),
        }

    def run_one(method: str, ids: list[int], seed: int) -> dict[str, Any]:
        before = meter.read() if meter else 0.0
        if method in HF_METHODS:
            result = _hf_run(method, target, hf_draft, ids, config, seed)
        else:
            result = _draftwise_run(method, target, draft_of[method], ids, config, seed)
        if meter:
            if target.device.type == "cuda":
                torch.cuda.synchronize(target.device)
            result["energy_j"] = meter.joules_between(before, meter.read())
        return result

    warm = BenchConfig(**{**asdict(config), "max_new_tokens": min(16, config.max_new_tokens)})
    for method in config.methods:  # warm-up: allocator, kernels, first-call caches
        for _, ids in encoded[: config.warmup]:
            (_hf_run(method, target, hf_draft, ids, warm, 0) if method in HF_METHODS
             else _draftwise_run(method, target, draft_of[method], ids, warm, 0))

    records: list[RunRecord] = []
    record_prompts: list[Prompt] = []
    for repeat in range(config.repeats):
        for i, (prompt, ids) in enumerate(encoded):
            for method in config.methods:
                seed = config.seed + 1000 * repeat + i  # the same seed for every method on a prompt
                result = run_one(method, ids, seed)
                record = RunRecord(
                    method=method, repeat=repeat, question_id=prompt.question_id, category=prompt.category, **result,
                )
                if score_quality:
                    _score(record, target, ids, prompt)
                records.append(record)
                record_prompts.append(prompt)
                if progress:
                    progress(1)
    tested = [(r, p) for r, p in zip(records, record_prompts) if p.tests is not None]
    if tested and target.tokenizer is not None:  # HumanEval: each answer's code against its tests, in subprocesses
        from draftwise.bench.execution import pass_all

        texts = [target.tokenizer.decode(r.token_ids, skip_special_tokens=True) for r, _ in tested]
        outcome = pass_all([(text, p.code_prompt, p.tests, p.entry_point) for text, (_, p) in zip(texts, tested)],
                           workers=max(1, min(4, os.cpu_count() or 1)))
        for (record, _), passed in zip(tested, outcome):
            record.passed = passed
    methods = report(records, compare_identical=SamplingConfig(config.temperature).greedy,
                     compare_to=config.compare_to if config.compare_to in config.methods else None)
    out = {
        "config": {**asdict(config), "prompts": [p.question_id for p in prompts], "drafts": drafts},
        "machine": machine_description(target.device) | {"dtype": str(target.dtype)},
        "energy": {"available": True, "source": meter.source} if meter else {"available": False,
                                                                              "reason": energy_reason},
        "methods": methods,
    }
    if config.advice and "ar" in labels.values() and len(config.methods) > 1:
        out["advice"] = _advice(out, config, target, draft_of)
    if config.save_outputs:
        decode = target.tokenizer.decode if target.tokenizer is not None else None
        out["outputs"] = {
            method: [{"question_id": r.question_id, "category": r.category, "repeat": r.repeat, "passed": r.passed,
                      "token_ids": r.token_ids,
                      "text": decode(r.token_ids, skip_special_tokens=True) if decode else None}
                     for r in records if r.method == method]
            for method in config.methods
        }
    return out
