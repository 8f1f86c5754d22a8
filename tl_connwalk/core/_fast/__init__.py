"""The fast paths of the math core, private: the public modules of `tl_connwalk.core` read as
the formulas of the spec and call into these (chunked edges, quartic forms, Gram tensors,
messages, random draws, the process-wide caches). Nothing outside ``tl_connwalk.core``
imports them.
"""
