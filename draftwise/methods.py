"""The method registry: name -> (drafter kind, acceptance rule, options with defaults).

Every default is defined here once; the API, the CLI and `draftwise methods` read it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from draftwise.engine.protocols import TargetRule
from draftwise.rules.acceptance import ExactRule, LossyGreedyRule, LossyRule
from draftwise.rules.cascades import (CASCADE_RULES, AcceptDraftRule, BildRollbackRule, CascadeRule, FLyRule, chow_stop,
                       sequence_confidence)
from draftwise.errors import DraftwiseError, did_you_mean, short
from draftwise.selectors.selection import PROBE_EVERY, QUIET_AFTER


@dataclass(frozen=True)
class Option:
    name: str
    default: Any
    type: type
    help: str
    required: str = ""  # non-empty: the option must be given; the text says how to get a value
    high: int | None = None  # an integer option's largest value: every size a request can set is bounded


MAX_GAMMA = 32  # draft tokens per step: the per-position counters (API, server, /metrics) have this many slots
MAX_WINDOW = 64  # the bound of every option that sets a draft run, a match length or a block


@dataclass(frozen=True)
class DrafterKind:
    """What a kind of drafter needs, and how it is built: `builder`, "module:function", names a function
    `(plan, rule) -> drafter` (a new kind keeps it beside its drafter class); the built-in kinds leave it empty and
    are built by `builder.DRAFTER_BUILDERS[name]`. Adding a kind is its module and this entry."""

    name: str
    needs: str  # what `draftwise methods` says it needs
    draft_model: bool = False  # a draft model or an EAGLE head
    companion: bool = False  # a companion model (SV)
    objective: str = ""  # the trained file's objective: "sprinter" (a verifier) or "acceptance" (a stop head)
    builder: str = ""  # "module:function" building its rows drafter; "": builder.DRAFTER_BUILDERS[name]


DRAFTERS: dict[str, DrafterKind] = {k.name: k for k in (
    DrafterKind("none", "target only"),
    DrafterKind("model", "needs --draft", draft_model=True),
    DrafterKind("ngram", "no draft model"),
    DrafterKind("suffix", "no draft model"),
    DrafterKind("hybrid", "needs --draft (an EAGLE head or a draft model)", draft_model=True),
    DrafterKind("sprinter", "needs --draft and --verifier", draft_model=True, objective="sprinter"),
    DrafterKind("stophead", "needs --draft and --head", draft_model=True, objective="acceptance"),
    DrafterKind("beam", "needs --draft", draft_model=True),
    DrafterKind("target-beam", "target only (its beams run on the target's weights)"),
    DrafterKind("companion", "needs --draft and --companion (registry defaults)", draft_model=True, companion=True),
    DrafterKind("staged", "needs --draft and --companion (registry defaults)", draft_model=True, companion=True),
)}


@dataclass(frozen=True)
class Method:
    name: str
    summary: str
    drafter: str  # a key of DRAFTERS
    make_rule: Callable[[dict[str, Any]], TargetRule]
    options: tuple[Option, ...] = ()
    uses_gamma: bool = True
    greedy_only: bool = False
    exact: bool = True
    reference: str = ""
    loop: str = "speculative"  # "speculative" (draft -> verify on one engine), "sequence" (eq. 1: the draft's
    #                            engine writes each response, the target's engine redoes the deferred ones)
    draft_stop: Callable[[dict[str, Any]], Callable] | None = None  # the drafter's own deferral (sequential cascades)
    run_option: str | None = None  # the option that sets the draft window in place of gamma
    selector: str = ""  # the select phase: "" (verify every drafted token) | "sv" | "history" | "smartspec"
    fixed_run: int = 0  # a fixed draft run for a method without gamma (oracle-diff: 1)
    refuses: tuple[tuple[str, str], ...] = ()  # (request feature, why this method cannot apply it)
    head_refusal: str = ""  # why an EAGLE head cannot draft for it ("": a head can, when the method has a draft)
    independent_by_default: bool = False  # a head can draft, but the registry's default is the independent draft
    _defaults: dict[str, Any] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.drafter not in DRAFTERS:
            raise ValueError(f"method {self.name!r}: unknown drafter kind {self.drafter!r}")
        object.__setattr__(self, "_defaults", {o.name: o.default for o in self.options})

    @property
    def kind(self) -> DrafterKind:
        return DRAFTERS[self.drafter]

    @property
    def needs_draft(self) -> bool:
        return self.kind.draft_model

    def refusal(self, feature: str) -> str | None:
        """Why this method cannot apply a request feature ("logprobs", "prompt_logprobs", "a grammar"), or None."""
        return dict(self.refuses).get(feature)

    def draft_run(self, options: dict[str, Any], gamma: int) -> int:
        """Tokens drafted per step at most: the window option, else gamma, else the fixed draft length."""
        if self.run_option:
            return int(options[self.run_option])
        return gamma if self.uses_gamma else self.fixed_run

    @property
    def needs_companion(self) -> bool:
        return self.kind.companion

    @property
    def needs_profile(self) -> bool:
        """Reads an SV profile: P(accept | S, A) for `sv`, the latency model for every selector."""
        return bool(self.selector)

    def check_required(self, options: dict[str, Any]) -> None:
        """Options without a usable default (a trained file) must be given; checked when a method runs,
        after `make_rule` has checked the values."""
        for option in self.options:
            if option.required and not options.get(option.name):
                raise DraftwiseError(f"{self.name} needs {option.name}=PATH ({option.required})")

    def resolve_options(self, given: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(given) - set(self._defaults))
        if unknown:
            valid = ", ".join(self._defaults) or "none"
            raise DraftwiseError(f"method {self.name!r} has no option {', '.join(map(repr, unknown))}; its options: {valid}")
        options = dict(self._defaults)
        for option in self.options:
            if option.name in given and given[option.name] is not None:
                value = given[option.name]
                try:
                    typed = option.type(value)
                except (TypeError, ValueError):
                    typed = None
                if typed is None or (isinstance(typed, float) and not math.isfinite(typed)) or (
                        option.type is int and (isinstance(value, bool) or typed != value and not isinstance(value, str))):
                    raise DraftwiseError(
                        f"option {option.name!r} of method {self.name!r} must be a finite {option.type.__name__}, "
                        f"got {short(value, 60)}"
                    )
                if option.high is not None and typed > option.high:
                    raise DraftwiseError(f"option {option.name!r} of method {self.name!r} must be <= {option.high}, "
                                         f"got {typed}")
                options[option.name] = typed
        return options


def _positive_int(name: str, value: int) -> int:
    if value < 1:
        raise DraftwiseError(f"{name} must be >= 1, got {value}")
    return value


def _ngram_rule(options: dict[str, Any]) -> TargetRule:
    _positive_int("min_ngram", options["min_ngram"])
    if options["max_ngram"] < options["min_ngram"]:
        raise DraftwiseError(f"max_ngram ({options['max_ngram']}) must be >= min_ngram ({options['min_ngram']})")
    return _coupled(options)


_ALPHA = Option("alpha", 0.1, float, "deviation allowed from the target (0 = exact)")

_CONFIDENCE = Option("confidence", -1.0, float,
                     "dynamic draft length: stop drafting when the draft's top probability falls below this (0: "
                     "always gamma tokens; -1: the EAGLE head's tuned value, else 0)")


MAX_TREE_NODES = 64
_TREE = Option("tree_nodes", 0, int, "token trees: at most this many drafted nodes per row, verified in one forward "
               "(0: a chain of gamma tokens; the engine takes fewer at large batches, from the measured verification "
               "cost); gamma bounds the depth", high=MAX_TREE_NODES)
_TREE_ADAPTIVE = Option("tree_adaptive", 1, int, "token trees: 1 verifies only the nodes that pay for their "
                        "verification (the measured cost against each node's draft probability), 0 always the best "
                        "tree_nodes (the same trees on every machine)", high=1)


def _sd_rule(options: dict[str, Any]) -> TargetRule:
    if options.get("tree_nodes", 0) < 0:
        raise DraftwiseError(f"tree_nodes must be >= 0 (0: a chain), got {options['tree_nodes']}")
    if options.get("tree_adaptive", 1) not in (0, 1):
        raise DraftwiseError(f"tree_adaptive must be 0 or 1, got {options['tree_adaptive']}")
    if not (options["confidence"] == -1.0 or 0.0 <= options["confidence"] <= 1.0):
        raise DraftwiseError(f"confidence must be in [0, 1], or -1 for the head's own value; got {options['confidence']!r}")
    return _coupled(options)


_COUPLING = Option("coupling", "gumbel", str, "how the draft's and the target's randomness are coupled: 'gumbel' (a "
                   "seeded answer is ar's, whatever the draft, batch or load) or 'rejection' (standard speculative "
                   "sampling; accepts more at T > 0, but its answer follows the draft lengths)")


def _coupled(options: dict[str, Any]) -> TargetRule:
    from draftwise.engine.keyed import COUPLINGS

    coupling = options.get("coupling", "gumbel")
    if coupling not in COUPLINGS:
        raise DraftwiseError(f"coupling must be one of {', '.join(COUPLINGS)}, got {coupling!r}")
    return ExactRule(coupling=coupling)


_SUFFIX_OPTIONS = (
    Option("depth", 24, int, "longest substring the suffix tries hold (longest match is depth - 1)", high=MAX_WINDOW),
    Option("factor", 1.0, float, "draft at most factor x the matched length (adaptive length)"),
    Option("min_prob", 0.1, float, "stop when the speculation's running frequency product falls below this"),
    Option("min_match", 2, int, "shortest suffix match that may draft", high=MAX_WINDOW),
    Option("global_tokens", 200_000, int, "tokens of earlier outputs kept for matching (0: this request only)",
           high=10_000_000),
)


def suffix_options(options: dict[str, Any]):
    from draftwise.drafters.suffix import SuffixOptions

    return SuffixOptions(depth=options["depth"], factor=options["factor"], min_prob=options["min_prob"],
                         global_tokens=options["global_tokens"], min_match=options["min_match"])


def _suffix_rule(options: dict[str, Any]) -> TargetRule:
    suffix_options(options)  # checks the values
    _sd_rule({"confidence": -1.0, **options})
    if "confidence" in options:
        _sd_rule(options)
    if "threshold" in options and options["threshold"] < 0:
        raise DraftwiseError(f"threshold must be >= 0, got {options['threshold']}")
    return _coupled(options)


def _window(name: str) -> Callable[[dict[str, Any]], TargetRule]:
    def check(options: dict[str, Any]) -> TargetRule:
        _positive_int(name, options[name])
        return AcceptDraftRule()
    return check


def _bild_rule(options: dict[str, Any]) -> TargetRule:
    _positive_int("max_window", options["max_window"])
    if not 0.0 <= options["fallback"] <= 1.0:
        raise DraftwiseError(f"bild: fallback must be in [0, 1], got {options['fallback']!r}")
    return BildRollbackRule(alpha=options["alpha"])


def _seq_rule(options: dict[str, Any]) -> TargetRule:
    sequence_confidence([], options["aggregate"])  # validates the name
    return ExactRule()


def _sprinter_rule(options: dict[str, Any]) -> TargetRule:
    from draftwise.rules.sprinter import SprinterRule, check_tau

    check_tau(options["tau"])
    _positive_int("max_run", options["max_run"])
    return SprinterRule()


def _adaedl_rule(options: dict[str, Any]) -> TargetRule:
    if options["scale"] < 0:
        raise DraftwiseError(f"adaedl: scale must be >= 0, got {options['scale']!r}")
    return ExactRule()


def _adaedl_stop(options: dict[str, Any]):
    from draftwise.rules.sprinter import adaedl_stop

    return adaedl_stop(options["scale"], options["threshold"])


def _specdecpp_rule(options: dict[str, Any]) -> TargetRule:
    if not 0.0 <= options["threshold"] <= 1.0:
        raise DraftwiseError(f"specdec++: threshold must be in [0, 1], got {options['threshold']!r}")
    return ExactRule()


def _mtad_rule(options: dict[str, Any]) -> TargetRule:
    from draftwise.drafters.mtad import check_beams
    from draftwise.rules.mtad import MTADRule, check_tau

    check_tau(options["tau"])
    check_beams(options["num_beams"])
    return MTADRule(tau=options["tau"])


def _mtjd_rule(options: dict[str, Any]) -> TargetRule:
    from draftwise.drafters.mtad import check_beams

    _positive_int("k", options["k"])
    check_beams(options["num_beams"])
    return AcceptDraftRule()


_BEAM_REFUSALS = (("a grammar", "its beams are searched without the grammar's masks"),)
_BEAMS = Option("num_beams", 4, int, "beams W of the beam search (MTAD's draft, MTJD's target)", high=16)

def model_spec(value: Any) -> Any:
    """A model option: a registry name or a path (as text), or a model already loaded."""
    if isinstance(value, (str, bytes)) or hasattr(value, "__fspath__"):
        return str(value) if not isinstance(value, bytes) else value.decode()
    return value


_COMPANION = Option("companion", "", model_spec, "companion model (registry name or path; default: the registry's "
                    "companion for a registry target)")
_LOOKAHEAD = Option("lookahead", 1, int, "draft at most this many tokens past the most the request verified in "
                    f"its last {QUIET_AFTER} steps (0: always draft gamma)", high=MAX_GAMMA)
_PROBE = Option("probe", PROBE_EVERY, int, f"a request whose last {QUIET_AFTER} steps verified nothing drafts nothing, "
                "except in every this-many-th step and when the batch shrinks, where a draft could pay (0: it keeps "
                "drafting `lookahead` tokens a step)", high=1_000_000)
_PROFILE = Option("profile", "", str, "SV profile from `draftwise profile-sv` (default: the shipped profile for "
                  "the registry's default trio and this sampling setting)")


def _lookahead_rule(options: dict[str, Any]) -> TargetRule:
    if options.get("lookahead", 0) < 0:
        raise DraftwiseError(f"lookahead must be >= 0 (0: always draft gamma), got {options['lookahead']!r}")
    if options.get("probe", 0) < 0:
        raise DraftwiseError(f"probe must be >= 0 (0: never stop drafting), got {options['probe']!r}")
    return ExactRule()


def _sv_rule(options: dict[str, Any]) -> TargetRule:
    if options.get("bins") not in (None, "adaptive", "equal"):
        raise DraftwiseError(f"sv: bins must be 'adaptive' or 'equal', got {options['bins']!r}")
    return _lookahead_rule(options)


def _svip_stop(options: dict[str, Any]):
    threshold = options["threshold"]

    def stop(q_raw):  # SVIP: stop drafting once sqrt(H(q)) exceeds the threshold; [..., vocab] -> [...] bool
        entropy = -(q_raw * q_raw.clamp(min=1e-30).log()).sum(-1)
        return entropy.sqrt() > threshold
    return stop


def _svip_rule(options: dict[str, Any]) -> TargetRule:
    if options["threshold"] < 0:
        raise DraftwiseError(f"svip: threshold must be >= 0, got {options['threshold']!r}")
    return ExactRule()


_CHOW_ALPHA = Option("alpha", 0.1, float, "the small model keeps a token when max q >= 1 - alpha")

METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method(
            "ar", "target-only autoregressive decoding: the baseline every speedup is measured against",
            drafter="none", make_rule=lambda o: ExactRule(), uses_gamma=False,
        ),
        Method(
            "sd", "speculative decoding with a draft model and gamma draft tokens (exact)",
            drafter="model", make_rule=_sd_rule, options=(_CONFIDENCE, _TREE, _TREE_ADAPTIVE, _COUPLING), reference="Leviathan et al. 2023",
        ),
        Method(
            "lossy", "lossy speculative sampling: accept with min(1, p/((1-alpha) q)), recover from norm(max(0, p/beta - q))",
            drafter="model", make_rule=lambda o: LossyRule(alpha=o["alpha"], beta=o["beta"]),
            options=(_ALPHA, Option("beta", 1.0, float, "residual scale, >= 1 - alpha (1 = Zhou et al.)")),
            exact=False, reference="Tran-Thien 2023; Narasimhan et al. §2, Lemma 2",
        ),
        Method(
            "lossy-greedy", "deterministic lossy variant for temperature 0: keep a draft token if p(v) >= (1-alpha) max p",
            drafter="model", make_rule=lambda o: LossyGreedyRule(alpha=o["alpha"]),
            options=(_ALPHA,), greedy_only=True, exact=False, reference="Leviathan et al. 2023 A.5; Narasimhan et al. §C.4",
        ),
        Method(
            "prompt-lookup", "n-gram drafting over the prompt and output so far, no draft model (exact)",
            drafter="ngram", make_rule=_ngram_rule,
            options=(
                Option("max_ngram", 3, int, "longest n-gram to match", high=MAX_WINDOW),
                Option("min_ngram", 1, int, "shortest n-gram to match", high=MAX_WINDOW),
                _COUPLING,
            ),
            reference="Saxena 2023 (prompt lookup decoding)",
        ),
        Method(
            "suffix", "suffix-tree drafting over the prompt, the output so far and earlier outputs (exact)",
            drafter="suffix", make_rule=_suffix_rule, options=(*_SUFFIX_OPTIONS, _TREE, _TREE_ADAPTIVE, _COUPLING),
            reference="Oliaro et al. 2024 (SuffixDecoding)",
        ),
        Method(
            "hybrid", "suffix drafting where its speculation scores high, the draft (an EAGLE head) elsewhere (exact)",
            drafter="hybrid", make_rule=_suffix_rule,
            options=(Option("threshold", 3.0, float, "expected accepted tokens a suffix speculation needs to be used"),
                     _CONFIDENCE, *_SUFFIX_OPTIONS, _TREE, _TREE_ADAPTIVE, _COUPLING),
            reference="Oliaro et al. 2024 §4 (hybrid with a model drafter)",
        ),
        Method(
            "cascade", "speculative cascade: Algorithm 4 towards pi from a deferral rule (" + ", ".join(CASCADE_RULES) + ")",
            drafter="model", make_rule=lambda o: CascadeRule(rule=o["rule"], alpha=o["alpha"], bonus_from=o["bonus"]),
            options=(
                Option("rule", "token-v3", str, "deferral rule: " + ", ".join(CASCADE_RULES)),
                Option("alpha", 0.1, float, "trade-off parameter of the rule (Table 1, eq. 13-15, 28)"),
                Option("bonus", "pi", str, "bonus token from 'pi' = T(q, p) (Algorithm 4; one more draft "
                       "forward) or from the 'target' p"),
            ),
            exact=False, reference="Narasimhan et al. 2025, Narasimhan et al. Algorithms 5-6",
        ),
        Method(
            "token-cascade", "sequential token-level cascade with Chow's rule: the target runs only when the draft defers",
            drafter="model", make_rule=_window("max_run"), draft_stop=lambda o: chow_stop(o["alpha"]),
            options=(_CHOW_ALPHA, Option("max_run", 10, int, "small-model tokens before the target is invoked anyway",
                                         high=MAX_WINDOW)),
            uses_gamma=False, run_option="max_run", exact=False, reference="Narasimhan et al. Algorithm 2, §F.1",
        ),
        Method(
            "seq-cascade", "sequence-level cascade with Chow's rule: keep the draft's whole response or let the target redo it",
            drafter="model", make_rule=_seq_rule, loop="sequence",
            options=(
                Option("alpha", 0.5, float, "keep the draft's response when its confidence >= 1 - alpha"),
                Option("aggregate", "mean", str, "confidence: 'mean' (per-token geometric mean) or 'product' (eq. 1)"),
            ),
            uses_gamma=False, exact=False, reference="Narasimhan et al. eq. 1",
            head_refusal="it lets the draft write a whole response alone, and a head cannot decode without the target",
            refuses=(("logprobs", "a kept response is never scored by the target"),
                     ("prompt_logprobs", "its draft pass, not the target, reads the prompt first")),
        ),
        Method(
            "oracle-diff", "oracle cascade with the Diff rule: both models at every position, each token from the "
            "deferral's choice (one-token drafts; head-room reference, not fast)",
            drafter="model", make_rule=lambda o: CascadeRule(rule="diff", alpha=o["alpha"], bonus_from="pi"),
            options=(Option("alpha", 0.0, float, "defer when max q < max p - alpha"),),
            uses_gamma=False, fixed_run=1, exact=False, reference="Narasimhan et al. Algorithm 3, eq. 5",
            head_refusal="the oracle defers between two models that each decode alone, and a head cannot decode without the target",
        ),
        Method(
            "bild", "original Big Little Decoder: draft until max q < 1 - fallback, deterministic rollback where -log p > alpha",
            drafter="model", make_rule=_bild_rule, draft_stop=lambda o: chow_stop(o["fallback"]),
            options=(
                Option("alpha", 2.0, float, "rollback threshold on -log p(draft token)"),
                Option("fallback", 0.5, float, "fallback threshold: the draft stops when max q < 1 - fallback"),
                Option("max_window", 10, int, "longest draft run", high=MAX_WINDOW),
            ),
            uses_gamma=False, run_option="max_window", greedy_only=True, exact=False,
            reference="Kim et al. 2023; Narasimhan et al. §B, §F.5",
        ),
        Method(
            "sprinter", "a trained verifier accepts draft tokens one by one; the target runs only at its first rejection",
            drafter="sprinter", make_rule=_sprinter_rule,
            options=(
                Option("verifier", "", str, "verifier file from `draftwise train-verifier`",
                       required="train one with `draftwise train-verifier`"),
                Option("tau", 0.5, float, "the verifier accepts a token when its score >= tau"),
                Option("max_run", 16, int, "longest run of verifier-accepted tokens before the target runs anyway",
                       high=MAX_WINDOW),
            ),
            uses_gamma=False, run_option="max_run", exact=False, reference="Zhong et al. 2025, Zhong et al. Algorithm 2",
            independent_by_default=True,  # the shipped trained files read the independent draft's states
        ),
        Method(
            "adaedl", "exact speculative decoding whose draft stops when 1 - sqrt(scale * entropy(q)) < threshold",
            drafter="model", make_rule=_adaedl_rule, draft_stop=_adaedl_stop,
            options=(
                Option("scale", 0.4, float, "gamma of AdaEDL's bound 1 - sqrt(gamma H(q))"),
                Option("threshold", 0.5, float, "stop drafting when the bound falls below this"),
            ),
            reference="Agrawal et al. 2024 (AdaEDL), fixed threshold",
        ),
        Method(
            "specdec++", "exact speculative decoding whose draft stops when a trained head's P(a rejection) > threshold",
            drafter="stophead", make_rule=_specdecpp_rule,
            options=(
                Option("head", "", str, "acceptance head from `draftwise train-verifier --objective acceptance`",
                       required="train one with `draftwise train-verifier --objective acceptance`"),
                Option("threshold", 0.7, float, "stop after the token where 1 - prod(acceptance) exceeds this"),
            ),
            reference="Huang et al. 2024 (SpecDec++)",
            independent_by_default=True,  # the shipped trained files read the independent draft's states
        ),
        Method(
            "fly", "lossy FLy verification: forgive a mismatch at an uncertain position when the next drafts stay aligned",
            drafter="model", make_rule=lambda o: FLyRule(window=o["window"], entropy_threshold=o["entropy_threshold"]),
            options=(
                Option("window", 2, int, "drafted tokens after a mismatch that must match the target's argmax",
                       high=MAX_GAMMA),
                Option("entropy_threshold", 0.5, float, "target entropy (nats) above which a mismatch may be forgiven"),
            ),
            exact=False, reference="Li et al. 2025 (FLy), vLLM",
        ),
        Method(
            "sv", "speculative verification: a companion model predicts acceptance from (S, A); the batch verifies "
            "the drafted tokens that maximise estimated goodput (exact)",
            drafter="companion", make_rule=_sv_rule, selector="sv",
            options=(_COMPANION, _PROFILE,
                     Option("bins", "adaptive", str, "P(accept | S, A) from 'adaptive' (quantile) or 'equal' bins"),
                     _LOOKAHEAD, _PROBE),
            reference="Kim et al. 2025, Kim et al. §4-§5",
            head_refusal="SV's companion reads the draft's unwarped distributions, which the head drafter does not expose",
        ),
        Method(
            "adaptive-verify", "the goodput scheduler with each slot scored by its request's acceptance history "
            "(vLLM-style adaptive verification, no companion; exact)",
            drafter="model", make_rule=_lookahead_rule, selector="history", options=(_PROFILE, _LOOKAHEAD, _PROBE),
            reference="Kim et al. §2; vLLM adaptive verification",
            head_refusal="the SV selectors are built for independent drafts",
        ),
        Method(
            "smartspec", "one draft length per batch from each request's moving-average acceptance and the profiled "
            "step cost (exact)",
            drafter="model", make_rule=lambda o: ExactRule(), selector="smartspec", options=(_PROFILE,),
            reference="Liu et al. 2024 (SmartSpec); Kim et al. §2",
            head_refusal="the SV selectors are built for independent drafts",
        ),
        Method(
            "svip", "exact speculative decoding whose draft stops once sqrt(entropy(q)) > threshold",
            drafter="model", make_rule=_svip_rule, draft_stop=_svip_stop,
            options=(Option("threshold", 1.0, float, "stop drafting when sqrt(H(q)) (nats) exceeds this"),),
            reference="Zhang et al. 2025 (SVIP); Kim et al. §2",
        ),
        Method(
            "staged", "staged speculative decoding: the companion verifies the draft first, the target verifies what "
            "it keeps with the companion as the proposal (exact)",
            drafter="staged", make_rule=lambda o: ExactRule(), options=(_COMPANION,),
            reference="Spector & Re 2023; Kim et al. §2, §7.3",
            head_refusal="staged drafting runs the draft model and a companion",
        ),
        Method(
            "mtad", "multi-token assisted decoding: beam-search drafts, keep the longest prefix with "
            "min(1, p(x_1:j)/q(x_1:j)) > tau, then one target token (lossy: aims at lower perplexity)",
            drafter="beam", make_rule=_mtad_rule,
            options=(_BEAMS, Option("tau", 0.5, float, "MTAD keeps a prefix when min(1, joint p / joint q) > tau")),
            exact=False, reference="the MTAD paper §3.2, Algorithm 1", refuses=_BEAM_REFUSALS,
        ),
        Method(
            "mtjd", "multi-token joint decoding: the target's own beam search over k tokens, then the target's next "
            "token, per step (quality reference, slow)",
            drafter="target-beam", make_rule=_mtjd_rule,
            options=(Option("k", 4, int, "tokens per joint block", high=16), _BEAMS),
            uses_gamma=False, run_option="k", exact=False, reference="the MTAD paper Def. 3.1, Figure 1",
            refuses=_BEAM_REFUSALS,
        ),
    )
}


def get_method(name: str) -> Method:
    try:
        return METHODS[name]
    except KeyError:
        raise DraftwiseError(f"unknown method {name!r}{did_you_mean(str(name), METHODS)}; choose one of: "
                             f"{', '.join(METHODS)}") from None
