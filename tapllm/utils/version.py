"""The package's version, in a leaf module any part of tapllm may import."""

__version__ = "0.1.0"
