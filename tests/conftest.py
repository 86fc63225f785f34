"""Suite-wide settings. Tests run two workers on two cores (pytest -n 2), often beside server
processes they start: one torch/OpenMP thread per process keeps them from fighting over cores
(tiny models lose far more to thread synchronisation than they gain)."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
