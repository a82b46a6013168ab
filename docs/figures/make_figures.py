"""Draws docs/figures/token_layout.png: VECA's initial core positions and its block-sparse attention pattern.

    pip install matplotlib
    python docs/figures/make_figures.py

Left: the patch centres of a 256 x 256 image (16 x 16 grid, normalised to [-1, 1]^2) and the 64 initial core
positions `tanh(rho)` from `farthest_point_core_coordinates` (seed 0), coloured by chunk of 8. Every budget is a
prefix, so C = 8 uses the first chunk only, C = 16 the first two, C = 64 all eight.
Right: block 1's attention map (head 0) of a real tiny random `VecaModel` at C = 8 on a 64 x 64 image (N = 16
patches), as returned by `output_attentions=True`. Entries that are exactly zero are drawn in grey.
"""

from pathlib import Path

import matplotlib


matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from veca_hf import VecaConfig, VecaModel  # noqa: E402
from veca_hf.model.modeling_veca import farthest_point_core_coordinates, get_patch_coordinates  # noqa: E402


OUTPUT = Path(__file__).with_name("token_layout.png")


def draw_core_positions(ax) -> None:
    grid = 16  # a 256 x 256 image
    patches = get_patch_coordinates(grid, grid, torch.float32, torch.device("cpu")).numpy()  # (N, 2)
    rho = farthest_point_core_coordinates(64, 1000, 0.95, generator=torch.Generator().manual_seed(0))  # (M, 2)
    cores = rho.tanh().numpy()

    for edge in np.linspace(-1, 1, grid + 1):
        ax.axhline(edge, color="0.88", lw=0.6, zorder=0)
        ax.axvline(edge, color="0.88", lw=0.6, zorder=0)
    ax.scatter(patches[:, 0], patches[:, 1], s=4, color="0.6", zorder=1, label="patch centres (16 x 16)")

    colours = plt.get_cmap("tab10")(range(8))
    for chunk in range(8):
        points = cores[8 * chunk : 8 * chunk + 8]
        size = 80 if chunk == 0 else 50 if chunk == 1 else 25
        budget = {0: "  (C = 8)", 1: "  (C = 16)", 7: "  (C = 64)"}.get(chunk, "")
        ax.scatter(
            points[:, 0],
            points[:, 1],
            s=size,
            color=colours[chunk],
            edgecolor="black",
            linewidth=0.5,
            zorder=3,
            label=f"cores {8 * chunk + 1}-{8 * chunk + 8}{budget}",
        )
    for index in range(8):  # number the first chunk
        ax.annotate(str(index + 1), cores[index], xytext=(4, 4), textcoords="offset points", fontsize=8, zorder=4)

    ax.set_xlim(-1, 1)
    ax.set_ylim(1, -1)  # image convention: row 0 (y = -1) at the top
    ax.set_aspect("equal")
    ax.set_xlabel("x")
    ax.set_ylabel("y")
    ax.set_title("Initial core positions (farthest-point, seed 0)\ncoloured by chunk; every budget is a prefix")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7.5, frameon=False)


def draw_attention_pattern(fig, ax) -> None:
    torch.manual_seed(0)
    # NOTE: a larger init range than the default 0.02 only makes the random model's attention less uniform.
    config = VecaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=170,
        core_bank_size=16,
        initializer_range=0.3,
    )
    model = VecaModel(config).eval()
    num_cores = 8
    with torch.no_grad():
        outputs = model(torch.randn(1, 3, 64, 64), num_core_tokens=num_cores, output_attentions=True)
    attention = outputs.attentions[0][0, 0].numpy()  # (T, T), T = 8 + 16
    num_tokens = attention.shape[0]
    assert np.all(attention[num_cores:, num_cores:] == 0)  # the patch-patch block is exactly zero
    assert np.all(attention[:num_cores] > 0) and np.all(attention[:, :num_cores] > 0)  # nothing else is (grey = 0)

    cmap = plt.get_cmap("viridis").copy()
    cmap.set_bad("0.88")
    image = ax.imshow(np.ma.masked_equal(attention, 0.0), cmap=cmap, vmin=0, interpolation="nearest")
    ax.axhline(num_cores - 0.5, color="tab:red", lw=1.5)
    ax.axvline(num_cores - 0.5, color="tab:red", lw=1.5)

    centre_cores, centre_patches = (num_cores - 1) / 2, num_cores + (num_tokens - num_cores - 1) / 2
    ax.text(
        centre_patches,
        centre_patches,
        "patch -> patch\nexactly 0\n(never computed)",
        ha="center",
        va="center",
        fontsize=9,
        color="0.25",
    )
    ax.set_xticks([centre_cores, centre_patches], [f"cores 1-{num_cores}", "patches (0,0) ... (3,3), row-major"])
    ax.set_yticks(
        [centre_cores, centre_patches],
        [f"cores 1-{num_cores}\ncall 1: over\nall C + N keys", "patches\ncall 2: over\nthe C cores only"],
        fontsize=8.5,
    )
    ax.set_xlabel("keys")
    ax.set_ylabel("queries")
    ax.set_title("Block-sparse attention, C = 8, N = 16\n(tiny random model, block 1, head 0)")
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04, label="attention weight")


def main() -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.6), gridspec_kw={"width_ratios": [1.25, 1]})
    draw_core_positions(left)
    draw_attention_pattern(fig, right)
    fig.tight_layout()
    fig.savefig(OUTPUT, dpi=130)
    print(f"wrote {OUTPUT}")


if __name__ == "__main__":
    main()
