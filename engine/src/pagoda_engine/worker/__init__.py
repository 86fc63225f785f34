"""The workers: the executor and its worker processes, the model runner, models, layers, attention backends, sampling and CUDA graphs."""
