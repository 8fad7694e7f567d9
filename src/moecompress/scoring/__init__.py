"""Expert scoring (functions of statistics) and budgets (how many to keep where)."""

from .budget import group_feasible, nonuniform_keep, num_kept, rank, uniform_keep
from .criteria import acp, cp, ean, frequency, mone, pp, ps, random_scores, reap, routing_mass, super_experts
from .doptimal import default_ridge, doptimal_kernel, greedy_doptimal, logdet_objective

__all__ = [
    "acp",
    "cp",
    "default_ridge",
    "doptimal_kernel",
    "ean",
    "frequency",
    "greedy_doptimal",
    "group_feasible",
    "logdet_objective",
    "mone",
    "nonuniform_keep",
    "num_kept",
    "pp",
    "ps",
    "random_scores",
    "rank",
    "reap",
    "routing_mass",
    "super_experts",
    "uniform_keep",
]
