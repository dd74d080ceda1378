"""`python -m flax_orbax_plugin ...` runs the flax-orbax command line."""

from flax_orbax_plugin.cli import main

raise SystemExit(main())
