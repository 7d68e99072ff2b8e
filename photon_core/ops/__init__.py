"""Ops: one op per file, a torch reference beside its Triton kernel."""
