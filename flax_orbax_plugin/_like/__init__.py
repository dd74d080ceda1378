"""What the caller asked for: cast rules, placing data onto a ``like``."""
