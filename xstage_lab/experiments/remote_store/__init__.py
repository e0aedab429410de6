"""Remote stores between two or more GPUs (paper §3): the Burst–Gap characterization and its
calibration (``characterization``), M_X per remote operation (``ops``) and per injection pattern
(``patterns``), and remote-visible completion seen from the receiver (``visibility``)."""
