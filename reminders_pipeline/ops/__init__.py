"""The chores and checks an operator runs beside the two halves: ``reminders check`` and retention."""
