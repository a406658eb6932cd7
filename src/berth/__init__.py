"""berth: a small inference control plane for GPU hosts."""

__version__ = "0.2.0"
