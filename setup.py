"""The one optional extension: a copy that computes the crc32c as it copies
(``flax_orbax_plugin/_zarr/_copycrc.c``). ``optional=True``: where it cannot be
built (no compiler, no Python headers) the package installs without it and copies
with numpy, then checksums with the ``crc32c`` package (``_zarr/crcs.py``).
Everything else is in setup.cfg."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "flax_orbax_plugin._zarr._copycrc",
            ["flax_orbax_plugin/_zarr/_copycrc.c"],
            optional=True,
        )
    ]
)
