"""numba kernels: arrays and scalars in, arrays out.

No I/O, no pyarrow, no torch, no random-number generation: permutations come in as
arguments. Import the submodules directly (``from batchplan.kernels.pack import ...``);
this package imports nothing so that ``import batchplan`` stays free of numba.
"""
