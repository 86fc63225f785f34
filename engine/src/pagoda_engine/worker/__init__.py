"""The workers: the executor and its worker ranks (worker, rpc, parallel_state), models and
layers, attention backends, sampling, CUDA graphs, compile-ahead and the KV tiers' data plane."""
