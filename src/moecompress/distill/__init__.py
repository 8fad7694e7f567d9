"""MoE → dense students and knowledge distillation from the MoE teacher (HF Trainer / accelerate).

`export_dense` writes the dense student of a MoE checkpoint (`dense_export.py`); `distill` trains it
against the frozen MoE teacher (`trainer.py`, objectives in `kd.py`).
"""

from .dense_export import (
    DENSE_TARGETS,
    StudentTarget,
    build_student,
    export_dense,
    save_student,
    student_target,
)
from .kd import LOSSES, ExpandedMoEBlock, expanded_teacher, hidden_mse, kd_loss
from .trainer import DistillConfig, DistillResult, distill, plot_curve

__all__ = [
    "DENSE_TARGETS",
    "LOSSES",
    "DistillConfig",
    "DistillResult",
    "ExpandedMoEBlock",
    "StudentTarget",
    "build_student",
    "distill",
    "expanded_teacher",
    "export_dense",
    "hidden_mse",
    "kd_loss",
    "plot_curve",
    "save_student",
    "student_target",
]
