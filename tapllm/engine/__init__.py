"""The engine: requests, scheduling, KV blocks, model execution and sampling."""
