"""Backend test packages (packages, so same-named test modules of different backends do not collide)."""
