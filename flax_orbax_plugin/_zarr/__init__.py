"""zarr3 chunk files and arrays: chunk geometry, names, checksums, direct I/O."""
