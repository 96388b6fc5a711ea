"""Trace recorder and cache-policy simulator (`hisparse sim`); runs the runtime's own resolve and policy code."""
