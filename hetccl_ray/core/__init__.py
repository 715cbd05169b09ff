"""The pure core: topology, op kinds, the Op record, the plan IR and its builders, the planner. Imports no Ray."""
