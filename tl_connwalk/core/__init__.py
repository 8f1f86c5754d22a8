"""The math core: pure functions on tensors, one module per section of the spec (docs/spec.md).

It knows no model class.
"""
