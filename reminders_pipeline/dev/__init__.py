"""The quick start and its tools: ``reminders dev``, the demo's web page, and ending every process a command started."""
