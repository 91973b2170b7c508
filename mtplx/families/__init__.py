"""One adapter per model family; importing a module registers it."""
