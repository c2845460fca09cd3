"""Discrete-event cluster simulator that drives the engine's own scheduler and KV manager."""
