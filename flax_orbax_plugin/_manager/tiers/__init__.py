"""Two tiers: a manager's local directory of steps, replicated to a persistent one.

:class:`PersistentTier` (``tier.py``) is the façade the manager calls; its
collaborators are the collective open (``opening.py``), the files of a step
(``files.py``), the rounds of several processes (``rounds.py``), the replicator
thread (``replicator.py``), the copy down on restore (``copy_down.py``), the
damaged-step records (``damaged.py``) and their shared state (``state.py``).
The design: ``docs/tiers.md``.
"""

from .tier import PersistentTier

__all__ = ["PersistentTier"]
