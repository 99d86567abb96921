"""The build half: what a device's queue should hold (``plan``), the reads it plans from, and writing it (``build``); the agenda and the widget feed read the same plan."""
