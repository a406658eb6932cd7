"""berth: a small inference control plane for GPU hosts."""

__version__ = "0.1.0"
