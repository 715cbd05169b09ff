"""Lossless compression of border traffic: byte planes (planes.py), framed chunks (frames.py),
and when to compress (policy.py). The border uses it; islands stay raw. Imports no Ray."""
