"""Linear → BatchNorm1d → scale → softmax(dim=1) as one operation: api (entry point), checks, launch (forward
kernels), backward (backward kernels and GEMMs), autograd (torch.autograd glue)."""
from .api import linear_batchnorm_softmax

__all__ = ["linear_batchnorm_softmax"]
