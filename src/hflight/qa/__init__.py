"""Extractive question answering (MRC) on top of the hflight facade."""
