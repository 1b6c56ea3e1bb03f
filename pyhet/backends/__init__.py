"""One module per device kind, all with the same small set of array operations.

numpy_ref  the readable reference (and the oracle of every test); written against an ``xp``
           module so that the CuPy backend reuses it on a GPU
cpu        the C++ core: packed GEMM, im2col, fused bias + ReLU + max-pool
cuda       CuPy, imported only when a ``gpu`` device is asked for
"""
