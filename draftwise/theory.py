"""SPRINTER's theory (Zhong et al. §3.1, A.1-A.4, A.8), as functions the tests check by simulation.

eta_fp: false-positive rate (an unacceptable token, q(x) > p(x), passes the verifier);
eta_tp: true-positive rate (an acceptable token passes); r: acceptable tokens the draft can
produce before the first unacceptable one (the setting of Figure 4); t_d: draft time per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def _rate(name: str, value: float) -> float:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")
    return float(value)


def sprinter_distribution(p: np.ndarray, q: np.ndarray, eta_fp: float) -> np.ndarray:
    """Theorem 3.1: p_SPRINTER = (1 - eta_fp) p + eta_fp q."""
    eta_fp = _rate("eta_fp", eta_fp)
    return (1.0 - eta_fp) * np.asarray(p, dtype=float) + eta_fp * np.asarray(q, dtype=float)


def tv(p: np.ndarray, q: np.ndarray) -> float:
    return 0.5 * float(np.abs(np.asarray(p, dtype=float) - np.asarray(q, dtype=float)).sum())


def sprinter_tv(p: np.ndarray, q: np.ndarray, eta_fp: float) -> float:
    """Theorem 3.1: d_TV(p, p_SPRINTER) = eta_fp d_TV(p, q)."""
    return _rate("eta_fp", eta_fp) * tv(p, q)


def run_length_pmf(i: int, eta_tp: float, eta_fp: float, r: int) -> float:
    """Theorem 3.3: P(N = i), N = consecutive tokens the verifier accepts."""
    eta_tp, eta_fp = _rate("eta_tp", eta_tp), _rate("eta_fp", eta_fp)
    if i < 0:
        return 0.0
    if i < r:
        return eta_tp**i * (1.0 - eta_tp)
    return eta_tp**r * eta_fp ** (i - r) * (1.0 - eta_fp)


def expected_run_length(eta_tp: float, eta_fp: float, r: int) -> float:
    """Theorem 3.3, eq. 3: E[N] = (eta_tp - eta_tp^r) / (1 - eta_tp) + eta_tp^r / (1 - eta_fp)."""
    eta_tp, eta_fp = _rate("eta_tp", eta_tp), _rate("eta_fp", eta_fp)
    if eta_fp == 1.0:
        return float("inf")
    # (x - x^r) / (1 - x) = x + x^2 + ... + x^(r-1): r - 1 at x = 1
    first = r - 1.0 if eta_tp == 1.0 else (eta_tp - eta_tp**r) / (1.0 - eta_tp)
    return first + eta_tp**r / (1.0 - eta_fp)


def expected_stopping_time(eta_tp: float, eta_fp: float, r: int, t_d: float) -> float:
    """Theorem 3.4, eq. 4: E[T_stop] = (1 - eta_tp^r) t_d / (1 - eta_tp) + eta_tp^r t_d / (1 - eta_fp)."""
    eta_tp, eta_fp = _rate("eta_tp", eta_tp), _rate("eta_fp", eta_fp)
    if eta_fp == 1.0:
        return float("inf")
    first = r * t_d if eta_tp == 1.0 else (1.0 - eta_tp**r) * t_d / (1.0 - eta_tp)
    return first + eta_tp**r * t_d / (1.0 - eta_fp)


def acceptance_rate(eta_fp: float, tv_pq: float) -> float:
    """Theorem A.4: beta_SPRINTER = 1 - (1 - eta_fp) d_TV(p, q) (eta_fp = 0: speculative decoding's)."""
    return 1.0 - (1.0 - _rate("eta_fp", eta_fp)) * tv_pq


# ----------------------------------------------------------------------------- FLOPs (App. A.8)


@dataclass(frozen=True)
class ModelShape:
    vocab: int
    width: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    gated: bool  # SwiGLU-style MLP (three matrices) rather than two

    @classmethod
    def from_config(cls, config) -> "ModelShape":
        width = getattr(config, "hidden_size", None) or config.n_embd
        layers = getattr(config, "num_hidden_layers", None) or config.n_layer
        heads = getattr(config, "num_attention_heads", None) or config.n_head
        kv = getattr(config, "num_key_value_heads", None) or heads
        ffn = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * width
        gated = getattr(config, "model_type", "") in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2")
        return cls(config.vocab_size, width, layers, heads, kv, ffn, gated)


def forward_flops(shape: ModelShape, context: int = 0) -> float:
    """FLOPs of one forward pass for one token (Hoffmann et al. 2022 App. F; Casson 2023), as App. A.8 does:
    embeddings, attention projections (grouped-query aware), attention over `context` cached
    tokens, the MLP and the final logits. A multiply-add counts as 2."""
    d, head_dim = shape.width, shape.width // shape.heads
    embed = 2 * shape.vocab * d
    qkv = 2 * d * (d + 2 * shape.kv_heads * head_dim)
    attention = 2 * (context + 1) * d * 2 + 3 * shape.heads * (context + 1)  # logits + weighted sum, softmax
    out_proj = 2 * d * d
    mlp = 2 * (3 if shape.gated else 2) * d * shape.ffn
    logits = 2 * d * shape.vocab
    return float(embed + shape.layers * (qkv + attention + out_proj + mlp) + logits)


def sd_flops(gamma: int, f_draft: float, f_target: float) -> float:
    """eq. 5: SD-Flops(gamma) = gamma F_d + gamma F_t."""
    return gamma * (f_draft + f_target)


def sprinter_flops(gamma: int, f_draft: float, f_verifier: float, f_target: float) -> float:
    """eq. 6: SPRINTER-Flops(gamma) = gamma F_d + gamma F_v + F_t."""
    return gamma * (f_draft + f_verifier) + f_target


def verifier_flops(input_size: int, arch: str = "linear", mlp_width: int = 64) -> float:
    if arch == "linear":
        return 2.0 * input_size
    return 2.0 * (input_size * mlp_width + mlp_width)


def plot_figures(path, *, r: int = 5, t_d: float = 0.1, eta_fps=(0.1, 0.5)) -> None:
    """Figures 5 and 6: E[N] and E[T_stop] against eta_tp for a few eta_fp, with the ideal r and r t_d."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = np.linspace(0.0, 0.999, 200)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for eta_fp in eta_fps:
        axes[0].plot(grid, [expected_run_length(x, eta_fp, r) for x in grid], label=f"eta_FP = {eta_fp:g}")
        axes[1].plot(grid, [expected_stopping_time(x, eta_fp, r, t_d) for x in grid], label=f"eta_FP = {eta_fp:g}")
    axes[0].axhline(r, color="black", linestyle="--", linewidth=1, label=f"r = {r}")
    axes[1].axhline((r + 1) * t_d, color="black", linestyle="--", linewidth=1, label="(r + 1) t_d")
    axes[0].set_ylabel("expected tokens accepted by the verifier, E[N]")
    axes[1].set_ylabel("expected stopping time E[T_stop]")
    for ax, title in zip(axes, ("Theorem 3.3 (Figure 5)", f"Theorem 3.4, t_d = {t_d:g} (Figure 6)")):
        ax.set_xlabel("true-positive rate eta_TP")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
