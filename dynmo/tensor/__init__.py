"""Sparse tensors: their features (FeaTensor's whole set, exact) and tensors made from text.

Pure numpy; importing this package imports no torch. The API:

    from dynmo.tensor import read_tns, features, as_tensor
    t = read_tns("nell-2.tns")                  # or as_tensor(sparse.COO / scipy.sparse / ndarray)
    f = features(t)                             # TensorFeatures: .to_dict(), .of("nnz_per_fiber")
"""

from dynmo.tensor.coo import SparseTensor, TensorError, as_tensor, from_coo
from dynmo.tensor.features import STATS, DuplicateError, TensorFeatures, distribution_stats, features
from dynmo.tensor.tns import TensorFileError, read_tns, write_tns

__all__ = ["SparseTensor", "TensorError", "as_tensor", "from_coo", "STATS", "DuplicateError", "TensorFeatures",
           "distribution_stats", "features", "TensorFileError", "read_tns", "write_tns"]
