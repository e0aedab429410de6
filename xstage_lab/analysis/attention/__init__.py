"""What is read of the attention records (§4.3): the model of Table 3 (eqs. 17–20, ``model``) and the design test on the measured tiles (``trace``)."""
