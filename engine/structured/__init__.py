"""Structured output: a request's output held to a JSON schema, any JSON object, a
regex, a choice among strings or a grammar, token by token.

Each kind of constraint becomes an llguidance grammar (constraint.py); a sequence's
Guide (guide.py) follows the tokens it accepts and says which tokens its next sample
may be, as a bitmask row. The engine fills those rows on the host while the device
runs the forward pass (on a thread of their own, while the engine's thread goes on),
and each backend applies them to the logits before sampling.
"""

from engine.structured.constraint import CONSTRAINT_KINDS, Constraint
from engine.structured.guide import (DEFAULT_MAX_GRAMMAR_BYTES, FillingMasks, Guide, GuideCompiler, accept_tokens,
                                     fill_masks, start_filling_masks)

__all__ = ["CONSTRAINT_KINDS", "DEFAULT_MAX_GRAMMAR_BYTES", "Constraint", "FillingMasks", "Guide", "GuideCompiler", "accept_tokens", "fill_masks",
           "start_filling_masks"]
