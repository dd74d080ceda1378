"""One pytree: save, restore, staging and commit, removal, verify."""
