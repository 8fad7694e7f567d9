"""`DistillTrainer`: a `transformers.Trainer` whose loss is the KD objective against a frozen teacher (`kd.py`),
and its validation (KD objective, KL, student perplexity; the teacher's perplexity for the curve)."""

from __future__ import annotations

import math

import torch

from .config import DistillConfig
from .kd import expanded_teacher, hidden_mse, kd_loss
from .shard import place_teacher


def trainer_class():
    """The `DistillTrainer` class (defined on first use: importing transformers is slow)."""
    from transformers import Trainer

    class DistillTrainer(Trainer):
        """Trainer whose loss is the KD objective against a frozen teacher (see kd.py)."""

        def __init__(self, *args, teacher, kd: DistillConfig, **kwargs):
            super().__init__(*args, **kwargs)
            self.kd = kd
            # replicated on each device, or sharded like the student under FSDP2 / ZeRO-3 (shard.py)
            self.teacher = place_teacher(teacher, self.accelerator, self.args.device, kd.expanded_top_k)

        def _teacher_out(self, ids, hidden: bool):
            with torch.no_grad(), expanded_teacher(self.teacher, self.kd.expanded_top_k):
                return self.teacher(input_ids=ids, output_hidden_states=hidden, use_cache=False)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            ids = inputs["input_ids"]
            hidden = self.kd.loss == "kl_hidden"
            t = self._teacher_out(ids, hidden)
            s = model(input_ids=ids, output_hidden_states=hidden, use_cache=False)
            kind = "reverse_kl" if self.kd.loss == "reverse_kl" else "forward_kl"
            loss = kd_loss(s.logits, t.logits, kind, self.kd.temperature)
            if hidden:
                loss = loss + self.kd.hidden_weight * hidden_mse(s.hidden_states, t.hidden_states)
            return (loss, s) if return_outputs else loss

        @torch.no_grad()
        def evaluate(
            self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"
        ) -> dict[str, float]:
            """Validation: KD objective, forward KL(teacher ‖ student) at T=1, student CE and perplexity."""
            data = eval_dataset if eval_dataset is not None else self.eval_dataset
            model = self.model_wrapped if self.model_wrapped is not None else self.model
            was_training = model.training
            model.eval()
            tot, n_tok = _validation_sums(self, model, data)
            if was_training:
                model.train()
            metrics = {f"{metric_key_prefix}_{k}": v / max(n_tok, 1) for k, v in tot.items()}
            metrics[f"{metric_key_prefix}_ppl"] = math.exp(min(metrics[f"{metric_key_prefix}_ce"], 50.0))
            self.log(metrics)
            self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
            return metrics

    return DistillTrainer


def _validation_sums(trainer, model, data) -> tuple[dict[str, float], int]:
    """Token-weighted sums over the validation blocks `data` of the KD objective ("loss"), the forward KL at
    T=1 ("kl") and the student's cross-entropy ("ce"), and the number of tokens."""
    tot = {"loss": 0.0, "kl": 0.0, "ce": 0.0}
    n_tok = 0
    bs = trainer.args.per_device_eval_batch_size
    kd = trainer.kd
    hidden = kd.loss == "kl_hidden"
    for b in range(0, len(data), bs):
        ids = torch.stack([data[j]["input_ids"] for j in range(b, min(b + bs, len(data)))]).to(
            trainer.args.device
        )
        with trainer.compute_loss_context_manager():
            t = trainer._teacher_out(ids, hidden)
            s = model(input_ids=ids, output_hidden_states=hidden, use_cache=False)
        kind = "reverse_kl" if kd.loss == "reverse_kl" else "forward_kl"
        loss = kd_loss(s.logits, t.logits, kind, kd.temperature)
        if hidden:
            loss = loss + kd.hidden_weight * hidden_mse(s.hidden_states, t.hidden_states)
        m = ids.numel()
        tot["loss"] += float(loss) * m
        tot["kl"] += float(kd_loss(s.logits, t.logits, "forward_kl", 1.0)) * m
        logp = torch.log_softmax(s.logits[:, :-1].float(), -1)
        ce = -logp.gather(-1, ids[:, 1:, None]).mean()
        tot["ce"] += float(ce) * m
        n_tok += m
    return tot, n_tok


def teacher_ppl(trainer, data) -> float:
    """Teacher perplexity on the validation blocks (reference line of the curve)."""
    ce, n = 0.0, 0
    with torch.no_grad():
        for b in range(0, len(data), 4):
            ids = torch.stack([data[j]["input_ids"] for j in range(b, min(b + 4, len(data)))]).to(
                trainer.args.device
            )
            t = trainer._teacher_out(ids, False)
            logp = torch.log_softmax(t.logits[:, :-1].float(), -1)
            ce += float(-logp.gather(-1, ids[:, 1:, None]).mean()) * ids.numel()
            n += ids.numel()
    return math.exp(ce / max(n, 1))
