"""The compiled programs and the donated KV pool; backends.py (which implementation may run here), the
runtime tuner, the dense reference generator and step profiling."""
