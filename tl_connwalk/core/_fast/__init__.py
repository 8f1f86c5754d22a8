"""The fast paths of the math core, private: the public modules of `tl_connwalk.core` read as
the formulas of the spec and call into these (chunk sizes, Gram tensors, per-edge closed
forms and their quartic forms by monomials, message Grams, the head Grams and random draws
kept per set of weights, the process-wide caches' stores). Nothing outside
``tl_connwalk.core`` imports them (`tl_connwalk.core.caches` gives the cached terms).
"""
