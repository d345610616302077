"""Kernels, one folder per operation: `reference.py` (torch), `kernel.py` (Triton, where one
exists) and the dispatcher in its `__init__`. `backend.py` says which runs. Imports nothing from
the rest of `ft`."""
