"""The validation curve of a distillation run (``curve.png``)."""

from __future__ import annotations

from pathlib import Path


def plot_curve(history: list[dict], path: Path, teacher_ppl: float | None = None, title: str = "") -> Path:
    """Validation curve: KD objective and KL(teacher ‖ student) (left), student perplexity (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ev: dict[int, dict] = {}
    for h in history:
        if "eval_loss" in h:
            ev[int(h["step"])] = h  # a resumed run may evaluate a step twice: keep the last
    train = [(int(h["step"]), h["loss"]) for h in history if "loss" in h and "eval_loss" not in h]
    steps = sorted(ev)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    if train:
        a.plot(*zip(*train), color="0.7", lw=1, label="train KD loss")
    a.plot(steps, [ev[s]["eval_loss"] for s in steps], "o-", color="C0", label="val KD loss")
    a.plot(steps, [ev[s]["eval_kl"] for s in steps], "s--", color="C1", label="val KL(teacher‖student), T=1")
    a.set_xlabel("optimizer step")
    a.set_ylabel("nats per token")
    a.set_title("distillation loss")
    a.legend()
    a.grid(alpha=0.3)
    b.plot(steps, [ev[s]["eval_ppl"] for s in steps], "o-", color="C2", label="student")
    if teacher_ppl is not None:
        b.axhline(teacher_ppl, color="k", ls=":", label=f"MoE teacher ({teacher_ppl:.2f})")
    b.set_xlabel("optimizer step")
    b.set_ylabel("validation perplexity")
    ppl = [ev[s]["eval_ppl"] for s in steps] + ([teacher_ppl] if teacher_ppl else [])
    if max(ppl) / max(min(ppl), 1e-9) > 5:  # log scale only when the curve spans a wide range
        from matplotlib.ticker import FuncFormatter

        b.set_yscale("log")
        b.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        # minor ticks labelled at 2·10^n, 3·10^n, 5·10^n only, so labels never crowd
        b.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:e}"[0] in "235" else ""))
    b.set_title("held-out perplexity")
    b.legend()
    b.grid(alpha=0.3, which="both")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
