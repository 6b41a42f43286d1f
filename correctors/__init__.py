"""Off-policy correctors (IS, TIS, MIS, AIS) and mismatch metrics. Pure tensor math; torch only."""
