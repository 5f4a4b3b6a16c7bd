"""The scheduling simulator: the real engine loop and scheduler on a cost model and a simulated clock."""
