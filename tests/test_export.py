"""`draftwise export-eagle`: the EAGLE-3 checkpoint layout vLLM and SGLang load, and reading it back."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import draftwise
from conftest import tiny_llama
from draftwise.heads.export import load_head
from draftwise.heads.eagle3 import Eagle3Head
from draftwise.errors import DraftwiseError
from draftwise.heads.export import export_eagle3, import_eagle3


def expected_layout(H: int, heads: int, kv_heads: int, head_dim: int, inter: int, draft_vocab: int, vocab: int):
    """Tensor names and shapes of a one-layer EAGLE-3 Llama head, as read from the engines' model code:
    vLLM vllm/model_executor/models/llama_eagle3.py (LlamaModel: fc over 3 x target hidden, no bias; the first
    decoder layer's qkv_proj over 2 x hidden; hidden_norm; load_weights maps "midlayer." to "layers.0.", "d2t" to
    draft_id_to_target_id, skips "t2d"; Eagle3LlamaForCausalLM.lm_head over draft_vocab_size) and SGLang
    python/sglang/srt/models/llama_eagle3.py (LlamaModel.fc, self.midlayer with qkv_proj over 2 x hidden_size and
    hidden_norm, self.norm, lm_head over draft_vocab_size, "d2t" as target id - draft id)."""
    return {
        "fc.weight": (H, 3 * H),
        "midlayer.input_layernorm.weight": (H,),
        "midlayer.hidden_norm.weight": (H,),
        "midlayer.post_attention_layernorm.weight": (H,),
        "midlayer.self_attn.q_proj.weight": (heads * head_dim, 2 * H),
        "midlayer.self_attn.k_proj.weight": (kv_heads * head_dim, 2 * H),
        "midlayer.self_attn.v_proj.weight": (kv_heads * head_dim, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": (inter, H),
        "midlayer.mlp.up_proj.weight": (inter, H),
        "midlayer.mlp.down_proj.weight": (H, inter),
        "norm.weight": (H,),
        "lm_head.weight": (draft_vocab, H),
        "d2t": (draft_vocab,),
        "t2d": (vocab,),
    }


# config.json keys both engines read for an EAGLE-3 draft: the Llama shape keys, architectures (model
# class lookup), draft_vocab_size (lm_head size; vLLM and SGLang), tie_word_embeddings (SGLang ties lm_head to
# embed_tokens when true), and vLLM's eagle_config (use_aux_hidden_state, the aux layer ids).
CONFIG_KEYS = {"architectures", "model_type", "hidden_size", "intermediate_size", "num_attention_heads",
               "num_key_value_heads", "num_hidden_layers", "rms_norm_eps", "rope_theta", "max_position_embeddings",
               "vocab_size", "draft_vocab_size", "tie_word_embeddings", "hidden_act", "eagle_config"}


def _head(target):
    torch.manual_seed(0)
    head = Eagle3Head.new(target, vocab_ids=torch.tensor([0, 3, 5, 8, 13, 21, 34, 40, 55, 63]), intermediate_size=48,
                          feature_layers=(0, 2, 3))
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.3 * torch.randn_like(p))
        head.feature_scale.copy_(0.5 + 4 * torch.rand(head.feature_size))  # folded into fc by the export
    return head.eval()


def test_export_matches_the_engines_layout_and_reloads_to_the_same_drafts(tmp_path):
    target = tiny_llama(0, layers=4, width=32)
    head = _head(target)
    out = export_eagle3(head, tmp_path / "export", dtype=torch.float32)
    tensors = load_file(str(out / "model.safetensors"))
    layout = expected_layout(32, 4, 2, 8, 48, 10, 64)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == layout
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert (torch.arange(10) + tensors["d2t"]).tolist() == head.vocab_ids.tolist()
    assert tensors["t2d"].nonzero()[:, 0].tolist() == head.vocab_ids.tolist()
    config = json.loads((out / "config.json").read_text())
    assert CONFIG_KEYS <= set(config)
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["draft_vocab_size"] == 10 and config["vocab_size"] == 64 and config["tie_word_embeddings"] is False
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 3]

    back = load_head(out).attach(target)  # the loader recognises the engines' layout
    assert isinstance(back, Eagle3Head)
    prompt = [5, 9, 11, 20, 7]
    kw = dict(method="sd", temperature=0, max_new_tokens=16, gamma=4, ignore_eos=True)
    a = draftwise.generate(target, prompt, draft=head, **kw)
    b = draftwise.generate(target, prompt, draft=back, **kw)
    assert a.token_ids == b.token_ids and a.stats["accepted_per_position"] == b.stats["accepted_per_position"]
    x, t = torch.randn(1, 6, head.feature_size), torch.randint(0, 64, (1, 6))
    with torch.no_grad():
        torch.testing.assert_close(back.logits(back(x, t)), head.logits(head(x, t)))


def test_export_refuses_a_used_directory_and_reads_only_eagle3_checkpoints(tmp_path):
    target = tiny_llama(0, layers=4, width=32)
    head = _head(target)
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "keep.txt").write_text("data")
    with pytest.raises(DraftwiseError, match="not an empty directory"):
        export_eagle3(head, tmp_path / "used")
    assert (tmp_path / "used" / "keep.txt").read_text() == "data"
    out = export_eagle3(head, tmp_path / "e")
    config = json.loads((out / "config.json").read_text())
    config["eagle_config"] = {}
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(DraftwiseError, match="target layers"):
        import_eagle3(out)


def test_export_eagle_cli_errors_in_one_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "draftwise", "export-eagle", "--head", str(tmp_path / "nothing"),
                             "--out", str(tmp_path / "o")], capture_output=True, text=True)
    assert result.returncode != 0
    assert "not an EAGLE head" in result.stderr and "Traceback" not in result.stderr
