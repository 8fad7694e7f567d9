"""MoE → dense students and knowledge distillation from the MoE teacher (HF Trainer / accelerate).

`export_dense` writes the dense student of a MoE checkpoint (`dense_export.py`, built by `student.py`); `distill` trains it
against the frozen MoE teacher (`trainer.py`, objectives in `kd.py`).
"""

from .config import DistillConfig, DistillResult
from .curve import plot_curve
from .dense_export import export_dense, save_student
from .kd import LOSSES, ExpandedMoEBlock, expanded_teacher, hidden_mse, kd_loss
from .student import build_student
from .student_config import DENSE_TARGETS, StudentTarget, student_target
from .trainer import distill

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
