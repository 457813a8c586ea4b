"""Policies (schema, loader), the pure decision engine and node history."""
