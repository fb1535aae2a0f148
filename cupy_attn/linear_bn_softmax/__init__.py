"""Linear → BatchNorm1d → scale → softmax(dim=1) as one operation: api (entry point), checks, launch (kernels)."""
from .api import linear_batchnorm_softmax

__all__ = ["linear_batchnorm_softmax"]
