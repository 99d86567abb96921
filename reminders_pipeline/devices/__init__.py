"""A device: its registration and credential, and what its person does with a sent alert (Snooze, Done)."""
