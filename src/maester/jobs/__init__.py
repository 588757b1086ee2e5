"""Job directories and launchers."""
