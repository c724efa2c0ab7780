"""Loading a GGUF file straight into its codes: no float copy on disk, none in memory.

transformers builds the model's skeleton on the meta device from the file's metadata (config and tokenizer, read
once and kept in a small cache entry, `<cache>/models/<entry>-meta-<key>/`); the codes are decoded once into a cache
entry of their own (`<entry>-codes-<key>/codes.safetensors`, packed for the kernel, about the file's size, written
atomically by `cache.ensure_entry`), which later loads read as they are. The decoder's projections and the LM head
become `qkernel.CodesProjection`s over the file's codes, the token embedding a `qkernel.CodesEmbedding` (a lookup
dequantises the rows it reads), and only the norms and biases are float tensors. The codes are decoded once from
the file (`models.quant`) and repacked for draftwise's kernel (4-bit codes two to a byte, wider codes a signed byte
each). Both the fast forward and transformers' own forward then run from the codes.

It serves Llama-family files (`fast.FAST_FAMILIES`) whose projections are all quantised, on the CPU, where the
kernel is built; anything else is loaded through the dequantising path (`loading._load_gguf`), and `load` returns
None with the reason."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch

from .quant import QUANTISED, GGUFTensor, _decode, codes_of

CODES_FORMAT = 1  # the layout of a codes cache entry (a change makes new entries)
CHUNK_WEIGHTS = 1 << 24  # weights decoded at a time (about 50 MB of scratch)
_PROJECTIONS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                "mlp.down_proj": "ffn_down"}


class Unsupported(Exception):
    pass


def _file_key(path: Path) -> str:
    """The file's key in the cache (its path, size and modification time), as the dequantising loader keys it."""
    from .loading import gguf_cache_name

    return gguf_cache_name(path)[1]


def _meta_dir(path: Path, name: str) -> Path:
    """The file's config and tokenizer as a Hugging Face folder, written once (small: no weights)."""
    from transformers import AutoConfig, AutoTokenizer

    from .cache import ensure_entry

    key = _file_key(path)

    def build(out: Path) -> None:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(out)
        AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(out)

    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:64]
    return ensure_entry(f"{safe}-meta-{key[:12]}", build, source_sha256=key)


class _File:
    """The file's tensors by name, read from its memory map; `release(name)` drops a tensor's pages once it has
    been decoded, so the map does not stay resident beside the codes."""

    def __init__(self, path: Path) -> None:
        from gguf import GGUFReader

        self.reader = GGUFReader(str(path))
        self.by_name = {t.name: t for t in self.reader.tensors}

    def __contains__(self, name: str) -> bool:
        return name in self.by_name

    def __getitem__(self, name: str):
        t = self.by_name[name]
        return t.tensor_type.name.lower(), np.asarray(t.data), tuple(int(x) for x in t.shape)

    def release(self, name: str) -> None:
        import mmap

        t = self.by_name[name]
        mapped = getattr(self.reader.data, "_mmap", None)
        if mapped is None or not hasattr(mapped, "madvise"):
            return
        page = mmap.PAGESIZE
        start = (int(t.data_offset) // page) * page
        end = int(t.data_offset) + int(t.n_bytes)
        try:
            mapped.madvise(mmap.MADV_DONTNEED, start, end - start)
        except (OSError, ValueError):
            pass


def _float(entry) -> torch.Tensor:
    kind, data, _ = entry
    if kind not in ("f32", "f16", "bf16"):
        raise Unsupported(f"a {kind} norm or bias")
    if kind == "bf16":
        return torch.from_numpy(np.ascontiguousarray(data).view(np.int16).astype(np.int32) << 16).view(torch.float32)
    return torch.from_numpy(np.asarray(data, dtype=np.float32).copy())


def _codes(entry) -> GGUFTensor:
    kind, data, _ = entry
    if kind not in QUANTISED:
        raise Unsupported(f"a {kind} projection (the codes kernel takes {', '.join(QUANTISED)})")
    return _decode(kind, np.asarray(data))


def _llama_order(rows: int, heads: int) -> torch.Tensor:
    """llama.cpp's converter interleaves the rotary halves of a Llama file's q and k rows; this puts them back in
    transformers' order (`quant._match_rows` finds the same order by comparison)."""
    return torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(rows)


def _build_codes(path: Path, config, out: Path) -> None:
    """Decode every tensor the model needs from the file and write them, packed for the kernel, to
    `out/codes.safetensors` (with what each is in its metadata): the cache a warm load reads."""
    import json

    from safetensors.torch import save_file

    from . import qkernel

    tensors = _File(path)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    llama = config.model_type == "llama"
    flat: dict[str, torch.Tensor] = {}
    meta: dict[str, dict] = {}

    def put(key: str, name: str, order=None, bias=None) -> None:
        """Tensor `name`'s codes, decoded in slices of rows (bounded scratch memory), then its pages released."""
        kind, data, _ = tensors[name]
        if kind not in QUANTISED:
            raise Unsupported(f"a {kind} tensor ({name}; the codes kernel takes {', '.join(QUANTISED)})")
        step = max(1, CHUNK_WEIGHTS // max(1, data.shape[1]))
        pieces = []
        for begin in range(0, data.shape[0], step):
            index = None if order is None else order[begin: begin + step].numpy()
            pieces.append(codes_of(_codes((kind, data[begin: begin + step] if index is None else data[index], None))))
        tensors.release(name)
        linear = qkernel.joined(pieces) if len(pieces) > 1 else pieces[0]
        flat[key + ".codes"], flat[key + ".scales"] = linear.codes.contiguous(), linear.scales.contiguous()
        if linear.zeros is not None:
            flat[key + ".zeros"] = linear.zeros.contiguous()
        if bias is not None:
            flat[key + ".bias"] = bias.float().contiguous()
        meta[key] = {"kind": kind, "bits": linear.bits, "group": linear.group, "in": linear.in_features}

    for i in range(config.num_hidden_layers):
        for attr, short in _PROJECTIONS.items():
            key = f"blk.{i}.{short}"
            if key + ".weight" not in tensors:
                raise Unsupported(f"no {key}.weight")
            order = None
            if llama and short in ("attn_q", "attn_k"):
                order = _llama_order(tensors[key + ".weight"][1].shape[0], heads if short == "attn_q" else kv_heads)
            bias = _float(tensors[key + ".bias"]) if key + ".bias" in tensors else None
            if bias is not None and order is not None:
                bias = bias[order]
            put(f"layers.{i}.{attr}", key + ".weight", order, bias)
        flat[f"layers.{i}.input_layernorm"] = _float(tensors[f"blk.{i}.attn_norm.weight"])
        flat[f"layers.{i}.post_attention_layernorm"] = _float(tensors[f"blk.{i}.ffn_norm.weight"])
    flat["norm"] = _float(tensors["output_norm.weight"])
    put("embed", "token_embd.weight")
    if "output.weight" in tensors:
        put("lm_head", "output.weight")
    save_file(flat, str(out / "codes.safetensors"), metadata={"draftwise": json.dumps(meta)})


def load(path: Path, dtype: torch.dtype, *, name: str):
    """(model, tokenizer) with every projection in its codes, or raise Unsupported with the reason. The first load
    decodes the file into a cache entry (`<name>-codes-<key>`, about the file's size); later loads read it."""
    import json

    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from . import qkernel
    from .cache import ensure_entry
    from .fast import FAST_FAMILIES

    if not qkernel.available():
        raise Unsupported(f"the codes kernel is not built ({qkernel.problem()})")
    meta_dir = _meta_dir(path, name)
    config = AutoConfig.from_pretrained(meta_dir, local_files_only=True)
    if config.model_type not in FAST_FAMILIES:
        raise Unsupported(f"{config.model_type} models")
    key = hashlib.sha256(f"codes-{CODES_FORMAT}|{_file_key(path)}".encode()).hexdigest()
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:64]
    entry = ensure_entry(f"{safe}-codes-{key[:12]}", lambda out: _build_codes(path, config, out), source_sha256=key)
    with safe_open(str(entry / "codes.safetensors"), framework="pt") as f:
        meta = json.loads(f.metadata()["draftwise"])
        flat = {k: f.get_tensor(k).clone() for k in f.keys()}  # owned memory: the map closes here

    def linear(key: str) -> qkernel.CodesLinear:
        info = meta[key]
        return qkernel.CodesLinear.packed(info["kind"], info["bits"], info["group"], flat[key + ".codes"],
                                          flat[key + ".scales"], flat.get(key + ".zeros"), flat.get(key + ".bias"),
                                          info["in"])

    config.tie_word_embeddings = False  # the head is its own module here, over the embedding's codes if tied
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    base = model.base_model

    def param(t: torch.Tensor) -> torch.nn.Parameter:
        return torch.nn.Parameter(t.to(dtype), requires_grad=False)

    for i, layer in enumerate(base.layers):
        for attr in _PROJECTIONS:
            owner_name, leaf = attr.split(".")
            owner = getattr(layer, owner_name)
            if (getattr(owner, leaf).bias is not None) != (f"layers.{i}.{attr}.bias" in flat):
                raise Unsupported(f"layer {i} {attr}: the file's bias does not match the model's")
            setattr(owner, leaf, qkernel.CodesProjection(linear(f"layers.{i}.{attr}")))
        layer.input_layernorm.weight = param(flat[f"layers.{i}.input_layernorm"])
        layer.post_attention_layernorm.weight = param(flat[f"layers.{i}.post_attention_layernorm"])
    base.norm.weight = param(flat["norm"])
    base.embed_tokens = qkernel.CodesEmbedding(linear("embed"), dtype)
    model.lm_head = qkernel.CodesProjection(linear("lm_head") if "lm_head" in meta else base.embed_tokens.codes)
    with torch.device("cpu"):
        base.rotary_emb = type(base.rotary_emb)(config=config)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise Unsupported(f"tensors the file does not fill: {', '.join(left[:3])}")
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(meta_dir, local_files_only=True)
    return model, tokenizer


class CodesFormats:
    """The `draftwise_formats` of a model loaded in its codes (its projections are already in place)."""

    def __init__(self, model) -> None:
        self.kinds: dict[str, int] = {}
        for module in model.modules():
            linear = getattr(module, "linear", None)
            for part in getattr(linear, "parts", [linear] if linear is not None else []):
                self.kinds[part.kind] = self.kinds.get(part.kind, 0) + 1

    def linear(self, name, parts, weight, bias):
        raise AssertionError("a model loaded in its codes builds no projection from float weights")

    def describe(self) -> str:
        return "gguf codes (" + ", ".join(f"{n} {k}" for k, n in sorted(self.kinds.items())) + \
            " projections; draftwise's kernel)"
