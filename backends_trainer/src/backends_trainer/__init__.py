"""The trainer's half of a weight update."""
