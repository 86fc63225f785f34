"""The workers: the executor and its worker ranks (worker, rpc, parallel_state), the model runner,
models, layers, attention backends, sampling and CUDA graphs."""
