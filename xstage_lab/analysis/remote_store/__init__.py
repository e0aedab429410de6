"""What is read of the remote-store records (§3): the characterization and its calibration, the visibility latencies, the fits beyond one pair and 16-byte stores, and their tables."""
