"""Pattern families, one file each: the pattern as plain PyTorch, its variants, its guard, its replacement."""
