"""Reading any checkpoint: restore with the foreign fallback, serving."""
