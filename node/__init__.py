"""The affinity serving node."""
