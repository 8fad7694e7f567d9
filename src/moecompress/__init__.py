"""moecompress: compress trained Mixture-of-Experts language models after training."""

from .errors import MoECompressError
from .models import MoEAdapter, RouterSpec, load_model

__version__ = "0.1.0"

__all__ = ["MoEAdapter", "MoECompressError", "RouterSpec", "__version__", "load_model"]
