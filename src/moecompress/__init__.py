"""moecompress: compress trained Mixture-of-Experts language models after training."""

from .errors import MoECompressError
from .models import MoEAdapter, RouterSpec, load_model
from .plan import CompressionPlan, PlanTensors  # plan / runtime / export API (issue 4)
from .api import apply_plan, export, load  # noqa: E402  (moecompress.export is also the callable subpackage)

from ._version import __version__  # noqa: E402

__all__ = ["MoEAdapter", "MoECompressError", "RouterSpec", "__version__", "load_model"]
__all__ += ["CompressionPlan", "PlanTensors", "apply_plan", "export", "load"]
