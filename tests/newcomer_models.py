"""A tiny stand-in for the registry's default models, for the newcomer tests.

`build(root)` saves a tiny chat target (with a chat template), an independent draft and an
EAGLE head under `root`; `register(root)` puts them into the registry under the default
models' names (`smollm2-135m`, `smollm2-135m-eagle`, `smollm2-135m-draft`), so the README's
own commands run unchanged on them, in this process or, through `run_cli`, in a fresh one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from conftest import tiny_llama, tiny_tokenizer

# A minimal chat template: role-tagged turns, then the assistant's turn opened.
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
TARGET, EAGLE, DRAFT = "smollm2-135m", "smollm2-135m-eagle", "smollm2-135m-draft"
TESTS = Path(__file__).resolve().parent


def chat_tokenizer():
    tok = tiny_tokenizer(64)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build(root: Path) -> dict[str, str]:
    """Save the tiny target (chat template), draft and EAGLE head; returns their directories by role."""
    from draftwise.heads.eagle import EagleConfig, EagleHead

    root = Path(root)
    tok = chat_tokenizer()
    target = tiny_llama(0, window=512)
    target.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    tiny_llama(1, layers=1, window=512).save_pretrained(root / "draft")
    tok.save_pretrained(root / "draft")
    torch.manual_seed(2)
    config = EagleConfig(hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128, target_vocab_size=64,
                         target="tiny")
    EagleHead(config, torch.arange(48)).save(root / "eagle", dtype=torch.float32)
    dirs = {"target": str(root / "target"), "draft": str(root / "draft"), "eagle": str(root / "eagle")}
    (root / "dirs.json").write_text(json.dumps(dirs))
    return dirs


def register(root: Path, setitem=None) -> dict[str, str]:
    """The tiny models under the default models' registry names. `setitem` (pytest's monkeypatch.setitem)
    undoes it after the test; without it the change lasts for the process (a subprocess)."""
    from draftwise.models import registry

    dirs = json.loads((Path(root) / "dirs.json").read_text())
    setitem = setitem or (lambda mapping, key, value: mapping.__setitem__(key, value))
    for name, role, key in ((TARGET, "target", "target"), (EAGLE, "eagle", "eagle"), (DRAFT, "draft", "draft")):
        path = Path(dirs[key])
        setitem(registry._ENTRIES, name, registry.RegistryEntry(
            name=name, role=role, description=f"tiny {role} for tests", resolve=lambda path=path: path,
            cached=lambda: "ready"))
    setitem(registry._DEFAULT_DRAFTS, TARGET, (EAGLE, DRAFT))
    setitem(registry._SAMPLED_HEADS, TARGET, EAGLE)  # the tiny head at every temperature (the shipped T=1 head is real)
    # the registry's verifier files for the pair: the tiny ones under root/verifiers (none unless a test trains them)
    setitem(vars(registry), "VERIFIERS_DIR", Path(root) / "verifiers")
    return dirs


def run_cli(root: Path, argv: list[str], *, stdin: str | None = None, timeout: float = 300):
    """`draftwise ARGV` in a fresh Python process whose registry holds the tiny models."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import newcomer_models as m; m.register(sys.argv[2]); "
        "from draftwise.cli import main; sys.exit(main(sys.argv[3:]))"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", code, str(TESTS), str(root), *argv], capture_output=True,
                          text=True, input=stdin, timeout=timeout, env=env)
