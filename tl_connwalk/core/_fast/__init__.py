"""The fast paths of the math core, private: the public modules of `tl_connwalk.core` read as
the formulas of the spec and call into these (chunk sizes, Gram tensors, per-edge closed
forms, message Grams, the process-wide caches' stores). Nothing outside ``tl_connwalk.core``
imports them.
"""
