"""An example third-party plugin for the GEM training framework."""

__version__ = "0.1.0"
