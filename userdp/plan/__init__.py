"""``userdp plan``: the group size and cohort of ULS for a compute budget (Estimate-and-Double)."""
