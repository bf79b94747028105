"""userdp: language-model training with user-level differential privacy."""

__version__ = "0.1.0"
