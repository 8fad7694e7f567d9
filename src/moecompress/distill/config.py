"""The settings of a distillation run (`DistillConfig`) and what it returns (`DistillResult`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class DistillConfig(BaseModel):
    """Settings of one distillation run (CLI flags map 1:1)."""

    model_config = ConfigDict(extra="forbid")

    tokens: int = Field(..., ge=1, description="training tokens (sets the number of optimizer steps)")
    loss: Literal["forward_kl", "reverse_kl", "kl_hidden"] = "forward_kl"
    temperature: float = Field(1.0, gt=0)
    hidden_weight: float = Field(1.0, ge=0)  # λ of the hidden-state MSE (loss kl_hidden)
    expanded_top_k: int | None = Field(None, ge=1)  # teacher routes to k' experts
    seq_len: int = Field(256, ge=2)
    batch_size: int = Field(8, ge=1)  # per device
    grad_accum: int = Field(1, ge=1)
    lr: float = Field(1e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup: float = Field(0.05, ge=0)  # steps, or a fraction of the run when < 1
    scheduler: str = "cosine"
    max_grad_norm: float = 1.0
    bf16: bool = False
    gradient_checkpointing: bool = False
    eval_every: int = Field(50, ge=1)  # optimizer steps between validations
    save_every: int = Field(50, ge=1)  # optimizer steps between checkpoints
    save_limit: int = Field(2, ge=1)
    val_fraction: float = Field(
        0.05, gt=0, lt=1
    )  # held out from the training text when no eval data is given
    val_tokens: int | None = Field(None, ge=2)  # cap on validation tokens
    seed: int = Field(0, ge=0, le=2**32 - 1)  # numpy's seed range
    log_every: int = Field(10, ge=1)


@dataclass
class DistillResult:
    student_dir: Path
    curve: Path
    report: Path
    metrics: dict
