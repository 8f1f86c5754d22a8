"""The math core: pure functions on tensors, one module per SPEC section. Knows no model class."""
