"""Two tiers: a manager's local directory of steps, replicated to a persistent one.

:class:`PersistentTier` (``tier.py``) is the façade the manager calls over its
collaborators. The design: ``docs/tiers.md``.
"""

from .tier import PersistentTier

__all__ = ["PersistentTier"]
