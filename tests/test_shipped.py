"""The shipped helpers agree with each other: every verifier file the registry lists exists and was trained
on the shipped draft's weights, for the sampling setting and objective its name says. (A retrained draft
without retrained verifiers fails here, not at a user's first `--method sprinter`.)"""

from __future__ import annotations

import json

import pytest

from draftwise.models import registry
from draftwise.models.loading import read_output_vocabulary
from draftwise.heads.sprinter import Verifier

SHIPPED = [(target, draft, objective, temperature)
           for (target, draft), temperatures in registry._TRAINED_FILES.items()
           for objective in ("sprinter", "acceptance") for temperature in temperatures]
# the Qwen2.5-Coder pair's files come with `make pair`, not `make install`: their checks run with `make test-slow`
PARAMS = [pytest.param(*entry, id=f"{entry[1]}-{entry[2]}-t{entry[3]:g}",
                       marks=[pytest.mark.slow] if entry[0].startswith("qwen2.5-coder") else [])
          for entry in SHIPPED]


@pytest.fixture(scope="module")
def drafts():
    return {}


@pytest.mark.parametrize("target, draft, objective, temperature", PARAMS)
def test_shipped_verifier_matches_the_shipped_draft(drafts, target, draft, objective, temperature):
    from draftwise.models.loading import load_model

    path = registry.trained_file(target, draft, objective, temperature)
    assert path is not None, f"{draft}-{objective}-t{temperature:g}.pt is listed but not shipped"
    if draft not in drafts:  # as `--method sprinter` loads it (a GGUF draft in its own blocks)
        drafts[draft] = load_model(draft, dtype="auto").model
    verifier = Verifier.load(path, drafts[draft])  # raises if the draft's weights changed since training
    assert verifier.spec.temperature == temperature and verifier.spec.top_k == 0 and verifier.spec.top_p == 1.0
    assert verifier.spec.extra.get("objective", "sprinter") == objective
    assert verifier.spec.target_name == target and verifier.spec.target_fingerprint


def test_shipped_draft_output_vocabulary_is_valid():
    directory = registry.resolve("smollm2-135m-draft")
    config = json.loads((directory / "config.json").read_text())
    ids = read_output_vocabulary(directory / "output-vocab.json", config["vocab_size"])
    assert len(ids) == 8192
    assert {config["bos_token_id"], config["eos_token_id"]} <= set(ids.tolist())


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_shipped_sv_profiles_are_found_for_the_registry_helpers(temperature):
    """`sv` on the registry's SmolLM2 helpers needs no --profile: the shipped profile is found wherever the module
    that looks for it lives (a move once left it looking in the wrong folder)."""
    from draftwise.engine.sampling import SamplingConfig
    from draftwise.selectors.sv import profile_setting, shipped_profile

    setting = profile_setting("smollm2-135m", "smollm2-135m-draft", "smollm2-135m-companion",
                              SamplingConfig(temperature=temperature))
    path = shipped_profile(setting)
    assert path is not None and path.parent.name == "sv-profiles"
