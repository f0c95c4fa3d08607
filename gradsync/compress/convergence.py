"""Does a compressor still train the model? A seeded teacher task, ``workers`` data-parallel workers
simulated in one process, the same steps and data with and without compression.

Task: inputs ``x ~ N(0, I_32)``, labels the argmax of a fixed random linear teacher with a 32-wide
bottleneck (10 classes; exact training reaches about 94 % held-out accuracy); the student is a 32-64-10 MLP trained with plain SGD (no momentum: DGC brings its own).
Each step, every worker computes its gradient on its own batch, compresses it with its own
compressor instance (as on a real rank: own residuals, own random streams, shared seeds where the
algorithm shares them), and the update is the mean of the decompressed gradients, as every
synchronization strategy computes it. Transport is left out on purpose: this measures what the
compression does to the optimization, not how fast bytes move. Reported: held-out loss and accuracy
after ``steps`` steps, and the loss curve.
"""
from __future__ import annotations

import math

from dataclasses import dataclass

import torch
from torch import nn

from gradsync.compress import build

INPUTS, HIDDEN, CLASSES = 32, 64, 10


@dataclass
class Task:
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor


def teacher_task(samples: int = 20_000, seed: int = 0) -> Task:
    gen = torch.Generator().manual_seed(seed)
    w1, w2 = torch.randn(INPUTS, 32, generator=gen), torch.randn(32, CLASSES, generator=gen)
    x = torch.randn(samples + 2000, INPUTS, generator=gen)
    y = (x @ w1 @ w2).argmax(dim=1)
    return Task(x[:samples], y[:samples], x[samples:], y[samples:])


def student(seed: int = 1) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(INPUTS, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))


def evaluate(model: nn.Module, task: Task) -> tuple[float, float]:
    with torch.no_grad():
        logits = model(task.test_x)
        return (float(nn.functional.cross_entropy(logits, task.test_y)),
                float((logits.argmax(dim=1) == task.test_y).float().mean()))


def train(spec: str | None, *, error_feedback: bool = False, workers: int = 4, steps: int = 600,
          batch_size: int = 32, lr: float = 0.3, task: Task | None = None, every: int = 10,
          **options) -> dict:
    """Train with compressor ``spec`` (None: exact averaging); final test loss, accuracy and curve."""
    task = task or teacher_task()
    model = student()
    names = [n for n, _ in model.named_parameters()]
    codecs = None if spec is None else [
        {n: build(spec, key=n, worker=w, error_feedback=error_feedback, **options) for n in names}
        for w in range(workers)]
    gen = torch.Generator().manual_seed(2)
    curve = []
    for step in range(steps):
        grads = []
        for w in range(workers):
            idx = torch.randint(0, len(task.train_x), (batch_size,), generator=gen)
            model.zero_grad()
            nn.functional.cross_entropy(model(task.train_x[idx]), task.train_y[idx]).backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        with torch.no_grad():
            for n, p in model.named_parameters():
                decoded = [g[n] if codecs is None else codecs[w][n].decompress(*codecs[w][n].compress(g[n]))
                           for w, g in enumerate(grads)]
                p -= lr * torch.stack(decoded).mean(dim=0)
        if step % every == 0 or step == steps - 1:
            curve.append((step, evaluate(model, task)[0]))
    loss, accuracy = evaluate(model, task)
    return {"compressor": spec or "none (exact)", "error_feedback": error_feedback, "options": options,
            "loss": loss, "accuracy": accuracy, "curve": curve}


# Compressors whose algorithm already keeps a residual (or momentum-corrected accumulator): another
# error-feedback wrapper around them would count the same error twice.
OWN_FEEDBACK = {"efsignsgd", "tbq", "graddrop", "dgc"}


YMAX = 5.0


def diverged(result: dict) -> bool:
    """Whether a run ended at or above :data:`YMAX`, or reached a loss that is not finite."""
    final, curve = result["loss"], [loss for _, loss in result["curve"]]
    return not (math.isfinite(final) and final < YMAX) or not all(map(math.isfinite, curve))


def plot(results: list[dict], path: str) -> None:
    """Held-out loss per step: without error feedback (left) and with it (right). Each compressor has
    one colour in both panels; a diverged run is drawn dotted, ends in an x, and says so."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["compressor"] for r in results if not r["compressor"].startswith("none")))
    palette = plt.cm.tab20.colors[0::2] + plt.cm.tab20.colors[1::2]  # ten distinct hues, then their light shades
    colour = {name: palette[i % len(palette)] for i, name in enumerate(names)}
    fig, axes = plt.subplots(1, 2, figsize=(15, 6), sharey=True)
    for ax, feedback in zip(axes, (False, True)):
        shown = [r for r in results if r["error_feedback"] == feedback or r["compressor"].startswith("none")]
        for r in shown:
            steps, losses = zip(*r["curve"])
            exact, failed = r["compressor"].startswith("none"), diverged(r)
            label = r["compressor"] + (" (diverged)" if failed else "")
            clipped = [min(loss, YMAX) if math.isfinite(loss) else YMAX for loss in losses]
            ax.plot(steps, clipped, label=label, lw=3 if exact else 1.2, linestyle=":" if failed else "-",
                    color="black" if exact else colour[r["compressor"]])
            if failed:
                ax.plot(steps[-1], clipped[-1], marker="x", markersize=9, color=colour[r["compressor"]])
        ax.set_title("with error feedback" if feedback else "without error feedback (built-in residuals kept)")
        ax.set_xlabel("step")
        ax.set_yscale("log")
        ax.set_ylim(0.1, YMAX * 1.1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=1, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    axes[0].set_ylabel("held-out cross-entropy (clipped at %g)" % YMAX)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
