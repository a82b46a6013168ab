"""Independent, deliberately plain re-implementation of VECA used as ground truth.

Written from the paper (arXiv 2605.12491: the forward pass) and the reference
checkpoint format (docs/conversion.md) alone.  It must not import anything from ``veca_hf``: its purpose is to
cross-check that package.  Speed is irrelevant here; every step is spelled out
in the most direct form (dense attention with a block mask, explicit
interleaved-pair RoPE, explicit SwiGLU split).

Eval-mode semantics only: patch-coordinate augmentation (train mode) is not
implemented.

``state_dict()`` keys are exactly the reference checkpoint keys described in
docs/conversion.md (without the ``module.`` / ``student.`` prefixes).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


__all__ = [
    "ReferenceVeca",
    "rope_periods",
    "rope_rotate_interleaved",
    "patch_coords",
    "strip_reference_prefixes",
]


# --------------------------------------------------------------------------- #
# RoPE
# --------------------------------------------------------------------------- #
def rope_periods(head_dim: int, base: float = 100.0, p_zero: float = 0.125) -> torch.Tensor:
    """The ``Hd/4`` periods ``p_f = base ** (2f / (Hd/2))``; the last
    ``round(p_zero * Hd/4)`` of them are infinite (channels not rotated)."""
    if head_dim % 4 != 0:
        raise ValueError(f"head_dim must be a multiple of 4, got {head_dim}")
    n_freq = head_dim // 4
    f = torch.arange(n_freq, dtype=torch.float64)
    periods = base ** (2.0 * f / (head_dim / 2))
    n_zero = round(p_zero * n_freq)
    if n_zero > 0:
        periods[n_freq - n_zero :] = float("inf")
    return periods


def rope_rotate_interleaved(
    x: torch.Tensor,
    coords: torch.Tensor,
    head_dim: int,
    base: float = 100.0,
    p_zero: float = 0.125,
) -> torch.Tensor:
    """Apply 2D axial RoPE with interleaved channel pairs.

    x: (..., T, head_dim) (any leading dims, e.g. (B, H, T, Hd) or (T, Hd)).
    coords: (..., T, 2) holding (x, y); must broadcast against x's leading
    dims once a head axis is considered (pass (B, 1, T, 2) for (B, H, T, Hd)).

    Channels [0, Hd/2) carry x angles, [Hd/2, Hd) y angles. Within each half,
    pair m = (2m, 2m+1) uses frequency f = m: angle = 2*pi*coord / p_f, and
    (a, b) -> (a cos - b sin, b cos + a sin).
    """
    assert x.shape[-1] == head_dim
    periods = rope_periods(head_dim, base, p_zero).to(torch.float64)  # (Hd/4,)
    inv = torch.where(torch.isinf(periods), torch.zeros_like(periods), 1.0 / periods)
    c = coords.to(torch.float64)
    # angles per axis: (..., T, Hd/4)
    ang_x = 2.0 * math.pi * c[..., 0:1] * inv
    ang_y = 2.0 * math.pi * c[..., 1:2] * inv
    ang = torch.cat([ang_x, ang_y], dim=-1)  # (..., T, Hd/2): one angle per pair
    cos = torch.cos(ang).to(x.dtype)
    sin = torch.sin(ang).to(x.dtype)

    a = x[..., 0::2]  # first element of each pair, (..., T, Hd/2)
    b = x[..., 1::2]  # second element of each pair
    ra = a * cos - b * sin
    rb = b * cos + a * sin
    out = torch.stack([ra, rb], dim=-1).reshape(x.shape)
    return out


# --------------------------------------------------------------------------- #
# helpers
# --------------------------------------------------------------------------- #
def patch_coords(hp: int, wp: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """(Hp*Wp, 2) coordinates (x, y), row-major: x=(j+.5)/Wp*2-1, y=(i+.5)/Hp*2-1."""
    rows = []
    for i in range(hp):
        for j in range(wp):
            rows.append([(j + 0.5) / wp * 2 - 1, (i + 0.5) / hp * 2 - 1])
    return torch.tensor(rows, device=device, dtype=dtype)


def strip_reference_prefixes(state_dict: dict) -> dict:
    """Remove leading ``module.`` and ``student.`` prefixes (in any order / repeats)."""
    out = {}
    for k, v in state_dict.items():
        changed = True
        while changed:
            changed = False
            for p in ("module.", "student."):
                if k.startswith(p):
                    k = k[len(p) :]
                    changed = True
        out[k] = v
    return out


# --------------------------------------------------------------------------- #
# model
# --------------------------------------------------------------------------- #
class _PatchEmbed(nn.Module):
    def __init__(self, in_channels: int, hidden_dim: int, patch_size: int):
        super().__init__()
        self.proj = nn.Conv2d(in_channels, hidden_dim, kernel_size=patch_size, stride=patch_size, bias=True)


class _Attention(nn.Module):
    def __init__(self, hidden_dim: int):
        super().__init__()
        self.q_proj = nn.Linear(hidden_dim, hidden_dim, bias=True)
        self.k_proj = nn.Linear(hidden_dim, hidden_dim, bias=True)
        self.v_proj = nn.Linear(hidden_dim, hidden_dim, bias=True)
        self.out_proj = nn.Linear(hidden_dim, hidden_dim, bias=True)


class _Block(nn.Module):
    def __init__(self, hidden_dim: int, mlp_hidden: int, eps: float):
        super().__init__()
        self.norm_attn = nn.LayerNorm(hidden_dim, eps=eps)
        self.attn = _Attention(hidden_dim)
        self.norm_ffn = nn.LayerNorm(hidden_dim, eps=eps)
        self.fc1 = nn.Linear(hidden_dim, 2 * mlp_hidden, bias=True)
        self.fc2 = nn.Linear(mlp_hidden, hidden_dim, bias=True)


class ReferenceVeca(nn.Module):
    def __init__(
        self,
        hidden_dim: int,
        num_heads: int,
        num_layers: int,
        mlp_hidden: int,
        num_query_tokens: int,
        chunk_size: int = 8,
        patch_size: int = 16,
        in_channels: int = 3,
        rope_base: float = 100.0,
        rope_p_zero_freqs: float = 0.125,
        eps: float = 1e-5,
    ):
        super().__init__()
        assert hidden_dim % num_heads == 0
        assert num_query_tokens % chunk_size == 0
        self.hidden_dim = hidden_dim
        self.num_heads = num_heads
        self.head_dim = hidden_dim // num_heads
        self.num_layers = num_layers
        self.mlp_hidden = mlp_hidden
        self.num_query_tokens = num_query_tokens
        self.chunk_size = chunk_size
        self.patch_size = patch_size
        self.rope_base = rope_base
        self.rope_p_zero_freqs = rope_p_zero_freqs
        self.eps = eps

        n_chunks = num_query_tokens // chunk_size
        self.patch_embed = _PatchEmbed(in_channels, hidden_dim, patch_size)
        self.query_token_chunks = nn.ParameterList(
            [nn.Parameter(torch.randn(1, chunk_size, hidden_dim) / math.sqrt(hidden_dim)) for _ in range(n_chunks)]
        )
        self.qcoord_chunks = nn.ParameterList([nn.Parameter(torch.zeros(1, chunk_size, 2)) for _ in range(n_chunks)])
        self.pos_linears = nn.ModuleList([nn.Linear(hidden_dim, 2, bias=True) for _ in range(num_layers - 1)])
        self.pos_alpha = nn.Parameter(torch.full((num_layers - 1,), 0.01))
        self.blocks = nn.ModuleList([_Block(hidden_dim, mlp_hidden, eps) for _ in range(num_layers)])
        self.final_norm = nn.LayerNorm(hidden_dim, eps=eps)

    @classmethod
    def from_checkpoint_config(cls, cfg: dict) -> ReferenceVeca:
        chunk = cfg.get("nested_chunk_size", cfg.get("matryoshka_chunk_size", 8))
        return cls(
            hidden_dim=cfg["hidden_dim"],
            num_heads=cfg["num_heads"],
            num_layers=cfg["num_layers"],
            mlp_hidden=int(cfg["hidden_dim"] * cfg["mlp_ratio"]),
            num_query_tokens=cfg["num_query_tokens"],
            chunk_size=chunk,
            patch_size=cfg.get("patch_size", 16),
            in_channels=cfg.get("in_channels", 3),
            rope_p_zero_freqs=cfg.get("rope_p_zero_freqs", 0.125),
        )

    # -- pieces ------------------------------------------------------------- #
    def _rope(self, t: torch.Tensor, coords: torch.Tensor) -> torch.Tensor:
        # t: (B, H, T, Hd); coords: (B, T, 2)
        return rope_rotate_interleaved(
            t, coords[:, None, :, :], self.head_dim, base=self.rope_base, p_zero=self.rope_p_zero_freqs
        )

    def _attention(self, blk: _Block, h: torch.Tensor, coords: torch.Tensor, num_cores: int) -> torch.Tensor:
        B, T, D = h.shape
        H, Hd = self.num_heads, self.head_dim
        q = blk.attn.q_proj(h).reshape(B, T, H, Hd).transpose(1, 2)  # (B, H, T, Hd)
        k = blk.attn.k_proj(h).reshape(B, T, H, Hd).transpose(1, 2)
        v = blk.attn.v_proj(h).reshape(B, T, H, Hd).transpose(1, 2)
        q = self._rope(q, coords)
        k = self._rope(k, coords)

        scores = (q @ k.transpose(-1, -2)) / math.sqrt(Hd)  # (B, H, T, T)
        # mask: patch rows (>= C) may only see core columns (< C)
        mask = torch.zeros(T, T, dtype=scores.dtype, device=scores.device)
        mask[num_cores:, num_cores:] = float("-inf")
        scores = scores + mask
        probs = torch.softmax(scores, dim=-1)
        o = probs @ v  # (B, H, T, Hd)
        o = o.transpose(1, 2).reshape(B, T, D)
        return blk.attn.out_proj(o)

    @staticmethod
    def _mlp(blk: _Block, h: torch.Tensor) -> torch.Tensor:
        z = blk.fc1(h)
        hidden = z.shape[-1] // 2
        u = z[..., :hidden]
        g = z[..., hidden:]
        return blk.fc2(F.silu(u) * g)

    # -- forward ------------------------------------------------------------ #
    def forward(self, pixel_values: torch.Tensor, num_cores: int):
        C = int(num_cores)
        if C % self.chunk_size != 0 or not (self.chunk_size <= C <= self.num_query_tokens):
            raise ValueError(f"num_cores={C} invalid")
        B = pixel_values.shape[0]

        feat = self.patch_embed.proj(pixel_values)  # (B, D, Hp, Wp)
        _, D, Hp, Wp = feat.shape
        patches = feat.flatten(2).transpose(1, 2)  # (B, N, D), row-major
        N = Hp * Wp

        cores = torch.cat(list(self.query_token_chunks), dim=1)[:, :C]  # (1, C, D)
        rho = torch.cat(list(self.qcoord_chunks), dim=1)[:, :C]  # (1, C, 2)
        cores = cores.expand(B, C, D)
        rho = rho.expand(B, C, 2)

        x = torch.cat([cores, patches], dim=1)  # (B, C+N, D)
        pcoords = patch_coords(Hp, Wp, device=x.device, dtype=x.dtype)[None].expand(B, N, 2)

        for layer, blk in enumerate(self.blocks):
            if layer > 0:
                r = x[:, :C]  # residual stream, before any norm
                rho = rho + self.pos_alpha[layer - 1] * self.pos_linears[layer - 1](r)
            u = torch.tanh(rho)
            coords = torch.cat([u, pcoords], dim=1)  # (B, C+N, 2)

            x = x + self._attention(blk, blk.norm_attn(x), coords, C)
            x = x + self._mlp(blk, blk.norm_ffn(x))

        x = self.final_norm(x)
        return x[:, 0], x[:, C:], x
