"""KV tiers below the device pool (docs/architecture.md, "The KV pool and its tiers"): the core's
side. `index.py` is one tier's bookkeeping (which keys it holds, LRU, capacity); `manager.py`
decides what goes down and what comes back up, and drives the workers' data plane
(`worker/kv_offload.py`)."""
