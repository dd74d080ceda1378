"""Two tiers: a manager's local directory of steps, replicated to a persistent one
(:class:`PersistentTier`, ``tier.py``; the design: ``docs/tiers.md``)."""

from .tier import PersistentTier

__all__ = ["PersistentTier"]
