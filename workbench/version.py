"""The package version (a leaf module: the CLI reads it without importing the whole package)."""

__version__ = "0.1.0"
