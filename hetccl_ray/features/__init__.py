"""Training features over a group: balanced shares, the bridge between modules, weight sync."""
