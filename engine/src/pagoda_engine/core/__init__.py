"""The engine core process: the core loop, the scheduler, the KV page manager and the engine-side request."""
