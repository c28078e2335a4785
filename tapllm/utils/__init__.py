"""Small helpers any part of tapllm may import: atomic files, option dataclasses from dicts, text
checks, the version, the dtypes by name, and what the CPU supports. Imports nothing else of tapllm."""
