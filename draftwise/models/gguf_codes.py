"""Loading a GGUF file straight into its codes: no float copy on disk, none in memory.

transformers builds the model's skeleton on the meta device from the file's metadata (config and tokenizer, read
once and kept in a small cache entry, `<cache>/models/<entry>-meta-<key>/`). The decoder's projections and the LM
head become `linear.CodesProjection`s, the token embedding a `linear.CodesEmbedding` (a lookup dequantises the
rows it reads), and only the norms and biases are float tensors. Two regimes, one a file:
- a file whose projections are all Q4_K, Q6_K, Q5_0 or Q8_0 (a K-quant file such as Q4_K_M) keeps the file's own
  blocks byte for byte (`linear.BlockLinear`, int8 activations as llama.cpp runs it): they are copied from the
  file at every load, nothing is decoded and nothing cached;
- any other (Q4_0, Q4_1) is decoded once into a cache entry (`<entry>-codes-<key>/codes.safetensors`, packed for
  the codes kernel, float32 activations; written atomically by `cache.ensure_entry`), which later loads read.
Both the fast forward and transformers' own forward then run from the codes.

It serves Llama-family files (`fast.FAST_FAMILIES`) whose projections are all quantised, on the CPU, where the
kernel is built; anything else is loaded through the dequantising path (`loading._load_gguf`), and `load` returns
None with the reason."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch

from draftwise.models.linear import (BLOCK_KINDS, BlockLinear, CodesEmbedding, CodesLinear, CodesProjection, codes_of,
                                     joined)
from draftwise.models.quant import QUANTISED, GGUFTensor, _decode

CODES_FORMAT = 1  # the layout of a codes cache entry (a change makes new entries)
CHUNK_WEIGHTS = 1 << 24  # weights decoded at a time (about 50 MB of scratch)
_PROJECTIONS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                "mlp.down_proj": "ffn_down"}


class Unsupported(Exception):
    pass


def _file_key(path: Path) -> str:
    """The file's key in the cache (its path, size and modification time), as the dequantising loader keys it."""
    from draftwise.models.cache import gguf_cache_name

    return gguf_cache_name(path)[1]


def _meta_dir(path: Path, name: str) -> Path:
    """The file's config and tokenizer as a Hugging Face folder, written once (small: no weights)."""
    from transformers import AutoConfig, AutoTokenizer

    from draftwise.models.cache import ensure_entry

    key = _file_key(path)

    def build(out: Path) -> None:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(out)
        AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(out)

    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:64]
    return ensure_entry(f"{safe}-meta-{key[:12]}", build, source_sha256=key, supersedes=f"{safe}-meta-",
                        source=str(path.resolve()))


class _File:
    """The file's tensors by name, read from its memory map; `release(name)` drops a tensor's pages once it has
    been copied or decoded, so the map does not stay resident beside the weights.

    It reads the tensor table itself: gguf's GGUFReader builds a numpy view of every metadata item, and a Qwen2.5
    file's 151,936 tokens and 151,387 merges took it 21 s; here the metadata is stepped over (only
    `general.alignment` is kept) in about a tenth of a second."""

    _SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value type -> bytes

    def __init__(self, path: Path) -> None:
        import mmap
        import struct

        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        with open(path, "rb") as f:
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf, at = self.map, 0

        def take(fmt: str):
            nonlocal at
            values = struct.unpack_from("<" + fmt, buf, at)
            at += struct.calcsize("<" + fmt)
            return values if len(values) > 1 else values[0]

        def string() -> str:
            nonlocal at
            size = take("Q")
            at += size
            return bytes(buf[at - size: at]).decode("utf-8", "replace")

        def skip(kind: int) -> None:
            nonlocal at
            if kind == 8:
                size = take("Q")  # (not `at += take(...)`: that adds to `at` as it was before the read)
                at += size
            elif kind == 9:
                inner, count = take("IQ")
                if inner in self._SCALARS:
                    at += self._SCALARS[inner] * count
                else:
                    for _ in range(count):
                        skip(inner)
            else:
                at += self._SCALARS[kind]

        magic, version = take("4sI")
        if magic != b"GGUF" or version < 2:
            raise Unsupported(f"not a GGUF v2+ file ({path.name})")
        n_tensors, n_kv = take("QQ")
        alignment = 32
        for _ in range(n_kv):
            key, kind = string(), take("I")
            if key == "general.alignment" and kind == 4:
                alignment = take("I")
            else:
                skip(kind)
        infos = []
        for _ in range(n_tensors):
            name = string()
            dims = take("I")
            shape = tuple(int(d) for d in (take("Q" * dims) if dims > 1 else (take("Q"),)))
            kind, offset = take("IQ")
            infos.append((name, shape, kind, offset))
        base = (at + alignment - 1) // alignment * alignment
        self.by_name: dict[str, tuple[str, tuple[int, ...], int, int, int]] = {}  # kind, shape, start, rows, row bytes
        for name, shape, kind, offset in infos:
            qtype = GGMLQuantizationType(kind)
            block, size = GGML_QUANT_SIZES[qtype]
            rows = int(np.prod(shape[1:])) if len(shape) > 1 else 1
            self.by_name[name] = (qtype.name.lower(), shape, base + offset, rows, shape[0] // block * size)

    def __contains__(self, name: str) -> bool:
        return name in self.by_name

    def __getitem__(self, name: str):
        """(kind, data, shape): data is [rows, row bytes] uint8 for a quantised tensor, else the values (shape
        reversed, as numpy reads ggml's order); shape is ggml's (inputs first)."""
        kind, shape, start, rows, row_bytes = self.by_name[name]
        raw = np.frombuffer(self.map, dtype=np.uint8, count=rows * row_bytes, offset=start)
        if kind in ("f32", "f16", "bf16"):
            dtype = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16}[kind]
            return kind, raw.view(dtype).reshape(tuple(reversed(shape))), shape
        return kind, raw.reshape(rows, row_bytes), shape

    def release(self, name: str) -> None:
        import mmap

        _, _, start, rows, row_bytes = self.by_name[name]
        size = rows * row_bytes
        if not hasattr(self.map, "madvise"):
            return
        page = mmap.PAGESIZE
        begin = start // page * page
        try:
            self.map.madvise(mmap.MADV_DONTNEED, begin, start + size - begin)
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


def _quantised_names(tensors: "_File", config) -> list[str]:
    names = [f"blk.{i}.{short}.weight" for i in range(config.num_hidden_layers) for short in _PROJECTIONS.values()]
    return names + [n for n in ("token_embd.weight", "output.weight") if n in tensors]


def _all_blocks(tensors: "_File", config) -> bool:
    """Whether every projection and the embedding are kinds the block kernel runs from the file's own bytes (a
    K-quant file's Q4_K, Q6_K, Q5_0 and Q8_0): then the model runs in llama.cpp's regime (int8 activations, see
    linear.BlockLinear) and nothing is decoded or cached. A file with any other kind (Q4_0, Q4_1) runs wholly on
    the codes kernel (float32 activations): one numerical regime a model."""
    return all(n in tensors and tensors[n][0] in BLOCK_KINDS for n in _quantised_names(tensors, config))


def _gather(tensors: "_File", config, blocks: bool) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """Every tensor the model needs, by key, and what each projection is: the file's own blocks, copied as they are
    (`blocks`), or its codes decoded and packed for the codes kernel."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    llama = config.model_type == "llama"
    flat: dict[str, torch.Tensor] = {}
    meta: dict[str, dict] = {}

    def put(key: str, name: str, order=None, bias=None) -> None:
        """Tensor `name`'s blocks (or its codes, decoded in slices of rows: bounded scratch memory), then its pages
        released."""
        kind, data, shape = tensors[name]
        if kind not in QUANTISED:
            raise Unsupported(f"a {kind} tensor ({name}; the codes kernel takes {', '.join(QUANTISED)})")
        if bias is not None:
            flat[key + ".bias"] = bias.float().contiguous()
        if blocks:
            rows = data if order is None else data[order.numpy()]
            flat[key + ".blocks"] = torch.from_numpy(np.array(rows, dtype=np.uint8, copy=True))
            meta[key] = {"kind": kind, "blocks": True, "in": int(shape[0])}
            tensors.release(name)
            return
        step = max(1, CHUNK_WEIGHTS // max(1, data.shape[1]))
        pieces = []
        for begin in range(0, data.shape[0], step):
            index = None if order is None else order[begin: begin + step].numpy()
            pieces.append(codes_of(_codes((kind, data[begin: begin + step] if index is None else data[index], None))))
        tensors.release(name)
        linear = joined(pieces) if len(pieces) > 1 else pieces[0]
        flat[key + ".codes"], flat[key + ".scales"] = linear.codes.contiguous(), linear.scales.contiguous()
        if linear.zeros is not None:
            flat[key + ".zeros"] = linear.zeros.contiguous()
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
    return flat, meta


def _build_codes(path: Path, config, out: Path) -> None:
    """Decode every tensor the model needs from the file and write them, packed for the codes kernel, to
    `out/codes.safetensors` (with what each is in its metadata): the cache a warm load reads."""
    import json

    from safetensors.torch import save_file

    flat, meta = _gather(_File(path), config, blocks=False)
    save_file(flat, str(out / "codes.safetensors"), metadata={"draftwise": json.dumps(meta)})


def _drop_stale(entry: str) -> None:
    """A codes entry an earlier draftwise decoded for a file that now runs from its blocks (about the file's size,
    never read again): removed, under the cache's lock."""
    import shutil

    from draftwise.models.cache import _lock, cache_root

    stale = cache_root() / "models" / entry
    if stale.is_dir():
        with _lock(entry):
            shutil.rmtree(stale, ignore_errors=True)


def load(path: Path, dtype: torch.dtype, *, name: str):
    """(model, tokenizer) with every projection in its codes, or raise Unsupported with the reason. The first load
    decodes the file into a cache entry (`<name>-codes-<key>`, about the file's size); later loads read it."""
    import json

    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from draftwise.models import qkernel
    from draftwise.models.cache import ensure_entry
    from draftwise.models.fast import FAST_FAMILIES

    if not qkernel.available():
        raise Unsupported(f"the codes kernel is not built ({qkernel.problem()})")
    meta_dir = _meta_dir(path, name)
    config = AutoConfig.from_pretrained(meta_dir, local_files_only=True)
    if config.model_type not in FAST_FAMILIES:
        raise Unsupported(f"{config.model_type} models")
    tensors = _File(path)
    key = hashlib.sha256(f"codes-{CODES_FORMAT}|{_file_key(path)}".encode()).hexdigest()
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:64]
    if _all_blocks(tensors, config):  # the file's own bytes, read as they are: nothing to decode or cache
        flat, meta = _gather(tensors, config, blocks=True)
        _drop_stale(f"{safe}-codes-{key[:12]}")
    else:
        entry = ensure_entry(f"{safe}-codes-{key[:12]}", lambda out: _build_codes(path, config, out),
                             source_sha256=key, supersedes=f"{safe}-codes-", source=str(path.resolve()))
        with safe_open(str(entry / "codes.safetensors"), framework="pt") as f:
            meta = json.loads(f.metadata()["draftwise"])
            flat = {k: f.get_tensor(k).clone() for k in f.keys()}  # owned memory: the map closes here
    del tensors

    def linear(key: str) -> CodesLinear | BlockLinear:
        info = meta[key]
        if info.get("blocks"):
            return BlockLinear(info["kind"], flat[key + ".blocks"], info["in"], flat.get(key + ".bias"))
        return CodesLinear.packed(info["kind"], info["bits"], info["group"], flat[key + ".codes"],
                                  flat[key + ".scales"], flat.get(key + ".zeros"), flat.get(key + ".bias"), info["in"])

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
            setattr(owner, leaf, CodesProjection(linear(f"layers.{i}.{attr}")))
        layer.input_layernorm.weight = param(flat[f"layers.{i}.input_layernorm"])
        layer.post_attention_layernorm.weight = param(flat[f"layers.{i}.post_attention_layernorm"])
    base.norm.weight = param(flat["norm"])
    base.embed_tokens = CodesEmbedding(linear("embed"), dtype)
    model.lm_head = CodesProjection(linear("lm_head") if "lm_head" in meta else base.embed_tokens.codes)
    with torch.device("cpu"):
        base.rotary_emb = type(base.rotary_emb)(config=config)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise Unsupported(f"tensors the file does not fill: {', '.join(left[:3])}")
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(meta_dir, local_files_only=True)
    return model, tokenizer
