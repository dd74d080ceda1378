"""Where things are, for tests and the helpers they start as child processes.

``REPO`` is the repository root (the package, examples, README), ``SUPPORT`` this
directory of shared test helpers (put on ``sys.path`` by ``pytest``'s ``pythonpath``
and handed to child processes), ``TESTS`` the directory of the test wings.
"""

import os

SUPPORT = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(SUPPORT)
REPO = os.path.dirname(TESTS)
