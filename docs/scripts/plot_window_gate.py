"""Draw the dynamic-window gate G(x) for a few sigma (docs figure).

Run by ``docs/conf.py`` at build time; also usable by hand::

    python docs/scripts/plot_window_gate.py OUTDIR

The curves are evaluated by the float64 oracle itself, not re-implemented:
for a single query row (N = 1) the gate of key ``j`` is read off
``elastic_np.reference.attention`` with ``q = 0`` and ``v`` the identity, so
that ``out[j] = G_j / sum_j G_j``.
"""

import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

import elastic_np as enp  # noqa: E402

SIGMAS = (0.1, 0.25, 0.5, 1.0)
SHARPNESS = 1.0
THRESHOLD = 0.3
M = 401  # keys; with N = 1 the position is x_j = 2 (j - (M - 1)) / (M - 1) in [-2, 0]


def gate_curve(sigma, sharpness, threshold, M=M):
    """Return ``(x, G)`` for one query row, G evaluated through the oracle.

    ``out[j] = G_j / sum(G)``, so ``G`` is recovered up to one factor, which
    is fixed by the closed form of the gate at its centre (``x = 0``).
    """
    window = enp.DynamicWindow(sigma, sharpness=sharpness, threshold=threshold)
    q = np.zeros((1, 1, 1, 1))
    k = np.zeros((1, 1, M, 1))
    v = np.eye(M)[None, None]
    out, _ = enp.reference.attention(q, k, v, dynamic_window=window)
    weights = out[0, 0, 0]
    x = 2.0 * (np.arange(M) - (M - 1)) / (M - 1)
    f0 = 1.0 / (sigma * np.sqrt(2 * np.pi))
    G0 = np.tanh(sharpness * f0) if f0 > threshold else 0.0
    G = weights * (G0 / weights[-1]) if weights[-1] > 0 else weights
    return x, G


def main(outdir):
    os.makedirs(outdir, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), constrained_layout=True)
    for sigma in SIGMAS:
        x, G = gate_curve(sigma, SHARPNESS, 0.0)
        xx = np.concatenate([x, -x[::-1][1:]])  # the gate is even in x
        GG = np.concatenate([G, G[::-1][1:]])
        axes[0].plot(xx, GG, label=rf"$\sigma = {sigma}$")
        x, G = gate_curve(sigma, SHARPNESS, THRESHOLD)
        GG = np.concatenate([G, G[::-1][1:]])
        axes[1].plot(xx, GG, label=rf"$\sigma = {sigma}$")
    axes[0].set_title(f"sharpness = {SHARPNESS:g}, threshold = 0")
    axes[1].set_title(f"sharpness = {SHARPNESS:g}, threshold = {THRESHOLD:g}")
    for ax in axes:
        ax.set_xlabel(r"$x = 2\,(j - i - (M - N)) / (M - 1)$")
        ax.set_xlim(-2, 2)
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(r"gate $G = \tanh(\mathrm{sharpness}\cdot f')$")
    axes[1].legend(loc="upper right", fontsize="small")
    path = os.path.join(outdir, "window_gate.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    print(main(sys.argv[1] if len(sys.argv) > 1 else "."))
