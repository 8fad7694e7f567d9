"""moecompress: compress trained Mixture-of-Experts language models after training.

The Python API (`api.py`): `calibrate`, `compress`, `evaluate`, `compare`, `load`, `apply_plan`, `export`,
plus `load_model`, `MoEAdapter` and `CompressionPlan` (README, "Python").
"""

# first, on purpose: importing it makes the `moecompress` command exit cleanly on Ctrl-C / SIGTERM during the
# imports below, which take seconds (and does nothing in a program that imports moecompress as a library)
from . import _signals  # noqa: F401  # isort: skip
from ._version import __version__
from .errors import MoECompressError
from .models import MoEAdapter, RouterSpec, load_model
from .plan import CompressionPlan, PlanTensors  # plan / runtime / export API (issue 4)

# `calibrate`, `compare` and `export` are also the names of a subpackage, a module and a subpackage. Binding
# the functions here shadows those attributes: `moecompress.calibrate(...)` is the function, while
# `from moecompress.calibrate import StatsStore` and `import moecompress.calibrate.store` still find the
# subpackage (through sys.modules). api.py imports moecompress.calibrate and moecompress.compare first, so
# nothing rebinds them; moecompress.export is imported only when first used, which rebinds the attribute to
# the package, and the package forwards calls to `export` (export/__init__.py), so it works either way.
from .api import apply_plan, calibrate, compare, compress, evaluate, export, load  # isort: skip

__all__ = ["MoEAdapter", "MoECompressError", "RouterSpec", "__version__", "load_model"]
__all__ += [
    "CompressionPlan",
    "PlanTensors",
    "apply_plan",
    "calibrate",
    "compare",
    "compress",
    "evaluate",
    "export",
    "load",
]
