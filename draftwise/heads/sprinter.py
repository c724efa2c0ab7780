"""SPRINTER (Zhong et al.): a tiny trained verifier accepts draft tokens one by one; the target is
called only when the verifier rejects.

Algorithm 2 on the engine: the drafter samples x ~ S(q) one token at a time and scores each
with the verifier V(s(x, prefix)); drafting continues while the score is >= `tau` (at most
`max_run` tokens). The run ends with the first token the verifier rejects. The target then
runs once over the whole run; the tokens the verifier accepted stay (pi = one-hot), and only
the rejected last token is checked with the speculative-sampling rule (pi = S(p): accept with
min(1, p/q), else draw from the residual). When the verifier accepted every token (`max_run`
reached) or the last one passes, the bonus token after the run is drawn from the target, which
the same forward already computed (Algorithm 2 drops it; keeping it costs nothing and is an
exact target sample).

Features s(x, prefix) (`FEATURES`):
- `hidden`: the draft's last-layer hidden state at the position that produced q, i.e. the
  "last embedding of the previous token" of §3.2 (the paper's choice);
- `embedding`: the draft's input embedding of x;
- `stats`: log q(x), max q and the entropy of the unwarped q.

The rule is `rules.sprinter.SprinterRule`. A verifier file records the features, the draft model's fingerprint and the sampling settings
its labels were made with; loading it for another draft is an error that says so.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from draftwise.errors import DraftwiseError
from draftwise.models.linear import weight_rows
from draftwise.engine.sampling import SamplingConfig

FEATURES = ("hidden", "embedding", "stats")
FORMAT = "draftwise-sprinter-verifier-1"


def draft_fingerprint(model: torch.nn.Module, *, legacy: bool = False) -> str:
    """A short hash of a model's shape and of the start of its embedding matrix.

    The rows are rounded to bf16 first, so the same weights loaded in fp32, fp16 or bf16 give one fingerprint.
    `legacy`: the hash of the unrounded rows, which files written before that change record."""
    from draftwise.heads.eagle import DraftHead

    if isinstance(model, DraftHead):  # a feature head: its kind, sizes, draft vocabulary and input projection
        shape = {"head": type(model).__name__, "feature_size": model.feature_size,
                 "vocab": model.vocab_ids[:64].tolist(), "draft_vocab": int(model.vocab_ids.shape[0])}
        weight = model.fc.weight.detach()[:64]
    else:
        config = model.config
        shape = {k: getattr(config, k, None) for k in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size")}
        weight = weight_rows(model.get_input_embeddings(), torch.arange(64))
    weight = (weight.float() if legacy else weight.to(torch.bfloat16).float()).cpu().contiguous()
    digest = hashlib.sha256(json.dumps(shape, sort_keys=True).encode() + weight.numpy().tobytes())
    return digest.hexdigest()[:16]


def verifier_features(features: Sequence[str], hidden: torch.Tensor, tokens: torch.Tensor, q_raw: torch.Tensor,
                      embedding: torch.nn.Module) -> torch.Tensor:
    """s(x, prefix) for n drafted tokens: hidden [n, H], tokens [n], q_raw [n, V] -> [n, d] float32."""
    parts = []
    for name in features:
        if name == "hidden":
            parts.append(hidden.float())
        elif name == "embedding":
            parts.append(embedding(tokens).float())
        elif name == "stats":
            q = q_raw.float()
            q_x = q.gather(-1, tokens[:, None]).clamp_min(1e-12)
            entropy = -torch.special.xlogy(q, q).sum(-1, keepdim=True)
            parts.append(torch.cat([q_x.log(), q.max(-1, keepdim=True).values, entropy], dim=-1))
        else:
            raise DraftwiseError(f"unknown verifier feature {name!r}; choose from: {', '.join(FEATURES)}")
    return torch.cat(parts, dim=-1)


@dataclass(frozen=True)
class VerifierSpec:
    features: tuple[str, ...]
    input_size: int
    draft_fingerprint: str
    draft_name: str = ""
    target_fingerprint: str = ""  # the labels come from this target's distributions ("": not recorded)
    target_name: str = ""
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    lam: float = 1.0  # labels: 1 iff q(x) / p(x) <= lam
    arch: str = "linear"  # "linear" (+ sigmoid: the paper) or "mlp"
    mlp_width: int = 64
    extra: dict = field(default_factory=dict)  # training report (ROC-AUC, TPR/FPR...)


class Verifier(torch.nn.Module):
    """Linear (or one-hidden-layer MLP) + sigmoid over standardised features."""

    def __init__(self, spec: VerifierSpec) -> None:
        super().__init__()
        if spec.arch not in ("linear", "mlp"):
            raise DraftwiseError(f"verifier arch must be 'linear' or 'mlp', got {spec.arch!r}")
        self.spec = spec
        d = spec.input_size
        self.register_buffer("mean", torch.zeros(d))
        self.register_buffer("std", torch.ones(d))
        if spec.arch == "linear":
            self.net = torch.nn.Linear(d, 1)
        else:
            self.net = torch.nn.Sequential(torch.nn.Linear(d, spec.mlp_width), torch.nn.GELU(),
                                           torch.nn.Linear(spec.mlp_width, 1))

    def logit(self, features: torch.Tensor) -> torch.Tensor:
        return self.net((features - self.mean) / self.std).squeeze(-1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """P(acceptable) per row: [n, d] -> [n]."""
        return torch.sigmoid(self.logit(features))

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.net.parameters())

    def save(self, path: str | Path) -> None:
        from draftwise.atomic import save_torch as atomic_save

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        spec = asdict(self.spec)
        atomic_save({"format": FORMAT, "spec": json.dumps(spec), "state": self.state_dict()}, path)

    @classmethod
    def load(cls, path: str | Path, draft_model: torch.nn.Module | None = None,
             target_model: torch.nn.Module | None = None) -> "Verifier":
        path = Path(path)
        if not path.is_file():
            raise DraftwiseError(f"verifier file {str(path)!r} does not exist (train one with `draftwise train-verifier`)")
        try:
            blob = torch.load(path, map_location="cpu", weights_only=True)
            assert blob.get("format") == FORMAT
            spec_dict = json.loads(blob["spec"])
        except Exception as error:  # noqa: BLE001 - any unreadable file gets the same message
            raise DraftwiseError(f"{path} is not a draftwise SPRINTER verifier ({error.__class__.__name__})") from None
        spec_dict["features"] = tuple(spec_dict["features"])
        spec = VerifierSpec(**spec_dict)
        verifier = cls(spec)
        verifier.load_state_dict(blob["state"])
        if draft_model is not None:
            verifier.check_draft(draft_model)
        if target_model is not None:
            verifier.check_target(target_model)
        return verifier.eval()

    def check_target(self, target_model: torch.nn.Module) -> None:
        if self.spec.target_fingerprint:  # files from before targets were recorded: not checked
            self._check_model(target_model, self.spec.target_fingerprint, self.spec.target_name,
                              "this file was trained for another target model{name}: its labels come from that "
                              "target's distributions", "train one for this target with `draftwise train-verifier`")

    def check_draft(self, draft_model: torch.nn.Module) -> None:
        self._check_model(draft_model, self.spec.draft_fingerprint, self.spec.draft_name,
                          "this verifier was trained on the features of another draft model{name}",
                          "train one for this draft")

    @staticmethod
    def _check_model(model: torch.nn.Module, expected: str, name: str, what: str, fix: str) -> None:
        found = draft_fingerprint(model)
        if found != expected and draft_fingerprint(model, legacy=True) != expected:  # older files: unrounded rows
            named = f" ({name})" if name else ""
            raise DraftwiseError(f"{what.format(name=named)}: fingerprint {expected}, but the model given has "
                                 f"{found}; {fix}")

    def check_sampling(self, sampling: SamplingConfig) -> None:
        mine = SamplingConfig(self.spec.temperature, self.spec.top_k, self.spec.top_p)
        if mine != sampling:
            raise DraftwiseError(
                f"this verifier's labels were made at temperature={mine.temperature}, top_k={mine.top_k}, "
                f"top_p={mine.top_p}; decoding with temperature={sampling.temperature}, top_k={sampling.top_k}, "
                f"top_p={sampling.top_p} needs a verifier trained with those settings"
            )
