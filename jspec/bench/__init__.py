"""The benchmark lab: presets, timing, roofline, controlled acceptance, the HF peer, plots and the
``python -m jspec.bench`` CLI. It imports the library; the library never imports it."""
