"""The bench, the plan printer and the local clusters (simulated islands, shaped links) they run on."""
