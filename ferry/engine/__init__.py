"""The one step loop, its clock and its outputs."""
