"""Small helpers any part of tapllm may import: atomic files, option dataclasses from dicts, text
checks, the version, the dtypes by name, what the CPU supports, and connecting to Ray.
Imports nothing else of tapllm."""
