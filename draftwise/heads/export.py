"""Export an EAGLE-3-style head as the checkpoint vLLM and SGLang load (`llama_eagle3`), and read such a checkpoint.

The layout (vLLM `model_executor/models/llama_eagle3.py`, SGLang `srt/models/llama_eagle3.py`):
- `config.json`: a Llama config with `architectures: ["LlamaForCausalLMEagle3"]`, one hidden layer,
  the target's `vocab_size`, the head's `draft_vocab_size`, `tie_word_embeddings: false`, and
  `eagle_config.eagle_aux_hidden_state_layer_ids` (the target layers whose inputs are fused);
- `model.safetensors`: `fc.weight` [H, 3H]; `midlayer.{input_layernorm, hidden_norm,
  post_attention_layernorm}.weight`; `midlayer.self_attn.{q,k,v}_proj.weight` [*, 2H];
  `midlayer.self_attn.o_proj.weight`; `midlayer.mlp.{gate,up,down}_proj.weight`; `norm.weight`;
  `lm_head.weight` [draft_vocab, H]; `d2t` int64 [draft_vocab] (target id = draft id + d2t);
  `t2d` bool [vocab] (which target ids are in the draft vocabulary).
The token embedding is the target's: both engines share it from the target, so it is written only on request.

A draftwise head maps onto this layout one to one (its architecture was chosen for that), so nothing is
approximated; `import_eagle3` reads the layout back (an exported head, or one trained elsewhere).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from draftwise.heads.eagle import DraftHead, EagleHead
from draftwise.heads.eagle3 import Eagle3Config, Eagle3Head
from draftwise.errors import DraftwiseError
from draftwise.models.head_files import EAGLE3_ARCHITECTURE as ARCHITECTURE, is_eagle3_checkpoint, is_eagle3_dir

_RENAMES = (("body.midlayer.", "midlayer."),)


def export_eagle3(head: Eagle3Head, out: str | Path, *, dtype: torch.dtype = torch.float16,
                  embeddings: torch.Tensor | None = None) -> Path:
    """Write `head` to `out` (created; refused if it holds files). Atomic: a temporary directory, then a rename."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DraftwiseError(f"--out {out} exists and is not an empty directory: choose a new one")
    c = head.config
    tensors: dict[str, torch.Tensor] = {}
    for name, value in head.state_dict().items():
        if name in ("vocab_ids", "feature_scale"):  # the feature scale is folded into fc (the layout has none)
            continue
        if name == "fc.weight":
            value = head.fc_weight()
        for old, new in _RENAMES:
            name = name.replace(old, new)
        tensors[name] = value.detach().to(dtype).contiguous()
    ids = head.vocab_ids.long()
    tensors["d2t"] = (ids - torch.arange(ids.shape[0])).contiguous()
    t2d = torch.zeros(c.target_vocab_size, dtype=torch.bool)
    t2d[ids] = True
    tensors["t2d"] = t2d
    if embeddings is not None:
        tensors["embed_tokens.weight"] = embeddings.detach().to(dtype).contiguous()
    config = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.target_vocab_size,
        "draft_vocab_size": head.draft_vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(c.feature_layers), "use_aux_hidden_state": True},
        "draftwise": {"target": c.target, "dynamic": c.dynamic},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def import_eagle3(path: str | Path) -> Eagle3Head:
    """Read an EAGLE-3 checkpoint in vLLM's / SGLang's layout into a draftwise head."""
    path = Path(path)
    try:
        config = json.loads((path / "config.json").read_text())
        state = load_file(str(path / "model.safetensors"))
    except (OSError, ValueError) as e:
        raise DraftwiseError(f"{path}: not a readable EAGLE-3 checkpoint ({type(e).__name__}: {e})") from None
    if config.get("num_hidden_layers", 1) != 1:
        raise DraftwiseError(f"{path}: {config['num_hidden_layers']} draft layers; draftwise reads one-layer EAGLE-3 heads")
    if config.get("tie_word_embeddings"):
        raise DraftwiseError(f"{path}: tied word embeddings (lm_head = embed_tokens) are not supported")
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    layers = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if not layers:
        raise DraftwiseError(f"{path}: config.json does not name the target layers the head reads "
                             "(eagle_config.eagle_aux_hidden_state_layer_ids)")
    extra = config.get("draftwise") or {}
    rope_theta = config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta") or 10000.0
    c = Eagle3Config(
        hidden_size=hidden, num_heads=heads, num_kv_heads=int(config.get("num_key_value_heads", heads)),
        head_dim=int(config.get("head_dim") or hidden // heads), intermediate_size=int(config["intermediate_size"]),
        target_vocab_size=int(config["vocab_size"]), feature_layers=tuple(layers),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)), rope_theta=float(rope_theta),
        max_position_embeddings=int(config.get("max_position_embeddings", 8192)), target=extra.get("target", ""),
        dynamic=extra.get("dynamic", {}))
    draft_vocab = int(config.get("draft_vocab_size") or config["vocab_size"])
    d2t = state.get("d2t")
    vocab_ids = torch.arange(draft_vocab) + (d2t.long() if d2t is not None else 0)
    head = Eagle3Head(c, vocab_ids)
    wanted = {}
    for name in head.state_dict():
        if name in ("vocab_ids", "feature_scale"):  # the layout's fc reads the features as they are: scale ones
            continue
        source = name
        for old, new in _RENAMES:
            source = source.replace(old, new)
        if source not in state:
            raise DraftwiseError(f"{path}: tensor {source} is missing")
        wanted[name] = state[source].float()
    head.load_state_dict({**wanted, "vocab_ids": vocab_ids, "feature_scale": torch.ones(3 * hidden)})
    return head.eval()


def load_head(path: str | Path) -> DraftHead:
    """Load the draft head in `path`, whichever kind it is."""
    if is_eagle3_dir(path):
        return Eagle3Head.load(path)
    if is_eagle3_checkpoint(path):  # vLLM's / SGLang's layout (`draftwise export-eagle`, or trained elsewhere)
        return import_eagle3(path)
    return EagleHead.load(path)
