"""Format version 1 on disk: typed records, step names and listing, public metadata."""
